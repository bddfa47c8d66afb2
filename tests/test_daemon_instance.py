"""One daemon per state directory: a second one is refused, the first is unharmed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from qsched.daemon.config import DaemonConfig
from qsched.daemon.control import handle_payload
from qsched.daemon.errors import InstanceError
from qsched.daemon.instance import EXIT_ANOTHER_INSTANCE, EXIT_FLEET_TAKEN
from qsched.daemon.service import Daemon
from qsched.lab.broker import MosquittoBroker
from qsched.protocol.control import Reply


def _config(state: Path) -> DaemonConfig:
    return DaemonConfig.model_validate({"state_dir": state, "mqtt": {"enabled": False}})


async def test_instance_second_daemon_is_refused_first_unharmed(tmp_path: Path) -> None:
    """In one process or another: refused at once, with the holder's pid; the first serves on."""
    async with Daemon(_config(tmp_path)) as first:
        with pytest.raises(InstanceError, match="another qsched daemon"):
            async with Daemon(_config(tmp_path)):
                pass
        command = [sys.executable, "-m", "qsched.daemon.cli", "daemon", "--no-mqtt"]
        other = await asyncio.to_thread(
            subprocess.run,
            [*command, "--state-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert other.returncode == EXIT_ANOTHER_INSTANCE
        lines = other.stderr.strip().splitlines()
        assert len(lines) == 1 and "another qsched daemon" in lines[0], other.stderr
        assert "Traceback" not in other.stderr
        reply = await handle_payload(first, '{"type": "status"}')
        assert isinstance(reply, Reply) and reply.ok
    async with Daemon(_config(tmp_path)):  # the lock went with the first daemon
        pass


async def test_instance_second_daemon_on_the_fleet_is_refused(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """Another state directory, same fleet and broker: refused with exit status 4; the first
    keeps its connection (no client-id fight) and restarts of it are not refused."""
    mqtt = {"host": mqtt_broker.host, "port": mqtt_broker.port}
    first_cfg = DaemonConfig.model_validate(
        {"state_dir": tmp_path / "a", "fleet": "f1", "mqtt": mqtt}
    )
    async with Daemon(first_cfg) as first:
        connects = first._mqtt.connection.connects
        command = [sys.executable, "-m", "qsched.daemon.cli", "daemon", "--fleet", "f1"]
        command += [
            "--state-dir",
            str(tmp_path / "b"),
            "--mqtt",
            f"{mqtt_broker.host}:{mqtt_broker.port}",
        ]
        other = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=60, check=False
        )
        assert other.returncode == EXIT_FLEET_TAKEN, other.stderr
        assert "is online on fleet 'f1'" in other.stderr and "Traceback" not in other.stderr
        assert first._mqtt.connection.connected and first._mqtt.connection.connects == connects
        reply = await handle_payload(first, '{"type": "status"}')
        assert isinstance(reply, Reply) and reply.ok
    async with Daemon(first_cfg):  # its Will said offline: the next start is free
        pass
