"""The qsched command line: help, dispatch, unknown and unbuilt commands, config errors."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from qsched.daemon import cli
from qsched.daemon.cli import COMMANDS, Command, NotBuiltError, main, resolve


@pytest.fixture(autouse=True)
def _restore_globals(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # main() exports --config as $QSCHED_CONFIG for the subcommand and configures
    # logging; undo both after each test.
    monkeypatch.setenv("QSCHED_CONFIG", "")
    yield
    structlog.reset_defaults()


def test_cli_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`qsched --help` exits 0 and names every command of the table."""
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_cli_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown command is a usage error (exit 2) that lists the choices."""
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_cli_group_needs_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    """`qsched bench` without engine|fleet is a usage error."""
    assert main(["bench"]) == 2
    assert "engine, fleet" in capsys.readouterr().err
    assert main(["bench", "gpu"]) == 2


def test_cli_not_built_yet(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command whose module or function is missing exits 2 with 'not built yet'."""
    monkeypatch.setitem(COMMANDS, "ghost", Command("qsched.daemon.no_such_module:main", "x"))
    monkeypatch.setitem(COMMANDS, "shade", Command("qsched.daemon.cli:no_such_function", "x"))
    assert main(["ghost"]) == 2
    assert "qsched ghost: not built yet" in capsys.readouterr().err
    assert main(["shade"]) == 2
    assert "not built yet" in capsys.readouterr().err


def test_cli_dispatch_passes_arguments_and_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command gets the arguments after its name; its return value is the exit status."""
    seen: list[list[str]] = []

    def fake(argv: list[str]) -> int:
        seen.append(argv)
        return 7

    monkeypatch.setattr(cli, "fake_main", fake, raising=False)
    monkeypatch.setitem(COMMANDS, "fake", Command("qsched.daemon.cli:fake_main", "x"))
    assert main(["--log-level", "warning", "fake", "--flag", "value"]) == 7
    assert seen == [["--flag", "value"]]


def test_cli_resolve_keeps_real_import_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A built module that fails to import (a missing dependency) is not 'not built yet'."""
    (tmp_path / "qsched_broken_cmd.py").write_text(
        "import qsched_missing_dependency\ndef main(argv): return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="qsched_missing_dependency"):
        resolve("qsched_broken_cmd:main")


def test_cli_every_target_resolves_or_is_unbuilt() -> None:
    """Each table entry imports cleanly or is reported as not built (never another error)."""
    for name, command in COMMANDS.items():
        with contextlib.suppress(NotBuiltError):
            assert callable(resolve(command.target)), name


def test_cli_config_error_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A broken --config file stops any command with exit 2 and names the setting."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[mqtt]\nport = 'many'\n")
    assert main(["--config", str(bad), "config"]) == 2
    assert "mqtt.port" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.toml"), "config"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_config_prints_effective_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`qsched config` shows file + environment merged, with the password masked."""
    path = tmp_path / "q.toml"
    path.write_text('fleet = "lab"\n[mqtt]\npassword = "hunter2"\n')
    monkeypatch.setenv("QSCHED_MQTT_PORT", "1999")
    assert main(["--config", str(path), "config"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert data["fleet"] == "lab" and data["mqtt"]["port"] == 1999
    assert "hunter2" not in out


def test_cli_train_rejects_invalid_spec(capsys: pytest.CaptureFixture[str]) -> None:
    """An invalid job spec override is a usage error before any training starts."""
    assert main(["train", "--set", "numerics=int4"]) == 2
    assert "invalid job spec" in capsys.readouterr().err
    assert main(["train", "--set", "no-equals-sign"]) == 2


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model=nosuch", "nosuch"),
        ("dataset=nosuch", "nosuch"),
        ("policy.name=nosuch", "nosuch"),
        ("model_options.width=2", "width"),
        ("backbone=missing.tflite", "missing.tflite"),
    ],
)
def test_cli_train_unresolved_name_is_one_line(
    capsys: pytest.CaptureFixture[str], override: str, named: str
) -> None:
    """A model, data set, policy, option or file that does not resolve: status 2, one named line."""
    assert main(["train", "--set", "steps=1", "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qsched train: ") and named in err and "Traceback" not in err


def test_logging_json_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    """Records are JSON lines on a non-terminal stderr, with level, timestamp and fields."""
    from qsched.daemon.logging import configure_logging

    configure_logging("info")
    structlog.get_logger("qsched.test").info("board appeared", board="b-1")
    structlog.get_logger("qsched.test").debug("hidden at info")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == 1
    assert lines[0]["event"] == "board appeared" and lines[0]["board"] == "b-1"
    assert lines[0]["level"] == "info" and "timestamp" in lines[0]
    with pytest.raises(ValueError, match="log level"):
        configure_logging("loud")


def test_board_state_changes_are_logged_at_debug_only(capsys: pytest.CaptureFixture[str]) -> None:
    """A board's state change is a debug record: there at level debug, not even built at
    info (``debug_enabled``, asked on the per-board path)."""
    from qsched.daemon.fleet import BoardSession
    from qsched.daemon.logging import configure_logging, debug_enabled

    session = BoardSession(address="b-1", link=object(), transport="inproc")  # type: ignore[arg-type]
    configure_logging("debug")
    assert debug_enabled()
    assert session.set_state("hello", "said hello")
    configure_logging("info")
    assert not debug_enabled()
    assert session.set_state("ready", "synchronised")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(r["event"], r["new"]) for r in lines] == [("board state", "hello")]


def test_logging_stdlib_records_are_json_too(capsys: pytest.CaptureFixture[str]) -> None:
    """A library's standard-library record (asyncio, with a traceback) is one JSON line as well."""
    import logging

    from qsched.daemon.logging import configure_logging

    configure_logging("info")
    try:
        raise RuntimeError("board gone")
    except RuntimeError as exc:
        logging.getLogger("asyncio").error("Future exception was never retrieved", exc_info=exc)
    logging.getLogger("aiomqtt").debug("hidden at info")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == 1
    record = lines[0]
    assert (
        record["event"] == "Future exception was never retrieved" and record["logger"] == "asyncio"
    )
    assert record["level"] == "error" and "timestamp" in record
    assert record["exception"][0]["exc_type"] == "RuntimeError"
