"""In-process links: a pair of bounded asyncio queues per board.

For experiments, the demo and unit tests: virtual boards run in the daemon's event loop
and ``InProcTransport.attach`` plays the part of plugging a board in.

An end may take what the other end sends as it is sent (``receive_with``) instead of
through its queue: a host of many in-process boards (``HostAggregator``) then handles
each answer without a reader task's wake-up.

    async with InProcTransport() as transport:
        endpoint = transport.attach("vb-0")       # the board's end
        event = await anext(transport.events())   # BoardAppeared("vb-0", <daemon's end>)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Self

from qsched.protocol.links.base import (
    EVENT_QUEUE_SIZE,
    INCOMING_QUEUE_SIZE,
    BoardAppeared,
    BoardGone,
    LinkClosedError,
    LinkError,
    LinkEvent,
    close_queue,
    iterate_queue,
    stamped,
    stamped_messages,
)

__all__ = ["InProcLink", "InProcTransport"]

NAME = "inproc"


class _Pair:
    """The shared state of the two ends: closing either closes both."""

    def __init__(self, board_id: str, queue_size: int, on_close: asyncio.Queue[object]) -> None:
        self.board_id = board_id
        self.to_board: asyncio.Queue[object] = asyncio.Queue(queue_size)
        self.to_daemon: asyncio.Queue[object] = asyncio.Queue(queue_size)
        self.closed = False
        self.reason = ""
        self._events = on_close

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.reason = reason
        close_queue(self.to_board)
        close_queue(self.to_daemon)
        event = BoardGone(self.board_id, reason, NAME)
        try:
            self._events.put_nowait(event)
        except asyncio.QueueFull as exc:  # the fleet stopped reading events: a bug upstream
            raise LinkError(self.board_id, "event_queue_full") from exc


class InProcLink:
    """One end of an in-process link (the daemon's or the board's)."""

    def __init__(
        self, pair: _Pair, inbox: asyncio.Queue[object], outbox: asyncio.Queue[object]
    ) -> None:
        self.board_id = pair.board_id
        self._pair = pair
        self._inbox = inbox
        self._outbox = outbox
        self.peer: InProcLink | None = None  # the other end, once both exist
        self.last_arrival: float | None = None  # when the message incoming yields arrived
        self._receiver: Callable[[bytes], None] | None = None

    @property
    def closed(self) -> bool:
        """Whether either end closed the link."""
        return self._pair.closed

    async def send(self, payload: bytes) -> None:
        """Queue one message for the other end (waits while its queue is full).

        Args:
            payload: the message bytes.

        Raises:
            LinkClosedError: the link is closed.
        """
        if self._pair.closed:
            raise LinkClosedError(self.board_id, "closed", self._pair.reason)
        if not self._handed_over(payload):
            await self._outbox.put(stamped(bytes(payload)))

    def send_nowait(self, payload: bytes) -> bool:
        """Queue one message for the other end if its queue has room, without waiting.

        Returns:
            False when the queue is full (``send`` waits for room).

        Raises:
            LinkClosedError: the link is closed.
        """
        if self._pair.closed:
            raise LinkClosedError(self.board_id, "closed", self._pair.reason)
        if self._handed_over(payload):
            return True
        try:
            self._outbox.put_nowait(stamped(bytes(payload)))
        except asyncio.QueueFull:
            return False
        return True

    def _handed_over(self, payload: bytes) -> bool:
        """Give ``payload`` to the other end's receiver, if it took one (``receive_with``)."""
        receiver = None if self.peer is None else self.peer._receiver
        if receiver is None:
            return False
        receiver(bytes(payload))
        return True

    def receive_with(self, receiver: Callable[[bytes], None]) -> None:
        """Hand every message the other end sends to ``receiver``, in the sender's call,
        instead of queueing it for ``incoming`` (which then only ends when the link
        closes). Messages queued already go to ``receiver`` first, in order.
        ``receiver`` must not raise: an exception would reach the sender."""
        if self._pair.closed:
            return  # nothing more comes; incoming ends
        while not self._inbox.empty():  # open: the queue holds stamped messages only
            item = self._inbox.get_nowait()
            assert isinstance(item, tuple)
            receiver(item[0])
        self._receiver = receiver

    async def incoming(self) -> AsyncIterator[bytes]:
        """Messages from the other end until the link closes (with ``receive_with``:
        none, only the end)."""
        async for payload in stamped_messages(self._inbox, self):
            yield payload

    async def close(self, reason: str = "closed") -> None:
        """Close both ends; the transport reports ``BoardGone(reason)``."""
        self._pair.close(reason)


class InProcTransport:
    """Boards attached in the same process.

    Args:
        queue_size: the bound of each direction's queue.
    """

    name = NAME

    def __init__(self, queue_size: int = INCOMING_QUEUE_SIZE) -> None:
        self._queue_size = queue_size
        self._events: asyncio.Queue[object] = asyncio.Queue(EVENT_QUEUE_SIZE)
        self._pairs: dict[str, _Pair] = {}

    def attach(self, board_id: str) -> InProcLink:
        """Plug a board in: returns the board's end and reports the daemon's end.

        Args:
            board_id: the board's id (unique among attached boards).

        Returns:
            The board's end of the new link.

        Raises:
            LinkError: a live board with this id is attached already.
        """
        old = self._pairs.get(board_id)
        if old is not None and not old.closed:
            raise LinkError(board_id, "duplicate", "a board with this id is attached")
        pair = _Pair(board_id, self._queue_size, self._events)
        self._pairs[board_id] = pair
        daemon_end = InProcLink(pair, pair.to_daemon, pair.to_board)
        board_end = InProcLink(pair, pair.to_board, pair.to_daemon)
        daemon_end.peer, board_end.peer = board_end, daemon_end
        self._events.put_nowait(BoardAppeared(board_id, daemon_end, NAME))
        return board_end

    def detach(self, board_id: str, reason: str = "detached") -> None:
        """Unplug a board: both ends close and ``BoardGone(reason)`` is reported.

        Args:
            board_id: the board to unplug.
            reason: the reason the event carries.
        """
        pair = self._pairs.get(board_id)
        if pair is not None:
            pair.close(reason)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for pair in self._pairs.values():
            if not pair.closed:
                pair.closed = True  # no BoardGone on shutdown: the consumer is leaving too
                close_queue(pair.to_board)
                close_queue(pair.to_daemon)
        close_queue(self._events)

    async def events(self) -> AsyncIterator[LinkEvent]:
        """``BoardAppeared`` on attach, ``BoardGone`` on detach or close."""
        async for event in iterate_queue(self._events):
            yield event
