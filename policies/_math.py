"""Pure helpers shared by the q policies: allowed-value ladders, EMA, improvement, drift.

Everything here is a plain function of its arguments, computed in Python floats, so
a policy's decisions are reproducible on any machine and survive a JSON round trip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Literal

__all__ = [
    "Direction",
    "default_allowed",
    "ema",
    "floor_allowed",
    "improved",
    "next_allowed",
    "ols_drift",
    "validate_allowed",
]

Direction = Literal["max", "min"]


def default_allowed(q0: int, qmax: int) -> tuple[int, ...]:
    """The default ladder: q0, the powers of two above it, and qmax.

    Args:
        q0: the first value (>= 1).
        qmax: the cap (>= q0); included so the cap is reachable when it is no power of two.

    Returns:
        Sorted unique values from q0 to qmax.
    """
    values = {q0, qmax}
    power = 1
    while power <= qmax:
        if power > q0:
            values.add(power)
        power *= 2
    return tuple(sorted(values))


def validate_allowed(values: Sequence[int], q0: int, qmax: int) -> tuple[int, ...]:
    """Check a user-given ladder of allowed q values.

    Args:
        values: the ladder.
        q0: the starting q, which must be on the ladder.
        qmax: the cap no value may exceed.

    Returns:
        The ladder as a tuple.

    Raises:
        ValueError: empty, not positive, not strictly increasing, missing q0, or above qmax.
    """
    ladder = tuple(int(v) for v in values)
    if not ladder:
        raise ValueError("allowed values are empty")
    if ladder[0] < 1:
        raise ValueError(f"allowed values must be >= 1, got {ladder[0]}")
    if any(b <= a for a, b in pairwise(ladder)):
        raise ValueError(f"allowed values must be sorted and unique, got {list(ladder)}")
    if q0 not in ladder:
        raise ValueError(f"allowed values must contain q0={q0}, got {list(ladder)}")
    if ladder[-1] > qmax:
        raise ValueError(f"allowed values must be <= qmax={qmax}, got {ladder[-1]}")
    return ladder


def next_allowed(q: int, allowed: Sequence[int], qmax: int) -> int:
    """The next rung above q, or q itself when there is none at or below qmax.

    Args:
        q: the current q.
        allowed: sorted ladder.
        qmax: the cap.

    Returns:
        The smallest allowed value > q that is <= qmax, else q (never lower).
    """
    for value in allowed:
        if q < value <= qmax:
            return value
    return q


def floor_allowed(q: int, allowed: Sequence[int]) -> int:
    """Round q down onto the ladder (the lowest rung when q is below all of it).

    Args:
        q: any q.
        allowed: sorted, non-empty ladder.

    Returns:
        The largest allowed value <= q, or ``allowed[0]``.
    """
    below = [value for value in allowed if value <= q]
    return below[-1] if below else allowed[0]


def ema(previous: float | None, value: float, factor: float) -> float:
    """Exponential moving average ``factor * previous + (1 - factor) * value``.

    Args:
        previous: the average so far, or None before the first value (which is taken as is,
            so the average has no start-up bias toward zero).
        value: the new observation.
        factor: weight of the past, in [0, 1).

    Returns:
        The updated average.
    """
    if previous is None:
        return float(value)
    return float(factor * previous + (1.0 - factor) * value)


def improved(
    value: float, best: float, min_delta: float, direction: Direction, relative: bool
) -> bool:
    """Whether ``value`` beats ``best`` by more than the threshold.

    Args:
        value: the new metric value.
        best: the best value so far.
        min_delta: the margin; an absolute amount, or a fraction of |best| when relative.
        direction: "max" (higher is better) or "min".
        relative: interpret min_delta as a fraction of |best|.

    Returns:
        True when it is an improvement by more than the margin.
    """
    margin = min_delta * abs(best) if relative else min_delta
    if direction == "max":
        return value > best + margin
    return value < best - margin


def ols_drift(values: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope of a series over its index, and the slope's squared standard error.

    Args:
        values: at least three equally spaced observations.

    Returns:
        ``(slope, se2)``: change per index, and the variance of that estimate from the
        residuals (``residual variance / sum (x - mean x)^2``, with n - 2 degrees of freedom).

    Raises:
        ValueError: fewer than three values.
    """
    n = len(values)
    if n < 3:
        raise ValueError(f"a drift needs at least 3 values, got {n}")
    x_mean = (n - 1) / 2.0
    y_mean = math.fsum(values) / n
    sxx = math.fsum((i - x_mean) ** 2 for i in range(n))
    sxy = math.fsum((i - x_mean) * (y - y_mean) for i, y in enumerate(values))
    slope = sxy / sxx
    residuals = math.fsum((y - y_mean - slope * (i - x_mean)) ** 2 for i, y in enumerate(values))
    return slope, residuals / (n - 2) / sxx
