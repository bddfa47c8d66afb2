"""`qsched train` writes a run folder like a daemon job's and resumes from it to the same bits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qsched.daemon.state import Checkpoint
from qsched.daemon.train import main
from qsched.protocol.jobspec import JobSpec
from qsched.zo.trainer import train_zo

SETTINGS = [
    "--set",
    "steps=30",
    "--set",
    "eval_every=10",
    "--set",
    "checkpoint_every=10",
    "--set",
    "policy.name=fixed",
    "--set",
    "policy.config.q=2",
]


def _summary(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    return dict(json.loads(capsys.readouterr().out))


def test_train_writes_a_job_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Spec, status, metrics, checkpoints, export and summary, as a daemon job has them."""
    out = tmp_path / "run"
    assert main([*SETTINGS, "--out", str(out)]) == 0
    summary = _summary(capsys)
    spec = JobSpec.model_validate(json.loads((out / "spec.json").read_text()))
    reference = train_zo(spec)
    assert summary["checksum"] == f"{reference.state.checksum():08x}"
    assert json.loads((out / "status.json").read_text())["status"] == "completed"
    kinds = [json.loads(line)["kind"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("step") == 30 and kinds.count("validation") == 3
    steps = sorted(
        Checkpoint.from_bytes(p.read_bytes()).step for p in (out / "checkpoints").iterdir()
    )
    assert steps == [10, 20, 30]
    assert (out / "export" / f"{spec.name}.tflite").stat().st_size > 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 30


def test_train_summary_counts_scale_doublings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """INT8 with recalibration: channels by the number of doublings of their scale, as the
    final state holds them; none without recalibration."""
    settings = [*SETTINGS, "--set", "numerics=int8", "--set", "lr=1.0"]
    out = tmp_path / "recal"
    assert main([*settings, "--set", "recalibrate_every=5", "--out", str(out)]) == 0
    doublings = _summary(capsys)["scale_doublings"]
    spec = JobSpec.model_validate(json.loads((out / "spec.json").read_text()))
    exps = train_zo(spec).state.scale_exps
    assert exps is not None
    assert doublings == np.bincount(exps.astype(np.int64)).tolist()
    assert isinstance(doublings, list) and sum(doublings[1:]) > 0
    assert main([*settings, "--out", str(tmp_path / "fixed")]) == 0
    assert _summary(capsys)["scale_doublings"] is None


def test_train_resume_ends_with_the_same_bits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run stopped after step 15 whose last checkpoint was lost resumes from step 10 to the
    same weights."""
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert main([*SETTINGS, "--out", str(whole)]) == 0
    expected = _summary(capsys)["checksum"]
    assert main([*SETTINGS, "--out", str(broken), "--stop-at", "15"]) == 0
    capsys.readouterr()
    (broken / "checkpoints" / "ckpt-0000000015.qsckpt").unlink()  # killed before it was written
    assert json.loads((broken / "status.json").read_text())["status"] == "running"
    assert main(["--resume", str(broken)]) == 0
    assert _summary(capsys)["checksum"] == expected
    assert (broken / "export").is_dir()
    assert (whole / "export" / "job.tflite").read_bytes() == (
        broken / "export" / "job.tflite"
    ).read_bytes()


def test_train_refuses_to_overwrite_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out on a folder that holds a run, or --resume with spec options: status 2, one line."""
    out = tmp_path / "run"
    assert main([*SETTINGS, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*SETTINGS, "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["--resume", str(out), "--set", "steps=5"]) == 2
    assert main(["--resume", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("qsched train:") == 2 and "Traceback" not in err


def test_train_unresolved_spec_leaves_no_folder(tmp_path: Path) -> None:
    """A spec whose model does not resolve is refused before any folder is made."""
    out = tmp_path / "run"
    assert main(["--set", "model=nosuch", "--out", str(out)]) == 2
    assert not out.exists()
