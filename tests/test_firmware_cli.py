"""The host board's command line: help, usage errors (sanitizer build)."""

from __future__ import annotations

import subprocess

from qsched.firmware.native import board_executable


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    exe = board_executable(sanitized=True)
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_cli_help_exits_zero_and_names_every_option() -> None:
    """``qs_board --help`` prints every option on stdout and exits with status 0."""
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for option in ("--pty", "--dataset", "--board-id", "--help"):
        assert option in proc.stdout


def test_cli_usage_errors_exit_two() -> None:
    """No device, an unknown option and a device plus --pty are usage errors (status 2)."""
    for args in ((), ("--bogus",), ("/dev/null", "--pty", "link")):
        proc = _run(*args)
        assert proc.returncode == 2, args
        assert proc.stderr.startswith("usage: qs_board"), args


def test_cli_bad_board_id_is_named() -> None:
    """A board id outside the wire alphabet is refused with a sentence naming it."""
    proc = _run("--pty", "unused-link", "--board-id", "bad id")
    assert proc.returncode == 2
    assert "board id" in proc.stderr and "'bad id'" in proc.stderr
