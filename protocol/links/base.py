"""The link interface: how the daemon talks to one board, whatever the wire.

Three transports (in-process queues, MQTT, USB serial) implement the same two shapes, so
the fleet code cannot tell them apart:

- ``Link``: one bidirectional message channel. The daemon holds one per board (a
  *board link*); a board holds one to the daemon (a *board endpoint*: the virtual board
  and the bridge use the same classes). Messages are opaque bytes — the binary codec's
  data-plane messages; the link only guarantees that a message sent arrives whole, at
  most once and in order, or that the link reports itself gone.
- ``Transport``: an ``async with`` object that discovers boards and reports them as a
  stream of ``BoardAppeared`` / ``BoardGone`` events.

A link end stamps every message it receives with the ``time.perf_counter`` moment it
arrived (``stamped``) and, while ``incoming`` yields it, exposes that moment as
``last_arrival`` (``stamped_messages``): a virtual board starts its modelled time there
rather than when its process gets round to the message (``BoardAgent.handle_bytes``).

``Link.board_id`` is the address under which the transport knows the board: the board
id from the MQTT topic or the in-process registration, or ``serial:<device>`` for a
serial port (a serial board names itself only in its Hello, which the fleet reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

__all__ = [
    "EVENT_QUEUE_SIZE",
    "INCOMING_QUEUE_SIZE",
    "BoardAppeared",
    "BoardGone",
    "Link",
    "LinkClosedError",
    "LinkError",
    "LinkEvent",
    "MessageTooLargeError",
    "MultiTransport",
    "SendTimeoutError",
    "Transport",
    "cancel_until_done",
    "close_queue",
    "iterate_queue",
    "stamped",
    "stamped_messages",
]

# How long cancel_until_done keeps cancelling, and how often.
CANCEL_TIMEOUT_S = 10.0
RECANCEL_S = 0.5


async def cancel_until_done(
    tasks: Iterable[asyncio.Task[Any]], timeout: float = CANCEL_TIMEOUT_S
) -> set[asyncio.Task[Any]]:
    """Cancel the tasks again and again until they end (bounded); returns those that did
    not. On Python 3.11 a cancellation that races with a result inside ``asyncio.wait_for``
    (aiomqtt's connect and publish use it) is swallowed, so one ``cancel()`` and an
    unbounded wait can hang a shutdown."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = {t for t in tasks if not t.done()}
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: the caller is shutting down, not reporting
    return pending


# Bounded queues everywhere: a board that floods the daemon fills its own queue and
# its link applies back-pressure (serial: no acks; MQTT: the client's queue) instead of
# growing the daemon's memory.
INCOMING_QUEUE_SIZE = 256
EVENT_QUEUE_SIZE = 1024


class LinkError(Exception):
    """A link failed. ``board_id`` names the board, ``reason`` is a short machine word."""

    def __init__(self, board_id: str, reason: str, detail: str = "") -> None:
        super().__init__(f"link to {board_id!r}: {reason}" + (f" ({detail})" if detail else ""))
        self.board_id = board_id
        self.reason = reason
        self.detail = detail


class LinkClosedError(LinkError):
    """The link is gone (closed locally, peer unplugged or offline, retries exhausted)."""


class SendTimeoutError(LinkError):
    """A message was not acknowledged after all retries; the link may still be up."""


class MessageTooLargeError(LinkError):
    """A message exceeds what the link can carry in one piece."""


@runtime_checkable
class Link(Protocol):
    """One connection between the daemon and one board, seen from either end."""

    board_id: str

    @property
    def closed(self) -> bool:
        """Whether the link is gone; ``send`` then raises ``LinkClosedError``."""
        ...

    async def send(self, payload: bytes) -> None:
        """Send one message.

        Args:
            payload: the message bytes (binary codec).

        Raises:
            LinkClosedError: the link is gone, or the message was not acknowledged.
            MessageTooLargeError: the payload exceeds the link's limit.
        """
        ...

    def incoming(self) -> AsyncIterator[bytes]:
        """Messages from the peer, in order; the iterator ends when the link is gone."""
        ...

    async def close(self) -> None:
        """Close the link (idempotent)."""
        ...


@dataclass(frozen=True)
class BoardAppeared:
    """A board became reachable (serial port opened, MQTT birth, in-process attach)."""

    board_id: str
    link: Link
    transport: str  # "inproc", "mqtt" or "serial"


@dataclass(frozen=True)
class BoardGone:
    """A board became unreachable; ``reason`` says how (``unplugged``, ``will``, ...)."""

    board_id: str
    reason: str
    transport: str


LinkEvent = BoardAppeared | BoardGone


class Transport(Protocol):
    """Discovers boards and yields their links as events."""

    name: str

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def events(self) -> AsyncIterator[LinkEvent]:
        """Board membership events, for one consumer, until the transport closes."""
        ...


_END = object()


async def iterate_queue(
    queue: asyncio.Queue[Any], is_end: Callable[[Any], bool] | None = None
) -> AsyncIterator[Any]:
    """Yield items from ``queue`` until the end marker arrives.

    Args:
        queue: the queue; producers end it with ``close_queue``.
        is_end: an extra predicate that ends the iteration.

    Returns:
        An async iterator over the items.
    """
    while True:
        item = await queue.get()
        if item is _END or (is_end is not None and is_end(item)):
            return
        yield item


def stamped(payload: bytes) -> tuple[bytes, float]:
    """``payload`` with the ``perf_counter`` moment it reached this end, for its queue."""
    return payload, time.perf_counter()


async def stamped_messages(queue: asyncio.Queue[Any], end: Any) -> AsyncIterator[bytes]:
    """Yield the payloads of ``queue``'s ``stamped`` items until its end marker; while
    one is yielded, ``end.last_arrival`` is the moment it arrived."""
    async for payload, arrived in iterate_queue(queue):
        end.last_arrival = arrived
        yield payload


def close_queue(queue: asyncio.Queue[Any]) -> None:
    """Put the end marker on ``queue``, dropping the oldest item if it is full.

    The end marker must get through even when the consumer is slow: dropping a
    message of a link that is already gone loses nothing the sender could rely on.
    """
    while True:
        try:
            queue.put_nowait(_END)
            return
        except asyncio.QueueFull:
            with contextlib.suppress(asyncio.QueueEmpty):
                queue.get_nowait()


@dataclass
class MultiTransport:
    """Several transports as one: their events merged into one stream.

    Args:
        transports: the transports (entered and exited together).
    """

    transports: list[Transport]
    name: str = "multi"
    _queue: asyncio.Queue[object] = field(default_factory=lambda: asyncio.Queue(EVENT_QUEUE_SIZE))
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _pumps: list[asyncio.Task[None]] = field(default_factory=list)

    async def __aenter__(self) -> Self:
        await self._stack.__aenter__()
        for transport in self.transports:
            await self._stack.enter_async_context(transport)
        tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
        for transport in self.transports:
            name = f"transport[{transport.name}].events"
            self._pumps.append(tasks.create_task(self._pump(transport), name=name))
        return self

    async def _pump(self, transport: Transport) -> None:
        async for event in transport.events():
            await self._queue.put(event)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for task in self._pumps:
            task.cancel()
        close_queue(self._queue)
        await self._stack.__aexit__(exc_type, exc, tb)

    async def events(self) -> AsyncIterator[LinkEvent]:
        """Events of all transports, interleaved as they happen."""
        async for event in iterate_queue(self._queue):
            yield event
