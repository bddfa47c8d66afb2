"""The setting of ``qsched chaos``: a private Mosquitto, the daemon and its boards as
real processes, and two noisy serial lines.

The daemon (``qsched daemon``) has the broker and both lines' ports. Three virtual boards
are ``qsched board`` processes of their own on the broker (so one can die alone), each
taking about 1 ms per inference, so that a step lasts long enough to be hit in the middle;
the serial boards on the lines' far ends start when a serial trial first needs them.
Everything is driven from outside, as a user would: control commands over MQTT, the job
folders of the state directory, signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from qsched.daemon.checkpoints import restore_checkpoint
from qsched.daemon.ctl import CtlError, send_command
from qsched.daemon.state import StateStore
from qsched.lab.broker import MosquittoBroker
from qsched.lab.noisy_line import NoisyLine
from qsched.lab.procs import Child, Processes, wait_for
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.topics import TopicMap

__all__ = ["BOARD_IDS", "FLEET", "SERIAL_IDS", "ChaosFleet", "open_fleet", "rss_mib"]

FLEET: Final = "chaos"
BOARD_IDS: Final = ("cb-0", "cb-1", "cb-2")
SERIAL_IDS: Final = ("cs-0", "cs-1")
# About 1 ms per inference: a step of q = 4 on a batch of 16 takes tens of ms.
SLOW_BOARD: Final = ("--macs", "3000000")
STEP_DEADLINE_S: Final = "2"


class ChaosFleet:
    """The daemon, its boards and the broker of the trials, as real processes.

    Args:
        procs: starts and kills the children.
        broker: the private broker (restarted by the broker trials).
        folder: holds the daemon's state directory.
    """

    def __init__(
        self, procs: Processes, broker: MosquittoBroker, folder: Path, lines: list[NoisyLine]
    ) -> None:
        self.procs = procs
        self.broker = broker
        self.lines = lines
        self.state = folder / "state"
        self.cfg = MqttConfig(host=broker.host, port=broker.port)
        self.topics = TopicMap(fleet=FLEET)
        self.daemon = self.start_daemon()
        self.boards = {board: self.start_board(board) for board in BOARD_IDS}
        self.serial_boards: dict[str, Child] = {}

    def _address(self) -> list[str]:
        return ["--mqtt", f"{self.broker.host}:{self.broker.port}", "--fleet", FLEET]

    def start_daemon(self) -> Child:
        """A daemon on the fleet's state directory."""
        args = ["--state-dir", str(self.state), "--step-deadline", STEP_DEADLINE_S]
        ports = ["--serial", *(line.daemon_port for line in self.lines)]
        return self.procs.qsched("daemon", "daemon", *args, *ports, *self._address())

    def start_board(self, board: str, *extra: str) -> Child:
        """One board process (``qsched board --id BOARD``) on the broker."""
        return self._board(board, *self._address(), *extra)

    def _board(self, board: str, *args: str) -> Child:
        timing = ["--model-latency", "off", "--heartbeat", "1", *SLOW_BOARD]
        return self.procs.qsched(f"board-{board}", "board", "--id", board, *timing, *args)

    def start_serial_boards(self) -> None:
        """A board on the far end of each noisy line (once)."""
        for board, line in zip(SERIAL_IDS, self.lines, strict=True):
            if board not in self.serial_boards:
                self.serial_boards[board] = self._board(board, "--serial", line.board_port)

    def set_noise(self, rate: float) -> None:
        """Every line garbles this share of its bytes from now on."""
        for line in self.lines:
            line.error_rate = rate

    def drain(self, boards: tuple[str, ...], drain: bool) -> None:
        """Take boards out of (or back into) the work."""
        for board in boards:
            reply = self.command({"type": "drain_board", "board_id": board, "drain": drain})
            if reply is None or not reply.ok:
                raise RuntimeError(f"drain_board {board} {drain}: {reply}")

    def command(self, document: dict[str, Any], timeout: float = 10.0) -> Any:
        """One control command; None when no reply came (a daemon or broker is down)."""
        try:
            return asyncio.run(send_command(self.cfg, self.topics, document, timeout))
        except CtlError:
            return None

    def wait_ready(self, extra: tuple[str, ...] = (), timeout: float = 60.0) -> None:
        """Until the daemon answers and sees every board (and ``extra``); a faulty board
        is resynchronised by the next job."""
        wanted = {*BOARD_IDS, *extra}

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
        folder = StateStore(self.state).job(job)
        checkpoint = folder.load_checkpoint()
        if checkpoint is None:
            return None
        result, _ = restore_checkpoint(JobSpec.from_stored(folder.spec()), checkpoint)
        return result.state.checksum(), [*result.steps, *result.evals]


def rss_mib(pid: int) -> float:
    """Resident memory of a process in MiB (Linux ``/proc``; NaN once it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def open_fleet(folder: Path, seed: int) -> Iterator[ChaosFleet]:
    """Broker, lines and processes, torn down (every child killed) on exit.

    Args:
        folder: logs and the daemon's state directory.
        seed: seeds the lines' noise.
    """
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(MosquittoBroker())
        lines = [stack.enter_context(NoisyLine(seed + i)) for i in range(len(SERIAL_IDS))]
        procs = stack.enter_context(Processes(folder))
        yield ChaosFleet(procs, broker, folder, lines)
