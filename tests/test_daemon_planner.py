"""Shard planning across boards of different speed."""

from collections.abc import Callable

import pytest

from qsched.daemon.planner import (
    StepSplit,
    ThroughputEstimate,
    batch_slices,
    choose_split,
    even_or_proportional,
    plan_shards,
    plan_units,
    predicted_seconds,
    reassign,
    slice_counts,
    split_proportional,
)
from qsched.protocol.messages import MAX_SLICE_KS


def test_split_proportional_sums_and_follows_weights():
    """Shares add up to the count and follow the weights."""
    assert split_proportional(10, [1, 1]) == [5, 5]
    assert split_proportional(10, [3, 1]) == [8, 2]  # 7.5 / 2.5: tie goes to the first
    assert sum(split_proportional(17, [0.3, 2.2, 1.1])) == 17


def test_split_proportional_even_when_no_positive_weight():
    """All-zero rates still spread the work instead of dropping it."""
    assert split_proportional(4, [0.0, 0.0]) == [2, 2]


def test_boards_within_the_rate_noise_get_even_shares():
    """Two boards measured 5 % apart share 64 keys 32/32, not 33/31 (which would give
    an aggregate of 64 single-key members a second round); the remainder of an uneven
    count goes to the fastest."""
    assert split_proportional(64, [1.05, 1.0]) == [33, 31]
    assert even_or_proportional(64, [1.05, 1.0]) == [32, 32]
    assert even_or_proportional(5, [0.99, 1.0, 1.02]) == [1, 2, 2]


def test_boards_of_different_speed_still_get_proportional_shares():
    """A board twice as fast takes twice the keys (an even split would be 33 % slower);
    one 25 % faster takes more too (even: 11 % slower, beyond the noise)."""
    assert even_or_proportional(60, [2.0, 1.0]) == [40, 20]
    assert even_or_proportional(64, [1.0, 1.25]) == split_proportional(64, [1.0, 1.25]) == [28, 36]


def test_plan_shards_contiguous_and_complete():
    """Each key is planned exactly once, in contiguous runs per board."""
    plan = plan_shards(list(range(64)), {"b": 2.0, "a": 1.0, "c": 1.0})
    assert sorted(k for ks in plan.values() for k in ks) == list(range(64))
    for ks in plan.values():
        assert ks == list(range(ks[0], ks[0] + len(ks)))
    assert len(plan["b"]) == 32


def test_plan_shards_is_deterministic_and_skips_idle():
    """The plan depends only on inputs; a board with no share is absent."""
    rates = {"x": 100.0, "y": 0.001}
    assert plan_shards([0, 1], rates) == plan_shards([0, 1], dict(reversed(rates.items())))
    assert "y" not in plan_shards([0, 1], rates)


def test_reassign_avoids_excluded_boards():
    """Late keys go to other boards, or to anyone if all are excluded."""
    rates = {"a": 1.0, "b": 1.0}
    assert reassign([5, 6], rates, {"a"}) == {"b": [5, 6]}
    assert sum(len(v) for v in reassign([5, 6], rates, {"a", "b"}).values()) == 2


def test_throughput_estimate_smooths():
    """The first observation replaces the prior; later ones are averaged."""
    est = ThroughputEstimate()
    est.observe(10, 1.0)
    assert est.rate == pytest.approx(10.0)
    est.observe(20, 1.0)
    assert est.rate == pytest.approx(13.0)
    est.observe(0, 1.0)
    assert est.observations == 2


def test_batch_slices_cover_the_batch_once() -> None:
    """Slice j of s starts at floor(j B / s); the slices tile the batch in order."""
    assert batch_slices(4, 2) == [(0, 2), (2, 2)]
    assert batch_slices(5, 3) == [(0, 1), (1, 2), (3, 2)]
    for batch in range(1, 12):
        for parts in range(1, batch + 1):
            slices = batch_slices(batch, parts)
            assert [s for s, _ in slices] == [sum(c for _, c in slices[:j]) for j in range(parts)]
            assert sum(c for _, c in slices) == batch and all(c >= 1 for _, c in slices)
    with pytest.raises(ValueError, match="slices"):
        batch_slices(2, 3)


def test_step_split_numbers_units_slice_major() -> None:
    """Unit part * q + k; its cost counts the slice's share of the batch."""
    split = StepSplit(q=3, batch_size=4, parts=2)
    assert list(split.units) == list(range(6))
    assert [(split.key(u), split.part(u)) for u in split.units] == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
    ]  # fmt: skip
    assert split.unit(2, 1) == 5
    assert split.bounds(1) == (2, 2)
    assert split.part_of(2, 2) == 1 and split.part_of(1, 2) is None
    assert split.cost([0, 4]) == 1.0
    assert StepSplit(q=3, batch_size=4).cost([0, 1]) == 2.0


def test_plan_units_gives_each_board_one_slice() -> None:
    """Split plans: every unit once, each board's units of one slice, groups by rate."""
    split = StepSplit(q=4, batch_size=4, parts=2)
    rates = {"a": 4.0, "b": 1.0, "c": 1.0, "d": 4.0}
    plan = plan_units(split, split.units, rates)
    assert sorted(u for units in plan.values() for u in units) == list(split.units)
    assert all(len({split.part(u) for u in units}) == 1 for units in plan.values())
    # The two fast boards lead different slices, each with one slow board beside it.
    parts = {b: split.part(units[0]) for b, units in plan.items()}
    assert parts["a"] != parts["d"] and {parts["b"], parts["c"]} == {0, 1}
    assert len(plan["a"]) > len(plan["b"])


def test_plan_units_with_fewer_boards_than_slices() -> None:
    """Board i takes the i-th slice with missing units; the rest waits for a board."""
    split = StepSplit(q=2, batch_size=4, parts=4)
    plan = plan_units(split, [1, 2, 6, 7], {"x": 1.0, "y": 1.0})
    assert plan == {"x": [1], "y": [2]}


def test_plan_units_unsplit_is_plan_shards() -> None:
    rates = {"a": 2.0, "b": 1.0}
    split = StepSplit(q=6, batch_size=4)
    assert plan_units(split, split.units, rates) == plan_shards(list(range(6)), rates)


def choose_parts(
    q: int,
    batch_size: int,
    rates: dict[str, float] | Callable[[int], dict[str, float]],
    max_parts: int | None = None,
) -> int:
    """Slices per key of the split ``choose_split`` chooses."""
    return choose_split(q, batch_size, rates, max_parts)[0].parts


def test_choose_parts_splits_only_when_boards_would_idle() -> None:
    """q = 64 at batch 4: 32 boards stay whole; 48, 128 and 256 boards split."""

    def even(n: int) -> dict[str, float]:
        return {f"b{i:03d}": 1.0 for i in range(n)}

    assert choose_parts(64, 4, even(8)) == 1
    assert choose_parts(64, 4, even(32)) == 1
    assert choose_parts(64, 4, even(48)) == 2
    assert choose_parts(64, 4, even(128)) == 2
    assert choose_parts(64, 4, even(256)) == 4
    assert choose_parts(64, 4, even(256), max_parts=2) == 2
    assert choose_parts(64, 3, even(128)) == 3  # divisors of the batch only
    assert choose_parts(2, 1, even(8)) == 1  # a batch of one cannot be split
    assert choose_parts(8, 4, {}) == 1


@pytest.mark.parametrize("boards", [3, 8, 48, 128, 256])
def test_choose_split_returns_the_plan_of_the_split_it_chose(boards: int) -> None:
    """The plan comes with the split (the caller need not plan again) and is the one
    ``plan_units`` makes for it at that split's rates; the split is ``choose_parts``'."""
    names = [f"b{i:03d}" for i in range(boards)]
    whole = {b: 1.0 + (i % 5) / 40 for i, b in enumerate(names)}

    def rates(parts: int) -> dict[str, float]:
        return whole if parts == 1 else {b: r * 0.9 / parts for b, r in whole.items()}

    split, plan = choose_split(64, 4, rates)
    assert split == StepSplit(64, 4, choose_parts(64, 4, rates))
    assert plan == plan_units(split, split.units, rates(split.parts))
    assert sorted(u for units in plan.values() for u in units) == list(split.units)
    assert choose_split(8, 4, {}) == (StepSplit(8, 4), {})


def test_choose_parts_follows_measured_rates() -> None:
    """Two fast boards and many slow ones: the slow boards add nothing, no split; eight
    even boards for four keys: split in two."""
    rates = {"fast0": 100.0, "fast1": 100.0} | {f"slow{i}": 1.0 for i in range(6)}
    assert choose_parts(4, 4, rates) == 1
    assert predicted_seconds(StepSplit(4, 4, 1), rates) <= predicted_seconds(
        StepSplit(4, 4, 2), rates
    )
    assert choose_parts(4, 4, dict.fromkeys(rates, 1.0)) == 2


def test_choose_parts_respects_the_slice_key_limit() -> None:
    """A shard of a split may hold at most MAX_SLICE_KS keys."""
    rates = {"a": 1.0, "b": 1.0, "c": 1.0}
    assert choose_parts(MAX_SLICE_KS * 2, 2, rates) == 1


def test_choose_parts_judges_a_split_on_its_measured_rate() -> None:
    """128 boards, 64 keys: a split is worth trying at face value, but not once slices
    were measured at less than half the whole-batch rate (fixed costs per request)."""
    boards = [f"b{i:03d}" for i in range(128)]

    def measured(slice_rate: float) -> Callable[[int], dict[str, float]]:
        return lambda parts: dict.fromkeys(boards, 1.0 if parts == 1 else slice_rate)

    assert choose_parts(64, 4, measured(1.0)) == 2
    assert choose_parts(64, 4, measured(0.9)) == 2
    assert choose_parts(64, 4, measured(0.4)) == 1


def test_slice_counts_are_the_batchs_divisors_up_to_a_bound() -> None:
    assert slice_counts(12) == [2, 3, 4, 6, 12]
    assert slice_counts(12, 5) == [2, 3, 4]
    assert slice_counts(7) == [7] and slice_counts(1) == []
