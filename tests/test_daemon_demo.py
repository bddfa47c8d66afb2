"""``qsched demo`` end to end (board processes on ptys and over a private Mosquitto), and
the progress line it shares with ``qsched experiment``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from qsched.lab.broker import MosquittoBroker
from qsched.lab.demo import main, q_trajectory
from qsched.lab.progress import ProgressLine, format_duration, render_bar
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.links.config import parse_host_port
from qsched.zo.tflite_io import export_tflite, read_tflite
from qsched.zo.trainer import train_zo
from qsched.zo.workload import Workload


class FakeClock:
    """A settable monotonic clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _reference_tflite(spec: JobSpec) -> bytes:
    """The .tflite of the single-process reference run of ``spec``."""
    state = train_zo(spec).state
    return export_tflite(Workload.from_spec(spec).to_quant_model(state))


def _records(out: Path, kind: str) -> list[dict[str, object]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_demo_serial_short_run_writes_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """30 default-spec steps on 4 pty boards: metrics, plot, summary, and the reference model."""
    out = tmp_path / "run"
    status = main(["--steps", "30", "--out", str(out)])
    printed = capsys.readouterr()

    assert status == 0
    summary = json.loads((out / "summary.json").read_text())
    steps, evals = _records(out, "step"), _records(out, "validation")
    assert summary["status"] == "completed" and summary["steps"] == 30 == len(steps)
    assert summary["boards"] == 4 and summary["link"] == "serial pseudo-terminals"
    assert [e["step"] for e in evals] == [9, 19, 29]
    assert summary["final_accuracy"] == evals[-1]["val_accuracy"]
    assert summary["best_accuracy"] == max(e["val_accuracy"] for e in evals)
    assert (
        summary["forward_passes"] == sum(2 * s["q"] for s in steps) == steps[-1]["forward_passes"]
    )
    assert summary["q_trajectory"][0] == [0, steps[0]["q"]]
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    expected = _reference_tflite(JobSpec(name="demo", steps=30))
    assert (out / "model.tflite").read_bytes() == expected
    assert read_tflite(out / "model.tflite").layers  # the file reads back as a model
    assert "final val accuracy" in printed.out and str(out) in printed.out
    assert (out / "demo.log").exists() and "demo.log" in summary[
        "files"
    ]  # the daemon's log, listed
    assert "demo  [" in printed.err  # the progress line


def test_demo_mqtt_private_broker_shards_over_boards(
    tmp_path: Path, mqtt_broker: MosquittoBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    """Over a private Mosquitto, 2 boards share q=6 and the model equals the reference."""
    out = tmp_path / "mqtt"
    policy = '{"name": "fixed", "config": {"q": 6}}'
    status = main(
        [
            "--steps",
            "12",
            "--boards",
            "2",
            "--out",
            str(out),
            "--no-progress",
            "--mqtt",
            f"{mqtt_broker.host}:{mqtt_broker.port}",
            "--set",
            f"policy={policy}",
            "--set",
            "eval_every=6",
        ]
    )
    capsys.readouterr()

    assert status == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["link"].startswith("MQTT ") and summary["steps"] == 12
    assert sorted(summary["work"]) == ["vb-00", "vb-01"] and min(summary["work"].values()) > 0
    assert summary["q_trajectory"] == [[0, 6]]
    spec = JobSpec(
        name="demo", steps=12, eval_every=6, policy={"name": "fixed", "config": {"q": 6}}
    )
    assert (out / "model.tflite").read_bytes() == _reference_tflite(spec)


def test_demo_bad_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --set, --steps or --mqtt is a usage error before any board starts."""
    assert main(["--out", str(tmp_path / "a"), "--set", "numerics=int4"]) == 2
    assert main(["--out", str(tmp_path / "b"), "--steps", "0"]) == 2
    assert main(["--out", str(tmp_path / "c"), "--mqtt", "nohost"]) == 2
    assert "qsched demo:" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_demo_unrunnable_job_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing backbone or a bad model option: one line, status 2, nothing started or made."""
    missing = tmp_path / "missing.tflite"
    assert main(["--out", str(tmp_path / "a"), "--set", f"backbone={missing}"]) == 2
    assert main(["--out", str(tmp_path / "b"), "--set", 'model_options={"hidden": -3}']) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("qsched demo: the job cannot run") == 2
    assert f"backbone '{missing}': No such file" in err and "hidden=-3" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_demo_q_trajectory_change_points() -> None:
    """Only the steps where q changes are kept, the first step always."""
    assert q_trajectory([(0, 1), (1, 1), (2, 2), (3, 2), (4, 8)]) == [(0, 1), (2, 2), (4, 8)]
    assert q_trajectory([]) == []


def test_demo_parse_host_port() -> None:
    """HOST:PORT, IPv6 in brackets; a missing or bad port raises ValueError."""
    assert parse_host_port("127.0.0.1:1883") == ("127.0.0.1", 1883)
    assert parse_host_port("[::1]:8883") == ("::1", 8883)
    for bad in ("broker", "broker:", ":1883", "broker:99999"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


def test_progress_live_redraws_in_place() -> None:
    """On a terminal the line is redrawn with \\r, padded over a longer previous line."""
    clock, stream = FakeClock(), io.StringIO()
    bar = ProgressLine(10, label="t", stream=stream, live=True, clock=clock)
    bar.update(1, q=2, loss=1.25, boards="4/4")
    clock.now += 1.0
    bar.update(2, boards=None)
    bar.close()

    text = stream.getvalue()
    first, second = text.split("\r")[1:3]
    assert first.startswith("t  [##") and "q 2  loss 1.2500  boards 4/4" in first
    assert "boards" not in second and len(second) == len(first)  # blanks the old tail
    assert text.endswith("\n") and text.count("\n") == 1


def test_progress_pipe_prints_periodic_lines() -> None:
    """Not on a terminal: one line per interval, a final line, no carriage returns."""
    clock, stream = FakeClock(), io.StringIO()
    bar = ProgressLine(100, stream=stream, live=False, line_every_s=10.0, clock=clock)
    for step in range(1, 60):
        clock.now += 0.5  # 29.5 s in all: lines at 0.5, 10.5, 20.5 s
        bar.update(step, q=step // 10)
    bar.note("board vb-01 left")
    bar.close()

    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert len(lines) == 5 and lines[3] == "board vb-01 left"
    assert " 59/100" in lines[-1] and "q 5" in lines[-1]


def test_progress_helpers_format() -> None:
    """Durations as m:ss or h:mm:ss, bars clipped to their total."""
    assert format_duration(73.2) == "1:13"
    assert format_duration(4000) == "1:06:40"
    assert format_duration(float("nan")) == "?"
    assert render_bar(5, 10, width=10) == "[#####-----]  5/10"
    assert render_bar(15, 10, width=4) == "[####] 10/10"


def test_demo_fine_tunes_a_users_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's flow on serial pty boards: MLPerf Tiny's ResNet-8 head on EuroSAT at
    32x32 (a data set the boards are told about), exported in the file's own form."""
    from qsched.zo.data import RESNET8_CIFAR10
    from qsched.zo.tflite_io import export_tflite
    from qsched.zo.trainer import train_zo
    from qsched.zo.workload import Workload

    out = tmp_path / "run"
    settings = {
        "backbone": str(RESNET8_CIFAR10),
        "dataset": "eurosat:size=32,scale=255,limit_per_class=6",
        "numerics": "int8",
        "trainable": "last:1",
        "eval_every": 3,
        "batch_size": 8,
    }
    argv = ["--steps", "3", "--boards", "2", "--no-progress", "--out", str(out)]
    for key, value in settings.items():
        argv += ["--set", f"{key}={value}"]
    assert main(argv) == 0
    capsys.readouterr()
    spec = JobSpec.model_validate(json.loads((out / "spec.json").read_text()))
    reference = train_zo(spec)
    workload = Workload.from_spec(spec)
    exported = (out / "model.tflite").read_bytes()
    assert exported == export_tflite(workload.to_quant_model(reference.state))  # same bits
    back = read_tflite(out / "model.tflite")
    assert back.source is not None and back.source.output_ops == ("SOFTMAX",)
    assert len(exported) == RESNET8_CIFAR10.stat().st_size
