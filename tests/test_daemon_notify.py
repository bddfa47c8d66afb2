"""sd_notify against a real unix datagram socket, as systemd provides it."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from qsched.daemon.notify import Notifier, watchdog_interval


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(2.0)
    yield sock, path
    sock.close()


def test_notify_ready_status_stopping(notify_socket: tuple[socket.socket, str]) -> None:
    """READY, STATUS and STOPPING arrive as KEY=value datagrams."""
    sock, path = notify_socket
    notifier = Notifier(path)
    assert notifier.ready("training job-1")
    assert sock.recv(4096) == b"READY=1\nSTATUS=training job-1"
    assert notifier.status("step 3\nof 10")
    assert sock.recv(4096) == b"STATUS=step 3 of 10"
    assert notifier.stopping()
    assert sock.recv(4096) == b"STOPPING=1"


def test_notify_abstract_namespace() -> None:
    """An '@' address is the Linux abstract namespace."""
    name = f"qsched-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        assert Notifier("@" + name).watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_notify_noop_without_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without $NOTIFY_SOCKET nothing is sent and nothing fails."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    assert not notifier.ready()


def test_notify_missing_socket_is_not_fatal(tmp_path: Path) -> None:
    """A socket that went away makes notify return False instead of raising."""
    assert not Notifier(str(tmp_path / "gone")).status("x")


def test_watchdog_interval_from_environment() -> None:
    """WATCHDOG_USEC gives the period; a WATCHDOG_PID of another process disables it."""
    assert watchdog_interval({"WATCHDOG_USEC": "3000000"}) == 3.0
    assert watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}) == 3.0
    assert watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "junk"}) is None
    assert watchdog_interval({}) is None


async def test_watchdog_loop_pings_from_event_loop(
    notify_socket: tuple[socket.socket, str],
) -> None:
    """The watchdog task pings at half the period, and withholds pings while unhealthy."""
    sock, path = notify_socket
    sock.setblocking(False)
    healthy = True
    notifier = Notifier(path)
    task = asyncio.create_task(notifier.watchdog_loop(interval=0.1, healthy=lambda: healthy))
    await asyncio.sleep(0.28)
    pings = _drain(sock)
    assert pings.count(b"WATCHDOG=1") >= 4
    healthy = False
    await asyncio.sleep(0.06)
    _drain(sock)
    await asyncio.sleep(0.2)
    assert _drain(sock) == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_watchdog_loop_returns_when_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without WATCHDOG_USEC the loop ends at once (safe to start unconditionally)."""
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    await asyncio.wait_for(Notifier(str(tmp_path / "s")).watchdog_loop(), 1.0)


def _drain(sock: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096))
        except BlockingIOError:
            return out
