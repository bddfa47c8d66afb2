"""Collecting a step's losses from the boards, with audits.

The keys ``0..q-1`` are split across ready boards in proportion to their measured
throughput, one ``EvalRequest`` each; in INT8 mode a key's batch may also be cut into
slices (``StepSplit``: the work units are then (key, slice) pairs, one
``EvalSliceRequest`` per board, and a key's loss is the floor of its slices' summed Q16
losses over B, the bits of one whole-batch answer). At an audit step one unit of every
shard is also evaluated by the next board of its slice. Answers later than the
deadline, lost with their board, or refused are reassigned to other boards, audited
the same way (a lone shard also carries a unit another board already answered); two
answers for the same unit must agree bit for bit — when they do not, the daemon
evaluates the unit itself and every board that disagrees with it is marked faulty, its
answers of this step dropped and its units reassigned. At an audit step every accepted
result (late ones too) must be confirmed: one of its units agreed with a second board
or with the daemon; before the update, the daemon evaluates one unit of each result
still unconfirmed. A lie shifts a whole result, so this catches it; a single flipped
loss (MQTT has no frame CRC) is caught only when it hits the audited unit.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from qsched.daemon.engine.context import (
    Interrupted,
    JobContext,
    Outcome,
    fault_text,
    log,
    observe_throughput,
)
from qsched.daemon.engine.sync import BoardSync
from qsched.daemon.fleet import BoardFaultError, BoardSession
from qsched.daemon.planner import StepSplit
from qsched.protocol.messages import EvalResult, EvalSliceResult
from qsched.zo.intloss import sliced_batch_loss
from qsched.zo.spsa import LossPairs, LossSums

__all__ = ["Flight", "Flights", "KeyCollector"]

_IDLE_MIN_S: Final = 0.02  # first back-off of a round that could dispatch nothing
_IDLE_MAX_S: Final = 1.0


@dataclass
class Flight:
    """One outstanding EvalRequest or EvalSliceRequest: its work units (``StepSplit``)."""

    session: BoardSession
    ks: tuple[int, ...]
    sent: float
    deadline: float
    late: bool = False


Answer = EvalResult | EvalSliceResult
# The requests of one step in flight: task (its Outcome holds the answer) -> request.
Flights = dict["asyncio.Task[Outcome[Answer]]", Flight]
# A unit's value: whole-batch losses (L+, L-) as float32, or a slice's Q16 sums.
Value = tuple[float, float | None] | tuple[int, int | None]


@dataclass
class _Collected:
    """Losses of one step gathered so far and who said what."""

    values: dict[int, Value] = field(default_factory=dict)  # unit -> value
    sources: dict[int, set[str]] = field(default_factory=dict)  # unit -> addresses
    base: dict[int, float | int] = field(default_factory=dict)  # one-sided: slice -> L0
    excluded: set[str] = field(default_factory=set)  # addresses out of this step
    checked: set[int] = field(default_factory=set)  # units whose value the daemon computed
    # accepted results (address, ks)
    groups: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def confirmed(self, ks: Sequence[int]) -> bool:
        """Whether a result with keys ``ks`` was audited: one of its keys agrees with a
        second board's answer or was computed by the daemon."""
        return any(k in self.checked or len(self.sources.get(k, ())) >= 2 for k in ks)


class KeyCollector:
    """Gathers the verified losses of one step at a time.

    Args:
        ctx: the job's shared context.
        sync: loads boards while none can work.
    """

    def __init__(self, ctx: JobContext, sync: BoardSync) -> None:
        self.ctx = ctx
        self.sync = sync

    async def collect(self, t: int, q: int, flights: Flights) -> LossPairs:
        """Gather verified losses for keys 0..q-1 of step t.

        Args:
            t: the step.
            q: its number of perturbations.
            flights: requests of step t already out (pipelined with the last update).

        Returns:
            The losses.

        Raises:
            Interrupted: a stop arrived before the step could finish.
        """
        got = _Collected()
        split = self.ctx.split(t, q, self.ctx.workers())
        first = not flights  # the first plan (with its audit) went out with the last update
        idle_rounds = 0
        try:
            while True:
                if first:  # nothing out yet: the split follows the boards there now
                    split = self.ctx.split(t, q, self.ctx.workers())
                missing = [u for u in split.units if u not in got.values]
                covered = {k for f in flights.values() if not f.late for k in f.ks}
                uncovered = [k for k in missing if k not in covered]
                if not missing and not any(not f.late for f in flights.values()):
                    if await self._confirm_rest(t, split, got):
                        continue  # a result failed the daemon's check: its keys are missing again
                    return self._losses(got, split)
                if self.ctx.stopping.is_set() and self.ctx.shutdown:
                    raise Interrupted  # nothing of step t is applied: it runs again on resume
                if uncovered:
                    await self._dispatch(t, split, uncovered, got, flights, first=first)
                    first = False
                if not flights:
                    # Nobody could take the keys (every board failed at once): wait, never spin.
                    idle_rounds += 1
                    await self._idle(t, idle_rounds)
                    continue
                idle_rounds = 0
                await self._await_some(t, split, got, flights)
        finally:
            for task, flight in flights.items():
                task.cancel()
                if flight.session.state == "busy":
                    # Still computing a shard nobody waits for: resynchronise it before new work.
                    self.ctx.fault(flight.session, f"step {t}: no answer before the deadline")

    async def _idle(self, t: int, rounds: int) -> None:
        """A round dispatched nothing: back off (capped, jittered) and say so in the status."""
        ctx = self.ctx
        if ctx.stopping.is_set():
            raise Interrupted
        ctx.status_line = f"waiting for boards (step {t}/{ctx.spec.steps})"
        delay = min(_IDLE_MAX_S, _IDLE_MIN_S * 2 ** min(rounds - 1, 16)) * random.uniform(0.5, 1.0)
        if rounds == 1:
            log.warning("no board could take work; backing off", job=ctx.spec.name, step=t)
        with ctx.at_safe_point():  # nothing of step t is applied yet
            await asyncio.sleep(_IDLE_MIN_S / 2)  # a burst of fleet news must not make a busy loop
            await ctx.fleet.wait_changed(delay)

    async def _dispatch(
        self,
        t: int,
        split: StepSplit,
        keys: list[int],
        got: _Collected,
        flights: Flights,
        first: bool,
    ) -> None:
        ctx = self.ctx
        busy = {f.session.address for f in flights.values()}
        workers = ctx.workers(got.excluded | busy)
        if not workers:
            if flights:
                return  # someone is still working (late answers count too): wait for them
            found = await self.sync.wait_for_workers()
            workers = [w for w in found if w.address not in got.excluded]
            if not workers:
                got.excluded.clear()  # everyone failed once this step: give all another chance
                return
        if not first:
            ctx.reassigned += len(keys)
        now = asyncio.get_running_loop().time()
        by_address = {w.address: w for w in workers}
        for address, units in self._audited_plan(t, split, keys, workers, got).items():
            session = by_address[address]
            request = ctx.eval_request(t, units, split)
            deadline = ctx.deadline(session, split.cost(units), now, split)
            flight = Flight(session, tuple(units), now, deadline)
            timeout = flight.deadline - now + ctx.config.step_deadline_s * 4
            # The waiter is keyed by the request's step and ks: only an EvalResult answers it.
            task = ctx.tasks.spawn(_eval(session, request, timeout), f"fleet[{address}].eval[{t}]")
            flights[task] = flight
            session.set_state("busy", "eval")

    def _audited_plan(
        self,
        t: int,
        split: StepSplit,
        keys: list[int],
        workers: list[BoardSession],
        got: _Collected,
    ) -> dict[str, list[int]]:
        """Every dispatch is audited, reassignments too: shards overlap by one unit, and a
        lone shard also carries a unit of its slice another board already answered (when
        there is one)."""
        plan = self.ctx.plan(split, keys, workers, audit=True)
        if len(plan) == 1 and self.ctx.audit_step(t):
            ((address, ks),) = plan.items()
            part = split.part(ks[0])
            known = next(
                (
                    k
                    for k in sorted(got.values)
                    if got.sources.get(k)
                    and address not in got.sources[k]
                    and split.part(k) == part
                ),
                None,
            )
            if known is not None:
                plan[address] = sorted({*ks, known})
        return plan

    async def _confirm_rest(self, t: int, split: StepSplit, got: _Collected) -> bool:
        """At an audit step, the daemon checks one key of every result no second board
        confirmed (its audit partner was lost, late or alone). Returns whether one failed."""
        if not self.ctx.audit_step(t):
            return False
        open_groups = [g for g in got.groups if not got.confirmed(g[1])]
        if not open_groups:
            return False
        keys = sorted({ks[0] for _, ks in open_groups})
        log.info(
            "daemon audits unconfirmed results",
            job=self.ctx.spec.name,
            step=t,
            results=len(open_groups),
        )
        liars = await self._daemon_truth(t, split, keys, got)
        self._drop_liars(t, liars, got, keep=set(keys))
        return bool(liars)

    async def _daemon_truth(
        self, t: int, split: StepSplit, units: list[int], got: _Collected
    ) -> set[str]:
        """The daemon computes ``units``; their values become its own. Returns the
        addresses whose accepted values disagree with it."""
        liars: set[str] = set()
        by_part: dict[int, list[int]] = {}
        for unit in units:
            by_part.setdefault(split.part(unit), []).append(unit)
        for part, members in sorted(by_part.items()):
            truth, base = await self._daemon_values(t, split, part, members)
            for unit, true_value in truth.items():
                if unit in got.values and got.values[unit] != true_value:
                    liars |= got.sources.get(unit, set())
                got.values[unit] = true_value
                got.sources[unit] = set()
                got.checked.add(unit)
            if base is not None:
                got.base[part] = base
        return liars

    async def _daemon_values(
        self, t: int, split: StepSplit, part: int, units: list[int]
    ) -> tuple[dict[int, Value], float | int | None]:
        """The daemon's own values of ``units`` (all of slice ``part``), and L0 (one-sided)."""
        ctx = self.ctx
        keys = [split.key(u) for u in units]
        two_sided = ctx.spec.estimator == "two_sided"
        truth: LossPairs | LossSums
        if split.parts == 1:
            truth = await asyncio.to_thread(ctx.workload.perturbed_losses, ctx.state, t, keys)
        else:
            start, count = split.bounds(part)
            truth = await asyncio.to_thread(
                ctx.workload.perturbed_loss_sums, ctx.state, t, keys, start, count
            )
        values: dict[int, Value] = {
            u: (truth.plus[k], truth.minus[k] if two_sided else None)
            for u, k in zip(units, keys, strict=True)
        }
        return values, None if two_sided else truth.base

    def _drop_liars(self, t: int, liars: set[str], got: _Collected, keep: set[int]) -> None:
        for address in liars:
            _drop_board_values(address, got, keep=keep)
            liar = self.ctx.fleet.sessions.get(address)
            if liar is not None:
                self.ctx.fault(liar, f"step {t}: losses disagree with the daemon's")

    async def _await_some(
        self, t: int, split: StepSplit, got: _Collected, flights: Flights
    ) -> None:
        ctx = self.ctx
        loop = asyncio.get_running_loop()
        pending_deadlines = [f.deadline for f in flights.values() if not f.late]
        timeout = max(0.0, min(pending_deadlines) - loop.time()) if pending_deadlines else None
        if ctx.going_down is None:
            ctx.going_down = loop.create_future()
        # A shutdown does not wait for the answers: the step runs again after the restart.
        waiters: list[asyncio.Future[Any]] = [*flights, ctx.going_down]
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        now = loop.time()
        for waiter in done:
            if waiter is ctx.going_down:
                continue
            task: asyncio.Task[Outcome[Answer]] = waiter  # type: ignore[assignment]
            flight = flights.pop(task)
            await self._on_answer(t, split, task, flight, got, now)
        for flight in flights.values():
            if not flight.late and now >= flight.deadline:
                flight.late = True
                got.excluded.add(flight.session.address)
                observe_throughput(flight.session, split, flight.ks, now - flight.sent)
                log.warning(
                    "shard late; reassigning",
                    board=flight.session.board_id,
                    step=t,
                    ks=len(flight.ks),
                )

    async def _on_answer(
        self,
        t: int,
        split: StepSplit,
        task: asyncio.Task[Outcome[Answer]],
        flight: Flight,
        got: _Collected,
        now: float,
    ) -> None:
        ctx = self.ctx
        session = flight.session
        if session.state == "busy":
            session.set_state("ready", "answered")
        try:
            result = task.result().get()
            units = self._check_result(result, t, split, flight)
        except BoardFaultError as exc:
            got.excluded.add(session.address)
            ctx.fault(session, fault_text(exc, f"step {t}"))
            return
        ctx.work[session.board_id] = ctx.work.get(session.board_id, 0) + len(result.ks)
        if not flight.late:  # a late answer still counts (and is checked), its time does not
            observe_throughput(session, split, flight.ks, max(now - flight.sent, 1e-6))
        await self._accept(t, split, session, result, units, got)

    def _check_result(
        self, result: Answer, t: int, split: StepSplit, flight: Flight
    ) -> tuple[int, ...]:
        """The result's work units, after checking it answers the flight's request."""
        ctx = self.ctx
        board = flight.session.board_id
        if (
            not isinstance(result, EvalResult | EvalSliceResult)
            or result.step != t
            or result.job_id != ctx.job_id
        ):
            raise BoardFaultError(board, "wrong_answer", "result for another job or step")
        part = 0
        if isinstance(result, EvalSliceResult):
            found = split.part_of(result.slice_start, result.slice_count)
            if split.parts == 1 or found is None:
                raise BoardFaultError(board, "wrong_answer", "result for another slice")
            part = found
        elif split.parts != 1:
            raise BoardFaultError(board, "wrong_answer", "whole-batch result for a slice")
        units = tuple(split.unit(k, part) for k in result.ks)
        if units != flight.ks or result.estimator != ctx.spec.estimator:
            raise BoardFaultError(board, "wrong_answer", "result for other keys")
        return units

    async def _accept(
        self,
        t: int,
        split: StepSplit,
        session: BoardSession,
        result: Answer,
        units: tuple[int, ...],
        got: _Collected,
    ) -> None:
        theirs, base = _result_values(result, units)
        conflicts: list[int] = []
        for unit, value in theirs.items():
            if unit in got.values and got.values[unit] != value:
                conflicts.append(unit)
                continue
            got.values.setdefault(unit, value)
            got.sources.setdefault(unit, set()).add(session.address)
        if base is not None:
            part = split.part(units[0])
            if part in got.base and got.base[part] != base:
                conflicts.append(units[0])
            got.base.setdefault(part, base)
        liars = (
            await self._arbitrate(t, split, conflicts, session, theirs, got) if conflicts else set()
        )
        if session.address not in liars:
            got.groups.append((session.address, units))

    async def _arbitrate(
        self,
        t: int,
        split: StepSplit,
        units: list[int],
        session: BoardSession,
        theirs: dict[int, Value],
        got: _Collected,
    ) -> set[str]:
        """Two boards disagree: the daemon evaluates the units and the wrong side is
        faulty. Returns the addresses found lying."""
        liars = await self._daemon_truth(t, split, units, got)
        if any(theirs[u] != got.values[u] for u in units):
            liars.add(session.address)
        self._drop_liars(t, liars, got, keep=set(units))
        return liars

    def _losses(self, got: _Collected, split: StepSplit) -> LossPairs:
        """The step's losses per key; sliced keys from their summed slices (SPEC 6.10)."""
        two_sided = self.ctx.spec.estimator == "two_sided"
        if split.parts == 1:
            plus = {k: float(got.values[k][0]) for k in range(split.q)}
            if two_sided:
                minus = {k: float(got.values[k][1]) for k in range(split.q)}  # type: ignore[arg-type]
                return LossPairs(plus=plus, minus=minus)
            return LossPairs(plus=plus, minus={}, base=float(got.base[0]))
        parts = range(split.parts)

        def whole(side: int, k: int) -> float:
            sums = [got.values[split.unit(k, p)][side] for p in parts]
            return float(
                sliced_batch_loss([int(v) for v in sums if v is not None], split.batch_size)
            )

        plus = {k: whole(0, k) for k in range(split.q)}
        if two_sided:
            return LossPairs(plus=plus, minus={k: whole(1, k) for k in range(split.q)})
        base = sliced_batch_loss([int(got.base[p]) for p in parts], split.batch_size)
        return LossPairs(plus=plus, minus={}, base=float(base))


def _result_values(result: Answer, units: tuple[int, ...]) -> tuple[dict[int, Value], Any]:
    """Each unit's value in a result, and its L0 (one-sided; None two-sided)."""
    two_sided = result.estimator == "two_sided"
    if isinstance(result, EvalSliceResult):
        sliced: dict[int, Value] = {
            u: (result.sum_plus[i], result.sum_minus[i] if two_sided else None)
            for i, u in enumerate(units)
        }
        return sliced, result.sum_zero
    whole: dict[int, Value] = {
        u: (result.loss_plus[i], result.loss_minus[i] if two_sided else None)
        for i, u in enumerate(units)
    }
    return whole, result.loss_zero


async def _eval(session: BoardSession, request: Any, timeout: float) -> Answer:
    result = await session.request(request, timeout)
    return result  # type: ignore[return-value]  # keyed by step, slice and ks: the answer


def _drop_board_values(address: str, got: _Collected, keep: set[int]) -> None:
    got.excluded.add(address)
    got.groups = [g for g in got.groups if g[0] != address]
    for k, sources in list(got.sources.items()):
        if address in sources:
            sources.discard(address)
            if not sources and k not in keep:
                del got.values[k]
                del got.sources[k]
