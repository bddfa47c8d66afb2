"""The daemon service without a broker: jobs through the control handlers, waiting for
boards in its status, stop with a checkpoint, resume of a running job on start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from pathlib import Path

import pytest

from qsched.daemon.config import DaemonConfig
from qsched.daemon.control import handle_payload
from qsched.daemon.notify import Notifier
from qsched.daemon.service import Daemon
from qsched.daemon.service import main as service_main
from qsched.daemon.state import StateStore
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.protocol.control import Reply
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.links.inproc import InProcTransport
from qsched.zo.trainer import train_zo
from qsched.zo.workload import TrainState

SPEC = {"name": "svc", "steps": 12, "eval_every": 4, "checkpoint_every": 5, "batch_size": 16}


def _config(state: Path) -> DaemonConfig:
    return DaemonConfig.model_validate({"state_dir": state, "mqtt": {"enabled": False}})


async def _command(daemon: Daemon, document: str) -> Reply:
    reply = await handle_payload(daemon, document)
    assert isinstance(reply, Reply), reply
    return reply


async def test_service_no_boards_status_says_waiting(tmp_path: Path) -> None:
    """A job without boards waits and says so; stop ends it as 'stopped' with a checkpoint."""
    async with Daemon(_config(tmp_path)) as daemon:
        await _command(daemon, '{"type": "start_job", "spec": {"name": "lonely", "steps": 5}}')
        await asyncio.sleep(0.5)
        assert "waiting for boards" in daemon._status_text()
        status = (await _command(daemon, '{"type": "status"}')).status
        assert status is not None and status.job is not None and status.job.state == "running"
        checkpoint = await _command(daemon, '{"type": "checkpoint"}')
        assert checkpoint.path is not None and Path(checkpoint.path).exists()
        await _command(daemon, '{"type": "stop"}')
        assert daemon.job is not None and daemon.job.task is not None
        await asyncio.wait_for(daemon.job.task, 10)
    assert StateStore(tmp_path).job("lonely").status()["status"] == "stopped"


async def test_service_resumes_running_job_on_start(tmp_path: Path) -> None:
    """A job left 'running' by a shutdown is resumed by the next daemon and ends exactly."""
    transport = InProcTransport()
    async with Daemon(_config(tmp_path), transports=[transport]) as daemon:
        endpoint = transport.attach("b0")
        board = asyncio.create_task(
            serve_link(BoardAgent("b0", latency=LatencyProfile.off()), endpoint)
        )
        await _command(daemon, json.dumps({"type": "start_job", "spec": SPEC}))
        while daemon.job is not None and daemon.job.engine.step < 6:
            await asyncio.sleep(0.01)
        daemon.request_stop()
    await endpoint.close()
    await board
    job = StateStore(tmp_path).job("svc")
    assert job.status()["status"] == "running"
    assert (job.load_checkpoint() or object()).step < 12  # type: ignore[attr-defined]

    transport = InProcTransport()
    async with Daemon(_config(tmp_path), transports=[transport]) as daemon:
        endpoint = transport.attach("b1")
        board = asyncio.create_task(
            serve_link(BoardAgent("b1", latency=LatencyProfile.off()), endpoint)
        )
        assert daemon.job is not None and daemon.job.task is not None
        await asyncio.wait_for(daemon.job.task, 30)
        await endpoint.close()
        await board
    assert job.status()["status"] == "completed"
    checkpoint = job.load_checkpoint()
    assert checkpoint is not None
    final = TrainState.from_bytes(checkpoint.train_state)
    assert final.checksum() == train_zo(JobSpec.model_validate(SPEC)).state.checksum()
    assert (tmp_path / "jobs" / "svc" / "export" / "svc.tflite").exists()


async def test_service_sd_notify_ready_status_watchdog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd hears READY, STATUS and WATCHDOG from the event loop, then STOPPING."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    try:
        async with Daemon(_config(tmp_path / "state"), notifier=Notifier(path)):
            await asyncio.sleep(0.4)
        await asyncio.sleep(0.05)
        received = []
        with contextlib.suppress(BlockingIOError):
            while True:
                received.append(sock.recv(4096).decode())
    finally:
        sock.close()
    text = "\n".join(received)
    assert "READY=1" in text and "STATUS=idle" in text
    assert text.count("WATCHDOG=1") >= 3
    assert received[-1].startswith("STOPPING=1") or any(
        r.startswith("STOPPING=1") for r in received
    )


@pytest.mark.parametrize("mqtt", ["foo", "host:0", "host:99999", "host:"])
def test_service_bad_mqtt_address_is_a_usage_error(
    mqtt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--mqtt`` that is not HOST:PORT exits 2 with one usage line, no traceback."""
    with pytest.raises(SystemExit) as exited:
        service_main(["--mqtt", mqtt])
    assert exited.value.code == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_service_uncreatable_state_dir_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A state directory that cannot be created exits 2 with one line naming it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exited:
        service_main(["--no-mqtt", "--state-dir", str(blocker / "state")])
    assert exited.value.code == 2
    assert "state directory" in capsys.readouterr().err
