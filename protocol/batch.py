"""Host batches: many boards' data-plane messages in one MQTT publish (SPEC 8.1).

A process hosting many boards (``qsched board --count N --host-uplink``) publishes what
its boards send within one turn of its event loop as one batch on ``hosts/<host>/out``
instead of one publish per message: the daemon's broker traffic and its per-publish
cost grow with hosts rather than boards. Pure: no I/O.

Layout: ``51 42`` ("QB"), version u8 (1), count u16, then per record: board id (u8
length, ASCII, one topic level), payload (u16 length, the codec bytes of section 6).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from typing import Final

from qsched.protocol.errors import ProtocolError
from qsched.protocol.messages import MAX_PAYLOAD

__all__ = [
    "BATCH_MAGIC",
    "BATCH_VERSION",
    "MAX_BATCH_BYTES",
    "batch_size",
    "pack_batch",
    "record_size",
    "unpack_batch",
]

BATCH_MAGIC: Final = b"QB"
BATCH_VERSION: Final = 1
# Most bytes in one batch: a publish stays far below brokers' default message limits.
MAX_BATCH_BYTES: Final = 256 * 1024
_BOARD_ID: Final = re.compile(rb"[A-Za-z0-9_.-]{1,64}")
_HEAD: Final = struct.Struct("<2sBH")


def pack_batch(records: Sequence[tuple[str, bytes]]) -> bytes:
    """One batch of (board id, message bytes) records, in order.

    Raises:
        ValueError: a board id that is not one topic level, a message over
            ``MAX_PAYLOAD``, more than 65,535 records or a batch over ``MAX_BATCH_BYTES``.
    """
    if len(records) > 0xFFFF:
        raise ValueError(f"{len(records)} records, at most 65535")
    out = bytearray(_HEAD.pack(BATCH_MAGIC, BATCH_VERSION, len(records)))
    for board_id, payload in records:
        raw = board_id.encode("ascii", "replace")
        if not _BOARD_ID.fullmatch(raw):
            raise ValueError(f"board id {board_id!r} is not one topic level")
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"a message of {len(payload)} bytes, at most {MAX_PAYLOAD}")
        out += struct.pack("<B", len(raw)) + raw + struct.pack("<H", len(payload)) + payload
    if len(out) > MAX_BATCH_BYTES:
        raise ValueError(f"a batch of {len(out)} bytes, at most {MAX_BATCH_BYTES}")
    return bytes(out)


def record_size(board_id: str, payload: bytes) -> int:
    """The bytes one record takes in a batch."""
    return 3 + len(board_id) + len(payload)


def batch_size(records: Sequence[tuple[str, bytes]]) -> int:
    """The bytes ``pack_batch(records)`` takes."""
    return _HEAD.size + sum(record_size(b, p) for b, p in records)


def unpack_batch(data: bytes) -> list[tuple[str, bytes]]:
    """The records of one batch.

    Raises:
        ProtocolError: ``bad_magic``, ``unsupported_version``, ``truncated``,
            ``trailing_bytes`` or ``invalid_field`` (a bad board id or a message too long).
    """
    if len(data) < _HEAD.size:
        raise ProtocolError("truncated", f"{len(data)} bytes, a batch header needs {_HEAD.size}")
    magic, version, count = _HEAD.unpack_from(data)
    if magic != BATCH_MAGIC:
        raise ProtocolError("bad_magic", f"batch starts with {magic.hex()}, not 5142")
    if version != BATCH_VERSION:
        raise ProtocolError("unsupported_version", f"batch version {version}")
    records: list[tuple[str, bytes]] = []
    pos = _HEAD.size
    for _ in range(count):
        if pos + 1 > len(data):
            raise ProtocolError("truncated", "batch ends inside a record")
        size = data[pos]
        raw = data[pos + 1 : pos + 1 + size]
        pos += 1 + size
        if len(raw) != size or pos + 2 > len(data):
            raise ProtocolError("truncated", "batch ends inside a record")
        if not _BOARD_ID.fullmatch(raw):
            raise ProtocolError("invalid_field", "a record's board id is not one topic level")
        (length,) = struct.unpack_from("<H", data, pos)
        pos += 2
        if length > MAX_PAYLOAD:
            raise ProtocolError("invalid_field", f"a record of {length} bytes > {MAX_PAYLOAD}")
        if pos + length > len(data):
            raise ProtocolError("truncated", "batch ends inside a record")
        records.append((raw.decode("ascii"), bytes(data[pos : pos + length])))
        pos += length
    if pos != len(data):
        raise ProtocolError("trailing_bytes", f"{len(data) - pos} bytes after the last record")
    return records
