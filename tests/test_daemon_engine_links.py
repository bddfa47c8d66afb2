"""The same job on in-process links, on serial pseudo-terminals and over a real Mosquitto
ends with the same weights: the reference trainer's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tty
from collections.abc import AsyncIterator

from qsched.daemon.engine import StepEngine
from qsched.daemon.fleet import Fleet
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.lab.broker import MosquittoBroker
from qsched.lab.harness import run_job_inprocess
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.base import Transport
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.links.mqtt import MqttEndpoint, MqttTransport
from qsched.protocol.links.serial import SerialEndpoint, SerialTransport
from qsched.protocol.topics import TopicMap
from qsched.zo.trainer import train_zo

SPEC = JobSpec(
    name="links",
    steps=8,
    eval_every=4,
    batch_size=32,
    policy=PolicySpec(name="fixed", config={"q": 6}),
)


async def _run(transport: Transport, boards: contextlib.AbstractAsyncContextManager[None]) -> int:
    async with transport, Fleet(transport) as fleet:  # type: ignore[attr-defined]
        if isinstance(transport, MqttTransport):
            await transport.wait_connected(10)
        async with boards:
            result = await StepEngine(SPEC, fleet).run()
    return result.state.checksum()


@contextlib.asynccontextmanager
async def _serial_boards(masters: list[int]) -> AsyncIterator[None]:
    served: list[asyncio.Task[str]] = []
    async with contextlib.AsyncExitStack() as stack, asyncio.TaskGroup() as tasks:
        for i, master in enumerate(masters):
            link = await stack.enter_async_context(SerialEndpoint.from_fd(master, f"pty-{i}"))
            served.append(
                tasks.create_task(
                    serve_link(BoardAgent(f"pty-{i}", latency=LatencyProfile.off()), link)
                )
            )
        try:
            yield
        finally:
            for task in served:
                task.cancel()


@contextlib.asynccontextmanager
async def _mqtt_boards(cfg: MqttConfig, topics: TopicMap, count: int) -> AsyncIterator[None]:
    served: list[asyncio.Task[str]] = []
    async with contextlib.AsyncExitStack() as stack, asyncio.TaskGroup() as tasks:
        for i in range(count):
            endpoint = await stack.enter_async_context(MqttEndpoint(cfg, topics, f"mq-{i}"))
            await endpoint.wait_connected(10)
            served.append(
                tasks.create_task(
                    serve_link(BoardAgent(f"mq-{i}", latency=LatencyProfile.off()), endpoint)
                )
            )
        try:
            yield
        finally:
            for task in served:
                task.cancel()


async def test_engine_links_same_weights_everywhere(mqtt_broker: MosquittoBroker) -> None:
    """In-process, serial-pty and MQTT fleets all reach the single-process weights."""
    reference = train_zo(SPEC).state.checksum()
    inproc = (await run_job_inprocess(SPEC, boards=3)).state.checksum()

    ptys = [os.openpty() for _ in range(2)]
    for _, slave in ptys:
        tty.setraw(slave)
    paths = [os.ttyname(slave) for _, slave in ptys]
    serial = await _run(
        SerialTransport(paths, reopen_interval=0.05), _serial_boards([m for m, _ in ptys])
    )
    for _, slave in ptys:
        os.close(slave)

    cfg = MqttConfig(host=mqtt_broker.host, port=mqtt_broker.port)
    topics = TopicMap(fleet="links")
    transport = MqttTransport(cfg, topics)
    mqtt = await _run(transport, _mqtt_boards(cfg, topics, 3))

    assert inproc == serial == mqtt == reference
