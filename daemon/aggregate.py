"""A host's boards as one board: ``qsched bridge --aggregate NAME``.

The daemon's work per step grows with the boards it talks to: one request, one result
and one ack each. A host with many boards can instead present them as a single board
``NAME``: the aggregator fans every daemon message out to its member boards and folds
their answers into one, so the daemon's work grows with hosts, not boards.

- Loading (``JobConfig``, ``SelectDataset``, ``LoadModel``, ``SetWeights``) and
  ``ApplyUpdate`` go to every member. ``Loaded`` goes up once every member confirmed
  the same resource; an ``UpdateAck`` once every member reported a checksum, and only
  if all are equal. When members disagree the answer is ``Error(internal)`` naming the
  update, so the daemon resynchronises the host, every member with it: a diverged
  board is found (logged by id) and resynchronised, and the daemon still compares the
  one checksum with its own.
- ``EvalRequest`` keys are shared among the members by their measured throughput
  (``qsched.daemon.planner``); in INT8 mode, when members outnumber the keys, a key's
  batch is cut into slices (SPEC 6.10) and the slices' sums are folded into the
  whole-batch loss, bit for bit. An ``EvalSliceRequest`` is shared by keys. A member's
  refusal, loss or silence refuses the whole request (the daemon gives it elsewhere).
- ``ValidateRequest`` goes to the fastest member; ``Ping`` to the first, whose heartbeat
  answers for the host (its unsolicited heartbeats go up as the host's).
- A step order's update and eval request reach the host one right behind the other;
  they go to the members interleaved, each member's update right before its share, so
  the first member does not wait for every member's update before its share.
- Shares are prepared a step ahead. Once every member acknowledged an update, the
  host waits for their results with nothing to do, and the daemon's next order will
  most likely carry the eval request the host just shared, one step on. The host plans
  and encodes that request's shares then, on the rates measured so far, and sends
  them as they are when the order matches; anything else is planned on arrival.

The protocol is unchanged: to the daemon the host is one board of the summed speed.
Members are fixed when the aggregator starts; one whose link ends is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from qsched.daemon.fleet import error_matches, reply_key, request_key
from qsched.daemon.host_timeline import HostTimeline
from qsched.daemon.planner import ThroughputEstimate, estimate_for, observe_split
from qsched.daemon.shares import PreparedShares, carried, planned
from qsched.protocol.codec import STEP_SHARED_CODES, decode, decode_shared, encode
from qsched.protocol.errors import ProtocolError
from qsched.protocol.links.base import LinkClosedError, LinkError
from qsched.protocol.messages import (
    TYPE_CODES,
    ApplyUpdate,
    BoardErrorCode,
    DataMessage,
    Error,
    EvalRequest,
    EvalResult,
    EvalSliceRequest,
    EvalSliceResult,
    Heartbeat,
    Hello,
    JobConfig,
    LoadModel,
    Ping,
    Reset,
    SelectDataset,
    SetWeights,
    UpdateAck,
    ValidateRequest,
)
from qsched.zo.intloss import batch_losses_of_totals

__all__ = ["MEMBER_REPLY_TIMEOUT_S", "HostAggregator", "Member", "await_members"]

_log = structlog.get_logger("qsched.aggregate")

# How long the aggregator waits for a member's answer before refusing the request.
MEMBER_REPLY_TIMEOUT_S: Final = 60.0
_HELLO: Final = ("hello",)  # the waiter of a member's Hello after a Reset
_U32_MAX: Final = 2**32 - 1  # the largest step a message carries
_FANNED_OUT: Final = (JobConfig, SelectDataset, LoadModel, SetWeights, ApplyUpdate)
# After these the next eval request is not the last one a step on: a new job, data,
# model or weights.
_RESTARTS: Final = (JobConfig, SelectDataset, LoadModel, SetWeights, Reset)
_PROTOCOL_CODES: Final[dict[str, BoardErrorCode]] = {
    "unsupported_version": "unsupported_version",
    "oversized": "too_large",
}

Send = Callable[[DataMessage], Awaitable[None]]


@dataclass
class Member:
    """One board behind the aggregator: its open link and the Hello it said."""

    link: Any
    hello: Hello
    alive: bool = True
    throughput: ThroughputEstimate = field(default_factory=ThroughputEstimate)
    slice_throughput: dict[int, ThroughputEstimate] = field(default_factory=dict)
    waiters: dict[Hashable, asyncio.Future[DataMessage]] = field(default_factory=dict)
    # What goes down to it, in the daemon's order; one sender task drains it, so a
    # serial link's stop-and-wait holds up this member only, never the others.
    outbox: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)
    sending: bool = False  # the sender task holds a message the link has not taken yet
    # A fold's done-callback per waiter, called in the call that settles the waiter
    # (``resolve``, ``fail``) instead of a loop turn later: a host of many members would
    # pay each answer a turn of its one thread (see ``_settled``).
    watchers: dict[asyncio.Future[DataMessage], Callable[[asyncio.Future[DataMessage]], None]] = (
        field(default_factory=dict)
    )

    @property
    def board_id(self) -> str:
        """The member's own id (logs only: the daemon never sees it)."""
        return self.hello.board_id

    def post(self, data: bytes) -> None:
        """Send ``data`` after what is queued for this member: handed to the link right
        here when the link takes messages without waiting (in-process) and nothing is
        ahead of it, which saves the sender task a wake-up per message; else queued for
        the sender."""
        send_now = getattr(self.link, "send_nowait", None)
        if send_now is not None and not self.sending and self.outbox.empty():
            try:
                if send_now(data):
                    return
            except LinkClosedError:
                self.fail("link closed")
                return
        self.outbox.put_nowait(data)

    def rate(self, parts: int) -> float:
        """Measured whole-batch keys per second on ``parts`` slices a key (else whole)."""
        return estimate_for(self.throughput, self.slice_throughput, parts).rate

    def expect(self, key: Hashable) -> asyncio.Future[DataMessage]:
        """The waiter of the answer under ``key`` (one per key: a transfer's chunks share it)."""
        future = self.waiters.get(key)
        if future is None or future.done():
            future = self.waiters[key] = asyncio.get_running_loop().create_future()
        return future

    def resolve(self, msg: DataMessage) -> bool:
        """Hand an answer to its waiter(s); False: nobody waited for it. A Hello also
        updates what the member holds (after a Reset, say)."""
        if isinstance(msg, Hello):
            self.hello = msg
            keys: list[Hashable] = [_HELLO]
        elif isinstance(msg, Error):
            keys = [k for k in self.waiters if error_matches(msg, k)]
        else:
            keys = [reply_key(msg)]
        resolved = False
        for key in keys:
            future = self.waiters.pop(key, None)
            if future is not None and not future.done():
                self._settle(future, msg)
                resolved = True
        return resolved

    def fail(self, reason: str) -> None:
        """The link ended: every waiter fails."""
        self.alive = False
        for future in self.waiters.values():
            if not future.done():
                self._settle(future, LinkClosedError(self.board_id, "closed", reason))
        self.waiters.clear()

    def _settle(
        self, future: asyncio.Future[DataMessage], outcome: DataMessage | Exception
    ) -> None:
        """Settle a waiter; its fold's watcher runs now, in place of its done-callback."""
        watcher = self.watchers.pop(future, None)
        if watcher is not None:
            future.remove_done_callback(watcher)
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        if watcher is not None:
            watcher(future)


@dataclass
class _Part:
    """One member's share of an eval request, and when it was sent and answered."""

    member: Member
    request: EvalRequest | EvalSliceRequest
    future: asyncio.Future[DataMessage]
    parts: int  # slices per key of the split it belongs to
    cost: float  # whole-batch keys
    sent: float

    def observe(self, arrived: float | None) -> None:
        """Fold this part's time into the member's estimate of its kind (whole or
        sliced), if its answer was a result (``arrived``: when, on the loop's clock)."""
        future = self.future
        if arrived is None or not future.done() or future.cancelled() or future.exception():
            return
        if isinstance(future.result(), EvalResult | EvalSliceResult):
            seconds = max(arrived - self.sent, 1e-6)
            member = self.member
            observe_split(
                member.throughput, member.slice_throughput, self.parts, self.cost, seconds
            )


class _Refused(Exception):
    """A member refused or failed: the request is refused up with this error."""

    def __init__(self, error: Error) -> None:
        super().__init__(error.detail)
        self.error = error


class HostAggregator:
    """Serves ``members`` as the one board ``name`` (see the module docstring).

    Args:
        name: the board id the daemon sees.
        members: the boards, their links open and their Hellos heard.
        reply_timeout_s: how long a member may take to answer.
        timeline: notes when each step's eval request passed the host (the fleet
            benchmark's host timeline); None: not noted.
    """

    def __init__(
        self,
        name: str,
        members: Sequence[Member],
        *,
        reply_timeout_s: float = MEMBER_REPLY_TIMEOUT_S,
        timeline: HostTimeline | None = None,
    ) -> None:
        if not members:
            raise ValueError("an aggregate needs at least one member board")
        self.name = name
        self.members = list(members)
        self.reply_timeout_s = reply_timeout_s
        self.timeline = timeline
        self._int8 = False  # from the JobConfig: INT8 requests may be cut into slices
        self._send: Send | None = None
        self.sliced = 0  # eval requests answered from batch slices of the members
        self._tasks: set[asyncio.Task[None]] = set()
        # The shares the last eval request went out with, and those of the next one.
        self._last_shares: PreparedShares | None = None
        self._prepared: PreparedShares | None = None
        self.prepared_used = 0  # eval requests sent from shares prepared a step ahead
        self.plans_carried = 0  # steps whose shares are the step before's plan, carried over
        # An update's copies not yet posted, by member: held for the rest of the loop
        # turn, so that the eval request of the same step order goes out interleaved
        # with them (``_post_held``).
        self._held: dict[int, tuple[Member, bytes]] = {}

    def alive(self) -> list[Member]:
        """The members still linked."""
        return [m for m in self.members if m.alive]

    def hello(self) -> Hello:
        """The host's Hello: the least of the members' limits, hashes only if shared."""
        hellos = [m.hello for m in self.alive()] or [self.members[0].hello]

        def common(values: list[int]) -> int:
            return values[0] if len(set(values)) == 1 else 0

        return Hello(
            protocol_version=min(h.protocol_version for h in hellos),
            board_id=self.name,
            firmware_version=f"aggregate-{len(hellos)}"[:24],
            npu=hellos[0].npu,
            ram_kib=min(h.ram_kib for h in hellos),
            max_batch=min(h.max_batch for h in hellos),
            max_payload=min(h.max_payload for h in hellos),
            model_hash=common([h.model_hash for h in hellos]),
            dataset_hash=common([h.dataset_hash for h in hellos]),
        )

    async def serve(self, upstream: Any, connects: Callable[[], int] | None = None) -> str:
        """Act as the board until the upstream link or every member ends.

        Args:
            upstream: the host's link to the daemon (``send``, ``incoming``).
            connects: the upstream's (re)connection count: a change means Hello again.

        Returns:
            ``"closed"`` (upstream ended) or ``"members gone"``.
        """

        async def send(msg: DataMessage) -> None:
            with contextlib.suppress(LinkError):  # broker away: the daemon asks again
                await upstream.send(encode(msg))

        self._send = send
        await send(self.hello())
        readers = [
            asyncio.create_task(self._read(m), name=f"aggregate[{m.board_id}].reader")
            for m in self.members
        ]
        senders = [
            asyncio.create_task(self._sender(m), name=f"aggregate[{m.board_id}].sender")
            for m in self.members
        ]
        watcher = asyncio.create_task(self._watch(connects), name="aggregate.watch")
        down = asyncio.create_task(self._downlink(upstream), name="aggregate.downlink")
        members_gone: asyncio.Task[Any] = asyncio.create_task(_all_done(readers))
        try:
            done, _ = await asyncio.wait([down, members_gone], return_when=asyncio.FIRST_COMPLETED)
            return "closed" if down in done else "members gone"
        finally:
            tasks = [down, watcher, members_gone, *readers, *senders, *self._tasks]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ daemon -> members

    async def _downlink(self, upstream: Any) -> None:
        async for data in upstream.incoming():
            try:
                msg = _decode_order(data)
            except ProtocolError as exc:
                code = _PROTOCOL_CODES.get(exc.kind, "malformed")
                await self._up(Error(code=code, ref_type=exc.msg_type or 0, detail=exc.kind))
                continue
            await self._dispatch(msg, bytes(data))
            if not self.alive():
                return

    async def _dispatch(self, msg: DataMessage, data: bytes | None = None) -> None:
        """Send ``msg`` on to the members now (so every member sees the daemon's order),
        and fold their answers in the background; ``data``: its bytes as received, which
        a message the members all get is sent on as (not encoded again)."""
        if not isinstance(msg, EvalRequest | EvalSliceRequest):
            self._post_held()  # what the members had first goes first
        if isinstance(msg, JobConfig):
            self._int8 = msg.numerics == "int8"
        if isinstance(msg, _RESTARTS):
            self._prepared = None  # no step to plan ahead
            self._last_shares = None
        if isinstance(msg, ApplyUpdate):
            futures = self._to(self.alive(), msg, data, hold=True)
            self._fold(self._fold_same(msg, futures), then=self._prepare_next(msg))
        elif isinstance(msg, _FANNED_OUT):
            futures = self._to(self.alive(), msg, data)
            self._fold(self._fold_same(msg, futures))
        elif isinstance(msg, EvalRequest | EvalSliceRequest):
            self._mark(msg.step, "order in")
            parts = await self._share_eval(msg)
            self._mark(msg.step, "shares out")
            arrived: dict[int, float] = {}
            # The members' rates take the answers' times after the answer went up.
            self._fold(
                self._fold_eval(msg, parts, arrived), then=lambda _: _observe(parts, arrived)
            )
        elif isinstance(msg, ValidateRequest | Ping):
            member = self._first() if isinstance(msg, Ping) else self._fastest()
            if member is not None:
                futures = self._to([member], msg)
                self._fold(self._relay(msg, futures[0]))
        elif isinstance(msg, Reset):
            futures = self._to(self.alive(), msg, data, key=_HELLO)
            self._fold(self._hello_after(msg, futures))
        elif isinstance(msg, Error):
            _log.warning("daemon reported an error", host=self.name, detail=msg.detail)
        else:
            await self._up(Error(code="unknown_type", ref_type=_code(msg), detail=msg.type))

    def _to(
        self,
        members: Sequence[Member],
        msg: DataMessage,
        data: bytes | None = None,
        key: Hashable | None = None,
        *,
        hold: bool = False,
    ) -> list[tuple[Member, asyncio.Future[DataMessage]]]:
        """Send ``msg`` to ``members``, each answer's waiter (under ``key``, by default
        the request's) registered first; encoded once, unless its bytes are given: a
        fan-out to many members is the same bytes. ``hold``: post the copies at the end
        of this loop turn, or with the members' shares of an eval request dispatched
        before then (``_post_held``)."""
        if key is None:
            key = request_key(msg)
        if data is None:
            data = encode(msg)
        out = []
        for member in members:
            out.append((member, member.expect(key)))
            if hold:
                self._held[id(member)] = (member, data)
            else:
                member.post(data)
        if hold and members:
            asyncio.get_running_loop().call_soon(self._post_held)
        return out

    def _post_held(self, member: Member | None = None) -> None:
        """Post the held update to ``member``, or to every member it is held for.

        A step order carries an update and an eval request, which reach the host one
        right behind the other. Posted as two fan-outs, every member's share would wait
        behind all the members' updates; interleaved, the first member has both at once
        and starts a whole fan-out earlier. Each member still gets the update first."""
        if member is not None:
            held = self._held.pop(id(member), None)
            if held is not None:
                member.post(held[1])
            return
        held_now, self._held = self._held, {}
        for target, data in held_now.values():
            target.post(data)

    async def _sender(self, member: Member) -> None:
        """Send a member's outbox in order until its link ends."""
        while member.alive:
            data = await member.outbox.get()
            member.sending = True
            try:
                await member.link.send(data)
            except LinkClosedError:
                member.fail("link closed")
            except LinkError as exc:  # not acknowledged: its answer times out
                _log.warning(
                    "message to a member not delivered", member=member.board_id, error=str(exc)
                )
            finally:
                member.sending = False

    def _first(self) -> Member | None:
        alive = self.alive()
        return alive[0] if alive else None

    def _fastest(self) -> Member | None:
        alive = self.alive()
        return max(alive, key=lambda m: m.throughput.rate) if alive else None

    # ------------------------------------------------------------------ evaluation

    async def _share_eval(self, msg: EvalRequest | EvalSliceRequest) -> list[_Part]:
        """Send the members their shares of the request's keys (and, INT8, slices): the
        ones prepared a step ahead if they fit, else planned now."""
        members = self.alive()
        prepared, self._prepared = self._prepared, None
        self._last_shares = None
        try:
            if not members:
                return []
            if prepared is not None and prepared.fits(msg, members, self._int8):
                self.prepared_used += 1
            else:
                prepared = planned(msg, members, self._int8)
            self._last_shares = prepared
            shares = prepared.shares
            self.sliced += bool(shares) and shares[0].parts > 1
            out = []
            now = asyncio.get_running_loop().time()
            for share in shares:
                future = share.member.expect(request_key(share.request))
                self._post_held(share.member)
                share.member.post(share.data)
                out.append(_Part(share.member, share.request, future, share.parts, share.cost, now))
            return out
        finally:
            self._post_held()  # the members without a share

    def _prepare_next(self, update: ApplyUpdate) -> Callable[[DataMessage], None]:
        """What to do once the members' acks of ``update`` went up: while they compute,
        prepare the shares of the request shared right behind it, one step on (the
        daemon's next order, if nothing changes): its plan carried over where the
        members' rates allow (``carried``), else planned again."""

        def prepare(answer: DataMessage) -> None:
            last = self._last_shares
            if not isinstance(answer, UpdateAck) or last is None:
                return
            shared = last.request
            if shared.step != update.step + 1 or shared.step >= _U32_MAX:
                return  # not a pipelined step (a validation came between, say)
            members = self.alive()
            if not members:
                return
            expected = shared.model_copy(update={"step": shared.step + 1})
            try:
                prepared = carried(last, expected, members, self._int8)
                if prepared is None:
                    prepared = planned(expected, members, self._int8)
                else:
                    self.plans_carried += 1
            except (ProtocolError, ValueError) as exc:  # planned on arrival instead
                _log.warning("next step's shares not prepared", host=self.name, error=str(exc))
                return
            self._prepared = prepared

        return prepare

    async def _fold_eval(
        self,
        msg: EvalRequest | EvalSliceRequest,
        parts: list[_Part],
        arrived: dict[int, float] | None = None,
    ) -> DataMessage:
        """The members' answers as one answer to ``msg`` (``arrived``: filled with when
        each answer came, by the id of its waiter)."""
        if not parts:
            raise _Refused(_error(msg, "not_ready", "no member board"))
        waits = [(part.member, part.future) for part in parts]
        answers = await self._answers(msg, waits, arrived)
        self._mark(msg.step, "answers in")
        for part, answer in zip(parts, answers, strict=False):  # one Error: refused at once
            if isinstance(answer, Error):
                raise _Refused(answer.model_copy(update={"ref_type": _code(msg)}))
            if not isinstance(answer, EvalResult | EvalSliceResult):
                raise _Refused(_error(msg, "internal", f"{part.member.board_id}: {answer.type}"))
        return _merged(msg, answers)

    async def _hello_after(
        self, msg: Reset, futures: list[tuple[Member, asyncio.Future[DataMessage]]]
    ) -> DataMessage:
        """After a Reset: the host's Hello once every member said its own."""
        for member, future in futures:
            with contextlib.suppress(_Refused):
                await self._answers(msg, [(member, future)])
        return self.hello()

    # ------------------------------------------------------------------ folding

    def _fold(
        self,
        work: Awaitable[DataMessage | None],
        then: Callable[[DataMessage], None] | None = None,
    ) -> None:
        """Run one fold in the background; its answer (or refusal) goes up, and then
        ``then`` gets it."""

        async def run() -> None:
            try:
                answer = await work
            except _Refused as exc:
                answer = exc.error
            if answer is not None:
                if isinstance(answer, EvalResult | EvalSliceResult):
                    self._mark(answer.step, "result out")
                await self._up(answer)
                if then is not None:
                    then(answer)

        task = asyncio.create_task(run(), name=f"aggregate[{self.name}].fold")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fold_same(
        self, msg: DataMessage, futures: list[tuple[Member, asyncio.Future[DataMessage]]]
    ) -> DataMessage | None:
        """Every member's answer to a fanned-out message: one if all agree."""
        if isinstance(msg, LoadModel | SetWeights) and msg.offset + len(msg.chunk) < msg.total:
            return None  # not the last chunk: the transfer's waiters answer at its end
        if not futures:
            raise _Refused(_error(msg, "not_ready", "no member board"))
        answers = await self._answers(msg, futures)
        for answer in answers:
            if isinstance(answer, Error):
                return answer
        first = answers[0]
        if all(answer is first or answer == first for answer in answers):
            return first
        if isinstance(msg, ApplyUpdate):
            members = [m.board_id for m, _ in futures]
            seen = {b: getattr(a, "checksum", None) for b, a in zip(members, answers, strict=True)}
            _log.warning("members diverged; asking for a resync", host=self.name, checksums=seen)
            return _error(msg, "internal", "member boards disagree on the weights")
        return _error(msg, "internal", "member boards answered differently")

    async def _relay(
        self, msg: DataMessage, part: tuple[Member, asyncio.Future[DataMessage]]
    ) -> DataMessage:
        (answer,) = await self._answers(msg, [part])
        return answer

    async def _answers(
        self,
        msg: DataMessage,
        waits: Sequence[tuple[Member, asyncio.Future[DataMessage]]],
        arrived: dict[int, float] | None = None,
    ) -> list[DataMessage]:
        """The members' answers to ``msg`` in their order, once all are in, or the first
        Error among them (alone) as soon as one comes. The fold wakes once, not once per
        answer: answers come one by one as members finish, and on a host of many members
        each wake-up costs its thread what a member's start costs.

        ``arrived`` (when given) gets the loop time each answer came, by the id of its
        waiter; an answer there before the call counts as come at the call.

        Raises:
            _Refused: a member went silent for ``reply_timeout_s`` (the first in order
                that had not answered) or its link ended (the first such in order).
        """
        pending = [(member, future) for member, future in waits if not future.done()]
        if arrived is not None:
            now = asyncio.get_running_loop().time()
            arrived.update((id(future), now) for _, future in waits if future.done())
        timed_out = False
        answers: list[DataMessage] = []
        if pending and not any(_refuses(f) for _, f in waits if f.done()):
            try:
                async with asyncio.timeout(self.reply_timeout_s):
                    await _settled(pending, arrived)
            except TimeoutError:
                timed_out = True
            finally:
                for member, future in pending:  # a late answer: its done-callback alone
                    member.watchers.pop(future, None)
        for member, future in waits:
            if not future.done():
                if timed_out:
                    raise _Refused(_error(msg, "busy", f"{member.board_id} did not answer"))
                continue  # woken by an Error or a loss further on: found below
            if future.cancelled() or future.exception() is not None:
                raise _Refused(_error(msg, "not_ready", f"{member.board_id} is gone"))
            answer = future.result()
            if isinstance(answer, Error):
                return [answer]  # the refusal is all a fold needs
            answers.append(answer)
        return answers  # all of them: nothing failed, so nothing was left waiting

    def _mark(self, step: int, name: str) -> None:
        if self.timeline is not None:
            self.timeline.mark(step, name)

    async def _up(self, msg: DataMessage) -> None:
        if self._send is not None:
            await self._send(msg)

    # ------------------------------------------------------------------ members -> daemon

    async def _read(self, member: Member) -> None:
        """A member's messages until its link ends (``_take`` each). An in-process link
        hands them over as they are sent (``receive_with``), without a wake-up of this
        task per message: on a host of many members every answer costs less."""
        receive_with = getattr(member.link, "receive_with", None)
        if receive_with is not None:
            receive_with(functools.partial(self._received, member))
        try:
            async for data in member.link.incoming():
                heartbeat = self._take(member, data)
                if heartbeat is not None:
                    await self._up(heartbeat)
        except LinkError:
            pass
        finally:
            member.fail("link closed")
            _log.warning("member board gone", host=self.name, member=member.board_id)

    def _received(self, member: Member, data: bytes) -> None:
        """``_take`` for a message handed over in the member's send."""
        heartbeat = self._take(member, data)
        if heartbeat is not None:
            task = asyncio.create_task(self._up(heartbeat), name=f"aggregate[{self.name}].up")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self, member: Member, data: bytes) -> Heartbeat | None:
        """A member's message: an answer goes to its waiter; the first member's
        heartbeat is returned, to go up as the host's; the rest is dropped (its Hellos
        after a Reset, say, and what does not decode)."""
        try:
            msg = _decode_answer(data)
        except ProtocolError:
            return None
        if member.resolve(msg):
            return None
        if isinstance(msg, Heartbeat) and member is self._first():
            return msg
        return None

    async def _watch(self, connects: Callable[[], int] | None) -> None:
        """Say Hello again after the upstream reconnected (the daemon may have missed it)."""
        if connects is None:
            return
        seen = connects()
        while True:
            await asyncio.sleep(0.2)
            if connects() != seen:
                seen = connects()
                await self._up(self.hello())


def _decode_order(data: bytes) -> DataMessage:
    """A message from the daemon, decoded once per distinct bytes when it is an
    ApplyUpdate: the host's in-process members, which decode an update the same way
    (``decode_shared``), then find it decoded when the host sends them these bytes. An
    eval request that this process's MQTT endpoint made from a step order is taken as
    made (the order itself was decoded)."""
    return decode_shared(data, *STEP_SHARED_CODES)


def _decode_answer(data: bytes) -> DataMessage:
    """A member's message, decoded once per distinct bytes when it is an UpdateAck: the
    members of a process ack an update with equal bytes."""
    return decode_shared(data, TYPE_CODES[UpdateAck])


def _settled(
    waits: Sequence[tuple[Member, asyncio.Future[DataMessage]]],
    arrived: dict[int, float] | None = None,
) -> asyncio.Future[None]:
    """Done when every one of the waiters is, or as soon as one holds an Error or failed
    (a member refused or is gone: the fold need not wait for the others). ``arrived``
    (when given) gets the loop time each future was done, by its id.

    One callback per answer does both. It is each waiter's done-callback and its
    member's watcher: the member runs it in the call that hands the answer over (a
    member's answer on a host of many members would otherwise cost a loop turn of the
    host's one thread, on the way from the first member's answer to the last's), and
    takes the done-callback off; a waiter settled some other way gets the callback."""
    loop = asyncio.get_running_loop()
    settled: asyncio.Future[None] = loop.create_future()
    left = len(waits)

    def on_done(future: asyncio.Future[DataMessage]) -> None:
        nonlocal left
        if arrived is not None:
            arrived[id(future)] = loop.time()
        left -= 1
        if not settled.done() and (left == 0 or _refuses(future)):
            settled.set_result(None)

    for member, future in waits:
        future.add_done_callback(on_done)
        member.watchers[future] = on_done
    return settled


def _observe(parts: Sequence[_Part], arrived: dict[int, float]) -> None:
    """Each part's time into its member's rate, from when its answer ``arrived``."""
    for part in parts:
        part.observe(arrived.get(id(part.future)))


def _refuses(answered: asyncio.Future[DataMessage]) -> bool:
    """Whether a member's done waiter refuses the request: an Error, or a lost link."""
    if answered.cancelled() or answered.exception() is not None:
        return True
    return isinstance(answered.result(), Error)


async def _all_done(tasks: Sequence[asyncio.Task[None]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


def _code(msg: DataMessage) -> int:
    return TYPE_CODES[type(msg)]


def _error(msg: DataMessage, code: Any, detail: str) -> Error:
    return Error(
        code=code,
        ref_type=_code(msg),
        job_id=getattr(msg, "job_id", 0),
        step=getattr(msg, "step", 0),
        detail=detail[:64],
    )


# Where each kind of eval answer keeps its values: (plus, minus, zero).
_VALUE_FIELDS: Final = {
    EvalResult: ("loss_plus", "loss_minus", "loss_zero"),
    EvalSliceResult: ("sum_plus", "sum_minus", "sum_zero"),
}


def _merged(msg: EvalRequest | EvalSliceRequest, answers: list[Any]) -> DataMessage:
    """One answer from the parts' answers: each key's values where its member put them
    (whole-batch losses or slice sums), or, for slices of a whole-batch request, folded."""
    kinds = {type(a) for a in answers}
    cls = EvalSliceResult if isinstance(msg, EvalSliceRequest) else EvalResult
    if kinds != {cls}:
        if cls is EvalResult and kinds == {EvalSliceResult}:
            return _folded_slices(msg, answers)  # type: ignore[arg-type]
        raise _Refused(_error(msg, "internal", "member boards answered other kinds"))
    plus, minus, zero = _VALUE_FIELDS[cls]
    two_sided = msg.estimator == "two_sided"
    values = {
        name: {k: v for a in answers for k, v in zip(a.ks, getattr(a, name), strict=True)}
        for name in (plus, minus)
    }
    zeros = {getattr(a, zero) for a in answers}
    if not two_sided and len(zeros) != 1:
        raise _Refused(_error(msg, "internal", "member boards disagree on L0"))
    fields: dict[str, Any] = {
        "job_id": msg.job_id,
        "step": msg.step,
        "compute_us": max(a.compute_us for a in answers),
        "estimator": msg.estimator,
        "ks": msg.ks,
        plus: tuple(values[plus][k] for k in msg.ks),
        minus: tuple(values[minus][k] for k in msg.ks) if two_sided else (),
        zero: None if two_sided else zeros.pop(),
    }
    if isinstance(msg, EvalSliceRequest):
        fields |= {"slice_start": msg.slice_start, "slice_count": msg.slice_count}
    return cls.model_validate(fields)


def _folded_slices(msg: EvalRequest, answers: list[EvalSliceResult]) -> EvalResult:
    """Whole-batch losses from slice sums: floor(sum / B) per key (SPEC 6.10). The sums
    are added as they come (exact integers), not listed first: a host folds one answer
    per member on its way up, at the end of every step."""
    two_sided = msg.estimator == "two_sided"
    plus: dict[int, int] = {}
    minus: dict[int, int] = {}
    zero: dict[tuple[int, int], int] = {}
    for a in answers:
        for k, value in zip(a.ks, a.sum_plus, strict=True):
            plus[k] = plus.get(k, 0) + value
        if two_sided:
            for k, value in zip(a.ks, a.sum_minus, strict=True):
                minus[k] = minus.get(k, 0) + value
        if a.sum_zero is not None:
            zero[(a.slice_start, a.slice_count)] = a.sum_zero

    batch = msg.batch_size
    return EvalResult(
        job_id=msg.job_id,
        step=msg.step,
        compute_us=max(a.compute_us for a in answers),
        estimator=msg.estimator,
        ks=msg.ks,
        loss_plus=tuple(batch_losses_of_totals([plus[k] for k in msg.ks], batch)),
        loss_minus=tuple(batch_losses_of_totals([minus[k] for k in msg.ks], batch))
        if two_sided
        else (),
        loss_zero=None if two_sided else batch_losses_of_totals([sum(zero.values())], batch)[0],
    )


async def await_members(links: Sequence[Any], timeout: float) -> list[Member]:
    """The boards on ``links`` as members, once each said its Hello (others dropped).

    Raises:
        TimeoutError: a board said no Hello within ``timeout`` seconds.
    """

    async def hello_of(link: Any) -> Member:
        async for data in link.incoming():
            with contextlib.suppress(ProtocolError):
                msg = decode(data)
                if isinstance(msg, Hello):
                    return Member(link, msg)
        raise LinkClosedError(getattr(link, "board_id", "?"), "closed", "no Hello")

    async with asyncio.timeout(timeout):
        return list(await asyncio.gather(*(hello_of(link) for link in links)))
