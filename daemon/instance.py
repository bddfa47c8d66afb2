"""One daemon per state directory: an exclusive lock held for the daemon's lifetime.

Two daemons on one state directory would resume the same job twice and fight over the
MQTT client id. The first takes ``<state>/daemon.lock`` with ``flock``; the kernel
drops the lock when the process ends, however it ends, so a SIGKILLed daemon leaves no
stale lock. The file records who holds it, for the refusal message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Final

from qsched.daemon.errors import InstanceError

__all__ = ["EXIT_ANOTHER_INSTANCE", "LOCK_NAME", "InstanceLock"]

LOCK_NAME: Final = "daemon.lock"
# The exit status of a daemon that found another on its state directory (systemd's unit
# does not restart on it: RestartPreventExitStatus).
EXIT_ANOTHER_INSTANCE: Final = 3


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
