"""Shared policy math: ladders, EMA, improvement checks and the loss drift."""

from __future__ import annotations

import random

import pytest

from qsched.policies._math import (
    Direction,
    default_allowed,
    ema,
    floor_allowed,
    improved,
    next_allowed,
    ols_drift,
    validate_allowed,
)


def test_default_allowed_powers_of_two() -> None:
    """The default ladder from 1 to 32 is the powers of two."""
    assert default_allowed(1, 32) == (1, 2, 4, 8, 16, 32)


def test_default_allowed_odd_ends() -> None:
    """q0 and qmax are rungs even when they are no powers of two."""
    assert default_allowed(3, 48) == (3, 4, 8, 16, 32, 48)
    assert default_allowed(5, 5) == (5,)


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ((), "empty"),
        ((0, 1, 2), ">= 1"),
        ((1, 4, 2), "sorted and unique"),
        ((1, 2, 2), "sorted and unique"),
        ((2, 4), "contain q0=1"),
        ((1, 2, 64), "<= qmax=32"),
    ],
)
def test_validate_allowed_rejects(values: tuple[int, ...], fragment: str) -> None:
    """Each broken ladder is refused with a message saying what is wrong."""
    with pytest.raises(ValueError, match=fragment):
        validate_allowed(values, 1, 32)


def test_validate_allowed_accepts() -> None:
    """A sorted unique ladder with q0 below qmax comes back as a tuple."""
    assert validate_allowed([1, 3, 9, 27], 1, 32) == (1, 3, 9, 27)


def test_next_allowed_steps_one_rung() -> None:
    """The next rung is the smallest value above q."""
    assert next_allowed(1, (1, 2, 4, 8), 8) == 2
    assert next_allowed(3, (1, 2, 4, 8), 8) == 4


def test_next_allowed_stops_at_top_and_cap() -> None:
    """At the top of the ladder, or when the next rung exceeds qmax, q stays."""
    assert next_allowed(8, (1, 2, 4, 8), 8) == 8
    assert next_allowed(4, (1, 2, 4, 8), 6) == 4


def test_floor_allowed_rounds_down() -> None:
    """q is rounded down onto the ladder, or up to its first rung when below it."""
    assert floor_allowed(7, (2, 4, 8)) == 4
    assert floor_allowed(8, (2, 4, 8)) == 8
    assert floor_allowed(1, (2, 4, 8)) == 2


def test_ema_first_value_and_update() -> None:
    """The first value is taken as is; later ones mix with weight 1 - factor."""
    assert ema(None, 3.0, 0.9) == 3.0
    assert ema(2.0, 4.0, 0.75) == pytest.approx(2.5)


@pytest.mark.parametrize(
    ("value", "best", "direction", "relative", "expected"),
    [
        (0.81, 0.80, "max", False, True),
        (0.801, 0.80, "max", False, False),
        (0.79, 0.80, "max", False, False),
        (0.99, 1.00, "min", True, True),
        (0.999, 1.00, "min", True, False),
        (1.01, 1.00, "min", True, False),
    ],
)
def test_improved_margin_and_direction(
    value: float, best: float, direction: Direction, relative: bool, expected: bool
) -> None:
    """An improvement must beat the best by more than min_delta in the metric's sense."""
    assert improved(value, best, 0.002, direction, relative) is expected


def test_ols_drift_exact_line() -> None:
    """A noiseless line has its slope and zero standard error."""
    slope, se2 = ols_drift([5.0 - 0.25 * i for i in range(10)])
    assert slope == pytest.approx(-0.25)
    assert se2 == pytest.approx(0.0, abs=1e-20)


def test_ols_drift_noise_scale() -> None:
    """For white noise the squared standard error is about sigma^2 / sum (x - mean)^2."""
    rng = random.Random(7)
    n, sigma = 200, 0.5
    slope, se2 = ols_drift([rng.gauss(0.0, sigma) for _ in range(n)])
    sxx = n * (n * n - 1) / 12.0
    assert se2 == pytest.approx(sigma**2 / sxx, rel=0.25)
    assert abs(slope) < 4 * se2**0.5


def test_ols_drift_needs_three() -> None:
    """Two points give no residual degrees of freedom: refused."""
    with pytest.raises(ValueError, match="at least 3"):
        ols_drift([1.0, 2.0])
