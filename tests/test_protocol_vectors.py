"""The committed test vectors: current, and consumed the way the C tests consume them."""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np
import pytest

from qsched.lab.make_vectors import (
    SETS,
    VECTOR_DIR,
    json_vector_sets,
    main,
    render_json,
    render_txt,
    vector_sets,
)
from qsched.protocol import Frame, FrameReader, ProtocolError, decode, encode
from qsched.protocol.framing import delivered_messages
from qsched.protocol.messages import Shard
from qsched.zo.prng import batch_indices, philox4x32, rademacher_bits
from qsched.zo.update import apply_fp32, apply_int8_fp16


def _read_txt(name: str) -> dict[str, str]:
    """The line format as a C reader sees it: key, one space, the rest of the line."""
    out: dict[str, str] = {}
    for line in (VECTOR_DIR / f"{name}.txt").read_text(encoding="ascii").splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.partition(" ")
        out[key] = value
    return out


def _groups(vectors: dict[str, str], prefix: str) -> dict[str, dict[str, str]]:
    groups: dict[str, dict[str, str]] = {}
    for key, value in vectors.items():
        head, _, rest = key.partition(".")
        if head == prefix:
            name, _, field = rest.partition(".")
            groups.setdefault(name, {})[field] = value
    return groups


def test_vectors_committed_files_are_current() -> None:
    """Every committed vector file equals a fresh generation (else run make_vectors)."""
    fresh = vector_sets()
    for name, vectors in fresh.items():
        assert (VECTOR_DIR / f"{name}.txt").read_text(encoding="utf-8") == render_txt(
            name, vectors
        ), name
        assert (VECTOR_DIR / f"{name}.json").read_text(encoding="utf-8") == render_json(vectors), (
            name
        )
    for name, vectors in json_vector_sets().items():  # numeric, wire: JSON only
        assert (VECTOR_DIR / f"{name}.json").read_text(encoding="utf-8") == render_json(vectors), (
            name
        )
    assert main(["--check"]) == 0


@pytest.mark.parametrize("name", sorted(SETS))
def test_vectors_json_and_txt_agree(name: str) -> None:
    """The JSON file is one flat object of strings holding exactly the text file's lines."""
    data = json.loads((VECTOR_DIR / f"{name}.json").read_text(encoding="utf-8"))
    assert all(isinstance(value, str) for value in data.values())
    assert data == _read_txt(name)


def _shard(text: str) -> Shard:
    """``board:k k``, or ``board@start+count:k k`` for a batch slice."""
    head, keys = text.split(":")
    board, _, bounds = head.partition("@")
    start, count = (int(v) for v in bounds.split("+")) if bounds else (0, 0)
    ks = tuple(int(k) for k in keys.split())
    return Shard(board_id=board, ks=ks, slice_start=start, slice_count=count)


def _expected_field(current: Any, text: str) -> Any:
    """Parse a field line into the type the decoded model holds."""
    if isinstance(current, tuple) and current and isinstance(current[0], Shard):
        return tuple(_shard(part) for part in text.split(";"))
    if isinstance(current, tuple):
        items = text.split(",") if text else []
        sample = current[0] if current else 0
        return tuple(_expected_field(sample, item) for item in items)
    if isinstance(current, float):
        raw = bytes.fromhex(text[2:])
        return struct.unpack(">f" if len(raw) == 4 else ">d", raw)[0]
    if isinstance(current, bytes):
        return bytes.fromhex(text)
    if isinstance(current, int):
        return int(text)
    return text


def test_vectors_messages_decode_to_their_fields() -> None:
    """Each message's hex decodes to the listed fields and re-encodes to the same bytes."""
    groups = _groups(_read_txt("messages"), "msg")
    assert len(groups) >= 16
    for name, fields in groups.items():
        data = bytes.fromhex(fields.pop("hex"))
        message = decode(data)
        assert encode(message) == data, name
        assert message.type == fields.pop("type") and data[3] == int(fields.pop("type_code"))
        present = {key for key, value in message if key != "type" and value is not None}
        assert present == set(fields), name
        for field, text in fields.items():
            assert getattr(message, field) == _expected_field(getattr(message, field), text), (
                name,
                field,
            )


def test_vectors_bad_messages_are_refused() -> None:
    """Every bad.* input raises ProtocolError of the listed kind."""
    groups = _groups(_read_txt("messages"), "bad")
    assert len(groups) >= 10
    for name, fields in groups.items():
        with pytest.raises(ProtocolError) as info:
            decode(bytes.fromhex(fields["hex"]))
        assert info.value.kind == fields["error"], name


# What each bad.* input breaks, in the decoder's words: an input refused for another
# reason (a field patched at the wrong offset, say) would not test its case.
_BAD_REASONS = {
    "empty": "0 bytes",
    "short_header": "3 bytes",
    "bad_magic": "header starts",
    "future_version": "version",
    "unknown_type": "type code",
    "truncated_body": "layout needs",
    "trailing_byte": "after the message",
    "bad_enum": "scope code",
    "bad_kset_mode": "k set mode",
    "kset_not_ascending": "ascending",
    "zero_keys": "k count 0",
    "nan_eps": "eps",
    "oversized_chunk": "chunk is",
}


def test_vectors_bad_messages_fail_for_their_named_reason() -> None:
    """Each bad.* input is refused for the fault its name gives, not for a side effect."""
    groups = _groups(_read_txt("messages"), "bad")
    assert set(groups) == set(_BAD_REASONS)
    for name, fields in groups.items():
        with pytest.raises(ProtocolError) as info:
            decode(bytes.fromhex(fields["hex"]))
        assert _BAD_REASONS[name] in str(info.value), (name, str(info.value))


def _summary(item: Frame | ProtocolError) -> str:
    if isinstance(item, ProtocolError):
        return "error"
    return f"{item.seq}:{item.flags}:{item.payload.hex()}"


def test_vectors_frames() -> None:
    """Each frame's wire bytes read back to its seq, flags and payload; streams as listed."""
    vectors = _read_txt("frames")
    for name, fields in _groups(vectors, "frame").items():
        (frame,) = FrameReader().feed(bytes.fromhex(fields["wire"]))
        assert frame == Frame(
            int(fields["seq"]), int(fields["flags"]), bytes.fromhex(fields["payload"])
        ), name
    for name, fields in _groups(vectors, "stream").items():
        items = FrameReader().feed(bytes.fromhex(fields["wire"]))
        assert ",".join(_summary(item) for item in items) == fields["frames"], name
        messages = ",".join(m.hex() for m in delivered_messages(items))
        assert messages == fields["messages"], name


def test_vectors_prng_matches_known_answers() -> None:
    """The Philox vectors include the published Random123 known answers, and all recompute."""
    groups = _groups(_read_txt("prng"), "philox")
    outputs = {fields["counter"] + "/" + fields["key"]: fields["out"] for fields in groups.values()}
    assert outputs["00000000,00000000,00000000,00000000/00000000,00000000"] == (
        "6627e8d5,e169c58d,bc57ac4c,9b00dbd8"
    )
    assert outputs["243f6a88,85a308d3,13198a2e,03707344/a4093822,299f31d0"] == (
        "d16cfe09,94fdcceb,5001e420,24126ea1"
    )
    for fields in groups.values():
        counter = [int(w, 16) for w in fields["counter"].split(",")]
        key = tuple(int(w, 16) for w in fields["key"].split(","))
        words = philox4x32(np.array([counter], dtype=np.uint32), (key[0], key[1]))[0]
        assert ",".join(f"{int(w):08x}" for w in words) == fields["out"]


def test_vectors_rademacher_and_batches() -> None:
    """Sign bits and minibatch indices recompute from their seeds."""
    vectors = _read_txt("prng")
    for fields in _groups(vectors, "rademacher").values():
        seed, step, k, size = (int(fields[f]) for f in ("seed", "step", "k", "size"))
        bits = np.unpackbits(
            np.frombuffer(bytes.fromhex(fields["bits"]), np.uint8), bitorder="little"
        )
        assert np.array_equal(bits[:size].astype(bool), rademacher_bits(seed, step, k, size))
        assert not bits[size:].any()
    for fields in _groups(vectors, "batch").values():
        got = batch_indices(
            int(fields["seed"]),
            int(fields["step"]),
            int(fields["batch_size"]),
            int(fields["dataset_size"]),
        )
        assert ",".join(map(str, got)) == fields["indices"]


def _pairs(fields: dict[str, str]) -> list[tuple[int, float]]:
    ks = [int(k) for k in fields["ks"].split(",")]
    cs = np.frombuffer(bytes.fromhex(fields["cs"]), "<f4")
    return [(k, float(c)) for k, c in zip(ks, cs, strict=True)]


def test_vectors_update_results() -> None:
    """FP32 and INT8 + FP16 update vectors recompute to the listed bytes and checksums."""
    vectors = _read_txt("update")
    fp32 = _groups(vectors, "fp32")
    int8 = _groups(vectors, "int8_fp16")
    assert fp32 and int8
    for fields in fp32.values():
        theta = np.frombuffer(bytes.fromhex(fields["theta"]), "<f4").copy()
        result = apply_fp32(
            theta, int(fields["seed"]), int(fields["step"]), _pairs(fields)
        ).tobytes()
        assert result.hex() == fields["expected"]
        assert zlib.crc32(result) == int(fields["checksum"])
    for fields in int8.values():
        weights = np.frombuffer(bytes.fromhex(fields["weights"]), np.int8).copy()
        buffer = np.frombuffer(bytes.fromhex(fields["buffer"]), "<f2").copy()
        new_w, new_b = apply_int8_fp16(
            weights, buffer, int(fields["seed"]), int(fields["step"]), _pairs(fields)
        )
        assert new_w.tobytes().hex() == fields["expected_weights"]
        assert new_b.tobytes().hex() == fields["expected_buffer"]
        assert zlib.crc32(new_w.tobytes() + new_b.tobytes()) == int(fields["checksum"])
