"""Softmax cross-entropy in integer arithmetic: the same bits in numpy, host C and on the M55.

Every board reports its losses to the daemon, which turns them into the update
coefficients, so a loss must not depend on the platform's libm. From int8 logits ``l``
with the output tensor's scale ``s`` (the zero point cancels in a softmax):

    d_j     = max(l) - l_j                        in [0, 255]
    sum     = sum_j E[d_j]                        uint64; E[0] = 2**Q so sum >= 2**Q
    log2    = ilog2_q24(sum) - Q * 2**24          fixed point, 24 fractional bits
    loss_24 = (log2 * LN2_Q32 + 2**31) >> 32  +  S * d_y          (Q24)
    loss_16 = (loss_24 + 128) >> 8                                (Q16, int32)

``E`` (the exp table) and ``S = round(s * 2**24)`` depend on the scale only; they are
data computed once (``exp_table``, exactly, from the float32's bits with Python's
integers) and shipped in the model blob, so the C side only sums, shifts and multiplies.
``protocol/SPEC.md`` section "Integer loss" is the normative text.

FP32 mode uses an ordinary float log-sum-exp (``float_cross_entropy``); its bits are the
same only among processes of one machine.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from qsched.zo.errors import IntLossError

__all__ = [
    "LN2_Q32",
    "LOSS_FRAC_BITS",
    "MAX_SCALE",
    "TABLE_BITS",
    "TABLE_SIZE",
    "IntLossError",
    "batch_loss_q16",
    "batch_losses_of_totals",
    "exp_table",
    "float_cross_entropy",
    "ilog2_q24",
    "loss_q16",
    "q16_to_float",
    "scale_q24",
    "sliced_batch_loss",
    "sliced_batch_losses",
]

TABLE_BITS: Final = 24  # Q: E[0] = 2**24
TABLE_SIZE: Final = 256  # one entry per possible logit difference
LOG_FRAC_BITS: Final = 24
LOSS_FRAC_BITS: Final = 16
NORM_BITS: Final = 30  # the mantissa of log2's argument, in [2**30, 2**31)
# round(ln 2 * 2**32); ln 2 < 1 so it fits a uint32.
LN2_Q32: Final = 0xB17217F8
# Scales at or above this would let S * 255 and the loss leave their integer ranges.
MAX_SCALE: Final = 16.0
# Exact fixed point for the table generator: far more bits than the 24 kept.
_GEN_BITS: Final = 128


def _float32_rational(value: float) -> tuple[int, int]:
    """The float32 nearest ``value`` as an exact (mantissa, exponent): m * 2**e."""
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    exponent = (bits >> 23) & 0xFF
    if bits >> 31 or exponent in (0, 0xFF):
        raise IntLossError(f"output scale must be a positive normal float32, got {value!r}")
    mantissa = (bits & 0x7FFFFF) | 0x800000
    return mantissa, exponent - 150


def _check_scale(scale: float) -> tuple[int, int]:
    mantissa, exponent = _float32_rational(scale)
    if mantissa * 2.0**exponent >= MAX_SCALE:
        raise IntLossError(f"output scale must be below {MAX_SCALE}, got {scale!r}")
    return mantissa, exponent


def scale_q24(scale: float) -> int:
    """S = floor(s * 2**24 + 1/2), exact from the float32's bits.

    Args:
        scale: the output tensor's scale (rounded to float32 first).

    Returns:
        S, a non-negative integer below 2**28.
    """
    mantissa, exponent = _check_scale(scale)
    shift = exponent + 24
    if shift >= 0:
        return mantissa << shift
    return (mantissa + (1 << (-shift - 1))) >> -shift


def _exp_neg_fixed(x_num: int, x_shift: int) -> int:
    """exp(-x) * 2**_GEN_BITS, floor, for x = x_num / 2**x_shift >= 0, in integers only.

    Range reduction by ln 2 would need ln 2 itself; instead halve x until it is below
    2**-8, sum the Taylor series there, and square back: every step is integer math with
    128 fractional bits, so the error stays far below the 2**-24 we keep.
    """
    work_bits = _GEN_BITS + 64
    halvings = max(0, x_num.bit_length() - x_shift + 8)
    # y = x / 2**halvings as a fixed-point number with work_bits fractional bits.
    total_shift = x_shift + halvings
    y = (x_num << work_bits) >> total_shift
    w_one = 1 << work_bits
    term = w_one
    acc = w_one
    n = 1
    while term:
        term = (term * y) >> work_bits
        term //= n
        acc += -term if n % 2 else term
        n += 1
    for _ in range(halvings):
        acc = (acc * acc) >> work_bits
    return acc >> (work_bits - _GEN_BITS)


def exp_table(scale: float) -> npt.NDArray[np.uint32]:
    """E[d] = round(2**24 * exp(-s * d)) for d = 0..255, computed without floating point.

    The exact value of the float32 ``s`` feeds a 128-bit fixed-point exp; the result is
    rounded half up to an integer. ``E[0] = 2**24``.

    Args:
        scale: the output tensor's scale.

    Returns:
        256 uint32 values.
    """
    mantissa, exponent = _check_scale(scale)
    shift = -exponent if exponent < 0 else 0
    base = mantissa << exponent if exponent >= 0 else mantissa
    half = 1 << (_GEN_BITS - TABLE_BITS - 1)
    values = [
        (_exp_neg_fixed(base * d, shift) + half) >> (_GEN_BITS - TABLE_BITS)
        for d in range(TABLE_SIZE)
    ]
    return np.asarray(values, dtype=np.uint32)


def ilog2_q24(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """floor-ish log2 of positive integers with 24 fractional bits, integer-only.

    n = floor(log2 v); x = v normalised to [2**30, 2**31) (left shift, or right shift
    that truncates); then 24 times: x = (x * x) >> 30, and if x >= 2**31 the next bit is
    1 and x >>= 1. Result = (n << 24) | bits.

    Args:
        values: positive uint64 integers below 2**62.

    Returns:
        uint64 array: log2(v) * 2**24, truncated as described.
    """
    v = np.asarray(values, dtype=np.uint64)
    if np.any(v == 0):
        raise IntLossError("log2 of zero")
    n = np.zeros(v.shape, dtype=np.uint64)
    probe = v.copy()
    for width in (32, 16, 8, 4, 2, 1):
        # big is 0 or 1: shift the probe by width where it is at least 2**width.
        big = (probe >> np.uint64(width)) != 0
        amount = big.astype(np.uint64) * np.uint64(width)
        probe >>= amount
        n += amount
    norm = np.uint64(NORM_BITS)
    x = np.where(n <= norm, v << (norm - np.minimum(n, norm)), v >> (np.maximum(n, norm) - norm))
    frac = np.zeros(v.shape, dtype=np.uint64)
    for i in range(1, LOG_FRAC_BITS + 1):
        # x < 2**31, so x * x < 2**62: no overflow in uint64; after >> 30, x < 2**32.
        x *= x
        x >>= norm
        bit = x >> np.uint64(NORM_BITS + 1)  # 1 when x >= 2**31, else 0
        x >>= bit
        frac |= bit << np.uint64(LOG_FRAC_BITS - i)
    result: npt.NDArray[np.uint64] = (n << np.uint64(LOG_FRAC_BITS)) | frac
    return result


def loss_q16(
    logits: npt.NDArray[np.int8],
    labels: npt.NDArray[np.integer],
    table: npt.NDArray[np.uint32],
    s_q24: int,
) -> npt.NDArray[np.int32]:
    """Per-sample cross-entropy in Q16 from int8 logits.

    Args:
        logits: int8 array (..., C); the last axis is the class axis.
        labels: integer labels of shape (...) broadcastable against logits[..., 0].
        table: the 256-entry exp table of the output scale (``exp_table``).
        s_q24: ``scale_q24`` of the output scale.

    Returns:
        int32 array of shape (...): loss * 2**16, rounded as the SPEC says.
    """
    lg = np.asarray(logits)
    if lg.dtype != np.int8:
        raise IntLossError(f"logits must be int8, got {lg.dtype}")
    if table.shape != (TABLE_SIZE,) or int(table[0]) != 1 << TABLE_BITS:
        raise IntLossError("exp table must have 256 entries with E[0] = 2**24")
    classes = lg.shape[-1]
    lab = np.broadcast_to(np.asarray(labels, dtype=np.int64), lg.shape[:-1])
    if np.any((lab < 0) | (lab >= classes)):
        raise IntLossError(f"labels must be in [0, {classes})")
    wide = lg.astype(np.int32)
    d = (wide.max(axis=-1, keepdims=True) - wide).astype(np.int64)
    sums = table.astype(np.uint64)[d].sum(axis=-1, dtype=np.uint64)
    log2 = ilog2_q24(sums) - np.uint64(TABLE_BITS << LOG_FRAC_BITS)
    ln_q24 = (log2 * np.uint64(LN2_Q32) + np.uint64(1 << 31)) >> np.uint64(32)
    d_y = np.take_along_axis(d, lab[..., None], axis=-1)[..., 0].astype(np.uint64)
    total = ln_q24 + np.uint64(s_q24) * d_y
    shift = LOG_FRAC_BITS - LOSS_FRAC_BITS
    return ((total + np.uint64(1 << (shift - 1))) >> np.uint64(shift)).astype(np.int32)


def batch_loss_q16(per_sample: npt.NDArray[np.int32]) -> npt.NDArray[np.int64]:
    """Mean over the last axis: floor(sum of int64 losses / B).

    Args:
        per_sample: int32 losses of shape (..., B).

    Returns:
        int64 array of shape (...).
    """
    ps = np.asarray(per_sample, dtype=np.int64)
    if ps.shape[-1] == 0:
        raise IntLossError("empty batch")
    # Losses are non-negative, so floor division and C's truncating division agree.
    result: npt.NDArray[np.int64] = ps.sum(axis=-1) // ps.shape[-1]
    return result


def sliced_batch_loss(slice_sums: Sequence[int], batch_size: int) -> np.float32:
    """The batch loss, as on the wire, from the Q16 loss sums of slices covering the
    batch once (SPEC 6.10): float32(floor(sum / B) / 65536), the whole batch's bits."""
    return np.float32(sliced_batch_losses([slice_sums], batch_size)[0])


def sliced_batch_losses(slice_sums: Iterable[Sequence[int]], batch_size: int) -> list[float]:
    """``sliced_batch_loss`` of several keys (one sequence of slice sums each), as Python
    floats."""
    return batch_losses_of_totals([sum(map(int, sums)) for sums in slice_sums], batch_size)


def batch_losses_of_totals(totals: Sequence[int], batch_size: int) -> list[float]:
    """``sliced_batch_losses`` of keys whose slice sums are added up already (each total
    the Q16 loss sum of the whole batch): the float32 rounding of all of them in one
    ``array`` conversion, the same round-to-nearest-even as numpy's (a host folds 64 keys
    per step on its way up)."""
    if batch_size < 1:
        raise IntLossError("empty batch")
    return array("f", [(total // batch_size) / 65536.0 for total in totals]).tolist()


def q16_to_float(value: int | np.integer) -> np.float32:
    """A Q16 loss as float32; exact for values below 2**24 (losses below 256)."""
    return np.float32(int(value) / 65536.0)


def float_cross_entropy(
    logits: npt.NDArray[np.float32], labels: npt.NDArray[np.integer]
) -> npt.NDArray[np.float32]:
    """Per-sample softmax cross-entropy in float32, by log-sum-exp (FP32 mode).

    Args:
        logits: float array (..., C).
        labels: integer labels of shape (...).

    Returns:
        float32 losses of shape (...).
    """
    lg = np.asarray(logits, dtype=np.float32)
    lab = np.broadcast_to(np.asarray(labels, dtype=np.int64), lg.shape[:-1])
    top = lg.max(axis=-1, keepdims=True)
    shifted = lg - top
    lse = np.log(np.exp(shifted).sum(axis=-1, dtype=np.float32)).astype(np.float32)
    picked = np.take_along_axis(shifted, lab[..., None], axis=-1)[..., 0]
    result: npt.NDArray[np.float32] = (lse - picked).astype(np.float32)
    return result


# Test vectors shared with the C firmware's test suite (protocol/vectors/intloss.txt).
_VECTOR_SCALES: Final = (0.00390625, 0.0123, 0.0625, 0.1, 0.171875, 0.3, 1.0, 2.5)
_VECTOR_CLASSES: Final = (2, 3, 10, 10, 10, 17, 10, 100)


def _scale_bits(scale: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", scale))[0])


def format_vectors(seed: int = 2024, per_scale: int = 12) -> str:
    """The text of ``protocol/vectors/intloss.txt`` (line format in the SPEC).

    Args:
        seed: numpy seed for the random logits (the file is regenerated by this function).
        per_scale: loss lines per scale.

    Returns:
        The file's text.
    """
    rng = np.random.default_rng(seed)
    lines = [
        "# Integer softmax cross-entropy test vectors (protocol/SPEC.md, 'Integer loss').",
        "# table <scale f32 bits hex> <S = scale_q24 decimal> <E[0..255] as 256 hex words>",
        "# log2 <value hex> <ilog2_q24 decimal>",
        "# loss <scale f32 bits hex> <logits: int8 bytes as hex, two digits each> "
        "<label> <loss_q16 decimal>",
    ]
    probes = [1 << 24, (1 << 24) + 1, 0x2FFFFFF, 10 << 24, 0xFFFFFFFFFF, 0x7FFFFFFF, 3, 1]
    for value, result in zip(probes, ilog2_q24(np.asarray(probes, dtype=np.uint64)), strict=True):
        lines.append(f"log2 {value:x} {int(result)}")
    for scale, classes in zip(_VECTOR_SCALES, _VECTOR_CLASSES, strict=True):
        table = exp_table(scale)
        s_q24 = scale_q24(scale)
        bits = _scale_bits(scale)
        lines.append(f"table {bits:08x} {s_q24} " + " ".join(f"{int(e):x}" for e in table))
        logits = rng.integers(-128, 128, size=(per_scale, classes)).astype(np.int8)
        logits[0] = 0  # all equal: loss = ln(C)
        logits[1] = -128
        logits[1, 0] = 127  # widest spread, label below picks the extremes
        labels = rng.integers(0, classes, size=per_scale)
        labels[1] = 1
        losses = loss_q16(logits, labels, table, s_q24)
        for row, label, loss in zip(logits, labels, losses, strict=True):
            lines.append(
                f"loss {bits:08x} {row.view(np.uint8).tobytes().hex()} {int(label)} {int(loss)}"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(format_vectors())
