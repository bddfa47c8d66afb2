"""Every converter-made fixture on virtual boards: a daemon job over a real broker and a
`qsched demo` run each fine-tune its last layer to the single-process weights, and the
export keeps the file's form (only that layer's bytes changed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_daemon_resume import _boards, _daemon, _final_state, _start_job, procs
from tflite_checks import assert_only_layer_changed, synthetic_images

from qsched.lab.broker import MosquittoBroker
from qsched.lab.demo import main as demo_main
from qsched.lab.procs import Processes
from qsched.protocol.jobspec import JobSpec
from qsched.zo.datasets import load_dataset
from qsched.zo.tflite_io import import_tflite, read_tflite
from qsched.zo.trainer import TrainResult, train_zo
from qsched.zo.workload import Workload

pytestmark = pytest.mark.slow
__all__ = ["procs"]  # the fixture, shared with test_daemon_resume

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "tflite").glob("*.tflite"))


def _data_sets(tmp_path: Path) -> dict[Path, Path]:
    """A small synthetic image set for each fixture, one per input shape."""
    by_shape: dict[tuple[int, ...], Path] = {}
    out = {}
    for fixture in FIXTURES:
        shape = tuple(read_tflite(fixture).model.input_shape)
        if shape not in by_shape:
            name = "fx" + "x".join(str(d) for d in shape)
            by_shape[shape] = synthetic_images(shape, tmp_path / f"{name}.npz", count=40)
        out[fixture] = by_shape[shape]
    return out


def _spec(fixture: Path, data: Path) -> dict[str, object]:
    return {
        "name": fixture.stem.replace("_", "-"),
        "dataset": str(data),
        "backbone": str(fixture),
        "numerics": "int8",
        "trainable": "last:1",
        "steps": 2,
        "eval_every": 2,
        "checkpoint_every": 2,
        "batch_size": 4,
        # Large enough that two steps move some head weight by a whole int8 step.
        "lr": 2.0,
        "policy": {"name": "fixed", "config": {"q": 2}},
    }


def _assert_exported_form(
    exported: bytes, fixture: Path, spec: JobSpec, result: TrainResult
) -> None:
    """The file with only the head's bytes changed. The random-weight MobileNets' features
    are constant on these images (every batch's loss is ln 10: the logits are all
    equal), so their heads get no signal and cannot move; the others' heads must have."""
    model = import_tflite(exported)
    initial = Workload.from_spec(spec).initial_state().params
    moved = not np.array_equal(result.state.params, initial)
    no_signal = all(abs(s.train_loss - math.log(10)) < 1e-4 for s in result.steps)
    assert moved or no_signal, fixture.name
    head = model.model.param_nodes()[-1].name
    assert_only_layer_changed(exported, fixture.read_bytes(), model, head, moved=moved)


def test_daemon_trains_every_fixture_over_mqtt(
    mqtt_broker: MosquittoBroker, tmp_path: Path, procs: Processes
) -> None:
    """One daemon and two board processes holding each fixture's data set by name: one
    job per fixture, each ending with the reference checksum and history."""
    data = _data_sets(tmp_path)
    held = []
    for path in sorted(set(data.values())):
        held += ["--dataset", f"{load_dataset(path).name}={path}"]
    state, fleet = tmp_path / "state", "fixtures"
    _boards(procs, mqtt_broker, fleet, 2, "fx", *held)
    _daemon(procs, mqtt_broker, state, fleet)
    for fixture in FIXTURES:
        spec = _spec(fixture, data[fixture])
        _start_job(mqtt_broker, fleet, spec, tmp_path)
        final, history = _final_state(state, str(spec["name"]), timeout=180)
        reference = train_zo(JobSpec.model_validate(spec))
        assert final.checksum() == reference.state.checksum(), fixture.name
        assert history == [*reference.steps, *reference.evals], fixture.name
        export = state / "jobs" / str(spec["name"]) / "export" / f"{spec['name']}.tflite"
        _assert_exported_form(export.read_bytes(), fixture, reference.spec, reference)


def test_demo_trains_every_fixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`qsched demo` (two serial pty boards) on each fixture: the reference weights, the
    file's own form exported."""
    data = _data_sets(tmp_path)
    for fixture in FIXTURES:
        out = tmp_path / fixture.stem
        argv = ["--steps", "2", "--boards", "2", "--no-progress", "--out", str(out)]
        for key, value in _spec(fixture, data[fixture]).items():
            if key not in ("name", "steps", "policy"):
                argv += ["--set", f"{key}={value}"]
        assert demo_main(argv) == 0, fixture.name
        capsys.readouterr()
        spec = JobSpec.model_validate(json.loads((out / "spec.json").read_text()))
        reference = train_zo(spec)
        exported = (out / "model.tflite").read_bytes()
        trained = Workload.from_spec(spec).to_quant_model(reference.state)
        head = trained.model.param_nodes()[-1].name
        got = import_tflite(exported).layers[head].weight
        assert np.array_equal(got, trained.layers[head].weight), fixture.name
        _assert_exported_form(exported, fixture, spec, reference)
