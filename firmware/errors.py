"""The board side's errors: a fault description, an injected crash, a firmware build."""

from __future__ import annotations

__all__ = ["BoardCrash", "FaultError", "FirmwareBuildError"]


class FaultError(ValueError):
    """A fault description that cannot be parsed."""


class BoardCrash(Exception):
    """The board died on purpose (fault ``crash-at-step``): stop serving, say nothing."""

    def __init__(self, board_id: str, step: int) -> None:
        super().__init__(f"board {board_id} crashed at step {step}")
        self.board_id = board_id
        self.step = step


class FirmwareBuildError(RuntimeError):
    """``make`` failed or is missing; the message carries the tail of its output."""
