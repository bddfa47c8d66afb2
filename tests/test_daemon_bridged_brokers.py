"""A fleet spread over two Mosquitto brokers joined by Mosquitto's own bridge trains to
the single-process weights: the daemon on one broker, boards on both (docs/FLEET.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from qsched.daemon.engine import StepEngine
from qsched.daemon.fleet import Fleet
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.lab.broker import MosquittoBroker
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.links.mqtt import MqttEndpoint, MqttTransport
from qsched.protocol.topics import TopicMap
from qsched.zo.trainer import train_zo

SPEC = JobSpec(
    name="two-brokers",
    steps=6,
    eval_every=3,
    batch_size=16,
    policy=PolicySpec(name="fixed", config={"q": 6}),
)
TIMEOUT_S = 30.0


def bridge_conf(name: str, remote: MosquittoBroker, fleet_base: str) -> list[str]:
    """The lines that join a broker to ``remote``: the fleet's topics both ways."""
    return [
        f"connection {name}",
        f"address {remote.host}:{remote.port}",
        f"topic {fleet_base}/# both 1",
        "bridge_protocol_version mqttv50",
        "cleansession true",
        "try_private true",
        "restart_timeout 1",
        "start_type automatic",
    ]


@contextlib.asynccontextmanager
async def _boards(broker: MosquittoBroker, topics: TopicMap, ids: list[str]) -> AsyncIterator[None]:
    cfg = MqttConfig(host=broker.host, port=broker.port, reconnect_min_s=0.1)
    async with contextlib.AsyncExitStack() as stack:
        tasks = []
        for board_id in ids:
            endpoint = await stack.enter_async_context(MqttEndpoint(cfg, topics, board_id))
            await endpoint.wait_connected(TIMEOUT_S)
            agent = BoardAgent(board_id, latency=LatencyProfile.off())
            tasks.append(asyncio.create_task(serve_link(agent, endpoint)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_fleet_on_two_bridged_brokers_trains_to_the_same_bits() -> None:
    """Boards on the far broker reach the daemon through Mosquitto's bridge, step orders
    included, and the job ends with the reference checksum."""
    topics = TopicMap(fleet="split")
    near = MosquittoBroker()
    with near, MosquittoBroker(conf=bridge_conf("to-near", near, topics.base)) as far:
        cfg = MqttConfig(host=near.host, port=near.port, reconnect_min_s=0.1)
        async with (
            MqttTransport(cfg, topics) as transport,
            Fleet(transport) as fleet,
            _boards(near, topics, ["near-0"]),
            _boards(far, topics, ["far-0", "far-1"]),
        ):
            await transport.wait_connected(TIMEOUT_S)
            async with asyncio.timeout(TIMEOUT_S):
                while not all(
                    (s := fleet.find(n)) is not None and s.hello
                    for n in ("near-0", "far-0", "far-1")
                ):
                    await fleet.wait_changed(0.2)
            result = await StepEngine(SPEC, fleet).run()
    assert result.status == "completed"
    assert all(result.work.get(n) for n in ("near-0", "far-0", "far-1"))
    assert result.state.checksum() == train_zo(SPEC).state.checksum()
