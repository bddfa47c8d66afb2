"""A private Mosquitto broker for tests and demos.

``MosquittoBroker`` writes a throw-away ``mosquitto.conf`` (one listener on a free
loopback port, anonymous access, no persistence), starts ``mosquitto -c`` as a child
process and waits until the port accepts connections. Fault tests kill it and start it
again on the same port (``restart``), which is what a broker crash looks like to the
clients. It never touches a system broker.

    with MosquittoBroker() as broker:          # pytest fixtures
        ...broker.host, broker.port...
    async with MosquittoBroker() as broker:    # asyncio code (demo)
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from qsched.lab.errors import BrokerError

__all__ = ["BrokerError", "MosquittoBroker", "free_port"]

_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that nothing listens on right now.

    Args:
        host: the interface to probe.

    Returns:
        A port number the kernel handed out for an ephemeral bind.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _port_accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class MosquittoBroker:
    """A Mosquitto child process on a private loopback port.

    Args:
        port: the port to listen on; a free one when ``None``.
        host: the listener address (loopback by default).
        executable: the broker binary, looked up on ``PATH``.
        users: optional ``{username: password}``; when given, anonymous access is off
            and a password file is generated with ``mosquitto_passwd``.
        tls: optional ``(certfile, keyfile)``: the listener speaks TLS only.
        acl_file: optional Mosquitto ACL file (with ``users``: who may publish what).
        conf: more lines for its ``mosquitto.conf`` (a bridge to another broker, the
            ``$SYS`` interval).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        executable: str = "mosquitto",
        users: dict[str, str] | None = None,
        tls: tuple[str | Path, str | Path] | None = None,
        acl_file: str | Path | None = None,
        conf: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        self._executable = executable
        self._users = dict(users or {})
        self._tls = tls
        self._acl_file = acl_file
        self._conf = tuple(conf)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """Whether the broker process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path | None:
        """The broker's log file (stderr), for diagnostics when a test fails."""
        return Path(self._tmp.name) / "mosquitto.log" if self._tmp else None

    def start(self) -> None:
        """Start the broker and block until its port accepts connections.

        Raises:
            BrokerError: the binary is missing, it exited, or the port never opened.
        """
        if self.running:
            return
        binary = shutil.which(self._executable)
        if binary is None:
            raise BrokerError(f"{self._executable!r} not found on PATH; install mosquitto")
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="qsched-mosquitto-")
        conf = self._write_conf(Path(self._tmp.name))
        log = open(Path(self._tmp.name) / "mosquitto.log", "ab")  # noqa: SIM115 - child owns it
        try:
            self._proc = subprocess.Popen(
                [binary, "-c", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        self._wait_accepting()

    def _write_conf(self, folder: Path) -> Path:
        lines = [f"listener {self.port} {self.host}"]
        if self._tls is not None:
            lines += [f"certfile {self._tls[0]}", f"keyfile {self._tls[1]}"]
        lines += [
            "persistence false",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "max_queued_messages 10000",
            "set_tcp_nodelay true",
        ]
        with contextlib.suppress(KeyError, OSError):
            # Started as root, mosquitto would switch to user "mosquitto" and lose
            # access to our private files; as anyone else this line has no effect.
            lines.append(f"user {getpass.getuser()}")
        if self._users:
            passwd = folder / "passwd"
            passwd.write_text("")
            for user, password in self._users.items():
                subprocess.run(["mosquitto_passwd", "-b", str(passwd), user, password], check=True)
            lines += ["allow_anonymous false", f"password_file {passwd}"]
            if self._acl_file is not None:
                lines.append(f"acl_file {self._acl_file}")
        else:
            lines.append("allow_anonymous true")
        lines += self._conf
        conf = folder / "mosquitto.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def _wait_accepting(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise BrokerError(
                    f"mosquitto exited with {self._proc.returncode}: {self._log_tail()}"
                )
            if _port_accepts(self.host, self.port):
                return
            time.sleep(0.02)
        self.stop()
        raise BrokerError(
            f"mosquitto did not accept on {self.host}:{self.port} within {_START_TIMEOUT_S} s"
        )

    def _log_tail(self) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return ""
        return path.read_text(errors="replace")[-2000:]

    def kill(self) -> None:
        """Kill the broker abruptly (SIGKILL): clients see their connection drop."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(_STOP_TIMEOUT_S)
        self._proc = None

    def stop(self) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after a timeout)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(_STOP_TIMEOUT_S)
        self._proc = None

    def restart(self, *, down_s: float = 0.0) -> None:
        """Kill the broker and start it again on the same port.

        Args:
            down_s: how long the broker stays down between kill and start.
        """
        self.kill()
        if down_s > 0:
            time.sleep(down_s)
        self.start()

    def close(self) -> None:
        """Stop the broker and remove its temporary folder."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> MosquittoBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> MosquittoBroker:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.close)

    async def arestart(self, *, down_s: float = 0.0) -> None:
        """``restart`` without blocking the event loop."""
        await asyncio.to_thread(self.restart, down_s=down_s)
