"""Shared fixtures for the qsched test suite."""

import contextlib
import os
import tty
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from qsched.daemon.broker import MosquittoBroker


@pytest.fixture
def mqtt_broker() -> Iterator[MosquittoBroker]:
    """A private Mosquitto on a free loopback port (never the system broker on 1883)."""
    with MosquittoBroker() as broker:
        yield broker


@dataclass
class PtyPair:
    """A pseudo-terminal: ``path`` plays the board's USB port; ``master`` is the far end.

    The slave side is in raw mode (no echo, no line editing) before anyone writes, and
    one slave descriptor stays open for the whole test so the master does not read a
    hang-up (EIO) while the port's user reopens it. Closing ``master`` is the unplug.
    """

    master: int
    slave: int
    path: str
    owns_master: bool = True

    def take_master(self) -> int:
        """Hand the master descriptor to its new owner (e.g. ``FdStream``), who closes it."""
        self.owns_master = False
        return self.master


@pytest.fixture
def pty_pair() -> Iterator[PtyPair]:
    """A raw pseudo-terminal pair, closed after the test (the master unless taken)."""
    master, slave = os.openpty()
    tty.setraw(slave)
    pair = PtyPair(master, slave, os.ttyname(slave))
    yield pair
    # A taken master may be closed and its number reused already: never close it here.
    for fd in (pair.slave, pair.master) if pair.owns_master else (pair.slave,):
        with contextlib.suppress(OSError):
            os.close(fd)
