"""The fault trials of ``qsched chaos``: kill, restart, stop and mislead real processes
while a job trains, and check every job ends as if nothing had happened.

The setting is a private Mosquitto, the daemon (``qsched daemon``) and three virtual
boards, each a ``qsched board`` process of its own (so one can die alone) that takes
about 1 ms per inference, so a step lasts long enough to be hit in the middle. Each
trial is one short job (its own name and seed; FP32 and INT8 in turn) with one fault at
a random step:

| fault | what is done |
| --- | --- |
| ``daemon-kill`` | SIGKILL of the daemon, then a new daemon on the same state directory |
| ``board-kill`` | SIGKILL of one board process mid-step, then the board starts again |
| ``broker-restart`` | the broker is killed and started again on the same port |
| ``hung`` | one board process is stopped (SIGSTOP) for the rest of the job |
| ``liar`` | a fourth board joins for the trial that lies about a share of its results |

A trial is bit-identical when the job's final weights, and its q, losses and
validations step by step, equal the single-process trainer's. It also reports the steps
recomputed (a resumed daemon redoes the steps after its last checkpoint) and the
recovery time: from the fault to the first step recorded after it.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from qsched.daemon.ctl import CtlError, send_command
from qsched.daemon.state import StateStore
from qsched.lab.broker import MosquittoBroker
from qsched.lab.procs import Child, Processes, wait_for
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.topics import TopicMap
from qsched.zo.step import EvalRecord, StepRecord
from qsched.zo.trainer import train_zo
from qsched.zo.workload import TrainState

__all__ = ["TRIAL_FAULTS", "ChaosFleet", "TrialResult", "run_trials"]

TRIAL_FAULTS: Final = ("daemon-kill", "board-kill", "broker-restart", "hung", "liar")
FLEET: Final = "chaos"
BOARD_IDS: Final = ("cb-0", "cb-1", "cb-2")
# About 1 ms per inference: a step of q = 4 on a batch of 16 takes tens of ms.
SLOW_BOARD: Final = ("--macs", "3000000")
STEP_DEADLINE_S: Final = "2"
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


class ChaosFleet:
    """The daemon, its boards and the broker of the trials, as real processes.

    Args:
        procs: starts and kills the children.
        broker: the private broker (restarted by the broker trials).
        folder: holds the daemon's state directory.
    """

    def __init__(self, procs: Processes, broker: MosquittoBroker, folder: Path) -> None:
        self.procs = procs
        self.broker = broker
        self.state = folder / "state"
        self.cfg = MqttConfig(host=broker.host, port=broker.port)
        self.topics = TopicMap(fleet=FLEET)
        self.daemon = self.start_daemon()
        self.boards = {board: self.start_board(board) for board in BOARD_IDS}

    def _address(self) -> list[str]:
        return ["--mqtt", f"{self.broker.host}:{self.broker.port}", "--fleet", FLEET]

    def start_daemon(self) -> Child:
        """A daemon on the fleet's state directory."""
        args = ["--state-dir", str(self.state), "--step-deadline", STEP_DEADLINE_S]
        return self.procs.qsched("daemon", "daemon", *args, *self._address())

    def start_board(self, board: str, *extra: str) -> Child:
        """One board process (``qsched board --id BOARD``)."""
        args = ["--id", board, "--model-latency", "off", "--heartbeat", "1", *SLOW_BOARD]
        return self.procs.qsched(f"board-{board}", "board", *args, *self._address(), *extra)

    def command(self, document: dict[str, Any], timeout: float = 10.0) -> Any:
        """One control command; None when no reply came (a daemon or broker is down)."""
        try:
            return asyncio.run(send_command(self.cfg, self.topics, document, timeout))
        except CtlError:
            return None

    def wait_ready(self, extra: str | None = None, timeout: float = 60.0) -> None:
        """Until the daemon answers and sees every board (and ``extra``); a faulty board
        is resynchronised by the next job."""
        wanted = {*BOARD_IDS, *([extra] if extra else [])}

        def ready() -> bool:
            reply = self.command({"type": "status"}, 5)
            status = getattr(reply, "status", None)
            boards = status.boards if status is not None else ()
            present = {b.board_id for b in boards if b.state not in ("gone", "unknown")}
            return wanted <= present

        wait_for(ready, timeout, f"the daemon and the boards {', '.join(sorted(wanted))}")

    def start_job(self, spec: dict[str, Any], timeout: float = 60.0) -> None:
        """Start a job, retrying while the daemon is not there yet."""

        def started() -> bool:
            reply = self.command({"type": "start_job", "spec": spec}, 10)
            if reply is not None and not reply.ok:
                raise RuntimeError(f"start_job {spec['name']} refused: {reply.error.message}")
            return reply is not None

        wait_for(started, timeout, f"the daemon to take job {spec['name']}")

    def records(self, job: str) -> list[int]:
        """The steps recorded in the job's metrics log, in the order written."""
        path = self.state / "jobs" / job / "metrics.jsonl"
        steps = []
        for line in path.read_bytes().splitlines() if path.exists() else ():
            if b'"kind":"step"' in line:
                try:
                    steps.append(int(json.loads(line)["step"]))
                except (ValueError, KeyError):
                    continue  # a line being written
        return steps

    def job_status(self, job: str) -> str:
        """The job folder's status (``running``, ``completed``, ...)."""
        return str(StateStore(self.state).job(job).status()["status"])

    def final(self, job: str) -> tuple[int, list[object]] | None:
        """The ended job's checksum and history, or None without a checkpoint."""
        checkpoint = StateStore(self.state).job(job).load_checkpoint()
        if checkpoint is None:
            return None
        history: list[object] = [StepRecord(**r) for r in checkpoint.metrics]
        history += [EvalRecord(**e) for e in checkpoint.extra["evals"]]
        return TrainState.from_bytes(checkpoint.train_state).checksum(), history


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
        "liar": lambda fleet: lambda: None,  # the liar's lies are the fault
    }
    return faults[kind]


# --------------------------------------------------------------------------- one trial


def trial_spec(kind: str, index: int) -> dict[str, Any]:
    """The job of trial ``index`` of ``kind``: its own name and seed, FP32 and INT8 in turn."""
    numerics = "int8" if index % 2 else "fp32"
    return {**TRIAL_SPEC, "name": f"{kind}-{index:02d}", "seed": index, "numerics": numerics}


def _reference(spec: dict[str, Any]) -> tuple[int, list[object]]:
    result = train_zo(JobSpec.model_validate(spec))
    return result.state.checksum(), [*result.steps, *result.evals]


def run_trial(fleet: ChaosFleet, kind: str, index: int, rng: random.Random) -> TrialResult:
    """One job with one fault of ``kind`` at a random step; compared with the reference."""
    spec = trial_spec(kind, index)
    job = spec["name"]
    fault = _fault(kind, rng)
    liar = None
    if kind == "liar":
        liar = fleet.start_board(LIAR, "--fault", "lie:0.3", "--fault-seed", str(index))
    fleet.wait_ready(LIAR if liar else None)
    fleet.start_job(spec)
    at = rng.randint(3, spec["steps"] - 8)
    wait_for(lambda: len(set(fleet.records(job))) >= at, 60, f"step {at} of {job}")
    written = len(fleet.records(job))
    hit = time.monotonic()
    undo = fault(fleet)
    try:
        wait_for(lambda: len(fleet.records(job)) > written, 120, f"a step of {job} after the fault")
        recovery = time.monotonic() - hit if kind != "liar" else None
        wait_for(lambda: fleet.job_status(job) != "running", _JOB_TIMEOUT_S, f"{job} to end")
    finally:
        undo()
        if liar is not None:
            fleet.procs.kill(liar)
    steps = fleet.records(job)
    lost = len(steps) - len(set(steps))
    status = fleet.job_status(job)
    final = fleet.final(job)
    if status != "completed" or final is None:
        return TrialResult(kind, False, lost, recovery, f"{job} ended {status}")
    exact = final == _reference(spec)
    return TrialResult(kind, exact, lost, recovery, "" if exact else f"{job} diverged")


def run_trials(
    counts: dict[str, int], seed: int, folder: Path, progress: Callable[[str], None]
) -> list[TrialResult]:
    """Every trial of ``counts`` (fault kind to trials), on one fleet.

    Args:
        counts: trials per fault kind, in the order to run them.
        seed: picks the fault steps and boards.
        folder: logs and the daemon's state directory.
        progress: told one line per trial.

    Returns:
        One result per trial.
    """
    rng = random.Random(seed)
    results = []
    with MosquittoBroker() as broker, Processes(folder) as procs:
        fleet = ChaosFleet(procs, broker, folder)
        for kind, count in counts.items():
            for index in range(count):
                result = run_trial(fleet, kind, index, rng)
                results.append(result)
                exact = "bit-identical" if result.exact else f"NOT exact: {result.reason}"
                progress(f"{kind} {index + 1}/{count}: {exact}, {result.lost_steps} steps redone")
    return results
