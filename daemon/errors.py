"""The daemon's errors, one place for all of them.

A board's misbehaviour (BoardFaultError and its kinds) marks that board faulty and
never ends a job; a JobError ends the job with its reason; ControlError is the typed
refusal of a control command; the others are a command line's usage errors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qsched.protocol.control import ControlErrorCode
    from qsched.protocol.messages import Error

__all__ = [
    "BoardErrorReply",
    "BoardFaultError",
    "BoardLostError",
    "ConfigError",
    "ControlError",
    "CtlError",
    "ExportError",
    "InstanceError",
    "Interrupted",
    "JobError",
    "NotBuiltError",
    "StateDirError",
]


class ConfigError(ValueError):
    """The configuration file or an environment override is invalid."""

    def __init__(self, source: str, detail: str) -> None:
        super().__init__(f"{source}: {detail}")
        self.source = source
        self.detail = detail


class StateDirError(Exception):
    """The state directory holds something unreadable, or a request is invalid."""

    def __init__(self, path: Path | str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = Path(path)
        self.detail = detail


class BoardFaultError(Exception):
    """A board misbehaved (timeout, wrong answer, typed refusal); ``reason`` is a short word."""

    def __init__(self, board_id: str, reason: str, detail: str = "") -> None:
        super().__init__(f"board {board_id}: {reason}" + (f" ({detail})" if detail else ""))
        self.board_id = board_id
        self.reason = reason
        self.detail = detail


class BoardLostError(BoardFaultError):
    """The board's link went away while a request waited."""


class BoardErrorReply(BoardFaultError):
    """The board answered a request with a typed ``Error``."""

    def __init__(self, board_id: str, error: Error) -> None:
        super().__init__(board_id, error.code, error.detail)
        self.error = error


class ControlError(Exception):
    """A command refused with a control-plane error code and a sentence."""

    def __init__(self, code: ControlErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ControlErrorCode = code
        self.message = message


class JobError(Exception):
    """The job cannot go on (``reason``: ``numeric``, ``no_workload``, ``internal`` ...)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Interrupted(Exception):
    """A stop arrived while the step waited for boards; nothing of the step was applied."""


class ExportError(ValueError):
    """The model cannot be written in the format asked for."""


class CtlError(Exception):
    """The command could not be sent or got no reply."""


class NotBuiltError(RuntimeError):
    """The module or function a command names does not exist (yet)."""


class InstanceError(RuntimeError):
    """Another daemon already runs on this state directory."""


class FleetTakenError(RuntimeError):
    """Another daemon is online on this fleet at this broker."""
