"""An event loop whose timers keep the virtual boards' modelled times.

A virtual board sleeps out its modelled NPU time (``LatencyProfile``). On Linux,
asyncio's default loop waits in ``epoll``, whose timeout is a whole number of
milliseconds, rounded up twice (by ``selectors`` and by ``epoll.poll``, where the float
26 ms becomes 27): a process with nothing else to do woke from a 25.40 ms sleep about
1.8 ms late, so a board that modelled 25.40 ms took 27.2. A real board's NPU finishes
when its work does. ``select`` waits to the microsecond, so the processes that host
virtual boards run on a loop built on it.

The kernel's wake-up from an idle wait is late too, by more than a board's message
handling takes: 25.4 ms sleeps on a ``select`` loop woke 0.16-0.27 ms late (median;
0.34-0.41 ms at the 90th percentile) on the 2-core development machine, a virtual
machine whose idle cores wake slowly. So the loop's selector waits for a timer only
until ``PUNCTUAL_S`` before it is due and polls the descriptors without waiting from
there (``_PunctualSelector``): the same sleeps then woke 0.01 ms late, for about 0.3 ms
of CPU a wait. Only a wait that ends at a timer pays it; a message that arrives ends
the wait as before.

``select`` takes descriptors below ``FD_SETSIZE`` (1024) only: a process that may open
more (a thousand MQTT boards in one process) keeps the default loop.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

__all__ = ["PUNCTUAL_S", "SELECT_DESCRIPTORS", "precise_loop_factory", "run_precise"]

# Descriptors a process may hold and still wait in select() (FD_SETSIZE, with room for
# the interpreter's own files, the event loop's self-pipe and log files).
SELECT_DESCRIPTORS: Final = 1024 - 64

# How long before a timer is due the loop stops sleeping and polls instead: above the
# kernel's usual lateness in waking an idle process (see the module docstring).
PUNCTUAL_S: Final = 0.0005

_T = TypeVar("_T")


class _PunctualSelector(selectors.SelectSelector):
    """``select()`` that ends a timed wait on time: it sleeps until ``PUNCTUAL_S``
    before the timeout, then polls until the timeout or a ready descriptor."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout <= 0:
            return super().select(timeout)
        deadline = time.monotonic() + timeout
        while True:  # a wait that ends early for any reason sleeps again, not polls
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            ready = super().select(left - PUNCTUAL_S if left > PUNCTUAL_S else 0)
            if ready:
                return ready


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
    return lambda: asyncio.SelectorEventLoop(_PunctualSelector())


def run_precise(main: Coroutine[Any, Any, _T], *, descriptors: int) -> _T:
    """``asyncio.run(main)`` on a loop from ``precise_loop_factory(descriptors)``."""
    with asyncio.Runner(loop_factory=precise_loop_factory(descriptors)) as runner:
        return runner.run(main)
