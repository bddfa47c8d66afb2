"""Shard planning: which board evaluates which perturbation keys k.

Pure functions, no I/O. The step engine calls ``plan_shards`` once per step and
``reassign`` when an answer is late or lost; throughput estimates come from
``ThroughputEstimate`` (an exponentially weighted average of each board's measured
perturbations per second).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ThroughputEstimate", "plan_shards", "reassign", "split_proportional"]


@dataclass
class ThroughputEstimate:
    """Smoothed samples-per-second of one board.

    Args:
        rate: the current estimate in perturbation samples per second.
        weight: smoothing factor of the exponential average, in (0, 1].
    """

    rate: float = 1.0
    weight: float = 0.3
    observations: int = 0

    def observe(self, samples: int, seconds: float) -> None:
        """Fold one measurement in; the first one replaces the prior outright."""
        if samples <= 0 or seconds <= 0:
            return
        measured = samples / seconds
        self.rate = (
            measured
            if self.observations == 0
            else (1 - self.weight) * self.rate + self.weight * measured
        )
        self.observations += 1


def split_proportional(count: int, weights: Sequence[float]) -> list[int]:
    """Split ``count`` items into len(weights) whole shares proportional to ``weights``.

    Largest-remainder rounding; ties go to the earlier entry, so the result is
    deterministic. Non-positive weights get nothing unless every weight is
    non-positive, in which case the split is even.
    """
    if not weights:
        raise ValueError("no weights to split over")
    positive = [max(w, 0.0) for w in weights]
    total = sum(positive)
    if total <= 0:
        positive, total = [1.0] * len(weights), float(len(weights))
    exact = [count * w / total for w in positive]
    shares = [int(x) for x in exact]
    remainders = sorted(range(len(exact)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in remainders[: count - sum(shares)]:
        shares[i] += 1
    return shares


def plan_shards(ks: Sequence[int], rates: Mapping[str, float]) -> dict[str, list[int]]:
    """Give each board a contiguous run of ``ks`` in proportion to its rate.

    Contiguous runs keep eval requests small (a k range, not a list). Boards are
    taken in sorted id order so the plan is a pure function of its inputs; boards
    that get no keys are left out of the result.
    """
    boards = sorted(rates)
    if not boards:
        return {}
    shares = split_proportional(len(ks), [rates[b] for b in boards])
    plan: dict[str, list[int]] = {}
    start = 0
    for board, share in zip(boards, shares, strict=True):
        if share:
            plan[board] = list(ks[start : start + share])
        start += share
    return plan


def reassign(
    missing: Sequence[int], rates: Mapping[str, float], exclude: set[str]
) -> dict[str, list[int]]:
    """Plan the ``missing`` keys over the boards not in ``exclude``.

    Falls back to every board when all are excluded: a slow board is better than
    no answer.
    """
    candidates = {b: r for b, r in rates.items() if b not in exclude} or dict(rates)
    return plan_shards(missing, candidates)
