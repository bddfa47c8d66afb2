"""The Cortex-M55 board under QEMU (``mps3-an547``): build, launch, and the self-test.

``start_qemu_board`` gives the daemon (and tests) a board that runs the C agent on an
emulated Cortex-M55 and talks over a pseudo-terminal, exactly as a USB-attached board
would. The data set blob the board holds is placed in its DDR by QEMU's loader device.

    board = start_qemu_board(tmp / "m55-0", dataset=tmp / "digits.qzds")
    ... open board.pty_path (or the link) with the serial transport ...
    board.close()
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from qsched.firmware.native import FirmwareBuildError, build, m55_unavailable_reason

__all__ = [
    "DATASET_ADDRESS",
    "QEMU_MACHINE",
    "QemuBoard",
    "run_selftest",
    "start_qemu_board",
]

QEMU_MACHINE: Final = "mps3-an547"
# Where the board looks for its data set blob (m55/an547.ld, __dataset_base).
DATASET_ADDRESS: Final = 0x60800000
DATASET_MAX_BYTES: Final = 8 << 20
START_TIMEOUT_S: Final = 15.0
_PTY_MARKER: Final = "char device redirected to "


@dataclass
class QemuBoard:
    """A running emulated board.

    Attributes:
        pty_path: the host side of its UART0 (``/dev/pts/N``).
        link_path: the symlink to ``pty_path`` the caller asked for.
        process: the QEMU process.
    """

    pty_path: str
    link_path: Path
    process: subprocess.Popen[bytes]

    def close(self, timeout: float = 10.0) -> None:
        """Stop QEMU and remove the link."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
        if self.link_path.is_symlink():
            self.link_path.unlink()


def _qemu_command(image: Path, extra: list[str]) -> list[str]:
    return [
        "qemu-system-arm",
        "-M",
        QEMU_MACHINE,
        "-display",
        "none",
        "-monitor",
        "none",
        "-kernel",
        str(image),
        *extra,
    ]


def _read_pty_path(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """QEMU names the pty it allocated on stdout: 'char device redirected to /dev/pts/N'."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
            text = seen.decode(errors="replace")
            if _PTY_MARKER in text:
                return text.split(_PTY_MARKER, 1)[1].split()[0]
        elif proc.poll() is not None:
            break
    raise FirmwareBuildError(
        f"QEMU did not report its pty: {seen.decode(errors='replace')[-2000:]}"
    )


def start_qemu_board(
    pty_link_path: str | os.PathLike[str], *, dataset: str | os.PathLike[str] | None = None
) -> QemuBoard:
    """Build the Cortex-M55 board image if needed and launch it under QEMU.

    Args:
        pty_link_path: where to put a symlink to the board's pseudo-terminal (what a
            udev rule gives a real board, e.g. ``/dev/qsched/board-0``).
        dataset: a data set blob (``qsched.zo.blob.encode_dataset_blob``) for the board
            to hold; without one the board refuses ``SelectDataset``.

    Returns:
        The running board; call ``close()`` when done. Open ``pty_path`` while the
        process runs: QEMU drops UART output while no one has the pty open, and the
        board repeats its Hello when the first message arrives.

    Raises:
        FirmwareBuildError: the toolchain or QEMU is missing, or QEMU failed to start.
    """
    reason = m55_unavailable_reason()
    if reason is not None:
        raise FirmwareBuildError(f"cannot run the Cortex-M55 board: {reason}")
    image = build("m55") / "qs_board.elf"
    extra = ["-chardev", "pty,id=uart0", "-serial", "chardev:uart0"]
    if dataset is not None:
        size = Path(dataset).stat().st_size
        if size > DATASET_MAX_BYTES:
            raise FirmwareBuildError(
                f"data set blob of {size} bytes > {DATASET_MAX_BYTES} the board has room for"
            )
        extra += [
            "-device",
            f"loader,file={os.fspath(dataset)},addr=0x{DATASET_ADDRESS:08x},force-raw=on",
        ]
    # QEMU says little after start-up (its pty line, fatal errors): one pipe for both.
    proc = subprocess.Popen(
        _qemu_command(image, extra),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    link = Path(pty_link_path)
    try:
        pty_path = _read_pty_path(proc, START_TIMEOUT_S)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(pty_path)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return QemuBoard(pty_path, link, proc)


def run_selftest(timeout: float = 60.0) -> str:
    """Run the self-test image on the emulated M55 and return its result line.

    Returns:
        The line starting ``QS-SELFTEST`` (PASS or FAIL and the per-kind counts).

    Raises:
        FirmwareBuildError: no toolchain/QEMU, or no result line within ``timeout``.
    """
    reason = m55_unavailable_reason()
    if reason is not None:
        raise FirmwareBuildError(f"cannot run the Cortex-M55 self-test: {reason}")
    image = build("m55") / "qs_selftest.elf"
    cmd = _qemu_command(
        image, ["-serial", "stdio", "-semihosting-config", "enable=on,target=native"]
    )
    try:
        proc = subprocess.run(
            cmd, capture_output=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        raise FirmwareBuildError(f"the M55 self-test did not finish in {timeout} s") from exc
    for line in proc.stdout.decode(errors="replace").splitlines():
        if line.startswith("QS-SELFTEST"):
            return line.strip()
    raise FirmwareBuildError(
        f"no QS-SELFTEST line (exit {proc.returncode}): {proc.stderr.decode()[-1000:]}"
    )
