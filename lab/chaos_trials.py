"""The fault trials of ``qsched chaos``: kill, restart, stop and mislead real processes
while a job trains, and check every job ends as if nothing had happened.

The setting is ``chaos_fleet.ChaosFleet``: a private broker, the daemon and boards as
processes of their own. Each trial is one short job (its own name and seed; FP32 and
INT8 in turn) with one fault at a random step:

| fault | what is done |
| --- | --- |
| ``daemon-kill`` | SIGKILL of the daemon, then a new daemon on the same state directory |
| ``board-kill`` | SIGKILL of one board process mid-step, then the board starts again |
| ``broker-restart`` | the broker is killed and started again on the same port |
| ``hung`` | one board process is stopped (SIGSTOP) for the rest of the job |
| ``liar`` | a fourth board joins for the trial that lies about a share of its results |
| ``serial-1e-3``, ``serial-1e-2`` | two serial boards alone (the MQTT ones drained) run \
the job, each on a line that garbles that share of its bytes both ways, all job long |

A trial is bit-identical when the job's final weights, and its q, losses and
validations step by step, equal the single-process trainer's. It also reports the steps
recomputed (a resumed daemon redoes the steps after its last checkpoint) and the
recovery time: from the fault to the first step recorded after it.
"""

from __future__ import annotations

import contextlib
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from qsched.lab.chaos_fleet import BOARD_IDS, SERIAL_IDS, ChaosFleet, rss_mib
from qsched.lab.chaos_report import ChaosRow
from qsched.lab.procs import wait_for
from qsched.protocol.jobspec import JobSpec
from qsched.zo.trainer import train_zo

__all__ = ["DEFAULT_TRIALS", "SERIAL_RATES", "TRIAL_FAULTS", "TrialResult", "run_trials"]

SERIAL_RATES: Final = {"serial-1e-3": 1e-3, "serial-1e-2": 1e-2}
# Trials of a default campaign, in the order they run.
DEFAULT_TRIALS: Final = {
    "daemon-kill": 20,
    "board-kill": 20,
    "broker-restart": 20,
    "hung": 5,
    "liar": 5,
    "serial-1e-3": 5,
    "serial-1e-2": 5,
}
TRIAL_FAULTS: Final = tuple(DEFAULT_TRIALS)
LIAR: Final = "cb-liar"
# The trials' job: short, checkpointed every 4 steps, audited every step (the default).
TRIAL_SPEC: Final[dict[str, Any]] = {
    "steps": 30,
    "eval_every": 6,
    "checkpoint_every": 4,
    "batch_size": 16,
    "policy": {"name": "fixed", "config": {"q": 4}},
}
_JOB_TIMEOUT_S: Final = 180.0


@dataclass(frozen=True)
class TrialResult:
    """What one trial showed."""

    fault: str
    exact: bool
    lost_steps: int
    recovery_s: float | None
    reason: str = ""
    crashed: bool = False


# --------------------------------------------------------------------------- the faults

Fault = Callable[[ChaosFleet], Callable[[], None]]
"""Does the fault now; returns what undoes it once the job has ended (often nothing)."""


def _kill_daemon(fleet: ChaosFleet) -> Callable[[], None]:
    fleet.procs.kill(fleet.daemon)
    fleet.daemon = fleet.start_daemon()
    return lambda: None


def _kill_board(fleet: ChaosFleet, board: str) -> Callable[[], None]:
    fleet.procs.kill(fleet.boards[board])
    fleet.boards[board] = fleet.start_board(board)
    return lambda: None


def _restart_broker(fleet: ChaosFleet) -> Callable[[], None]:
    fleet.broker.restart()
    return lambda: None


def _hang_board(fleet: ChaosFleet, board: str) -> Callable[[], None]:
    child = fleet.boards[board]
    fleet.procs.signal(child, signal.SIGSTOP)
    return lambda: fleet.procs.signal(child, signal.SIGCONT)


def _fault(kind: str, rng: random.Random) -> Fault:
    board = rng.choice(BOARD_IDS)
    faults: dict[str, Fault] = {
        "daemon-kill": _kill_daemon,
        "board-kill": lambda fleet: _kill_board(fleet, board),
        "broker-restart": _restart_broker,
        "hung": lambda fleet: _hang_board(fleet, board),
    }
    # The liar's lies and the lines' noise last the whole job (``_setting``).
    return faults.get(kind, lambda fleet: lambda: None)


@contextlib.contextmanager
def _setting(fleet: ChaosFleet, kind: str, index: int) -> Iterator[None]:
    """The fleet as a trial of ``kind`` needs it for its whole job, and back after."""
    liar = None
    extra: tuple[str, ...] = ()
    rate = SERIAL_RATES.get(kind)
    if kind == "liar":
        liar = fleet.start_board(LIAR, "--fault", "lie:0.3", "--fault-seed", str(index))
        extra = (LIAR,)
    if rate is not None:
        fleet.start_serial_boards()
        extra = SERIAL_IDS
    fleet.wait_ready(extra)
    if rate is not None:
        fleet.drain(BOARD_IDS, True)
        fleet.set_noise(rate)
    try:
        yield
    finally:
        if liar is not None:
            fleet.procs.kill(liar)
        if rate is not None:
            fleet.set_noise(0.0)
            fleet.drain(BOARD_IDS, False)


# --------------------------------------------------------------------------- one trial


def trial_spec(kind: str, index: int) -> dict[str, Any]:
    """The job of trial ``index`` of ``kind``: its own name and seed, FP32 and INT8 in turn."""
    numerics = "int8" if index % 2 else "fp32"
    return {**TRIAL_SPEC, "name": f"{kind}-{index:02d}", "seed": index, "numerics": numerics}


def _reference(spec: dict[str, Any]) -> tuple[int, list[object]]:
    result = train_zo(JobSpec.model_validate(spec))
    return result.state.checksum(), [*result.steps, *result.evals]


def run_trial(fleet: ChaosFleet, kind: str, index: int, rng: random.Random) -> TrialResult:
    """One job with one fault of ``kind`` at a random step; compared with the reference.

    A trial that goes wrong (a wait that never ends, a refused command) is a failed
    trial with its reason; its job is stopped so the next trial can start.
    """
    try:
        return _trial(fleet, kind, index, rng)
    except (TimeoutError, RuntimeError) as exc:
        name = trial_spec(kind, index)["name"]
        fleet.command({"type": "stop", "job": name}, 10)
        crashed = fleet.daemon.poll() is not None
        if crashed:
            fleet.daemon = fleet.start_daemon()
        return TrialResult(kind, False, 0, None, str(exc), crashed)


def _trial(fleet: ChaosFleet, kind: str, index: int, rng: random.Random) -> TrialResult:
    spec = trial_spec(kind, index)
    job = spec["name"]
    fault = _fault(kind, rng)
    instant = kind not in ("liar", *SERIAL_RATES)
    with _setting(fleet, kind, index):
        fleet.start_job(spec)
        at = rng.randint(3, spec["steps"] - 8)
        wait_for(lambda: len(set(fleet.records(job))) >= at, 120, f"step {at} of {job}")
        written = len(fleet.records(job))
        hit = time.monotonic()
        undo = fault(fleet)
        try:
            wait_for(lambda: len(fleet.records(job)) > written, 120, f"a step of {job} after it")
            recovery = time.monotonic() - hit if instant else None
            wait_for(lambda: fleet.job_status(job) != "running", _JOB_TIMEOUT_S, f"{job} to end")
        finally:
            undo()
    crashed = fleet.daemon.poll() is not None  # no trial kills the daemon after its fault
    if crashed:
        fleet.daemon = fleet.start_daemon()
    steps = fleet.records(job)
    lost = len(steps) - len(set(steps))
    status = fleet.job_status(job)
    final = fleet.final(job)
    if status != "completed" or final is None:
        return TrialResult(kind, False, lost, recovery, f"{job} ended {status}", crashed)
    exact = final == _reference(spec)
    return TrialResult(kind, exact, lost, recovery, "" if exact else f"{job} diverged", crashed)


def _row_notes(fleet: ChaosFleet, kind: str, since: tuple[int, int, int]) -> str:
    """What the row's faults did, from the counters at its start (``_counters``)."""
    relayed, garbled, lies = (now - then for now, then in zip(_counters(fleet), since, strict=True))
    if kind in SERIAL_RATES:
        return f"{garbled:,} of {relayed:,} bytes garbled, none reached the weights"
    if kind == "liar":
        return f"{lies} lying results caught by the audits"
    return ""


def _counters(fleet: ChaosFleet) -> tuple[int, int, int]:
    relayed = sum(line.bytes_relayed for line in fleet.lines)
    garbled = sum(line.bytes_garbled for line in fleet.lines)
    lies = fleet.procs.log("daemon").count(b"losses disagree with the daemon")
    return relayed, garbled, lies


def run_row(
    fleet: ChaosFleet, kind: str, count: int, rng: random.Random, progress: Callable[[str], None]
) -> ChaosRow:
    """``count`` trials of ``kind``, as one row of the table."""
    before, since = rss_mib(fleet.daemon.pid), _counters(fleet)
    results = []
    for index in range(count):
        result = run_trial(fleet, kind, index, rng)
        results.append(result)
        exact = "bit-identical" if result.exact else f"NOT exact: {result.reason}"
        progress(f"{kind} {index + 1}/{count}: {exact}, {result.lost_steps} steps redone")
    recoveries = [r.recovery_s for r in results if r.recovery_s is not None]
    # A killed daemon's successor is another process: its memory says nothing of a leak.
    after = rss_mib(fleet.daemon.pid)
    memory = "-" if kind == "daemon-kill" else f"{before:.0f} -> {after:.0f} MiB"
    return ChaosRow(
        fault=kind,
        trials=count,
        exact=sum(r.exact for r in results),
        checked=count,
        lost_steps=sum(r.lost_steps for r in results),
        worst_recovery_s=max(recoveries) if recoveries else None,
        crashes=sum(r.crashed for r in results),
        memory=memory,
        notes=_row_notes(fleet, kind, since),
    )


def run_trials(
    fleet: ChaosFleet, counts: dict[str, int], seed: int, progress: Callable[[str], None]
) -> list[ChaosRow]:
    """Every trial of ``counts`` (fault kind to trials), one row per kind.

    Args:
        fleet: the fleet to hurt.
        counts: trials per fault kind, in the order to run them.
        seed: picks the fault steps and boards.
        progress: told one line per trial.
    """
    rng = random.Random(seed)
    return [run_row(fleet, kind, count, rng, progress) for kind, count in counts.items() if count]
