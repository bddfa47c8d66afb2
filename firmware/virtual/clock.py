"""An event loop whose timers keep the virtual boards' modelled times.

A virtual board sleeps out its modelled NPU time (``LatencyProfile``). On Linux,
asyncio's default loop waits in ``epoll``, whose timeout is a whole number of
milliseconds, rounded up twice (by ``selectors`` and by ``epoll.poll``, where the float
26 ms becomes 27): a process with nothing else to do woke from a 25.40 ms sleep about
1.8 ms late, so a board that modelled 25.40 ms took 27.2. A real board's NPU finishes
when its work does. ``select`` waits to the microsecond (0.16 ms late, the kernel's
wake-up, in the same measurement), so the processes that host virtual boards run on a
loop built on it.

``select`` takes descriptors below ``FD_SETSIZE`` (1024) only: a process that may open
more (a thousand MQTT boards in one process) keeps the default loop.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

__all__ = ["SELECT_DESCRIPTORS", "precise_loop_factory", "run_precise"]

# Descriptors a process may hold and still wait in select() (FD_SETSIZE, with room for
# the interpreter's own files, the event loop's self-pipe and log files).
SELECT_DESCRIPTORS: Final = 1024 - 64

_T = TypeVar("_T")


def precise_loop_factory(descriptors: int) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory of event loops whose timers are precise to the microsecond, for a
    process expected to hold about ``descriptors`` open sockets and files; None where
    the default loop is as precise (no epoll or poll) or select() could not serve."""
    coarse = selectors.DefaultSelector in (
        getattr(selectors, "EpollSelector", None),
        getattr(selectors, "PollSelector", None),
    )
    if not coarse or descriptors > SELECT_DESCRIPTORS:
        return None
    return lambda: asyncio.SelectorEventLoop(selectors.SelectSelector())


def run_precise(main: Coroutine[Any, Any, _T], *, descriptors: int) -> _T:
    """``asyncio.run(main)`` on a loop from ``precise_loop_factory(descriptors)``."""
    with asyncio.Runner(loop_factory=precise_loop_factory(descriptors)) as runner:
        return runner.run(main)
