"""``qsched experiment-merge``: folders run on other seeds pool into what one grid would give."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from experiment_grids import tiny_grid

from qsched.lab import experiment, experiment_merge

# Each test names the seeds (a later --seeds, --policies or --steps replaces the earlier).
TINY = [
    *tiny_grid("fixed:2", "qscheduler", numerics=["fp32"]),
    "--workers",
    "1",
    "--quiet",
    "--no-plots",
]


def _grid(out: Path, *extra: str) -> dict[str, Any]:
    stream = io.StringIO()
    assert experiment.main([*TINY, *extra, "--out", str(out)], stream=stream) == 0, (
        stream.getvalue()
    )
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same tiny grid on seeds 0-1 at once, on seed 0 alone and on seed 1 alone."""
    root = tmp_path_factory.mktemp("merge")
    for name, seeds in (("joint", ["0", "1"]), ("seed0", ["0"]), ("seed1", ["1"])):
        _grid(root / name, "--seeds", *seeds)
    return {name: root / name for name in ("joint", "seed0", "seed1")}


def _merge(out: Path, *folders: Path) -> tuple[int, str]:
    stream = io.StringIO()
    status = experiment_merge.main(
        [*map(str, folders), "--out", str(out), "--no-plots"], stream=stream
    )
    return status, stream.getvalue()


def _without_wall(config: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if k not in ("wall_s", "runs", "curve", "mean_q")}
    out["runs"] = [{k: v for k, v in r.items() if k != "wall_s"} for r in config["runs"]]
    return out


def test_merge_equals_the_joint_grid(parts: dict[str, Path], tmp_path: Path) -> None:
    """Merging seed 0 and seed 1 gives the joint grid's runs, statistics, curves and comparisons."""
    status, log = _merge(tmp_path, parts["seed1"], parts["seed0"])
    assert status == 0, log
    merged = json.loads((tmp_path / "results.json").read_text())
    joint = json.loads((parts["joint"] / "results.json").read_text())
    assert merged["setting"]["seeds"] == [0, 1]
    assert [c["key"] for c in merged["configs"]] == [c["key"] for c in joint["configs"]]
    for mine, theirs in zip(merged["configs"], joint["configs"], strict=True):
        assert _without_wall(mine) == _without_wall(theirs)
        assert mine["mean_q"] == pytest.approx(theirs["mean_q"])
        for field in ("val_accuracy_mean", "val_accuracy_std", "forward_passes_mean"):
            assert mine["curve"][field] == pytest.approx(theirs["curve"][field])
    for mine, theirs in zip(merged["comparisons"], joint["comparisons"], strict=True):
        assert (
            mine["best_fixed"] == theirs["best_fixed"] and mine["floor_met"] == theirs["floor_met"]
        )
        assert mine["difference_pp"] == pytest.approx(theirs["difference_pp"])
    for stat in ("final_accuracy", "best_accuracy"):
        assert merged["baseline"][stat] == joint["baseline"][stat]
    assert "Merged from 2 result folders" in (tmp_path / "results.md").read_text()


def test_merge_keeps_only_configs_every_part_has(parts: dict[str, Path], tmp_path: Path) -> None:
    """A policy run on one part only is left out and named, so no comparison mixes seed sets."""
    _grid(tmp_path / "extra", "--seeds", "2", "--policies", "fixed:2", "qscheduler", "fixed:4")
    status, log = _merge(tmp_path / "out", parts["seed0"], tmp_path / "extra")
    assert status == 0, log
    merged = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [c["key"] for c in merged["configs"]] == ["fixed q=2@fp32", "qscheduler@fp32"]
    assert merged["environment"]["dropped_configs"] == ["fixed q=4@fp32"]
    assert (
        "Left out, not run on every seed set: fixed q=4@fp32."
        in (tmp_path / "out" / "results.md").read_text()
    )


def test_merge_refuses_a_seed_run_twice(parts: dict[str, Path], tmp_path: Path) -> None:
    """The same seed in two parts would count one run twice."""
    status, log = _merge(tmp_path, parts["joint"], parts["seed1"])
    assert status == 2 and "seed run twice" in log
    assert not (tmp_path / "results.json").exists()


def test_merge_refuses_other_settings(parts: dict[str, Path], tmp_path: Path) -> None:
    """Only the seeds may differ: another step count is another experiment."""
    _grid(tmp_path / "longer", "--seeds", "2", "--steps", "16")
    status, log = _merge(tmp_path / "out", parts["seed0"], tmp_path / "longer")
    assert status == 2 and "setting differs" in log


def test_merge_takes_a_folder_written_before_a_spec_field_existed(
    parts: dict[str, Path], tmp_path: Path
) -> None:
    """A folder whose spec lacks a field that came later (it ran as the field's default)
    merges with one that records the default, and still not with one that records another
    value."""
    doc = json.loads((parts["seed1"] / "results.json").read_text())
    spec = doc["setting"]["spec"]
    assert spec["lr_decay"] == "none"
    for field in ("lr_decay", "lr_decay_start", "lr_end"):
        del spec[field]
    (tmp_path / "older").mkdir()
    (tmp_path / "older" / "results.json").write_text(json.dumps(doc))
    status, log = _merge(tmp_path / "out", parts["seed0"], tmp_path / "older")
    assert status == 0, log
    merged = json.loads((tmp_path / "out" / "results.json").read_text())
    joint = json.loads((parts["joint"] / "results.json").read_text())
    assert merged["comparisons"] == joint["comparisons"]
    _grid(tmp_path / "decayed", "--seeds", "2", "--set", 'lr_decay="linear"')
    status, log = _merge(tmp_path / "refused", tmp_path / "older", tmp_path / "decayed")
    assert status == 2 and "setting differs" in log


def test_merge_refuses_one_folder_and_missing_results(
    parts: dict[str, Path], tmp_path: Path
) -> None:
    """One folder is nothing to merge; a folder without results.json is named in the error."""
    status, log = _merge(tmp_path / "a", parts["seed0"])
    assert status == 2 and "at least two" in log
    status, log = _merge(tmp_path / "b", parts["seed0"], tmp_path / "empty")
    assert status == 2 and "results.json" in log


def test_merge_refuses_a_malformed_results_json(parts: dict[str, Path], tmp_path: Path) -> None:
    """A file with the right schema tag but a missing field, or not an object, is a clear error."""
    doc = json.loads((parts["seed1"] / "results.json").read_text())
    del doc["configs"][0]["runs"]
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "results.json").write_text(json.dumps(doc))
    status, log = _merge(tmp_path / "a", parts["seed0"], tmp_path / "cut")
    assert status == 2 and "cut/results.json: field configs.0.runs" in log
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "results.json").write_text("[]")
    status, log = _merge(tmp_path / "b", parts["seed0"], tmp_path / "list")
    assert status == 2 and "not a qsched.experiment/1 results.json" in log
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_merge_pools_baselines_run_alone(tmp_path: Path) -> None:
    """Parts of ``--grid baseline`` (no ZO run) pool into the baseline over all their
    seeds, as one such grid gives; a seed in two parts is refused."""
    alone = ["--grid", "baseline", "--steps", "6", "--set", "eval_every=3", "--quiet"]
    for name, seeds in (("joint", ["0", "1"]), ("seed0", ["0"]), ("seed1", ["1"])):
        stream = io.StringIO()
        argv = [*alone, "--seeds", *seeds, "--out", str(tmp_path / name)]
        assert experiment.main(argv, stream=stream) == 0, stream.getvalue()
    status, log = _merge(tmp_path / "merged", tmp_path / "seed1", tmp_path / "seed0")
    assert status == 0, log
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    joint = json.loads((tmp_path / "joint" / "results.json").read_text())
    assert merged["configs"] == [] and merged["setting"]["seeds"] == [0, 1]
    for stat in ("final_accuracy", "best_accuracy"):
        assert merged["baseline"][stat] == joint["baseline"][stat]
    status, log = _merge(tmp_path / "twice", tmp_path / "joint", tmp_path / "seed1")
    assert status == 2 and "seed run twice" in log


def test_merge_joins_folders_run_on_the_same_seeds(parts: dict[str, Path], tmp_path: Path) -> None:
    """A policy run later on the paper grid's seeds joins that grid before seeds pool, so the
    pooled comparison is what one grid over every seed and configuration gives."""
    _grid(tmp_path / "fixed0", "--seeds", "0", "--policies", "fixed:2")
    _grid(tmp_path / "policy0", "--seeds", "0", "--policies", "qscheduler", "--no-baseline")
    folders = (tmp_path / "fixed0", tmp_path / "policy0", parts["seed1"])
    status, log = _merge(tmp_path / "out", *folders)
    assert status == 0, log
    merged = json.loads((tmp_path / "out" / "results.json").read_text())
    joint = json.loads((parts["joint"] / "results.json").read_text())
    assert [c["key"] for c in merged["configs"]] == [c["key"] for c in joint["configs"]]
    for mine, theirs in zip(merged["configs"], joint["configs"], strict=True):
        assert _without_wall(mine) == _without_wall(theirs)
    assert merged["comparisons"][0]["difference_pp"] == pytest.approx(
        joint["comparisons"][0]["difference_pp"]
    )
    assert merged["baseline"]["final_accuracy"] == joint["baseline"]["final_accuracy"]
    assert merged["environment"]["dropped_configs"] == []
    assert len(merged["environment"]["merged_from"]) == 3


def test_merge_refuses_a_configuration_twice_on_the_same_seeds(
    parts: dict[str, Path], tmp_path: Path
) -> None:
    """Two folders on the same seeds holding one configuration would count its runs twice;
    seed sets that overlap without being equal are refused as before."""
    _grid(tmp_path / "again0", "--seeds", "0", "--policies", "fixed:2", "--no-baseline")
    status, log = _merge(tmp_path / "a", parts["seed0"], tmp_path / "again0")
    assert status == 2 and "fixed q=2@fp32: run on seeds [0] in both" in log
    status, log = _merge(tmp_path / "b", parts["joint"], parts["seed0"])
    assert status == 2 and "seed run twice" in log


def test_merge_refuses_baselines_that_differ_on_the_same_seeds(
    parts: dict[str, Path], tmp_path: Path
) -> None:
    """The baseline is a pure function of setting and seeds: two that differ mean an edited file."""
    _grid(tmp_path / "policy0", "--seeds", "0", "--policies", "qscheduler")
    doc = json.loads((tmp_path / "policy0" / "results.json").read_text())
    doc["baseline"]["final_accuracy"]["values"][0] += 0.01
    (tmp_path / "policy0" / "results.json").write_text(json.dumps(doc))
    _grid(tmp_path / "fixed0", "--seeds", "0", "--policies", "fixed:2")
    status, log = _merge(tmp_path / "out", tmp_path / "fixed0", tmp_path / "policy0")
    assert status == 2 and "its first-order baseline differs" in log
