"""What every part of a job's step engine shares: the job's facts, its flags and its tasks.

The engine is split by concern (``sync``, ``collect``, ``update``, ``validate``, and the
job lifecycle in ``job``); each collaborator holds the one ``JobContext`` of its job and
nothing of the others. ``JobTasks`` is the job's ``TaskGroup``: every background task of
the job (board loads, shard requests, pipelined updates) is its child, so none outlives
the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar

import structlog

from qsched.daemon.errors import Interrupted, JobError
from qsched.daemon.fleet import BoardFaultError, BoardSession, Fleet
from qsched.daemon.planner import (
    StepSplit,
    ThroughputEstimate,
    choose_split,
    estimate_for,
    observe_split,
    plan_units,
)
from qsched.protocol.control import Event, EventKind
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.messages import PROTOCOL_VERSION, EvalRequest, EvalSliceRequest
from qsched.protocol.states import JobState
from qsched.zo.history import EvalHistory, StepHistory
from qsched.zo.trainer import TrainResult
from qsched.zo.workload import TrainState, Workload

__all__ = [
    "EngineConfig",
    "Interrupted",
    "JobContext",
    "JobError",
    "JobResult",
    "JobTasks",
    "Outcome",
    "fault_text",
    "planning_rates",
    "refused",
]

log = structlog.get_logger("qsched.engine")

T = TypeVar("T")


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
        split_batches: INT8 jobs may split a key's minibatch over several boards when
            the boards' measured rates say it shortens the step (SPEC 6.10); off: every
            board evaluates whole batches.
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
    split_batches: bool = True


@dataclass
class JobResult:
    """How a job ended: its status and the training result (state, policy, history)."""

    status: JobState
    train: TrainResult
    faults: int = 0
    reassigned: int = 0
    policy: PolicySpec | None = None
    work: dict[str, int] = field(default_factory=dict)  # keys evaluated per board id
    split_steps: int = 0  # steps whose batches were split over boards (SPEC 6.10)

    @property
    def state(self) -> TrainState:
        """The final weights."""
        return self.train.state

    @property
    def steps(self) -> StepHistory:
        """Per-step history."""
        return self.train.steps

    @property
    def evals(self) -> EvalHistory:
        """Per-validation history."""
        return self.train.evals


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What a child task of ``JobTasks`` ended with: its value, or the exception it raised."""

    value: T | None = None
    error: BaseException | None = None

    def get(self) -> T:
        """The value; the task's exception is raised here, in whoever awaited it."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


class JobTasks:
    """The job's ``TaskGroup``: every background task of one job, ended with the job.

    A child's exception must not cancel its siblings (a board's failed request is that
    board's fault, not the job's), so each child hands what it raised to whoever reads
    its ``Outcome``; only cancellation ends a child early. On exit every child still
    running is cancelled and awaited.
    """

    def __init__(self, job: str) -> None:
        self._job = job
        self._group: asyncio.TaskGroup | None = None
        self._children: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Self:
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel_all()
        assert self._group is not None
        group, self._group = self._group, None
        # The group hears of no exception of the body: it would wrap the job's own error
        # in an ExceptionGroup. It waits for the cancelled children; the error goes on.
        await group.__aexit__(None, None, None)

    def spawn(self, work: Awaitable[T], name: str) -> asyncio.Task[Outcome[T]]:
        """Start ``work`` as a child of the job.

        Args:
            work: the coroutine.
            name: the task's name (``fleet[board-07].eval[12]``).

        Returns:
            The task; its result is the ``Outcome`` of ``work``.

        Raises:
            RuntimeError: the job is not running (no task may outlive it).
        """
        if self._group is None:
            _close(work)
            raise RuntimeError(f"job {self._job!r} is not running: no task can start")
        task = self._group.create_task(_outcome(work), name=name)
        self._children.add(task)
        task.add_done_callback(self._children.discard)
        # A child cancelled before it ran never awaited its work: close it, quietly.
        task.add_done_callback(lambda done: _close(work) if done.cancelled() else None)
        return task

    def cancel_all(self) -> None:
        """Cancel every child still running."""
        for task in list(self._children):
            task.cancel()


def _close(work: Awaitable[Any]) -> None:
    if inspect.iscoroutine(work) and inspect.getcoroutinestate(work) == inspect.CORO_CREATED:
        work.close()


async def _outcome(work: Awaitable[T]) -> Outcome[T]:
    try:
        return Outcome(value=await work)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # handed to the reader: see JobTasks
        return Outcome(error=exc)


class JobContext:
    """The facts and flags of one running job that every engine part reads or sets.

    Args:
        spec: the job.
        fleet: the boards.
        config: timing and checking knobs.
        workload: the job's workload (the daemon's own copy of the model and data).
        job_id: the job's wire id.
        result: where the run stands (the daemon's weights, history, forward passes).
        tasks: the job's task group.
        on_event: called with every control-plane event.
    """

    def __init__(
        self,
        spec: JobSpec,
        fleet: Fleet,
        config: EngineConfig,
        workload: Workload,
        job_id: int,
        result: TrainResult,
        tasks: JobTasks,
        on_event: Callable[[Event], None] | None,
    ) -> None:
        self.spec, self.fleet, self.config, self.workload = spec, fleet, config, workload
        self.job_id, self.result, self.tasks = job_id, result, tasks
        self.on_event = on_event
        self.status_line = "pending"
        self.faults = 0
        self.reassigned = 0
        self.work: dict[str, int] = {}  # keys evaluated (on a whole batch or a slice)
        self.split_steps = 0
        self.stopping = asyncio.Event()
        self.shutdown = False
        self.safe_point = False  # True while no step is half done (checkpoints may run)
        # Boards whose update ack is not checked yet get no work meanwhile.
        self.unverified: dict[str, asyncio.Task[Outcome[None]]] = {}
        self.going_down: asyncio.Future[None] | None = None  # done on a shutdown stop
        self._splits: dict[int, StepSplit] = {}  # step -> its split, chosen once
        # The plan of every unit that choosing the last split computed, for the workers
        # it was chosen among: the step's first ``plan`` takes it instead of planning
        # again (once: later plans see other units or newer rates).
        self._chosen_plan: tuple[StepSplit, tuple[str, ...], dict[str, list[int]]] | None = None

    @property
    def state(self) -> TrainState:
        """The daemon's copy of the weights (at the next step to run)."""
        return self.result.state

    @property
    def step(self) -> int:
        """The next step to run."""
        return self.result.state.step

    @contextlib.contextmanager
    def at_safe_point(self) -> Iterator[None]:
        """While inside, nothing of the current step is applied: a checkpoint is whole."""
        self.safe_point = True
        try:
            yield
        finally:
            self.safe_point = False

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
            and s.address not in self.unverified
        ]

    def fault(self, session: BoardSession, reason: str) -> None:
        """Mark a board faulty (it is resynchronised before it gets work again)."""
        self.faults += 1
        self.fleet.mark_faulty(session, reason)

    def audit_step(self, t: int) -> bool:
        """Whether step ``t`` is audited (``audit_every``)."""
        every = self.config.audit_every
        return every > 0 and t % every == 0

    def split(self, t: int, q: int, workers: Sequence[BoardSession]) -> StepSplit:
        """How step ``t`` (``q`` keys) is cut into work units; chosen once per step, from
        the rates of ``workers``, and kept (a reassignment plans the same units). With no
        workers yet nothing is kept: the whole batch, until boards are there."""
        known = self._splits.get(t)
        if known is not None and known.q == q:
            return known
        if not workers:
            return StepSplit(q, self.spec.batch_size)
        split = StepSplit(q, self.spec.batch_size)
        if self.config.split_batches and self.workload.int8:
            split, plan = choose_split(
                q, self.spec.batch_size, lambda n: planning_rates(workers, n)
            )
            self._chosen_plan = (split, tuple(s.address for s in workers), plan)
        self.split_steps += split.parts > 1
        self._splits = {step: v for step, v in self._splits.items() if step >= t - 1}
        self._splits[t] = split
        return split

    def plan(
        self,
        split: StepSplit,
        missing: Sequence[int],
        workers: list[BoardSession],
        audit: bool,
        step: int | None = None,
    ) -> dict[str, list[int]]:
        """Units to boards by throughput; at an audit step, the shards of one slice
        overlap by one unit (a board alone on its slice is checked by the daemon)."""
        plan = self._take_chosen_plan(split, missing, workers)
        if plan is None:
            plan = plan_units(split, list(missing), planning_rates(workers, split.parts))
        step = self.step if step is None else step
        if not (audit and self.audit_step(step)):
            return plan
        groups: dict[int, list[str]] = {}
        for board in sorted(plan):
            groups.setdefault(split.part(plan[board][0]), []).append(board)
        for order in groups.values():
            if len(order) < 2:
                continue
            extra = {b: plan[order[(i - 1) % len(order)]][0] for i, b in enumerate(order)}
            for b in order:
                plan[b] = sorted({*plan[b], extra[b]})
        return plan

    def _take_chosen_plan(
        self, split: StepSplit, missing: Sequence[int], workers: list[BoardSession]
    ) -> dict[str, list[int]] | None:
        """The plan ``split`` computed while it was chosen, when this plan is of the same
        split, units and workers (the step's first); None otherwise. Used once."""
        chosen, self._chosen_plan = self._chosen_plan, None
        if chosen is None:
            return None
        chosen_split, addresses, plan = chosen
        same = (
            chosen_split is split
            and addresses == tuple(s.address for s in workers)
            and list(missing) == list(split.units)
        )
        return {board: list(units) for board, units in plan.items()} if same else None

    def eval_request(
        self, t: int, units: Sequence[int], split: StepSplit
    ) -> EvalRequest | EvalSliceRequest:
        """The request for ``units`` of step ``t`` (all of one slice)."""
        spec = self.spec
        fields: dict[str, object] = {
            "job_id": self.job_id,
            "step": t,
            "batch_size": spec.batch_size,
            "eps": spec.eps,
            "estimator": spec.estimator,
            "ks": tuple(sorted(split.key(u) for u in units)),
        }
        if split.parts == 1:
            return EvalRequest.model_validate(fields)
        (part,) = {split.part(u) for u in units}
        start, count = split.bounds(part)
        # Built at once, not as EvalSliceRequest.of an EvalRequest: one validation, not
        # two and a dump, for each of a large fleet's boards every step.
        fields |= {"slice_start": start, "slice_count": count}
        return EvalSliceRequest.model_validate(fields)

    def deadline(
        self, session: BoardSession, cost: float, now: float, split: StepSplit | None = None
    ) -> float:
        """When a shard of ``cost`` whole-batch keys sent now is late."""
        rate = throughput_of(session, split.parts if split else 1).rate
        expected = cost / max(rate, 1e-6)
        return now + max(self.config.step_deadline_s, self.config.deadline_factor * expected)

    def emit(
        self,
        kind: EventKind,
        *,
        step: int | None = None,
        message: str = "",
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Publish a control-plane event of this job."""
        if self.on_event is None:
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
            self.on_event(event)
        except Exception:  # a consumer's bug must not stop training
            log.exception("event handler failed", kind=kind)


def throughput_of(session: BoardSession, parts: int = 1) -> ThroughputEstimate:
    """The board's measured rate on whole batches or on slices (``estimate_for``)."""
    return estimate_for(session.throughput, session.slice_throughput, parts)


def planning_rates(workers: Sequence[BoardSession], parts: int = 1) -> dict[str, float]:
    """Each worker's throughput (whole-batch keys per second) on ``parts`` slices per key;
    a board never measured counts as the mean of the measured ones (its prior of 1 key/s
    would starve it of work for good next to measured boards)."""
    estimates = {s.address: throughput_of(s, parts) for s in workers}
    measured = [e.rate for e in estimates.values() if e.observations]
    prior = sum(measured) / len(measured) if measured else 1.0
    return {a: e.rate if e.observations else prior for a, e in estimates.items()}


def observe_throughput(
    session: BoardSession, split: StepSplit, units: Sequence[int], seconds: float
) -> None:
    """Fold one answered (or late) shard's time into the estimate of its kind."""
    observe_split(
        session.throughput, session.slice_throughput, split.parts, split.cost(units), seconds
    )


def fault_text(exc: BoardFaultError, where: str) -> str:
    """A fault's reason for the event log (an update mismatch names its own step)."""
    if exc.reason == "checksum":
        return exc.detail
    return f"{where}: {exc.reason} {exc.detail}".strip()


def refused(session: BoardSession) -> bool:
    """Whether the board speaks an older protocol than ours (it gets no job)."""
    return session.hello is not None and session.hello.protocol_version < PROTOCOL_VERSION
