"""Serial links: COBS frames with CRC-32, acks and retransmission over a byte stream.

The framing (``qsched.protocol.framing``, SPEC "Serial framing") is stop-and-wait per
direction: every data frame is acknowledged by an ACK with its sequence number; a frame
without an ACK after ``ack_timeout`` is sent again (the same bytes) up to
``max_retries`` times; a retransmitted frame the receiver already delivered is
acknowledged again and dropped. Bad frames (garbage, CRC errors, cut-off frames) are
counted and skipped; the reader resynchronises on the next delimiter.

A read of no data (``b""``) or an I/O error means the port is gone — a USB VCP that was
unplugged, or a pseudo-terminal whose other side closed — and the link closes.

Ports are opened with pyserial-asyncio-fast: pyserial-asyncio has had no release
since 2021, while the -fast fork is maintained and keeps its API (writes bypass its
transport, see ``SerialPortStream``). Boards and tests run the same link over a raw
file descriptor (``FdStream``, e.g. a pty master).

A board whose MCU resets behind a still-powered ST-LINK keeps its port: the link stays
up, the board's first frame carries SYN (the receiver accepts it whatever its sequence
number) and the fleet learns of the reset from the board's new Hello.

    async with SerialTransport(["/dev/ttyACM0"]) as transport:   # daemon side
        async for event in transport.events(): ...
    async with SerialEndpoint.from_fd(master_fd, "board-0") as link:   # board side
        await link.send(hello_bytes)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import glob
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

import structlog

from qsched.protocol.errors import ProtocolError
from qsched.protocol.framing import (
    ACK_TIMEOUT_S,
    MAX_RETRIES,
    MAX_SEGMENT,
    Frame,
    FrameEncoder,
    FrameReader,
    Reassembler,
    ReceiveFilter,
    SegmentSizer,
)
from qsched.protocol.links.base import (
    EVENT_QUEUE_SIZE,
    INCOMING_QUEUE_SIZE,
    BoardAppeared,
    BoardGone,
    LinkClosedError,
    LinkEvent,
    MessageTooLargeError,
    SendTimeoutError,
    close_queue,
    iterate_queue,
    stamped,
    stamped_messages,
)
from qsched.protocol.messages import MAX_PAYLOAD

__all__ = [
    "DEFAULT_BAUDRATE",
    "ByteStream",
    "FdStream",
    "LinkStats",
    "SerialEndpoint",
    "SerialLink",
    "SerialPortStream",
    "SerialTransport",
    "write_fd",
]

NAME = "serial"
DEFAULT_BAUDRATE = 921600  # the ST-LINK VCP of the STM32N6570-DK
READ_SIZE = 4096
REOPEN_INTERVAL_S = 1.0
_log = structlog.get_logger("qsched.links.serial")


class ByteStream(Protocol):
    """A duplex byte stream (a serial port, a pty). Fault tests wrap one."""

    async def read(self) -> bytes:
        """Some bytes, or ``b""`` when the other side is gone (no exception)."""
        ...

    async def write(self, data: bytes) -> None:
        """Write all of ``data`` (raises ``OSError`` when the port is gone)."""
        ...

    async def close(self) -> None:
        """Release the port (idempotent)."""
        ...


async def _wait_fd(fd: int, add: Callable[..., None], remove: Callable[[int], object]) -> None:
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add(fd, wake)
    try:
        await ready
    finally:
        remove(fd)


async def write_fd(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a non-blocking descriptor without blocking the loop.

    Args:
        fd: the descriptor (``O_NONBLOCK`` set).
        data: the bytes.

    Raises:
        OSError: the write failed (EIO when the port is gone).
    """
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await _wait_fd(fd, loop.add_writer, loop.remove_writer)


class FdStream:
    """A ``ByteStream`` over a file descriptor (a pty master, an opened tty).

    Args:
        fd: an open descriptor; it is made non-blocking and closed by ``close``.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._closed = False

    async def read(self) -> bytes:
        """Wait until readable, then read; ``b""`` on EOF, EIO (hang-up) or after close."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                return os.read(self._fd, READ_SIZE)
            except BlockingIOError:
                await _wait_fd(self._fd, loop.add_reader, loop.remove_reader)
            except OSError as exc:
                if exc.errno in (errno.EIO, errno.EBADF, errno.ENXIO):
                    return b""  # Linux reports a closed pty peer as EIO
                raise
        return b""

    async def write(self, data: bytes) -> None:
        """Write everything, waiting while the kernel buffer is full."""
        if self._closed:
            raise OSError(errno.EBADF, "stream closed")
        await write_fd(self._fd, data)

    async def close(self) -> None:
        """Close the descriptor."""
        if not self._closed:
            self._closed = True
            os.close(self._fd)


class SerialPortStream:
    """A ``ByteStream`` over a serial port opened with pyserial-asyncio-fast.

    The library opens and configures the port and reads from it. Writes go straight to
    the port's non-blocking descriptor instead of through its transport: in 0.16 a
    write the kernel takes only in part leaves the transport's writer registered for
    ever (an AssertionError on every loop turn), and a write that exactly fills the
    kernel buffer can block the event loop (upstream pull request 36).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, device: str, baudrate: int = DEFAULT_BAUDRATE) -> SerialPortStream:
        """Open ``device`` in raw mode (8N1, no flow control).

        Args:
            device: the port's path (``/dev/ttyACM0``, a udev symlink, a pty).
            baudrate: the line speed (ignored by USB CDC and ptys, kept for UARTs).

        Returns:
            The stream.
        """
        import serial_asyncio_fast  # imported here: pyserial is only needed with serial ports

        reader, writer = await serial_asyncio_fast.open_serial_connection(
            url=device, baudrate=baudrate, exclusive=True
        )
        return cls(reader, writer)

    async def read(self) -> bytes:
        """Some bytes, or ``b""`` when the port reported an error or EOF."""
        try:
            return await self._reader.read(READ_SIZE)
        except (OSError, ConnectionError) as exc:  # SerialException is an OSError
            _log.debug("serial read failed", error=str(exc))
            return b""

    async def write(self, data: bytes) -> None:
        """Write all of ``data`` to the port (see the class docstring for why directly)."""
        port = self._writer.transport.get_extra_info("serial")
        if self._writer.is_closing() or port is None or port.fd is None:
            raise OSError(errno.EBADF, "serial port closed")
        await write_fd(port.fd, data)

    async def close(self) -> None:
        """Close the port."""
        self._writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await self._writer.wait_closed()


@dataclass
class LinkStats:
    """Counters of one serial link (exported as metrics by the fleet)."""

    sent: int = 0
    received: int = 0
    retransmits: int = 0
    segments: int = 0  # data frames sent (a message is one or more segments)
    duplicates: int = 0
    bad_frames: int = 0
    refused: int = 0  # frames not acknowledged because the incoming queue was full


class SerialLink:
    """A reliable message link over a ``ByteStream``; the same class on both ends.

    Use as ``async with``: it runs its reader task until the stream ends or it is closed.

    Args:
        board_id: the link's address (``serial:<device>`` on the daemon side).
        stream: the byte stream (owned: closed with the link).
        ack_timeout: seconds to wait for an ACK before sending again.
        max_retries: retransmissions of a segment before ``send`` gives up.
        queue_size: bound of the incoming message queue.
        max_segment: the longest segment sent; shorter ones while frames need resending.
    """

    def __init__(
        self,
        board_id: str,
        stream: ByteStream,
        *,
        ack_timeout: float = ACK_TIMEOUT_S,
        max_retries: int = MAX_RETRIES,
        queue_size: int = INCOMING_QUEUE_SIZE,
        max_segment: int = MAX_SEGMENT,
    ) -> None:
        self.board_id = board_id
        self.stats = LinkStats()
        self.reason = ""
        self._stream = stream
        self._ack_timeout = ack_timeout
        self._max_retries = max_retries
        self._inbox: asyncio.Queue[object] = asyncio.Queue(queue_size)
        self.last_arrival: float | None = None  # when the message incoming yields arrived
        self._encoder = FrameEncoder()
        self._filter = ReceiveFilter()
        self._reassembler = Reassembler()
        self._sizer = SegmentSizer(max_segment)
        self._acks: dict[int, asyncio.Future[None]] = {}
        self._send_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self._closed = asyncio.Event()
        self._reader_task: asyncio.Task[None] | None = None

    @property
    def closed(self) -> bool:
        """Whether the link is gone."""
        return self._closed.is_set()

    async def __aenter__(self) -> Self:
        self._reader_task = asyncio.create_task(
            self._read_loop(), name=f"link[{self.board_id}].reader"
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def wait_closed(self) -> str:
        """Wait until the link is gone. Returns the reason (``unplugged``, ``closed``)."""
        await self._closed.wait()
        return self.reason

    async def send(self, payload: bytes) -> None:
        """Send one message and wait for its acknowledgement.

        Args:
            payload: the message bytes (at most ``MAX_PAYLOAD``).

        Raises:
            MessageTooLargeError: the payload does not fit a frame.
            SendTimeoutError: a segment had no ACK after ``max_retries`` retransmissions.
            LinkClosedError: the link is gone.
        """
        if len(payload) > MAX_PAYLOAD:
            raise MessageTooLargeError(
                self.board_id, "too_large", f"{len(payload)} > {MAX_PAYLOAD} bytes"
            )
        async with self._send_lock:  # stop-and-wait: one data frame in flight
            self._check_open()
            rest = bytes(payload)
            while True:
                # The size is chosen per segment: a noisy line shrinks the next ones.
                piece, rest = rest[: self._sizer.size], rest[self._sizer.size :]
                await self._send_segment(piece, more=bool(rest))
                if not rest:
                    break
            self.stats.sent += 1

    async def _send_segment(self, piece: bytes, more: bool) -> None:
        seq, wire = self._encoder.data(piece, more)
        ack = asyncio.get_running_loop().create_future()
        self._acks[seq] = ack  # registered before the first write: a fast ACK is not lost
        try:
            self._sizer.record(await self._send_until_acked(seq, wire, ack))
        finally:
            self._acks.pop(seq, None)
            _settle(ack)
        self.stats.segments += 1

    async def _send_until_acked(self, seq: int, wire: bytes, ack: asyncio.Future[None]) -> int:
        """Write the frame until it is acknowledged. Returns the retransmissions it took."""
        for attempt in range(self._max_retries + 1):
            if attempt:
                self.stats.retransmits += 1
                _log.debug("retransmit", board=self.board_id, seq=seq, attempt=attempt)
            await self._write(wire)
            done, _ = await asyncio.wait([ack], timeout=self._ack_timeout)
            if done:
                ack.result()  # raises LinkClosedError when the link went away meanwhile
                return attempt
        # SPEC: the next frame carries SYN, so the peer drops this message's segments.
        self._encoder.restart()
        raise SendTimeoutError(self.board_id, "unacked", f"seq {seq}, {self._max_retries} retries")

    async def _write(self, data: bytes) -> None:
        self._check_open()
        try:
            async with self._write_lock:
                await self._stream.write(data)
        except OSError as exc:
            self._mark_closed("unplugged")
            raise LinkClosedError(self.board_id, "unplugged", str(exc)) from exc

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise LinkClosedError(self.board_id, self.reason or "closed")

    async def incoming(self) -> AsyncIterator[bytes]:
        """Messages from the peer, in order; ends when the link is gone."""
        async for payload in stamped_messages(self._inbox, self):
            yield payload

    async def _read_loop(self) -> None:
        reader = FrameReader()
        try:
            while True:
                data = await self._stream.read()
                if not data:
                    self._mark_closed("unplugged")
                    return
                for frame in reader.feed(data):
                    await self._on_frame(frame)
        except LinkClosedError:
            return
        except Exception:
            _log.exception("serial reader failed", board=self.board_id)
            self._mark_closed("error")

    async def _on_frame(self, frame: Frame | ProtocolError) -> None:
        if isinstance(frame, ProtocolError):
            self.stats.bad_frames += 1
            _log.debug("bad frame", board=self.board_id, kind=frame.kind, detail=frame.detail)
            return
        if frame.is_ack:
            waiter = self._acks.get(frame.seq)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
        if self._inbox.full():
            # Flow control: no ACK, so the peer sends the frame again later instead of
            # this reader blocking (it must keep reading ACKs for our own sends).
            self.stats.refused += 1
            return
        # Acknowledge before the duplicate check: a duplicate means our ACK was lost.
        await self._write(self._encoder.ack(frame.seq))
        if not self._filter.accept(frame):
            self.stats.duplicates += 1
            return
        message = self._reassembler.push(frame)
        if message is None:
            return  # more segments follow; the inbox had room, so it has room for one
        self.stats.received += 1
        self._inbox.put_nowait(stamped(message))

    def _mark_closed(self, reason: str) -> None:
        if self._closed.is_set():
            return
        self.reason = reason
        self._closed.set()
        for waiter in self._acks.values():
            if not waiter.done():
                waiter.set_exception(LinkClosedError(self.board_id, reason))
        close_queue(self._inbox)

    async def close(self, reason: str = "closed") -> None:
        """Close the link and its stream (idempotent)."""
        self._mark_closed(reason)
        task, self._reader_task = self._reader_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._stream.close()


def _settle(future: asyncio.Future[None]) -> None:
    # A sender cancelled while the link closed leaves an exception nobody awaits;
    # fetch it so asyncio does not report "exception was never retrieved".
    if not future.done():
        future.cancel()
    elif not future.cancelled():
        future.exception()


class SerialEndpoint:
    """The board's end of a serial link (virtual board, tests): open and wrap a stream."""

    @staticmethod
    def from_fd(fd: int, board_id: str, **options: float | int) -> SerialLink:
        """A link over an open descriptor (e.g. a pty master); use it with ``async with``.

        Args:
            fd: the descriptor (owned by the link from now on).
            board_id: the board's id, for logs.
            options: ``ack_timeout``, ``max_retries``, ``queue_size`` of ``SerialLink``.

        Returns:
            The (not yet started) link.
        """
        return SerialLink(board_id, FdStream(fd), **options)  # type: ignore[arg-type]

    @staticmethod
    async def open(device: str, board_id: str, baudrate: int = DEFAULT_BAUDRATE) -> SerialLink:
        """A link over a serial device opened with pyserial-asyncio-fast.

        Args:
            device: the port path.
            board_id: the board's id, for logs.
            baudrate: the line speed.

        Returns:
            The (not yet started) link.
        """
        return SerialLink(board_id, await SerialPortStream.open(device, baudrate))


class SerialTransport:
    """The daemon's serial ports: opens each, reports boards, reopens after unplug.

    A link closed by the daemon (``link.close()``, e.g. a faulty board) ends with
    ``BoardGone("closed")``; the port is opened again after ``reopen_interval`` and the
    board comes back as a fresh ``BoardAppeared``, as after a re-plug.

    Args:
        devices: port paths (udev symlinks such as ``/dev/qsched/stlink-<serial>`` work)
            or glob patterns (``/dev/qsched/stlink-*``), rescanned for new ports.
        baudrate: the line speed.
        reopen_interval: seconds between attempts to open an absent port (and rescans).
        link_options: ``ack_timeout``, ``max_retries``, ``queue_size`` of each link.
    """

    name = NAME

    def __init__(
        self,
        devices: Sequence[str | Path],
        *,
        baudrate: int = DEFAULT_BAUDRATE,
        reopen_interval: float = REOPEN_INTERVAL_S,
        **link_options: float | int,
    ) -> None:
        self.devices = [str(device) for device in devices]
        self._baudrate = baudrate
        self._reopen_interval = reopen_interval
        self._link_options = link_options
        self._events: asyncio.Queue[object] = asyncio.Queue(EVENT_QUEUE_SIZE)
        self._tasks: asyncio.TaskGroup | None = None
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._scanner: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        for device in self.devices:
            if not glob.has_magic(device):
                self._start_watch(device)
        if any(glob.has_magic(device) for device in self.devices):
            self._scanner = self._tasks.create_task(self._scan(), name="serial.scan")
        return self

    def _start_watch(self, device: str) -> None:
        assert self._tasks is not None
        task = self._tasks.create_task(self._watch(device), name=f"serial[{device}].watch")
        self._watchers[device] = task

    async def _scan(self) -> None:
        patterns = [device for device in self.devices if glob.has_magic(device)]
        while True:
            for pattern in patterns:
                for device in sorted(glob.glob(pattern)):
                    if device not in self._watchers:
                        self._start_watch(device)
            await asyncio.sleep(self._reopen_interval)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._scanner is not None:
            self._scanner.cancel()
        for task in self._watchers.values():
            task.cancel()
        if self._tasks is not None:
            await self._tasks.__aexit__(None, None, None)
        close_queue(self._events)

    async def events(self) -> AsyncIterator[LinkEvent]:
        """``BoardAppeared`` when a port opens, ``BoardGone("unplugged")`` when it drops."""
        async for event in iterate_queue(self._events):
            yield event

    async def _watch(self, device: str) -> None:
        board_id = f"serial:{device}"
        logged_absent = False
        while True:
            try:
                stream = await SerialPortStream.open(device, self._baudrate)
            except (OSError, ValueError) as exc:  # absent, busy, or not a tty
                if not logged_absent:
                    _log.info("serial port unavailable", device=device, error=str(exc))
                    logged_absent = True
                await asyncio.sleep(self._reopen_interval)
                continue
            logged_absent = False
            _log.info("serial port opened", device=device)
            await self._serve(board_id, SerialLink(board_id, stream, **self._link_options))  # type: ignore[arg-type]
            await asyncio.sleep(self._reopen_interval)

    async def _serve(self, board_id: str, link: SerialLink) -> None:
        async with link:
            await self._events.put(BoardAppeared(board_id, link, NAME))
            try:
                reason = await link.wait_closed()
            finally:
                if not link.closed:  # cancelled: the transport is shutting down
                    await link.close("shutdown")
        _log.info("serial board gone", board=board_id, reason=reason)
        await self._events.put(BoardGone(board_id, reason, NAME))
