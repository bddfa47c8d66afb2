"""Control commands: one handler per command type, each answering exactly once.

``handle_payload`` is what the MQTT control subscription calls: it parses the JSON
document, runs the command's handler against the daemon (``JobHost``) and returns one
``Reply`` or one ``ErrorReply`` — never raises, never stays silent. Handlers raise
``ControlError(code, message)`` for refusals; anything else is a bug, answered with
``internal`` and logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

import structlog
from pydantic import ValidationError

from qsched.daemon.errors import ControlError
from qsched.policies import PolicyError
from qsched.protocol.control import (
    ChangePolicy,
    CheckpointNow,
    Command,
    DrainBoard,
    ErrorReply,
    ExportModel,
    GetStatus,
    JobStatus,
    ListBoards,
    PauseJob,
    Reply,
    ResumeJob,
    StartJob,
    StatusReport,
    StopJob,
    error_reply,
    parse_command,
)
from qsched.protocol.errors import ProtocolError

__all__ = ["CHECKPOINT_TIMEOUT_S", "ControlError", "JobHost", "handle_command", "handle_payload"]

_log = structlog.get_logger("qsched.control")

# A checkpoint waits for the step in progress; longer than this is a "timeout" reply.
CHECKPOINT_TIMEOUT_S: Final = 60.0


class JobHost(Protocol):
    """What the control handlers need from the daemon (``service.Daemon``)."""

    async def start_job(self, command: StartJob) -> JobStatus: ...
    def job_status(self, name: str | None) -> JobStatus: ...
    def pause_job(self, name: str | None) -> JobStatus: ...
    def resume_job(self, name: str | None) -> JobStatus: ...
    def stop_job(self, name: str | None) -> JobStatus: ...
    async def checkpoint_job(self, name: str | None) -> str: ...
    def change_policy(self, command: ChangePolicy) -> JobStatus: ...
    def status(self, name: str | None = None) -> StatusReport: ...
    def drain_board(self, board_id: str, drain: bool) -> str: ...
    async def export_job(self, name: str | None, fmt: str) -> str: ...


async def _start(host: JobHost, cmd: StartJob) -> dict[str, Any]:
    return {"job": await host.start_job(cmd), "message": f"job {cmd.spec.name} started"}


async def _pause(host: JobHost, cmd: PauseJob) -> dict[str, Any]:
    return {"job": host.pause_job(cmd.job), "message": "pausing after the current step"}


async def _resume(host: JobHost, cmd: ResumeJob) -> dict[str, Any]:
    return {"job": host.resume_job(cmd.job), "message": "resumed"}


async def _stop(host: JobHost, cmd: StopJob) -> dict[str, Any]:
    return {"job": host.stop_job(cmd.job), "message": "stopping after the current step"}


async def _status(host: JobHost, cmd: GetStatus) -> dict[str, Any]:
    return {"status": host.status(cmd.job)}


async def _checkpoint(host: JobHost, cmd: CheckpointNow) -> dict[str, Any]:
    try:
        path = await asyncio.wait_for(host.checkpoint_job(cmd.job), CHECKPOINT_TIMEOUT_S)
    except TimeoutError as exc:
        raise ControlError("timeout", f"no checkpoint within {CHECKPOINT_TIMEOUT_S:.0f} s") from exc
    return {"path": path, "message": "checkpoint written"}


async def _change_policy(host: JobHost, cmd: ChangePolicy) -> dict[str, Any]:
    try:
        job = host.change_policy(cmd)
    except (PolicyError, ValidationError) as exc:
        raise ControlError("invalid_command", f"policy {cmd.policy.name!r} refused: {exc}") from exc
    return {"job": job, "message": f"policy {cmd.policy.name} from the next step"}


async def _list_boards(host: JobHost, cmd: ListBoards) -> dict[str, Any]:
    del cmd
    return {"boards": host.status().boards}


async def _drain(host: JobHost, cmd: DrainBoard) -> dict[str, Any]:
    return {"message": host.drain_board(cmd.board_id, cmd.drain)}


async def _export(host: JobHost, cmd: ExportModel) -> dict[str, Any]:
    return {
        "path": await host.export_job(cmd.job, cmd.format),
        "message": f"exported as {cmd.format}",
    }


_HANDLERS: Final[dict[type, Callable[[JobHost, Any], Awaitable[dict[str, Any]]]]] = {
    StartJob: _start,
    PauseJob: _pause,
    ResumeJob: _resume,
    StopJob: _stop,
    GetStatus: _status,
    CheckpointNow: _checkpoint,
    ChangePolicy: _change_policy,
    ListBoards: _list_boards,
    DrainBoard: _drain,
    ExportModel: _export,
}


async def handle_command(host: JobHost, command: Command) -> Reply | ErrorReply:
    """Run one validated command.

    Args:
        host: the daemon.
        command: the command.

    Returns:
        Exactly one reply, echoing the command's ``request_id``.
    """
    handler = _HANDLERS[type(command)]
    try:
        fields = await handler(host, command)
        return Reply(command=command.type, request_id=command.request_id, **fields)
    except ControlError as exc:
        return ErrorReply(
            command=command.type, request_id=command.request_id, code=exc.code, message=exc.message
        )
    except Exception as exc:  # a bug: answer anyway, and leave a trace
        _log.exception("control command failed", command=command.type)
        message = f"{type(exc).__name__}: {exc}"
        return ErrorReply(
            command=command.type, request_id=command.request_id, code="internal", message=message
        )


async def handle_payload(host: JobHost, payload: bytes | str) -> Reply | ErrorReply:
    """Parse one JSON command and run it; a malformed document gets ``invalid_command``.

    Args:
        host: the daemon.
        payload: the MQTT payload.

    Returns:
        Exactly one reply.
    """
    try:
        command = parse_command(payload)
    except ProtocolError as exc:
        return error_reply(exc)
    return await handle_command(host, command)
