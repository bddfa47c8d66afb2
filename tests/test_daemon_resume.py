"""The determinism contract with real processes and a real broker: a job interrupted by
SIGKILL of the daemon, by a board process dying mid-step, or by a broker restart ends
with the weights of an uninterrupted run; SIGTERM checkpoints and exits cleanly."""

from __future__ import annotations

import json
import random
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from qsched.daemon.checkpoints import restore_checkpoint
from qsched.daemon.state import StateStore
from qsched.firmware.virtual.faults import CRASH_EXIT_CODE
from qsched.lab.broker import MosquittoBroker
from qsched.lab.procs import Child, Processes, qsched_argv, wait_for
from qsched.protocol.jobspec import JobSpec
from qsched.zo.trainer import train_zo
from qsched.zo.workload import TrainState

pytestmark = pytest.mark.slow

# Boards that take about 1 ms per inference, so a job lasts long enough to interrupt.
SLOW = ("--macs", "3000000")

SPEC = {
    "name": "resume",
    "steps": 36,
    "eval_every": 6,
    "checkpoint_every": 4,
    "batch_size": 16,
    "policy": {"name": "qscheduler", "config": {}},
}


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    """Children started by a test; all killed afterwards."""
    with Processes(tmp_path) as keeper:
        yield keeper


def _daemon(procs: Processes, broker: MosquittoBroker, state: Path, fleet: str) -> Child:
    return procs.qsched(
        "daemon",
        "daemon",
        "--state-dir",
        str(state),
        "--mqtt",
        f"{broker.host}:{broker.port}",
        "--fleet",
        fleet,
        "--step-deadline",
        "2",
    )


def _boards(
    procs: Processes, broker: MosquittoBroker, fleet: str, count: int, prefix: str, *extra: str
) -> Child:
    return procs.qsched(
        f"boards-{prefix}",
        "board",
        "--mqtt",
        f"{broker.host}:{broker.port}",
        "--fleet",
        fleet,
        "--count",
        str(count),
        "--id-prefix",
        prefix,
        "--model-latency",
        "off",
        "--heartbeat",
        "1",
        *extra,
    )


def _ctl(broker: MosquittoBroker, fleet: str, *args: str) -> dict[str, object]:
    child = subprocess.Popen(
        qsched_argv(
            "ctl",
            "--mqtt",
            f"{broker.host}:{broker.port}",
            "--fleet",
            fleet,
            "--timeout",
            "20",
            *args,
            log_level="warning",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=60)
    finally:
        Processes.signal(child, signal.SIGKILL)
        child.wait(10)
    assert child.returncode in (0, 1), stderr.decode()
    return dict(json.loads(stdout))


def _start_job(broker: MosquittoBroker, fleet: str, spec: dict[str, object], tmp: Path) -> None:
    # A command published before the daemon subscribed is lost: wait for its connection.
    log = tmp / "daemon.log"
    wait_for(
        lambda: log.exists() and b"mqtt connected" in log.read_bytes(),
        30,
        "the daemon's connection",
    )
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    reply = _ctl(broker, fleet, "start", str(path))
    assert reply["ok"] is True, reply


def _steps_logged(state: Path, name: str) -> int:
    log = state / "jobs" / name / "metrics.jsonl"
    if not log.exists():
        return 0
    steps = [
        json.loads(line)["step"] for line in log.read_text().splitlines() if '"kind":"step"' in line
    ]
    return max(steps) + 1 if steps else 0


def _final_state(state: Path, name: str, timeout: float = 90) -> tuple[TrainState, list[object]]:
    """The finished job's weights and its history (step and validation records)."""
    job = StateStore(state).job(name)
    wait_for(
        lambda: job.status()["status"] in ("completed", "failed", "stopped"),
        timeout,
        "the job to end",
    )
    assert job.status()["status"] == "completed", job.status()
    checkpoint = job.load_checkpoint()
    assert checkpoint is not None
    result, _ = restore_checkpoint(JobSpec.model_validate(job.spec()), checkpoint)
    return result.state, [*result.steps, *result.evals]


def _reference(spec: dict[str, object]) -> tuple[int, list[object]]:
    result = train_zo(JobSpec.model_validate(spec))
    return result.state.checksum(), [*result.steps, *result.evals]


def test_resume_after_sigkill_bit_identical(
    mqtt_broker: MosquittoBroker, tmp_path: Path, procs: Processes
) -> None:
    """SIGKILL of the daemon at a random step, then a restart: the reference weights and q's."""
    state, fleet = tmp_path / "state", "kill"
    _boards(procs, mqtt_broker, fleet, 2, "kb", *SLOW)
    daemon = _daemon(procs, mqtt_broker, state, fleet)
    _start_job(mqtt_broker, fleet, SPEC, tmp_path)
    kill_at = random.Random().randint(5, 18)
    wait_for(lambda: _steps_logged(state, "resume") >= kill_at, 60, f"step {kill_at}")
    daemon.send_signal(signal.SIGKILL)
    daemon.wait(10)
    assert StateStore(state).job("resume").status()["status"] == "running"
    _daemon(procs, mqtt_broker, state, fleet)
    final, history = _final_state(state, "resume")
    checksum, reference_history = _reference(SPEC)
    assert final.checksum() == checksum, f"killed at step {kill_at}"
    assert history == reference_history  # the same q, losses and validations, step by step


def test_resume_board_killed_mid_step(
    mqtt_broker: MosquittoBroker, tmp_path: Path, procs: Processes
) -> None:
    """A board process that dies mid-step loses nothing: its keys go to the others."""
    state, fleet = tmp_path / "state", "crash"
    spec = {**SPEC, "policy": {"name": "fixed", "config": {"q": 6}}, "steps": 16}
    _boards(procs, mqtt_broker, fleet, 2, "ok")
    crasher = _boards(procs, mqtt_broker, fleet, 1, "doomed", "--fault", "crash-at-step:5")
    _daemon(procs, mqtt_broker, state, fleet)
    # Every board must be in the fleet before the short job starts, the doomed one too.
    log = tmp_path / "daemon.log"
    wait_for(
        lambda: log.exists() and log.read_bytes().count(b'"board joined"') >= 3, 30, "three boards"
    )
    _start_job(mqtt_broker, fleet, spec, tmp_path)
    final, _ = _final_state(state, "resume")
    assert crasher.poll() == CRASH_EXIT_CODE  # it did die, on purpose
    assert final.checksum() == _reference(spec)[0]


def test_resume_broker_restart_mid_job(
    mqtt_broker: MosquittoBroker, tmp_path: Path, procs: Processes
) -> None:
    """The broker restarts mid-job; daemon and boards reconnect and the weights are exact."""
    state, fleet = tmp_path / "state", "restart"
    spec = {**SPEC, "policy": {"name": "fixed", "config": {"q": 4}}, "steps": 30}
    _boards(procs, mqtt_broker, fleet, 2, "rb", *SLOW)
    _daemon(procs, mqtt_broker, state, fleet)
    _start_job(mqtt_broker, fleet, spec, tmp_path)
    wait_for(lambda: _steps_logged(state, "resume") >= 8, 60, "step 8")
    mqtt_broker.restart()
    assert _steps_logged(state, "resume") < spec["steps"]  # type: ignore[operator]
    final, _ = _final_state(state, "resume", timeout=120)
    assert final.checksum() == _reference(spec)[0]


def test_service_sigterm_checkpoints_and_resumes(
    mqtt_broker: MosquittoBroker, tmp_path: Path, procs: Processes
) -> None:
    """SIGTERM: a checkpoint, exit status 0, the job still 'running'; a restart finishes it
    exactly."""
    state, fleet = tmp_path / "state", "term"
    spec = {**SPEC, "checkpoint_every": 1000}
    _boards(procs, mqtt_broker, fleet, 1, "tb")
    daemon = _daemon(procs, mqtt_broker, state, fleet)
    _start_job(mqtt_broker, fleet, spec, tmp_path)
    wait_for(lambda: _steps_logged(state, "resume") >= 6, 60, "step 6")
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    job = StateStore(state).job("resume")
    checkpoint = job.load_checkpoint()
    assert job.status()["status"] == "running"
    assert checkpoint is not None and checkpoint.step >= 6
    _daemon(procs, mqtt_broker, state, fleet)
    final, history = _final_state(state, "resume")
    checksum, reference_history = _reference(spec)
    assert final.checksum() == checksum and history == reference_history
