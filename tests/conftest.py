"""Shared fixtures for the qsched test suite."""

import contextlib
import os
import tty
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import pytest

from qsched.lab.broker import MosquittoBroker
from qsched.protocol.links.base import BoardAppeared, Link, LinkEvent
from qsched.protocol.links.inproc import InProcTransport


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


class WrappedInProcTransport:
    """An in-process transport whose daemon-side links are wrapped as they appear.

    ``wrap(link, board_id)`` returns the link the daemon sees; boards attach to
    ``inner`` as usual. Tests use it to trace or break the daemon's end of a link.
    """

    name = "inproc"

    def __init__(self, wrap: Callable[[Link, str], Link]) -> None:
        self.inner = InProcTransport()
        self._wrap = wrap

    async def __aenter__(self) -> Self:
        await self.inner.__aenter__()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.inner.__aexit__(t, e, tb)

    async def events(self) -> AsyncIterator[LinkEvent]:
        async for event in self.inner.events():
            if isinstance(event, BoardAppeared):
                event = BoardAppeared(
                    event.board_id, self._wrap(event.link, event.board_id), event.transport
                )
            yield event
