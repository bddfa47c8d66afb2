"""Fixed-point helpers against scalar Python versions of TFLite's integer recipes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qsched.zo.fixedpoint import (
    INT32_MAX,
    INT32_MIN,
    multiply_by_quantized_multiplier,
    quantize_multiplier,
    round_half_away,
    rounding_divide_by_pot,
    saturating_rounding_doubling_high_mul,
    wrap_int32,
)


def _c_div(a: int, b: int) -> int:
    """C integer division (truncation toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _srdhm(a: int, b: int) -> int:
    if a == b == INT32_MIN:
        return INT32_MAX
    ab = a * b
    nudge = (1 << 30) if ab >= 0 else 1 - (1 << 30)
    return _c_div(ab + nudge, 1 << 31)


def _rdbpot(x: int, e: int) -> int:
    mask = (1 << e) - 1
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> e) + (1 if (x & mask) > threshold else 0)


def _edge_values() -> list[int]:
    return [INT32_MIN, INT32_MIN + 1, -(2**30), -12345, -3, -1, 0, 1, 2, 3, 12345, 2**30, INT32_MAX]


def test_srdhm_saturates_int32_min_squared() -> None:
    """INT32_MIN * INT32_MIN is the one overflow and saturates to INT32_MAX."""
    assert saturating_rounding_doubling_high_mul(INT32_MIN, INT32_MIN) == INT32_MAX
    assert saturating_rounding_doubling_high_mul(INT32_MIN, INT32_MAX) == _srdhm(
        INT32_MIN, INT32_MAX
    )


def test_srdhm_matches_scalar_on_edges_and_random() -> None:
    """Vectorised SRDHM equals the scalar C recipe, signs and rounding included."""
    rng = np.random.default_rng(1)
    edges = _edge_values()
    a = np.array(edges * len(edges) + list(rng.integers(INT32_MIN, INT32_MAX, 2000)), np.int64)
    b = np.array(
        [e for e in edges for _ in edges] + list(rng.integers(INT32_MIN, INT32_MAX, 2000)), np.int64
    )
    got = saturating_rounding_doubling_high_mul(a, b)
    assert got.tolist() == [_srdhm(int(x), int(y)) for x, y in zip(a, b, strict=True)]


def test_rounding_divide_by_pot_rounds_half_away_from_zero() -> None:
    """Halves round away from zero on both signs; exponent 0 is the identity."""
    x = np.array([5, -5, 4, -4, 6, -6, 7, -7, 0, INT32_MIN, INT32_MAX])
    assert rounding_divide_by_pot(x, 1).tolist() == [3, -3, 2, -2, 3, -3, 4, -4, 0, -(2**30), 2**30]
    assert rounding_divide_by_pot(x, 0).tolist() == x.tolist()
    big = np.array([INT32_MIN, INT32_MAX, -(2**30), -(2**30) + 1, 2**30 - 1])
    assert rounding_divide_by_pot(big, 31).tolist() == [-1, 1, -1, 0, 0]


def test_rounding_divide_by_pot_matches_scalar_per_element_shift() -> None:
    """Per-element exponents broadcast, equal to the scalar recipe."""
    rng = np.random.default_rng(2)
    x = rng.integers(INT32_MIN, INT32_MAX, 3000)
    e = rng.integers(0, 32, 3000)
    assert rounding_divide_by_pot(x, e).tolist() == [
        _rdbpot(int(v), int(s)) for v, s in zip(x, e, strict=True)
    ]


def test_rounding_divide_by_pot_rejects_bad_exponent() -> None:
    """Exponents outside [0, 31] are a caller bug and raise."""
    with pytest.raises(ValueError, match="exponent"):
        rounding_divide_by_pot(np.array([1]), 32)


def test_quantize_multiplier_known_values() -> None:
    """frexp mantissa to 31 bits: exact powers of two, carries and flush to zero."""
    real = np.array([0.0, 0.5, 1.0, 0.75, 1.0 - 2.0**-33, 2.0**-40, 3.0])
    m, s = quantize_multiplier(real)
    assert m.tolist() == [0, 2**30, 2**30, 3 * 2**29, 2**30, 0, 3 * 2**29]
    assert s.tolist() == [0, 0, 1, 0, 1, 0, 2]


def test_quantize_multiplier_matches_scalar_frexp() -> None:
    """Random multipliers: math.frexp plus C round, and m * 2^(s-31) close to the input."""
    rng = np.random.default_rng(3)
    real = np.exp(rng.uniform(-20, 3, 500))
    m, s = quantize_multiplier(real)
    for r, mi, si in zip(real, m, s, strict=True):
        mant, exp = math.frexp(float(r))
        q = math.floor(mant * 2**31 + 0.5)  # mantissa > 0: half up == half away
        if q == 2**31:
            q, exp = q // 2, exp + 1
        assert (int(mi), int(si)) == (q, exp)
        assert abs(int(mi) * 2.0 ** (int(si) - 31) - r) <= r * 2.0**-30


def test_quantize_multiplier_rejects_negative() -> None:
    """Negative multipliers do not occur in int8 inference and raise."""
    with pytest.raises(ValueError, match="non-negative"):
        quantize_multiplier(np.array([-0.5]))


@pytest.mark.parametrize(("low", "high"), [(-31, 1), (-20, 3), (0, 1)])
def test_multiply_by_quantized_multiplier_double_rounding(low: int, high: int) -> None:
    """Reference arithmetic: left shift in int32, SRDHM, then rounding right shift.

    Right shifts only (one fused shift), mixed signs (general path) and shift 0.
    """
    rng = np.random.default_rng([4, -low, high])
    x = np.concatenate(
        [rng.integers(INT32_MIN, INT32_MAX, 1000), rng.integers(-(2**12), 2**12, 3000)]
    )
    m = rng.integers(2**30, 2**31, x.size)
    s = rng.integers(low, high, x.size)
    # Exact ties of the rounding shift: x * m with its low 31 + e bits at a half.
    m[:200] = 2**30
    got = multiply_by_quantized_multiplier(x, m, s)
    expected = []
    for xi, mi, si in zip(x.tolist(), m.tolist(), s.tolist(), strict=True):
        shifted = int(wrap_int32(xi << max(si, 0)))
        expected.append(_rdbpot(_srdhm(shifted, mi), max(-si, 0)))
    assert got.tolist() == expected


def test_multiply_by_quantized_multiplier_single_rounding() -> None:
    """Single rounding: floor((x * m + 2^(30 - s)) / 2^(31 - s)), halves rounded up."""
    x = np.array([-3, -1, 1, 3, -(2**20) - 1, 2**20 + 1])
    got = multiply_by_quantized_multiplier(x, 2**30, -1, single_rounding=True)
    assert got.tolist() == [(v * 2**30 + 2**31) >> 32 for v in x.tolist()]
    # -3 / 4 = -0.75 -> -1; the double-rounding path agrees there but not on ties below.
    ties = np.array([-6, -2, 2, 6])
    single = multiply_by_quantized_multiplier(ties, 2**30, -1, single_rounding=True)
    double = multiply_by_quantized_multiplier(ties, 2**30, -1)
    assert single.tolist() == [-1, 0, 1, 2]
    assert double.tolist() == [-2, -1, 1, 2]


def test_round_half_away_from_zero() -> None:
    """C round: halves away from zero, and the float just below 0.5 stays 0."""
    below_half = np.nextafter(np.float32(0.5), np.float32(0.0))
    x = np.array([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, below_half, -below_half, 0.0], np.float32)
    assert round_half_away(x).tolist() == [1, -1, 2, -2, 3, -3, 0, 0, 0]
    assert round_half_away(x).dtype == np.float32


def test_wrap_int32_two_complement() -> None:
    """Values past int32 wrap as an int32 store does."""
    assert wrap_int32(np.array([2**31, -(2**31) - 1, 5, 2**32 + 7])).tolist() == [
        INT32_MIN,
        INT32_MAX,
        5,
        7,
    ]
