"""Shard planning across boards of different speed."""

import pytest

from qsched.daemon.planner import ThroughputEstimate, plan_shards, reassign, split_proportional


def test_split_proportional_sums_and_follows_weights():
    """Shares add up to the count and follow the weights."""
    assert split_proportional(10, [1, 1]) == [5, 5]
    assert split_proportional(10, [3, 1]) == [8, 2]  # 7.5 / 2.5: tie goes to the first
    assert sum(split_proportional(17, [0.3, 2.2, 1.1])) == 17


def test_split_proportional_even_when_no_positive_weight():
    """All-zero rates still spread the work instead of dropping it."""
    assert split_proportional(4, [0.0, 0.0]) == [2, 2]


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
