"""Building and driving the C firmware from Python (tests, the daemon's fleet tests, CLI).

``make -C firmware`` builds three flavours into ``firmware/build/``: ``host`` (the board
executable and the test tool), ``asan`` (the same with AddressSanitizer and UBSan) and
``m55`` (Cortex-M55 images for QEMU's ``mps3-an547``). This module runs that build once
per process (under a file lock, so parallel test processes do not race) and says
plainly why a part cannot be built.
"""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from qsched.firmware.errors import FirmwareBuildError

__all__ = [
    "BUILD_DIR",
    "FIRMWARE_DIR",
    "BoardClient",
    "FirmwareBuildError",
    "ToolProcess",
    "board_executable",
    "build",
    "m55_unavailable_reason",
    "start_host_board",
    "tool_executable",
]

FIRMWARE_DIR: Final = Path(__file__).resolve().parent
BUILD_DIR: Final = FIRMWARE_DIR / "build"
ARM_CC: Final = "arm-none-eabi-gcc"
QEMU: Final = "qemu-system-arm"
BUILD_TIMEOUT_S: Final = 300.0

Flavour = Literal["host", "asan", "m55"]
_built: set[str] = set()


def m55_unavailable_reason() -> str | None:
    """Why the Cortex-M55 part cannot be built or run here, or None if it can.

    Returns:
        A sentence naming the missing tool, or None.
    """
    for tool, package in ((ARM_CC, "gcc-arm-none-eabi"), (QEMU, "qemu-system-arm")):
        if shutil.which(tool) is None:
            return f"{tool} not found (install the Debian package {package})"
    return None


def build(flavour: Flavour) -> Path:
    """Build one flavour of the firmware (once per process) and return its folder.

    Args:
        flavour: ``host``, ``asan`` or ``m55``.

    Returns:
        The build folder of that flavour, e.g. ``firmware/build/host``.

    Raises:
        FirmwareBuildError: make is missing or the build failed.
    """
    out = BUILD_DIR / flavour
    if flavour in _built:
        return out
    if shutil.which("make") is None:
        raise FirmwareBuildError("make not found: install make and gcc to build the firmware")
    if flavour == "m55" and (reason := m55_unavailable_reason()) is not None:
        raise FirmwareBuildError(f"cannot build the Cortex-M55 images: {reason}")
    BUILD_DIR.mkdir(exist_ok=True)
    with open(BUILD_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(
            ["make", "-s", "-C", str(FIRMWARE_DIR), flavour],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise FirmwareBuildError(f"make {flavour} failed (exit {proc.returncode}):\n{tail}")
    _built.add(flavour)
    return out


def board_executable(sanitized: bool = False) -> Path:
    """The host board executable (``qs_board``), built if needed.

    Args:
        sanitized: the AddressSanitizer/UBSan build instead of the optimised one.

    Returns:
        Path of the executable; run it as ``qs_board <serial device>``.
    """
    return build("asan" if sanitized else "host") / "qs_board"


def tool_executable(sanitized: bool = True) -> Path:
    """The host test tool (``qs_tool``), built if needed."""
    return build("asan" if sanitized else "host") / "qs_tool"


@dataclass
class HostBoard:
    """A running host build of the C board serving a pseudo-terminal it allocated.

    Attributes:
        pty_path: the slave side (``/dev/pts/N``): what the daemon opens.
        link_path: the symlink to it the caller asked for.
        process: the ``qs_board`` process.
    """

    pty_path: str
    link_path: Path
    process: subprocess.Popen[bytes]

    def close(self, timeout: float = 10.0) -> str:
        """Stop the board and remove the link; returns what it wrote to stderr."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            _, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate(timeout=timeout)
        if self.link_path.is_symlink():
            self.link_path.unlink()
        return err.decode(errors="replace")


def start_host_board(
    pty_link_path: str | os.PathLike[str],
    *,
    dataset: str | os.PathLike[str] | None = None,
    board_id: str = "c-host",
    sanitized: bool = False,
    timeout: float = 10.0,
) -> HostBoard:
    """Launch ``qs_board --pty``: a C board on a fresh pseudo-terminal, linked at a path.

    Args:
        pty_link_path: where to link the pty's slave side (the daemon's serial device).
        dataset: the data set blob the board holds (``encode_dataset_blob``).
        board_id: the id its Hello reports.
        sanitized: run the AddressSanitizer/UBSan build.
        timeout: seconds to wait for the board to report its pty.

    Returns:
        The running board; ``close()`` stops it.

    Raises:
        FirmwareBuildError: the build failed or the board did not start.
    """
    cmd = [
        str(board_executable(sanitized)),
        "--pty",
        os.fspath(pty_link_path),
        "--board-id",
        board_id,
    ]
    if dataset is not None:
        cmd += ["--dataset", os.fspath(dataset)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().decode(errors="replace") if ready else ""
    if not line.startswith("qs_board: serving "):
        proc.kill()
        _, err = proc.communicate()
        raise FirmwareBuildError(
            f"qs_board did not start: {line!r} {err.decode(errors='replace')[-2000:]}"
        )
    return HostBoard(line.split()[2], Path(pty_link_path), proc)


class ToolProcess:
    """A running ``qs_tool``: one command line in, one answer line out.

    Use as a context manager; the process ends when the block exits.
    """

    def __init__(self, sanitized: bool = True) -> None:
        self._proc = subprocess.Popen(
            [str(tool_executable(sanitized))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, line: str) -> str:
        """Send one command and return its answer line (without the newline).

        Args:
            line: the command, e.g. ``"crc32 616263"``.

        Returns:
            The tool's answer.

        Raises:
            FirmwareBuildError: the tool died (a sanitizer report goes to stderr).
        """
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        if not answer:
            raise FirmwareBuildError(f"qs_tool exited (code {self._proc.wait()}) on: {line[:120]}")
        return answer.rstrip("\n")

    def close(self) -> None:
        """Close stdin and wait for the tool to exit."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> ToolProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BoardClient:
    """The daemon side of one serial link, synchronous: for tests and bring-up.

    Speaks the framing of ``qsched.protocol.framing`` over a file descriptor (a pty
    master): data frames are acknowledged, the board's retransmissions dropped, its
    segments joined (SPEC 7.4), and ``send`` waits for the board's ACK. Heartbeats are
    kept apart from other messages.

    Args:
        fd: the file descriptor of the link (owned by the caller).
    """

    def __init__(self, fd: int) -> None:
        from qsched.protocol.framing import FrameEncoder, FrameReader, Reassembler, ReceiveFilter

        self._fd = fd
        self._encoder = FrameEncoder()
        self._reader = FrameReader()
        self._filter = ReceiveFilter()
        self._joiner = Reassembler()
        self._acks: set[int] = set()
        self._inbox: list[bytes] = []

    def _pump(self, timeout: float) -> None:
        from qsched.protocol.framing import Frame

        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return
        data = os.read(self._fd, 65536)
        if not data:
            raise FirmwareBuildError("the board closed the link")
        for item in self._reader.feed(data):
            if not isinstance(item, Frame):
                continue
            if item.is_ack:
                self._acks.add(item.seq)
                continue
            os.write(self._fd, self._encoder.ack(item.seq))
            if self._filter.accept(item):
                message = self._joiner.push(item)
                if message is not None:
                    self._inbox.append(message)

    def send_payload(self, payload: bytes, timeout: float = 5.0) -> None:
        """Send raw message bytes in one data frame and wait for the board's ACK."""
        import time

        seq, wire = self._encoder.data(payload)
        deadline = time.monotonic() + timeout
        next_send = 0.0
        while seq not in self._acks:
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"no ACK for frame {seq}")
            if now >= next_send:
                os.write(self._fd, wire)
                next_send = now + 0.5
            self._pump(0.05)
        self._acks.discard(seq)

    def send(self, msg: object, timeout: float = 5.0) -> None:
        """Encode and send one data-plane message."""
        from qsched.protocol.codec import encode

        self.send_payload(encode(msg), timeout)  # type: ignore[arg-type]

    def recv(self, timeout: float = 30.0, *, heartbeats: bool = False) -> object:
        """The next message from the board (unsolicited Heartbeats skipped unless asked).

        Raises:
            TimeoutError: nothing arrived in time.
        """
        import time

        from qsched.protocol.codec import decode
        from qsched.protocol.messages import Heartbeat

        deadline = time.monotonic() + timeout
        while True:
            while self._inbox:
                msg = decode(self._inbox.pop(0))
                if heartbeats or not (isinstance(msg, Heartbeat) and msg.nonce == 0):
                    return msg
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no message from the board")
            self._pump(min(remaining, 0.1))

    def request(self, msg: object, timeout: float = 60.0) -> object:
        """Send a message and return the board's next answer."""
        self.send(msg)
        return self.recv(timeout)

    def load_job(self, blob: bytes, select: object, config: object) -> list[object]:
        """Make the board ready: the model blob in chunks, then SelectDataset and JobConfig.

        Args:
            blob: the model blob.
            select: the ``SelectDataset`` message.
            config: the ``JobConfig`` message.

        Returns:
            The board's three answers (``Loaded`` each, or an ``Error``).
        """
        import zlib

        from qsched.protocol.messages import MAX_CHUNK, LoadModel

        crc = zlib.crc32(blob)
        for offset in range(0, len(blob), MAX_CHUNK):
            self.send(
                LoadModel(
                    total=len(blob),
                    offset=offset,
                    crc32=crc,
                    chunk=blob[offset : offset + MAX_CHUNK],
                )
            )
        return [self.recv(), self.request(select), self.request(config)]
