"""TFLite's fixed-point requantisation, vectorised over int64 numpy arrays.

The INT8 engine must equal TFLite's reference integer kernels bit for bit, so these are
the same integer recipes (``tensorflow/lite/kernels/internal/common.h`` and
``kernel_util.cc``), written as pure functions over arrays:

- ``quantize_multiplier``: a positive real multiplier ``M`` becomes a 31-bit mantissa
  ``m`` in ``[2^30, 2^31)`` and a power-of-two exponent ``s`` with ``M ~= m * 2^(s-31)``
  (``frexp``, then round half away from zero).
- ``multiply_by_quantized_multiplier``: ``x * M`` in integers. The default is the
  reference build's double rounding: saturating rounding doubling high multiply, then
  a rounding right shift. TFLite's ``TFLITE_SINGLE_ROUNDING`` variant (one rounding of
  ``x * m`` by ``31 - s`` bits) is available with ``single_rounding=True``.

Every intermediate is held in int64, where it cannot overflow: ``|x * m| <= 2^62``.
Results are int64 arrays with int32 values; callers cast when they store.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "multiply_by_quantized_multiplier",
    "quantize_multiplier",
    "round_half_away",
    "rounding_divide_by_pot",
    "saturating_rounding_doubling_high_mul",
    "wrap_int32",
]

INT32_MIN: Final = -(2**31)
INT32_MAX: Final = 2**31 - 1

I64 = npt.NDArray[np.int64]
IntLike = npt.ArrayLike


def wrap_int32(x: IntLike) -> I64:
    """Two's-complement wrap of integer values to int32 range (what an int32 store does)."""
    v = np.asarray(x, dtype=np.int64)
    return ((v + 2**31) & 0xFFFFFFFF) - 2**31


def round_half_away(x: npt.ArrayLike) -> npt.NDArray[np.floating]:
    """C's ``round``: to the nearest integer, halves away from zero, in the input's precision.

    ``floor(x + 0.5)`` is wrong for the float just below 0.5 (the add rounds up), so the
    fraction is taken exactly with ``trunc`` instead.
    """
    v = np.asarray(x)
    if not np.issubdtype(v.dtype, np.floating):
        v = v.astype(np.float64)
    whole = np.trunc(v)
    frac = v - whole  # exact: both operands share the exponent range of v
    rounded: npt.NDArray[np.floating] = whole + np.where(np.abs(frac) >= 0.5, np.sign(v), 0).astype(
        v.dtype
    )
    return rounded


def quantize_multiplier(real: npt.ArrayLike) -> tuple[I64, I64]:
    """TFLite ``QuantizeMultiplier`` for an array of non-negative doubles.

    Args:
        real: multipliers (float64; an effective scale such as in*w/out).

    Returns:
        ``(multiplier, shift)`` int64 arrays: multiplier in ``[2^30, 2^31)`` (0 for a zero
        or tiny multiplier), shift the exponent (positive = left shift).
    """
    r = np.asarray(real, dtype=np.float64)
    if np.any(r < 0) or not np.all(np.isfinite(r)):
        raise ValueError("quantized multipliers must be finite and non-negative")
    mantissa, exponent = np.frexp(r)
    q = round_half_away(mantissa * float(2**31)).astype(np.int64)
    exp = exponent.astype(np.int64)
    # Rounding may carry to exactly 2^31: renormalise to 2^30 with one more bit of shift.
    carry = q == 2**31
    q = np.where(carry, q // 2, q)
    exp = np.where(carry, exp + 1, exp)
    # Below 2^-31 every bit would be shifted out: TFLite flushes to a zero multiplier.
    tiny = exp < -31
    q = np.where(tiny | (r == 0), 0, q)
    exp = np.where(tiny | (r == 0), 0, exp)
    return q, exp


def saturating_rounding_doubling_high_mul(a: IntLike, b: IntLike) -> I64:
    """gemmlowp's SaturatingRoundingDoublingHighMul: ``a * b / 2^31`` rounded, saturated.

    The C code adds a nudge (``2^30``, or ``1 - 2^30`` for a negative product) and
    divides truncating toward zero. For a negative product ``v = ab + 1 - 2^30`` is
    negative and ``trunc(v / 2^31) = floor((v + 2^31 - 1) / 2^31)``, which is
    ``floor((ab + 2^30) / 2^31)`` — the same expression as for a non-negative product.
    So one add and one arithmetic shift do it. The only overflow, INT32_MIN * INT32_MIN,
    is the only case above INT32_MAX, and saturates there.
    """
    b64 = np.asarray(b, dtype=np.int64)
    ab = np.asarray(a, dtype=np.int64) * b64  # |ab| <= 2^62
    ab += 1 << 30
    ab >>= 31
    if np.any(b64 == INT32_MIN):
        ab = np.minimum(ab, INT32_MAX)
    return np.asarray(ab, dtype=np.int64)


def rounding_divide_by_pot(x: IntLike, exponent: IntLike) -> I64:
    """gemmlowp's RoundingDivideByPOT: x / 2^exponent, rounding half away from zero.

    The C form is ``(x >> e) + (remainder > threshold)`` with ``threshold = half - 1``
    for negative x. Equivalently ``(x + half - [x < 0]) >> e`` for ``e >= 1`` (halves
    of negative values land on ``-half - 1`` and floor away from zero), where
    ``-[x < 0]`` is the sign word ``x >> 63``; ``e = 0`` is the identity.

    Args:
        x: int32 values.
        exponent: shift in [0, 31], broadcast against x.
    """
    x64 = np.asarray(x, dtype=np.int64)
    e = np.asarray(exponent, dtype=np.int64)
    if np.any(e < 0) or np.any(e > 31):
        raise ValueError("rounding_divide_by_pot exponent must be in [0, 31]")
    if np.all(e == 0):
        return x64.copy()
    out = x64 >> 63
    if not np.all(e > 0):
        out *= e > 0  # no correction where the shift is 0
    out += x64
    out += (np.int64(1) << e) >> 1
    out >>= e
    return out


def multiply_by_quantized_multiplier(
    x: IntLike, multiplier: IntLike, shift: IntLike, *, single_rounding: bool = False
) -> I64:
    """TFLite ``MultiplyByQuantizedMultiplier(x, multiplier, shift)`` over arrays.

    Args:
        x: int32 accumulator values (int64 array with int32 values).
        multiplier: quantized multipliers from ``quantize_multiplier``, broadcast.
        shift: their exponents, broadcast.
        single_rounding: the ``TFLITE_SINGLE_ROUNDING`` build's arithmetic instead of
            the reference build's double rounding.

    Returns:
        The int32 results as int64 values.
    """
    x64 = np.asarray(x, dtype=np.int64)
    m = np.asarray(multiplier, dtype=np.int64)
    s = np.asarray(shift, dtype=np.int64)
    if single_rounding:
        # TFLite clamps shift to <= 30 (multiplier to 2^31-1) in this build.
        big = s > 30
        m = np.where(big, 2**31 - 1, m)
        s = np.where(big, 30, s)
        total = 31 - s
        rounded = x64 * m
        rounded += np.int64(1) << (total - 1)
        rounded >>= total
        return np.asarray(rounded, dtype=np.int64)
    if np.all(s <= 0) and np.all(m >= 0):
        return _double_rounding_right_shift(x64, m, -s)
    right = np.maximum(-s, 0)
    if np.any(s > 0):
        # The C code shifts in int32; a left shift only happens for multipliers > 1.
        x64 = wrap_int32(x64 << np.maximum(s, 0))
    return rounding_divide_by_pot(saturating_rounding_doubling_high_mul(x64, m), right)


def _double_rounding_right_shift(x: I64, m: I64, e: I64) -> I64:
    """``RoundingDivideByPOT(SRDHM(x, m), e)`` as one shift of ``x * m``, for m >= 0.

    With ``h = SRDHM(x, m) = floor((x*m + 2^30) / 2^31)`` and, for ``e >= 1``,
    ``RDBPOT(h, e) = floor((h + half - [h < 0]) / 2^e)``: adding an integer commutes with
    floor and ``floor(floor(y) / d) = floor(y / d)`` for an integer d, so the result is
    ``floor((x*m + 2^30 + (half - [h < 0]) * 2^31) / 2^(31 + e))``, where ``h < 0``
    exactly when ``x*m + 2^30 < 0``. For ``e = 0`` it is ``h`` itself. m >= 0 rules out
    SRDHM's one saturating case. Every term stays below 2^63.
    """
    half = (np.int64(1) << e) >> 1
    t = x * m
    t += (1 << 30) + (half << 31)
    if np.any(e > 0):
        # t < half * 2^31 is x*m + 2^30 < 0. The sign word of t - threshold is -1 there
        # and 0 elsewhere; shifted to -2^31 it is the correction. A threshold of -2^62
        # (below every x*m + 2^30, without overflow) turns it off where e = 0.
        threshold = np.where(e > 0, half << 31, np.int64(-(2**62)))
        sign = t - threshold
        sign >>= 63
        sign <<= 31
        t += sign
    t >>= 31 + e
    return np.asarray(t, dtype=np.int64)
