"""Control plane: user commands, replies, events and status, as JSON models.

Every command gets exactly one reply, ``Reply`` (ok) or ``ErrorReply`` (a code from
a closed set and a human sentence), echoing the command's ``request_id``. The JSON
Schema published for clients is generated from these models (``schema.py``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Final, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from qsched.protocol.errors import ProtocolError
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.states import BoardState, JobState

__all__ = [
    "CONTROL_ERROR_CODES",
    "BoardInfo",
    "BoardPresence",
    "ChangePolicy",
    "CheckpointNow",
    "Command",
    "CommandAdapter",
    "ControlErrorCode",
    "ControlMessage",
    "ControlMessageAdapter",
    "ControlModel",
    "DaemonPresence",
    "DrainBoard",
    "ErrorReply",
    "Event",
    "EventKind",
    "ExportModel",
    "GetStatus",
    "JobStatus",
    "ListBoards",
    "PauseJob",
    "Reply",
    "ResumeJob",
    "StartJob",
    "StatusReport",
    "StopJob",
    "error_reply",
    "parse_command",
    "parse_control",
]

MAX_DOCUMENT: Final = 1 << 20  # a command larger than 1 MiB is refused unread

ControlErrorCode = Literal[
    "invalid_command",  # not a valid command document
    "unknown_job",  # the named job does not exist
    "no_job",  # the command needs a job and none is loaded
    "conflict",  # the command contradicts the current state (start while running)
    "busy",  # the daemon cannot take the command now; retry later
    "unknown_board",  # the named board is not in the fleet
    "unsupported",  # a valid command this daemon does not implement (e.g. a format)
    "timeout",  # the daemon gave up waiting on the fleet
    "internal",  # a bug or an I/O failure in the daemon; see its log
]
CONTROL_ERROR_CODES: tuple[str, ...] = get_args(ControlErrorCode)

RequestId = Annotated[str, Field(min_length=1, max_length=128)]
JobName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
BoardId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class ControlModel(BaseModel):
    """Wire conventions of the control plane: no extra fields, immutable, finite floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class _Command(ControlModel):
    request_id: RequestId | None = Field(default=None, description="echoed in the reply")


class _JobCommand(_Command):
    job: JobName | None = Field(default=None, description="job name; default: the current job")


class StartJob(_Command):
    """Start a job from its spec (conflict if one is running)."""

    type: Literal["start_job"] = "start_job"
    spec: JobSpec


class PauseJob(_JobCommand):
    """Pause after the current step."""

    type: Literal["pause"] = "pause"


class ResumeJob(_JobCommand):
    """Resume a paused job."""

    type: Literal["resume"] = "resume"


class StopJob(_JobCommand):
    """Stop a job for good (it keeps its last checkpoint)."""

    type: Literal["stop"] = "stop"


class GetStatus(_JobCommand):
    """Ask for a StatusReport (in the reply's ``status``); ``job`` names any job the
    daemon keeps, loaded or finished (default: the loaded one)."""

    type: Literal["status"] = "status"


class CheckpointNow(_JobCommand):
    """Write a checkpoint after the current step."""

    type: Literal["checkpoint"] = "checkpoint"


class ChangePolicy(_JobCommand):
    """Switch the q policy of a job from the next step on."""

    type: Literal["change_policy"] = "change_policy"
    policy: PolicySpec


class ListBoards(_Command):
    """List the fleet (in the reply's ``boards``)."""

    type: Literal["list_boards"] = "list_boards"


class DrainBoard(_Command):
    """Stop giving a board work (``drain=false`` undoes it)."""

    type: Literal["drain_board"] = "drain_board"
    board_id: BoardId
    drain: bool = True


class ExportModel(_JobCommand):
    """Export a job's current model (the reply's ``path`` names the file)."""

    type: Literal["export"] = "export"
    format: Literal["tflite", "npz"] = "tflite"


Command = Annotated[
    StartJob
    | PauseJob
    | ResumeJob
    | StopJob
    | GetStatus
    | CheckpointNow
    | ChangePolicy
    | ListBoards
    | DrainBoard
    | ExportModel,
    Field(discriminator="type"),
]
CommandAdapter: TypeAdapter[Command] = TypeAdapter(Command)
CommandType = Literal[
    "start_job",
    "pause",
    "resume",
    "stop",
    "status",
    "checkpoint",
    "change_policy",
    "list_boards",
    "drain_board",
    "export",
]


class BoardInfo(ControlModel):
    """One board as the daemon sees it."""

    board_id: BoardId
    state: BoardState
    link: Literal["mqtt", "serial", "inproc"]
    draining: bool = False
    protocol_version: int | None = None
    firmware_version: str | None = None
    npu: str | None = None
    throughput: float = Field(default=0.0, ge=0, description="measured samples per second")
    last_seen: float | None = Field(default=None, description="Unix time of the last message")


class JobStatus(ControlModel):
    """One job's progress."""

    name: JobName
    job_id: int = Field(ge=0, lt=2**32)
    state: JobState
    step: int = Field(ge=0)
    steps: int = Field(ge=1)
    q: int | None = None
    policy: str | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    val_accuracy: float | None = None


class StatusReport(ControlModel):
    """The daemon's state: its job and its fleet."""

    type: Literal["status_report"] = "status_report"
    daemon_version: str
    time: float = Field(description="Unix time")
    job: JobStatus | None = None
    boards: tuple[BoardInfo, ...] = ()


class Reply(ControlModel):
    """Success. Fields beyond ``command`` are set by the commands that return data."""

    type: Literal["reply"] = "reply"
    ok: Literal[True] = True
    request_id: RequestId | None = None
    command: CommandType
    message: str = ""
    job: JobStatus | None = None
    status: StatusReport | None = None
    boards: tuple[BoardInfo, ...] | None = None
    path: str | None = None


class ErrorReply(ControlModel):
    """Failure: a code from a closed set and a sentence for a human."""

    type: Literal["error"] = "error"
    ok: Literal[False] = False
    request_id: RequestId | None = None
    command: CommandType | None = None
    code: ControlErrorCode
    message: str = Field(min_length=1)


EventKind = Literal[
    "job_started",
    "job_paused",
    "job_resumed",
    "job_stopped",
    "job_completed",
    "job_failed",
    "step",
    "validation",
    "checkpoint",
    "policy_changed",
    "board_joined",
    "board_left",
    "board_faulty",
    "board_resynced",
]


class Event(ControlModel):
    """Something happened; step and validation events carry metrics."""

    type: Literal["event"] = "event"
    kind: EventKind
    time: float = Field(description="Unix time")
    job: JobName | None = None
    step: int | None = Field(default=None, ge=0)
    board_id: BoardId | None = None
    message: str = ""
    metrics: dict[str, float] = Field(default_factory=dict)


class BoardPresence(ControlModel):
    """Retained on a board's presence topic: the birth message, or its Will (offline)."""

    type: Literal["board_presence"] = "board_presence"
    board_id: BoardId
    online: bool
    protocol_version: int | None = None
    fleet_in: bool = Field(
        default=False,
        description="the board's endpoint takes StepOrders from the fleet topic (SPEC 6.9)",
    )


class DaemonPresence(ControlModel):
    """Retained on the daemon state topic: online when up, its Will says offline."""

    type: Literal["daemon_state"] = "daemon_state"
    online: bool
    version: str | None = None
    job: JobName | None = None
    instance: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{32}$",
        description="a random id of this daemon process: a second daemon on the fleet sees it",
    )


ControlMessage = Annotated[
    StartJob
    | PauseJob
    | ResumeJob
    | StopJob
    | GetStatus
    | CheckpointNow
    | ChangePolicy
    | ListBoards
    | DrainBoard
    | ExportModel
    | Reply
    | ErrorReply
    | Event
    | StatusReport
    | BoardPresence
    | DaemonPresence,
    Field(discriminator="type"),
]
ControlMessageAdapter: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)


def _describe(exc: ValidationError) -> str:
    parts = [
        f"{'.'.join(map(str, e['loc'])) or 'document'}: {_sentence(e)}" for e in exc.errors()[:5]
    ]
    return "; ".join(parts)


def _sentence(error: Any) -> str:
    """pydantic's message, in the words of a control document where it names internals."""
    kinds = ", ".join(get_args(CommandType))
    if error["type"] == "union_tag_not_found":
        return f'a command is a JSON object with a "type": one of {kinds}'
    if error["type"] == "union_tag_invalid":
        return f"unknown type {error['ctx'].get('tag')!r}; the types are {kinds}"
    return str(error["msg"])


def _recover_request_id(data: bytes) -> str | None:
    """The request_id of a document that failed validation, if it has a usable one."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    value = document.get("request_id")
    if isinstance(value, str) and 1 <= len(value) <= 128 and _encodable(value):
        return value
    return None


def _encodable(text: str) -> bool:
    """Whether ``text`` can go into a reply: JSON allows a lone surrogate (``"\\ud800"``)
    that no UTF-8 document can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _as_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    return data.encode("utf-8", "replace") if isinstance(data, str) else bytes(data)


def parse_command(data: bytes | bytearray | memoryview | str) -> Command:
    """Validate one JSON command.

    Args:
        data: the JSON document (an MQTT payload).

    Returns:
        The command model.

    Raises:
        ProtocolError: kind ``invalid_command``, with ``request_id`` set when the
            document carried one, so the daemon can answer with an ErrorReply.
    """
    raw = _as_bytes(data)
    if len(raw) > MAX_DOCUMENT:
        raise ProtocolError("invalid_command", f"document of {len(raw)} bytes > {MAX_DOCUMENT}")
    try:
        return CommandAdapter.validate_json(raw)
    except ValidationError as exc:
        raise ProtocolError(
            "invalid_command", _describe(exc), request_id=_recover_request_id(raw)
        ) from exc


def parse_control(data: bytes | bytearray | memoryview | str) -> ControlMessage:
    """Validate any control-plane JSON document (command, reply, event, status, presence).

    Raises:
        ProtocolError: kind ``invalid_command`` for anything that is not valid.
    """
    raw = _as_bytes(data)
    if len(raw) > MAX_DOCUMENT:
        raise ProtocolError("invalid_command", f"document of {len(raw)} bytes > {MAX_DOCUMENT}")
    try:
        return ControlMessageAdapter.validate_json(raw)
    except ValidationError as exc:
        raise ProtocolError("invalid_command", _describe(exc)) from exc


def error_reply(exc: ProtocolError) -> ErrorReply:
    """The ErrorReply for a command that ``parse_command`` refused."""
    # The code is its own field: the message is the sentence alone, not "invalid_command: ...".
    return ErrorReply(code="invalid_command", message=exc.detail, request_id=exc.request_id)
