"""A fleet whose links fail at once (a broker gone with its socket half open): the engine
neither spins nor ignores a stop, and says it waits for boards."""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import AsyncIterator

from conftest import WrappedInProcTransport

from qsched.daemon.engine import EngineConfig, StepEngine
from qsched.daemon.fleet import Fleet
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.base import Link, SendTimeoutError
from qsched.protocol.links.inproc import InProcTransport

SPEC = JobSpec(
    name="stall",
    steps=10_000,
    eval_every=1000,
    batch_size=8,
    policy=PolicySpec(name="fixed", config={"q": 4}),
)


class _BrokenLink:
    """The daemon's end of a link whose sends fail at once once ``broken`` is set,
    while the link still looks open (what a half-closed MQTT socket looks like)."""

    def __init__(self, inner: Link, switch: _Switch) -> None:
        self._inner = inner
        self._switch = switch

    @property
    def closed(self) -> bool:
        return self._inner.closed

    async def send(self, payload: bytes) -> None:
        self._switch.sends += 1
        if self._switch.broken:
            raise SendTimeoutError("any", "broker_unreachable", "injected")
        await self._inner.send(payload)

    def incoming(self) -> AsyncIterator[bytes]:
        return self._inner.incoming()

    async def close(self) -> None:
        await self._inner.close()


class _Switch:
    broken = False
    sends = 0


async def _loop_lag(seconds: float) -> float:
    """The worst delay of a 10 ms sleep over ``seconds`` (a spinning loop makes it large)."""
    worst, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        before = time.monotonic()
        await asyncio.sleep(0.01)
        worst = max(worst, time.monotonic() - before - 0.01)
    return worst


async def _advance(engine: StepEngine, step: int) -> None:
    while engine.step < step:
        await asyncio.sleep(0.01)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def test_engine_links_failing_at_once_no_spin_and_stop() -> None:
    """Sends that fail at once: loop responsive, CPU idle, work resumes with the links, a stop
    ends the run."""
    switch = _Switch()
    transport = WrappedInProcTransport(lambda link, _board: _BrokenLink(link, switch))
    config = EngineConfig(step_deadline_s=0.5, reply_timeout_s=1.0, resync_backoff_s=0.05)
    async with (
        transport,
        Fleet(transport, heartbeat_interval=0.2) as fleet,
        asyncio.TaskGroup() as tasks,
    ):
        for i in range(2):
            endpoint = transport.inner.attach(f"br-{i}")
            tasks.create_task(
                serve_link(BoardAgent(f"br-{i}", latency=LatencyProfile.off()), endpoint)
            )
        engine = StepEngine(SPEC, fleet, config=config)
        run = tasks.create_task(engine.run())
        while engine.step < 3:
            await asyncio.sleep(0.01)
        switch.broken = True
        await asyncio.sleep(0.3)  # the step in flight fails
        sends, cpu, wall = switch.sends, _cpu_s(), time.monotonic()
        lag = await _loop_lag(1.0)
        cpu_share = (_cpu_s() - cpu) / (time.monotonic() - wall)
        attempts = switch.sends - sends
        assert lag < 0.1, f"event loop blocked {lag:.3f} s"
        assert attempts < 100, f"{attempts} sends in a second: the engine spins"
        assert cpu_share < 0.5, f"CPU {cpu_share:.0%} while no board can work"
        assert "waiting for boards" in engine.status_line
        assert fleet.boards() and not any(s.alive for s in fleet.boards())  # out of the ready set
        stalled_at = engine.step
        switch.broken = False  # the broker is back: a ping brings the links up
        await asyncio.wait_for(_advance(engine, stalled_at + 2), 10.0)
        switch.broken = True
        await asyncio.sleep(0.3)
        engine.stop(shutdown=True)
        result = await asyncio.wait_for(run, 3.0)
        assert result.status == "running" and result.state.step == engine.step
        for session in list(fleet.sessions.values()):
            await session.link.close()


async def test_engine_shutdown_mid_step_does_not_wait_for_answers() -> None:
    """A shutdown stop while slow boards compute ends the run at once, the step undone."""
    slow = LatencyProfile.named("mobilenetv2-0.35-128", speed=0.01)  # a minute per shard
    config = EngineConfig(step_deadline_s=60.0)
    async with (
        InProcTransport() as transport,
        Fleet(transport) as fleet,
        asyncio.TaskGroup() as tasks,
    ):
        boards = [
            tasks.create_task(
                serve_link(BoardAgent(f"sl-{i}", latency=slow), transport.attach(f"sl-{i}"))
            )
            for i in range(2)
        ]
        engine = StepEngine(SPEC, fleet, config=config)
        run = tasks.create_task(engine.run())
        while not any(s.state == "busy" for s in fleet.boards()):
            await asyncio.sleep(0.01)
        engine.stop(shutdown=True)
        result = await asyncio.wait_for(run, 2.0)
        assert result.status == "running" and result.state.step == 0
        for board in boards:
            board.cancel()  # still modelling a minute of NPU time
