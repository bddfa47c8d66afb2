"""Bringing boards up to date: job config, data set, model and weights, in the background.

A board that joined, reconnected or diverged is loaded concurrently with the others; the
step waits for the loads at most ``step_deadline_s``, so a board whose reply is lost
costs that board ``resync_timeout_s`` and a logged retry, not the others a stall.
"""

from __future__ import annotations

import asyncio
import functools
import zlib
from collections.abc import Callable
from typing import Any, Final

from qsched.daemon.engine.context import (
    Interrupted,
    JobContext,
    JobError,
    Outcome,
    log,
    refused,
)
from qsched.daemon.fleet import BoardFaultError, BoardSession
from qsched.protocol.identity import dataset_hash64, model_hash64
from qsched.protocol.messages import MAX_CHUNK, LoadModel, SelectDataset, SetWeights, job_config

__all__ = ["BoardSync"]

_MAX_BACKOFF_S: Final = 60.0
_WAIT_POLL_S: Final = 1.0  # how often a step waiting for boards looks again


class BoardSync:
    """Loads boards for one job and says when none can work.

    Args:
        ctx: the job's shared context.
    """

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self._blob = ctx.workload.model_blob()
        self._blob_hash = model_hash64(self._blob)
        # address -> (the board's Hello epoch, detail) of boards that refused the model
        self._model_refusals: dict[str, tuple[int, str]] = {}
        # Boards being loaded or resynchronised: a step waits for them only so long.
        self._syncing: dict[str, asyncio.Task[Outcome[None]]] = {}

    async def sync_boards(self) -> None:
        """Bring every board that needs it to the current step (concurrently, in the
        background): the step waits for them at most ``step_deadline_s``, so a board whose
        reply is lost does not hold up the others; it joins when its load is done.

        Raises:
            JobError: every board that could work refused the model (SPEC 9.2).
        """
        now = asyncio.get_running_loop().time()
        todo = [
            s
            for s in self.ctx.fleet.boards()
            if self._needs_sync(s) and s.retry_at <= now and s.address not in self._syncing
        ]
        started: list[asyncio.Task[Outcome[None]]] = []
        for session in todo:
            task = self.ctx.tasks.spawn(self._prepare(session), f"fleet[{session.address}].sync")
            self._syncing[session.address] = task
            task.add_done_callback(functools.partial(self._sync_done, session.address))
            started.append(task)
        if started:  # loads from earlier steps are not waited for again: they join when done
            done, _ = await asyncio.wait(started, timeout=self.ctx.config.step_deadline_s)
            for task in done:
                if not task.cancelled():
                    task.result().get()  # an unexpected error of a load surfaces here
        self._check_model_loadable()

    async def wait_for_workers(self) -> list[BoardSession]:
        """Sync boards until one can work; says so in the status while none can.

        Raises:
            Interrupted: a stop arrived while no board could work.
        """
        ctx = self.ctx
        announced = False
        while True:
            await self.sync_boards()
            workers = ctx.workers()
            if not workers and ctx.stopping.is_set():
                raise Interrupted
            if workers:
                if announced:
                    log.info("boards available again", job=ctx.spec.name, boards=len(workers))
                return workers
            if not announced:
                log.warning("no board available; waiting", job=ctx.spec.name, step=ctx.step)
                announced = True
            ctx.status_line = f"waiting for boards (step {ctx.step}/{ctx.spec.steps})"
            with ctx.at_safe_point():  # nothing of this step is applied yet
                await ctx.fleet.wait_changed(_WAIT_POLL_S)

    async def cancel(self) -> None:
        """The job ends: stop loads still in flight (their boards are resynchronised later)."""
        tasks = list(self._syncing.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _sync_done(self, address: str, _task: asyncio.Task[Outcome[None]]) -> None:
        self._syncing.pop(address, None)

    def _check_model_loadable(self) -> None:
        """SPEC 9.2: when every board that could work refused the model, the job fails."""
        candidates = [
            s for s in self.ctx.fleet.boards() if s.alive and s.hello is not None and not refused(s)
        ]
        refusals = [self._model_refusals.get(s.address) for s in candidates]
        if not candidates or any(
            r is None or r[0] != s.epoch for r, s in zip(refusals, candidates, strict=True)
        ):
            return
        detail = next(r[1] for r in refusals if r is not None)
        raise JobError(
            "model_invalid", f"no board can load the model ({len(candidates)} refused it): {detail}"
        )

    def _note_refusal(self, session: BoardSession, exc: BoardFaultError) -> None:
        """Remember a board that refused the model (its answer, or an Error sent unasked)."""
        error = session.last_error
        if exc.reason == "model_invalid":
            self._model_refusals[session.address] = (session.epoch, exc.detail)
        elif error is not None and error.code == "model_invalid":
            self._model_refusals[session.address] = (session.epoch, error.detail)

    def _needs_sync(self, session: BoardSession) -> bool:
        if not session.alive or session.state in ("unknown", "loading", "resync", "busy"):
            return False
        if session.state in ("hello", "faulty"):
            return session.hello is not None and not refused(session)
        return session.job_id != self.ctx.job_id or session.step != self.ctx.step

    async def _prepare(self, session: BoardSession) -> None:
        ctx = self.ctx
        t, epoch = ctx.step, session.epoch
        was_faulty = session.state == "faulty"
        try:
            fresh_model = await self._load_job(session)
            if t > 0 or not fresh_model:
                await self._send_weights(session, t)
        except BoardFaultError as exc:
            await self._failed(session, t, exc)
            return
        except asyncio.CancelledError:
            if session.state in ("loading", "resync"):
                ctx.fleet.mark_faulty(session, "load cancelled")  # resynchronised by the next job
            raise
        if session.epoch != epoch:  # it rebooted meanwhile: what it was sent is gone
            return
        if not session.set_state("ready", "synchronised"):  # it went away meanwhile
            return
        session.job_id, session.step = ctx.job_id, t
        session.sync_failures = 0
        self._model_refusals.pop(session.address, None)
        if was_faulty:
            ctx.fleet.emit("board_resynced", session, f"at step {t}")
        await ctx.fleet.notify_changed()

    async def _failed(self, session: BoardSession, t: int, exc: BoardFaultError) -> None:
        self._note_refusal(session, exc)
        # A board that keeps failing costs each step a timeout: back off, doubling.
        backoff = self.ctx.config.resync_backoff_s * 2 ** min(session.sync_failures, 16)
        delay = min(_MAX_BACKOFF_S, backoff)
        session.sync_failures += 1
        session.retry_at = asyncio.get_running_loop().time() + delay
        log.warning(
            "board load failed; retrying later",
            board=session.board_id,
            step=t,
            error=f"{exc.reason} {exc.detail}".strip(),
            retry_in_s=round(delay, 2),
        )
        if session.state in ("loading", "resync", "hello"):
            self.ctx.fault(session, f"resync failed: {exc}")
        await self.ctx.fleet.notify_changed()

    async def _load_job(self, session: BoardSession) -> bool:
        """Job config, data set and (if the board lacks it) model; True when the model was sent."""
        ctx = self.ctx
        session.last_error = None  # only what the board says about this load counts
        if session.job_id == ctx.job_id:
            session.set_state("resync", "weights")
            return False
        session.set_state("loading" if session.state == "hello" else "resync", "job")
        timeout = ctx.config.reply_timeout_s
        await session.request(job_config(ctx.spec), timeout)
        data = ctx.workload.dataset
        select = SelectDataset(
            name=data.name,
            dataset_hash=dataset_hash64(data.content_hash),
            train_size=len(data.x_train),
            val_size=len(data.x_val),
        )
        await session.request(select, timeout)
        if session.model_hash == self._blob_hash:
            return False
        blob, crc = self._blob, zlib.crc32(self._blob)
        await self._send_chunks(
            session,
            blob,
            lambda off, chunk: LoadModel(total=len(blob), offset=off, chunk=chunk, crc32=crc),
        )
        session.model_hash = self._blob_hash
        return True

    async def _send_weights(self, session: BoardSession, step: int) -> None:
        ctx = self.ctx
        if session.state not in ("loading", "resync"):
            session.set_state("resync", "weights")
        raw = ctx.state.weight_bytes()
        checksum = ctx.state.checksum()
        await self._send_chunks(
            session,
            raw,
            lambda off, chunk: SetWeights(
                total=len(raw),
                offset=off,
                chunk=chunk,
                job_id=ctx.job_id,
                step=step,
                checksum=checksum,
            ),
            ctx.config.resync_timeout_s,
        )

    async def _send_chunks(
        self,
        session: BoardSession,
        data: bytes,
        make: Callable[[int, bytes], Any],
        timeout: float | None = None,
    ) -> None:
        offsets = list(range(0, len(data), MAX_CHUNK)) or [0]
        for offset in offsets[:-1]:
            await session.send(make(offset, data[offset : offset + MAX_CHUNK]))
        last = offsets[-1]
        await session.request(
            make(last, data[last : last + MAX_CHUNK]), timeout or self.ctx.config.load_timeout_s
        )
