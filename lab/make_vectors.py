"""Generate the test vectors in ``protocol/vectors/`` that Python and C tests consume.

    python -m qsched.lab.make_vectors            # rewrite the files
    python -m qsched.lab.make_vectors --check    # exit 1 if any file is stale

Each set of ``SETS`` is written twice from one ordered mapping of key -> value:
``<set>.txt`` with one ``key value`` per line (the value is the rest of the line;
``#`` starts a comment line) for a small C reader, and ``<set>.json``, one flat JSON
object of strings. The sets of ``JSON_SETS`` (``numeric``, ``wire``) are written as
``<set>.json`` only: the C test runner reads every ``.txt`` file of the folder and these
groups are not its own. Value conventions: integers in decimal; floats as the hex of
their IEEE bits with a ``0x`` prefix (8 digits float32, 16 digits float64); byte
strings as lowercase hex; lists comma-separated; names as plain text
(``protocol/SPEC.md`` section 11).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt
from cobs import cobs

import qsched.protocol as protocol_package
from qsched.daemon.planner import batch_slices
from qsched.policies import PolicyContext, QSchedulerConfig, QSchedulerPolicy
from qsched.protocol.codec import decode, encode
from qsched.protocol.errors import ProtocolError
from qsched.protocol.framing import (
    FLAG_ACK,
    FLAG_MORE,
    FLAG_SYN,
    MAX_ENCODED_FRAME,
    Frame,
    FrameReader,
    delivered_messages,
    encode_frame,
    segments,
)
from qsched.protocol.identity import model_hash64
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.messages import (
    MAX_CHUNK,
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    TYPE_CODES,
    ApplyUpdate,
    DataMessage,
    Error,
    EvalRequest,
    EvalResult,
    EvalSliceRequest,
    EvalSliceResult,
    Heartbeat,
    Hello,
    JobConfig,
    Loaded,
    LoadModel,
    Ping,
    Reset,
    SelectDataset,
    SetWeights,
    Shard,
    StepOrder,
    UpdateAck,
    ValidateRequest,
    ValidateResult,
    job_id_of,
)
from qsched.zo import accum_int8
from qsched.zo.blob import encode_blob, trainable_layers
from qsched.zo.graph import Dense, Model, MulConstant, QuantizedLayer, QuantModel, TensorQuant
from qsched.zo.intloss import batch_loss_q16, exp_table, loss_q16, q16_to_float, scale_q24
from qsched.zo.lookup import hard_swish_table, logistic_table, mul_constant_table
from qsched.zo.prng import batch_indices, philox4x32, rademacher_bits
from qsched.zo.recalibrate import RECAL_EXP_MAX, ChannelLayout, effective_bias, recalibrate
from qsched.zo.spsa import Estimator, LossPairs, coefficients
from qsched.zo.step import step_lr
from qsched.zo.update import (
    accumulate_delta,
    apply_fp32,
    apply_int8_fp16,
    channel_gains,
    element_channels,
    perturb_fp32,
    perturb_int8,
    to_fp16_saturating,
)
from qsched.zo.workload import TrainState

__all__ = [
    "JSON_SETS",
    "SETS",
    "VECTOR_DIR",
    "json_vector_sets",
    "main",
    "numeric_vectors",
    "render_json",
    "render_txt",
    "vector_sets",
    "wire_vectors",
]

# The vectors ship with the protocol package, beside SPEC.md, for every implementation.
VECTOR_DIR: Final = Path(protocol_package.__file__).with_name("vectors")
Vectors = dict[str, str]


def _f32_bits(value: float) -> str:
    return "0x" + struct.pack(">f", value).hex()


def _f64_bits(value: float) -> str:
    return "0x" + struct.pack(">d", value).hex()


def _field_value(cls: type, name: str, value: Any) -> str:
    if (cls, name) == (StepOrder, "shards"):  # board:k k k;board:  (no keys: the update alone)
        # board:k k k, board@start+count:k k (a batch slice), board: (the update alone)
        return ";".join(
            s.board_id
            + (f"@{s.slice_start}+{s.slice_count}" if s.slice_count else "")
            + ":"
            + " ".join(map(str, s.ks))
            for s in value
        )
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
                lr_unit="weight",
                recalibrate_every=100,
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
        (
            "step_order",
            StepOrder(
                job_id=0xCAFEF00D,
                step=42,
                ks=(0, 1, 2, 3, 4),
                coefficients=(0.5, -0.25, 1e-3, -3.0, 0.0625),
                batch_size=4,
                eps=1.0,
                estimator="two_sided",
                shards=(
                    Shard(board_id="n6-01", ks=(0, 1, 2)),
                    Shard(board_id="n6-02", ks=(2, 3, 4)),
                    Shard(board_id="n6-03", ks=(1, 4)),
                    Shard(board_id="n6-04"),
                    Shard(board_id="n6-05", ks=(0, 1), slice_start=2, slice_count=2),
                ),
            ),
        ),
        (
            "eval_slice_request",
            EvalSliceRequest(
                job_id=0xCAFEF00D,
                step=43,
                batch_size=8,
                eps=1.0,
                estimator="two_sided",
                slice_start=3,
                slice_count=5,
                ks=(4, 5, 9),
            ),
        ),
        (
            "eval_slice_result_two_sided",
            EvalSliceResult(
                job_id=0xCAFEF00D,
                step=43,
                compute_us=1500,
                estimator="two_sided",
                slice_start=3,
                slice_count=5,
                ks=(4, 5, 9),
                sum_plus=(754510, 2**33 + 5, 0),
                sum_minus=(750000, 1, 2**40),
            ),
        ),
        (
            "eval_slice_result_one_sided",
            EvalSliceResult(
                job_id=0xCAFEF00D,
                step=43,
                compute_us=900,
                estimator="one_sided",
                slice_start=0,
                slice_count=2,
                ks=(7, 8),
                sum_plus=(131072, 131073),
                sum_zero=140000,
            ),
        ),
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
        ("more", 8, bytes(range(1, 33)), FLAG_MORE),
        ("syn_more", 65535, b"\x00QS", FLAG_SYN | FLAG_MORE),
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
        "segments": _segmented_stream(),
    }
    for name, wire in streams.items():
        items = FrameReader().feed(wire)
        out[f"stream.{name}.wire"] = wire.hex()
        out[f"stream.{name}.frames"] = ",".join(_frame_summary(item) for item in items)
        out[f"stream.{name}.messages"] = ",".join(m.hex() for m in delivered_messages(items))
    return out


def _segmented_stream() -> bytes:
    """A message in 32-byte segments across the seq wrap, one resent (its ACK was lost),
    then a message cut off by a SYN (its sender gave up) and the one sent after it."""
    message = encode(Ping(nonce=7)) + bytes(range(80))
    pieces = segments(message, 32)
    wires = [
        encode_frame((65534 + i) & 0xFFFF, p, FLAG_MORE if i < len(pieces) - 1 else 0)
        for i, p in enumerate(pieces)
    ]
    given_up = encode_frame(2, b"lost", FLAG_MORE)
    after = encode_frame(9, b"fresh", FLAG_SYN)
    return wires[0] + wires[1] + wires[1] + b"".join(wires[2:]) + given_up + after


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
        weights = rng.integers(-127, 128, size).astype(np.int8)
        buffer = (rng.uniform(-1, 1, size) * spread).astype("<f2")
        _int8_fp16_fields(f"int8_fp16.{i}", seed, step, pairs, weights, buffer, out)
    _discriminating_updates(out)
    return out


def _int8_fp16_fields(
    key: str,
    seed: int,
    step: int,
    pairs: list[tuple[int, float]],
    weights: npt.NDArray[np.int8],
    buffer: npt.NDArray[np.float16],
    out: Vectors,
) -> None:
    new_w, new_b = apply_int8_fp16(weights, buffer, seed, step, pairs)
    _pairs_fields(key, seed, step, pairs, out)
    out[f"{key}.weights"] = weights.tobytes().hex()
    out[f"{key}.buffer"] = buffer.astype("<f2").tobytes().hex()
    out[f"{key}.expected_weights"] = new_w.tobytes().hex()
    out[f"{key}.expected_buffer"] = new_b.astype("<f2").tobytes().hex()
    out[f"{key}.checksum"] = str(zlib.crc32(new_w.tobytes() + new_b.astype("<f2").tobytes()))


# Pairs whose float32 sum in ascending k differs from a float64 sum and from a descending
# sum: 1 + 2^-11 absorbs each 2^-24 (a tie, to even) one at a time, but not their sum.
# 1 + 2^-11 is also a binary16 tie, so the FP16 rounding shows the difference.
TIE_PAIRS: Final = [(0, 1.0 + 2.0**-11), (1, 2.0**-24), (2, 2.0**-24)]
# Pairs of ordinary size: adding them to theta (or to the binary16 buffer) one by one, or
# rounding the delta to binary16 before adding it, gives other bits than SPEC 4.2.
SPREAD_PAIRS: Final = [
    (0, 0.30078125 + 2.0**-13),
    (2, -0.7109375 - 2.0**-15),
    (3, 0.0009765625 + 2.0**-17),
    (7, 1.3330078125 + 2.0**-12),
    (9, -0.0625 - 2.0**-16),
]


def _discriminating_updates(out: Vectors) -> None:
    """Cases fp32.2-3 and int8_fp16.3-4: inputs where a wrong method gives other bits.

    fp32.2 and int8_fp16.3 (TIE_PAIRS) tell the float32 sum in ascending k from a float64
    sum and from a descending sum; fp32.3 (SPREAD_PAIRS) tells summing delta first from
    adding each pair to theta; int8_fp16.3 and .4 tell the one binary16 rounding from
    rounding delta to binary16 first, and int8_fp16.4 also from adding each pair to the
    binary16 buffer. tests/test_protocol_spec_vectors.py checks each of these claims.
    """
    rng = np.random.Generator(np.random.Philox(2025))
    theta = (rng.integers(-64, 64, 32) * 2.0**-8).astype("<f4")
    theta[::4] = 0.0
    for key, seed, step, pairs, start in [
        ("fp32.2", 5, 3, TIE_PAIRS, theta),
        ("fp32.3", 11, 17, SPREAD_PAIRS, rng.standard_normal(32).astype("<f4")),
    ]:
        result = apply_fp32(start, seed, step, pairs)
        _pairs_fields(key, seed, step, pairs, out)
        out[f"{key}.theta"] = start.tobytes().hex()
        out[f"{key}.expected"] = result.astype("<f4").tobytes().hex()
        out[f"{key}.checksum"] = str(zlib.crc32(result.astype("<f4").tobytes()))
    for i, (seed, step, pairs) in enumerate([(5, 3, TIE_PAIRS), (11, 17, SPREAD_PAIRS)]):
        weights = rng.integers(-128, 128, 32).astype(np.int8)
        weights[:4] = (-128, -127, 127, 0)  # -128 becomes -127 even when m = 0
        buffer = (rng.integers(-1024, 1024, 32) * 2.0**-10).astype("<f2")
        buffer[::4] = 0.0
        _int8_fp16_fields(f"int8_fp16.{3 + i}", seed, step, pairs, weights, buffer, out)


# --------------------------------------------------------------------------- numeric.json


def _f32_list(values: Iterable[float]) -> str:
    return ",".join(_f32_bits(float(v)) for v in values)


def _bits_hex(negative: npt.NDArray[np.bool_]) -> str:
    return np.packbits(negative, bitorder="little").tobytes().hex()


def _perturbation_vectors(out: Vectors) -> None:
    """z_k and the perturbed weights, INT8 (saturating) and FP32 (float32 eps)."""
    rng = np.random.Generator(np.random.Philox(31))
    int8_cases = [
        (0, 0, 0, 1, 40),
        (0x0123456789ABCDEF, 42, 7, 5, 300),
        (2**64 - 1, 9, 65535, 127, 8),
    ]
    for i, (seed, step, k, eps, size) in enumerate(int8_cases):
        key = f"perturb_int8.{i}"
        weights = rng.integers(-128, 128, size).astype(np.int8)
        weights[:6] = (-128, -127, -126, 125, 126, 127)
        out[f"{key}.seed"] = str(seed)
        out[f"{key}.step"] = str(step)
        out[f"{key}.k"] = str(k)
        out[f"{key}.eps"] = str(eps)
        out[f"{key}.weights"] = weights.tobytes().hex()
        out[f"{key}.bits"] = _bits_hex(rademacher_bits(seed, step, k, size))
        out[f"{key}.plus"] = perturb_int8(weights, seed, step, k, eps, 1).tobytes().hex()
        out[f"{key}.minus"] = perturb_int8(weights, seed, step, k, eps, -1).tobytes().hex()
    for i, (seed, step, k, spec_eps) in enumerate(
        [(3, 1, 2, 0.001), (0x0123456789ABCDEF, 42, 9, 0.02)]
    ):
        key = f"perturb_fp32.{i}"
        theta = (rng.standard_normal(48) * 2.0 ** rng.integers(-20, 10, 48)).astype("<f4")
        plus = perturb_fp32(theta, seed, step, k, spec_eps, 1)
        # float32(eps) is what the wire carries; theta + eps in float64 gives other bits here.
        exact = (theta.astype(np.float64) + spec_eps).astype(np.float32)
        negative = rademacher_bits(seed, step, k, theta.size)
        assert not np.array_equal(plus[~negative], exact[~negative]), key
        out[f"{key}.seed"] = str(seed)
        out[f"{key}.step"] = str(step)
        out[f"{key}.k"] = str(k)
        out[f"{key}.eps"] = _f32_bits(spec_eps)
        out[f"{key}.spec_eps"] = _f64_bits(spec_eps)
        out[f"{key}.theta"] = theta.tobytes().hex()
        out[f"{key}.bits"] = _bits_hex(negative)
        out[f"{key}.plus"] = plus.astype("<f4").tobytes().hex()
        out[f"{key}.minus"] = (
            perturb_fp32(theta, seed, step, k, spec_eps, -1).astype("<f4").tobytes().hex()
        )


def _acc8_vectors(out: Vectors) -> None:
    """The INT8 buffer: plain steps, a refining and a coarsening rescale, ties, the clamp."""
    rng = np.random.Generator(np.random.Philox(47))
    sizes = [40, 24]
    n = sum(sizes)
    tiny = [(0, 0.004), (1, -0.002), (2, 0.001)]
    cases: list[tuple[str, int, int, list[tuple[int, float]], list[int], npt.NDArray[np.int64]]] = [
        (
            "plain",
            3,
            2,
            [(0, 0.4), (1, -0.25), (4, 0.0625 + 2.0**-20)],
            [7, 9],
            rng.integers(-100, 101, n),
        ),
        ("initial_refine", 9, 15, tiny, [7, 7], np.zeros(n, np.int64)),
        ("coarsen", 21, 31, [(0, 3.0), (1, 2.5)], [10, 7], rng.integers(-127, 128, n)),
        # 2^-8 * 2^7 = 0.5 and 3 * 2^-8 * 2^7 = 1.5: ties, to even; 1e6: the 2^24 clamp.
        (
            "ties_clamp",
            2,
            4,
            [(0, 2.0**-8), (1, 3 * 2.0**-8), (5, 1e6)],
            [7, 8],
            rng.integers(-5, 6, n),
        ),
    ]
    for name, seed, step, pairs, shifts, buffer in cases:
        key = f"acc8.{name}"
        weights = rng.integers(-127, 128, n).astype(np.int8)
        state = np.concatenate([np.asarray(buffer, np.int64), shifts]).astype(np.int8)
        new_w, new_state = accum_int8.apply(weights, state, sizes, seed, step, pairs)
        if name in ("initial_refine", "coarsen"):
            assert not np.array_equal(new_state[n:], state[n:]), key  # a rescale happened
        _pairs_fields(key, seed, step, pairs, out)
        out[f"{key}.tensor_sizes"] = ",".join(map(str, sizes))
        out[f"{key}.weights"] = weights.tobytes().hex()
        out[f"{key}.state"] = state.tobytes().hex()
        out[f"{key}.expected_weights"] = new_w.tobytes().hex()
        out[f"{key}.expected_state"] = new_state.tobytes().hex()
        out[f"{key}.checksum"] = str(zlib.crc32(new_w.tobytes() + new_state.tobytes()))


def _fp16_signed_zero_vectors(out: Vectors) -> None:
    """An FP16 update whose sum rounds to -0.0 in binary16: the remainder is +0.0."""
    seed, step = 1, 0
    pairs = [(0, -1e-10), (1, 2.0**-26)]
    weights = np.array([0, 5, -5, 127, -128, 0, 1, -1], dtype=np.int8)
    buffer = np.array([0.0, -0.0, 0.0, 0.5, -0.5, 0.0, 2.0**-24, -0.0], dtype="<f2")
    summed = to_fp16_saturating(
        buffer.astype(np.float32) + accumulate_delta(seed, step, pairs, weights.size)
    )
    assert np.signbit(summed[summed == 0]).any()  # some b are -0.0
    _, new_b = apply_int8_fp16(weights, buffer, seed, step, pairs)
    assert not np.signbit(new_b[new_b == 0]).any()  # every zero remainder is +0.0
    _int8_fp16_fields("int8_fp16_zero.0", seed, step, pairs, weights, buffer, out)


# (channel-minor layout, per-channel float32 scales, pairs): a zero scale (gain 0), a
# tiny one (gain FLT_MAX, a saturated buffer) and ordinary ones.
GAIN_CASES: Final = (
    (False, (0.0125, 0.5, 0.0), [(0, 0.004), (2, -0.0015), (3, 0.0002)]),
    (True, (0.02, 1e-30, 0.003, 0.25), [(1, 2e-4), (4, -7e-5)]),
)


def _gain_vectors(out: Vectors) -> None:
    """INT8 + FP16 updates of one tensor with a weight-unit learning rate (SPEC 4.2)."""
    rng = np.random.Generator(np.random.Philox(83))
    for i, (minor, scales, pairs) in enumerate(GAIN_CASES):
        count = 4 * len(scales)
        weights = rng.integers(-127, 128, count).astype(np.int8)
        buffer = rng.uniform(-0.5, 0.5, count).astype("<f2")
        channel = element_channels([(count, len(scales), minor)])
        gain = channel_gains(np.asarray(scales, dtype=np.float32))[channel]
        seed, step = 11 + i, 5
        new_w, new_b = apply_int8_fp16(weights, buffer, seed, step, pairs, gain)
        key = f"gain.{i}"
        _pairs_fields(key, seed, step, pairs, out)
        out[f"{key}.channel_minor"] = str(int(minor))
        out[f"{key}.scales"] = np.asarray(scales, dtype="<f4").tobytes().hex()
        out[f"{key}.gains"] = (
            channel_gains(np.asarray(scales, dtype=np.float32)).astype("<f4").tobytes().hex()
        )
        out[f"{key}.weights"] = weights.tobytes().hex()
        out[f"{key}.buffer"] = buffer.tobytes().hex()
        out[f"{key}.expected_weights"] = new_w.tobytes().hex()
        out[f"{key}.expected_buffer"] = new_b.astype("<f2").tobytes().hex()


# (channel_minor, multipliers, shifts, exponents): saturated and free channels; a zero
# multiplier, a shift of 29 (limit 1) and an exponent at RECAL_EXP_MAX, which never grow.
RECAL_CASES: Final = (
    (False, [1 << 30] * 4, [-9, -9, -9, -9], [0, 0, 1, 0]),
    (True, [1 << 30] * 3, [-6, -7, -8], [0, 2, 0]),
    (False, [0, 1518500250, 1518500250, 1 << 30], [-3, 29, 29, -20], [0, 0, 1, RECAL_EXP_MAX]),
)
# (bias, exponent) pairs of the derived bias: halves round away from zero.
RECAL_BIASES: Final = (
    (3, 1),
    (-3, 1),
    (5, 2),
    (6, 2),
    (-6, 2),
    (7, 0),
    (-(2**31), 8),
    (2**31 - 1, 8),
)


def _recal_vectors(out: Vectors) -> None:
    """Scale recalibration of one tensor (SPEC "Scale recalibration"), and derived biases."""
    rng = np.random.Generator(np.random.Philox(97))
    for i, (minor, multipliers, shifts, exps) in enumerate(RECAL_CASES):
        channels, per_channel = len(exps), 5
        count = channels * per_channel
        layout = ChannelLayout.of(
            [(count, channels, minor)], np.array(multipliers), np.array(shifts)
        )
        weights = rng.integers(-126, 127, count).astype(np.int8)
        # Even channels (case 2: every channel) get one weight on the clamp, -127 when
        # c mod 3 == 1, else +127; the others stay inside it.
        for c in range(channels):
            if c % 2 == 0 or i == 2:
                members = np.flatnonzero(layout.element_channel == c)
                weights[members[c % per_channel]] = -127 if c % 3 == 1 else 127
        buffer = rng.uniform(-0.999, 0.999, count).astype("<f2")
        buffer[:2] = (0.99951171875, -0.99951171875)  # 0.5 b + 0.5 rounds in binary16
        start = np.array(exps, np.int8)
        new_w, new_b, new_e = recalibrate(weights, buffer, start, layout)
        key = f"recal.{i}"
        out[f"{key}.channels"] = str(channels)
        out[f"{key}.channel_minor"] = str(int(minor))
        out[f"{key}.multipliers"] = ",".join(map(str, multipliers))
        out[f"{key}.shifts"] = ",".join(map(str, shifts))
        out[f"{key}.weights"] = weights.tobytes().hex()
        out[f"{key}.buffer"] = buffer.tobytes().hex()
        out[f"{key}.exps"] = start.tobytes().hex()
        out[f"{key}.expected_weights"] = new_w.tobytes().hex()
        out[f"{key}.expected_buffer"] = new_b.astype("<f2").tobytes().hex()
        out[f"{key}.expected_exps"] = new_e.tobytes().hex()
    for i, (bias, exp) in enumerate(RECAL_BIASES):
        out[f"recal_bias.{i}.bias"] = str(bias)
        out[f"recal_bias.{i}.exp"] = str(exp)
        out[f"recal_bias.{i}.expected"] = str(int(effective_bias([bias], [exp])[0]))


# The coefficient vectors need a policy only for its learning-rate factor, which the
# job's length does not enter.
_VECTOR_CONTEXT: Final = PolicyContext(total_steps=1, steps_per_epoch=1.0, eval_every=1)


# A coefficient case's learning-rate decay: lr_decay, lr_decay_start, lr_end, the step
# and the job's steps.
_Decay = tuple[str, float, float, int, int]
_NO_DECAY: Final[_Decay] = ("none", 0.0, 0.0, 0, 1)
# From step 0: to 0.1 at step 37 of 100, and to 0 at the last step of 24,000.
_FROM_START_10: Final[_Decay] = ("linear", 0.0, 0.1, 37, 100)
_FROM_START_LAST: Final[_Decay] = ("linear", 0.0, 0.0, 23999, 24000)


def _late_decay(step: int) -> _Decay:
    """The decay over the last quarter of 24,000 steps, to 0, at ``step``."""
    return ("linear", 0.75, 0.0, step, 24000)


class _CoefCase(NamedTuple):
    """One coefficient vector: the job's numbers, and the policy's factor on its rate."""

    name: str
    numerics: str
    estimator: Estimator
    lr: float
    eps: float
    q: int
    lr_full_q: int = 0
    halvings: int = 0
    decay: _Decay = _NO_DECAY


# Appended cases only: each draws its losses from one generator, in this order.
_COEF_CASES: Final = (
    _CoefCase("int8_two_sided", "int8", "two_sided", 3000.0, 1.0, 4),
    _CoefCase("int8_one_sided", "int8", "one_sided", 3000.0, 2.0, 3),
    _CoefCase("fp32_two_sided", "fp32", "two_sided", 0.02, 0.001, 8),
    _CoefCase("fp32_one_sided", "fp32", "one_sided", 0.05, 0.003, 6),
    _CoefCase("fp32_lr_follows_q", "fp32", "two_sided", 0.01, 0.001, 5, lr_full_q=8),
    _CoefCase("fp32_lr_decay", "fp32", "two_sided", 0.02, 0.001, 4, 8, decay=_FROM_START_10),
    _CoefCase("int8_lr_decay", "int8", "two_sided", 0.05, 1.0, 3, decay=_FROM_START_LAST),
    _CoefCase("fp32_late_decay", "fp32", "two_sided", 0.02, 0.001, 5, decay=_late_decay(19337)),
    _CoefCase("fp32_before_decay", "fp32", "two_sided", 0.02, 0.001, 5, decay=_late_decay(18000)),
    _CoefCase("fp32_lr_halved", "fp32", "two_sided", 0.02, 0.001, 32, 32, halvings=3),
    _CoefCase(
        "fp32_lr_halved_late_decay", "fp32", "two_sided", 0.03, 0.001, 6, 8, 2, _late_decay(21001)
    ),
    _CoefCase("int8_lr_halved", "int8", "two_sided", 0.05, 1.0, 4, halvings=5),
)


def _coefficient_vectors(out: Vectors) -> None:
    """c_k from loss pairs: INT8 and FP32 (float64 eps of the spec), two- and one-sided,
    with the learning rate following q (qscheduler's ``lr_full_q``, 0 when off), halved
    at the top of its ladder (``lr_halvings`` so far) and with the job's linear decay."""
    rng = np.random.Generator(np.random.Philox(59))
    for name, numerics, estimator, lr, eps, q, lr_full_q, halvings, decay in _COEF_CASES:
        key = f"coef.{name}"
        if numerics == "int8":
            # Q16 losses, as INT8 boards report them.
            plus = rng.integers(60000, 200000, q) / 65536.0
            minus = rng.integers(60000, 200000, q) / 65536.0
        else:
            plus = (2.3 + rng.standard_normal(q) * 1e-3).astype(np.float32).astype(np.float64)
            minus = (2.3 + rng.standard_normal(q) * 1e-3).astype(np.float32).astype(np.float64)
        base = float(minus[0])
        ks = list(range(q))
        losses = (
            LossPairs(
                plus=dict(zip(ks, plus, strict=True)), minus=dict(zip(ks, minus, strict=True))
            )
            if estimator == "two_sided"
            else LossPairs(plus=dict(zip(ks, plus, strict=True)), minus={}, base=base)
        )
        policy = _halved_policy(lr_full_q, halvings)
        lr_decay, lr_decay_start, lr_end, step, steps = decay
        spec = JobSpec.model_validate(
            {
                "numerics": numerics,
                "lr": lr,
                "eps": eps,
                "lr_decay": lr_decay,
                "lr_decay_start": lr_decay_start,
                "lr_end": lr_end,
                "steps": steps,
            }
        )
        lr_t = step_lr(spec, step, policy.lr_scale(q))
        pairs = coefficients(losses, lr_t, eps, q, estimator)
        if numerics == "fp32":
            wire = coefficients(losses, lr_t, float(np.float32(eps)), q, estimator)
            assert pairs != wire, key  # the float32 eps of the wire gives other bits
        out[f"{key}.numerics"] = numerics
        out[f"{key}.estimator"] = estimator
        out[f"{key}.lr"] = _f64_bits(lr)
        out[f"{key}.eps"] = _f64_bits(eps)
        out[f"{key}.wire_eps"] = _f32_bits(eps)
        out[f"{key}.q"] = str(q)
        out[f"{key}.lr_full_q"] = str(lr_full_q)
        out[f"{key}.lr_halvings"] = str(halvings)
        out[f"{key}.lr_decay"] = lr_decay
        out[f"{key}.lr_decay_start"] = _f64_bits(lr_decay_start)
        out[f"{key}.lr_end"] = _f64_bits(lr_end)
        out[f"{key}.step"] = str(step)
        out[f"{key}.steps"] = str(steps)
        out[f"{key}.ks"] = ",".join(map(str, ks))
        out[f"{key}.loss_plus"] = _f32_list(plus)
        if estimator == "two_sided":
            out[f"{key}.loss_minus"] = _f32_list(minus)
        else:
            out[f"{key}.loss_zero"] = _f32_bits(base)
        out[f"{key}.cs"] = _f32_list(c for _, c in pairs)


def _halved_policy(lr_full_q: int, halvings: int) -> QSchedulerPolicy:
    """A qscheduler whose state has halved its learning rate ``halvings`` times."""
    config = QSchedulerConfig(lr_full_q=lr_full_q, lr_halvings=halvings)
    policy = QSchedulerPolicy(config, _VECTOR_CONTEXT)
    state = policy.state_dict()
    state["lr_halvings"] = halvings
    policy.load_state_dict(state)
    return policy


def blob_models() -> dict[str, tuple[QuantModel | Model, list[str]]]:
    """The two small models of the blob vectors and their trainable layers."""
    w1 = np.array([[12, -7, 127, 0], [-127, 33, 5, -64], [90, 1, -2, 45]], dtype=np.int8)
    w2 = np.array([[100, -50, 7], [-3, 127, -127]], dtype=np.int8)
    s1 = np.array([0.0078125, 0.01171875, 0.00390625], dtype=np.float32)
    s2 = np.array([0.015625, 0.0234375], dtype=np.float32)
    b1 = np.array([40, -12, 7], dtype=np.int32)
    b2 = np.array([-300, 55], dtype=np.int32)
    in_scale = 0.03125
    f1 = (w1 * s1[:, None]).astype(np.float32)
    f2 = (w2 * s2[:, None]).astype(np.float32)
    fb1 = (b1 * in_scale * s1).astype(np.float32)
    fb2 = (b2 * 0.0625 * s2).astype(np.float32)
    model = Model(
        "tiny",
        "input",
        (4,),
        [
            Dense("fc1", ["input"], "fc1", f1, fb1, "relu"),
            Dense("fc2", ["fc1"], "fc2", f2, fb2),
        ],
        "fc2",
        2,
    )
    qmodel = QuantModel(
        model=model,
        tensors={
            "input": TensorQuant(in_scale, -3),
            "fc1": TensorQuant(0.0625, -128),
            "fc2": TensorQuant(0.0859375, 5),
        },
        layers={
            "fc1": QuantizedLayer(weight=w1, weight_scales=s1, bias=b1),
            "fc2": QuantizedLayer(weight=w2, weight_scales=s2, bias=b2),
        },
    )
    return {"int8": (qmodel, ["fc2"]), "fp32": (model, ["fc1", "fc2"])}


def _blob_vectors(out: Vectors) -> None:
    """Two small model blobs: bytes, identities, header fields, flat vector, initial state."""
    for name, (obj, trainable) in blob_models().items():
        key = f"blob.{name}"
        blob = encode_blob(obj, trainable=trainable)
        header = struct.unpack_from("<4sHBBHHHHIIIIII", blob)
        out[f"{key}.hex"] = blob.hex()
        out[f"{key}.size"] = str(len(blob))
        out[f"{key}.sha256"] = hashlib.sha256(blob).hexdigest()
        out[f"{key}.model_hash"] = str(model_hash64(blob))
        out[f"{key}.crc32"] = str(zlib.crc32(blob))
        fields = ("numerics", "flags", "tensors", "ops", "input", "output", "classes")
        for field, value in zip(fields, header[2:9], strict=True):
            out[f"{key}.{field}"] = str(value)
        out[f"{key}.params"] = str(header[9])
        out[f"{key}.data_size"] = str(header[10])
        out[f"{key}.body_crc32"] = str(header[11])
        out[f"{key}.scale"] = f"0x{header[12]:08x}"
        out[f"{key}.scale_q24"] = str(header[13])
        out[f"{key}.trainable"] = ",".join(trainable_layers(blob))
        if isinstance(obj, QuantModel):
            scale = obj.tensors[obj.model.output_name].scale
            out[f"{key}.exp_table"] = ",".join(f"{int(e):x}" for e in exp_table(scale))
            flat = np.concatenate([obj.layers[t].weight.ravel() for t in trainable]).astype(np.int8)
            sizes = [obj.layers[t].weight.size for t in trainable]
            fp16 = TrainState(0, flat, np.zeros(flat.size, dtype=np.float16))
            acc8 = TrainState(0, flat, accum_int8.initial_state(sizes))
            out[f"{key}.initial_fp16"] = fp16.weight_bytes().hex()
            out[f"{key}.initial_fp16_checksum"] = str(fp16.checksum())
            out[f"{key}.initial_int8"] = acc8.weight_bytes().hex()
            out[f"{key}.initial_int8_checksum"] = str(acc8.checksum())
        else:
            parts = []
            for layer in trainable:
                node = obj.node(layer)
                assert isinstance(node, Dense)
                parts += [node.weight.ravel(), node.bias.ravel()]
            fp32 = TrainState(0, np.concatenate(parts).astype(np.float32), None)
            out[f"{key}.initial_fp32"] = fp32.weight_bytes().hex()
            out[f"{key}.initial_fp32_checksum"] = str(fp32.checksum())


def _slice_sums(losses: list[int]) -> str:
    """The case split in (at most) three slices as the daemon plans them (SPEC 6.10):
    ``start+count=sum`` of each; the sums add up to the whole batch's sum."""
    parts = []
    for start, count in batch_slices(len(losses), min(3, len(losses))):
        parts.append(f"{start}+{count}={sum(int(v) for v in losses[start : start + count])}")
    return ",".join(parts)


def _batch_loss_vectors(out: Vectors) -> None:
    """Per-sample Q16 losses to the batch loss and the float32 a message carries."""
    rng = np.random.Generator(np.random.Philox(71))
    cases = [
        [65536, 65537],
        [150902, 0, 1, 2, 3],
        [7],
        list(rng.integers(0, 400000, 64)),
        # Losses of 256 and more: the float32 on the wire is rounded (nearest even).
        [2**28 + 3, 2**28 + 6, 2**28 + 1],
    ]
    for i, losses in enumerate(cases):
        key = f"batch_loss.{i}"
        batch = int(batch_loss_q16(np.asarray(losses, dtype=np.int32)))
        out[f"{key}.losses"] = ",".join(str(int(v)) for v in losses)
        out[f"{key}.batch_loss"] = str(batch)
        out[f"{key}.wire"] = _f32_bits(float(q16_to_float(batch)))
        out[f"{key}.slices"] = _slice_sums(losses)
    # From logits, with a scale of intloss.txt (its table line gives E).
    scale = 0.0625
    classes, batch_size = 10, 6
    logits = rng.integers(-128, 128, (batch_size, classes)).astype(np.int8)
    labels = rng.integers(0, classes, batch_size)
    per_sample = loss_q16(logits, labels, exp_table(scale), scale_q24(scale))
    batch = int(batch_loss_q16(per_sample))
    key = "batch_loss.logits"
    out[f"{key}.scale"] = _f32_bits(scale)
    out[f"{key}.classes"] = str(classes)
    out[f"{key}.logits"] = logits.view(np.uint8).tobytes().hex()
    out[f"{key}.labels"] = ",".join(str(int(v)) for v in labels)
    out[f"{key}.losses"] = ",".join(str(int(v)) for v in per_sample)
    out[f"{key}.batch_loss"] = str(batch)
    out[f"{key}.wire"] = _f32_bits(float(q16_to_float(batch)))


# (name, op, input scale, input zero point, output scale, output zero point)
TABLE_CASES: Final = (
    ("logistic.0", "logistic", 0.0625, -3, 1.0 / 256, -128),
    ("logistic.1", "logistic", 0.0012, 40, 1.0 / 256, -128),
    ("logistic.2", "logistic", 0.7, -128, 1.0 / 256, -128),
    ("hard_swish.0", "hard_swish", 0.05, -20, 0.03, -110),
    ("hard_swish.1", "hard_swish", 0.002, 5, 0.0011, -7),  # a right-shifting relu-ish step
    ("hard_swish.2", "hard_swish", 0.3, 100, 0.5, -128),
)


def table_inputs(case: tuple[str, str, float, int, float, int]) -> tuple[TensorQuant, TensorQuant]:
    """A table case's input and output parameters (float32 scales)."""
    _, _, s_in, z_in, s_out, z_out = case
    return (
        TensorQuant(float(np.float32(s_in)), z_in),
        TensorQuant(float(np.float32(s_out)), z_out),
    )


# MUL by a constant: (input, output, constant value, its scale and zero point).
MUL_CONSTANT_CASE: Final = ((0.0125, 6), (0.002, -128), 127, 0.00065359, -128)


def _mul_constant_vector(out: Vectors) -> None:
    (s_in, z_in), (s_out, z_out), c, s_c, z_c = MUL_CONSTANT_CASE
    node = MulConstant("m", ["x"], "m", constant=c, constant_scale=float(np.float32(s_c)),
                       constant_zero_point=z_c)  # fmt: skip
    inp, res = (
        TensorQuant(float(np.float32(s_in)), z_in),
        TensorQuant(float(np.float32(s_out)), z_out),
    )
    key = "table.mul_constant.0"
    out[f"{key}.in_scale"] = _f32_bits(inp.scale)
    out[f"{key}.in_zero_point"] = str(inp.zero_point)
    out[f"{key}.out_scale"] = _f32_bits(res.scale)
    out[f"{key}.out_zero_point"] = str(res.zero_point)
    out[f"{key}.constant"] = str(c)
    out[f"{key}.constant_scale"] = _f32_bits(node.constant_scale)
    out[f"{key}.constant_zero_point"] = str(z_c)
    out[f"{key}.table"] = mul_constant_table(node, inp, res).view(np.uint8).tobytes().hex()


def _table_vectors(out: Vectors) -> None:
    """LOGISTIC, HARD_SWISH and MUL-by-constant tables (SPEC "Model blob"): parameters
    and the 256 bytes."""
    for case in TABLE_CASES:
        inp, res = table_inputs(case)
        make = logistic_table if case[1] == "logistic" else hard_swish_table
        key = f"table.{case[0]}"
        out[f"{key}.in_scale"] = _f32_bits(inp.scale)
        out[f"{key}.in_zero_point"] = str(inp.zero_point)
        out[f"{key}.out_scale"] = _f32_bits(res.scale)
        out[f"{key}.out_zero_point"] = str(res.zero_point)
        out[f"{key}.table"] = make(inp, res).view(np.uint8).tobytes().hex()
    _mul_constant_vector(out)


def numeric_vectors() -> Vectors:
    """Perturbations, the INT8 buffer, c_k, model blobs and batch losses (numeric.json)."""
    out: Vectors = {}
    _perturbation_vectors(out)
    _acc8_vectors(out)
    _fp16_signed_zero_vectors(out)
    _coefficient_vectors(out)
    _blob_vectors(out)
    _batch_loss_vectors(out)
    _table_vectors(out)
    _gain_vectors(out)
    _recal_vectors(out)
    return out


# --------------------------------------------------------------------------- wire.json


def _hello_bytes(board_id: bytes, firmware: bytes) -> bytes:
    fixed = struct.pack("<HBIHIQQ", PROTOCOL_VERSION, 0, 4200, 64, 12288, 0, 0)
    return (
        b"QS"
        + bytes([PROTOCOL_VERSION, TYPE_CODES[Hello]])
        + fixed
        + bytes([len(board_id)])
        + board_id
        + bytes([len(firmware)])
        + firmware
    )


def _select_bytes(name: bytes) -> bytes:
    head = b"QS" + bytes([PROTOCOL_VERSION, TYPE_CODES[SelectDataset]])
    return head + bytes([len(name)]) + name + struct.pack("<QII", 1, 2, 3)


def _error_bytes(detail: bytes) -> bytes:
    head = b"QS" + bytes([PROTOCOL_VERSION, TYPE_CODES[Error]])
    return head + struct.pack("<BBII", 2, 0x41, 0, 0) + bytes([len(detail)]) + detail


def _decode_cases() -> list[tuple[str, bytes]]:
    """(name, bytes) whose decode result pins the check order and the text-field rules."""
    ping = encode(Ping(nonce=1))
    request = encode(
        EvalRequest(job_id=1, step=2, batch_size=4, eps=1.0, estimator="two_sided", ks=(0, 2))
    )
    update = encode(ApplyUpdate(job_id=1, step=2, ks=(0, 2), coefficients=(0.5, -0.5)))
    heartbeat = encode(Heartbeat(uptime_ms=5, state="ready", job_id=1, step=2))
    chunk = encode(LoadModel(total=4, offset=2, crc32=0, chunk=b"ab"))
    kset = 19  # offset of the k set in EvalRequest and of its count + 1
    nan = struct.pack("<f", float("nan"))
    return [
        # The envelope: length, header length, magic, version, type code.
        ("oversized_first", b"QX" + bytes(MAX_PAYLOAD - 1)),
        ("max_payload_trailing", ping + bytes(MAX_PAYLOAD - len(ping))),
        ("short_before_magic", b"QX\x01"),
        ("magic_before_version", b"QX\x09\x30"),
        ("version_before_type", b"QS\x09\x30"),
        ("version_before_body", ping[:2] + b"\x09" + ping[3:] + b"\x00"),
        ("type_before_body", b"QS" + bytes([PROTOCOL_VERSION]) + b"\x30"),
        # The walk: truncation and the checks that decide how to read on.
        ("enum_before_truncation", heartbeat[:12] + b"\x09"),
        ("text_length_before_truncation", _hello_bytes(b"a" * 33, b"")[:39]),
        ("text_non_ascii_before_truncation", _hello_bytes(b"caf\xc3\xa9", b"1")[:-2]),
        ("kset_count_before_truncation", request[:kset] + b"\x00\x01\x04"),
        ("kset_mode_before_truncation", request[:kset] + b"\x05\x02\x00"),
        ("chunk_length_before_truncation", chunk[:16] + struct.pack("<H", MAX_CHUNK + 1)),
        (
            "one_sided_needs_loss_zero",
            encode(
                EvalResult(
                    job_id=1,
                    step=2,
                    compute_us=3,
                    estimator="one_sided",
                    ks=(4,),
                    loss_plus=(1.0,),
                    loss_zero=0.5,
                )
            )[:-4],
        ),
        # Value checks come after the walk and the length check.
        ("text_pattern_after_truncation", _hello_bytes(b"a b", b"1")[:-1]),
        ("text_pattern_after_trailing", _hello_bytes(b"a b", b"1") + b"\x00"),
        ("nan_after_truncation", request[:14] + nan + request[18:-1]),
        ("nan_after_trailing", request[:14] + nan + request[18:] + b"\x00"),
        ("kset_range_past_65535", request[:kset] + b"\x00\x02\x00\xff\xff"),
        ("kset_range_after_trailing", request[:kset] + b"\x00\x02\x00\xff\xff\x00"),
        ("kset_order_after_truncation", update[: kset - 7] + b"\x01\x02\x00\x02\x00\x00\x00"),
        ("chunk_past_total", chunk[:4] + struct.pack("<I", 3) + chunk[8:]),
        ("chunk_past_total_after_trailing", chunk[:4] + struct.pack("<I", 3) + chunk[8:] + b"\x00"),
        (
            "validate_count_zero",
            encode(ValidateRequest(job_id=1, step=2, start=0, count=1))[:-4] + struct.pack("<I", 0),
        ),
        (
            "correct_above_count",
            encode(
                ValidateResult(
                    job_id=1, step=2, start=0, count=3, loss_sum=1.0, correct=3, compute_us=0
                )
            )[:-8]
            + struct.pack("<II", 4, 0),
        ),
        (
            "loss_sum_infinite",
            encode(
                ValidateResult(
                    job_id=1, step=2, start=0, count=3, loss_sum=1.0, correct=3, compute_us=0
                )
            )[:20]
            + struct.pack("<d", float("inf"))
            + struct.pack("<II", 3, 0),
        ),
        # Text fields, one rule each.
        ("board_id_32", _hello_bytes(b"A-Z_a.z-09" + b"x" * 22, b"1")),
        ("board_id_33", _hello_bytes(b"x" * 33, b"1")),
        ("board_id_empty", _hello_bytes(b"", b"1")),
        ("board_id_space", _hello_bytes(b"n6 01", b"1")),
        ("board_id_slash", _hello_bytes(b"n6/01", b"1")),
        ("board_id_plus", _hello_bytes(b"n6+01", b"1")),
        ("board_id_hash", _hello_bytes(b"n6#01", b"1")),
        ("board_id_nul", _hello_bytes(b"n6\x0001", b"1")),
        ("board_id_newline", _hello_bytes(b"n601\n", b"1")),
        ("board_id_utf8", _hello_bytes(b"n\xc3\xa9", b"1")),
        ("firmware_printable", _hello_bytes(b"b", b'v0.1+g3f/rc~!"#')),
        ("firmware_24", _hello_bytes(b"b", b"x" * 24)),
        ("firmware_25", _hello_bytes(b"b", b"x" * 25)),
        ("firmware_empty", _hello_bytes(b"b", b"")),
        ("firmware_space", _hello_bytes(b"b", b"v 1")),
        ("firmware_del", _hello_bytes(b"b", b"v1\x7f")),
        ("dataset_name_ok", _select_bytes(b"cifar-10.v2_small")),
        ("dataset_name_empty", _select_bytes(b"")),
        ("dataset_name_space", _select_bytes(b"my data")),
        ("dataset_name_slash", _select_bytes(b"data/digits")),
        ("detail_empty", _error_bytes(b"")),
        ("detail_spaces", _error_bytes(b" weights CRC 1234abcd, expected 0badc0de! ")),
        ("detail_64", _error_bytes(b"d" * 64)),
        ("detail_65", _error_bytes(b"d" * 65)),
        ("detail_tab", _error_bytes(b"a\tb")),
        ("detail_newline", _error_bytes(b"ab\n")),
        ("detail_del", _error_bytes(b"ab\x7f")),
    ]


def _decode_result(data: bytes) -> str:
    try:
        decode(data)
    except ProtocolError as exc:
        return exc.kind
    return "ok"


# Job specs of the job_id vectors: the input documents (JSON, as a user may write them).
_JOB_SPECS: Final = [
    {},
    {"name": "fp32-run", "numerics": "fp32"},
    {
        "name": "cifar.q16",
        "dataset": "data/cifar-10",
        "model": "cnn",
        "model_options": {"width": 16, "dropout": 0.25, "act": "relu6"},
        "numerics": "int8",
        "accumulator": "int8",
        "estimator": "one_sided",
        "seed": 18446744073709551615,
        "steps": 4294967295,
        "batch_size": 4096,
        "lr": 1.5e-05,
        "lr_decay": "linear",
        "lr_decay_start": 0.5,
        "lr_end": 1,
        "eps": 3,
        "trainable": ["conv1", "fc"],
        "backbone": "models/backbone.tflite",
        "policy": {"name": "fixed", "config": {"q": 8, "ratio": 1e-07, "on": True}},
        "eval_every": 1,
        "checkpoint_every": 7,
    },
    {
        "checkpoint_every": 5,
        "numerics": "fp32",
        "lr": 1e16,
        "eps": 0.0001,
        "model_options": {"z": 1, "a": 2.0},
        "dataset": 'données ☃ "quoted" back\\slash\ttab',
        "trainable": "last:2",
    },
    # CRC-32 of this one's JSON is 0, so its job id is 1.
    {"name": "crc-zero", "dataset": "digitsDOLIGJJBB@"},
]


def _largest_frame() -> bytes:
    """The longest frame a receiver takes: 12344 COBS bytes, a payload of 12336 bytes.

    ``encode_frame`` refuses such a payload, so the frame is built by hand (SPEC 7.1).
    """
    payload = encode(Ping(nonce=0))[:4] + bytes(MAX_ENCODED_FRAME - 8 - 4)
    body = struct.pack("<BH", 0, 0x0101) + payload
    raw = body + struct.pack("<I", zlib.crc32(body))
    wire = b"\x00" + bytes(cobs.encode(raw)) + b"\x00"
    assert len(wire) == MAX_ENCODED_FRAME + 2
    return wire


def wire_vectors() -> Vectors:
    """Decoder check order, text-field rules, the largest frame and job ids (wire.json)."""
    out: Vectors = {}
    for name, data in _decode_cases():
        out[f"decode.{name}.hex"] = data.hex()
        out[f"decode.{name}.result"] = _decode_result(data)
    wire = _largest_frame()
    (frame,) = FrameReader().feed(wire)
    assert isinstance(frame, Frame)
    out["frame.largest.wire"] = wire.hex()
    out["frame.largest.seq"] = str(frame.seq)
    out["frame.largest.flags"] = str(frame.flags)
    out["frame.largest.payload_size"] = str(len(frame.payload))
    out["frame.largest.payload_sha256"] = hashlib.sha256(frame.payload).hexdigest()
    out["frame.largest.result"] = _decode_result(frame.payload)
    for i, document in enumerate(_JOB_SPECS):
        spec = JobSpec.model_validate_json(json.dumps(document))
        out[f"job_id.{i}.input"] = json.dumps(document)
        out[f"job_id.{i}.json"] = spec.model_dump_json()
        out[f"job_id.{i}.job_id"] = str(job_id_of(spec))
    return out


SETS: Final[dict[str, tuple[str, Callable[[], Vectors]]]] = {
    "messages": ("binary data-plane messages (SPEC section 6)", message_vectors),
    "frames": ("serial frames (SPEC section 7)", frame_vectors),
    "prng": ("Philox4x32-10, Rademacher bits, minibatch indices (SPEC section 1)", prng_vectors),
    "update": ("update arithmetic and checksums (SPEC sections 4, 5)", update_vectors),
}


# Sets that exist only as JSON: the C test runner reads every .txt file of the folder and
# counts lines it cannot run, and these sets are for implementations of the whole SPEC.
JSON_SETS: Final[dict[str, tuple[str, Callable[[], Vectors]]]] = {
    "numeric": (
        "perturbation, INT8 buffer, coefficients, model blobs, batch loss (SPEC 2, 4, 'Model "
        "blob', 'INT8 accumulation buffer', 'Integer loss')",
        numeric_vectors,
    ),
    "wire": (
        "decoder check order, text fields, the largest frame, job ids (SPEC 6.4, 6.5, 7.3, 6.8)",
        wire_vectors,
    ),
}


def vector_sets() -> dict[str, Vectors]:
    """Every vector set written as .txt and .json, freshly computed."""
    return {name: make() for name, (_, make) in SETS.items()}


def json_vector_sets() -> dict[str, Vectors]:
    """Every vector set written as .json only, freshly computed."""
    return {name: make() for name, (_, make) in JSON_SETS.items()}


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
    for name, vectors in json_vector_sets().items():
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
