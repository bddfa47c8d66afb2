"""The board-session and job-lifecycle state machines (SPEC section 9), as data."""

from __future__ import annotations

from typing import Final, Literal

__all__ = [
    "BOARD_TRANSITIONS",
    "JOB_TERMINAL",
    "JOB_TRANSITIONS",
    "BoardState",
    "JobState",
    "check_board_transition",
    "check_job_transition",
]

BoardState = Literal["unknown", "hello", "loading", "ready", "busy", "faulty", "resync", "gone"]
JobState = Literal["pending", "running", "paused", "stopped", "completed", "failed"]

# A Hello restarts a session from any state (the board rebooted or reconnected).
BOARD_TRANSITIONS: Final[dict[BoardState, frozenset[BoardState]]] = {
    "unknown": frozenset({"hello", "gone"}),
    # hello -> faulty: an unsupported protocol version (the board gets a typed Error
    # and no work); hello -> ready: it already holds the job's model, data and weights.
    "hello": frozenset({"hello", "loading", "ready", "faulty", "gone"}),
    "loading": frozenset({"hello", "ready", "faulty", "gone"}),
    "ready": frozenset({"hello", "busy", "loading", "resync", "faulty", "gone"}),
    "busy": frozenset({"hello", "ready", "resync", "faulty", "gone"}),
    # A faulty board is resynchronised (full weights) or given up on.
    "faulty": frozenset({"hello", "resync", "gone"}),
    "resync": frozenset({"hello", "ready", "faulty", "gone"}),
    "gone": frozenset({"hello"}),
}

JOB_TRANSITIONS: Final[dict[JobState, frozenset[JobState]]] = {
    "pending": frozenset({"running", "stopped", "failed"}),
    "running": frozenset({"paused", "stopped", "completed", "failed"}),
    "paused": frozenset({"running", "stopped", "failed"}),
    "stopped": frozenset(),
    "completed": frozenset(),
    "failed": frozenset(),
}
JOB_TERMINAL: Final[frozenset[JobState]] = frozenset({"stopped", "completed", "failed"})


def check_board_transition(old: BoardState, new: BoardState) -> None:
    """Raise ValueError unless a board session may go from ``old`` to ``new``."""
    if new not in BOARD_TRANSITIONS[old]:
        raise ValueError(f"board session cannot go from {old} to {new}")


def check_job_transition(old: JobState, new: JobState) -> None:
    """Raise ValueError unless a job may go from ``old`` to ``new``."""
    if new not in JOB_TRANSITIONS[old]:
        raise ValueError(f"job cannot go from {old} to {new}")
