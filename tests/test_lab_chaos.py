"""The fault campaign's short version: a live daemon survives a fuzz and trains exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from qsched.lab.chaos import control_documents, data_messages, main


def test_chaos_documents_are_reproducible_and_varied() -> None:
    """The same seed gives the same documents; they include valid, broken and huge ones."""
    first, again = list(control_documents(400, 3)), list(control_documents(400, 3))
    assert first == again and len(set(first)) > 200
    assert any(d.startswith(b'{"type": "status"') for d in first)
    assert any(len(d) > 1 << 20 for d in first) and any(b"\\ud800" in d for d in first)
    kinds = {kind for _, kind, _ in data_messages(200, 3, ["board-00"])}
    assert kinds == {"out", "presence"}


def test_chaos_short_fuzz_every_document_answered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """300 control documents and 300 data-plane messages: all answered, no crash, exact job."""
    assert main(["--control", "300", "--data", "300", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "| fuzz: control documents | 300 | yes |" in table
    assert "| fuzz: data-plane messages | 300 | yes | - | 0 |" in table


def test_chaos_unbuilt_trials_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    """Asking for a trial kind that is not built is status 2 and one line."""
    assert main(["--faults", "daemon-kill"]) == 2
    assert "not built yet" in capsys.readouterr().err
