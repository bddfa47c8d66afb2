"""numeric.json, wire.json and the discriminating update cases, checked twice.

Each vector is recomputed from the library (so the committed files cannot drift from the
code), and most are recomputed a second time from protocol/SPEC.md's own description,
written here in a few lines of numpy or plain integers without the library's functions
(so the text is enough to implement them). Only Philox itself (section 1, with its known
answers tested elsewhere) is taken from the library.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import qsched.protocol
from qsched.lab.make_vectors import (
    JSON_SETS,
    SETS,
    VECTOR_DIR,
    blob_models,
    json_vector_sets,
    render_json,
)
from qsched.policies import PolicyContext, create_policy
from qsched.protocol import ProtocolError, decode
from qsched.protocol.framing import MAX_ENCODED_FRAME, Frame, FrameReader
from qsched.protocol.identity import model_hash64
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.messages import job_id_of
from qsched.zo import accum_int8
from qsched.zo.blob import encode_blob, trainable_layers
from qsched.zo.graph import QuantModel
from qsched.zo.intloss import batch_loss_q16, exp_table, loss_q16, q16_to_float, scale_q24
from qsched.zo.prng import philox4x32, rademacher_bits
from qsched.zo.spsa import LossPairs
from qsched.zo.step import settle_step
from qsched.zo.update import apply_int8_fp16, perturb_fp32, perturb_int8

SPEC = (Path(qsched.protocol.__file__).parent / "SPEC.md").read_text(encoding="utf-8")

Fields = dict[str, str]


def _load(name: str) -> dict[str, str]:
    if name in JSON_SETS:
        data: dict[str, str] = json.loads((VECTOR_DIR / f"{name}.json").read_text("utf-8"))
        return data
    out: dict[str, str] = {}
    for line in (VECTOR_DIR / f"{name}.txt").read_text(encoding="ascii").splitlines():
        if not line.startswith("#"):
            key, _, value = line.partition(" ")
            out[key] = value
    return out


def _groups(name: str, prefix: str) -> dict[str, Fields]:
    """``<prefix>.<case>.<field>`` keys of a set, by case (the field is after the last dot)."""
    groups: dict[str, Fields] = {}
    for key, value in _load(name).items():
        head, _, rest = key.partition(".")
        if head == prefix:
            case, _, field = rest.rpartition(".")
            groups.setdefault(case, {})[field] = value
    assert groups, f"{name} has no {prefix} vectors"
    return groups


def _f32(text: str) -> np.float32:
    return np.frombuffer(bytes.fromhex(text[2:])[::-1], "<f4")[0]


def _f64(text: str) -> float:
    return float(struct.unpack(">d", bytes.fromhex(text[2:]))[0])


def _f32_list(text: str) -> npt.NDArray[np.float32]:
    return np.array([_f32(item) for item in text.split(",")], dtype=np.float32)


def _i8(text: str) -> npt.NDArray[np.int8]:
    return np.frombuffer(bytes.fromhex(text), np.int8).copy()


def _ks(fields: Fields) -> list[int]:
    return [int(k) for k in fields["ks"].split(",")]


def _cs(fields: Fields) -> npt.NDArray[np.float32]:
    return np.frombuffer(bytes.fromhex(fields["cs"]), "<f4").copy()


def _pairs(fields: Fields) -> list[tuple[int, float]]:
    return [(k, float(c)) for k, c in zip(_ks(fields), _cs(fields), strict=True)]


# --------------------------------------------------------------------------- the files


def test_json_sets_are_current_and_have_no_text_twin() -> None:
    """numeric.json and wire.json equal a fresh generation; no .txt for the C runner."""
    for name, vectors in json_vector_sets().items():
        assert (VECTOR_DIR / f"{name}.json").read_text("utf-8") == render_json(vectors), name
        assert not (VECTOR_DIR / f"{name}.txt").exists(), name
        assert name not in SETS


def test_every_vector_group_is_documented_in_spec_section_11() -> None:
    """Each group of the JSON-only sets is named in SPEC section 11."""
    section = SPEC[SPEC.index("## 11. Test vector files") : SPEC.index("## 12. Control plane")]
    for name in JSON_SETS:
        groups = {key.split(".")[0] for key in _load(name)}
        assert f"`{name}`" in section
        for group in groups:
            assert f"`{group}." in section or f"`{group}`" in section, (name, group)


# --------------------------------------------------------------------------- SPEC section 1, 2


def _spec_z(seed: int, step: int, k: int, size: int) -> npt.NDArray[np.int64]:
    """z_k from SPEC section 1: bit i mod 32 of word (i mod 128) div 32 of block i div 128."""
    blocks = np.array([[b, step, k, 0] for b in range((size + 127) // 128)], dtype=np.uint32)
    words = philox4x32(blocks, (seed & 0xFFFFFFFF, seed >> 32)).astype(np.int64)
    i = np.arange(size)
    bit = (words[i // 128, (i % 128) // 32] >> (i % 32)) & 1
    return np.where(bit == 1, -1, 1)


def _bits_text(z: npt.NDArray[np.int64]) -> str:
    return np.packbits(z < 0, bitorder="little").tobytes().hex()


def test_perturbation_vectors_from_library() -> None:
    """perturb_int8 / perturb_fp32 and the sign bits give the committed bytes."""
    for fields in _groups("numeric", "perturb_int8").values():
        seed, step, k, eps = (int(fields[f]) for f in ("seed", "step", "k", "eps"))
        w = _i8(fields["weights"])
        assert (
            np.packbits(rademacher_bits(seed, step, k, w.size), bitorder="little").tobytes().hex()
            == fields["bits"]
        )
        assert perturb_int8(w, seed, step, k, eps, 1).tobytes().hex() == fields["plus"]
        assert perturb_int8(w, seed, step, k, eps, -1).tobytes().hex() == fields["minus"]
    for fields in _groups("numeric", "perturb_fp32").values():
        seed, step, k = (int(fields[f]) for f in ("seed", "step", "k"))
        theta = np.frombuffer(bytes.fromhex(fields["theta"]), "<f4").copy()
        eps = float(_f32(fields["eps"]))
        assert np.float32(_f64(fields["spec_eps"])) == np.float32(eps)
        assert perturb_fp32(theta, seed, step, k, eps, 1).tobytes().hex() == fields["plus"]
        assert perturb_fp32(theta, seed, step, k, eps, -1).tobytes().hex() == fields["minus"]


def test_perturbation_vectors_from_spec() -> None:
    """SPEC section 2: integer add and clamp (INT8), one float32 add of float32 eps (FP32)."""
    for fields in _groups("numeric", "perturb_int8").values():
        seed, step, k, eps = (int(fields[f]) for f in ("seed", "step", "k", "eps"))
        w = _i8(fields["weights"]).astype(np.int64)
        z = _spec_z(seed, step, k, w.size)
        assert _bits_text(z) == fields["bits"]
        for sign, name in ((1, "plus"), (-1, "minus")):
            moved = np.clip(w + sign * eps * z, -127, 127).astype(np.int8)
            assert moved.tobytes().hex() == fields[name]
        assert -128 in w and (w == 127).any()  # both ends saturate
    for fields in _groups("numeric", "perturb_fp32").values():
        seed, step, k = (int(fields[f]) for f in ("seed", "step", "k"))
        theta = np.frombuffer(bytes.fromhex(fields["theta"]), "<f4").copy()
        z = _spec_z(seed, step, k, theta.size)
        assert _bits_text(z) == fields["bits"]
        eps32 = _f32(fields["eps"])
        for sign, name in ((1, "plus"), (-1, "minus")):
            e = np.float32(sign) * eps32
            moved = (theta + np.where(z > 0, e, -e).astype(np.float32)).astype("<f4")
            assert moved.tobytes().hex() == fields[name]
            # The float64 eps of the spec would give other bits (SPEC 2: the wire's float32).
            wide = (theta + sign * z * _f64(fields["spec_eps"])).astype("<f4")
            assert wide.tobytes().hex() != fields[name]


# --------------------------------------------------------------------------- SPEC section 4


def _spec_delta(
    z: npt.NDArray[np.int64], cs: npt.NDArray[np.float32], method: str = "spec"
) -> npt.NDArray[np.float32]:
    """delta = sum of +-c: SPEC 4.2 (float32, ascending k), or a wrong method."""
    if method == "float64":
        return (z * cs.astype(np.float64)[:, None]).sum(axis=0).astype(np.float32)
    order = range(len(cs)) if method == "spec" else reversed(range(len(cs)))
    delta = np.zeros(z.shape[1], dtype=np.float32)
    for j in order:
        delta = (delta + np.where(z[j] > 0, cs[j], -cs[j])).astype(np.float32)
    return delta


def _f16(values: npt.NDArray[np.float32]) -> npt.NDArray[np.float16]:
    """float32 to binary16, nearest even, saturating at +-65504."""
    return np.clip(values, np.float32(-65504), np.float32(65504)).astype(np.float16)


def _int8_fp16_from_spec(
    w: npt.NDArray[np.int8], b: npt.NDArray[np.float16]
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float16]]:
    """The tail of SPEC 4.2 from b: m = trunc(b) in float32, clamp, buf = f16(b - m)."""
    b32 = b.astype(np.float32)
    m = np.trunc(b32)
    moved = np.clip(w.astype(np.int64) + m.astype(np.int64), -127, 127).astype(np.int8)
    return moved, (b32 - m).astype(np.float16)


def _update_inputs(
    fields: Fields, size: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    seed, step = int(fields["seed"]), int(fields["step"])
    z = np.stack([_spec_z(seed, step, k, size) for k in _ks(fields)])
    return z, _cs(fields)


def _fp32_result(fields: Fields, method: str) -> str:
    theta = np.frombuffer(bytes.fromhex(fields["theta"]), "<f4").copy()
    z, cs = _update_inputs(fields, theta.size)
    if method == "each_pair":
        for j in range(len(cs)):
            theta = (theta + np.where(z[j] > 0, cs[j], -cs[j])).astype(np.float32)
        return theta.astype("<f4").tobytes().hex()
    return (theta + _spec_delta(z, cs, method)).astype("<f4").tobytes().hex()


def _int8_fp16_result(fields: Fields, method: str) -> str:
    w = _i8(fields["weights"])
    buf = np.frombuffer(bytes.fromhex(fields["buffer"]), "<f2").copy()
    z, cs = _update_inputs(fields, w.size)
    if method == "each_pair":
        b = buf
        for j in range(len(cs)):
            b = _f16(b.astype(np.float32) + np.where(z[j] > 0, cs[j], -cs[j]))
    elif method == "delta_to_f16":
        b = _f16(buf.astype(np.float32) + _f16(_spec_delta(z, cs)).astype(np.float32))
    else:
        b = _f16(buf.astype(np.float32) + _spec_delta(z, cs, method))
    moved, rest = _int8_fp16_from_spec(w, b)
    return moved.tobytes().hex() + rest.astype("<f2").tobytes().hex()


def _int8_fp16_cases() -> dict[str, Fields]:
    cases = {f"update.{n}": f for n, f in _groups("update", "int8_fp16").items()}
    cases.update({f"numeric.{n}": f for n, f in _groups("numeric", "int8_fp16_zero").items()})
    return cases


def test_update_vectors_from_spec() -> None:
    """Every fp32 and int8_fp16 update vector follows the pseudo-code of SPEC 4.2."""
    for name, fields in _groups("update", "fp32").items():
        assert _fp32_result(fields, "spec") == fields["expected"], name
        assert zlib.crc32(bytes.fromhex(fields["expected"])) == int(fields["checksum"])
    for name, fields in _int8_fp16_cases().items():
        expected = fields["expected_weights"] + fields["expected_buffer"]
        assert _int8_fp16_result(fields, "spec") == expected, name
        assert zlib.crc32(bytes.fromhex(expected)) == int(fields["checksum"]), name


def _spec_gain(scale: np.float32) -> np.float32:
    square = float(scale) * float(scale)
    if not square > 0:
        return np.float32(0.0)
    return np.float32(min(1.0 / square, float(np.finfo(np.float32).max)))


def test_gain_vectors_from_spec() -> None:
    """SPEC 4.2's weight-unit learning rate: delta times the element's channel gain."""
    for name, fields in _groups("numeric", "gain").items():
        w = _i8(fields["weights"])
        buf = np.frombuffer(bytes.fromhex(fields["buffer"]), "<f2").copy()
        scales = np.frombuffer(bytes.fromhex(fields["scales"]), "<f4")
        gains = np.array([_spec_gain(s) for s in scales], dtype=np.float32)
        assert gains.astype("<f4").tobytes().hex() == fields["gains"], name
        channel = np.arange(w.size)
        channel = channel % scales.size if fields["channel_minor"] == "1" else channel // 4
        z, cs = _update_inputs(fields, w.size)
        b = _f16(buf.astype(np.float32) + (_spec_delta(z, cs) * gains[channel]).astype(np.float32))
        moved, rest = _int8_fp16_from_spec(w, b)
        assert moved.tobytes().hex() == fields["expected_weights"], name
        assert rest.astype("<f2").tobytes().hex() == fields["expected_buffer"], name


def test_recalibration_vectors_from_spec() -> None:
    """SPEC "Scale recalibration", element by element as written: a channel with a weight
    at +-127 and an exponent below its limit halves toward zero and carries half steps."""
    for name, fields in _groups("numeric", "recal").items():
        w = [int(v) for v in _i8(fields["weights"])]
        buf = np.frombuffer(bytes.fromhex(fields["buffer"]), "<f2").copy()
        exps = [int(v) for v in _i8(fields["exps"])]
        channels = int(fields["channels"])
        mults = [int(v) for v in fields["multipliers"].split(",")]
        shifts = [int(v) for v in fields["shifts"].split(",")]
        per = len(w) // channels
        for c in range(channels):
            members = [
                c + i * channels if fields["channel_minor"] == "1" else c * per + i
                for i in range(per)
            ]
            limit = 0 if mults[c] == 0 else max(0, min(8, 30 - shifts[c]))
            if max(abs(w[j]) for j in members) != 127 or exps[c] >= limit:
                continue
            exps[c] += 1
            for j in members:
                half = int(w[j] / 2)  # toward zero
                carried = np.float32(w[j] - 2 * half) * np.float32(0.5)
                buf[j] = _f16(np.float32(buf[j]) * np.float32(0.5) + carried)
                w[j] = half
        assert np.array(w, np.int8).tobytes().hex() == fields["expected_weights"], name
        assert buf.astype("<f2").tobytes().hex() == fields["expected_buffer"], name
        assert np.array(exps, np.int8).tobytes().hex() == fields["expected_exps"], name
    for name, fields in _groups("numeric", "recal_bias").items():
        b, e = int(fields["bias"]), int(fields["exp"])
        want = b if e == 0 else (1 if b > 0 else -1) * ((abs(b) + (1 << (e - 1))) >> e)
        assert want == int(fields["expected"]), name


def test_fp16_signed_zero_vector_from_library() -> None:
    """numeric.json int8_fp16_zero: apply_int8_fp16 gives +0.0 remainders where b = -0.0."""
    for fields in _groups("numeric", "int8_fp16_zero").values():
        w = _i8(fields["weights"])
        buf = np.frombuffer(bytes.fromhex(fields["buffer"]), "<f2").copy()
        new_w, new_b = apply_int8_fp16(
            w, buf, int(fields["seed"]), int(fields["step"]), _pairs(fields)
        )
        assert new_w.tobytes().hex() == fields["expected_weights"]
        assert new_b.astype("<f2").tobytes().hex() == fields["expected_buffer"]
        z, cs = _update_inputs(fields, w.size)
        b = _f16(buf.astype(np.float32) + _spec_delta(z, cs))
        assert np.signbit(b[b == 0]).any()  # some sums do round to -0.0
        # Converting m to an integer first (b - 0 instead of b - trunc(b)) keeps -0.0.
        wrong = (b.astype(np.float32) - np.trunc(b.astype(np.float32)).astype(np.int64)).astype(
            "<f2"
        )
        assert wrong.tobytes().hex() != fields["expected_buffer"]


# Which wrong method each discriminating case tells apart (SPEC 4.2, "Vectors").
_DISCRIMINATES = {
    ("fp32", "2"): ("float64", "descending"),
    ("fp32", "3"): ("each_pair",),
    ("int8_fp16", "3"): ("float64", "descending", "delta_to_f16"),
    ("int8_fp16", "4"): ("delta_to_f16", "each_pair"),
}


@pytest.mark.parametrize(("group", "case"), sorted(_DISCRIMINATES))
def test_update_vectors_tell_wrong_methods_apart(group: str, case: str) -> None:
    """A float64 sum, a descending sum, a sum per pair, two binary16 roundings: other bits."""
    fields = _groups("update", group)[case]
    result = _fp32_result if group == "fp32" else _int8_fp16_result
    expected = (
        fields["expected"]
        if group == "fp32"
        else fields["expected_weights"] + fields["expected_buffer"]
    )
    assert result(fields, "spec") == expected
    for method in _DISCRIMINATES[(group, case)]:
        assert result(fields, method) != expected, method


def _acc8_from_spec(
    w: npt.NDArray[np.int8],
    state: npt.NDArray[np.int8],
    sizes: list[int],
    step: int,
    delta: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.int8]]:
    """SPEC "INT8 accumulation buffer": one update, then the rescaling of every 16th step."""
    n = sum(sizes)
    b = state[:n].astype(np.int64)
    shifts = state[n:].astype(np.int64).copy()
    sigma = np.repeat(shifts, sizes)
    u = (delta * (2.0**sigma).astype(np.float32)).astype(np.float32)
    r = np.rint(np.clip(u, np.float32(-(2.0**24)), np.float32(2.0**24))).astype(np.int64)
    acc = b + r
    m = np.sign(acc) * (np.abs(acc) >> sigma)
    moved = np.clip(w.astype(np.int64) + m, -127, 127)
    b = np.clip(acc - m * (1 << sigma), -127, 127)
    if (step + 1) % 16 == 0:
        start = 0
        for t, size in enumerate(sizes):
            part = b[start : start + size]
            if np.count_nonzero(np.abs(part) == 127) * 64 > size and shifts[t] > 7:
                shifts[t] -= 1
                part[:] = np.sign(part) * ((np.abs(part) + 1) >> 1)
            elif np.abs(part).max() < 64 and shifts[t] < 15:
                shifts[t] += 1
                part[:] = 2 * part
            start += size
    return moved.astype(np.int8), np.concatenate([b, shifts]).astype(np.int8)


def test_acc8_vectors_from_library_and_spec() -> None:
    """accum_int8.apply and the SPEC's pseudo-code both give the committed bytes."""
    for name, fields in _groups("numeric", "acc8").items():
        sizes = [int(s) for s in fields["tensor_sizes"].split(",")]
        seed, step = int(fields["seed"]), int(fields["step"])
        w, state = _i8(fields["weights"]), _i8(fields["state"])
        lib_w, lib_state = accum_int8.apply(w, state, sizes, seed, step, _pairs(fields))
        z, cs = _update_inputs(fields, w.size)
        spec_w, spec_state = _acc8_from_spec(w, state, sizes, step, _spec_delta(z, cs))
        for got_w, got_state in ((lib_w, lib_state), (spec_w, spec_state)):
            assert got_w.tobytes().hex() == fields["expected_weights"], name
            assert got_state.tobytes().hex() == fields["expected_state"], name
        assert zlib.crc32(lib_w.tobytes() + lib_state.tobytes()) == int(fields["checksum"])
    cases = _groups("numeric", "acc8")
    assert _i8(cases["initial_refine"]["state"]).tolist() == [0] * 64 + [7, 7]  # step 0
    for name, direction in (("initial_refine", 1), ("coarsen", -1)):
        before, after = _i8(cases[name]["state"])[64:], _i8(cases[name]["expected_state"])[64:]
        assert (after - before).tolist().count(direction) >= 1, name


def _spec_coefficients(fields: Fields, eps: float) -> list[float]:
    """SPEC 4.1 in binary64: lr_t = lr * g, g = (q / N) below N = lr_full_q (else 1)
    times 2^-h for h halvings, times the linear decay's 1 - (1 - lr_end) * ((p - s) /
    (1 - s)) once p = t / steps passes s = lr_decay_start, then c = (-lr_t * d) / (den *
    q), one rounding to float32."""
    lr, q, full = _f64(fields["lr"]), int(fields["q"]), int(fields["lr_full_q"])
    factor = float(q) / float(full) if q < full else 1.0
    lr = lr * (factor * 2.0 ** -int(fields["lr_halvings"]))
    progress = float(int(fields["step"])) / float(int(fields["steps"]))
    start = _f64(fields["lr_decay_start"])
    if fields["lr_decay"] == "linear" and progress > start:
        lr = lr * (1.0 - (1.0 - _f64(fields["lr_end"])) * ((progress - start) / (1.0 - start)))
    plus = [float(v) for v in _f32_list(fields["loss_plus"])]
    if fields["estimator"] == "two_sided":
        diffs = [p - float(m) for p, m in zip(plus, _f32_list(fields["loss_minus"]), strict=True)]
        den = 2.0 * eps
    else:
        diffs = [p - float(_f32(fields["loss_zero"])) for p in plus]
        den = eps
    scale = den * q
    return [float(np.float32((-lr * d) / scale)) for d in diffs]


def test_coefficient_vectors_from_library_and_spec() -> None:
    """settle_step with the policy's lr scale and the spec's decay, and SPEC 4.1, give
    the committed c_k; FP32 needs the float64 eps."""
    for name, fields in _groups("numeric", "coef").items():
        expected = [float(c) for c in _f32_list(fields["cs"])]
        eps = _f64(fields["eps"])
        assert _spec_coefficients(fields, eps) == expected, name
        ks = _ks(fields)
        plus = dict(zip(ks, (float(v) for v in _f32_list(fields["loss_plus"])), strict=True))
        if fields["estimator"] == "two_sided":
            minus = dict(zip(ks, (float(v) for v in _f32_list(fields["loss_minus"])), strict=True))
            losses = LossPairs(plus=plus, minus=minus)
        else:
            losses = LossPairs(plus=plus, minus={}, base=float(_f32(fields["loss_zero"])))
        est = "two_sided" if fields["estimator"] == "two_sided" else "one_sided"
        q = int(fields["q"])
        halvings = int(fields["lr_halvings"])
        config = {"lr_full_q": int(fields["lr_full_q"]), "lr_halvings": halvings}
        policy = create_policy(
            PolicySpec(name="qscheduler", config=config),
            PolicyContext(total_steps=1, steps_per_epoch=1.0, eval_every=1),
        )
        policy.load_state_dict({**policy.state_dict(), "lr_halvings": halvings})
        spec = JobSpec(
            numerics="fp32" if fields["numerics"] == "fp32" else "int8",
            estimator=est,
            lr=_f64(fields["lr"]),
            eps=eps,
            lr_decay="linear" if fields["lr_decay"] == "linear" else "none",
            lr_decay_start=_f64(fields["lr_decay_start"]),
            lr_end=_f64(fields["lr_end"]),
            steps=int(fields["steps"]),
        )
        settled = settle_step(spec, int(fields["step"]), q, losses, 0, policy.lr_scale(q))
        assert [c for _, c in settled.pairs] == expected, name
        wire_eps = float(_f32(fields["wire_eps"]))
        if fields["numerics"] == "fp32":
            assert _spec_coefficients(fields, wire_eps) != expected, name
        else:
            assert wire_eps == eps


# --------------------------------------------------------------------------- integer loss


def _spec_exp_table(scale_bits: int) -> list[int]:
    """SPEC "Integer loss": E[0..255] with integers only, from the float32's bits."""
    m = (scale_bits & 0x7FFFFF) | 0x800000
    p = ((scale_bits >> 23) & 0xFF) - 150
    table = []
    for d in range(256):
        big_n, big_k = ((m << p) * d, 0) if p >= 0 else (m * d, -p)
        w = 192
        h = max(0, big_n.bit_length() - big_k + 8)
        y = (big_n << w) >> (big_k + h)
        term = acc = 1 << w
        n = 1
        while term != 0:
            term = ((term * y) >> w) // n
            acc = acc - term if n % 2 else acc + term
            n += 1
        for _ in range(h):
            acc = (acc * acc) >> w
        table.append(((acc >> 64) + (1 << 103)) >> 104)
    return table


def _spec_scale_q24(scale_bits: int) -> int:
    """S = floor(s * 2^24 + 1/2), exactly."""
    m = (scale_bits & 0x7FFFFF) | 0x800000
    shift = ((scale_bits >> 23) & 0xFF) - 150 + 24
    return m << shift if shift >= 0 else (m + (1 << (-shift - 1))) >> -shift


def _intloss_tables() -> dict[int, tuple[int, list[int]]]:
    text = (VECTOR_DIR / "intloss.txt").read_text(encoding="ascii")
    tables = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "table":
            tables[int(parts[1], 16)] = (int(parts[2]), [int(e, 16) for e in parts[3:]])
    return tables


def test_exp_table_from_spec_text_matches_the_vectors() -> None:
    """The SPEC's step-by-step exp table rebuilds every intloss.txt table and the blob's."""
    tables = _intloss_tables()
    assert len(tables) >= 8
    for bits, (s_q24, table) in tables.items():
        assert _spec_exp_table(bits) == table, f"{bits:08x}"
        assert _spec_scale_q24(bits) == s_q24
        scale = float(np.frombuffer(struct.pack("<I", bits), "<f4")[0])
        assert exp_table(scale).tolist() == table
        assert scale_q24(scale) == s_q24
    blob = _groups("numeric", "blob")["int8"]
    bits = int(blob["scale"], 16)
    assert _spec_exp_table(bits) == [int(e, 16) for e in blob["exp_table"].split(",")]


def _spec_loss_q16(logits: npt.NDArray[np.int8], label: int, table: list[int], s_q24: int) -> int:
    """One sample's Q16 loss, from the pseudo-code of SPEC "Integer loss"."""
    values = [int(v) for v in logits]
    top = max(values)
    d = [top - v for v in values]
    total = sum(table[x] for x in d)
    n = total.bit_length() - 1
    x = total << (30 - n) if n <= 30 else total >> (n - 30)
    f = 0
    for i in range(1, 25):
        x = (x * x) >> 30
        if x >= 1 << 31:
            x >>= 1
            f |= 1 << (24 - i)
    log2_24 = ((n - 24) << 24) | f
    ln_24 = (log2_24 * 0xB17217F8 + (1 << 31)) >> 32
    return (ln_24 + s_q24 * d[label] + 128) >> 8


def test_batch_loss_vectors_from_library_and_spec() -> None:
    """floor(sum / B) in integers, float32(batch / 65536) on the wire; a case from logits."""
    for name, fields in _groups("numeric", "batch_loss").items():
        losses = [int(v) for v in fields["losses"].split(",")]
        batch = int(fields["batch_loss"])
        assert sum(losses) // len(losses) == batch, name
        assert int(batch_loss_q16(np.asarray(losses, dtype=np.int32))) == batch
        assert _f32(fields["wire"]) == np.float32(batch / 65536.0) == q16_to_float(batch)
        if name != "logits":
            continue
        bits = struct.unpack(">I", bytes.fromhex(fields["scale"][2:]))[0]
        s_q24, table = _intloss_tables()[bits]  # SPEC: the intloss.txt table of its scale
        classes = int(fields["classes"])
        logits = _i8(fields["logits"]).reshape(-1, classes)
        labels = [int(v) for v in fields["labels"].split(",")]
        spec = [_spec_loss_q16(row, y, table, s_q24) for row, y in zip(logits, labels, strict=True)]
        assert spec == losses
        lib = loss_q16(logits, np.asarray(labels), np.asarray(table, dtype=np.uint32), s_q24)
        assert lib.tolist() == losses
    assert any(
        float(_f32(f["wire"])) * 65536 != int(f["batch_loss"])
        for f in _groups("numeric", "batch_loss").values()
    )


# --------------------------------------------------------------------------- model blob


def test_blob_vectors_from_library() -> None:
    """encode_blob of the two small models gives the committed bytes and identities."""
    blobs = _groups("numeric", "blob")
    for name, (obj, trainable) in blob_models().items():
        fields = blobs[name]
        blob = encode_blob(obj, trainable=trainable)
        assert blob.hex() == fields["hex"], name
        assert hashlib.sha256(blob).hexdigest() == fields["sha256"]
        assert model_hash64(blob) == int(fields["model_hash"])
        assert zlib.crc32(blob) == int(fields["crc32"])
        assert trainable_layers(blob) == fields["trainable"].split(",")
    int8 = blob_models()["int8"][0]
    assert isinstance(int8, QuantModel)
    scale = int8.tensors[int8.model.output_name].scale
    assert exp_table(scale).tolist() == [int(e, 16) for e in blobs["int8"]["exp_table"].split(",")]


def _flat_from_blob(blob: bytes) -> tuple[bytes, list[int], int]:
    """The flat trainable vector from the op records (SPEC "Model blob"), tensor sizes."""
    n_tensors, n_ops = struct.unpack_from("<HH", blob, 8)
    numerics = blob[6]
    ops = 64 + 1024 + 52 * n_tensors
    data = ops + 140 * n_ops
    params = struct.unpack_from("<I", blob, 20)[0]
    width = 1 if numerics == 1 else 4
    flat = bytearray(params * width)
    sizes = []
    for i in range(n_ops):
        record = ops + 140 * i
        if not blob[record + 35] & 1:
            continue
        weight_at, bias_at = struct.unpack_from("<II", blob, record + 76)
        count, channels, offset = struct.unpack_from("<III", blob, record + 96)
        parts = [(weight_at, count)] + ([] if numerics == 1 else [(bias_at, channels)])
        at = offset * width
        for start, length in parts:
            flat[at : at + length * width] = blob[data + start : data + start + length * width]
            at += length * width
        sizes.append(count)
    return bytes(flat), sizes, params


def test_blob_vectors_from_spec() -> None:
    """Header fields, length, CRCs, identities, exp table bytes and the state of step 0."""
    for name, fields in _groups("numeric", "blob").items():
        blob = bytes.fromhex(fields["hex"])
        assert blob[:4] == b"QZMB" and struct.unpack_from("<H", blob, 4)[0] == 1
        header = struct.unpack_from("<BBHHHHIIIIII", blob, 6)
        names = (
            "numerics",
            "flags",
            "tensors",
            "ops",
            "input",
            "output",
            "classes",
            "params",
            "data_size",
            "body_crc32",
        )
        for field, value in zip(names, header, strict=False):
            assert str(value) == fields[field], (name, field)
        assert f"0x{header[10]:08x}" == fields["scale"] and str(header[11]) == fields["scale_q24"]
        assert blob[40:64] == bytes(24)
        tensors, ops, data_size = header[2], header[3], header[8]
        assert len(blob) == 64 + 1024 + 52 * tensors + 140 * ops + data_size == int(fields["size"])
        assert zlib.crc32(blob[64:]) == int(fields["body_crc32"])
        assert zlib.crc32(blob) == int(fields["crc32"])
        digest = hashlib.sha256(blob).digest()
        assert digest.hex() == fields["sha256"]
        assert int.from_bytes(digest[:8], "little") == int(fields["model_hash"])
        table = list(struct.unpack_from("<256I", blob, 64))
        flat, sizes, params = _flat_from_blob(blob)
        if fields["numerics"] == "1":
            bits = header[10]
            assert table == _spec_exp_table(bits) and header[11] == _spec_scale_q24(bits)
            fp16 = flat + bytes(2 * params)
            acc8 = flat + bytes(params) + bytes([7] * len(sizes))
            assert fp16.hex() == fields["initial_fp16"]
            assert acc8.hex() == fields["initial_int8"]
            assert zlib.crc32(fp16) == int(fields["initial_fp16_checksum"])
            assert zlib.crc32(acc8) == int(fields["initial_int8_checksum"])
        else:
            assert table == [0] * 256 and header[10] == header[11] == 0
            assert flat.hex() == fields["initial_fp32"]
            assert zlib.crc32(flat) == int(fields["initial_fp32_checksum"])


def _spec_logistic(v: int, s_i: np.float32, z_i: int, s_o: np.float32, z_o: int) -> int:
    x = s_i * np.float32(v - z_i)
    e = np.float32(math.exp(-float(x))) if -float(x) < 89.0 else np.float32(np.inf)
    y = np.float32(1) / (np.float32(1) + e)
    t = float(y * (np.float32(1) / s_o))
    r = math.floor(t + 0.5) if t >= 0 else -math.floor(-t + 0.5)  # exact: t is a float32
    return min(max(r + z_o, -128), 127)


def _i16(v: int) -> int:
    return ((v + 2**15) & 0xFFFF) - 2**15


def _spec_quantize_multiplier(real: float) -> tuple[int, int]:
    m, e = math.frexp(real)
    q = int(Decimal(m * 2**31).to_integral_value("ROUND_HALF_UP"))
    return (q // 2, e + 1) if q == 2**31 else (q, e)


def _spec_mult16(real: float) -> tuple[int, int]:
    q, e = _spec_quantize_multiplier(real)
    return (32767 if q >= 2**31 - 1 - 2**15 else (q + 2**15) >> 16), e


def _spec_mbqm(x: int, m: int, e: int) -> int:
    """MultiplyByQuantizedMultiplier, double rounding, for a shift e <= 0."""
    high = (x * m + (1 << 30)) >> 31  # SaturatingRoundingDoublingHighMul (no saturation here)
    shift = -e
    if shift == 0:
        return high
    mask, remainder = (1 << shift) - 1, high & ((1 << shift) - 1)
    return (high >> shift) + (1 if remainder > (mask >> 1) + (high < 0) else 0)


def _spec_hard_swish(v: int, s_i: np.float32, z_i: int, s_o: np.float32, z_o: int) -> int:
    def mul(a: int, b: int, nudge: bool) -> int:
        if a == b == -(2**15):
            return 2**15 - 1
        p = a * b + ((2**14 if a * b >= 0 else 1 - 2**14) if nudge else 0)
        return _i16(int(p / 2**15))  # exact in double; int() truncates toward zero

    def rdbpot(x: int, e: int) -> int:
        mask = _i16((1 << e) - 1)
        return _i16((x >> e) + (1 if _i16(x & mask) > (mask >> 1) + (x < 0) else 0))

    def sat(x: int) -> int:
        return min(max(x, -(2**15)), 2**15 - 1)

    h = np.float32(1 / 128) * s_i
    mr, er = _spec_mult16(float(h / (np.float32(3) / np.float32(32768))))
    mo, eo = _spec_mult16(float(h / s_o))
    u = _i16((v - z_i) * 128)
    p, r = mul(u, mo, True), u
    r = sat(r * 2 ** (er - 1)) if er > 0 else r
    r = mul(r, mr, True)
    r = sat(2 * r) if er > 0 else (rdbpot(r, -er) if er < 0 else r)
    r = (r + 2**15) >> 1
    return min(max(_i16(rdbpot(mul(r, p, False), -eo) + z_o), -128), 127)


def test_table_vectors_from_spec() -> None:
    """LOGISTIC, HARD_SWISH and MUL-by-constant tables from SPEC "Model blob"'s recipe."""
    groups = _groups("numeric", "table")
    assert len(groups) == 7
    f = groups.pop("mul_constant.0")
    s_i, s_o, s_c = (_f32(f[k]) for k in ("in_scale", "out_scale", "constant_scale"))
    z_i, z_o, c, z_c = (int(f[k]) for k in ("in_zero_point", "out_zero_point", "constant",
                                            "constant_zero_point"))  # fmt: skip
    m, e = _spec_quantize_multiplier(float(s_i) * float(s_c) / float(s_o))
    table = [
        min(max(_spec_mbqm((v - z_i) * (c - z_c), m, e) + z_o, -128), 127) for v in range(-128, 128)
    ]
    assert bytes(t & 0xFF for t in table).hex() == f["table"]
    for name, f in groups.items():
        s_i, s_o = _f32(f["in_scale"]), _f32(f["out_scale"])
        z_i, z_o = int(f["in_zero_point"]), int(f["out_zero_point"])
        spec = _spec_logistic if name.startswith("logistic") else _spec_hard_swish
        table = bytes(spec(v, s_i, z_i, s_o, z_o) & 0xFF for v in range(-128, 128))
        assert table.hex() == f["table"], name


# --------------------------------------------------------------------------- wire.json


# The decoder's words for the fault each decode.* case must be refused for. A case with two
# faults names the one that wins; _ALONE gives the bytes that leave only its first fault.
_DECODE_REASONS = {
    "oversized_first": "MAX_PAYLOAD",
    "max_payload_trailing": "after the message",
    "short_before_magic": "a header needs 4",
    "magic_before_version": "header starts",
    "version_before_type": "version 9",
    "version_before_body": "version 9",
    "type_before_body": "type code 0x30",
    "enum_before_truncation": "state code 9",
    "text_length_before_truncation": "board_id is 33 bytes",
    "text_non_ascii_before_truncation": "not ASCII",
    "kset_count_before_truncation": "k count 1025",
    "kset_mode_before_truncation": "k set mode 5",
    "chunk_length_before_truncation": "chunk is 8193 bytes",
    "one_sided_needs_loss_zero": "layout needs 30",
    "text_pattern_after_truncation": "layout needs",
    "text_pattern_after_trailing": "after the message",
    "nan_after_truncation": "layout needs",
    "nan_after_trailing": "after the message",
    "kset_range_past_65535": "65535",
    "kset_range_after_trailing": "after the message",
    "kset_order_after_truncation": "layout needs",
    "chunk_past_total": "past the total",
    "chunk_past_total_after_trailing": "after the message",
    "validate_count_zero": "count",
    "correct_above_count": "correct cannot exceed count",
    "loss_sum_infinite": "loss_sum",
}
# For "<fault>_after_<kind>": what to do to the bytes to leave only the first fault, and
# the decoder's words for that fault (a value check: invalid_field).
_ALONE: dict[str, tuple[Any, str]] = {
    "text_pattern_after_truncation": (lambda b: b + b"1", "board_id: String should match"),
    "text_pattern_after_trailing": (lambda b: b[:-1], "board_id: String should match"),
    "nan_after_truncation": (lambda b: b + b"\x00", "eps"),
    "nan_after_trailing": (lambda b: b[:-1], "eps"),
    "kset_range_after_trailing": (lambda b: b[:-1], "65535"),
    "kset_order_after_truncation": (lambda b: b + bytes(8), "strictly ascending"),
    "chunk_past_total_after_trailing": (lambda b: b[:-1], "past the total"),
}


def _decode_result(data: bytes) -> tuple[str, str]:
    try:
        decode(data)
    except ProtocolError as exc:
        return exc.kind, str(exc)
    return "ok", ""


def test_decode_vectors_from_library() -> None:
    """Every decode.* input gives its result, for the reason its name says."""
    cases = _groups("wire", "decode")
    for name, fields in cases.items():
        kind, text = _decode_result(bytes.fromhex(fields["hex"]))
        assert kind == fields["result"], name
        if name in _DECODE_REASONS:
            assert _DECODE_REASONS[name] in text, (name, text)
        elif kind != "ok":
            field = name.split("_")[0]
            assert {"board": "board_id", "firmware": "firmware_version", "dataset": "name"}.get(
                field, field
            ) in text
    assert set(_DECODE_REASONS) <= set(cases)
    for name, (repair, reason) in _ALONE.items():
        kind, text = _decode_result(repair(bytes.fromhex(cases[name]["hex"])))
        assert kind == "invalid_field" and reason in text, (name, text)


def test_decode_vectors_follow_the_text_table() -> None:
    """The decode.* text cases agree with the table of SPEC 6.5, applied to the raw bytes."""
    rules = {
        "board_id": (
            1,
            32,
            set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-"),
        ),
        "firmware_version": (1, 24, set(range(0x21, 0x7F))),
        "name": (1, 32, set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")),
        "detail": (0, 64, set(range(0x20, 0x7F))),
    }
    prefixes = {
        "board_id": "board_id",
        "firmware": "firmware_version",
        "dataset_name": "name",
        "detail": "detail",
    }
    checked = 0
    for name, fields in _groups("wire", "decode").items():
        field = next((f for p, f in prefixes.items() if name.startswith(p + "_")), None)
        if field is None:
            continue
        data = bytes.fromhex(fields["hex"])
        start = {
            "board_id": 33,
            "firmware_version": 34 + data[33] if len(data) > 33 else 0,
            "name": 4,
            "detail": 14,
        }[field]
        text = data[start + 1 : start + 1 + data[start]]
        low, high, allowed = rules[field]
        ok = low <= len(text) <= high and set(text) <= allowed
        assert (fields["result"] == "ok") == ok, name
        checked += 1
    assert checked >= 20


_SPEC_KEYS = [
    "name",
    "dataset",
    "model",
    "model_options",
    "numerics",
    "accumulator",
    "estimator",
    "seed",
    "steps",
    "batch_size",
    "lr",
    "lr_unit",
    "lr_decay",
    "lr_decay_start",
    "lr_end",
    "eps",
    "trainable",
    "backbone",
    "recalibrate_every",
    "policy",
    "eval_every",
    "checkpoint_every",
]


def _spec_float(x: float) -> str:
    """A float as SPEC 6.8 writes it: repr's digits, positional for exponents -5 .. 15."""
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    sign = "-" if x < 0 else ""
    _, digit_tuple, exponent = Decimal(repr(abs(x))).normalize().as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple))
    k = len(digits) - 1 + exponent
    if -5 <= k <= 15:
        if k >= 0:
            whole, frac = digits[: k + 1].ljust(k + 1, "0"), digits[k + 1 :] or "0"
        else:
            whole, frac = "0", "0" * (-k - 1) + digits
        return f"{sign}{whole}.{frac}"
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{sign}{mantissa}e{'+' if k > 0 else '-'}{abs(k)}"


def _spec_string(s: str) -> str:
    short = {
        '"': '\\"',
        "\\": "\\\\",
        "\b": "\\b",
        "\t": "\\t",
        "\n": "\\n",
        "\f": "\\f",
        "\r": "\\r",
    }
    out = []
    for ch in s:
        if ch in short:
            out.append(short[ch])
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _spec_json(value: Any) -> str:
    """SPEC 6.8's canonical JSON of a parsed document (key order as parsed)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _spec_float(value)
    if isinstance(value, str):
        return _spec_string(value)
    if isinstance(value, list):
        return "[" + ",".join(_spec_json(v) for v in value) + "]"
    assert isinstance(value, dict)
    return "{" + ",".join(f"{_spec_string(k)}:{_spec_json(v)}" for k, v in value.items()) + "}"


def test_job_id_vectors_from_library() -> None:
    """JobSpec's canonical JSON and job_id_of give the committed text and ids."""
    for name, fields in _groups("wire", "job_id").items():
        spec = JobSpec.model_validate_json(fields["input"])
        assert spec.model_dump_json() == fields["json"], name
        assert job_id_of(spec) == int(fields["job_id"]), name


def test_job_id_vectors_from_spec() -> None:
    """SPEC 6.8: field order, formatting rules and the CRC-32 rule rebuild each id."""
    cases = _groups("wire", "job_id")
    for name, fields in cases.items():
        text = fields["json"]
        parsed = json.loads(text)
        assert list(parsed) == _SPEC_KEYS and list(parsed["policy"]) == ["name", "config"]
        assert all(
            isinstance(parsed[key], float) for key in ("lr", "lr_decay_start", "lr_end", "eps")
        )
        assert _spec_json(parsed) == text, name
        crc = zlib.crc32(text.encode("utf-8"))
        assert (crc or 1) == int(fields["job_id"]), name
        document = json.loads(fields["input"])
        for key in ("model_options",):
            if key in document:
                assert list(parsed[key]) == list(document[key])  # the document's key order
    assert any(zlib.crc32(f["json"].encode()) == 0 for f in cases.values())
    for value, text in [
        (3000.0, "3000.0"),
        (1.5e-5, "0.000015"),
        (1e-5, "0.00001"),
        (1e-6, "1e-6"),
        (1e16, "1e+16"),
        (1e15, "1000000000000000.0"),
        (1.2345678901234568e17, "1.2345678901234568e+17"),
        (-0.0, "-0.0"),
        (0.30000000000000004, "0.30000000000000004"),
    ]:
        assert _spec_float(value) == text


def test_largest_frame_vector() -> None:
    """SPEC 7.3: 12344 COBS bytes are taken, the 12336-byte payload is oversized."""
    fields = _groups("wire", "frame")["largest"]
    wire = bytes.fromhex(fields["wire"])
    assert wire[0] == wire[-1] == 0 and 0 not in wire[1:-1]
    assert len(wire) - 2 == MAX_ENCODED_FRAME
    (frame,) = FrameReader().feed(wire)
    assert isinstance(frame, Frame)
    assert (frame.seq, frame.flags) == (int(fields["seq"]), int(fields["flags"]))
    assert len(frame.payload) == int(fields["payload_size"]) == MAX_ENCODED_FRAME - 8
    assert hashlib.sha256(frame.payload).hexdigest() == fields["payload_sha256"]
    assert _decode_result(frame.payload)[0] == fields["result"] == "oversized"
    # One more byte in the run and the reader drops it (one error, no frame).
    (error,) = FrameReader().feed(wire[:-1] + b"\x01\x00")
    assert isinstance(error, ProtocolError) and error.kind == "oversized"
