"""``qsched bridge``: a virtual board on a pseudo-terminal, behind a bridge, in an MQTT fleet."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import PtyPair

from qsched.daemon.bridge import main, run_bridge
from qsched.daemon.engine import EngineConfig, StepEngine
from qsched.daemon.fleet import Fleet
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.lab.broker import MosquittoBroker
from qsched.protocol.codec import decode
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.base import BoardAppeared, BoardGone
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.links.mqtt import MqttTransport
from qsched.protocol.links.serial import SerialEndpoint
from qsched.protocol.messages import Hello
from qsched.protocol.topics import TopicMap
from qsched.zo.trainer import train_zo

TIMEOUT_S = 30.0
SPEC = JobSpec(
    name="bridged",
    steps=6,
    eval_every=3,
    batch_size=16,
    policy=PolicySpec(name="fixed", config={"q": 4}),
)


@contextlib.asynccontextmanager
async def pty_board(
    pty: PtyPair, board_id: str, heartbeat: float = 5.0
) -> AsyncIterator[asyncio.Task[str]]:
    """A virtual board serving the master end of ``pty`` (its port is ``pty.path``)."""
    async with SerialEndpoint.from_fd(
        pty.take_master(), board_id, ack_timeout=0.5, max_retries=20
    ) as link:
        agent = BoardAgent(board_id, latency=LatencyProfile.off())
        task = asyncio.create_task(serve_link(agent, link, heartbeat_interval=heartbeat))
        try:
            yield task
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def start_bridge(pty: PtyPair, broker: MosquittoBroker, fleet: str) -> subprocess.Popen[bytes]:
    """``qsched bridge`` for the pty's port, as a process."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qsched.daemon.cli",
            "--log-level",
            "warning",
            "bridge",
            "--serial",
            pty.path,
            "--mqtt",
            f"{broker.host}:{broker.port}",
            "--fleet",
            fleet,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def bridged_session(
    transport: MqttTransport, bridge: subprocess.Popen[bytes], board_id: str
) -> None:
    """The board appears through ``bridge`` and says Hello; SIGTERM makes it go offline."""
    events = transport.events()
    appeared = await asyncio.wait_for(anext(events), TIMEOUT_S)
    assert isinstance(appeared, BoardAppeared) and appeared.board_id == board_id
    hello = decode(await asyncio.wait_for(anext(appeared.link.incoming()), TIMEOUT_S))
    assert isinstance(hello, Hello) and hello.board_id == board_id
    bridge.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(bridge.wait, TIMEOUT_S) == 0
    gone = await asyncio.wait_for(anext(events), TIMEOUT_S)
    assert isinstance(gone, BoardGone) and gone.board_id == board_id


async def wait_until(predicate: object, fleet: Fleet) -> None:
    """Wait for ``predicate()`` to hold, re-checking on every fleet change."""
    async with asyncio.timeout(TIMEOUT_S):
        while not predicate():  # type: ignore[operator]
            await fleet.wait_changed(0.2)


async def test_bridge_board_joins_mqtt_fleet_and_trains(
    pty_pair: PtyPair, mqtt_broker: MosquittoBroker
) -> None:
    """A pty board behind the bridge trains to the reference weights; unplugged, it leaves."""
    cfg = MqttConfig(host=mqtt_broker.host, port=mqtt_broker.port, reconnect_min_s=0.1)
    topics = TopicMap(fleet="bridged")
    async with MqttTransport(cfg, topics) as transport, Fleet(transport) as fleet:
        await transport.wait_connected(TIMEOUT_S)
        bridge = asyncio.create_task(run_bridge([pty_pair.path], cfg, topics, reopen_interval=0.1))
        try:
            async with pty_board(pty_pair, "far-07"):
                await wait_until(
                    lambda: fleet.find("far-07") is not None and fleet.find("far-07").hello, fleet
                )
                session = fleet.find("far-07")
                assert session is not None and session.transport == "mqtt"
                result = await StepEngine(SPEC, fleet, config=EngineConfig(audit_every=0)).run()
            # The board's port is gone: the bridge says offline on its behalf.
            await wait_until(lambda: fleet.find("far-07") is None, fleet)
        finally:
            bridge.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await bridge
    assert result.status == "completed" and result.work == {"far-07": 6 * 4}
    assert result.state.checksum() == train_zo(SPEC).state.checksum()


async def test_bridge_cli_restart_asks_for_the_hello(
    pty_pair: PtyPair, mqtt_broker: MosquittoBroker
) -> None:
    """A restarted bridge finds a board that said Hello long ago, asks again, and it rejoins."""
    cfg = MqttConfig(host=mqtt_broker.host, port=mqtt_broker.port, reconnect_min_s=0.1)
    async with (
        MqttTransport(cfg, TopicMap(fleet="cli")) as transport,
        pty_board(pty_pair, "early-01", 60.0) as board,
    ):
        await transport.wait_connected(TIMEOUT_S)
        for _ in range(2):  # the second bridge only gets a Hello by asking for one (soft Reset)
            bridge = start_bridge(pty_pair, mqtt_broker, "cli")
            try:
                await bridged_session(transport, bridge, "early-01")
            finally:
                if bridge.poll() is None:
                    bridge.kill()
                    bridge.wait(5)
        assert not board.done()  # the board lived through both bridges


def test_bridge_without_ports_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --serial and no configured ports: exit 2 with a sentence saying so."""
    monkeypatch.delenv("QSCHED_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["--mqtt", "127.0.0.1:1883"]) == 2
    assert "no serial ports" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--aggregate", "lab/3"], "topic level"),
        (["--aggregate", "lab-3", "--host-uplink", "lab-3"], "no --host-uplink"),
    ],
)
def test_bridge_aggregate_usage_errors(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    said: str,
) -> None:
    """A name that is not one topic level, or --aggregate with --host-uplink: exit 2."""
    monkeypatch.delenv("QSCHED_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["--serial", "/dev/null", "--mqtt", "127.0.0.1:1883", *extra]) == 2
    assert said in capsys.readouterr().err
