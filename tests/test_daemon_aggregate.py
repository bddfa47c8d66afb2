"""A host's boards as one board (``HostAggregator``): the daemon sees one board per host
and the run ends with the single-process weights — whole keys, batch slices inside the
host, a member that diverges, a member that dies."""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from qsched.daemon.aggregate import (
    HostAggregator,
    Member,
    _decode_order,
    _merged,
    _observe,
    _Part,
    _Refused,
    _settled,
    await_members,
)
from qsched.daemon.engine import EngineConfig, JobResult, StepEngine
from qsched.daemon.fleet import Fleet, request_key
from qsched.daemon.host_timeline import MARKS, HostTimeline
from qsched.daemon.planner import RATE_NOISE, ThroughputEstimate
from qsched.daemon.shares import carried, plan_shares, planned
from qsched.firmware.virtual import board as board_module
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.firmware.virtual.faults import FaultPlan
from qsched.protocol.codec import decode, decode_shared, encode
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.base import LinkClosedError
from qsched.protocol.links.inproc import InProcTransport
from qsched.protocol.messages import (
    TYPE_CODES,
    ApplyUpdate,
    Error,
    EvalRequest,
    EvalResult,
    EvalSliceRequest,
    EvalSliceResult,
    Heartbeat,
    Hello,
    Ping,
    UpdateAck,
)
from qsched.zo.intloss import sliced_batch_losses
from qsched.zo.trainer import train_zo

# Modelled NPU time well above the host's compute: the members measure even rates.
LATENCY = LatencyProfile(macs_per_forward=20_000_000)


def _spec(**over: object) -> JobSpec:
    base: dict[str, object] = {
        "name": "aggregate",
        "steps": 6,
        "eval_every": 3,
        "batch_size": 4,
        "numerics": "int8",
        "policy": PolicySpec(name="fixed", config={"q": 4}),
    }
    base.update(over)
    return JobSpec.model_validate(base)


@contextlib.asynccontextmanager
async def _host(
    daemon_side: InProcTransport,
    name: str,
    agents: Sequence[BoardAgent],
    reply_timeout_s: float = 60.0,
    timeline: HostTimeline | None = None,
) -> AsyncIterator[HostAggregator]:
    """``agents`` behind one aggregator, attached to the daemon's transport as ``name``."""
    async with InProcTransport() as local, asyncio.TaskGroup() as tasks:
        ends = [local.attach(a.board_id) for a in agents]
        served = [tasks.create_task(serve_link(a, e)) for a, e in zip(agents, ends, strict=True)]
        links = []
        async for event in local.events():
            links.append(event.link)  # type: ignore[union-attr]
            if len(links) == len(agents):
                break
        members = await await_members(links, timeout=10)
        aggregator = HostAggregator(
            name, members, reply_timeout_s=reply_timeout_s, timeline=timeline
        )
        upstream = daemon_side.attach(name)
        serving = tasks.create_task(aggregator.serve(upstream))
        try:
            yield aggregator
        finally:
            for task in [serving, *served]:
                task.cancel()


async def _run(
    spec: JobSpec,
    hosts: dict[str, list[BoardAgent]],
    plain: int = 0,
    aggregators: list[HostAggregator] | None = None,
    reply_timeout_s: float = 60.0,
    config: EngineConfig | None = None,
    timeline: HostTimeline | None = None,
) -> JobResult:
    async with (
        InProcTransport() as transport,
        Fleet(transport) as fleet,
        contextlib.AsyncExitStack() as stack,
    ):
        for name, agents in hosts.items():
            context = _host(transport, name, agents, reply_timeout_s, timeline)
            host = await stack.enter_async_context(context)
            if aggregators is not None:
                aggregators.append(host)
        for i in range(plain):
            agent = BoardAgent(f"plain-{i}", latency=LATENCY)
            stack.push_async_callback(
                _cancel,
                asyncio.create_task(serve_link(agent, transport.attach(agent.board_id))),
            )
        names = [*hosts, *(f"plain-{i}" for i in range(plain))]
        async with asyncio.timeout(30):
            while not all((s := fleet.find(n)) and s.hello for n in names):
                await fleet.wait_changed(0.1)
        return await asyncio.wait_for(StepEngine(spec, fleet, config=config).run(), 120)


async def _cancel(task: asyncio.Task[object]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _boards(prefix: str, count: int, faults: Sequence[str] = ()) -> list[BoardAgent]:
    plan = FaultPlan.parse(list(faults), seed=3)
    return [
        BoardAgent(f"{prefix}-{i}", latency=LATENCY, faults=plan.for_board(f"{prefix}-{i}"))
        for i in range(count)
    ]


@pytest.mark.parametrize("numerics", ["int8", "fp32"])
async def test_two_hosts_and_a_plain_board_match_the_trainer(numerics: str) -> None:
    """The daemon sees three boards; eight virtual boards did the work, same bits."""
    over = {"numerics": numerics} | ({"lr": 0.05, "eps": 0.01} if numerics == "fp32" else {})
    spec = _spec(**over)
    hosts = {"host-a": _boards("a", 4), "host-b": _boards("b", 3)}
    result = await _run(spec, hosts, plain=1)
    assert result.status == "completed"
    assert result.state.checksum() == train_zo(spec).state.checksum()
    assert result.steps == train_zo(spec).steps
    assert set(result.work) <= {"host-a", "host-b", "plain-0"} and result.work.get("host-a")
    assert result.faults == 0


async def test_a_host_splits_batches_for_its_members() -> None:
    """One host of four boards, one key a step: the host cuts the key's batch into
    slices (INT8) and answers with the whole-batch loss bits."""
    spec = _spec(policy=PolicySpec(name="fixed", config={"q": 1}))
    aggregators: list[HostAggregator] = []
    result = await _run(spec, {"host-a": _boards("a", 4)}, aggregators=aggregators)
    assert result.state.checksum() == train_zo(spec).state.checksum()
    assert aggregators[0].sliced >= spec.steps - 1  # the first may start unmeasured


async def test_a_diverged_member_gets_its_host_resynchronised() -> None:
    """A member reporting a wrong checksum: the host refuses the update, the daemon
    resynchronises it, and the run still ends with the reference weights."""
    spec = _spec(steps=5)
    hosts = {"host-a": _boards("a", 2) + _boards("liar", 1, ["bad-checksum:0.5"])}
    result = await _run(spec, hosts, plain=1)
    assert result.status == "completed"
    assert result.faults >= 1
    assert result.state.checksum() == train_zo(spec).state.checksum()


async def test_a_member_that_dies_leaves_its_host_working() -> None:
    """A member crashes mid-job: its host refuses that request once (the daemon gives
    it elsewhere), then goes on with the others."""
    spec = _spec(steps=6)
    hosts = {"host-a": _boards("a", 2) + _boards("dies", 1, ["crash-at-step:2"])}
    result = await _run(spec, hosts, plain=1)
    assert result.status == "completed"
    assert result.state.checksum() == train_zo(spec).state.checksum()
    assert result.work.get("host-a")


async def test_a_silent_member_has_its_host_refuse_in_time() -> None:
    """A member that answers nothing about step 3 (neither its update's ack nor its
    share): its host refuses both once its own reply timeout is up, long before the
    daemon's would end the wait (60 s here), and the run ends with the reference
    weights."""
    spec = _spec(steps=6)
    hosts = {"host-a": _boards("a", 2) + _boards("mute", 1, ["drop:step=3"])}
    config = EngineConfig(reply_timeout_s=60.0, step_deadline_s=60.0)
    started = asyncio.get_running_loop().time()
    result = await _run(spec, hosts, plain=1, reply_timeout_s=0.5, config=config)
    assert result.status == "completed"
    assert result.state.checksum() == train_zo(spec).state.checksum()
    assert result.faults >= 1
    assert asyncio.get_running_loop().time() - started < 30


async def test_hosts_take_the_daemons_batch_slices() -> None:
    """One key a step over two hosts and a plain board: the daemon splits the batch,
    each host answers its EvalSliceRequests from a member, the bits are the same."""
    spec = _spec(policy=PolicySpec(name="fixed", config={"q": 1}))
    hosts = {"host-a": _boards("a", 2), "host-b": _boards("b", 2)}
    result = await _run(spec, hosts, plain=1)
    assert result.split_steps >= spec.steps - 2  # the first steps may start with fewer boards
    assert result.state.checksum() == train_zo(spec).state.checksum()
    assert result.work.get("host-a") and result.work.get("host-b")


async def test_a_host_prepares_the_next_steps_shares_while_its_members_compute() -> None:
    """With no validation between steps every order carries the request the host shared
    last, one step on: the host planned and encoded its shares while its members
    computed, sends them as they are, and the bits are the single-process ones."""
    spec = _spec(steps=8, eval_every=100)
    aggregators: list[HostAggregator] = []
    result = await _run(spec, {"host-a": _boards("a", 4)}, aggregators=aggregators)
    assert result.state.checksum() == train_zo(spec).state.checksum()
    # Steps 0 and 1 come before any update the host could prepare behind (one more may
    # miss on a loaded machine, where the acks' fold can end after the next order).
    assert spec.steps - 3 <= aggregators[0].prepared_used <= spec.steps - 2


async def test_a_host_notes_when_each_step_passed_it() -> None:
    """With a timeline, the host notes each step's eval request arriving, its shares
    posted, its members' answers in and its result going up, in that order."""
    spec = _spec(steps=5, eval_every=100)
    timeline = HostTimeline()
    result = await _run(spec, {"host-a": _boards("a", 3)}, timeline=timeline)
    assert result.state.checksum() == train_zo(spec).state.checksum()
    assert sorted(timeline.steps) == list(range(spec.steps))
    for marks in timeline.steps.values():
        assert list(marks) == list(MARKS)
        times = [marks[m] for m in MARKS]
        assert times == sorted(times)


async def test_a_host_plans_afresh_when_the_order_is_not_the_one_prepared() -> None:
    """q rising during the run (``linear``) and validations between steps: the orders
    that differ from the prepared shares are planned on arrival, with the same bits."""
    spec = _spec(steps=9, eval_every=4, policy=PolicySpec(name="linear", config={"qmax": 6}))
    aggregators: list[HostAggregator] = []
    result = await _run(spec, {"host-a": _boards("a", 4)}, aggregators=aggregators)
    assert result.state.checksum() == train_zo(spec).state.checksum()
    assert 0 < aggregators[0].prepared_used < spec.steps - 2


def _hello(board_id: str) -> Hello:
    return Hello(board_id=board_id, firmware_version="t", npu="virtual", ram_kib=64, max_batch=8)


async def test_messages_to_an_in_process_member_keep_their_order() -> None:
    """A message goes straight onto an in-process member's link while nothing is queued
    before it, into the member's queue while the link is full; either way the member
    gets them in the order they were sent, and a closed link ends the member."""
    async with InProcTransport(queue_size=2) as transport:
        board_end = transport.attach("m")
        event = await anext(transport.events())
        member = Member(event.link, _hello("m"))  # type: ignore[union-attr]
        aggregator = HostAggregator("host", [member])
        for i in range(6):
            member.post(bytes([i]))
        assert member.outbox.qsize() == 4  # the link took two at once
        sender = asyncio.create_task(aggregator._sender(member))
        received = []
        async for data in board_end.incoming():
            received.append(data)
            if len(received) == 6:
                break
        assert received == [bytes([i]) for i in range(6)]
        sender.cancel()
        await board_end.close()
        member.post(b"late")
        assert not member.alive


async def test_an_update_goes_to_the_members_as_the_bytes_that_came() -> None:
    """A fanned-out update is sent on as received, not encoded again: the members get
    the daemon's bytes even where the codec would write them otherwise (its keys as a
    list, not a range), and the host's decode is the one its members' shared decode
    finds."""
    update = ApplyUpdate(job_id=1, step=3, ks=(4, 5), coefficients=(0.5, -0.25))
    canonical = encode(update)
    assert canonical[12] == 0  # the keys as a range (mode 0)
    as_list = canonical[:12] + struct.pack("<BHHH", 1, 2, 4, 5) + canonical[17:]
    assert decode(as_list) == update and as_list != canonical
    async with InProcTransport() as transport:
        board_end = transport.attach("m")
        event = await anext(transport.events())
        member = Member(event.link, _hello("m"))  # type: ignore[union-attr]
        aggregator = HostAggregator("host", [member])
        msg = _decode_order(as_list)
        await aggregator._dispatch(msg, as_list)
        received = await anext(aiter(board_end.incoming()))
        assert received == as_list
        assert decode_shared(received, TYPE_CODES[ApplyUpdate]) is msg
        await board_end.close()


@pytest.mark.parametrize(("members", "keys"), [(3, 6), (8, 4)])
async def test_a_members_share_is_taken_without_a_decode(members: int, keys: int) -> None:
    """A share's bytes decode to its request, and a board of the host's process takes
    that very request for them without decoding it (a board's own work, which a real
    board does on its own CPU); with members beyond the keys the shares are slices."""
    request = EvalRequest(
        job_id=1, step=3, batch_size=4, eps=0.5, estimator="two_sided", ks=tuple(range(keys))
    )
    async with InProcTransport() as transport:
        hosted = []
        for i in range(members):
            transport.attach(f"m{i}")
            event = await anext(transport.events())
            hosted.append(Member(event.link, _hello(f"m{i}")))  # type: ignore[union-attr]
        shares = plan_shares(request, hosted, int8=True)
    assert {type(s.request) for s in shares} == (
        {EvalRequest} if members <= keys else {EvalSliceRequest}
    )
    for share in shares:
        assert decode(share.data) == share.request
        assert board_module._decode(share.data) is share.request


def _rated(rates: list[float]) -> list[Member]:
    """Members of those measured whole-batch rates (keys per second), links unused."""
    members = []
    for i, rate in enumerate(rates):
        member = Member(object(), _hello(f"m{i}"))
        member.throughput = ThroughputEstimate(rate=rate, observations=1)
        members.append(member)
    return members


def _shape(prepared: Any) -> list[tuple[Member, str, tuple[int, ...], int | None]]:
    """Who gets which keys of which request type and slice, in order."""
    return [
        (s.member, s.request.type, s.request.ks, getattr(s.request, "slice_start", None))
        for s in prepared.shares
    ]


@pytest.mark.parametrize(("rates", "keys"), [([10.0, 10.0, 11.0], 8), ([4.0] * 6, 3)])
def test_a_plan_carries_over_to_the_next_step_while_the_rates_hold(
    rates: list[float], keys: int
) -> None:
    """The next step's shares are the last plan's, at the new step, while every member's
    rate stays within RATE_NOISE of the one it was planned on; past that, with other
    members or another request, there is nothing to carry (planned again)."""
    members = _rated(rates)
    request = EvalRequest(
        job_id=1, step=3, batch_size=4, eps=0.5, estimator="two_sided", ks=tuple(range(keys))
    )
    last = planned(request, members, int8=True)
    nxt = request.model_copy(update={"step": 4})
    got = carried(last, nxt, members, True)
    assert got is not None and got.request == nxt and got.rates == last.rates
    assert _shape(got) == _shape(last) == _shape(planned(nxt, members, int8=True))
    for share in got.shares:
        assert share.request.step == 4 and decode(share.data) == share.request
    # Rates that drift within the noise keep the plan; the reference stays the planned one.
    members[0].throughput.rate *= 1 + RATE_NOISE / 2
    assert carried(got, nxt.model_copy(update={"step": 5}), members, True) is not None
    members[0].throughput.rate = rates[0] * (1 + 2 * RATE_NOISE)
    assert carried(got, nxt.model_copy(update={"step": 5}), members, True) is None
    members[0].throughput.rate = rates[0]
    assert carried(last, nxt, members[:-1], True) is None
    assert (
        carried(last, nxt.model_copy(update={"ks": tuple(range(keys + 1))}), members, True) is None
    )
    assert carried(None, nxt, members, True) is None


class _RecordingLink:
    """A member's in-process link that notes, in one list for all members, what it took."""

    def __init__(self, board_id: str, taken: list[tuple[str, str]]) -> None:
        self.board_id = board_id
        self._taken = taken

    def send_nowait(self, payload: bytes) -> bool:
        self._taken.append((self.board_id, decode(payload).type))
        return True


async def test_a_step_orders_update_and_shares_reach_the_members_interleaved() -> None:
    """The update and the eval request of one step order go out member by member, each
    member's update before its share; an update alone goes out by the end of the loop
    turn, and before anything dispatched after it."""
    taken: list[tuple[str, str]] = []
    members = [Member(_RecordingLink(f"m{i}", taken), _hello(f"m{i}")) for i in range(3)]
    aggregator = HostAggregator("host", members, reply_timeout_s=0.3)
    update = ApplyUpdate(job_id=1, step=3, ks=(4, 5), coefficients=(0.5, -0.25))
    request = EvalRequest(
        job_id=1, step=4, batch_size=4, eps=0.5, estimator="two_sided", ks=(0, 1, 2)
    )
    await aggregator._dispatch(update, encode(update))
    await aggregator._dispatch(request)
    assert taken == [(f"m{i}", kind) for i in range(3) for kind in ("apply_update", "eval_request")]
    taken.clear()
    await aggregator._dispatch(update, encode(update))
    assert taken == []
    await asyncio.sleep(0)
    assert taken == [(f"m{i}", "apply_update") for i in range(3)]
    taken.clear()
    await aggregator._dispatch(update, encode(update))
    await aggregator._dispatch(Ping(nonce=1))
    assert taken[:3] == [(f"m{i}", "apply_update") for i in range(3)]
    assert taken[3:] == [("m0", "ping")]
    await asyncio.gather(*aggregator._tasks, return_exceptions=True)  # refused in time


async def test_messages_to_a_waiting_link_go_through_the_members_queue() -> None:
    """A link that may make the sender wait (serial, MQTT) always gets its messages
    from the member's sender task."""

    class SlowLink:
        board_id = "s"

        def __init__(self) -> None:
            self.sent: list[bytes] = []

        async def send(self, payload: bytes) -> None:
            await asyncio.sleep(0)
            self.sent.append(payload)

    link = SlowLink()
    member = Member(link, _hello("s"))
    for i in range(3):
        member.post(bytes([i]))
    assert member.outbox.qsize() == 3 and not link.sent
    sender = asyncio.create_task(HostAggregator("host", [member])._sender(member))
    async with asyncio.timeout(5):
        while len(link.sent) < 3:
            await asyncio.sleep(0.01)
    sender.cancel()
    assert link.sent == [bytes([i]) for i in range(3)]


async def test_the_first_members_heartbeats_go_up_as_the_hosts() -> None:
    """Members on in-process links hand their messages over as they send them; the
    first member's unsolicited heartbeats still go up as the host's, the others' not
    (the second member beats twenty times as often: its beats would swamp the count)."""
    agents = [BoardAgent(f"hb-{i}", latency=LATENCY) for i in range(2)]
    intervals = [0.2, 0.01]
    async with InProcTransport() as local, InProcTransport() as daemon_side:
        ends = [local.attach(a.board_id) for a in agents]
        served = [
            asyncio.create_task(serve_link(a, e, heartbeat_interval=every))
            for a, e, every in zip(agents, ends, intervals, strict=True)
        ]
        links = [(await anext(local.events())).link for _ in agents]  # type: ignore[union-attr]
        aggregator = HostAggregator("host", await await_members(links, timeout=5))
        upstream = daemon_side.attach("host")
        daemon_end = (await anext(daemon_side.events())).link  # type: ignore[union-attr]
        serving = asyncio.create_task(aggregator.serve(upstream))
        beats = 0

        async def count() -> None:
            nonlocal beats
            async for data in daemon_end.incoming():
                beats += isinstance(decode(data), Heartbeat)

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(count(), 0.7)
        for task in [serving, *served]:
            task.cancel()
        assert 1 <= beats <= 6


def _waits(count: int) -> tuple[HostAggregator, list[tuple[Member, asyncio.Future[Any]]]]:
    """An aggregator of ``count`` members and one open waiter of an answer each."""
    members = [Member(None, _hello(f"m{i}")) for i in range(count)]
    loop = asyncio.get_running_loop()
    return HostAggregator("host", members, reply_timeout_s=0.3), [
        (m, loop.create_future()) for m in members
    ]


def _ack(step: int) -> UpdateAck:
    return UpdateAck(job_id=1, step=step, checksum=step)


async def test_a_fold_takes_its_answers_in_order_once_all_are_in() -> None:
    """Answers that arrive in any order come back in the members' order, and the fold
    is not done while one is missing."""
    aggregator, waits = _waits(3)
    fold = asyncio.create_task(aggregator._answers(Ping(nonce=1), waits))
    for i in (2, 0):
        waits[i][1].set_result(_ack(i))
    await asyncio.sleep(0.05)
    assert not fold.done()
    waits[1][1].set_result(_ack(1))
    assert await fold == [_ack(0), _ack(1), _ack(2)]


async def test_a_fold_times_each_members_answer_for_its_rate() -> None:
    """Each member's rate takes the time its own result came, observed once the fold
    is done: a member that answered later has a lower rate; an Error is not a result
    and observes nothing."""
    aggregator, waits = _waits(3)
    loop = asyncio.get_running_loop()
    sent = loop.time()
    parts = [
        _Part(member, Ping(nonce=1), future, parts=1, cost=1.0, sent=sent)  # type: ignore[arg-type]
        for member, future in waits
    ]
    arrived: dict[int, float] = {}
    fold = asyncio.create_task(aggregator._answers(Ping(nonce=1), waits, arrived))
    await asyncio.sleep(0)
    for i, (_, future) in enumerate(waits):
        await asyncio.sleep(0.05)
        result = EvalResult(
            job_id=1,
            step=0,
            compute_us=1,
            estimator="two_sided",
            ks=(i,),
            loss_plus=(1.0,),
            loss_minus=(1.0,),
        )
        future.set_result(result if i < 2 else Error(code="numeric", ref_type=0, detail="x"))
    await fold
    assert all(m.throughput.observations == 0 for m, _ in waits)  # not before the fold ends
    _observe(parts, arrived)
    first, second, third = (m.throughput for m, _ in waits)
    assert first.observations == second.observations == 1 and third.observations == 0
    assert first.rate > second.rate
    assert 1 / first.rate >= 0.05 and 1 / second.rate >= 0.1


async def test_a_members_answer_counts_in_its_fold_without_a_loop_turn() -> None:
    """An answer handed to its member settles the fold's wait in the same call (no
    done-callback a loop turn later), as does a lost link; a waiter settled some other
    way still counts, through its done-callback; a late answer after the wait leaves no
    watcher behind."""
    members = [Member(None, _hello(f"m{i}")) for i in range(2)]
    update = ApplyUpdate(job_id=1, step=3, ks=(0,), coefficients=(0.5,))
    waits = [(m, m.expect(request_key(update))) for m in members]
    settled = _settled(waits)
    assert members[0].resolve(_ack(3)) and not settled.done()
    assert members[1].resolve(_ack(3)) and settled.done()  # no await in between
    assert all(not m.watchers for m in members)

    waits = [(m, m.expect(request_key(update))) for m in members]
    settled = _settled(waits)
    members[1].fail("link closed")
    assert settled.done()  # a gone member refuses at once

    loop = asyncio.get_running_loop()
    waits = [(members[0], loop.create_future())]
    settled = _settled(waits)
    waits[0][1].set_result(_ack(3))
    assert not settled.done()
    await asyncio.sleep(0)
    assert settled.done()

    aggregator, waits = _waits(1)
    with pytest.raises(_Refused):  # silent past the reply timeout
        await aggregator._answers(Ping(nonce=1), waits)
    assert not waits[0][0].watchers


async def test_a_fold_ends_at_the_first_refusal_without_waiting_for_the_rest() -> None:
    """A member's Error refuses the request at once, while members before it are still
    computing; a member's lost link refuses it as gone, and silence as busy after the
    host's reply timeout, naming the first silent member."""
    aggregator, waits = _waits(3)
    fold = asyncio.create_task(aggregator._answers(Ping(nonce=1), waits))
    error = Error(code="numeric", ref_type=0, detail="nan")
    waits[2][1].set_result(error)
    assert await asyncio.wait_for(fold, 0.2) == [error]

    aggregator, waits = _waits(3)
    fold = asyncio.create_task(aggregator._answers(Ping(nonce=1), waits))
    waits[1][1].set_exception(LinkClosedError("m1", "closed"))
    with pytest.raises(_Refused) as gone:
        await asyncio.wait_for(fold, 0.2)
    assert gone.value.error.code == "not_ready" and "m1 is gone" in gone.value.error.detail

    aggregator, waits = _waits(3)
    waits[0][1].set_result(_ack(0))
    waits[2][1].set_result(_ack(2))
    with pytest.raises(_Refused) as silent:
        await aggregator._answers(Ping(nonce=1), waits)
    assert silent.value.error.code == "busy" and "m1 did not answer" in silent.value.error.detail


@pytest.mark.parametrize("estimator", ["two_sided", "one_sided"])
def test_slice_answers_fold_into_the_whole_batch_losses(estimator: str) -> None:
    """Each key's loss is floor(sum of its slices' sums / B) as float32, whichever member
    answered which slice and however many keys an answer carries (SPEC 6.10)."""
    rng = random.Random(7)
    batch, ks = 6, tuple(range(5))
    bounds = [(0, 2), (2, 3), (5, 1)]
    request = EvalRequest(job_id=3, step=9, batch_size=batch, eps=1e-3, estimator=estimator, ks=ks)
    sums: dict[tuple[int, int], int] = {}
    zero: dict[int, int] = {}
    answers = []
    for start, count in bounds:
        zero[start] = rng.randrange(1 << 30)  # a slice's base loss: the same from each member
        for group in ((0, 1), (2,), (3, 4)):
            plus = tuple(rng.randrange(1 << 30) for _ in group)
            minus = tuple(rng.randrange(1 << 30) for _ in group)
            for k, p, m in zip(group, plus, minus, strict=True):
                sums[(k, 0)], sums[(k, 1)] = sums.get((k, 0), 0) + p, sums.get((k, 1), 0) + m
            answers.append(
                EvalSliceResult(
                    job_id=3, step=9, compute_us=100 + start, estimator=estimator,
                    slice_start=start, slice_count=count, ks=group, sum_plus=plus,
                    sum_minus=minus if estimator == "two_sided" else (),
                    sum_zero=None if estimator == "two_sided" else zero[start],
                )
            )  # fmt: skip
    rng.shuffle(answers)
    folded = _merged(request, answers)
    assert isinstance(folded, EvalResult)
    assert folded.compute_us == 105
    assert folded.loss_plus == tuple(sliced_batch_losses([[sums[(k, 0)]] for k in ks], batch))
    if estimator == "two_sided":
        assert folded.loss_minus == tuple(sliced_batch_losses([[sums[(k, 1)]] for k in ks], batch))
    else:
        assert folded.loss_zero == sliced_batch_losses([list(zero.values())], batch)[0]
