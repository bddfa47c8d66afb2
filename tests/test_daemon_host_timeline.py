"""A host's step timeline (``HostTimeline``): the first passage of each mark kept,
written and read back, and the benchmark's medians of it after each step's update."""

from __future__ import annotations

from pathlib import Path

from qsched.daemon.host_timeline import MARKS, HostTimeline, read_marks
from qsched.lab.bench_fleet import StepTimeline


def test_a_mark_keeps_its_first_passage_and_survives_a_round_trip(tmp_path: Path) -> None:
    timeline = HostTimeline()
    timeline.mark(7, "order in")
    first = timeline.steps[7]["order in"]
    timeline.mark(7, "order in")  # the request sent again
    timeline.mark(7, "shares out")
    assert timeline.steps[7]["order in"] == first <= timeline.steps[7]["shares out"]
    path = tmp_path / "host.json"
    timeline.write(path)
    assert read_marks(path) == timeline.steps
    assert read_marks(tmp_path / "missing.json") == {}
    cut = tmp_path / "cut.json"
    cut.write_text(path.read_text()[:-3])  # a host killed while it wrote
    assert read_marks(cut) == {}


def test_the_benchmark_takes_medians_after_each_steps_update() -> None:
    """Marks count from the moment the daemon published the update that opened their
    step; a step missing a mark or outside the measured steps is left out."""
    daemon = StepTimeline()
    daemon.opened = {1: 10.0, 2: 20.0, 3: 30.0}
    host_a = {
        1: dict(zip(MARKS, (10.001, 10.002, 10.030, 10.031), strict=True)),
        2: dict(zip(MARKS, (20.003, 20.004, 20.032, 20.033), strict=True)),
        3: {"order in": 30.5},  # incomplete
    }
    host_b = {2: dict(zip(MARKS, (20.002, 20.003, 20.031, 20.035), strict=True))}
    got = daemon.host_medians_ms([host_a, host_b], steps=range(2, 4))
    assert list(got) == list(MARKS)
    expected = {"order in": 2.5, "shares out": 3.5, "answers in": 31.5, "result out": 34.0}
    assert all(abs(got[m] - expected[m]) < 1e-6 for m in MARKS)
    assert daemon.host_medians_ms([host_a, host_b], steps=range(5, 6)) == {}
