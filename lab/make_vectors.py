"""Generate the test vectors in ``protocol/vectors/`` that Python and C tests consume.

    python -m qsched.lab.make_vectors            # rewrite the files
    python -m qsched.lab.make_vectors --check    # exit 1 if any file is stale

Each set is written twice from one ordered mapping of key -> value:
``<set>.txt`` with one ``key value`` per line (the value is the rest of the line;
``#`` starts a comment line) for a small C reader, and ``<set>.json``, one flat JSON
object of strings. Value conventions: integers in decimal; floats as the hex of
their IEEE bits with a ``0x`` prefix (8 digits float32, 16 digits float64); byte
strings as lowercase hex; lists comma-separated; names as plain text.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final

import numpy as np

import qsched.protocol as protocol_package
from qsched.protocol.codec import encode
from qsched.protocol.errors import ProtocolError
from qsched.protocol.framing import FLAG_ACK, FLAG_SYN, Frame, FrameReader, encode_frame
from qsched.protocol.messages import (
    MAX_CHUNK,
    PROTOCOL_VERSION,
    TYPE_CODES,
    ApplyUpdate,
    DataMessage,
    Error,
    EvalRequest,
    EvalResult,
    Heartbeat,
    Hello,
    JobConfig,
    Loaded,
    LoadModel,
    Ping,
    Reset,
    SelectDataset,
    SetWeights,
    UpdateAck,
    ValidateRequest,
    ValidateResult,
)
from qsched.zo.prng import batch_indices, philox4x32, rademacher_bits
from qsched.zo.update import apply_fp32, apply_int8_fp16

__all__ = ["VECTOR_DIR", "main", "render_json", "render_txt", "vector_sets"]

# The vectors ship with the protocol package, beside SPEC.md, for every implementation.
VECTOR_DIR: Final = Path(protocol_package.__file__).with_name("vectors")
Vectors = dict[str, str]


def _f32_bits(value: float) -> str:
    return "0x" + struct.pack(">f", value).hex()


def _f64_bits(value: float) -> str:
    return "0x" + struct.pack(">d", value).hex()


def _field_value(cls: type, name: str, value: Any) -> str:
    if isinstance(value, bool):
        raise TypeError("no boolean fields on the data plane")
    if isinstance(value, float):
        return _f64_bits(value) if (cls, name) == (ValidateResult, "loss_sum") else _f32_bits(value)
    if isinstance(value, tuple):
        return ",".join(_field_value(cls, name, item) for item in value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _messages() -> list[tuple[str, DataMessage]]:
    losses = (2.302585, 2.1, 1.75, 0.5, 3.0, 2.25, 1.0, 0.125)
    return [
        (
            "hello",
            Hello(
                board_id="n6-01",
                firmware_version="0.1.0",
                npu="neural_art",
                ram_kib=4200,
                max_batch=64,
                model_hash=0x1122334455667788,
                dataset_hash=0x0102030405060708,
            ),
        ),
        (
            "heartbeat",
            Heartbeat(nonce=7, uptime_ms=123456, state="ready", job_id=0xCAFEF00D, step=41),
        ),
        (
            "eval_result_two_sided",
            EvalResult(
                job_id=0xCAFEF00D,
                step=42,
                compute_us=31250,
                estimator="two_sided",
                ks=tuple(range(8, 16)),
                loss_plus=losses,
                loss_minus=losses[::-1],
            ),
        ),
        (
            "eval_result_one_sided",
            EvalResult(
                job_id=0xCAFEF00D,
                step=42,
                compute_us=900,
                estimator="one_sided",
                ks=(1, 5, 6),
                loss_plus=(1.5, 0.25, 2.0),
                loss_zero=1.125,
            ),
        ),
        ("update_ack", UpdateAck(job_id=0xCAFEF00D, step=42, checksum=0x89ABCDEF)),
        (
            "validate_result",
            ValidateResult(
                job_id=0xCAFEF00D,
                step=50,
                start=100,
                count=50,
                loss_sum=34.56789,
                correct=45,
                compute_us=70000,
            ),
        ),
        ("loaded", Loaded(resource="weights", job_id=0xCAFEF00D, crc32=0x12345678, size=4096)),
        ("error", Error(code="unsupported_version", ref_type=0x01, detail="protocol 1 required")),
        ("load_model", LoadModel(total=1000, offset=256, crc32=0xDEADBEEF, chunk=bytes(range(16)))),
        (
            "set_weights",
            SetWeights(
                total=12,
                offset=0,
                job_id=0xCAFEF00D,
                step=42,
                checksum=0x0BADC0DE,
                chunk=b"\x01\xff\x00\x7f\x81\x02",
            ),
        ),
        (
            "select_dataset",
            SelectDataset(
                name="digits", dataset_hash=0xA1B2C3D4E5F60718, train_size=1437, val_size=360
            ),
        ),
        (
            "job_config",
            JobConfig(
                job_id=0xCAFEF00D,
                seed=0x0123456789ABCDEF,
                numerics="int8",
                estimator="two_sided",
                accumulator="fp16",
                batch_size=64,
                eps=1.0,
            ),
        ),
        (
            "eval_request_range",
            EvalRequest(
                job_id=0xCAFEF00D,
                step=42,
                batch_size=64,
                eps=1.0,
                estimator="two_sided",
                ks=tuple(range(8, 16)),
            ),
        ),
        (
            "eval_request_list",
            EvalRequest(
                job_id=0xCAFEF00D,
                step=42,
                batch_size=32,
                eps=0.001,
                estimator="one_sided",
                ks=(0, 3, 4, 9),
            ),
        ),
        (
            "apply_update_range",
            ApplyUpdate(
                job_id=0xCAFEF00D, step=42, ks=(0, 1, 2, 3), coefficients=(0.5, -0.25, 1e-3, -3.0)
            ),
        ),
        (
            "apply_update_list",
            ApplyUpdate(job_id=0xCAFEF00D, step=42, ks=(2, 7), coefficients=(-0.125, 0.0625)),
        ),
        ("validate_request", ValidateRequest(job_id=0xCAFEF00D, step=50, start=100, count=50)),
        ("ping", Ping(nonce=0xA5A5A5A5)),
        ("reset", Reset(scope="hard")),
    ]


def _bad_messages() -> list[tuple[str, bytes, str]]:
    """(name, bytes, expected ProtocolError kind): every decoder must refuse these."""
    ping = encode(Ping(nonce=1))
    request = encode(
        EvalRequest(job_id=1, step=2, batch_size=4, eps=1.0, estimator="two_sided", ks=(0, 2))
    )
    kset_at = 4 + 4 + 4 + 2 + 4 + 1
    return [
        ("empty", b"", "truncated"),
        ("short_header", b"QS\x01", "truncated"),
        ("bad_magic", b"QX" + ping[2:], "bad_magic"),
        (
            "future_version",
            ping[:2] + bytes([PROTOCOL_VERSION + 1]) + ping[3:],
            "unsupported_version",
        ),
        ("unknown_type", ping[:3] + b"\x30" + ping[4:], "unknown_type"),
        ("truncated_body", ping[:-1], "truncated"),
        ("trailing_byte", ping + b"\x00", "trailing_bytes"),
        ("bad_enum", encode(Reset())[:4] + b"\x09", "invalid_field"),
        ("bad_kset_mode", request[:kset_at] + b"\x07" + request[kset_at + 1 :], "invalid_field"),
        ("kset_not_ascending", request[: kset_at + 3] + b"\x02\x00\x00\x00", "invalid_field"),
        ("zero_keys", request[:kset_at] + b"\x00\x00\x00\x00\x00", "invalid_field"),
        ("nan_eps", request[:14] + struct.pack("<f", float("nan")) + request[18:], "invalid_field"),
        (
            "oversized_chunk",
            encode(LoadModel(total=0, offset=0, crc32=0, chunk=b""))[:16]
            + struct.pack("<H", MAX_CHUNK + 1),
            "invalid_field",
        ),
    ]


def message_vectors() -> Vectors:
    """Encoded messages with their fields, and inputs every decoder must refuse."""
    out: Vectors = {}
    for name, msg in _messages():
        key = f"msg.{name}"
        out[f"{key}.type"] = msg.type
        out[f"{key}.type_code"] = str(TYPE_CODES[type(msg)])
        out[f"{key}.hex"] = encode(msg).hex()
        for field, value in msg:
            if field != "type" and value is not None:
                out[f"{key}.{field}"] = _field_value(type(msg), field, value)
    for name, data, kind in _bad_messages():
        out[f"bad.{name}.hex"] = data.hex()
        out[f"bad.{name}.error"] = kind
    return out


def frame_vectors() -> Vectors:
    """Frames as on the wire, and byte streams with the frames a reader must find."""
    out: Vectors = {}
    cases = [
        ("ack", 41, b"", FLAG_ACK),
        ("syn_ping", 0, encode(Ping(nonce=0x01020304)), FLAG_SYN),
        ("zeros", 0xFFFF, bytes(10), 0),
        ("long_run", 300, bytes(range(1, 256)) * 2, 0),
        ("update_ack", 7, encode(UpdateAck(job_id=1, step=2, checksum=0)), 0),
    ]
    for name, seq, payload, flags in cases:
        out[f"frame.{name}.seq"] = str(seq)
        out[f"frame.{name}.flags"] = str(flags)
        out[f"frame.{name}.payload"] = payload.hex()
        out[f"frame.{name}.wire"] = encode_frame(seq, payload, flags).hex()
    good = encode_frame(5, b"\x00hello\x00", 0)
    corrupt = bytearray(encode_frame(6, b"abc", 0))
    corrupt[3] ^= 0x01
    streams = {
        "garbage_then_frame": b"\x13\x37garbage" + good,
        "cut_then_frame": good[: len(good) // 2] + good,
        "bad_crc_then_frame": bytes(corrupt) + good,
        "two_frames": encode_frame(9, b"\x01", FLAG_SYN) + encode_frame(9, b"", FLAG_ACK),
    }
    for name, wire in streams.items():
        out[f"stream.{name}.wire"] = wire.hex()
        out[f"stream.{name}.frames"] = ",".join(
            _frame_summary(item) for item in FrameReader().feed(wire)
        )
    return out


def _frame_summary(item: Frame | ProtocolError) -> str:
    if isinstance(item, ProtocolError):
        return "error"
    return f"{item.seq}:{item.flags}:{item.payload.hex()}"


def prng_vectors() -> Vectors:
    """Philox4x32-10 outputs, Rademacher sign bits and minibatch indices."""
    out: Vectors = {}
    philox_cases = [
        ((0, 0, 0, 0), (0, 0)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)),
        ((3, 42, 7, 0), (0x89ABCDEF, 0x01234567)),
        ((0, 42, 0, 1), (0x89ABCDEF, 0x01234567)),
    ]
    for i, (counter, key) in enumerate(philox_cases):
        words = philox4x32(np.array([counter], dtype=np.uint32), key)[0]
        out[f"philox.{i}.counter"] = ",".join(f"{w:08x}" for w in counter)
        out[f"philox.{i}.key"] = ",".join(f"{w:08x}" for w in key)
        out[f"philox.{i}.out"] = ",".join(f"{int(w):08x}" for w in words)
    for i, (seed, step, k, size) in enumerate(
        [(0, 0, 0, 128), (0x0123456789ABCDEF, 42, 7, 300), (2**64 - 1, 2**32 - 1, 65535, 33)]
    ):
        bits = rademacher_bits(seed, step, k, size)
        out[f"rademacher.{i}.seed"] = str(seed)
        out[f"rademacher.{i}.step"] = str(step)
        out[f"rademacher.{i}.k"] = str(k)
        out[f"rademacher.{i}.size"] = str(size)
        # Bit i is bit (i mod 8) of byte (i div 8); a set bit means z = -1.
        out[f"rademacher.{i}.bits"] = np.packbits(bits, bitorder="little").tobytes().hex()
    for i, (seed, step, batch, n) in enumerate(
        [(0, 0, 8, 1437), (0x0123456789ABCDEF, 42, 13, 27000)]
    ):
        out[f"batch.{i}.seed"] = str(seed)
        out[f"batch.{i}.step"] = str(step)
        out[f"batch.{i}.batch_size"] = str(batch)
        out[f"batch.{i}.dataset_size"] = str(n)
        out[f"batch.{i}.indices"] = ",".join(
            str(int(j)) for j in batch_indices(seed, step, batch, n)
        )
    return out


def _pairs_fields(
    key: str, seed: int, step: int, pairs: list[tuple[int, float]], out: Vectors
) -> None:
    out[f"{key}.seed"] = str(seed)
    out[f"{key}.step"] = str(step)
    out[f"{key}.ks"] = ",".join(str(k) for k, _ in pairs)
    out[f"{key}.cs"] = np.array([c for _, c in pairs], dtype="<f4").tobytes().hex()


def update_vectors() -> Vectors:
    """FP32 and INT8 + FP16 updates: inputs, pairs, outputs as little-endian hex bytes."""
    out: Vectors = {}
    rng = np.random.Generator(np.random.Philox(12345))
    fp32_cases = [
        (1, 3, [(0, 0.125), (1, -0.3), (5, 1e-3)], 40),
        (0x0123456789ABCDEF, 42, [(2, 1e-7), (3, -2.5e-8), (9, 3.0)], 257),
    ]
    for i, (seed, step, pairs, size) in enumerate(fp32_cases):
        key = f"fp32.{i}"
        theta = rng.standard_normal(size).astype("<f4")
        result = apply_fp32(theta, seed, step, pairs)
        _pairs_fields(key, seed, step, pairs, out)
        out[f"{key}.theta"] = theta.tobytes().hex()
        out[f"{key}.expected"] = result.astype("<f4").tobytes().hex()
        out[f"{key}.checksum"] = str(zlib.crc32(result.astype("<f4").tobytes()))
    int8_cases = [
        (1, 1, [(0, 0.5), (1, 0.75), (4, -0.3)], 64, 2.0),
        (7, 9, [(0, 40.0), (3, 80.0)], 130, 1.0),  # saturation of weights at +-127
        (7, 10, [(1, 70000.0)], 16, 0.0),  # saturation of the FP16 buffer at +-65504
    ]
    for i, (seed, step, pairs, size, spread) in enumerate(int8_cases):
        key = f"int8_fp16.{i}"
        weights = rng.integers(-127, 128, size).astype(np.int8)
        buffer = (rng.uniform(-1, 1, size) * spread).astype("<f2")
        new_w, new_b = apply_int8_fp16(weights, buffer, seed, step, pairs)
        _pairs_fields(key, seed, step, pairs, out)
        out[f"{key}.weights"] = weights.tobytes().hex()
        out[f"{key}.buffer"] = buffer.tobytes().hex()
        out[f"{key}.expected_weights"] = new_w.tobytes().hex()
        out[f"{key}.expected_buffer"] = new_b.astype("<f2").tobytes().hex()
        out[f"{key}.checksum"] = str(zlib.crc32(new_w.tobytes() + new_b.astype("<f2").tobytes()))
    return out


SETS: Final[dict[str, tuple[str, Callable[[], Vectors]]]] = {
    "messages": ("binary data-plane messages (SPEC section 6)", message_vectors),
    "frames": ("serial frames (SPEC section 7)", frame_vectors),
    "prng": ("Philox4x32-10, Rademacher bits, minibatch indices (SPEC section 1)", prng_vectors),
    "update": ("update arithmetic and checksums (SPEC sections 4, 5)", update_vectors),
}


def vector_sets() -> dict[str, Vectors]:
    """Every vector set, freshly computed."""
    return {name: make() for name, (_, make) in SETS.items()}


def render_txt(name: str, vectors: Vectors) -> str:
    """The line format: a comment header, then ``key value`` lines."""
    title = SETS[name][0]
    lines = [f"# qsched test vectors: {title}.", "# Format: protocol/SPEC.md section 11."]
    lines += [f"{key} {value}" for key, value in vectors.items()]
    return "\n".join(lines) + "\n"


def render_json(vectors: Vectors) -> str:
    """The JSON format: one flat object of strings, keys in generation order."""
    return json.dumps(vectors, indent=1) + "\n"


def _rendered() -> Iterable[tuple[Path, str]]:
    for name, vectors in vector_sets().items():
        yield VECTOR_DIR / f"{name}.txt", render_txt(name, vectors)
        yield VECTOR_DIR / f"{name}.json", render_json(vectors)


def main(argv: list[str] | None = None) -> int:
    """Write the vector files, or with ``--check`` report stale ones (exit status 1)."""
    parser = argparse.ArgumentParser(prog="python -m qsched.lab.make_vectors")
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for path, text in _rendered():
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if stale:
        print("stale vector files: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
