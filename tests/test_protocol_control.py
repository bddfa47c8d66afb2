"""Control plane: JSON commands, replies, events, the schema and the state machines."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsched.protocol import (
    ErrorReply,
    Event,
    ProtocolError,
    Reply,
    StatusReport,
    error_reply,
    parse_command,
    parse_control,
)
from qsched.protocol.control import BoardInfo, ChangePolicy, DrainBoard, JobStatus, StartJob
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.schema import SCHEMA_PATH, control_schema, main, render
from qsched.protocol.states import (
    BOARD_TRANSITIONS,
    JOB_TERMINAL,
    check_board_transition,
    check_job_transition,
)


@pytest.mark.parametrize(
    "command",
    ["pause", "resume", "stop", "status", "checkpoint", "list_boards", "export"],
)
def test_control_parses_simple_commands(command: str) -> None:
    """Every simple command parses from JSON and keeps its request_id."""
    parsed = parse_command(json.dumps({"type": command, "request_id": "r1"}))
    assert parsed.type == command and parsed.request_id == "r1"


def test_control_start_job_carries_job_spec() -> None:
    """start_job validates its spec with JobSpec."""
    parsed = parse_command(
        b'{"type": "start_job", "spec": {"name": "a", "numerics": "fp32", "eps": 0.01}}'
    )
    assert isinstance(parsed, StartJob)
    assert parsed.spec == JobSpec(name="a", numerics="fp32", eps=0.01)
    assert parse_command(parsed.model_dump_json()) == parsed


def test_control_change_policy_and_drain() -> None:
    """change_policy carries a PolicySpec; drain_board names a board."""
    policy = parse_command(
        '{"type": "change_policy", "policy": {"name": "fixed", "config": {"q": 8}}}'
    )
    drain = parse_command('{"type": "drain_board", "board_id": "n6-01"}')
    assert isinstance(policy, ChangePolicy) and policy.policy == PolicySpec(
        name="fixed", config={"q": 8}
    )
    assert isinstance(drain, DrainBoard) and drain.drain


@pytest.mark.parametrize(
    "document",
    [
        '{"type": "launch", "request_id": "r9"}',
        '{"type": "start_job", "request_id": "r9"}',
        '{"type": "start_job", "request_id": "r9", "spec": {"numerics": "int8", "eps": 0.5}}',
        '{"type": "pause", "request_id": "r9", "extra": 1}',
        '{"type": "drain_board", "request_id": "r9", "board_id": "a/b"}',
    ],
)
def test_control_malformed_command_keeps_request_id(document: str) -> None:
    """An invalid command raises invalid_command carrying the request_id for the reply."""
    with pytest.raises(ProtocolError) as info:
        parse_command(document)
    assert info.value.kind == "invalid_command" and info.value.request_id == "r9"
    reply = error_reply(info.value)
    assert (reply.code, reply.request_id, reply.ok) == ("invalid_command", "r9", False)
    assert reply.message == info.value.detail and not reply.message.startswith("invalid_command")


@pytest.mark.parametrize(
    "document", [b"", b"\xff\xfe", b"[]", b"null", b"{", b"[" * 5000, b"1e999"]
)
def test_control_garbage_is_invalid_command(document: bytes) -> None:
    """Non-JSON, non-object and deeply nested input give the typed error."""
    with pytest.raises(ProtocolError) as info:
        parse_command(document)
    assert info.value.kind == "invalid_command" and info.value.request_id is None


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200),
        st.dictionaries(
            st.sampled_from(["type", "request_id", "job", "spec", "x"]),
            st.one_of(st.text(max_size=10), st.integers(), st.none()),
        ).map(json.dumps),
    )
)
def test_control_random_input_raises_only_protocol_error(document: bytes | str) -> None:
    """Random documents either parse or raise ProtocolError, nothing else."""
    try:
        parse_command(document)
    except ProtocolError as exc:
        assert exc.kind == "invalid_command"


def test_control_replies_events_and_status_round_trip() -> None:
    """Replies, errors, events and status reports survive JSON and parse_control."""
    board = BoardInfo(board_id="n6-01", state="ready", link="serial", throughput=812.5)
    job = JobStatus(name="demo", job_id=7, state="running", step=3, steps=600, q=4)
    status = StatusReport(daemon_version="0.1.0", time=1.5e9, job=job, boards=(board,))
    documents = [
        Reply(request_id="r1", command="status", status=status),
        Reply(command="list_boards", boards=(board,)),
        ErrorReply(request_id="r2", command="resume", code="no_job", message="No job is loaded."),
        Event(kind="step", time=1.5e9, job="demo", step=3, metrics={"loss": 2.3, "q": 4}),
        status,
    ]
    for document in documents:
        assert parse_control(document.model_dump_json()) == document


def test_control_error_reply_needs_code_from_closed_set() -> None:
    """An error reply with an unknown code or no message is invalid."""
    with pytest.raises(ValueError):
        ErrorReply(code="oops", message="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ErrorReply(code="busy", message="")


def test_control_events_refuse_non_finite_metrics() -> None:
    """Metrics are finite: JSON has no NaN."""
    with pytest.raises(ValueError):
        Event(kind="step", time=0.0, metrics={"loss": float("nan")})


def test_schema_committed_file_is_current() -> None:
    """protocol/control.schema.json equals the schema generated from the models."""
    assert SCHEMA_PATH.read_text(encoding="utf-8") == render(), "stale: run `qsched schema`"
    assert main(["--check"]) == 0


def test_schema_covers_every_control_document() -> None:
    """The schema's union names every command, reply, event, status and presence type."""
    schema = control_schema()
    types = set(schema["discriminator"]["mapping"])
    assert {
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
        "reply",
        "error",
        "event",
        "status_report",
        "board_presence",
        "daemon_state",
    } == types


def test_schema_main_writes_and_checks(tmp_path: Path) -> None:
    """main() writes the schema to a file and --check detects a stale one."""
    path = tmp_path / "s.json"
    assert main(["-o", str(path)]) == 0
    assert json.loads(path.read_text()) == control_schema()
    path.write_text("{}")
    assert main(["-o", str(path), "--check"]) == 1
    with pytest.raises(SystemExit) as exc:  # nothing to compare with: not a silent pass
        main(["-o", "-", "--check"])
    assert exc.value.code == 2


def test_states_job_lifecycle() -> None:
    """pending -> running <-> paused -> stopped/completed/failed; terminal states are final."""
    check_job_transition("pending", "running")
    check_job_transition("running", "paused")
    check_job_transition("paused", "running")
    check_job_transition("running", "completed")
    for terminal in JOB_TERMINAL:
        with pytest.raises(ValueError):
            check_job_transition(terminal, "running")
    with pytest.raises(ValueError):
        check_job_transition("paused", "completed")


def test_states_board_session() -> None:
    """A board goes hello -> loading -> ready <-> busy; faulty boards resync; Hello restarts."""
    path = [
        "unknown",
        "hello",
        "loading",
        "ready",
        "busy",
        "ready",
        "resync",
        "ready",
        "busy",
        "faulty",
        "resync",
        "ready",
        "gone",
        "hello",
    ]
    for old, new in itertools.pairwise(path):
        check_board_transition(old, new)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        check_board_transition("faulty", "busy")
    assert all("hello" in targets for state, targets in BOARD_TRANSITIONS.items())


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ('{"foo": 1}', 'a JSON object with a "type"'),
        ('{"type": "nosuch"}', "unknown type 'nosuch'"),
    ],
)
def test_control_refusals_speak_of_commands_not_parsers(document: str, words: str) -> None:
    """A document without a known type is told what a command is, not a parser's internals."""
    with pytest.raises(ProtocolError) as refused:
        parse_command(document)
    assert words in refused.value.detail and "discriminator" not in refused.value.detail
    assert "start_job" in refused.value.detail
