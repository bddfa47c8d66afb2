"""The step engine: one job's ZO steps, sharded across the fleet.

One step ``t`` (DESIGN.md, "One training step, as data"), each part in its own module:

1. the policy says ``q``; boards that joined, reconnected or failed are brought to step
   ``t`` first, in the background (``sync``);
2. the keys ``0..q-1`` are split across ready boards by throughput, late, lost and
   refused shards are reassigned, duplicates must agree, audits catch a lying board
   (``collect``);
3. the pure step (``qsched.zo.step``) turns the losses into the update's coefficients;
   the daemon applies the update to its own copy and sends ``ApplyUpdate`` to every
   board, pipelined with the next step's requests where it may (``update``);
4. every ``eval_every`` steps validation runs data-parallel on the boards or in the
   daemon (``validate``); the policy hears about the step and the validation; metrics,
   events and checkpoints follow (here: the job's lifecycle).

Every background task of the job is a child of its ``JobTasks`` group, so none
outlives ``run``. The engine computes exactly what ``qsched.zo.trainer.train_zo``
computes, so a fleet run ends with the same weights as the single-process reference.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict

from qsched.daemon.checkpoints import checkpoint_of, restore_checkpoint
from qsched.daemon.engine.collect import KeyCollector
from qsched.daemon.engine.context import (
    EngineConfig,
    Interrupted,
    JobContext,
    JobError,
    JobResult,
    JobTasks,
    log,
)
from qsched.daemon.engine.sync import BoardSync
from qsched.daemon.engine.update import UpdateSender
from qsched.daemon.engine.validate import Validator
from qsched.daemon.fleet import BoardSession, Fleet, FleetEvent
from qsched.daemon.state import Checkpoint, JobDir
from qsched.policies import PolicyError, checked_lr_scale, checked_q, create_policy
from qsched.protocol.control import Event
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.messages import job_id_of
from qsched.protocol.states import JobState, check_job_transition
from qsched.zo.spsa import LossError
from qsched.zo.step import EvalRecord, StepRecord, checkpoint_due, settle_step, validates_after
from qsched.zo.trainer import TrainResult, policy_context
from qsched.zo.workload import TrainState, Workload

__all__ = ["StepEngine", "fleet_event"]


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
        self._context = policy_context(spec, self.workload)
        if resume is not None:
            result, self.policy_spec = restore_checkpoint(spec, resume)
            self.policy = create_policy(self.policy_spec, self._context)
            self.policy.load_state_dict(result.policy_state)
        else:
            self.policy_spec = spec.policy
            self.policy = create_policy(spec.policy, self._context)
            result = TrainResult(spec, self.workload.initial_state(), self.policy.state_dict())
        self.ctx = JobContext(
            spec,
            fleet,
            self.config,
            self.workload,
            self.job_id,
            result,
            JobTasks(spec.name),
            on_event,
        )
        self.job_state: JobState = "pending"
        self.last_checkpoint: str | None = None
        self._sync = BoardSync(self.ctx)
        self._collector = KeyCollector(self.ctx, self._sync)
        self._updates = UpdateSender(self.ctx)
        self._validator = Validator(self.ctx)
        self._resume = asyncio.Event()
        self._resume.set()
        self._checkpoint_waiters: list[asyncio.Future[str]] = []
        self._new_policy: PolicySpec | None = None

    # ------------------------------------------------------------------ what it shows

    @property
    def result(self) -> TrainResult:
        """The run so far: weights, policy state, history."""
        return self.ctx.result

    @property
    def state(self) -> TrainState:
        """The daemon's copy of the weights (at the next step to run)."""
        return self.ctx.state

    @property
    def step(self) -> int:
        """The next step to run."""
        return self.ctx.step

    @property
    def status_line(self) -> str:
        """One line for ``status``: the step and q, a wait, or how the job ended."""
        return self.ctx.status_line

    @property
    def faults(self) -> int:
        """Boards marked faulty during this job."""
        return self.ctx.faults

    @property
    def reassigned(self) -> int:
        """Keys given to another board after a late, lost or refused shard."""
        return self.ctx.reassigned

    @property
    def work(self) -> dict[str, int]:
        """Keys evaluated per board id."""
        return self.ctx.work

    def workers(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[BoardSession]:
        """Boards that may get work now: ready at this step, not draining, not excluded."""
        return self.ctx.workers(exclude)

    # ------------------------------------------------------------------ control

    def pause(self) -> None:
        """Pause after the current step (a pending job starts paused)."""
        if self.job_state == "pending":
            self._set_job_state("running")
        self._set_job_state("paused")
        self._resume.clear()
        self.ctx.status_line = "paused"

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
        ctx = self.ctx
        ctx.shutdown = ctx.shutdown or shutdown
        ctx.stopping.set()
        self._resume.set()
        if ctx.shutdown and ctx.going_down is not None and not ctx.going_down.done():
            ctx.going_down.set_result(None)  # wakes a step waiting for answers

    def change_policy(self, policy: PolicySpec) -> None:
        """Switch the q policy from the next step on (validated here, applied between steps)."""
        create_policy(policy, self._context)  # raises PolicyError when invalid
        self._new_policy = policy

    def request_checkpoint(self) -> asyncio.Future[str]:
        """A checkpoint after the current step; the future gives its path."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._checkpoint_waiters.append(future)
        if self.ctx.safe_point:  # paused or waiting for boards: no step is half done
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
        self.ctx.emit("job_resumed" if resumed else "job_started", message=f"at step {self.step}")
        started = time.perf_counter()
        try:
            async with self.ctx.tasks:
                await self._steps()
        except JobError as exc:
            self._finish_failed(exc, started)
            raise
        except Exception as exc:
            self._finish_failed(JobError("internal", f"{type(exc).__name__}: {exc}"), started)
            raise JobError("internal", f"{type(exc).__name__}: {exc}") from exc
        self.result.wall_s += time.perf_counter() - started
        return self._finish()

    async def _steps(self) -> None:
        """The step loop; on any way out, the job's requests and loads are ended."""
        try:
            while self.step < self.spec.steps and not self.ctx.stopping.is_set():
                await self._between_steps()
                if self.ctx.stopping.is_set():
                    break
                try:
                    await self._step()
                except Interrupted:  # stopped while no board could finish the step
                    break
                self._after_step()
        except BaseException:
            self._updates.drop()
            await self._sync.cancel()
            raise
        await self._updates.finish()
        await self._sync.cancel()

    def _finish(self) -> JobResult:
        self.result.policy_state = self.policy.state_dict()
        self._write_checkpoint()
        if self.step >= self.spec.steps:
            self._set_job_state("completed")
            self.ctx.emit("job_completed", message=f"{self.step} steps")
        elif not self.ctx.shutdown:
            self._set_job_state("stopped")
            self.ctx.emit("job_stopped", message=f"at step {self.step}")
        self.ctx.status_line = self.job_state
        self._settle_checkpoints()
        return JobResult(
            self.job_state,
            self.result,
            self.faults,
            self.reassigned,
            self.policy_spec,
            dict(self.work),
            self.ctx.split_steps,
        )

    def _finish_failed(self, exc: JobError, started: float) -> None:
        self.result.wall_s += time.perf_counter() - started
        log.error("job failed", job=self.spec.name, reason=exc.reason, detail=exc.detail)
        self._set_job_state("failed")
        self.ctx.status_line = f"failed: {exc}"
        self.ctx.emit("job_failed", message=str(exc))
        for future in self._checkpoint_waiters:
            if not future.done():
                future.set_exception(exc)
        self._checkpoint_waiters.clear()

    async def _between_steps(self) -> None:
        if not self._resume.is_set():
            self.ctx.emit("job_paused", message=f"at step {self.step}")
            with self.ctx.at_safe_point():
                await self._resume.wait()
            if not self.ctx.stopping.is_set():
                self.ctx.emit("job_resumed", message=f"at step {self.step}")
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
        self.ctx.emit("policy_changed", message=f"{policy.name} from step {self.step}")

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
        self.ctx.emit("checkpoint", message=str(path))

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
        t, q = self.step, self._policy_q()
        self.ctx.status_line = f"step {t}/{self.spec.steps} q={q}"
        await self._sync.sync_boards()
        losses = await self._collector.collect(t, q, self._updates.take_prefetch(t, q))
        try:
            settled = settle_step(
                self.spec, t, q, losses, self.result.forward_passes, self._policy_lr_scale(q)
            )
        except LossError as exc:
            raise JobError("numeric", str(exc)) from exc
        self.policy.on_step(settled.report)
        validate = validates_after(self.spec, t)
        new_state = await self._apply(t, settled.pairs, validate)
        record = settled.record
        self.result.state = new_state
        self.result.forward_passes = record.forward_passes
        self.result.steps.append(record)
        self._log_step(record)
        if validate:
            evaluation = await self._validator.validate(t)
            self.result.evals.append(evaluation)
            self.policy.on_eval(evaluation.report())
            self._log_eval(evaluation)

    async def _apply(self, t: int, pairs: list[tuple[int, float]], validate: bool) -> TrainState:
        """The daemon's own update and every board's; returns the daemon's new weights."""
        if not self._may_pipeline(validate):
            new_state = await asyncio.to_thread(self.workload.apply_update, self.state, t, pairs)
            await self._updates.broadcast(t, pairs, new_state.checksum())
            return new_state
        # The policy knows step t, so q of t+1 is known: its requests go right behind
        # the update (boards take messages in order) and the acks are checked with them.
        expected: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        try:
            await self._updates.send_with_next(t, pairs, self._policy_q(), expected)
            # Only now: a computing thread holds the GIL and would delay the sends. And
            # only once a board acknowledged the update: where boards (virtual ones, a
            # bridge) share the daemon's cores, this computation no longer competes with
            # them while they apply it and start step t+1's work (on two cores, 128
            # boards behind two hosts: 0.8 ms a step). Nothing needs it before an ack is
            # checked, and acks and results wait for it.
            await self._updates.first_ack()
            new_state = await asyncio.to_thread(self.workload.apply_update, self.state, t, pairs)
            expected.set_result(new_state.checksum())
        finally:
            if not expected.done():
                expected.cancel()
        return new_state

    def _policy_q(self) -> int:
        """The policy's q, checked (a plugin's q of 10^12 would exhaust the daemon)."""
        try:
            return checked_q(self.policy)
        except PolicyError as exc:
            raise JobError("policy", str(exc)) from exc

    def _policy_lr_scale(self, q: int) -> float:
        """The policy's learning-rate factor for a step at ``q``, checked like its q."""
        try:
            return checked_lr_scale(self.policy, q)
        except PolicyError as exc:
            raise JobError("policy", str(exc)) from exc

    def _may_pipeline(self, validate: bool) -> bool:
        """Whether step t+1's requests may go out with step t's update: not before a
        validation or the last step, nor while a stop, pause, policy change or checkpoint
        waits for the step to end (those want a whole step, and may change q)."""
        return (
            self.config.pipeline
            and not validate
            and not self.ctx.stopping.is_set()
            and self._resume.is_set()
            and self._new_policy is None
            and not self._checkpoint_waiters
        )

    def _log_step(self, record: StepRecord) -> None:
        metrics = {
            "q": float(record.q),
            "train_loss": record.train_loss,
            "forward_passes": float(record.forward_passes),
        }
        if self.job_dir is not None:
            self.job_dir.append_metrics({"kind": "step", "time": time.time(), **asdict(record)})
        self.ctx.emit("step", step=record.step, metrics=metrics)

    def _log_eval(self, evaluation: EvalRecord) -> None:
        metrics = {"val_loss": evaluation.val_loss, "val_accuracy": evaluation.val_accuracy}
        if self.job_dir is not None:
            self.job_dir.append_metrics(
                {"kind": "validation", "time": time.time(), **asdict(evaluation)}
            )
        self.ctx.emit("validation", step=evaluation.step, metrics=metrics)


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
