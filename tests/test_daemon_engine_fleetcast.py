"""One StepOrder per step on the fleet topic (SPEC 6.9): a fleet of boards that take it,
a board that does not, and a serial board behind the bridge trains to the reference
weights; what else lands on the fleet topic changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiomqtt
import pytest
from conftest import PtyPair
from test_daemon_bridge import pty_board, wait_until

from qsched.daemon.bridge import run_bridge
from qsched.daemon.engine import EngineConfig, StepEngine
from qsched.daemon.fleet import Fleet
from qsched.firmware.virtual import board as board_module
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.lab.broker import MosquittoBroker
from qsched.protocol import codec
from qsched.protocol.batch import unpack_batch
from qsched.protocol.codec import decode, encode, peek_header
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.links.mqtt import HostUplink, MqttEndpoint, MqttTransport, build_client
from qsched.protocol.links.mqtt import step_order_messages as messages_of
from qsched.protocol.messages import (
    PROTOCOL_VERSION,
    TYPE_CODES,
    ApplyUpdate,
    Ping,
    Shard,
    StepOrder,
)
from qsched.protocol.topics import TopicMap
from qsched.zo.trainer import train_zo

SPEC = JobSpec(
    name="fleetcast",
    steps=8,
    eval_every=4,
    batch_size=16,
    policy=PolicySpec(name="fixed", config={"q": 6}),
)
ORDER = StepOrder(
    job_id=7,
    step=3,
    ks=(0, 1, 2),
    coefficients=(0.5, -1.0, 0.25),
    batch_size=4,
    eps=0.01,
    estimator="two_sided",
    shards=(Shard(board_id="a", ks=(0, 1)), Shard(board_id="b")),
)


def test_step_order_gives_each_named_board_its_messages() -> None:
    """A named board gets the update then its request; one without keys the update
    alone; one not named, or a payload that is not a StepOrder, gives nothing."""
    payload = encode(ORDER)
    update, request = (decode(m) for m in messages_of(payload, "a"))
    expected = ApplyUpdate(job_id=7, step=3, ks=(0, 1, 2), coefficients=(0.5, -1.0, 0.25))
    assert update == expected == ORDER.update()  # the order's own, checked once
    assert encode(ORDER.update()) == encode(expected)
    assert request.type == "eval_request" and request.step == 4 and request.ks == (0, 1)
    assert (request.batch_size, request.eps, request.estimator) == (4, ORDER.eps, "two_sided")
    assert [decode(m) for m in messages_of(payload, "b")] == [update]
    assert messages_of(payload, "c") == []
    assert messages_of(b"QS" + bytes([PROTOCOL_VERSION]) + b"\x4a\x00", "a") == []  # truncated
    assert messages_of(encode(Ping(nonce=1)), "a") == []  # not an order


def test_a_step_orders_update_is_read_again_without_a_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The update a board's messages carry was made in this process: a shared decode of
    its bytes (a board's, a host aggregator's) finds it without decoding again."""
    order = ORDER.model_copy(update={"step": 11})  # bytes no other test made
    update_bytes = messages_of(encode(order), "b")[0]
    decodes: list[bytes] = []
    monkeypatch.setattr(codec, "decode", lambda data: decodes.append(data) or decode(data))
    shared = codec.decode_shared(update_bytes, TYPE_CODES[ApplyUpdate])
    assert shared == order.update() and decodes == []


def test_a_boards_request_from_a_step_order_is_taken_without_a_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The eval request a board takes from a step order was made in its process too: the
    board finds it (equal to what its bytes decode to) without decoding them."""
    order = ORDER.model_copy(update={"step": 12})  # bytes no other test made
    _, request_bytes = messages_of(encode(order), "a")
    expected = decode(request_bytes)
    decodes: list[bytes] = []
    monkeypatch.setattr(codec, "decode", lambda data: decodes.append(data) or decode(data))
    assert board_module._decode(request_bytes) == expected and decodes == []


def test_step_order_gives_a_slice_shard_its_slice_request() -> None:
    """A shard with a slice becomes an EvalSliceRequest of that slice."""
    order = ORDER.model_copy(
        update={"shards": (Shard(board_id="a", ks=(1, 2), slice_start=2, slice_count=2),)}
    )
    update, request = (decode(m) for m in messages_of(encode(order), "a"))
    assert update.type == "apply_update"
    assert request.type == "eval_slice_request" and request.step == 4 and request.ks == (1, 2)
    assert (request.slice_start, request.slice_count, request.batch_size) == (2, 2, 4)


def test_step_order_refuses_a_board_named_twice() -> None:
    """Two shards for one board would be two requests: the model refuses it."""
    with pytest.raises(ValueError, match="more than one shard"):
        StepOrder(**{**ORDER.model_dump(), "shards": (Shard(board_id="a"), Shard(board_id="a"))})


@contextlib.asynccontextmanager
async def _mqtt_board(
    cfg: MqttConfig,
    topics: TopicMap,
    board_id: str,
    *,
    fleet_in: bool = True,
    uplink: HostUplink | None = None,
    latency: LatencyProfile | None = None,
) -> AsyncIterator[None]:
    async with MqttEndpoint(cfg, topics, board_id, fleet_in=fleet_in, uplink=uplink) as endpoint:
        await endpoint.wait_connected(10)
        agent = BoardAgent(board_id, latency=latency or LatencyProfile.off())
        task = asyncio.create_task(serve_link(agent, endpoint))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class _Watcher:
    """Counts what the daemon publishes per kind, and throws junk on the fleet topic."""

    def __init__(self, cfg: MqttConfig, topics: TopicMap) -> None:
        self.cfg, self.topics = cfg, topics
        self.orders = 0
        self.own: dict[str, int] = {}  # board -> ApplyUpdates on its own topic
        self.ready = asyncio.Event()

    async def run(self) -> None:
        async with build_client(self.cfg, "fleetcast-watcher") as client:
            await client.subscribe(self.topics.fleet_in(), qos=1)
            await client.subscribe(f"{self.topics.base}/boards/+/in", qos=1)
            self.ready.set()
            junk_sent = False
            async for message in client.messages:
                payload = bytes(message.payload)  # type: ignore[arg-type]
                code = peek_header(payload)[1] if payload.startswith(b"QS") else None
                if message.topic.value == self.topics.fleet_in():
                    self.orders += code == TYPE_CODES[StepOrder]
                    if not junk_sent:  # once a step is under way: junk, an order of no job
                        junk_sent = True
                        await client.publish(self.topics.fleet_in(), b"not a message", qos=1)
                        stray = ORDER.model_copy(update={"job_id": 1})
                        await client.publish(self.topics.fleet_in(), encode(stray), qos=1)
                elif code == TYPE_CODES[ApplyUpdate]:
                    board = message.topic.value.split("/")[-2]
                    self.own[board] = self.own.get(board, 0) + 1


async def test_fleet_of_order_takers_a_legacy_board_and_a_bridged_board_trains_alike(
    pty_pair: PtyPair, mqtt_broker: MosquittoBroker
) -> None:
    """Boards that take StepOrders, one that takes its own messages and a serial board
    behind the bridge (its messages up in the bridge's host batches) end with the
    single-process weights; updates reached the order takers as one publish per step."""
    cfg = MqttConfig(host=mqtt_broker.host, port=mqtt_broker.port, reconnect_min_s=0.1)
    topics = TopicMap(fleet="fleetcast")
    watcher = _Watcher(cfg, topics)
    watching = asyncio.create_task(watcher.run())
    await asyncio.wait_for(watcher.ready.wait(), 10)
    async with (
        contextlib.AsyncExitStack() as stack,
        MqttTransport(cfg, topics) as transport,
        Fleet(transport) as fleet,
        _mqtt_board(cfg, topics, "taker-0", fleet_in=True),
        _mqtt_board(cfg, topics, "taker-1", fleet_in=True),
        _mqtt_board(cfg, topics, "legacy-0", fleet_in=False),
    ):
        await transport.wait_connected(10)
        uplink = await stack.enter_async_context(HostUplink(cfg, topics, "bridge-host"))
        bridge = asyncio.create_task(
            run_bridge([pty_pair.path], cfg, topics, reopen_interval=0.1, uplink=uplink)
        )
        try:
            async with pty_board(pty_pair, "serial-0"):
                names = ("taker-0", "taker-1", "legacy-0", "serial-0")
                await wait_until(
                    lambda: all(fleet.find(n) and fleet.find(n).hello for n in names), fleet
                )  # type: ignore[union-attr]
                links = {n: fleet.find(n).link for n in names}  # type: ignore[union-attr]
                result = await StepEngine(SPEC, fleet, config=EngineConfig(audit_every=1)).run()
        finally:
            bridge.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await bridge
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
                await watching
    assert result.status == "completed"
    assert result.state.checksum() == train_zo(SPEC).state.checksum()
    assert {n: getattr(link, "fleet_in", None) for n, link in links.items()} == {
        "taker-0": True,
        "taker-1": True,
        "legacy-0": False,
        "serial-0": True,  # the bridge takes orders apart for its serial boards
    }
    assert uplink.records >= 2 * SPEC.steps  # the bridged board's acks and results went up

    assert watcher.orders >= SPEC.steps - 1  # every update but the unpipelined last ones
    assert watcher.own.get("legacy-0", 0) >= SPEC.steps - 1
    assert not any(watcher.own.get(n) for n in ("taker-0", "taker-1", "serial-0"))
    assert all(result.work.get(n) for n in ("taker-0", "taker-1", "legacy-0", "serial-0"))


async def test_boards_behind_one_host_uplink_train_alike(mqtt_broker: MosquittoBroker) -> None:
    """Boards whose messages go up in their host's batches, next to a board that publishes
    its own, end with the single-process weights."""
    cfg = MqttConfig(host=mqtt_broker.host, port=mqtt_broker.port, reconnect_min_s=0.1)
    topics = TopicMap(fleet="uplink")
    names = ("hosted-0", "hosted-1", "hosted-2", "alone-0")
    async with (
        MqttTransport(cfg, topics) as transport,
        Fleet(transport) as fleet,
        HostUplink(cfg, topics, "host-a") as uplink,
        _mqtt_board(cfg, topics, "hosted-0", uplink=uplink),
        _mqtt_board(cfg, topics, "hosted-1", uplink=uplink),
        _mqtt_board(cfg, topics, "hosted-2", uplink=uplink),
        _mqtt_board(cfg, topics, "alone-0"),
    ):
        await transport.wait_connected(10)
        await wait_until(lambda: all(fleet.find(n) and fleet.find(n).hello for n in names), fleet)  # type: ignore[union-attr]
        result = await StepEngine(SPEC, fleet, config=EngineConfig(audit_every=1)).run()
    assert result.status == "completed"
    assert result.state.checksum() == train_zo(SPEC).state.checksum()
    assert all(result.work.get(n) for n in names)
    # Each hosted board sent at least an ack and a result per step, all in batches.
    assert uplink.records >= 3 * 2 * SPEC.steps and uplink.batches > 0


async def test_host_uplink_sends_one_moment_as_one_batch(mqtt_broker: MosquittoBroker) -> None:
    """Messages of several boards sent in one loop turn go out as one publish that the
    daemon's transport splits back into each board's link, in order."""
    cfg = MqttConfig(host=mqtt_broker.host, port=mqtt_broker.port)
    topics = TopicMap(fleet="batch")
    received: list[bytes] = []
    async with build_client(cfg, "batch-watcher") as client:
        await client.subscribe(topics.all_host_out(), qos=1)
        async with HostUplink(cfg, topics, "h") as uplink:
            sends = [uplink.send(f"b{i}", encode(Ping(nonce=i))) for i in range(5)]
            await asyncio.gather(*sends)
            async with asyncio.timeout(10):
                async for message in client.messages:
                    received.append(bytes(message.payload))  # type: ignore[arg-type]
                    break
    assert (uplink.batches, uplink.records) == (1, 5)
    assert unpack_batch(received[0]) == [(f"b{i}", encode(Ping(nonce=i))) for i in range(5)]


async def test_split_batches_over_the_fleet_topic_train_alike(mqtt_broker: MosquittoBroker) -> None:
    """One key a step on four order takers and a legacy board: the StepOrder carries
    slice shards, the legacy board gets its EvalSliceRequest on its own topic, and the
    weights are the single-process run's."""
    spec = JobSpec(
        name="split-mqtt",
        steps=6,
        eval_every=3,
        batch_size=4,
        numerics="int8",
        policy=PolicySpec(name="fixed", config={"q": 1}),
    )
    cfg = MqttConfig(host=mqtt_broker.host, port=mqtt_broker.port, reconnect_min_s=0.1)
    topics = TopicMap(fleet="split")
    latency = LatencyProfile(macs_per_forward=20_000_000)  # modelled time dominates: even rates
    names = ("taker-0", "taker-1", "taker-2", "taker-3", "legacy-0")
    async with contextlib.AsyncExitStack() as stack:
        transport = await stack.enter_async_context(MqttTransport(cfg, topics))
        fleet = await stack.enter_async_context(Fleet(transport))
        for name in names:
            await stack.enter_async_context(
                _mqtt_board(cfg, topics, name, fleet_in=name != "legacy-0", latency=latency)
            )
        await transport.wait_connected(10)
        await wait_until(lambda: all(fleet.find(n) and fleet.find(n).hello for n in names), fleet)  # type: ignore[union-attr]
        result = await StepEngine(spec, fleet, config=EngineConfig(audit_every=1)).run()
    assert result.status == "completed"
    assert result.split_steps >= spec.steps - 2  # the first steps may start with fewer boards
    assert result.state.checksum() == train_zo(spec).state.checksum()
    assert sum(1 for n in names if result.work.get(n)) >= 4
