"""An interrupted ``qsched experiment`` resumes: the runs that finished are kept and not
run again, and the results equal an uninterrupted grid's."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from experiment_grids import tiny_grid

from qsched.lab import experiment
from qsched.lab.run_store import RUNS_FOLDER, RunStore

GRID = [
    *tiny_grid("fixed:2", "qscheduler"),
    "--no-plots",
    "--no-baseline",
    "--quiet",
    "--workers",
    "1",
]
RUNS = 8  # 2 policies x 2 numerics x 2 seeds
REAL_RUN = experiment._run


class _Counting:
    """``experiment._run`` counted, and interrupted (as by Ctrl-C) after ``stop_after`` runs."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.stop_after = stop_after

    def __call__(self, task: tuple[experiment.GridEntry, int]) -> experiment.RunRecord:
        if self.stop_after is not None and len(self.calls) == self.stop_after:
            raise KeyboardInterrupt
        self.calls.append((task[0].key, task[1]))
        return REAL_RUN(task)


def _main(out: Path, *extra: str) -> tuple[int, str]:
    stream = io.StringIO()
    status = experiment.main([*GRID, *extra, "--out", str(out)], stream=stream)
    return status, stream.getvalue()


def _without_wall(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The configurations with every wall time left out (the rest is a pure function)."""
    configs = json.loads(json.dumps(doc["configs"]))
    for config in configs:
        config.pop("wall_s")
        for run in config["runs"]:
            run.pop("wall_s")
    return configs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("whole")
    status, log = _main(out)
    assert status == 0, log
    assert not (out / RUNS_FOLDER).exists()  # the kept records go once the results are written
    doc: dict[str, Any] = json.loads((out / "results.json").read_text())
    return doc


def test_an_interrupted_grid_resumes_to_the_same_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, Any]
) -> None:
    first = _Counting(stop_after=3)
    monkeypatch.setattr(experiment, "_run", first)
    status, log = _main(tmp_path)
    assert status == experiment.EXIT_INTERRUPTED
    assert "3 finished run(s) kept" in log and "the same command resumes" in log, log
    assert not (tmp_path / "results.json").exists()
    assert RunStore(tmp_path / RUNS_FOLDER).count() == 3

    second = _Counting()
    monkeypatch.setattr(experiment, "_run", second)
    status, log = _main(tmp_path)
    assert status == 0, log
    assert "resuming: 3 of 8 runs kept" in log
    assert len(second.calls) == RUNS - 3 and not set(second.calls) & set(first.calls)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert _without_wall(doc) == _without_wall(uninterrupted)
    assert doc["comparisons"] == uninterrupted["comparisons"]
    assert doc["environment"]["resumed_runs"] == 3
    assert "3 run(s) came from the earlier invocation" in (tmp_path / "results.md").read_text()
    assert "resumed_runs" not in uninterrupted["environment"]
    assert not (tmp_path / RUNS_FOLDER).exists()


def test_a_changed_spec_runs_afresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records made with another learning rate are not taken for this grid's runs."""
    monkeypatch.setattr(experiment, "_run", _Counting(stop_after=2))
    assert _main(tmp_path, "--set", "lr=0.01")[0] == experiment.EXIT_INTERRUPTED
    counting = _Counting()
    monkeypatch.setattr(experiment, "_run", counting)
    status, log = _main(tmp_path, "--set", "lr=0.02")
    assert status == 0, log
    assert len(counting.calls) == RUNS and "resuming" not in log


def test_nothing_finished_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(experiment, "_run", _Counting(stop_after=0))
    status, log = _main(tmp_path)
    assert status == experiment.EXIT_INTERRUPTED
    assert "stopped; no run had finished" in log and "Traceback" not in log


def test_a_damaged_record_is_run_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(experiment, "_run", _Counting(stop_after=2))
    assert _main(tmp_path)[0] == experiment.EXIT_INTERRUPTED
    records = sorted((tmp_path / RUNS_FOLDER).glob("*.json"))
    assert len(records) == 2
    records[0].write_text(records[0].read_text()[:40])  # cut short
    counting = _Counting()
    monkeypatch.setattr(experiment, "_run", counting)
    status, log = _main(tmp_path)
    assert status == 0, log
    assert "resuming: 1 of 8 runs kept" in log and len(counting.calls) == RUNS - 1


def test_a_record_with_wrong_fields_is_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(experiment, "_run", _Counting(stop_after=1))
    assert _main(tmp_path)[0] == experiment.EXIT_INTERRUPTED
    (path,) = (tmp_path / RUNS_FOLDER).glob("*.json")
    doc = json.loads(path.read_text())
    del doc["record"]["q_changes"]
    path.write_text(json.dumps(doc))
    counting = _Counting()
    monkeypatch.setattr(experiment, "_run", counting)
    status, log = _main(tmp_path)
    assert status == 0 and "resuming" not in log and len(counting.calls) == RUNS


def test_store_refuses_another_runs_record(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.save("fixed q=2@fp32", 0, "f" * 32, {"x": 1})
    assert store.load("fixed q=2@fp32", 0, "f" * 32) == {"x": 1}
    assert store.load("fixed q=2@fp32", 0, "e" * 32) is None  # another spec
    assert store.load("fixed q=2@fp32", 1, "f" * 32) is None  # another seed
    assert store.load("fixed q=4@fp32", 0, "f" * 32) is None  # another configuration
    assert store.count() == 1
    store.clear()
    assert not tmp_path.exists() and store.count() == 0
