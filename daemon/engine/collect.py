"""Collecting a step's losses from the boards, with audits.

The keys ``0..q-1`` are split across ready boards in proportion to their measured
throughput, one ``EvalRequest`` each; at an audit step one key of every shard is also
evaluated by the next board. Answers later than the deadline, lost with their board, or
refused are reassigned to other boards, audited the same way (a lone shard also carries
a key another board already answered); two answers for the same key must agree bit for
bit — when they do not, the daemon evaluates the key itself and every board that
disagrees with it is marked faulty, its answers of this step dropped and its keys
reassigned. At an audit step every accepted result (late ones too) must be confirmed:
one of its keys agreed with a second board or with the daemon; before the update, the
daemon evaluates one key of each result still unconfirmed. A lie shifts a whole result,
so this catches it; a single flipped loss (MQTT has no frame CRC) is caught only when it
hits the audited key.
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
)
from qsched.daemon.engine.sync import BoardSync
from qsched.daemon.fleet import BoardFaultError, BoardSession
from qsched.protocol.messages import EvalResult
from qsched.zo.spsa import LossPairs

__all__ = ["Flight", "Flights", "KeyCollector"]

_IDLE_MIN_S: Final = 0.02  # first back-off of a round that could dispatch nothing
_IDLE_MAX_S: Final = 1.0


@dataclass
class Flight:
    """One outstanding EvalRequest."""

    session: BoardSession
    ks: tuple[int, ...]
    sent: float
    deadline: float
    late: bool = False


# The requests of one step in flight: task (its Outcome holds the answer) -> request.
Flights = dict["asyncio.Task[Outcome[EvalResult]]", Flight]


@dataclass
class _Collected:
    """Losses of one step gathered so far and who said what."""

    values: dict[int, tuple[float, float | None]] = field(default_factory=dict)
    sources: dict[int, set[str]] = field(default_factory=dict)  # k -> addresses
    base: float | None = None
    excluded: set[str] = field(default_factory=set)  # addresses out of this step
    checked: set[int] = field(default_factory=set)  # keys whose value the daemon computed
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
                if self.ctx.stopping.is_set() and self.ctx.shutdown:
                    raise Interrupted  # nothing of step t is applied: it runs again on resume
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
        self, t: int, keys: list[int], got: _Collected, flights: Flights, first: bool
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
        for address, ks in self._audited_plan(t, keys, workers, got).items():
            session = by_address[address]
            request = ctx.eval_request(t, ks)
            flight = Flight(session, request.ks, now, ctx.deadline(session, len(ks), now))
            timeout = flight.deadline - now + ctx.config.step_deadline_s * 4
            # The waiter is keyed by the request's step and ks: only an EvalResult answers it.
            task = ctx.tasks.spawn(_eval(session, request, timeout), f"fleet[{address}].eval[{t}]")
            flights[task] = flight
            session.set_state("busy", "eval")

    def _audited_plan(
        self, t: int, keys: list[int], workers: list[BoardSession], got: _Collected
    ) -> dict[str, list[int]]:
        """Every dispatch is audited, reassignments too: shards overlap by one key, and a
        lone shard also carries a key another board already answered (when there is one)."""
        plan = self.ctx.plan(keys, workers, audit=True)
        if len(plan) == 1 and self.ctx.audit_step(t):
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

    async def _confirm_rest(self, t: int, got: _Collected) -> bool:
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
        liars = await self._daemon_truth(t, keys, got)
        self._drop_liars(t, liars, got, keep=set(keys))
        return bool(liars)

    async def _daemon_truth(self, t: int, keys: list[int], got: _Collected) -> set[str]:
        """The daemon computes ``keys``; their values become its own. Returns the
        addresses whose accepted values disagree with it."""
        ctx = self.ctx
        truth = await asyncio.to_thread(ctx.workload.perturbed_losses, ctx.state, t, keys)
        two_sided = ctx.spec.estimator == "two_sided"
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
            _drop_board_values(address, got, keep=keep)
            liar = self.ctx.fleet.sessions.get(address)
            if liar is not None:
                self.ctx.fault(liar, f"step {t}: losses disagree with the daemon's")

    async def _await_some(self, t: int, got: _Collected, flights: Flights) -> None:
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
            task: asyncio.Task[Outcome[EvalResult]] = waiter  # type: ignore[assignment]
            flight = flights.pop(task)
            await self._on_answer(t, task, flight, got, now)
        for flight in flights.values():
            if not flight.late and now >= flight.deadline:
                flight.late = True
                got.excluded.add(flight.session.address)
                flight.session.throughput.observe(len(flight.ks), now - flight.sent)
                log.warning(
                    "shard late; reassigning",
                    board=flight.session.board_id,
                    step=t,
                    ks=len(flight.ks),
                )

    async def _on_answer(
        self,
        t: int,
        task: asyncio.Task[Outcome[EvalResult]],
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
            self._check_result(result, t, flight)
        except BoardFaultError as exc:
            got.excluded.add(session.address)
            ctx.fault(session, fault_text(exc, f"step {t}"))
            return
        ctx.work[session.board_id] = ctx.work.get(session.board_id, 0) + len(result.ks)
        if not flight.late:  # a late answer still counts (and is checked), its time does not
            session.throughput.observe(len(flight.ks), max(now - flight.sent, 1e-6))
        await self._accept(t, session, result, got)

    def _check_result(self, result: EvalResult, t: int, flight: Flight) -> None:
        ctx = self.ctx
        if not isinstance(result, EvalResult) or result.step != t or result.job_id != ctx.job_id:
            raise BoardFaultError(
                flight.session.board_id, "wrong_answer", "result for another job or step"
            )
        if tuple(result.ks) != flight.ks or result.estimator != ctx.spec.estimator:
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
        two_sided = self.ctx.spec.estimator == "two_sided"
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

    def _losses(self, got: _Collected, q: int) -> LossPairs:
        plus = {k: got.values[k][0] for k in range(q)}
        if self.ctx.spec.estimator == "two_sided":
            minus = {k: got.values[k][1] for k in range(q)}
            return LossPairs(plus=plus, minus=minus)  # type: ignore[arg-type]
        return LossPairs(plus=plus, minus={}, base=got.base)


async def _eval(session: BoardSession, request: Any, timeout: float) -> EvalResult:
    result = await session.request(request, timeout)
    return result  # type: ignore[return-value]  # keyed by step and ks: an EvalResult


def _drop_board_values(address: str, got: _Collected, keep: set[int]) -> None:
    got.excluded.add(address)
    got.groups = [g for g in got.groups if g[0] != address]
    for k, sources in list(got.sources.items()):
        if address in sources:
            sources.discard(address)
            if not sources and k not in keep:
                del got.values[k]
                del got.sources[k]
