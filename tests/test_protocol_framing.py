"""Serial framing: COBS + CRC-32 frames, the streaming reader, sequence numbers, acks."""

from __future__ import annotations

import zlib

import pytest
from cobs import cobs
from hypothesis import given, settings
from hypothesis import strategies as st

from qsched.protocol import (
    ACK_TIMEOUT_S,
    FLAG_ACK,
    FLAG_SYN,
    MAX_ENCODED_FRAME,
    MAX_PAYLOAD,
    MAX_RETRIES,
    Frame,
    FrameEncoder,
    FrameReader,
    ProtocolError,
    ReceiveFilter,
    StopAndWaitSender,
    decode_frame,
    encode_frame,
)
from qsched.protocol.framing import (
    FLAG_MORE,
    MAX_SEGMENT,
    MIN_SEGMENT,
    Reassembler,
    SegmentSizer,
    delivered_messages,
    segments,
)

SETTINGS = settings(max_examples=150, deadline=None)
payloads = st.binary(max_size=600)


def _frames(items: list[Frame | ProtocolError]) -> list[Frame]:
    return [item for item in items if isinstance(item, Frame)]


@SETTINGS
@given(st.integers(0, 0xFFFF), payloads, st.sampled_from([0, FLAG_SYN]))
def test_framing_round_trip(seq: int, payload: bytes, flags: int) -> None:
    """A frame decodes to its seq, flags and payload; only its two delimiters are 0x00."""
    wire = encode_frame(seq, payload, flags)
    assert wire[0] == 0 and wire[-1] == 0 and 0 not in wire[1:-1]
    assert decode_frame(wire[1:-1]) == Frame(seq=seq, flags=flags, payload=payload)


@SETTINGS
@given(st.lists(payloads, min_size=1, max_size=5), st.data())
def test_framing_reader_handles_any_split(chunks: list[bytes], data: st.DataObject) -> None:
    """Frames fed in arbitrary pieces come out whole and in order."""
    stream = b"".join(encode_frame(i, p) for i, p in enumerate(chunks))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    reader = FrameReader()
    out: list[Frame | ProtocolError] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        out += reader.feed(stream[start:end])
    assert out == [Frame(seq=i, flags=0, payload=p) for i, p in enumerate(chunks)]


def test_framing_reader_resyncs_after_garbage() -> None:
    """Garbage before a frame costs one error item, never the frame after it."""
    reader = FrameReader()
    out = reader.feed(b"\x01\x02garbage\xff" + encode_frame(3, b"ok"))
    assert isinstance(out[0], ProtocolError)
    assert out[1:] == [Frame(seq=3, flags=0, payload=b"ok")]


def test_framing_reader_resyncs_after_cut_frame() -> None:
    """A frame cut off by a reset is reported, and the next frame still arrives."""
    wire = encode_frame(1, b"first payload")
    out = FrameReader().feed(wire[:-5] + encode_frame(2, b"second"))
    assert [type(item) for item in out] == [ProtocolError, Frame]
    assert _frames(out)[0].payload == b"second"


def test_framing_reader_rejects_bad_crc() -> None:
    """A flipped bit gives a bad_crc error, not a frame."""
    wire = bytearray(encode_frame(1, b"payload"))
    wire[5] ^= 0x10
    (item,) = FrameReader().feed(bytes(wire))
    assert isinstance(item, ProtocolError) and item.kind in {"bad_crc", "bad_framing"}


def test_framing_reader_drops_oversized_run_once() -> None:
    """A run of non-zero bytes past MAX_ENCODED_FRAME gives one error, then frames flow again."""
    reader = FrameReader()
    out = reader.feed(b"\x01" * (MAX_ENCODED_FRAME + 10))
    out += reader.feed(b"\x01" * 5000)
    out += reader.feed(encode_frame(4, b"after"))
    assert [item.kind for item in out if isinstance(item, ProtocolError)] == ["oversized"]
    assert _frames(out) == [Frame(seq=4, flags=0, payload=b"after")]


def test_framing_largest_frame_passes() -> None:
    """A MAX_PAYLOAD payload with no zero bytes (worst COBS overhead) fits the reader."""
    payload = bytes([0x55]) * MAX_PAYLOAD
    wire = encode_frame(0xFFFF, payload)
    assert len(wire) - 2 <= MAX_ENCODED_FRAME
    assert FrameReader().feed(wire) == [Frame(seq=0xFFFF, flags=0, payload=payload)]
    with pytest.raises(ProtocolError):
        encode_frame(0, payload + b"x")


def test_framing_ack_with_payload_is_refused() -> None:
    """An ACK frame that carries bytes is malformed."""
    import zlib

    from cobs import cobs

    body = bytes([FLAG_ACK, 1, 0]) + b"x"
    raw = body + zlib.crc32(body).to_bytes(4, "little")
    with pytest.raises(ProtocolError) as info:
        decode_frame(cobs.encode(raw))
    assert info.value.kind == "bad_framing"


@SETTINGS
@given(st.binary(max_size=400))
def test_framing_random_bytes_yield_only_frames_or_errors(data: bytes) -> None:
    """Random input never raises: the reader returns frames and ProtocolErrors only."""
    reader = FrameReader()
    out = reader.feed(data) + reader.feed(b"\x00")
    assert all(isinstance(item, Frame | ProtocolError) for item in out)


@SETTINGS
@given(payloads, st.data())
def test_framing_mutated_frames_never_pass_corrupted(payload: bytes, data: st.DataObject) -> None:
    """A frame with one byte changed is refused with a ProtocolError."""
    wire = bytearray(encode_frame(7, payload))
    index = data.draw(st.integers(0, len(wire) - 1))
    wire[index] ^= data.draw(st.integers(1, 255))
    out = FrameReader().feed(bytes(wire) + b"\x00")
    assert out and all(isinstance(item, ProtocolError) for item in out)


def test_framing_encoder_numbers_frames_and_starts_with_syn() -> None:
    """The first data frame is SYN, sequence numbers count up and wrap at 65536."""
    encoder = FrameEncoder(initial_seq=0xFFFF)
    seq1, wire1 = encoder.data(b"a")
    seq2, wire2 = encoder.data(b"b")
    assert (seq1, seq2) == (0xFFFF, 0)
    assert decode_frame(wire1[1:-1]).is_syn and not decode_frame(wire2[1:-1]).is_syn
    encoder.restart()
    assert decode_frame(encoder.data(b"c")[1][1:-1]).is_syn
    ack = decode_frame(encoder.ack(seq2)[1:-1])
    assert ack.is_ack and ack.seq == 0 and ack.payload == b""


def test_framing_filter_drops_retransmissions() -> None:
    """A resent frame (same seq, lost ACK) is not delivered twice; a SYN restart is."""
    filt = ReceiveFilter()
    first = Frame(seq=10, flags=FLAG_SYN, payload=b"x")
    second = Frame(seq=11, flags=0, payload=b"y")
    assert filt.accept(first) and not filt.accept(first)
    assert filt.accept(second) and not filt.accept(second)
    assert filt.accept(Frame(seq=11, flags=FLAG_SYN, payload=b"rebooted"))
    with pytest.raises(ValueError):
        filt.accept(Frame(seq=1, flags=FLAG_ACK, payload=b""))


def test_framing_sender_retransmits_then_gives_up() -> None:
    """An unacknowledged frame is resent after the timeout, MAX_RETRIES times, then fails."""
    sender = StopAndWaitSender(FrameEncoder(initial_seq=5))
    wire = sender.send(b"msg", now=0.0)
    assert sender.poll(ACK_TIMEOUT_S / 2) is None
    # Polled just after each deadline (a resend's deadline is the poll's time + timeout).
    late = ACK_TIMEOUT_S + 1e-6
    resent = [sender.poll(late * (i + 1)) for i in range(MAX_RETRIES)]
    assert resent == [wire] * MAX_RETRIES
    with pytest.raises(TimeoutError):
        sender.poll(late * (MAX_RETRIES + 1))
    assert not sender.busy
    assert decode_frame(sender.send(b"next", now=10.0)[1:-1]).is_syn


def test_framing_sender_clears_on_matching_ack_only() -> None:
    """Only the ACK with the pending seq frees the sender for the next frame."""
    sender = StopAndWaitSender(FrameEncoder(initial_seq=5))
    sender.send(b"one", now=0.0)
    with pytest.raises(RuntimeError):
        sender.send(b"two", now=0.0)
    assert not sender.on_ack(Frame(seq=4, flags=FLAG_ACK, payload=b""))
    assert not sender.on_ack(Frame(seq=5, flags=0, payload=b""))
    assert sender.on_ack(Frame(seq=5, flags=FLAG_ACK, payload=b""))
    assert not sender.busy and sender.poll(100.0) is None
    frame = decode_frame(sender.send(b"two", now=1.0)[1:-1])
    assert (frame.seq, frame.is_syn) == (6, False)


def test_framing_lossy_link_delivers_each_message_once() -> None:
    """Over a link that drops every other frame, each message is delivered exactly once."""
    sender, receiver = StopAndWaitSender(FrameEncoder(initial_seq=0)), ReceiveFilter()
    to_board, from_board = FrameReader(), FrameReader()
    acker = FrameEncoder()
    delivered: list[bytes] = []
    now, dropped = 0.0, 0
    for message in [b"a", b"b", b"c", b"d"]:
        wire = sender.send(message, now)
        while sender.busy:
            dropped += 1
            if dropped % 2 == 0:  # this copy of the frame arrives
                for frame in _frames(to_board.feed(wire)):
                    if receiver.accept(frame):
                        delivered.append(frame.payload)
                    ack = acker.ack(frame.seq)
                    if dropped % 4 == 0:  # and every other ACK arrives too
                        for item in _frames(from_board.feed(ack)):
                            sender.on_ack(item)
            now += ACK_TIMEOUT_S
            wire = sender.poll(now) or wire
    assert delivered == [b"a", b"b", b"c", b"d"]


@SETTINGS
@given(st.binary(max_size=3000), st.integers(MIN_SEGMENT, MAX_SEGMENT))
def test_framing_segments_join_to_the_message(payload: bytes, size: int) -> None:
    """A message cut into MORE-flagged segments (some resent) arrives whole, once."""
    encoder = FrameEncoder(initial_seq=65530)
    pieces = segments(payload, size)
    frames = []
    for i, piece in enumerate(pieces):
        _, wire = encoder.data(piece, more=i < len(pieces) - 1)
        frame = decode_frame(wire[1:-1])
        frames += [frame, frame] if i % 3 == 1 else [frame]  # a lost ACK: sent twice
    assert all(len(p) <= size for p in pieces)
    assert delivered_messages(frames) == [payload]


def test_framing_syn_drops_a_half_received_message() -> None:
    """A sender that gave up mid-message starts over with SYN: the partial is dropped."""
    encoder = FrameEncoder(initial_seq=1)
    first = decode_frame(encoder.data(b"head-", more=True)[1][1:-1])
    encoder.restart()
    again = [
        decode_frame(encoder.data(p, more=m)[1][1:-1]) for p, m in ((b"ne", True), (b"w", False))
    ]
    assert again[0].is_syn and delivered_messages([first, *again]) == [b"new"]


def test_framing_reassembly_is_bounded() -> None:
    """A peer that never ends its message cannot grow the buffer past MAX_PAYLOAD + 1."""
    joiner = Reassembler()
    chunk = Frame(seq=0, flags=FLAG_MORE, payload=bytes(MAX_SEGMENT))
    for _ in range(MAX_PAYLOAD // MAX_SEGMENT + 5):
        assert joiner.push(chunk) is None
    message = joiner.push(Frame(seq=1, flags=0, payload=b"end"))
    assert message is not None and len(message) == MAX_PAYLOAD + 1


def test_framing_ack_with_more_or_syn_is_refused() -> None:
    """An ACK carries no other flag: encoding refuses it, decoding calls it bad framing."""
    with pytest.raises(ValueError):
        encode_frame(1, b"", FLAG_ACK | FLAG_MORE)
    raw = bytes([FLAG_ACK | FLAG_MORE, 1, 0])
    wire = cobs.encode(raw + zlib.crc32(raw).to_bytes(4, "little"))
    with pytest.raises(ProtocolError) as info:
        decode_frame(wire)
    assert info.value.kind == "bad_framing"


def test_framing_segment_size_adapts_to_the_line() -> None:
    """Resends halve the next segments down to MIN_SEGMENT; clean runs double them back."""
    sizer = SegmentSizer(256)
    for _ in range(10):
        sizer.record(1)
    assert sizer.size == MIN_SEGMENT
    for _ in range(SegmentSizer.CLEAN_TO_GROW * 3):
        sizer.record(0)
    assert sizer.size == 256
    with pytest.raises(ValueError):
        SegmentSizer(MAX_SEGMENT + 1)
