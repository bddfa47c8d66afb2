"""``qsched experiment`` with worker processes, stopped from outside: the workers end too.

A pool worker left behind by its parent would compute its run to the end for nobody,
taking a core for as long as a run takes (tens of minutes on the real backbones).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from qsched.lab.procs import Child, Processes, wait_for
from qsched.lab.run_store import RUNS_FOLDER, RunStore

pytestmark = pytest.mark.skipif(
    not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
    reason="needs /proc's list of a process's children (Linux)",
)

# Two runs far longer than the test, so that both workers are busy when the signal comes.
LONG_GRID = (
    "experiment",
    "--grid",
    "custom",
    "--policies",
    "fixed:2",
    "--seeds",
    "0",
    "1",
    "--steps",
    "10000000",
    "--no-baseline",
    "--no-plots",
    "--quiet",
    "--workers",
    "2",
)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as procs:
        yield procs


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    """Running (a zombie has ended; whoever adopted it reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _is_pool_worker(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def _start(
    procs: Processes, out: Path, grid: tuple[str, ...] = LONG_GRID
) -> tuple[Child, list[int]]:
    """Start a grid; return the parent and its two workers once both are at work.

    The child gets Ctrl-C as in a terminal: a shell without job control starts its
    background commands with SIGINT ignored, and a child inherits an ignored signal (a
    handler is reset to the default on exec), so a test run that way would pass that on.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        parent = procs.qsched("experiment", *grid, "--out", str(out))
    finally:
        if previous is not None:  # None: a handler set outside Python, left as it was
            signal.signal(signal.SIGINT, previous)
    workers: list[int] = []

    def both_at_work() -> bool:
        assert parent.poll() is None, procs.log("experiment").decode(errors="replace")
        workers[:] = [pid for pid in _children(parent.pid) if _is_pool_worker(pid)]
        # a worker past its initializer runs the thread that watches its parent
        return len(workers) == 2 and all(_threads(pid) >= 2 for pid in workers)

    wait_for(both_at_work, 120, "two pool workers at work")
    return parent, list(workers)


def _wait_ended(workers: list[int]) -> None:
    wait_for(lambda: not any(_alive(pid) for pid in workers), 30, "the pool workers to end")


def test_workers_end_when_the_parent_is_killed(procs: Processes, tmp_path: Path) -> None:
    parent, workers = _start(procs, tmp_path / "out")
    os.kill(parent.pid, signal.SIGKILL)  # the parent alone: nothing can clean up after it
    parent.wait(10)
    _wait_ended(workers)


@pytest.mark.parametrize(
    ("signum", "group"),
    [(signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["sigterm-to-the-parent", "ctrl-c-to-the-group"],
)
def test_a_stopped_grid_stops_its_workers_quietly(
    procs: Processes, tmp_path: Path, signum: int, group: bool
) -> None:
    parent, workers = _start(procs, tmp_path / "out")
    if group:
        os.killpg(parent.pid, signum)  # what a terminal's Ctrl-C does
    else:
        os.kill(parent.pid, signum)
    assert parent.wait(60) == 130
    _wait_ended(workers)
    log = procs.log("experiment").decode(errors="replace")
    assert "Traceback" not in log, log
    assert "qsched experiment: stopped; no run had finished" in log, log
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_stopped_grid_keeps_its_finished_runs(procs: Processes, tmp_path: Path) -> None:
    """A short run and a long one on two workers: stopped after the short one ended, the
    grid keeps its record for the same command to resume from."""
    short_and_long = (
        "experiment",
        "--grid",
        "custom",
        "--policies",
        "fixed:1",
        "fixed:256",
        "--numerics",
        "fp32",
        "--seeds",
        "0",
        "--steps",
        "3000",
        "--no-baseline",
        "--no-plots",
        "--quiet",
        "--workers",
        "2",
    )
    out = tmp_path / "out"
    parent, workers = _start(procs, out, short_and_long)
    store = RunStore(out / RUNS_FOLDER)
    wait_for(lambda: store.count() == 1, 120, "the short run's record")
    os.kill(parent.pid, signal.SIGTERM)
    assert parent.wait(60) == 130
    _wait_ended(workers)
    log = procs.log("experiment").decode(errors="replace")
    assert "1 finished run(s) kept" in log and "Traceback" not in log, log
    (record,) = (out / RUNS_FOLDER).glob("*.json")
    assert json.loads(record.read_text())["key"] == "fixed q=1@fp32"
