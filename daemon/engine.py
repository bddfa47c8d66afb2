"""The step engine: one job's ZO steps, sharded across the fleet.

One step ``t`` (DESIGN.md, "One training step, as data"):

1. the policy says ``q``; boards that joined, reconnected or failed are brought to step
   ``t`` first (job config, data set, model, then ``SetWeights``), concurrently and in
   the background: the step waits for them at most ``step_deadline_s`` (a lost reply
   costs that board ``resync_timeout_s`` and a logged retry, not the others a stall);
2. the keys ``0..q-1`` are split across ready boards in proportion to their measured
   throughput (``planner.plan_shards``), one ``EvalRequest`` each; with two or more boards
   one key of every shard is also evaluated by the next board (an audit);
3. answers later than the deadline, lost with their board, or refused are reassigned to
   other boards, audited the same way (a lone shard also carries a key another board
   already answered); two answers for the same key must agree bit for bit — when they do
   not, the daemon evaluates the key itself and every board that disagrees with it is
   marked faulty, its answers of this step dropped and its keys reassigned. At an audit
   step every accepted result (late ones too) must be confirmed: one of its keys agreed
   with a second board or with the daemon; before the update, the daemon evaluates one
   key of each result still unconfirmed (its partner was lost, late, or there is one
   board). A lie shifts a whole result, so this catches it; a single flipped loss (MQTT
   has no frame CRC) is caught only when it hits the audited key;
4. the SPSA coefficients are computed once, the daemon applies the update to its own
   copy and sends ``ApplyUpdate`` to every board at step ``t``; a board whose checksum
   differs is resynchronised (full weights) before it gets work again. Pipelined (the
   default): once the policy has heard about step ``t``, q of ``t+1`` is known, so each
   board gets step ``t+1``'s ``EvalRequest`` right behind the update (boards take
   messages in order) and the acks are checked with the results — a result counts only
   after its board's ack matched. Not before a validation or the last step, nor while a
   stop, pause, policy change or checkpoint waits: those get a whole step;
5. every ``eval_every`` steps validation runs data-parallel on the boards
   (``ValidateRequest`` slices) or, with no board, in the daemon; the policy hears about
   the step and the validation; metrics, events and checkpoints follow.

The engine computes exactly what ``qsched.zo.trainer.train_zo`` computes, so a fleet run
ends with the same weights as the single-process reference.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, cast

import structlog

from qsched.daemon.checkpoints import checkpoint_of, restore_checkpoint
from qsched.daemon.fleet import BoardFaultError, BoardSession, Fleet, FleetEvent
from qsched.daemon.planner import plan_shards, split_proportional
from qsched.daemon.state import Checkpoint, JobDir
from qsched.policies import create_policy
from qsched.protocol.control import Event, EventKind
from qsched.protocol.identity import dataset_hash64, model_hash64
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.messages import (
    MAX_CHUNK,
    PROTOCOL_VERSION,
    ApplyUpdate,
    EvalRequest,
    EvalResult,
    LoadModel,
    SelectDataset,
    SetWeights,
    UpdateAck,
    ValidateRequest,
    ValidateResult,
    job_config,
    job_id_of,
)
from qsched.protocol.states import JobState, check_job_transition
from qsched.zo.spsa import LossError, LossPairs
from qsched.zo.step import (
    EvalRecord,
    StepRecord,
    checkpoint_due,
    eval_record,
    settle_step,
    validates_after,
)
from qsched.zo.trainer import TrainResult, policy_context
from qsched.zo.workload import TrainState, Workload

__all__ = [
    "EngineConfig",
    "JobError",
    "JobResult",
    "StepEngine",
    "fleet_event",
]

_log = structlog.get_logger("qsched.engine")

_WAIT_POLL_S: Final = 1.0
_IDLE_MIN_S: Final = 0.02  # first back-off of a round that could dispatch nothing
_IDLE_MAX_S: Final = 1.0
_MAX_BACKOFF_S: Final = 60.0


class _Interrupted(Exception):
    """A stop arrived while the step waited for boards; nothing of the step was applied."""


class JobError(Exception):
    """The job cannot go on (``reason``: ``numeric``, ``no_workload``, ``internal`` ...)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class EngineConfig:
    """Timing and checking knobs of the step engine (limits on everything).

    Args:
        step_deadline_s: the shortest time a board gets for its shard before the shard
            is reassigned.
        deadline_factor: a shard's deadline is this many times its expected time (from
            the board's throughput), when that is longer.
        reply_timeout_s: how long update acks, loads and validations may take.
        load_timeout_s: how long loading a model onto one board may take.
        resync_timeout_s: how long loading weights (``SetWeights``) onto one board may take.
        resync_backoff_s: wait this long before retrying a board whose resync failed.
        audit_every: every this many steps (0: never) one key of every shard is also
            evaluated by a second board (needs two boards). An audited step costs about
            one key per board more; between audits a lying board goes unnoticed.
        validate_on: ``boards`` (data-parallel slices) or ``daemon`` (local).
        checkpoint_every: steps between checkpoints (default: the spec's).
        pipeline: send step t's update and step t+1's eval requests together, and check
            the update acks alongside the results (off: wait for every ack first).
    """

    step_deadline_s: float = 5.0
    deadline_factor: float = 4.0
    reply_timeout_s: float = 10.0
    load_timeout_s: float = 60.0
    resync_timeout_s: float = 15.0
    resync_backoff_s: float = 2.0
    audit_every: int = 1
    validate_on: Literal["boards", "daemon"] = "boards"
    checkpoint_every: int | None = None
    pipeline: bool = True


@dataclass
class JobResult:
    """How a job ended: its status and the training result (state, policy, history)."""

    status: JobState
    train: TrainResult
    faults: int = 0
    reassigned: int = 0
    policy: PolicySpec | None = None
    work: dict[str, int] = field(default_factory=dict)  # keys evaluated per board id

    @property
    def state(self) -> TrainState:
        """The final weights."""
        return self.train.state

    @property
    def steps(self) -> list[StepRecord]:
        """Per-step history."""
        return self.train.steps

    @property
    def evals(self) -> list[EvalRecord]:
        """Per-validation history."""
        return self.train.evals


# --------------------------------------------------------------------------- per-step bookkeeping


@dataclass
class _Flight:
    """One outstanding EvalRequest."""

    session: BoardSession
    ks: tuple[int, ...]
    sent: float
    deadline: float
    late: bool = False


@dataclass
class _Collected:
    """Losses of one step gathered so far and who said what."""

    values: dict[int, tuple[float, float | None]] = field(default_factory=dict)
    sources: dict[int, set[str]] = field(default_factory=dict)  # k -> addresses
    base: float | None = None
    excluded: set[str] = field(default_factory=set)  # addresses out of this step
    checked: set[int] = field(default_factory=set)  # keys whose value the daemon computed
    groups: list[tuple[str, tuple[int, ...]]] = field(
        default_factory=list
    )  # accepted results (address, ks)

    def confirmed(self, ks: Sequence[int]) -> bool:
        """Whether a result with keys ``ks`` was audited: one of its keys agrees with a
        second board's answer or was computed by the daemon."""
        return any(k in self.checked or len(self.sources.get(k, ())) >= 2 for k in ks)


class StepEngine:
    """Runs one job on a fleet (see the module docstring).

    Args:
        spec: the job.
        fleet: the boards (an entered ``Fleet``).
        config: timing and checking knobs.
        workload: a prebuilt workload for ``spec``.
        resume: a checkpoint to continue from.
        job_dir: the job's folder (metrics log, checkpoints); None keeps nothing on disk.
        on_event: called with every control-plane event (step, validation, ...).
    """

    def __init__(
        self,
        spec: JobSpec,
        fleet: Fleet,
        *,
        config: EngineConfig | None = None,
        workload: Workload | None = None,
        resume: Checkpoint | None = None,
        job_dir: JobDir | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        self.spec = spec
        self.fleet = fleet
        self.config = config or EngineConfig()
        self.workload = workload if workload is not None else Workload.from_spec(spec)
        self.job_dir = job_dir
        self.job_id = job_id_of(spec)
        self._on_event = on_event
        self._context = policy_context(spec, self.workload)
        if resume is not None:
            self.result, self.policy_spec = restore_checkpoint(spec, resume)
            self.policy = create_policy(self.policy_spec, self._context)
            self.policy.load_state_dict(self.result.policy_state)
        else:
            self.policy_spec = spec.policy
            self.policy = create_policy(spec.policy, self._context)
            self.result = TrainResult(spec, self.workload.initial_state(), self.policy.state_dict())
        self.job_state: JobState = "pending"
        self.status_line = "pending"
        self.faults = 0
        self.reassigned = 0
        self.work: dict[str, int] = {}
        self._blob = self.workload.model_blob()
        self._blob_hash = model_hash64(self._blob)
        self._stop = asyncio.Event()
        self._shutdown = False
        self._resume = asyncio.Event()
        self._resume.set()
        self._checkpoint_waiters: list[asyncio.Future[str]] = []
        self._new_policy: PolicySpec | None = None
        self._safe_point = False  # True while waiting between whole steps
        # address -> (the board's Hello epoch, detail) of boards that refused the model
        self._model_refusals: dict[str, tuple[int, str]] = {}
        # Pipelining: eval requests of the next step sent with the update (step, flights),
        # and boards whose update ack is not checked yet (no work for them meanwhile).
        self._prefetch: tuple[int, dict[asyncio.Task[EvalResult], _Flight]] | None = None
        self._unverified: dict[str, asyncio.Task[None]] = {}
        self._going_down: asyncio.Future[None] | None = None  # done on a shutdown stop
        # Boards being loaded or resynchronised: a step waits for them only so long.
        self._syncing: dict[str, asyncio.Task[None]] = {}
        self.last_checkpoint: str | None = None

    # ------------------------------------------------------------------ control

    @property
    def state(self) -> TrainState:
        """The daemon's copy of the weights (at the next step to run)."""
        return self.result.state

    @property
    def step(self) -> int:
        """The next step to run."""
        return self.result.state.step

    def pause(self) -> None:
        """Pause after the current step (a pending job starts paused)."""
        if self.job_state == "pending":
            self._set_job_state("running")
        self._set_job_state("paused")
        self._resume.clear()
        self.status_line = "paused"

    def resume(self) -> None:
        """Resume a paused job."""
        self._set_job_state("running")
        self._resume.set()

    def stop(self, *, shutdown: bool = False) -> None:
        """Stop after the current step with a checkpoint.

        Args:
            shutdown: the daemon is going down: the job stays ``running`` on disk and
                resumes on the next start, instead of ending as ``stopped``.
        """
        self._shutdown = self._shutdown or shutdown
        self._stop.set()
        self._resume.set()
        if self._shutdown and self._going_down is not None and not self._going_down.done():
            self._going_down.set_result(None)  # wakes a step waiting for answers

    def change_policy(self, policy: PolicySpec) -> None:
        """Switch the q policy from the next step on (validated here, applied between steps)."""
        create_policy(policy, self._context)  # raises PolicyError when invalid
        self._new_policy = policy

    def request_checkpoint(self) -> asyncio.Future[str]:
        """A checkpoint after the current step; the future gives its path."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._checkpoint_waiters.append(future)
        if self._safe_point:  # paused or waiting for boards: no step is half done
            self._write_checkpoint()
            self._settle_checkpoints()
        return future

    def _set_job_state(self, new: JobState) -> None:
        if new != self.job_state:
            check_job_transition(self.job_state, new)
            self.job_state = new

    # ------------------------------------------------------------------ the run

    async def run(self) -> JobResult:
        """Run steps until the step budget, a stop, or a fatal error.

        Returns:
            The result (status ``completed``, ``stopped``, or ``running`` after a
            shutdown stop, which resumes on the next start).

        Raises:
            JobError: the job failed (status ``failed`` is recorded first).
        """
        if self.job_state == "pending":
            self._set_job_state("running")
        resumed = bool(self.result.steps)
        if resumed and self.job_dir is not None:
            # Steps after the checkpoint run again; readers of the log keep the later copy.
            self.job_dir.append_metrics({"kind": "resumed", "time": time.time(), "step": self.step})
        self._emit("job_resumed" if resumed else "job_started", message=f"at step {self.step}")
        started = time.perf_counter()
        try:
            try:
                while self.step < self.spec.steps and not self._stop.is_set():
                    await self._between_steps()
                    if self._stop.is_set():
                        break
                    try:
                        await self._step()
                    except _Interrupted:  # stopped while no board could finish the step
                        break
                    self._after_step()
            except BaseException:
                self._drop_pipeline()
                await self._cancel_syncs()
                raise
            await self._finish_pipeline()
            await self._cancel_syncs()
        except JobError as exc:
            self._finish_failed(exc, started)
            raise
        except Exception as exc:
            self._finish_failed(JobError("internal", f"{type(exc).__name__}: {exc}"), started)
            raise JobError("internal", f"{type(exc).__name__}: {exc}") from exc
        self.result.wall_s += time.perf_counter() - started
        return self._finish()

    def _finish(self) -> JobResult:
        self.result.policy_state = self.policy.state_dict()
        self._write_checkpoint()
        if self.step >= self.spec.steps:
            self._set_job_state("completed")
            self._emit("job_completed", message=f"{self.step} steps")
        elif not self._shutdown:
            self._set_job_state("stopped")
            self._emit("job_stopped", message=f"at step {self.step}")
        self.status_line = self.job_state
        self._settle_checkpoints()
        return JobResult(
            self.job_state,
            self.result,
            self.faults,
            self.reassigned,
            self.policy_spec,
            dict(self.work),
        )

    def _finish_failed(self, exc: JobError, started: float) -> None:
        self.result.wall_s += time.perf_counter() - started
        _log.error("job failed", job=self.spec.name, reason=exc.reason, detail=exc.detail)
        self._set_job_state("failed")
        self.status_line = f"failed: {exc}"
        self._emit("job_failed", message=str(exc))
        for future in self._checkpoint_waiters:
            if not future.done():
                future.set_exception(exc)
        self._checkpoint_waiters.clear()

    async def _between_steps(self) -> None:
        if not self._resume.is_set():
            self._emit("job_paused", message=f"at step {self.step}")
            self._safe_point = True
            try:
                await self._resume.wait()
            finally:
                self._safe_point = False
            if not self._stop.is_set():
                self._emit("job_resumed", message=f"at step {self.step}")
        if self._new_policy is not None:
            self._switch_policy(self._new_policy)
        if self._checkpoint_waiters:
            self._write_checkpoint()
            self._settle_checkpoints()

    def _switch_policy(self, policy: PolicySpec) -> None:
        self._new_policy = None
        self.policy_spec = policy
        self.policy = create_policy(policy, self._context)
        self.result.policy_state = self.policy.state_dict()
        self._emit("policy_changed", message=f"{policy.name} from step {self.step}")

    def _after_step(self) -> None:
        every = self.config.checkpoint_every or self.spec.checkpoint_every
        if checkpoint_due(self.step, every) or self._checkpoint_waiters:
            self._write_checkpoint()
            self._settle_checkpoints()

    def _write_checkpoint(self) -> None:
        if self.job_dir is None:
            return
        self.result.policy_state = self.policy.state_dict()
        path = self.job_dir.save_checkpoint(checkpoint_of(self.result, self.policy_spec))
        self.last_checkpoint = str(path)
        self._emit("checkpoint", message=str(path))

    def _settle_checkpoints(self) -> None:
        for future in self._checkpoint_waiters:
            if not future.done():
                if self.last_checkpoint is None:
                    future.set_exception(JobError("no_state_dir", "this job keeps no checkpoints"))
                else:
                    future.set_result(self.last_checkpoint)
        self._checkpoint_waiters.clear()

    # ------------------------------------------------------------------ one step

    async def _step(self) -> None:
        t, q = self.step, self.policy.q
        self.status_line = f"step {t}/{self.spec.steps} q={q}"
        await self._sync_boards()
        losses = await self._collect(t, q)
        try:
            settled = settle_step(self.spec, t, q, losses, self.result.forward_passes)
        except LossError as exc:
            raise JobError("numeric", str(exc)) from exc
        pairs, record = settled.pairs, settled.record
        self.policy.on_step(settled.report)
        validate = validates_after(self.spec, t)
        if self._may_pipeline(validate):
            # The policy knows step t, so q of t+1 is known: its requests go right behind
            # the update (boards take messages in order) and the acks are checked with them.
            expected: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            try:
                await self._send_update_and_next(t, pairs, expected)
                # Only now: a computing thread holds the GIL and would delay the sends.
                new_state = await asyncio.to_thread(
                    self.workload.apply_update, self.state, t, pairs
                )
                expected.set_result(new_state.checksum())
            finally:
                if not expected.done():
                    expected.cancel()
        else:
            new_state = await asyncio.to_thread(self.workload.apply_update, self.state, t, pairs)
            await self._broadcast_update(t, pairs, new_state.checksum())
        self.result.state = new_state
        self.result.forward_passes = record.forward_passes
        self.result.steps.append(record)
        self._log_step(record)
        if validate:
            evaluation = await self._validate(t)
            self.result.evals.append(evaluation)
            self.policy.on_eval(evaluation.report())
            self._log_eval(evaluation)

    def _log_step(self, record: StepRecord) -> None:
        metrics = {
            "q": float(record.q),
            "train_loss": record.train_loss,
            "forward_passes": float(record.forward_passes),
        }
        if self.job_dir is not None:
            self.job_dir.append_metrics({"kind": "step", "time": time.time(), **asdict(record)})
        self._emit("step", step=record.step, metrics=metrics)

    def _log_eval(self, evaluation: EvalRecord) -> None:
        metrics = {"val_loss": evaluation.val_loss, "val_accuracy": evaluation.val_accuracy}
        if self.job_dir is not None:
            self.job_dir.append_metrics(
                {"kind": "validation", "time": time.time(), **asdict(evaluation)}
            )
        self._emit("validation", step=evaluation.step, metrics=metrics)

    # ------------------------------------------------------------------ boards

    def workers(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[BoardSession]:
        """Boards that may get work now: ready at this step, not draining, not excluded."""
        return [
            s
            for s in self.fleet.boards()
            if s.alive
            and s.state == "ready"
            and s.job_id == self.job_id
            and s.step == self.step
            and not s.draining
            and s.address not in exclude
            and s.address not in self._unverified
        ]

    async def _sync_boards(self) -> None:
        """Bring every board that needs it to the current step (concurrently, in the
        background): the step waits for them at most ``step_deadline_s``, so a board whose
        reply is lost does not hold up the others; it joins when its load is done."""
        now = asyncio.get_running_loop().time()
        todo = [
            s
            for s in self.fleet.boards()
            if self._needs_sync(s) and s.retry_at <= now and s.address not in self._syncing
        ]
        started: list[asyncio.Task[None]] = []
        for session in todo:
            task = asyncio.create_task(
                self._prepare(session), name=f"fleet[{session.address}].sync"
            )
            self._syncing[session.address] = task
            task.add_done_callback(functools.partial(self._sync_done, session.address))
            started.append(task)
        if started:  # loads from earlier steps are not waited for again: they join when done
            done, _ = await asyncio.wait(started, timeout=self.config.step_deadline_s)
            for task in done:
                task.result()  # an unexpected error of a load surfaces here
        self._check_model_loadable()

    def _sync_done(self, address: str, _task: asyncio.Task[None]) -> None:
        self._syncing.pop(address, None)

    async def _cancel_syncs(self) -> None:
        """The job ends: stop loads still in flight (their boards are resynchronised later)."""
        tasks = list(self._syncing.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _check_model_loadable(self) -> None:
        """SPEC 9.2: when every board that could work refused the model, the job fails."""
        candidates = [
            s for s in self.fleet.boards() if s.alive and s.hello is not None and not _refused(s)
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
            return session.hello is not None and not _refused(session)
        return session.job_id != self.job_id or session.step != self.step

    async def _prepare(self, session: BoardSession) -> None:
        t, epoch = self.step, session.epoch
        was_faulty = session.state == "faulty"
        try:
            fresh_model = await self._load_job(session)
            if t > 0 or not fresh_model:
                await self._send_weights(session, t)
        except BoardFaultError as exc:
            self._note_refusal(session, exc)
            # A board that keeps failing costs each step a timeout: back off, doubling.
            delay = min(
                _MAX_BACKOFF_S, self.config.resync_backoff_s * 2 ** min(session.sync_failures, 16)
            )
            session.sync_failures += 1
            session.retry_at = asyncio.get_running_loop().time() + delay
            _log.warning(
                "board load failed; retrying later",
                board=session.board_id,
                step=t,
                error=f"{exc.reason} {exc.detail}".strip(),
                retry_in_s=round(delay, 2),
            )
            if session.state in ("loading", "resync", "hello"):
                self._fault(session, f"resync failed: {exc}")
            await self.fleet.notify_changed()
            return
        except asyncio.CancelledError:
            if session.state in ("loading", "resync"):
                self.fleet.mark_faulty(session, "load cancelled")  # resynchronised by the next job
            raise
        if session.epoch != epoch:  # it rebooted meanwhile: what it was sent is gone
            return
        if not session.set_state("ready", "synchronised"):  # it went away meanwhile
            return
        session.job_id, session.step = self.job_id, t
        session.sync_failures = 0
        self._model_refusals.pop(session.address, None)
        if was_faulty:
            self.fleet.emit("board_resynced", session, f"at step {t}")
        await self.fleet.notify_changed()

    async def _load_job(self, session: BoardSession) -> bool:
        """Job config, data set and (if the board lacks it) model; True when the model was sent."""
        session.last_error = None  # only what the board says about this load counts
        if session.job_id == self.job_id:
            session.set_state("resync", "weights")
            return False
        session.set_state("loading" if session.state == "hello" else "resync", "job")
        timeout = self.config.reply_timeout_s
        await session.request(job_config(self.spec), timeout)
        data = self.workload.dataset
        await session.request(
            SelectDataset(
                name=data.name,
                dataset_hash=dataset_hash64(data.content_hash),
                train_size=len(data.x_train),
                val_size=len(data.x_val),
            ),
            timeout,
        )
        if session.model_hash == self._blob_hash:
            return False
        await self._send_chunks(
            session,
            self._blob,
            lambda off, chunk: LoadModel(
                total=len(self._blob), offset=off, chunk=chunk, crc32=zlib.crc32(self._blob)
            ),
        )
        session.model_hash = self._blob_hash
        return True

    async def _send_weights(self, session: BoardSession, step: int) -> None:
        if session.state not in ("loading", "resync"):
            session.set_state("resync", "weights")
        raw = self.state.weight_bytes()
        checksum = self.state.checksum()
        await self._send_chunks(
            session,
            raw,
            lambda off, chunk: SetWeights(
                total=len(raw),
                offset=off,
                chunk=chunk,
                job_id=self.job_id,
                step=step,
                checksum=checksum,
            ),
            self.config.resync_timeout_s,
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
            make(last, data[last : last + MAX_CHUNK]), timeout or self.config.load_timeout_s
        )

    def _fault(self, session: BoardSession, reason: str) -> None:
        self.faults += 1
        self.fleet.mark_faulty(session, reason)

    async def _wait_for_workers(self) -> list[BoardSession]:
        """Sync boards until one can work; says so in the status while none can."""
        announced = False
        while True:
            await self._sync_boards()
            workers = self.workers()
            if not workers and self._stop.is_set():
                raise _Interrupted
            if workers:
                if announced:
                    _log.info("boards available again", job=self.spec.name, boards=len(workers))
                return workers
            if not announced:
                _log.warning("no board available; waiting", job=self.spec.name, step=self.step)
                announced = True
            self.status_line = f"waiting for boards (step {self.step}/{self.spec.steps})"
            # Nothing of this step is applied yet, so a checkpoint now is a whole one.
            self._safe_point = True
            try:
                await self.fleet.wait_changed(_WAIT_POLL_S)
            finally:
                self._safe_point = False

    # ------------------------------------------------------------------ evaluation requests

    def _deadline(self, session: BoardSession, count: int, now: float) -> float:
        expected = count / max(session.throughput.rate, 1e-6)
        return now + max(self.config.step_deadline_s, self.config.deadline_factor * expected)

    def _request(self, t: int, ks: Sequence[int]) -> EvalRequest:
        spec = self.spec
        return EvalRequest(
            job_id=self.job_id,
            step=t,
            batch_size=spec.batch_size,
            eps=spec.eps,
            estimator=spec.estimator,
            ks=tuple(sorted(ks)),
        )

    def _plan(
        self,
        missing: Sequence[int],
        workers: list[BoardSession],
        audit: bool,
        step: int | None = None,
    ) -> dict[str, list[int]]:
        rates = _planning_rates(workers)
        plan = plan_shards(list(missing), rates)
        every = self.config.audit_every
        step = self.step if step is None else step
        if audit and every > 0 and step % every == 0 and len(plan) >= 2:
            order = sorted(plan)
            extra = {b: plan[order[(i - 1) % len(order)]][0] for i, b in enumerate(order)}
            plan = {b: sorted({*plan[b], extra[b]}) for b in order}
        return plan

    async def _collect(self, t: int, q: int) -> LossPairs:
        """Gather verified losses for keys 0..q-1 of step t."""
        got = _Collected()
        flights = self._take_prefetch(t)
        first = not flights  # the first plan (with its audit) went out with the last update
        idle_rounds = 0
        try:
            while True:
                missing = [k for k in range(q) if k not in got.values]
                covered = {k for f in flights.values() if not f.late for k in f.ks}
                uncovered = [k for k in missing if k not in covered]
                if not missing and not any(not f.late for f in flights.values()):
                    if await self._confirm_rest(t, got):
                        continue  # a result failed the daemon's check: its keys are missing again
                    return self._losses(got, q)
                if self._stop.is_set() and self._shutdown:
                    raise _Interrupted  # nothing of step t is applied: it runs again on resume
                if uncovered:
                    await self._dispatch(t, uncovered, got, flights, first=first)
                    first = False
                if not flights:
                    # Nobody could take the keys (every board failed at once): wait, never spin.
                    idle_rounds += 1
                    await self._idle(t, idle_rounds)
                    continue
                idle_rounds = 0
                await self._await_some(t, got, flights)
        finally:
            for task, flight in flights.items():
                task.cancel()
                if flight.session.state == "busy":
                    # Still computing a shard nobody waits for: resynchronise it before new work.
                    self._fault(flight.session, f"step {t}: no answer before the deadline")

    async def _idle(self, t: int, rounds: int) -> None:
        """A round dispatched nothing: back off (capped, jittered) and say so in the status."""
        if self._stop.is_set():
            raise _Interrupted
        self.status_line = f"waiting for boards (step {t}/{self.spec.steps})"
        delay = min(_IDLE_MAX_S, _IDLE_MIN_S * 2 ** min(rounds - 1, 16)) * random.uniform(0.5, 1.0)
        if rounds == 1:
            _log.warning("no board could take work; backing off", job=self.spec.name, step=t)
        self._safe_point = True  # nothing of step t is applied yet
        try:
            await asyncio.sleep(_IDLE_MIN_S / 2)  # a burst of fleet news must not make a busy loop
            await self.fleet.wait_changed(delay)
        finally:
            self._safe_point = False

    async def _dispatch(
        self,
        t: int,
        keys: list[int],
        got: _Collected,
        flights: dict[asyncio.Task[EvalResult], _Flight],
        first: bool,
    ) -> None:
        busy = {f.session.address for f in flights.values()}
        workers = self.workers(got.excluded | busy)
        if not workers:
            if flights:
                return  # someone is still working (late answers count too): wait for them
            workers = [w for w in await self._wait_for_workers() if w.address not in got.excluded]
            if not workers:
                got.excluded.clear()  # everyone failed once this step: give all another chance
                return
        if not first:
            self.reassigned += len(keys)
        now = asyncio.get_running_loop().time()
        by_address = {w.address: w for w in workers}
        for address, ks in self._audited_plan(t, keys, workers, got).items():
            session = by_address[address]
            request = self._request(t, ks)
            flight = _Flight(session, request.ks, now, self._deadline(session, len(ks), now))
            remaining = flight.deadline - now
            # The waiter is keyed by the request's step and ks: only an EvalResult answers it.
            task = cast(
                "asyncio.Task[EvalResult]",
                asyncio.create_task(
                    session.request(request, remaining + self.config.step_deadline_s * 4),
                    name=f"fleet[{address}].eval[{t}]",
                ),
            )
            flights[task] = flight
            session.set_state("busy", "eval")

    def _audited_plan(
        self, t: int, keys: list[int], workers: list[BoardSession], got: _Collected
    ) -> dict[str, list[int]]:
        """Every dispatch is audited, reassignments too: shards overlap by one key, and a
        lone shard also carries a key another board already answered (when there is one)."""
        plan = self._plan(keys, workers, audit=True)
        if len(plan) == 1 and self._audit_step(t):
            ((address, ks),) = plan.items()
            known = next(
                (
                    k
                    for k in sorted(got.values)
                    if got.sources.get(k) and address not in got.sources[k]
                ),
                None,
            )
            if known is not None:
                plan[address] = sorted({*ks, known})
        return plan

    def _audit_step(self, t: int) -> bool:
        every = self.config.audit_every
        return every > 0 and t % every == 0

    async def _confirm_rest(self, t: int, got: _Collected) -> bool:
        """At an audit step, the daemon checks one key of every result no second board
        confirmed (its audit partner was lost, late or alone). Returns whether one failed."""
        if not self._audit_step(t):
            return False
        open_groups = [g for g in got.groups if not got.confirmed(g[1])]
        if not open_groups:
            return False
        keys = sorted({ks[0] for _, ks in open_groups})
        _log.info(
            "daemon audits unconfirmed results",
            job=self.spec.name,
            step=t,
            results=len(open_groups),
        )
        liars = await self._daemon_truth(t, keys, got)
        self._drop_liars(t, liars, got, keep=set(keys))
        return bool(liars)

    async def _daemon_truth(self, t: int, keys: list[int], got: _Collected) -> set[str]:
        """The daemon computes ``keys``; their values become its own. Returns the
        addresses whose accepted values disagree with it."""
        truth = await asyncio.to_thread(self.workload.perturbed_losses, self.state, t, keys)
        two_sided = self.spec.estimator == "two_sided"
        liars: set[str] = set()
        for k in keys:
            true_value = (truth.plus[k], truth.minus[k] if two_sided else None)
            if k in got.values and got.values[k] != true_value:
                liars |= got.sources.get(k, set())
            got.values[k] = true_value
            got.sources[k] = set()
            got.checked.add(k)
        if not two_sided and truth.base is not None:
            got.base = truth.base
        return liars

    def _drop_liars(self, t: int, liars: set[str], got: _Collected, keep: set[int]) -> None:
        for address in liars:
            self._drop_board_values(address, got, keep=keep)
            liar = self.fleet.sessions.get(address)
            if liar is not None:
                self._fault(liar, f"step {t}: losses disagree with the daemon's")

    async def _await_some(
        self, t: int, got: _Collected, flights: dict[asyncio.Task[EvalResult], _Flight]
    ) -> None:
        loop = asyncio.get_running_loop()
        pending_deadlines = [f.deadline for f in flights.values() if not f.late]
        timeout = max(0.0, min(pending_deadlines) - loop.time()) if pending_deadlines else None
        if self._going_down is None:
            self._going_down = loop.create_future()
        # A shutdown does not wait for the answers: the step runs again after the restart.
        waiters: list[asyncio.Future[Any]] = [*flights, self._going_down]
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        now = loop.time()
        for waiter in done:
            if waiter is self._going_down:
                continue
            task = cast("asyncio.Task[EvalResult]", waiter)
            flight = flights.pop(task)
            await self._on_answer(t, task, flight, got, now)
        for flight in flights.values():
            if not flight.late and now >= flight.deadline:
                flight.late = True
                got.excluded.add(flight.session.address)
                flight.session.throughput.observe(len(flight.ks), now - flight.sent)
                _log.warning(
                    "shard late; reassigning",
                    board=flight.session.board_id,
                    step=t,
                    ks=len(flight.ks),
                )

    async def _on_answer(
        self, t: int, task: asyncio.Task[EvalResult], flight: _Flight, got: _Collected, now: float
    ) -> None:
        session = flight.session
        if session.state == "busy":
            session.set_state("ready", "answered")
        try:
            result = task.result()
            self._check_result(result, t, flight)
        except BoardFaultError as exc:
            got.excluded.add(session.address)
            self._fault(session, _fault_text(exc, f"step {t}"))
            return
        self.work[session.board_id] = self.work.get(session.board_id, 0) + len(result.ks)
        if not flight.late:  # a late answer still counts (and is checked), its time does not
            session.throughput.observe(len(flight.ks), max(now - flight.sent, 1e-6))
        await self._accept(t, session, result, got)

    def _check_result(self, result: EvalResult, t: int, flight: _Flight) -> None:
        if not isinstance(result, EvalResult) or result.step != t or result.job_id != self.job_id:
            raise BoardFaultError(
                flight.session.board_id, "wrong_answer", "result for another job or step"
            )
        if tuple(result.ks) != flight.ks or result.estimator != self.spec.estimator:
            raise BoardFaultError(flight.session.board_id, "wrong_answer", "result for other keys")

    async def _accept(
        self, t: int, session: BoardSession, result: EvalResult, got: _Collected
    ) -> None:
        two_sided = result.estimator == "two_sided"
        conflicts: list[int] = []
        for i, k in enumerate(result.ks):
            value = (result.loss_plus[i], result.loss_minus[i] if two_sided else None)
            if k in got.values and got.values[k] != value:
                conflicts.append(k)
                continue
            got.values.setdefault(k, value)
            got.sources.setdefault(k, set()).add(session.address)
        if not two_sided and result.loss_zero is not None:
            if got.base is not None and got.base != result.loss_zero:
                conflicts.append(result.ks[0])
            got.base = result.loss_zero if got.base is None else got.base
        liars = await self._arbitrate(t, conflicts, session, result, got) if conflicts else set()
        if session.address not in liars:
            got.groups.append((session.address, tuple(result.ks)))

    async def _arbitrate(
        self, t: int, keys: list[int], session: BoardSession, result: EvalResult, got: _Collected
    ) -> set[str]:
        """Two boards disagree: the daemon evaluates the keys and the wrong side is faulty.
        Returns the addresses found lying."""
        two_sided = self.spec.estimator == "two_sided"
        index = {k: i for i, k in enumerate(result.ks)}
        theirs = {
            k: (result.loss_plus[index[k]], result.loss_minus[index[k]] if two_sided else None)
            for k in keys
        }
        liars = await self._daemon_truth(t, keys, got)
        if any(theirs[k] != got.values[k] for k in keys):
            liars.add(session.address)
        self._drop_liars(t, liars, got, keep=set(keys))
        return liars

    def _drop_board_values(self, address: str, got: _Collected, keep: set[int]) -> None:
        got.excluded.add(address)
        got.groups = [g for g in got.groups if g[0] != address]
        for k, sources in list(got.sources.items()):
            if address in sources:
                sources.discard(address)
                if not sources and k not in keep:
                    del got.values[k]
                    del got.sources[k]

    def _losses(self, got: _Collected, q: int) -> LossPairs:
        plus = {k: got.values[k][0] for k in range(q)}
        if self.spec.estimator == "two_sided":
            minus = {k: got.values[k][1] for k in range(q)}
            return LossPairs(plus=plus, minus=minus)  # type: ignore[arg-type]
        return LossPairs(plus=plus, minus={}, base=got.base)

    # ------------------------------------------------------------------ the update

    def _update_targets(self, t: int) -> list[BoardSession]:
        return [
            s
            for s in self.fleet.boards()
            if s.alive and s.state in ("ready", "busy") and s.job_id == self.job_id and s.step == t
        ]

    @staticmethod
    def _update_message(job_id: int, t: int, pairs: list[tuple[int, float]]) -> ApplyUpdate:
        ks = tuple(k for k, _ in pairs)
        return ApplyUpdate(job_id=job_id, step=t, ks=ks, coefficients=tuple(c for _, c in pairs))

    async def _broadcast_update(
        self, t: int, pairs: list[tuple[int, float]], expected: int
    ) -> None:
        await self._settle_unverified()
        message = self._update_message(self.job_id, t, pairs)
        targets = self._update_targets(t)
        answers = await asyncio.gather(
            *(s.request(message, self.config.reply_timeout_s) for s in targets),
            return_exceptions=True,
        )
        for session, answer in zip(targets, answers, strict=True):
            if isinstance(answer, UpdateAck) and answer.checksum == expected and answer.step == t:
                session.step = t + 1
                if session.state == "busy":
                    session.set_state("ready", "updated")
            elif isinstance(answer, UpdateAck):
                self._fault(
                    session, f"step {t}: checksum {answer.checksum:08x}, expected {expected:08x}"
                )
            elif isinstance(answer, BoardFaultError):
                self._fault(session, f"step {t} update: {answer.reason} {answer.detail}".strip())
            elif isinstance(answer, BaseException):
                raise answer

    # ------------------------------------------------------------------ pipelining

    def _may_pipeline(self, validate: bool) -> bool:
        """Whether step t+1's requests may go out with step t's update: not before a
        validation or the last step, nor while a stop, pause, policy change or checkpoint
        waits for the step to end (those want a whole step, and may change q)."""
        return (
            self.config.pipeline
            and not validate
            and not self._stop.is_set()
            and self._resume.is_set()
            and self._new_policy is None
            and not self._checkpoint_waiters
        )

    async def _send_update_and_next(
        self, t: int, pairs: list[tuple[int, float]], expected: asyncio.Future[int]
    ) -> None:
        """ApplyUpdate(t) to every board at step t and, right behind it on the same link,
        EvalRequests of step t+1 (keys of the policy's q) to those that may work; returns
        when every board's messages are sent (or failed to be)."""
        await self._settle_unverified()
        message = self._update_message(self.job_id, t, pairs)
        targets = self._update_targets(t)
        sent: list[asyncio.Future[None]] = []
        workers = [s for s in targets if s.state == "ready" and not s.draining]
        plan = self._plan(range(self.policy.q), workers, audit=True, step=t + 1) if workers else {}
        flights: dict[asyncio.Task[EvalResult], _Flight] = {}
        now = asyncio.get_running_loop().time()
        for session in targets:
            session.step = t + 1  # as far as the daemon knows: a wrong ack takes it back
            ks = plan.get(session.address)
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            sent.append(done)
            if ks is None:
                self._unverified[session.address] = asyncio.create_task(
                    self._update_only(session, message, expected, done),
                    name=f"fleet[{session.address}].update[{t}]",
                )
                continue
            request = self._request(t + 1, ks)
            flight = _Flight(session, request.ks, now, self._deadline(session, len(ks), now))
            timeout = flight.deadline - now + self.config.step_deadline_s * 4
            task = asyncio.create_task(
                self._update_then_eval(session, message, request, expected, timeout, done),
                name=f"fleet[{session.address}].eval[{t + 1}]",
            )
            flights[task] = flight
            session.set_state("busy", "eval")
        self._prefetch = (t + 1, flights)
        if sent:
            await asyncio.wait(sent)

    async def _update_then_eval(
        self,
        session: BoardSession,
        update: ApplyUpdate,
        request: EvalRequest,
        expected: asyncio.Future[int],
        timeout: float,
        sent: asyncio.Future[None],
    ) -> EvalResult:
        """Send the update and the next step's request; the result counts only after the
        update's ack matched the daemon's checksum (else ``BoardFaultError``)."""
        ack = session.expect(update)
        try:
            answer = session.expect(request)
        except BaseException:
            session.forget(("update", update.step), ack)
            _settle_none(sent)
            raise
        try:
            await _send_in_order(session, update, request)
        except BaseException:
            session.forget(("update", update.step), ack)
            session.forget(("eval", request.step, request.ks), answer)
            raise
        finally:
            _settle_none(sent)
        try:
            reply = await session.reply(update, ack, self.config.reply_timeout_s)
            await self._check_ack(session, update.step, reply, expected)
            result = await session.reply(request, answer, timeout)
            return cast("EvalResult", result)
        finally:
            session.forget(("update", update.step), ack)
            session.forget(("eval", request.step, request.ks), answer)

    async def _update_only(
        self,
        session: BoardSession,
        update: ApplyUpdate,
        expected: asyncio.Future[int],
        sent: asyncio.Future[None],
    ) -> None:
        """A board without work in the next step: its ack is checked in the background."""
        try:
            try:
                ack = await session.send_expecting(update)
            finally:
                _settle_none(sent)
            try:
                reply = await session.reply(update, ack, self.config.reply_timeout_s)
            finally:
                session.forget(("update", update.step), ack)
            await self._check_ack(session, update.step, reply, expected)
        except BoardFaultError as exc:
            self._fault(session, _fault_text(exc, f"step {update.step} update"))
        finally:
            self._unverified.pop(session.address, None)
        await self.fleet.notify_changed()  # it may take work now

    async def _check_ack(
        self, session: BoardSession, t: int, reply: Any, expected: asyncio.Future[int]
    ) -> None:
        checksum = await expected
        if not isinstance(reply, UpdateAck) or reply.step != t:
            raise BoardFaultError(session.board_id, "wrong_answer", f"step {t}: not its update ack")
        if reply.checksum != checksum:
            raise BoardFaultError(
                session.board_id,
                "checksum",
                f"step {t}: checksum {reply.checksum:08x}, expected {checksum:08x}",
            )

    async def _settle_unverified(self) -> None:
        """Wait for the update acks still being checked (normally all in already)."""
        if self._unverified:
            await asyncio.gather(*self._unverified.values(), return_exceptions=True)

    def _take_prefetch(self, t: int) -> dict[asyncio.Task[EvalResult], _Flight]:
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is None:
            return {}
        step, flights = prefetch
        if step == t:
            return flights
        self._prefetch = prefetch  # not this step's: dropped as on a stop
        self._drop_pipeline()
        return {}

    async def _finish_pipeline(self) -> None:
        """The job ends with the next step's requests out: wait for them (bounded) so the
        last update's acks are checked and no board is left computing, then forget them."""
        prefetch, self._prefetch = self._prefetch, None
        if self._shutdown or prefetch is None:
            self._prefetch = prefetch
            self._drop_pipeline()
            return
        flights = prefetch[1]
        if flights:
            loop = asyncio.get_running_loop()
            limit = max(f.deadline for f in flights.values()) - loop.time()
            done, _ = await asyncio.wait(flights, timeout=max(limit, self.config.reply_timeout_s))
            for task in done:
                session = flights.pop(task).session
                error = None if task.cancelled() else task.exception()
                if session.state == "busy":
                    session.set_state("ready", "answered")
                if isinstance(error, BoardFaultError):
                    self._fault(session, _fault_text(error, f"step {self.step}"))
            self._prefetch = (prefetch[0], flights)  # the unanswered ones: dropped below
        if self._unverified:
            await asyncio.wait(list(self._unverified.values()), timeout=self.config.reply_timeout_s)
        self._drop_pipeline()

    def _drop_pipeline(self) -> None:
        """The job leaves with requests of a step it will not run: cancel them; their
        boards hold updates nobody checked, so they are resynchronised before new work."""
        if self._prefetch is not None:
            _, flights = self._prefetch
            self._prefetch = None
            for task, flight in flights.items():
                task.cancel()
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: nobody waits for it any more
                if flight.session.state == "busy":
                    self._fault(flight.session, "request of a step that did not run")
        for address, ack in list(self._unverified.items()):
            if not ack.done():
                ack.cancel()
                session = self.fleet.sessions.get(address)
                if session is not None:
                    self._fault(session, "update ack not checked")
        self._unverified.clear()

    # ------------------------------------------------------------------ validation

    async def _validate(self, t: int) -> EvalRecord:
        n_val = len(self.workload.dataset.x_val)
        workers = self.workers() if self.config.validate_on == "boards" else []
        slices = self._val_slices(n_val, workers)
        results = await asyncio.gather(
            *(self._val_slice(t, s, start, count) for s, start, count in slices)
        )
        loss_sum = sum(r[0] for r in results)
        correct = sum(r[1] for r in results)
        return eval_record(t, loss_sum, correct, n_val, self.result.forward_passes)

    def _val_slices(
        self, n_val: int, workers: list[BoardSession]
    ) -> list[tuple[BoardSession | None, int, int]]:
        if not workers:
            return [(None, 0, n_val)]
        rates = _planning_rates(workers)
        shares = split_proportional(n_val, [rates[w.address] for w in workers])
        out: list[tuple[BoardSession | None, int, int]] = []
        start = 0
        for worker, share in zip(workers, shares, strict=True):
            if share:
                out.append((worker, start, share))
            start += share
        return out

    def _val_timeout(self, session: BoardSession, count: int) -> float:
        """A validation slice's deadline, as a shard's: a hung board costs the step
        ``step_deadline_s`` (then the daemon computes its slice), not a reply timeout."""
        passes_per_key = 2 if self.spec.estimator == "two_sided" else 1
        keys = count / max(self.spec.batch_size * passes_per_key, 1)
        expected = keys / max(session.throughput.rate, 1e-6)
        return max(self.config.step_deadline_s, self.config.deadline_factor * expected)

    async def _val_slice(
        self, t: int, session: BoardSession | None, start: int, count: int
    ) -> tuple[float, int]:
        if session is not None:
            request = ValidateRequest(job_id=self.job_id, step=t + 1, start=start, count=count)
            try:
                answer = await session.request(request, self._val_timeout(session, count))
                if isinstance(answer, ValidateResult) and answer.count == count:
                    return answer.loss_sum, answer.correct
                raise BoardFaultError(session.board_id, "wrong_answer", "validation slice mismatch")
            except BoardFaultError as exc:
                self._fault(session, f"validation: {exc.reason} {exc.detail}".strip())
        loss_sum, correct, _ = await asyncio.to_thread(
            self.workload.validate, self.state, start, count
        )
        return loss_sum, correct

    # ------------------------------------------------------------------ events

    def _emit(
        self,
        kind: EventKind,
        *,
        step: int | None = None,
        message: str = "",
        metrics: dict[str, float] | None = None,
    ) -> None:
        if self._on_event is None:
            return
        event = Event(
            kind=kind,
            time=time.time(),
            job=self.spec.name,
            step=step,
            message=message,
            metrics=metrics or {},
        )
        try:
            self._on_event(event)
        except Exception:  # a consumer's bug must not stop training
            _log.exception("event handler failed", kind=kind)


def fleet_event(event: FleetEvent, job: str | None = None) -> Event:
    """The control-plane event of a membership change.

    Args:
        event: the fleet's news.
        job: the current job's name, if any.

    Returns:
        The event.
    """
    return Event(
        kind=event.kind,  # type: ignore[arg-type]
        time=time.time(),
        job=job,
        board_id=event.board_id,
        message=event.message,
    )


def _planning_rates(workers: Sequence[BoardSession]) -> dict[str, float]:
    """Each worker's throughput; a board never measured counts as the mean of the measured
    ones (its prior of 1 key/s would starve it of work for good next to measured boards)."""
    measured = [s.throughput.rate for s in workers if s.throughput.observations]
    prior = sum(measured) / len(measured) if measured else 1.0
    return {s.address: s.throughput.rate if s.throughput.observations else prior for s in workers}


def _fault_text(exc: BoardFaultError, where: str) -> str:
    """A fault's reason for the event log (an update mismatch names its own step)."""
    if exc.reason == "checksum":
        return exc.detail
    return f"{where}: {exc.reason} {exc.detail}".strip()


async def _send_in_order(session: BoardSession, *messages: Any) -> None:
    """Send messages back to back without waiting for each send's confirmation (an MQTT
    QoS 1 acknowledgement costs a broker round trip). Sends start in call order, which
    links keep; a board that still got them out of order refuses the stale step and is
    resynchronised, so the order is a matter of speed, not of correctness."""
    sends = [asyncio.ensure_future(session.send(m)) for m in messages]
    try:
        await asyncio.gather(*sends)
    finally:
        for send in sends:
            send.cancel()
            if send.done() and not send.cancelled():
                send.exception()  # retrieved: gather raised the first one


def _settle_none(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _refused(session: BoardSession) -> bool:
    return session.hello is not None and session.hello.protocol_version < PROTOCOL_VERSION
