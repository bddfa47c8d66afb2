"""Experiment grids, job specs of a run, and the QScheduler-versus-best-fixed comparison."""

from __future__ import annotations

from typing import Any

import pytest

from qsched.lab.experiment import (
    ExperimentError,
    ExperimentResult,
    GridEntry,
    Setting,
    build_grid,
)
from qsched.protocol.jobspec import PolicySpec


def test_grid_paper_has_fixed_ladder_and_qscheduler() -> None:
    """The paper grid: fixed q 1..32 and QScheduler (q0=1, Qmax=32), in both numerics."""
    grid = build_grid("paper")
    assert len(grid) == 14
    labels = [e.label for e in grid if e.numerics == "int8"]
    assert labels == [f"fixed q={q}" for q in (1, 2, 4, 8, 16, 32)] + ["qscheduler"]
    sched = next(e for e in grid if e.label == "qscheduler")
    assert sched.policy == PolicySpec(name="qscheduler", config={"q0": 1, "qmax": 32})
    assert {e.numerics for e in grid} == {"fp32", "int8"}
    assert len({e.key for e in grid}) == len(grid)


def test_grid_all_policies_adds_three() -> None:
    """all-policies adds linear, power and variance to the paper grid."""
    names = [e.policy.name for e in build_grid("all-policies", numerics=["int8"])]
    assert names[-3:] == ["linear", "power", "variance"]
    assert len(names) == 10


def test_grid_custom_tokens() -> None:
    """Custom tokens: fixed:Q, bare names and name:{json config}."""
    grid = build_grid("custom", ["fixed:3", 'qscheduler:{"patience": 5}'], ["int8-acc8"])
    assert [e.policy for e in grid] == [
        PolicySpec(name="fixed", config={"q": 3}),
        PolicySpec(name="qscheduler", config={"patience": 5}),
    ]
    assert grid[0].label == "fixed q=3"
    assert grid[1].key.endswith("@int8-acc8")


def test_grid_baseline_may_be_empty() -> None:
    """The baseline grid holds no ZO run unless --policies names some."""
    assert build_grid("baseline", [], ["fp32"]) == []
    assert [e.label for e in build_grid("baseline", ["fixed:4"], ["fp32"])] == ["fixed q=4"]


@pytest.mark.parametrize(
    ("grid", "policies", "numerics", "message"),
    [
        ("custom", [], ["int8"], "the grid is empty"),
        ("paper", [], ["int4"], "unknown numerics"),
        ("nope", [], ["int8"], "unknown grid"),
        ("custom", ["qscheduler:[1]"], ["int8"], "JSON object"),
    ],
)
def test_grid_bad_requests(
    grid: str, policies: list[str], numerics: list[str], message: str
) -> None:
    """An empty grid, unknown numerics or grid name, or a non-object config is an
    ExperimentError."""
    with pytest.raises(ExperimentError, match=message):
        build_grid(grid, policies, numerics)


def test_setting_spec_per_numerics() -> None:
    """A run's spec: numerics and accumulator from the token, common then per-numerics overrides."""
    setting = Setting({"steps": 30, "lr": 5.0}, {"fp32": {"lr": 0.02}})
    entry = GridEntry("fixed q=2", PolicySpec(name="fixed", config={"q": 2}), "fp32")
    spec = setting.spec(entry, seed=4)
    assert (spec.numerics, spec.lr, spec.eps, spec.seed, spec.steps) == ("fp32", 0.02, 0.001, 4, 30)
    acc8 = setting.spec(GridEntry("q", PolicySpec(), "int8-acc8"), seed=0)
    assert (acc8.numerics, acc8.accumulator, acc8.lr, acc8.eps) == ("int8", "int8", 5.0, 1.0)


def _config(
    name: str, token: str, acc: float, passes: float, q: int | None = None
) -> dict[str, object]:
    config = {"q": q} if q is not None else {}
    key = f"{name}{q or ''}@{token}"
    # Two seeds whose accuracies straddle the mean by 0.01 (seed 0 low, seed 1 high).
    runs = [{"seed": 0, "final_accuracy": acc - 0.01}, {"seed": 1, "final_accuracy": acc + 0.01}]
    return {
        "key": key,
        "numerics_token": token,
        "policy": {"name": name, "config": config},
        "final_accuracy": {"mean": acc},
        "forward_passes": {"mean": passes},
        "runs": runs,
    }


def test_comparison_against_best_fixed() -> None:
    """The comparison picks the best fixed q per numerics and checks both floors."""
    configs = [
        _config("fixed", "int8", 0.80, 1000.0, q=4),
        _config("fixed", "int8", 0.90, 8000.0, q=32),
        _config("qscheduler", "int8", 0.895, 4000.0),
        _config("fixed", "fp32", 0.70, 8000.0, q=32),
        _config("qscheduler", "fp32", 0.60, 1000.0),
    ]
    result = ExperimentResult({}, configs, None, {}, "")
    by_token = {c["numerics_token"]: c for c in result.comparisons}
    assert by_token["int8"]["best_fixed_q"] == 32
    assert by_token["int8"]["difference_pp"] == pytest.approx(-0.5)
    assert by_token["int8"]["forward_pass_share"] == pytest.approx(0.5)
    assert by_token["int8"]["floor_met"] is True
    assert by_token["fp32"]["floor_met"] is False  # 10 points behind
    paired = by_token["int8"]["paired_difference_pp"]
    assert paired["values"] == pytest.approx([-0.5, -0.5])  # same seed, same offset: no spread
    assert paired["standard_error"] == pytest.approx(0.0, abs=1e-9)


def _curve_config(
    name: str, q: int | None, passes: list[float], acc: list[float]
) -> dict[str, Any]:
    policy = {"name": "fixed", "config": {"q": q}} if q else {"name": name, "config": {}}
    return {
        "label": name,
        "policy": policy,
        "numerics_token": "int8",
        "forward_passes": {"mean": passes[-1]},
        "final_accuracy": {"mean": acc[-1]},
        "curve": {"val_accuracy_mean": acc, "forward_passes_mean": passes},
    }


def test_equal_budget_table_stops_each_fixed_q_at_the_policys_passes() -> None:
    """At B = the policy's passes: q=4 stops at its last validation within B, q=1's whole
    run is shorter (marked *), q=64's first validation is already past B (-)."""
    from qsched.lab.experiment import _equal_budget_lines, accuracy_within_budget

    q1 = _curve_config("fixed q=1", 1, [20, 40, 60], [0.1, 0.2, 0.3])
    q4 = _curve_config("fixed q=4", 4, [80, 160, 240], [0.4, 0.5, 0.6])
    q64 = _curve_config("fixed q=64", 64, [1280, 2560, 3840], [0.7, 0.8, 0.9])
    policy = _curve_config("qscheduler", None, [20, 100, 170], [0.2, 0.4, 0.55])
    assert accuracy_within_budget(q4, 170) == 0.5
    assert accuracy_within_budget(q64, 170) is None
    lines = _equal_budget_lines([q1, q4, q64, policy])
    assert lines[-1] == "| qscheduler | int8 | 170 | 55.00 | 30.00* | 50.00 | - |"
