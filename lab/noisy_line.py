"""A serial line that garbles bytes: two pseudo-terminals joined by a relay thread.

The daemon opens one end (``daemon_port``), a board the other (``board_port``); both
are real ttys, so each side runs its ordinary serial code. The relay copies every byte
across and, with probability ``error_rate`` per byte and in both directions, replaces it
by another value (delimiters included): the noise a long or badly earthed UART picks up.
The frame CRC must catch every such byte; what it cannot fix, retransmission must.

    with NoisyLine(seed=1) as line:
        line.error_rate = 1e-3
        ... qsched daemon --serial line.daemon_port; qsched board --serial line.board_port
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import threading
import tty
from types import TracebackType
from typing import Self

__all__ = ["NoisyLine"]

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
