"""Shard planning: which board evaluates which perturbation keys k, on which samples.

Pure functions, no I/O. The step engine calls ``plan_units`` once per step and again
when an answer is late or lost; throughput estimates come from ``ThroughputEstimate``
(an exponentially weighted average of each board's measured perturbations per second).

A step's work is ``q`` keys on a batch of ``B`` samples. In INT8 mode one key's batch
may be split into ``parts`` contiguous slices (SPEC 6.10): the work units are then
(key, slice) pairs, numbered ``part * q + k``; ``choose_split`` picks the split from
the boards' measured rates.
"""

from __future__ import annotations

import functools
import heapq
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from qsched.protocol.messages import MAX_SLICE_KS

__all__ = [
    "MIN_SPLIT_GAIN",
    "RATE_NOISE",
    "StepSplit",
    "ThroughputEstimate",
    "batch_slices",
    "choose_split",
    "estimate_for",
    "even_or_proportional",
    "observe_split",
    "plan_shards",
    "plan_units",
    "predicted_seconds",
    "reassign",
    "slice_counts",
    "split_proportional",
]

# How much slower than the proportional split an even split may be predicted and still
# be taken: measured rates of equal boards differ by about this much.
RATE_NOISE: Final = 0.1

# A split must shorten the predicted step by this fraction to be taken: the throughput
# model has no per-request cost, and every slice costs a request and a reply.
MIN_SPLIT_GAIN: Final = 0.15


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

    def observe(self, samples: float, seconds: float) -> None:
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
    positive = [0.0 if w < 0.0 else w for w in weights]  # max(w, 0.0), inline
    total = sum(positive)
    if total <= 0:
        positive, total = [1.0] * len(weights), float(len(weights))
    exact = [count * w / total for w in positive]
    shares = [int(x) for x in exact]
    fractions = [x - s for x, s in zip(exact, shares, strict=True)]
    # The largest remainders, ties to the earlier entry (nsmallest is sorted()[:n]).
    left = count - sum(shares)
    for i in heapq.nsmallest(left, range(len(exact)), key=lambda i: (-fractions[i], i)):
        shares[i] += 1
    return shares


def even_or_proportional(count: int, rates: Sequence[float]) -> list[int]:
    """Shares of ``count`` keys: even (the remainder to the fastest boards) unless the
    proportional split (``split_proportional``) is predicted faster by more than
    ``RATE_NOISE``.

    Measured rates of boards of one kind differ by their noise, and a proportional
    split turns a 3 % difference into one key more for one board: with a key or two
    per board, or behind an aggregate whose members take whole keys, that one key is
    a second round, the board's next rate falls, and the extra key moves to another
    board, step after step.
    """
    proportional = split_proportional(count, rates)
    n = len(rates)
    fastest = sorted(range(n), key=lambda i: (-rates[i], i))
    even = [count // n] * n
    for i in fastest[: count % n]:
        even[i] += 1
    if _makespan(even, rates) <= _makespan(proportional, rates) * (1 + RATE_NOISE):
        return even
    return proportional


def _makespan(shares: Sequence[int], rates: Sequence[float]) -> float:
    return max(map(operator.truediv, shares, [1e-12 if r < 1e-12 else r for r in rates]))


def plan_shards(ks: Sequence[int], rates: Mapping[str, float]) -> dict[str, list[int]]:
    """Give each board a contiguous run of ``ks`` in proportion to its rate, or evenly
    when that is predicted to be at most ``RATE_NOISE`` slower (``even_or_proportional``).

    Contiguous runs keep eval requests small (a k range, not a list). Boards are
    taken in sorted id order so the plan is a pure function of its inputs; boards
    that get no keys are left out of the result.
    """
    boards = sorted(rates)
    if not boards:
        return {}
    shares = even_or_proportional(len(ks), [rates[b] for b in boards])
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


def estimate_for(
    whole: ThroughputEstimate, sliced: Mapping[int, ThroughputEstimate], parts: int
) -> ThroughputEstimate:
    """A board's rate on whole batches (``parts`` 1) or on slices of ``parts`` per key;
    slices not measured yet take the whole-batch estimate (so a split is tried once at
    face value, then judged on what it measured)."""
    if parts == 1:
        return whole
    estimate = sliced.get(parts)
    return estimate if estimate is not None and estimate.observations else whole


def observe_split(
    whole: ThroughputEstimate,
    sliced: dict[int, ThroughputEstimate],
    parts: int,
    cost: float,
    seconds: float,
) -> None:
    """Fold one shard's time (``cost`` whole-batch keys) into the estimate of its kind."""
    if parts == 1:
        whole.observe(cost, seconds)
    else:
        sliced.setdefault(parts, ThroughputEstimate()).observe(cost, seconds)


def batch_slices(batch_size: int, parts: int) -> list[tuple[int, int]]:
    """(start, count) of each of ``parts`` contiguous slices of a batch: slice j starts at
    floor(j * batch_size / parts) (SPEC 6.10)."""
    if not 1 <= parts <= batch_size:
        raise ValueError(f"cannot cut {batch_size} samples into {parts} slices")
    starts = [j * batch_size // parts for j in range(parts + 1)]
    return [(starts[j], starts[j + 1] - starts[j]) for j in range(parts)]


@dataclass(frozen=True)
class StepSplit:
    """How a step's keys and samples become work units: unit ``part * q + k`` is key k
    on slice ``part`` of the batch (``parts`` = 1: whole-batch keys, unit = k).

    Args:
        q: keys of the step.
        batch_size: samples of its minibatch.
        parts: slices per key, 1 .. batch_size.
    """

    q: int
    batch_size: int
    parts: int = 1

    @property
    def units(self) -> range:
        """Every unit of the step."""
        return range(self.q * self.parts)

    def key(self, unit: int) -> int:
        """The perturbation key of a unit."""
        return unit % self.q

    def part(self, unit: int) -> int:
        """The slice index of a unit."""
        return unit // self.q

    def unit(self, key: int, part: int) -> int:
        """The unit of key ``key`` on slice ``part``."""
        return part * self.q + key

    @functools.cached_property
    def slices(self) -> list[tuple[int, int]]:
        """(start, count) of every slice, in order (``batch_slices``, computed once)."""
        return batch_slices(self.batch_size, self.parts)

    def bounds(self, part: int) -> tuple[int, int]:
        """(start, count) of slice ``part``."""
        return self.slices[part]

    def part_of(self, start: int, count: int) -> int | None:
        """The slice index with these bounds (None: not a slice of this split)."""
        return self.slices.index((start, count)) if (start, count) in self.slices else None

    def cost(self, units: Sequence[int]) -> float:
        """Work of ``units`` in whole-batch keys (what ``ThroughputEstimate`` counts)."""
        if self.parts == 1:
            return float(len(units))
        counts, q = self._counts, self.q
        return sum(counts[u // q] for u in units) / self.batch_size

    @functools.cached_property
    def _counts(self) -> tuple[int, ...]:
        """Samples of each slice, by slice index."""
        return tuple(count for _, count in self.slices)


def plan_units(
    split: StepSplit, units: Sequence[int], rates: Mapping[str, float]
) -> dict[str, list[int]]:
    """Give boards the ``units``, each board's from a single slice (one request).

    Unsplit, this is ``plan_shards``. Split, every slice with units gets a group of
    boards: at least one each, then every other board, fastest first, joins the group
    with the least rate per unit (ties: the lower slice); each group shares its slice's
    keys by rate. With fewer boards than slices, board i takes the whole i-th slice
    and the others wait for the next round.
    """
    if split.parts == 1:
        return plan_shards(units, rates)
    by_part: dict[int, list[int]] = {}
    q = split.q
    for unit in sorted(units):
        by_part.setdefault(unit // q, []).append(unit)  # split.part(unit)
    parts = sorted(by_part)
    fastest = sorted(rates, key=lambda b: (-rates[b], b))
    if len(fastest) < len(parts):
        return {b: by_part[p] for b, p in zip(sorted(rates), parts, strict=False)}
    groups: dict[int, list[str]] = {p: [b] for p, b in zip(parts, fastest, strict=False)}
    totals = {p: rates[group[0]] for p, group in groups.items()}  # each group's rate
    sizes = {p: len(by_part[p]) for p in parts}
    for board in fastest[len(parts) :]:
        part = parts[0]  # the least rate per unit; ties to the lower slice
        for p in parts[1:]:
            if totals[p] / sizes[p] < totals[part] / sizes[part]:
                part = p
        groups[part].append(board)
        totals[part] += rates[board]
    plan: dict[str, list[int]] = {}
    for part in parts:
        plan.update(plan_shards(by_part[part], {b: rates[b] for b in groups[part]}))
    return plan


def predicted_seconds(split: StepSplit, rates: Mapping[str, float]) -> float:
    """Time of the step's slowest board under ``plan_units`` at the given rates."""
    return _slowest(split, plan_units(split, split.units, rates), rates)


def _slowest(split: StepSplit, plan: Mapping[str, list[int]], rates: Mapping[str, float]) -> float:
    cost = split.cost
    return max(cost(units) / (1e-12 if rates[b] < 1e-12 else rates[b]) for b, units in plan.items())


def slice_counts(batch_size: int, most: int | None = None) -> list[int]:
    """The numbers of equal slices a batch may be cut into for a split: the divisors of
    ``batch_size`` from 2 up to ``most`` (default: the batch size)."""
    top = batch_size if most is None else min(batch_size, most)
    return [parts for parts in range(2, top + 1) if batch_size % parts == 0]


def choose_split(
    q: int,
    batch_size: int,
    rates: Mapping[str, float] | Callable[[int], Mapping[str, float]],
    max_parts: int | None = None,
) -> tuple[StepSplit, dict[str, list[int]]]:
    """The split of a step, from the boards' measured rates, and its ``plan_units`` plan
    of every unit (computed while judging the split: a caller need not plan again).

    ``rates`` gives each board's whole-batch keys per second, or, called with a number
    of slices per key, the rates measured on such slices (a slice costs more than its
    share where per-request costs dominate, and the measurement says so). The split is
    whole keys unless slicing shortens the predicted step by at least
    ``MIN_SPLIT_GAIN``; the candidates are the divisors of ``batch_size`` (equal slices)
    up to ``max_parts``, and a split whose shards would exceed ``MAX_SLICE_KS`` keys is
    not considered.
    """
    fixed = rates

    def rates_for(parts: int) -> Mapping[str, float]:
        return fixed(parts) if callable(fixed) else fixed

    whole = rates_for(1)
    best = StepSplit(q, batch_size, 1)
    if not whole or q < 1:
        return best, {}
    best_plan = plan_units(best, best.units, whole)
    best_s = _slowest(best, best_plan, whole)
    # Fewer boards than slices would leave slices for a second round: never faster.
    limit = min(batch_size, len(whole), max_parts or batch_size)
    for parts in slice_counts(batch_size, limit):
        split = StepSplit(q, batch_size, parts)
        sliced = rates_for(parts)
        plan = plan_units(split, split.units, sliced)
        if any(len(units) > MAX_SLICE_KS for units in plan.values()):
            continue
        seconds = _slowest(split, plan, sliced)
        if seconds <= best_s * (1 - MIN_SPLIT_GAIN):
            best, best_plan, best_s = split, plan, seconds
    return best, best_plan
