"""Host batches (protocol/batch.py): many boards' messages in one publish, and every
malformed batch refused with one ProtocolError."""

from __future__ import annotations

import struct

import pytest

from qsched.protocol.batch import MAX_BATCH_BYTES, batch_size, pack_batch, unpack_batch
from qsched.protocol.codec import encode
from qsched.protocol.errors import ProtocolError
from qsched.protocol.messages import MAX_PAYLOAD, Ping, UpdateAck

RECORDS = [
    ("board-00", encode(UpdateAck(job_id=1, step=2, checksum=3))),
    ("board-01", encode(Ping(nonce=9))),
    ("board-00", b""),
]


def test_batch_round_trips_records_in_order() -> None:
    """Records come back in order, repeats of a board included; the size is exact."""
    data = pack_batch(RECORDS)
    assert data[:3] == b"QB\x01" and len(data) == batch_size(RECORDS)
    assert unpack_batch(data) == RECORDS
    assert unpack_batch(pack_batch([])) == []


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (b"QB", "truncated"),
        (b"XX\x01\x00\x00", "bad_magic"),
        (b"QB\x02\x00\x00", "unsupported_version"),
        (pack_batch(RECORDS)[:-1], "truncated"),
        (pack_batch(RECORDS) + b"\x00", "trailing_bytes"),
        (b"QB\x01\x01\x00" + b"\x03a/b" + b"\x00\x00", "invalid_field"),  # not one level
        (b"QB\x01\x01\x00" + b"\x01a" + struct.pack("<H", MAX_PAYLOAD + 1), "invalid_field"),
        (b"QB\x01\x05\x00", "truncated"),  # five records announced, none there
    ],
)
def test_malformed_batches_are_refused(data: bytes, kind: str) -> None:
    """Every malformed batch is one ProtocolError of the listed kind."""
    with pytest.raises(ProtocolError) as info:
        unpack_batch(data)
    assert info.value.kind == kind


def test_pack_refuses_what_the_daemon_could_not_route() -> None:
    """A board id that is not one topic level, an oversized message or batch: ValueError."""
    with pytest.raises(ValueError, match="topic level"):
        pack_batch([("a/b", b"")])
    with pytest.raises(ValueError, match="at most"):
        pack_batch([("a", b"x" * (MAX_PAYLOAD + 1))])
    big = [(f"b{i}", b"x" * MAX_PAYLOAD) for i in range(MAX_BATCH_BYTES // MAX_PAYLOAD + 1)]
    with pytest.raises(ValueError, match="batch of"):
        pack_batch(big)
