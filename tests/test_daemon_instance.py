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
from qsched.daemon.instance import EXIT_ANOTHER_INSTANCE
from qsched.daemon.service import Daemon
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
