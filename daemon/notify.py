"""systemd notifications (sd_notify) without libsystemd: READY, STATUS, WATCHDOG, STOPPING.

systemd passes ``$NOTIFY_SOCKET`` (a path, or ``@name`` in the abstract namespace) to a
``Type=notify`` service; each notification is one datagram of ``KEY=value`` lines.
Without the variable every call is a no-op, so the daemon runs the same by hand.

The watchdog ping runs as a task on the daemon's event loop: if the loop stalls, the
pings stop and systemd restarts the service — which is the point of sending them from
the loop rather than a thread.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping

import structlog

__all__ = ["Notifier", "watchdog_interval"]

_log = structlog.get_logger("qsched.notify")


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """The watchdog period in seconds from ``$WATCHDOG_USEC``, or None when off.

    ``$WATCHDOG_PID``, when set, must name this process (systemd's rule for children).

    Args:
        environ: the environment (``os.environ`` by default).

    Returns:
        Seconds between required pings, or None.
    """
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None


class Notifier:
    """Sends sd_notify datagrams.

    Args:
        socket_path: the notify socket; ``$NOTIFY_SOCKET`` when None (no-op if unset).
    """

    def __init__(self, socket_path: str | None = None) -> None:
        path = socket_path if socket_path is not None else os.environ.get("NOTIFY_SOCKET", "")
        self._address = "\0" + path[1:] if path.startswith("@") else path

    @property
    def enabled(self) -> bool:
        """Whether a notify socket is configured."""
        return bool(self._address)

    def notify(self, **fields: str | int) -> bool:
        """Send one notification, e.g. ``notify(READY=1, STATUS="up")``.

        Args:
            fields: the ``KEY=value`` pairs.

        Returns:
            True if a datagram was sent (False when disabled or on a send error,
            which is logged: a lost notification must not stop the daemon).
        """
        if not self.enabled:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            # A socket per message, as libsystemd does: nothing to keep open or leak.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self._address)
        except OSError as exc:
            _log.warning("sd_notify failed", error=str(exc))
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd start-up is complete (``READY=1``), with an optional status."""
        return self.notify(READY=1, **({"STATUS": status} if status else {}))

    def status(self, text: str) -> bool:
        """Set the one-line status ``systemctl status`` shows."""
        return self.notify(STATUS=text.replace("\n", " "))

    def watchdog(self) -> bool:
        """Ping the watchdog (``WATCHDOG=1``)."""
        return self.notify(WATCHDOG=1)

    def stopping(self, status: str | None = None) -> bool:
        """Tell systemd the service is shutting down (``STOPPING=1``)."""
        return self.notify(STOPPING=1, **({"STATUS": status} if status else {}))

    async def watchdog_loop(
        self, interval: float | None = None, healthy: Callable[[], bool] | None = None
    ) -> None:
        """Ping the watchdog at half its period until cancelled.

        Args:
            interval: the watchdog period; ``watchdog_interval()`` when None. Returns
                at once when there is none (run it unconditionally).
            healthy: optional check; no ping while it returns False, so systemd
                restarts a daemon that is alive but stuck.
        """
        period = interval if interval is not None else watchdog_interval()
        if period is None or not self.enabled:
            return
        while True:
            if healthy is None or healthy():
                self.watchdog()
            else:
                _log.warning("unhealthy: watchdog ping withheld")
            await asyncio.sleep(period / 2)
