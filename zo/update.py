"""Applying one ZO update, (k, c_k) pairs, to the flat trainable vector, to the bit.

The daemon and every board apply the same update and compare a checksum, so the order
of floating-point operations is part of the protocol (``protocol/SPEC.md``, section
"Update arithmetic") and ``firmware/core/update.c`` does exactly the same:

    delta_i = 0.0f;  for (k, c) in pairs, in ascending k:  delta_i += z_ki ? c : -c
    FP32:  theta_i = theta_i + delta_i                                  (float32)
    INT8 + FP16 buffer:
        b      = f16(f32(buf_i) + delta_i)          one rounding, to nearest even,
                                                    saturating at +-65504
        m      = trunc(b)                           whole int8 steps, toward zero
        w_i    = clamp(w_i + m, -127, 127)
        buf_i  = b - m                              exact in FP16 (|result| < 1)

z_ki = +1 or -1 comes from ``prng.rademacher_bits``; c is a float32. In INT8 jobs whose
learning rate is in weight units (``lr_unit = "weight"``, the default) ``delta_i`` is
then multiplied by its channel's gain ``1 / s_c^2`` (``channel_gains``), one float32
rounding: an int8 step of channel c is ``s_c`` in real units, so the float SGD step
``-lr * dL/dw`` is ``-lr / s_c^2 * dL/dq`` in int8 steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from qsched.zo import native
from qsched.zo.prng import rademacher_bits, rademacher_rows

__all__ = [
    "FP16_MAX",
    "INT8_WEIGHT_MAX",
    "accumulate_delta",
    "apply_fp32",
    "apply_int8_fp16",
    "channel_gains",
    "element_channels",
    "perturb_fp32",
    "perturb_int8",
    "to_fp16_saturating",
]

FP16_MAX: Final = np.float32(65504.0)
# Symmetric int8 weights, as TFLite's per-channel quantisation: -128 is never used.
INT8_WEIGHT_MAX: Final = 127
# Sign bits generated per Philox call in accumulate_delta (bounds its memory).
_BITS_PER_CALL: Final = 1 << 22

F32 = npt.NDArray[np.float32]


def _sorted_pairs(pairs: Sequence[tuple[int, float]]) -> list[tuple[int, np.float32]]:
    ks = [k for k, _ in pairs]
    if len(set(ks)) != len(ks):
        raise ValueError("update pairs repeat a sample index k")
    return [(k, np.float32(c)) for k, c in sorted(pairs, key=lambda kc: kc[0])]


def channel_gains(scales: npt.ArrayLike) -> F32:
    """``float32(1 / (s * s))`` per channel, in double from the float32 scales; 0 for a
    scale whose square is not positive (0 or NaN), ``FLT_MAX`` where the quotient is
    above it (SPEC section 4.2)."""
    s = np.asarray(scales, dtype=np.float32).astype(np.float64)
    square = s * s
    positive = square > 0
    quotient = 1.0 / np.where(positive, square, 1.0)
    limit = float(np.finfo(np.float32).max)
    return np.where(positive, np.minimum(quotient, limit), 0.0).astype(np.float32)


def element_channels(tensors: Sequence[tuple[int, int, bool]]) -> npt.NDArray[np.int64]:
    """The channel of every element of the flat vector (SPEC 4.2), numbered across its
    tensors given as ``(elements, channels, channel_minor)``: element ``j`` of a tensor of
    ``n`` elements and ``C`` channels is in its channel ``j mod C`` when
    ``channel_minor`` (depthwise 1HWC), else ``j div (n / C)``."""
    parts, first = [], 0
    for count, channels, minor in tensors:
        j = np.arange(count, dtype=np.int64)
        parts.append(first + (j % channels if minor else j // (count // channels)))
        first += channels
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def accumulate_delta(
    seed: int, step: int, pairs: Sequence[tuple[int, float]], size: int, gain: F32 | None = None
) -> F32:
    """delta = sum_k c_k z_k in float32, summed in ascending k; times ``gain`` (one
    value per element) when given."""
    delta = np.zeros(size, dtype=np.float32)
    ordered = _sorted_pairs(pairs)
    # The bits of many k come from one Philox call (per-call overhead dominates small
    # models), and their signed terms are built at once; the sums still run one k at a
    # time, in the specified order.
    per_call = max(1, _BITS_PER_CALL // max(size, 1))
    for start in range(0, len(ordered), per_call):
        chunk = ordered[start : start + per_call]
        rows = rademacher_rows(seed, step, [k for k, _ in chunk], size)
        coefficients = np.array([c for _, c in chunk], dtype=np.float32)
        if native.available():
            native.accumulate_signed(delta, rows, coefficients)  # the loop below, in C
            continue
        # Row by row on purpose: a numpy reduction over the rows would be sequential
        # only while a row has more than one element (with one, it sums pairwise).
        for term in _signed_terms(coefficients, rows):
            delta += term
    if gain is not None:
        delta *= gain
    return delta


def _signed_terms(coefficients: F32, negative: npt.NDArray[np.bool_]) -> F32:
    """``c_k z_ki`` for every k (a row) and element: ``c_k`` with its sign bit flipped
    where ``z_ki = -1``. Exact, as ``-c`` is (signed zeros included)."""
    rows, size = negative.shape
    terms = np.empty((rows, size), dtype=np.uint32)
    terms[:] = coefficients.view(np.uint32)[:, None]
    terms ^= negative.view(np.uint8).astype(np.uint32) << np.uint32(31)
    return terms.view(np.float32)


def apply_fp32(theta: F32, seed: int, step: int, pairs: Sequence[tuple[int, float]]) -> F32:
    """Return theta + sum_k c_k z_k (a new array)."""
    delta = accumulate_delta(seed, step, pairs, theta.size)
    return (theta.astype(np.float32) + delta).astype(np.float32)


def to_fp16_saturating(values: F32) -> npt.NDArray[np.float16]:
    """Round float32 to FP16 (nearest even), clamping to the largest finite value."""
    clipped = np.clip(values, -FP16_MAX, FP16_MAX)
    return clipped.astype(np.float16)


def apply_int8_fp16(
    weights: npt.NDArray[np.int8],
    buffer: npt.NDArray[np.float16],
    seed: int,
    step: int,
    pairs: Sequence[tuple[int, float]],
    gain: F32 | None = None,
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float16]]:
    """INT8 weights with an FP16 accumulation buffer; returns new (weights, buffer).
    ``gain``: per-element channel gains (weight-unit learning rate), else none."""
    delta = accumulate_delta(seed, step, pairs, weights.size, gain)
    summed = to_fp16_saturating(buffer.astype(np.float32) + delta)
    moves = np.trunc(summed.astype(np.float32))
    new_weights = np.clip(
        weights.astype(np.int32) + moves.astype(np.int32), -INT8_WEIGHT_MAX, INT8_WEIGHT_MAX
    )
    # summed - trunc(summed) is exactly representable in FP16 (it only drops bits).
    remainder = (summed.astype(np.float32) - moves).astype(np.float16)
    return new_weights.astype(np.int8), remainder


def perturb_fp32(theta: F32, seed: int, step: int, k: int, eps: float, sign: int) -> F32:
    """theta + sign * eps * z_k, in float32."""
    negative = rademacher_bits(seed, step, k, theta.size)
    step_size = np.float32(eps) * np.float32(sign)
    return (theta + np.where(negative, -step_size, step_size)).astype(np.float32)


def perturb_int8(
    weights: npt.NDArray[np.int8], seed: int, step: int, k: int, eps: int, sign: int
) -> npt.NDArray[np.int8]:
    """weights + sign * eps * z_k in whole int8 steps, saturating at +-127."""
    negative = rademacher_bits(seed, step, k, weights.size)
    moves = np.where(negative, -eps * sign, eps * sign)
    moved = weights.astype(np.int32) + moves
    return np.clip(moved, -INT8_WEIGHT_MAX, INT8_WEIGHT_MAX).astype(np.int8)
