"""Serial framing: COBS frames with CRC-32, sequence numbers, acks, retransmission.

On the wire every frame is ``00 | COBS(raw) | 00`` where raw is

    flags u8 | seq u16 | payload (one segment of a message) | crc32 u32

all little-endian, the CRC (zlib's CRC-32) taken over flags, seq and payload. The
leading 0x00 ends whatever partial frame a receiver holds (garbage, a frame cut off
by a reset), so the next frame is never lost to resynchronisation; receivers ignore
empty frames. A message travels in segments of at most ``MAX_SEGMENT`` bytes, every
one but the last flagged MORE: on a noisy line a short frame gets through where a long
one never would, and only the damaged segment is sent again. The link is stop-and-wait
per direction (SPEC section 7): a data frame is acknowledged by an ACK frame with the
same ``seq``; unacknowledged frames are sent again, the same bytes, after
``ACK_TIMEOUT_S``, at most ``MAX_RETRIES`` times. Nothing here does I/O.
"""

from __future__ import annotations

import random
import struct
import zlib
from dataclasses import dataclass
from typing import Final

from cobs import cobs

from qsched.protocol.errors import ProtocolError
from qsched.protocol.messages import MAX_PAYLOAD

__all__ = [
    "ACK_TIMEOUT_S",
    "DELIMITER",
    "FLAG_ACK",
    "FLAG_MORE",
    "FLAG_SYN",
    "FRAME_OVERHEAD",
    "MAX_ENCODED_FRAME",
    "MAX_RAW_FRAME",
    "MAX_RETRIES",
    "MAX_SEGMENT",
    "MIN_SEGMENT",
    "Frame",
    "FrameEncoder",
    "FrameReader",
    "Reassembler",
    "ReceiveFilter",
    "SegmentSizer",
    "StopAndWaitSender",
    "decode_frame",
    "delivered_messages",
    "encode_frame",
    "segments",
]

DELIMITER: Final = 0x00
FLAG_ACK: Final = 0x01  # an acknowledgement: empty payload, seq of the frame acked
FLAG_SYN: Final = 0x02  # the sender (re)started: the receiver forgets the last seq seen
FLAG_MORE: Final = 0x04  # the message continues in the next data frame
_KNOWN_FLAGS: Final = FLAG_ACK | FLAG_SYN | FLAG_MORE
_HEAD: Final = struct.Struct("<BH")
_CRC: Final = struct.Struct("<I")
FRAME_OVERHEAD: Final = _HEAD.size + _CRC.size
MAX_RAW_FRAME: Final = FRAME_OVERHEAD + MAX_PAYLOAD
# COBS adds one byte per started run of 254 bytes, so at most len // 254 + 1.
MAX_ENCODED_FRAME: Final = MAX_RAW_FRAME + MAX_RAW_FRAME // 254 + 1
# Segments a sender makes: at most MAX_SEGMENT bytes (11 ms at 921600 baud, 10 bits a
# byte); qsched's links shrink them to MIN_SEGMENT while frames need resending.
MAX_SEGMENT: Final = 1024
MIN_SEGMENT: Final = 32
# Ten times the longest segment's time on the wire, and USB's few ms: a lost frame is
# sent again soon, and 16 tries get a 32-byte segment through a line that garbles one
# byte in a hundred (each try arrives with probability 0.6) all but surely.
ACK_TIMEOUT_S: Final = 0.1
MAX_RETRIES: Final = 16


@dataclass(frozen=True)
class Frame:
    """One decoded frame."""

    seq: int
    flags: int
    payload: bytes

    @property
    def is_ack(self) -> bool:
        """True for an acknowledgement frame."""
        return bool(self.flags & FLAG_ACK)

    @property
    def is_syn(self) -> bool:
        """True for the first data frame after the sender (re)started."""
        return bool(self.flags & FLAG_SYN)

    @property
    def more(self) -> bool:
        """True when the message continues in the next data frame."""
        return bool(self.flags & FLAG_MORE)


def encode_frame(seq: int, payload: bytes, flags: int = 0) -> bytes:
    """Encode one frame, delimiters included.

    Args:
        seq: sequence number, 0..65535.
        payload: the message bytes (empty for an ACK).
        flags: FLAG_ACK alone, or FLAG_SYN and/or FLAG_MORE.

    Returns:
        ``00 | COBS(flags, seq, payload, crc32) | 00``.

    Raises:
        ProtocolError: ``oversized`` payload; ValueError for a bad seq or flags.
    """
    ack_with_more = flags & FLAG_ACK and flags & (FLAG_SYN | FLAG_MORE)
    if not 0 <= seq <= 0xFFFF or flags & ~_KNOWN_FLAGS or flags < 0 or ack_with_more:
        raise ValueError(f"bad seq {seq} or flags 0x{flags:x}")
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError("oversized", f"payload of {len(payload)} bytes > {MAX_PAYLOAD}")
    body = _HEAD.pack(flags, seq) + bytes(payload)
    raw = body + _CRC.pack(zlib.crc32(body))
    return b"\x00" + bytes(cobs.encode(raw)) + b"\x00"


def decode_frame(encoded: bytes) -> Frame:
    """Decode the COBS bytes of one frame (between delimiters, none included).

    Raises:
        ProtocolError: ``oversized``, ``bad_framing`` or ``bad_crc``.
    """
    if len(encoded) > MAX_ENCODED_FRAME:
        raise ProtocolError("oversized", f"frame of {len(encoded)} bytes > {MAX_ENCODED_FRAME}")
    try:
        raw = bytes(cobs.decode(bytes(encoded)))
    except cobs.DecodeError as exc:
        raise ProtocolError("bad_framing", f"COBS decoding failed: {exc}") from exc
    if len(raw) < FRAME_OVERHEAD:
        raise ProtocolError("bad_framing", f"frame of {len(raw)} bytes < {FRAME_OVERHEAD}")
    body, (crc,) = raw[:-4], _CRC.unpack(raw[-4:])
    if zlib.crc32(body) != crc:
        raise ProtocolError("bad_crc", f"CRC {zlib.crc32(body):08x} != {crc:08x}")
    flags, seq = _HEAD.unpack(body[:3])
    payload = body[3:]
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError("bad_framing", f"undefined flag bits 0x{flags:02x}")
    if flags & FLAG_ACK and (payload or flags & (FLAG_SYN | FLAG_MORE)):
        raise ProtocolError("bad_framing", "an ACK frame carries a payload or other flags")
    return Frame(seq=seq, flags=flags, payload=payload)


class FrameReader:
    """Splits a byte stream into frames; resynchronises after garbage or cut-off frames."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._discarding = False  # dropping an oversized run until the next delimiter

    def feed(self, data: bytes) -> list[Frame | ProtocolError]:
        """Take bytes as they arrive.

        Args:
            data: any number of bytes, split anywhere.

        Returns:
            The frames completed by these bytes, in order, with a ProtocolError in
            place of each frame that was bad (returned, never raised).
        """
        out: list[Frame | ProtocolError] = []
        start = 0
        while True:
            end = data.find(DELIMITER, start)
            piece = data[start:] if end < 0 else data[start:end]
            self._append(piece, out)
            if end < 0:
                return out
            self._finish(out)
            start = end + 1

    def _append(self, piece: bytes, out: list[Frame | ProtocolError]) -> None:
        if self._discarding or not piece:
            return
        self._buf += piece
        if len(self._buf) > MAX_ENCODED_FRAME:
            out.append(ProtocolError("oversized", f"no delimiter within {MAX_ENCODED_FRAME} bytes"))
            self._buf.clear()
            self._discarding = True

    def _finish(self, out: list[Frame | ProtocolError]) -> None:
        if self._discarding:
            self._discarding = False
        elif self._buf:
            try:
                out.append(decode_frame(bytes(self._buf)))
            except ProtocolError as exc:
                out.append(exc)
        self._buf.clear()


class FrameEncoder:
    """The sending side's sequence numbers: data frames count up, the first is SYN."""

    def __init__(self, initial_seq: int | None = None) -> None:
        # A random start makes a restarted sender unlikely to repeat the last seq seen.
        self._next = random.randrange(0x10000) if initial_seq is None else initial_seq & 0xFFFF
        self._syn = True

    def data(self, payload: bytes, more: bool = False) -> tuple[int, bytes]:
        """Frame a new segment (``more``: not the message's last). Returns (seq, wire
        bytes); resend the same bytes on timeout."""
        seq = self._next
        flags = (FLAG_SYN if self._syn else 0) | (FLAG_MORE if more else 0)
        wire = encode_frame(seq, payload, flags)
        self._next = (seq + 1) & 0xFFFF
        self._syn = False
        return seq, wire

    def ack(self, seq: int) -> bytes:
        """The acknowledgement of a received data frame."""
        return encode_frame(seq, b"", FLAG_ACK)

    def restart(self) -> None:
        """After MAX_RETRIES failed sends: the next data frame carries SYN again."""
        self._syn = True


class ReceiveFilter:
    """Duplicate detection on the receiving side (a lost ACK makes the peer resend)."""

    def __init__(self) -> None:
        self._last: tuple[int, bool] | None = None

    def accept(self, frame: Frame) -> bool:
        """True if a data frame is new and must be delivered; acknowledge it either way."""
        if frame.is_ack:
            raise ValueError("ACK frames are not filtered")
        # Consecutive data frames differ in seq (stop-and-wait), so the same seq and
        # SYN flag as the last delivered frame can only be a retransmission.
        key = (frame.seq, frame.is_syn)
        if key == self._last:
            return False
        self._last = key
        return True


class Reassembler:
    """Joins the segments of delivered data frames into messages.

    A frame without MORE ends a message. A SYN frame means the sender restarted or gave
    up on a message: whatever was collected before it is dropped. A message can grow
    past ``MAX_PAYLOAD`` only from a faulty peer; it is kept to ``MAX_PAYLOAD + 1``
    bytes, so the message decoder still refuses it (``oversized``) and memory is bounded.
    """

    def __init__(self) -> None:
        self._parts = bytearray()

    def push(self, frame: Frame) -> bytes | None:
        """Take a delivered (new, not duplicate) data frame; the message it completes."""
        if frame.is_syn:
            self._parts.clear()
        room = MAX_PAYLOAD + 1 - len(self._parts)
        self._parts += frame.payload[: max(room, 0)]
        if frame.more:
            return None
        message = bytes(self._parts)
        self._parts.clear()
        return message


def delivered_messages(items: list[Frame | ProtocolError]) -> list[bytes]:
    """The messages a receiver delivers from what ``FrameReader.feed`` returned: bad
    frames and ACKs skipped, duplicates filtered, segments joined (SPEC 7.4)."""
    receive, joiner, out = ReceiveFilter(), Reassembler(), []
    for item in items:
        if isinstance(item, Frame) and not item.is_ack and receive.accept(item):
            message = joiner.push(item)
            if message is not None:
                out.append(message)
    return out


def segments(payload: bytes, size: int) -> list[bytes]:
    """``payload`` cut into pieces of at most ``size`` bytes (an empty message is one
    empty segment)."""
    return [payload[i : i + size] for i in range(0, len(payload), size)] or [b""]


class SegmentSizer:
    """How long a sender's next segments are: halved (to ``MIN_SEGMENT``) whenever a
    frame had to be sent again, doubled (to ``largest``) after 8 clean frames in a row.

    A local choice of the sender (SPEC section 7.4): receivers take any segmentation.
    """

    CLEAN_TO_GROW: Final = 8

    def __init__(self, largest: int = MAX_SEGMENT) -> None:
        if not MIN_SEGMENT <= largest <= MAX_SEGMENT:
            raise ValueError(f"segment size {largest} outside [{MIN_SEGMENT}, {MAX_SEGMENT}]")
        self.largest = largest
        self.size = largest
        self._clean = 0

    def record(self, retransmits: int) -> None:
        """Take how many times the last frame was sent again."""
        if retransmits:
            self.size = max(MIN_SEGMENT, self.size // 2)
            self._clean = 0
            return
        self._clean += 1
        if self._clean >= self.CLEAN_TO_GROW:
            self.size = min(self.largest, self.size * 2)
            self._clean = 0


class StopAndWaitSender:
    """The sending side's retransmission rules, driven by the caller's clock. No I/O.

    ``send`` frames a payload, ``on_ack`` clears it when its ACK arrives, and ``poll``
    says what to resend when ``ACK_TIMEOUT_S`` has passed; after ``MAX_RETRIES`` resends
    it raises ``TimeoutError`` and the next frame carries SYN.
    """

    def __init__(
        self,
        encoder: FrameEncoder | None = None,
        timeout_s: float = ACK_TIMEOUT_S,
        max_retries: int = MAX_RETRIES,
    ) -> None:
        self._encoder = encoder or FrameEncoder()
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._pending: tuple[int, bytes] | None = None
        self._deadline = 0.0
        self._retries = 0

    @property
    def busy(self) -> bool:
        """True while a data frame awaits its ACK (the next one must wait)."""
        return self._pending is not None

    @property
    def deadline(self) -> float | None:
        """When ``poll`` next has something to do, or None when idle."""
        return self._deadline if self._pending is not None else None

    def send(self, payload: bytes, now: float) -> bytes:
        """Frame a payload. Returns the wire bytes to write.

        Raises:
            RuntimeError: a frame is still awaiting its ACK.
        """
        if self._pending is not None:
            raise RuntimeError(f"frame {self._pending[0]} is still awaiting its ACK")
        seq, wire = self._encoder.data(payload)
        self._pending = (seq, wire)
        self._deadline = now + self._timeout_s
        self._retries = 0
        return wire

    def on_ack(self, frame: Frame) -> bool:
        """Take an ACK frame; True if it acknowledged the pending frame."""
        if not frame.is_ack or self._pending is None or frame.seq != self._pending[0]:
            return False
        self._pending = None
        return True

    def poll(self, now: float) -> bytes | None:
        """The bytes to resend if the ACK is overdue, else None.

        Raises:
            TimeoutError: the frame went unacknowledged MAX_RETRIES times; it is dropped.
        """
        if self._pending is None or now < self._deadline:
            return None
        if self._retries >= self._max_retries:
            seq = self._pending[0]
            self._pending = None
            self._encoder.restart()
            raise TimeoutError(f"no ACK for frame {seq} after {self._max_retries} retries")
        self._retries += 1
        self._deadline = now + self._timeout_s
        return self._pending[1]
