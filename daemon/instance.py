"""One daemon per state directory and per fleet.

Two daemons on one state directory would resume the same job twice and fight over the
MQTT client id. The first takes ``<state>/daemon.lock`` with ``flock``; the kernel
drops the lock when the process ends, however it ends, so a SIGKILLed daemon leaves no
stale lock. The file records who holds it, for the refusal message. Two daemons on one
fleet and broker (other state directories, other hosts) are told apart by the instance
id in the fleet's retained daemon state, read before the daemon connects under the
fleet's client id.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path
from typing import Final

import aiomqtt
import structlog

from qsched.daemon.errors import FleetTakenError, InstanceError
from qsched.protocol.control import DaemonPresence
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.links.mqtt import build_client
from qsched.protocol.topics import TopicMap

_log = structlog.get_logger("qsched.daemon")

__all__ = [
    "EXIT_ANOTHER_INSTANCE",
    "EXIT_FLEET_TAKEN",
    "LOCK_NAME",
    "InstanceLock",
    "check_fleet_free",
]

LOCK_NAME: Final = "daemon.lock"
# The exit status of a daemon that found another on its state directory (systemd's unit
# does not restart on it: RestartPreventExitStatus).
EXIT_ANOTHER_INSTANCE: Final = 3
# The exit status of a daemon that found another online on its fleet and broker. systemd
# restarts on it: a daemon that died without its Will reaching the broker yet (a power
# cut) stays "online" until the broker's keepalive runs out, and the next try succeeds.
EXIT_FLEET_TAKEN: Final = 4
# How long a start waits for the fleet's retained daemon state (it comes at once if any).
FLEET_PROBE_S: Final = 0.5


class InstanceLock:
    """The state directory's lock.

    Args:
        state_dir: the daemon's state directory.
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or fail at once.

        Raises:
            InstanceError: another process holds it (its pid is named when known).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise InstanceError(
                f"another qsched daemon (pid {holder}) runs on the state directory "
                f"{self.path.parent}; stop it first or give this one another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Let go of the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


async def check_fleet_free(cfg: MqttConfig, topics: TopicMap, instance: str) -> None:
    """Refuse to start when another daemon says it is online on this fleet and broker.

    The daemon's MQTT client id is fixed per fleet, so a second daemon would keep
    disconnecting the first. Before it connects under that id, a probe with its own id
    reads the fleet's retained daemon state.

    Args:
        cfg: the broker.
        topics: the fleet's topics.
        instance: this daemon's instance id (its own old state does not count).

    Raises:
        FleetTakenError: another daemon is online there. A broker that cannot be
            reached now is no refusal: the daemon's connection loop retries it.
    """
    try:
        async with build_client(cfg, f"qsched-probe-{instance[:16]}") as client:
            await client.subscribe(topics.daemon_state(), qos=1)
            other = await _retained_presence(client)
    except aiomqtt.MqttError as exc:
        _log.info("fleet check skipped: broker not reachable", error=str(exc))
        return
    if other is not None and other.online and other.instance != instance:
        job = f", job {other.job}" if other.job else ""
        raise FleetTakenError(
            f"another qsched daemon (instance {other.instance or 'unknown'}, version "
            f"{other.version or 'unknown'}{job}) is online on fleet {topics.fleet!r} at "
            f"{cfg.host}:{cfg.port}; stop it first or give this one another fleet"
        )


async def _retained_presence(client: aiomqtt.Client) -> DaemonPresence | None:
    try:
        async with asyncio.timeout(FLEET_PROBE_S):
            async for message in client.messages:
                try:
                    return DaemonPresence.model_validate_json(message.payload)
                except ValueError:
                    return None  # not ours to judge: an empty or foreign payload
    except TimeoutError:
        pass
    return None
