"""The fault campaign's short version: a live daemon survives a fuzz, a lying board, a
hung board and a noisy serial line, and every job trains exactly."""

from __future__ import annotations

import os
import select
import time
from pathlib import Path

import pytest

from qsched.lab.chaos import main
from qsched.lab.chaos_fuzz import control_documents, data_messages
from qsched.lab.noisy_line import NoisyLine

pytestmark = pytest.mark.slow


def test_chaos_documents_are_reproducible_and_varied() -> None:
    """The same seed gives the same documents; they include valid, broken and huge ones."""
    first, again = list(control_documents(400, 3)), list(control_documents(400, 3))
    assert first == again and len(set(first)) > 200
    assert any(d.startswith(b'{"type": "status"') for d in first)
    assert any(len(d) > 1 << 20 for d in first) and any(b"\\ud800" in d for d in first)
    kinds = {kind for _, kind, _ in data_messages(200, 3, ["board-00"])}
    assert kinds == {"out", "presence"}


def _read(fd: int, count: int, timeout: float = 5.0) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1)[0]:
            out += os.read(fd, count - len(out))
    return out


def test_chaos_noisy_line_garbles_at_its_rate_both_ways() -> None:
    """Bytes cross the line both ways; at rate 0.1 about a tenth arrive changed."""
    with NoisyLine(seed=5) as line:
        daemon = os.open(line.daemon_port, os.O_RDWR | os.O_NOCTTY)
        board = os.open(line.board_port, os.O_RDWR | os.O_NOCTTY)
        try:
            os.write(daemon, b"clean")
            assert _read(board, 5) == b"clean"
            line.error_rate = 0.1
            sent = bytes(range(256)) * 8
            os.write(board, sent)
            got = _read(daemon, len(sent))
        finally:
            os.close(daemon)
            os.close(board)
    changed = sum(a != b for a, b in zip(sent, got, strict=True))
    assert len(got) == len(sent) and 120 < changed < 300 and changed == line.bytes_garbled


def test_chaos_short_campaign_every_trial_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """300 + 300 documents, then one liar, one hung and one noisy-line trial: all exact."""
    argv = ["--faults", "fuzz,liar,hung,serial-1e-3", "--trials", "1", "--out", str(tmp_path)]
    assert main([*argv, "--control", "300", "--data", "300"]) == 0
    table = capsys.readouterr().out
    assert "| fuzz: control documents | 300 | 1/1 | - | - | 301/301 | 0 |" in table
    assert "| liar | 1 | 1/1 | 0 | - | - | 0 |" in table and "lying results caught" in table
    assert "| hung | 1 | 1/1 | 0 |" in table
    assert "| serial-1e-3 | 1 | 1/1 | 0 |" in table and "bytes garbled" in table


def test_chaos_unknown_fault_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown fault kind, or the fuzz anywhere but first: status 2 and one line."""
    assert main(["--faults", "meteor"]) == 2
    assert main(["--faults", "liar,fuzz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("faults must be some of" in line for line in err)
