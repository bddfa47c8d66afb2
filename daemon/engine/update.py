"""The update of a step: ``ApplyUpdate`` to every board, acks checked, and pipelining.

The daemon applies the update to its own copy and sends ``ApplyUpdate`` to every board
at step ``t``; a board whose checksum differs is resynchronised (full weights) before it
gets work again. Pipelined (the default): once the policy has heard about step ``t``, q
of ``t+1`` is known, so each board gets step ``t+1``'s ``EvalRequest`` right behind the
update (boards take messages in order) and the acks are checked with the results — a
result counts only after its board's ack matched.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Final

from qsched.daemon.engine.collect import Flight, Flights
from qsched.daemon.engine.context import JobContext, fault_text
from qsched.daemon.engine.fleetcast import Fleetcast, wait_sent
from qsched.daemon.fleet import BoardFaultError, BoardSession, request_key
from qsched.protocol.messages import (
    ApplyUpdate,
    EvalRequest,
    EvalResult,
    EvalSliceRequest,
    EvalSliceResult,
    UpdateAck,
)

__all__ = ["FIRST_ACK_WAIT_S", "UpdateSender"]

# The longest the daemon waits for a board's ack before computing its own copy of an
# update (``UpdateSender.first_ack``): acks come within milliseconds when all is well.
FIRST_ACK_WAIT_S: Final = 0.05


class UpdateSender:
    """Sends each step's update and, pipelined, the next step's requests behind it.

    Args:
        ctx: the job's shared context.
    """

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        # Eval requests of the next step sent with the update: (step, q, flights).
        self._prefetch: tuple[int, int, Flights] | None = None
        self._first_ack = asyncio.Event()  # a board acknowledged the last update sent

    async def broadcast(self, t: int, pairs: list[tuple[int, float]], expected: int) -> None:
        """``ApplyUpdate(t)`` to every board at step t; wait for and check every ack."""
        ctx = self.ctx
        await self._settle_unverified()
        message = _update_message(ctx.job_id, t, pairs)
        targets = self._targets(t)
        cast = Fleetcast(ctx, message, {}, targets)
        acks = asyncio.gather(
            *(self._ack(s, message, cast.sent(s)) for s in targets), return_exceptions=True
        )
        cast.start()  # after the waiters: gather started them in order
        answers = await acks
        for session, answer in zip(targets, answers, strict=True):
            if isinstance(answer, UpdateAck) and answer.checksum == expected and answer.step == t:
                session.step = t + 1
                if session.state == "busy":
                    session.set_state("ready", "updated")
            elif isinstance(answer, UpdateAck):
                ctx.fault(
                    session, f"step {t}: checksum {answer.checksum:08x}, expected {expected:08x}"
                )
            elif isinstance(answer, BoardFaultError):
                ctx.fault(session, f"step {t} update: {answer.reason} {answer.detail}".strip())
            elif isinstance(answer, BaseException):
                raise answer

    async def send_with_next(
        self, t: int, pairs: list[tuple[int, float]], next_q: int, expected: asyncio.Future[int]
    ) -> None:
        """ApplyUpdate(t) to every board at step t and, right behind it on the same link,
        EvalRequests of step t+1 (keys ``0..next_q-1``) to those that may work; returns
        when every board's messages are sent (or failed to be)."""
        ctx = self.ctx
        await self._settle_unverified()
        message = _update_message(ctx.job_id, t, pairs)
        targets = self._targets(t)
        first_ack = self._first_ack = asyncio.Event()
        if not targets:
            first_ack.set()  # nobody will acknowledge it
        sent: list[asyncio.Future[None]] = []
        workers = [s for s in targets if s.state == "ready" and not s.draining]
        split = ctx.split(t + 1, next_q, workers)
        plan = ctx.plan(split, split.units, workers, audit=True, step=t + 1) if workers else {}
        requests = {a: ctx.eval_request(t + 1, units, split) for a, units in plan.items()}
        cast = Fleetcast(ctx, message, requests, targets)
        flights: Flights = {}
        now = asyncio.get_running_loop().time()
        for session in targets:
            session.step = t + 1  # as far as the daemon knows: a wrong ack takes it back
            request = requests.get(session.address)
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            sent.append(done)
            if request is None:
                ctx.unverified[session.address] = ctx.tasks.spawn(
                    self._update_only(
                        session, message, expected, done, cast.sent(session), first_ack
                    ),
                    f"fleet[{session.address}].update[{t}]",
                )
                continue
            units = tuple(plan[session.address])
            deadline = ctx.deadline(session, split.cost(units), now, split)
            flight = Flight(session, units, now, deadline)
            timeout = flight.deadline - now + ctx.config.step_deadline_s * 4
            task = ctx.tasks.spawn(
                self._update_then_eval(
                    session,
                    message,
                    request,
                    expected,
                    timeout,
                    done,
                    cast.sent(session),
                    first_ack,
                ),
                f"fleet[{session.address}].eval[{t + 1}]",
            )
            flights[task] = flight
            session.set_state("busy", "eval")
        cast.start()  # after every board's task: each registers its waiters first
        self._prefetch = (t + 1, next_q, flights)
        if sent:
            await asyncio.wait(sent)

    async def first_ack(self) -> None:
        """Until a board acknowledged the update ``send_with_next`` sent last, whatever
        its checksum; at most ``FIRST_ACK_WAIT_S`` (acks lost with the broker, say)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIRST_ACK_WAIT_S):
                await self._first_ack.wait()

    def take_prefetch(self, t: int, q: int) -> Flights:
        """The requests of step ``t`` with ``q`` keys already out with the last update
        (none: empty; their work units are numbered for that q)."""
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is None:
            return {}
        step, planned_q, flights = prefetch
        if (step, planned_q) == (t, q):
            return flights
        self._prefetch = prefetch  # not this step's: dropped as on a stop
        self.drop()
        return {}

    async def finish(self) -> None:
        """The job ends with the next step's requests out: wait for them (bounded) so the
        last update's acks are checked and no board is left computing, then forget them."""
        ctx = self.ctx
        prefetch, self._prefetch = self._prefetch, None
        if ctx.shutdown or prefetch is None:
            self._prefetch = prefetch
            self.drop()
            return
        flights = prefetch[2]
        if flights:
            loop = asyncio.get_running_loop()
            limit = max(f.deadline for f in flights.values()) - loop.time()
            done, _ = await asyncio.wait(flights, timeout=max(limit, ctx.config.reply_timeout_s))
            for task in done:
                session = flights.pop(task).session
                error = None if task.cancelled() else task.result().error
                if session.state == "busy":
                    session.set_state("ready", "answered")
                if isinstance(error, BoardFaultError):
                    ctx.fault(session, fault_text(error, f"step {ctx.step}"))
            self._prefetch = (prefetch[0], prefetch[1], flights)  # unanswered: dropped below
        if ctx.unverified:
            await asyncio.wait(list(ctx.unverified.values()), timeout=ctx.config.reply_timeout_s)
        self.drop()

    def drop(self) -> None:
        """The job leaves with requests of a step it will not run: cancel them; their
        boards hold updates nobody checked, so they are resynchronised before new work."""
        ctx = self.ctx
        if self._prefetch is not None:
            flights = self._prefetch[2]
            self._prefetch = None
            for task, flight in flights.items():
                task.cancel()
                if flight.session.state == "busy":
                    ctx.fault(flight.session, "request of a step that did not run")
        for address, ack in list(ctx.unverified.items()):
            if not ack.done():
                ack.cancel()
                session = ctx.fleet.sessions.get(address)
                if session is not None:
                    ctx.fault(session, "update ack not checked")
        ctx.unverified.clear()

    def _targets(self, t: int) -> list[BoardSession]:
        return [
            s
            for s in self.ctx.fleet.boards()
            if s.alive
            and s.state in ("ready", "busy")
            and s.job_id == self.ctx.job_id
            and s.step == t
        ]

    async def _update_then_eval(
        self,
        session: BoardSession,
        update: ApplyUpdate,
        request: EvalRequest | EvalSliceRequest,
        expected: asyncio.Future[int],
        timeout: float,
        sent: asyncio.Future[None],
        fleetcast: asyncio.Future[None] | None,
        first_ack: asyncio.Event,
    ) -> EvalResult | EvalSliceResult:
        """Send the update and the next step's request (or wait for the StepOrder that
        carries both); the result counts only after the update's ack matched the daemon's
        checksum (else ``BoardFaultError``)."""
        ack = session.expect(update)
        try:
            answer = session.expect(request)
        except BaseException:
            session.forget(("update", update.step), ack)
            _settle_none(sent)
            raise
        try:
            if fleetcast is None:
                await _send_in_order(session, update, request)
            else:
                await wait_sent(session, fleetcast)
        except BaseException:
            session.forget(("update", update.step), ack)
            session.forget(request_key(request), answer)
            raise
        finally:
            _settle_none(sent)
        try:
            reply = await session.reply(update, ack, self.ctx.config.reply_timeout_s)
            first_ack.set()
            await _check_ack(session, update.step, reply, expected)
            result = await session.reply(request, answer, timeout)
            return result  # type: ignore[return-value]  # keyed by step, slice and ks: the answer
        finally:
            session.forget(("update", update.step), ack)
            session.forget(request_key(request), answer)

    async def _update_only(
        self,
        session: BoardSession,
        update: ApplyUpdate,
        expected: asyncio.Future[int],
        sent: asyncio.Future[None],
        fleetcast: asyncio.Future[None] | None,
        first_ack: asyncio.Event,
    ) -> None:
        """A board without work in the next step: its ack is checked in the background."""
        ctx = self.ctx
        try:
            try:
                ack = await _send_update(session, update, fleetcast)
            finally:
                _settle_none(sent)
            try:
                reply = await session.reply(update, ack, ctx.config.reply_timeout_s)
                first_ack.set()
            finally:
                session.forget(("update", update.step), ack)
            await _check_ack(session, update.step, reply, expected)
        except BoardFaultError as exc:
            ctx.fault(session, fault_text(exc, f"step {update.step} update"))
        finally:
            ctx.unverified.pop(session.address, None)
        await ctx.fleet.notify_changed()  # it may take work now

    async def _ack(
        self, session: BoardSession, update: ApplyUpdate, fleetcast: asyncio.Future[None] | None
    ) -> Any:
        """The board's answer to ``update``, sent on its own or in a StepOrder."""
        ack = await _send_update(session, update, fleetcast)
        try:
            return await session.reply(update, ack, self.ctx.config.reply_timeout_s)
        finally:
            session.forget(("update", update.step), ack)

    async def _settle_unverified(self) -> None:
        """Wait for the update acks still being checked (normally all in already)."""
        if self.ctx.unverified:
            await asyncio.gather(*self.ctx.unverified.values(), return_exceptions=True)


def _update_message(job_id: int, t: int, pairs: list[tuple[int, float]]) -> ApplyUpdate:
    ks = tuple(k for k, _ in pairs)
    return ApplyUpdate(job_id=job_id, step=t, ks=ks, coefficients=tuple(c for _, c in pairs))


async def _check_ack(
    session: BoardSession, t: int, reply: Any, expected: asyncio.Future[int]
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


async def _send_update(
    session: BoardSession, update: ApplyUpdate, fleetcast: asyncio.Future[None] | None
) -> asyncio.Future[Any]:
    """Send ``update`` to one board, or wait for the StepOrder carrying it; the waiter of
    its ack is registered before anything is sent (release it with ``forget``)."""
    if fleetcast is None:
        return await session.send_expecting(update)
    ack = session.expect(update)
    try:
        await wait_sent(session, fleetcast)
    except BaseException:
        session.forget(("update", update.step), ack)
        raise
    return ack


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
