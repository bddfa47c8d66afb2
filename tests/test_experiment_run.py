"""``qsched experiment`` on tiny grids: output files, their schema, determinism, transfer."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
from experiment_grids import tiny_grid

from qsched.daemon.cli import main as cli_main
from qsched.lab import experiment
from qsched.lab.plots import PLOT_FILES

TINY = tiny_grid("fixed:2", "qscheduler")


def _run(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], str]:
    stream = io.StringIO()
    status = experiment.main([*TINY, "--out", str(tmp_path), *extra], stream=stream)
    assert status == 0, stream.getvalue()
    return json.loads((tmp_path / "results.json").read_text()), stream.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    """One tiny grid (2 policies x fp32, int8 x 2 seeds, 12 steps) shared by the schema tests."""
    out = tmp_path_factory.mktemp("tiny")
    doc, log = _run(out, "--workers", "1")
    return out, doc, log


def test_run_writes_every_file(tiny: tuple[Path, dict[str, Any], str]) -> None:
    """results.json, .csv, .md and three non-empty PNG plots land in --out."""
    out, _, log = tiny
    for name in ("results.json", "results.csv", "results.md", *PLOT_FILES):
        assert (out / name).stat().st_size > 0, name
    for name in PLOT_FILES:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "runs 8/8" in log  # the progress bar reached the end


def test_run_json_schema(tiny: tuple[Path, dict[str, Any], str]) -> None:
    """Per configuration: accuracy stats over seeds, passes, steps, wall time, q trajectory,
    curve."""
    _, doc, _ = tiny
    assert doc["schema"] == experiment.SCHEMA
    assert doc["setting"]["mode"] == "scratch" and doc["setting"]["seeds"] == [0, 1]
    assert [c["key"] for c in doc["configs"]] == [
        "fixed q=2@fp32",
        "qscheduler@fp32",
        "fixed q=2@int8",
        "qscheduler@int8",
    ]
    for c in doc["configs"]:
        assert c["steps"] == 12 and c["seeds"] == [0, 1]
        for stat in ("final_accuracy", "best_accuracy", "forward_passes", "wall_s"):
            assert set(c[stat]) == {"mean", "std", "values"} and len(c[stat]["values"]) == 2
        assert c["best_accuracy"]["mean"] >= c["final_accuracy"]["mean"]
        assert c["curve"]["step"] == [4, 8, 12]
        assert len(c["curve"]["val_accuracy_mean"]) == 3
        assert [t["seed"] for t in c["q_trajectory"]] == [0, 1]
        assert all(t["changes"][0][0] == 0 for t in c["q_trajectory"])
    fixed = doc["configs"][0]
    assert fixed["forward_passes"]["values"] == [2 * 2 * 12] * 2  # two-sided: 2 passes per k
    assert fixed["q_trajectory"][0]["changes"] == [[0, 2]]
    assert {c["policy"] for c in doc["comparisons"]} == {"qscheduler@fp32", "qscheduler@int8"}
    assert set(doc["baseline"]["final_accuracy"]) == {"mean", "std", "values"}
    assert doc["command"].startswith("qsched experiment --grid custom")


def test_run_csv_and_markdown(tiny: tuple[Path, dict[str, Any], str]) -> None:
    """The CSV has one row per configuration with the documented columns; the table lists them."""
    out, doc, _ = tiny
    with (out / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == list(experiment.CSV_COLUMNS)
    assert [r["key"] for r in rows] == [c["key"] for c in doc["configs"]]
    assert float(rows[0]["final_accuracy_mean"]) == pytest.approx(
        doc["configs"][0]["final_accuracy"]["mean"], abs=1e-6
    )
    text = (out / "results.md").read_text()
    assert "| fixed q=2 | int8 |" in text and "| qscheduler | fp32 |" in text
    assert "Against the best fixed q" in text and "First-order baseline" in text


def test_run_two_workers_same_results(
    tmp_path: Path, tiny: tuple[Path, dict[str, Any], str]
) -> None:
    """Runs are pure functions of their specs: two worker processes give the same accuracies."""
    _, one, _ = tiny
    two, _ = _run(tmp_path, "--workers", "2", "--no-plots", "--no-baseline", "--quiet")
    for a, b in zip(one["configs"], two["configs"], strict=True):
        assert a["runs"] == [
            {**r, "wall_s": a_r["wall_s"]} for r, a_r in zip(b["runs"], a["runs"], strict=True)
        ]
        assert a["q_trajectory"] == b["q_trajectory"]
    assert two["baseline"] is None and two["environment"]["workers"] == 2


def test_run_transfer_setting(tmp_path: Path) -> None:
    """Transfer: a backbone pretrained on source classes, ZO on the last layer of the target
    task."""
    stream = io.StringIO()
    argv = [
        "--grid",
        "custom",
        "--policies",
        "fixed:4",
        "--numerics",
        "int8",
        "--seeds",
        "0",
        "--steps",
        "8",
        "--set",
        "eval_every=4",
        "--set",
        "trainable=last:1",
        "--transfer",
        "0,1,2,3,4/5,6,7,8,9",
        "--pretrain-steps",
        "30",
        "--no-plots",
        "--quiet",
        "--out",
        str(tmp_path),
    ]
    assert experiment.main(argv, stream=stream) == 0, stream.getvalue()
    doc = json.loads((tmp_path / "results.json").read_text())
    transfer = doc["setting"]["transfer"]
    assert doc["setting"]["mode"] == "transfer"
    assert transfer["source_classes"] == [0, 1, 2, 3, 4]
    assert transfer["pretrain"]["source_val_accuracy"] > 0.5  # 30 Adam steps learn 5 digits
    assert transfer["pretrain"]["target_val"] < 359  # only the target classes' validation samples
    assert doc["baseline"]["trainable"] == "last:1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "lr"], "KEY=VALUE"),
        (["--set", "int4:lr=1"], "not one of"),
        (["--transfer", "0,1"], "SOURCE/TARGET"),
        (["--set", "steps=0"], "invalid experiment"),
        (["--policies", "nosuchpolicy"], "unknown policy"),
        (["--set", 'model_options={"head":"x"}', "--steps", "2"], "has no option(s)"),
        (["--set", "backbone=missing.tflite", "--steps", "2"], "missing.tflite"),
    ],
)
def test_run_bad_arguments(tmp_path: Path, argv: list[str], message: str) -> None:
    """Bad overrides, transfer classes, specs, policy names, model options or backbone
    files exit 2 with the reason, in one line."""
    stream = io.StringIO()
    assert experiment.main([*argv, "--out", str(tmp_path)], stream=stream) == 2
    assert message in stream.getvalue() and "Traceback" not in stream.getvalue()
    assert not (tmp_path / "results.json").exists()


def test_run_through_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`qsched experiment` is dispatched by the CLI table."""
    status = cli_main(
        [
            "experiment",
            "--grid",
            "custom",
            "--policies",
            "fixed:1",
            "--numerics",
            "fp32",
            "--seeds",
            "0",
            "--steps",
            "4",
            "--set",
            "eval_every=2",
            "--no-plots",
            "--no-baseline",
            "--quiet",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 0
    assert "| fixed q=1 | fp32 |" in capsys.readouterr().err


def test_run_fleet_matches_trainer(tmp_path: Path, tiny: tuple[Path, dict[str, Any], str]) -> None:
    """--fleet 2 trains every run on in-process virtual boards: the same accuracies and q as
    the trainer."""
    _, one, _ = tiny
    fleet, _ = _run(
        tmp_path, "--workers", "1", "--fleet", "2", "--no-plots", "--no-baseline", "--quiet"
    )
    assert "2 virtual boards" in fleet["environment"]["trainer"]
    for a, b in zip(one["configs"], fleet["configs"], strict=True):
        assert [r["val_accuracy"] for r in a["runs"]] == [r["val_accuracy"] for r in b["runs"]]
        assert [r["val_loss"] for r in a["runs"]] == [r["val_loss"] for r in b["runs"]]
        assert a["q_trajectory"] == b["q_trajectory"]
        assert a["forward_passes"] == b["forward_passes"]


def test_run_fleet_refuses_transfer(tmp_path: Path) -> None:
    """The transfer setting builds its workload outside a job spec, so --fleet refuses it."""
    stream = io.StringIO()
    argv = ["--transfer", "0,1/2,3", "--fleet", "2", "--out", str(tmp_path)]
    assert experiment.main(argv, stream=stream) == 2
    assert "--fleet" in stream.getvalue()


def test_run_baseline_starts_from_the_backbone(tmp_path: Path) -> None:
    """With a backbone file and a new head, the first-order baseline trains the model the
    ZO runs start from (before, it built the zoo's model and refused the head option)."""
    from tflite_checks import synthetic_images

    from qsched.zo.data import RESNET8_CIFAR10

    data = synthetic_images((32, 32, 3), tmp_path / "images.npz", count=60)
    argv = ["--grid", "custom", "--policies", "fixed:2", "--numerics", "int8", "--seeds", "0"]
    argv += ["--steps", "4", "--dataset", str(data), "--set", f"backbone={RESNET8_CIFAR10}"]
    argv += ["--set", 'model_options={"head":"new"}', "--set", "trainable=last:1"]
    argv += ["--set", "batch_size=8", "--set", "eval_every=2", "--no-plots", "--quiet"]
    stream = io.StringIO()
    assert experiment.main([*argv, "--out", str(tmp_path / "out")], stream=stream) == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["baseline"]["trainable"] == "last:1"
    assert len(doc["baseline"]["final_accuracy"]["values"]) == 1


def test_run_baseline_alone(tmp_path: Path) -> None:
    """--grid baseline trains the first-order baseline on the setting's trainable layers
    and writes it without a ZO run or a plot; without the baseline it is refused."""
    argv = ["--grid", "baseline", "--seeds", "0", "1", "--steps", "6", "--set", "eval_every=3"]
    argv += ["--set", "trainable=last:1", "--quiet"]
    stream = io.StringIO()
    assert experiment.main([*argv, "--out", str(tmp_path / "out")], stream=stream) == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["configs"] == [] and doc["comparisons"] == []
    assert doc["baseline"]["trainable"] == "last:1" and doc["baseline"]["steps"] == 6
    assert len(doc["baseline"]["final_accuracy"]["values"]) == 2
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "First-order baseline" in markdown and "| policy |" not in markdown
    assert "No ZO run; the baseline took" in markdown and "Grid wall time" not in markdown
    assert not any((tmp_path / "out" / name).exists() for name in PLOT_FILES)
    refused = io.StringIO()
    no_baseline = [*argv, "--no-baseline", "--out", str(tmp_path / "no")]
    status = experiment.main(no_baseline, stream=refused)
    assert status == 2 and "baseline" in refused.getvalue()
    assert not (tmp_path / "no" / "results.json").exists()


def test_run_records_scale_doublings(tmp_path: Path) -> None:
    """INT8 runs with recalibration record how many channels doubled their scale how
    often, as the trainer's final state has them; runs without recalibration do not."""
    from qsched.protocol.jobspec import JobSpec
    from qsched.zo.recalibrate import doubling_counts
    from qsched.zo.trainer import train_zo

    recal = ["--set", "int8:recalibrate_every=4", "--set", "int8:lr=1.0", "--no-plots"]
    doc, _ = _run(tmp_path / "recal", "--numerics", "int8", *recal, "--quiet")
    fixed = next(c for c in doc["configs"] if c["label"] == "fixed q=2")
    run = fixed["runs"][0]
    spec = JobSpec.model_validate(
        {**doc["setting"]["spec"], "numerics": "int8", "seed": run["seed"]}
        | {"policy": {"name": "fixed", "config": {"q": 2}}}
    )
    exps = train_zo(spec).state.scale_exps
    assert exps is not None and run["scale_doublings"] == doubling_counts(exps)
    assert sum(run["scale_doublings"][1:]) > 0
    plain, _ = _run(tmp_path / "plain", "--numerics", "int8", "--no-plots", "--quiet")
    assert all("scale_doublings" not in r for c in plain["configs"] for r in c["runs"])
