"""A serial line that garbles bytes: two pseudo-terminals joined by a relay thread.

The daemon opens one end (``daemon_port``), a board the other (``board_port``); both
are real ttys, so each side runs its ordinary serial code. The relay copies every byte
across and, with probability ``error_rate`` per byte and in both directions, replaces it
by another value (delimiters included): the noise a long or badly earthed UART picks up.
The frame CRC must catch every such byte; what it cannot fix, retransmission must.

    with NoisyLine(seed=1) as line:
        line.error_rate = 1e-3
        ... qsched daemon --serial line.daemon_port; qsched board --serial line.board_port

As a process, ``python -m qsched.lab.noisy_line --lines N [--error-rate R]`` holds N
lines, prints ``<daemon port> <board port>`` for each, then ``ready``, and relays until
its standard input closes or it gets SIGTERM (the fleet benchmark's serial bridges: the
relays' CPU is then not the benchmark's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import select
import signal
import sys
import threading
import tty
from collections.abc import Sequence
from types import TracebackType
from typing import Self

__all__ = ["NoisyLine", "main"]

_READ_BYTES = 4096


class _Pty:
    """One pseudo-terminal in raw mode; its slave stays open so the master never reads a
    hang-up while the port's user reopens it."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        tty.setraw(self.slave)
        os.set_blocking(self.master, False)
        self.path = os.ttyname(self.slave)

    def close(self) -> None:
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)


class NoisyLine:
    """A relay between two ptys that corrupts bytes at ``error_rate``.

    Args:
        seed: seeds the noise (which bytes, what values).
    """

    def __init__(self, seed: int = 0) -> None:
        self.error_rate = 0.0
        self.bytes_relayed = 0
        self.bytes_garbled = 0
        self._rng = random.Random(seed)
        self._daemon_side = _Pty()
        self._board_side = _Pty()
        self._stop_read, self._stop_write = os.pipe()
        self._thread = threading.Thread(target=self._relay, name="noisy-line", daemon=True)

    @property
    def daemon_port(self) -> str:
        """The tty the daemon opens (``qsched daemon --serial``)."""
        return self._daemon_side.path

    @property
    def board_port(self) -> str:
        """The tty the board opens (``qsched board --serial``)."""
        return self._board_side.path

    def _garble(self, data: bytes) -> bytes:
        rate = self.error_rate
        self.bytes_relayed += len(data)
        if rate <= 0.0:
            return data
        out = bytearray(data)
        for i in range(len(out)):
            if self._rng.random() < rate:
                out[i] ^= self._rng.randrange(1, 256)  # never the same value
                self.bytes_garbled += 1
        return bytes(out)

    def _relay(self) -> None:
        ends = {self._daemon_side.master: self._board_side.master}
        ends[self._board_side.master] = self._daemon_side.master
        while True:
            ready, _, _ = select.select([*ends, self._stop_read], [], [])
            if self._stop_read in ready:
                return
            for fd in ready:
                try:
                    data = os.read(fd, _READ_BYTES)
                except OSError:
                    continue  # nobody holds that end open right now
                self._write_all(ends[fd], self._garble(data))

    @staticmethod
    def _write_all(fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                # Nobody reads that end (no board yet): after a second, the bytes are lost.
                _, writable, _ = select.select([], [fd], [], 1.0)
                if not writable:
                    return
            except OSError:
                return  # the other end is closed: a line without a listener drops bytes

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        os.write(self._stop_write, b"x")
        self._thread.join(5)
        for fd in (self._stop_read, self._stop_write):
            os.close(fd)
        self._daemon_side.close()
        self._board_side.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Hold ``--lines`` relays until standard input closes or SIGTERM arrives."""
    p = argparse.ArgumentParser(prog="python -m qsched.lab.noisy_line")
    p.add_argument("--lines", type=int, default=1, help="how many lines (default 1)")
    p.add_argument("--error-rate", type=float, default=0.0, help="garbled bytes per byte")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.lines < 1 or not 0.0 <= args.error_rate <= 1.0:
        print("--lines must be at least 1, --error-rate in [0, 1]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.stdin.close())
    with contextlib.ExitStack() as stack:
        for i in range(args.lines):
            line = stack.enter_context(NoisyLine(seed=args.seed + i))
            line.error_rate = args.error_rate
            print(line.daemon_port, line.board_port, flush=True)
        print("ready", flush=True)
        with contextlib.suppress(OSError, ValueError):
            while sys.stdin.read(1):
                pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
