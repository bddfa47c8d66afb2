"""`qsched ctl` arguments to command documents (no broker: the documents only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qsched.daemon.ctl import _parser, build_command, main


def _command(*argv: str) -> dict[str, object]:
    return build_command(_parser().parse_args(list(argv)))


def test_ctl_start_set_without_spec_file() -> None:
    """--set alone builds the spec from defaults plus the overrides, nested keys included."""
    command = _command(
        "start", "--set", "name=j2", "--set", "steps=50", "--set", "policy.name=fixed"
    )

    assert command == {
        "type": "start_job",
        "spec": {"name": "j2", "steps": 50, "policy": {"name": "fixed"}},
    }


def test_ctl_start_set_overrides_spec_file(tmp_path: Path) -> None:
    """A spec file is read and --set wins over its fields."""
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "a", "steps": 10}))

    command = _command("start", str(spec), "--set", "steps=20")

    assert command == {"type": "start_job", "spec": {"name": "a", "steps": 20}}


def test_ctl_policy_config_is_not_the_daemon_config() -> None:
    """`policy NAME --config JSON` is the policy's configuration; the daemon's file stays unset."""
    args = _parser().parse_args(["policy", "fixed", "--config", '{"q": 8}', "--job", "j"])

    assert args.config is None
    assert build_command(args) == {
        "type": "change_policy",
        "policy": {"name": "fixed", "config": {"q": 8}},
        "job": "j",
    }


def test_ctl_policy_config_must_be_object() -> None:
    """A policy configuration that is not a JSON object is refused."""
    with pytest.raises(ValueError, match="JSON object"):
        _command("policy", "fixed", "--config", "[1]")


@pytest.mark.parametrize("address", ["foo", "host:", "host:0", "host:99999"])
def test_ctl_bad_mqtt_address_is_usage_error(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --mqtt that is not HOST:PORT exits 2 with a sentence, before any connection."""
    assert main(["--mqtt", address, "status"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_ctl_events_without_broker_is_no_reply(capsys: pytest.CaptureFixture[str]) -> None:
    """`ctl events` with no broker listening exits 3 with one line, not a traceback."""
    from qsched.lab.broker import free_port

    assert main(["--mqtt", f"127.0.0.1:{free_port()}", "events"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("qsched ctl: broker 127.0.0.1:") and "Traceback" not in err
