"""``qsched bench engine`` runs end to end on a tiny configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qsched.lab.bench_engine import bench_model, main


def test_tflite_bench_model_measures_both_sides() -> None:
    """bench_model times both sides on the same passes; the engine equals LiteRT-ref."""
    r = bench_model("cnn", q=2, batch=4, repeats=1, trainable="head")
    assert r.engine_s > 0 and r.litert_s > 0
    assert r.engine_rate == pytest.approx(4 / r.engine_s)
    assert r.ratio == pytest.approx(r.engine_rate / r.litert_rate)
    # Optimised LiteRT kernels round differently from the reference by at most a step or two.
    assert r.max_abs_diff <= 2
    assert r.reference_exact and r.reference_rate > 0


def test_tflite_bench_main_prints_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """main prints the resolvers used and a table row per model, and writes JSON."""
    out = tmp_path / "bench.json"
    code = main(
        [
            "--models",
            "cnn",
            "--q",
            "1",
            "--batch",
            "2",
            "--repeats",
            "1",
            "--trainable",
            "all",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    assert "default (optimised) op resolver" in text and "reference-kernel" in text
    assert any(line.startswith("cnn ") for line in text.splitlines())
    assert "reference kernels: bit-exact" in text
    assert [r["model"] for r in json.loads(out.read_text())] == ["cnn"]


def test_tflite_bench_main_bad_arguments() -> None:
    """An unknown model or a non-positive q is refused with status 2."""
    assert main(["--models", "vgg"]) == 2
    assert main(["--q", "0"]) == 2
