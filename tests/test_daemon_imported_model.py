"""A user's model through the daemon: MLPerf Tiny's ResNet-8 fine-tuned by a daemon job
over a real broker on virtual board processes, to the single-process weights, and
exported back in the file's own form with ``ctl export``."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_daemon_resume import _boards, _ctl, _daemon, _final_state, _reference, _start_job, procs
from tflite_checks import assert_only_layer_changed

from qsched.lab.broker import MosquittoBroker
from qsched.lab.procs import Processes
from qsched.zo.data import RESNET8_CIFAR10
from qsched.zo.tflite_io import import_tflite

pytestmark = pytest.mark.slow
__all__ = ["procs"]  # the fixture, shared with test_daemon_resume

DATASET = "eurosat:size=32,scale=255,limit_per_class=20"
SPEC = {
    "name": "resnet8-head",
    "dataset": DATASET,
    "backbone": str(RESNET8_CIFAR10),
    "numerics": "int8",
    "trainable": "last:1",
    "steps": 8,
    "eval_every": 4,
    "checkpoint_every": 4,
    "batch_size": 16,
    "policy": {"name": "fixed", "config": {"q": 4}},
}


def test_daemon_trains_an_imported_model_and_exports_its_form(
    mqtt_broker: MosquittoBroker, tmp_path: Path, procs: Processes
) -> None:
    """Two board processes hold the data set by the name the daemon selects; the job ends
    with the reference checksum; the export is the user's file with a trained head."""
    state, fleet = tmp_path / "state", "byom"
    held = ("--dataset", f"eurosat32x255={DATASET}")
    _boards(procs, mqtt_broker, fleet, 2, "bb", *held)
    _daemon(procs, mqtt_broker, state, fleet)
    _start_job(mqtt_broker, fleet, SPEC, tmp_path)
    final, history = _final_state(state, SPEC["name"], timeout=180)  # type: ignore[arg-type]
    checksum, reference_history = _reference(SPEC)
    assert final.checksum() == checksum and history == reference_history
    reply = _ctl(mqtt_broker, fleet, "export", str(SPEC["name"]))
    assert reply["ok"] is True, reply
    exported = Path(str(reply["path"])).read_bytes()
    model = import_tflite(exported)
    assert model.source is not None and model.source.output_ops == ("SOFTMAX",)
    assert_only_layer_changed(
        exported, RESNET8_CIFAR10.read_bytes(), model, model.model.nodes[-1].name
    )
