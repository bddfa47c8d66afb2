"""``qsched board`` as a process: over a real pseudo-terminal and over a private Mosquitto."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
from test_firmware_virtual_board import eval_request, load_messages

from qsched.firmware.virtual.cli import board_ids, main
from qsched.firmware.virtual.faults import CRASH_EXIT_CODE
from qsched.lab.broker import MosquittoBroker
from qsched.protocol.codec import decode, encode
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.links.base import BoardAppeared, BoardGone
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.links.mqtt import MqttTransport
from qsched.protocol.links.serial import FdStream, SerialLink
from qsched.protocol.messages import EvalResult, Hello, Loaded
from qsched.protocol.topics import TopicMap
from qsched.zo.workload import Workload

# The ``qsched`` entry point, run by this interpreter wherever its scripts were installed.
QSCHED = [sys.executable, "-m", "qsched.daemon.cli"]
TIMEOUT_S = 30.0


@pytest.fixture
def pty_board(request: pytest.FixtureRequest) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A ``qsched board --serial <pty>`` process with extra args; yields (master fd, process)."""
    master, slave = os.openpty()
    args = [
        *QSCHED,
        "--log-level",
        "warning",
        "board",
        "--serial",
        os.ttyname(slave),
        "--id",
        "pty-0",
        "--model-latency",
        "off",
        "--heartbeat",
        "60",
        *getattr(request, "param", []),
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # The slave stays open here too: a pty master whose slave has no open descriptor
        # reads as hung up, which would end the link before the board opens the port.
        yield master, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
        os.close(slave)


async def next_message(inbox: AsyncIterator[bytes], kind: type) -> object:
    """The next message of ``kind`` (heartbeats and others skipped)."""
    while True:
        msg = decode(await asyncio.wait_for(anext(inbox), TIMEOUT_S))
        if isinstance(msg, kind):
            return msg


@pytest.mark.parametrize(
    "pty_board", [["--fault", "corrupt:0.25", "--fault-seed", "4"]], indirect=True
)
async def test_board_cli_serial_pty_hello_and_eval(
    pty_board: tuple[int, subprocess.Popen[bytes]],
) -> None:
    """Over a real pty, with a quarter of its frames corrupted, the board loads and evaluates
    exactly."""
    master, proc = pty_board
    workload = Workload.from_spec(JobSpec(numerics="int8", batch_size=16, seed=2))
    async with SerialLink("serial:pty", FdStream(master), ack_timeout=0.2) as link:
        inbox = link.incoming()
        hello = await next_message(inbox, Hello)
        assert isinstance(hello, Hello) and hello.board_id == "pty-0" and hello.npu == "virtual"
        for msg in load_messages(workload):
            await link.send(encode(msg))
        for _ in range(3):
            await next_message(inbox, Loaded)
        await link.send(encode(eval_request(workload, 0, (0, 1, 2))))
        result = await next_message(inbox, EvalResult)
        expected = workload.perturbed_losses(workload.initial_state(), 0, (0, 1, 2))
        assert isinstance(result, EvalResult)
        assert list(result.loss_plus) == [expected.plus[k] for k in (0, 1, 2)]
        assert list(result.loss_minus) == [expected.minus[k] for k in (0, 1, 2)]
        assert link.stats.bad_frames > 0  # the corruption happened, and the CRC caught it
    assert proc.wait(TIMEOUT_S) == 0  # the port is gone: the board process ends


@pytest.mark.parametrize("pty_board", [["--fault", "crash-at-step:3"]], indirect=True)
async def test_board_cli_crash_exits_the_process(
    pty_board: tuple[int, subprocess.Popen[bytes]],
) -> None:
    """crash-at-step:3 kills the process with CRASH_EXIT_CODE on a request for step 3."""
    master, proc = pty_board
    workload = Workload.from_spec(JobSpec(numerics="int8", batch_size=16, seed=2))
    async with SerialLink("serial:pty", FdStream(master), ack_timeout=0.2, max_retries=1) as link:
        await next_message(link.incoming(), Hello)
        await link.send(encode(eval_request(workload, 3, (0,))))
        assert await asyncio.to_thread(proc.wait, TIMEOUT_S) == CRASH_EXIT_CODE


async def test_board_cli_mqtt_count_four_births(mqtt_broker: MosquittoBroker) -> None:
    """--count 4 over MQTT: four births with ids board-00..03, four Hellos, four offlines on
    SIGTERM."""
    cfg = MqttConfig(host=mqtt_broker.host, port=mqtt_broker.port, reconnect_min_s=0.1)
    async with MqttTransport(cfg, TopicMap(fleet="vbtest")) as transport:
        await transport.wait_connected(TIMEOUT_S)
        proc = subprocess.Popen(
            [
                *QSCHED,
                "--log-level",
                "warning",
                "board",
                "--mqtt",
                f"{mqtt_broker.host}:{mqtt_broker.port}",
                "--fleet",
                "vbtest",
                "--count",
                "4",
                "--model-latency",
                "off",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            events = transport.events()
            links = {}
            while len(links) < 4:
                event = await asyncio.wait_for(anext(events), TIMEOUT_S)
                assert isinstance(event, BoardAppeared)
                links[event.board_id] = event.link
            assert sorted(links) == ["board-00", "board-01", "board-02", "board-03"]
            for board_id, link in links.items():
                hello = await next_message(link.incoming(), Hello)
                assert isinstance(hello, Hello) and hello.board_id == board_id
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, TIMEOUT_S) == 0
            gone = [await asyncio.wait_for(anext(events), TIMEOUT_S) for _ in range(4)]
            assert all(isinstance(e, BoardGone) and e.reason == "offline" for e in gone)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


def test_board_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Bad combinations and fault texts are usage errors (status 2), with a reason."""
    assert main(["--serial", "/dev/null", "--mqtt", "h:1"]) == 2
    assert main(["--mqtt", "h:1", "--fault", "explode:1"]) == 2
    assert main(["--mqtt", "nohostport"]) == 2
    assert main(["--mqtt", "h:1", "--count", "2", "--id", "x"]) == 2
    assert "explode" in capsys.readouterr().err


def test_board_ids_are_numbered() -> None:
    """Ids are PREFIX-00.. with enough digits for the count."""
    assert board_ids(3) == ["board-00", "board-01", "board-02"]
    assert board_ids(120, "vb")[-1] == "vb-119"
    assert board_ids(1, explicit="solo") == ["solo"]
