"""``qsched lr-defaults``, the short version: two settings, one seed, a few steps."""

from __future__ import annotations

import pytest

from qsched.lab import lr_defaults


def test_lr_defaults_prints_a_row_per_setting_and_a_column_per_unit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(lr_defaults, "SETTINGS", lr_defaults.SETTINGS[:2])
    assert lr_defaults.main(["--seeds", "0", "--steps", "20"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| zoo")]
    assert len(lines) == 2
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 2 + len(lr_defaults.UNITS)
        assert float(cells[1]) > 1000  # 1/s^2 of int8 weights of scale ~1e-2
        assert all(0.0 <= float(c) <= 1.0 for c in cells[2:])
    assert "1 seeds" in out
