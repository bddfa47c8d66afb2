"""Where an INT8 model's activations clamp on real inputs, and what that costs."""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np
import pytest

from qsched.firmware.model_report import main
from qsched.zo import engine
from qsched.zo.clamping import clamping_report
from qsched.zo.data import RESNET8_CIFAR10
from qsched.zo.datasets import load_dataset
from qsched.zo.graph import QuantModel, TensorQuant
from qsched.zo.quantize import quantize_input
from qsched.zo.tflite_io import import_tflite

DATASET = "eurosat:size=32,scale=255"


@cache
def _resnet8() -> QuantModel:
    return import_tflite(RESNET8_CIFAR10.read_bytes())


def _narrowed_logits(qmodel: QuantModel, factor: float) -> QuantModel:
    """The model with its logits' scale divided by ``factor``: most logits clamp."""
    name = qmodel.model.output_name
    old = qmodel.tensors[name]
    tensors = {**qmodel.tensors, name: TensorQuant(old.scale / factor, old.zero_point)}
    return dataclasses.replace(qmodel, tensors=tensors)


def test_int8_tensors_hold_every_tensor_and_end_in_the_logits() -> None:
    qmodel = _resnet8()
    x = np.random.default_rng(0).integers(-128, 128, (3, 32, 32, 3), dtype=np.int8)
    tensors = engine.int8_tensors(qmodel, x)
    assert set(tensors) == {qmodel.model.input_name} | {n.output for n in qmodel.model.nodes}
    assert np.array_equal(tensors[qmodel.model.output_name], engine.run_int8(qmodel, x))


def test_report_counts_each_end_of_every_tensor() -> None:
    """Shares counted over slices equal a direct count over the whole set, at both ends."""
    data = load_dataset(DATASET)
    x, y = data.x_val[:130], data.y_val[:130]  # more than one slice
    qmodel = _narrowed_logits(_resnet8(), 40.0)
    report = clamping_report(qmodel, x, y)
    tensors = engine.int8_tensors(qmodel, quantize_input(qmodel, x))
    assert report.samples == 130 and len(report.tensors) == len(qmodel.model.nodes)
    for row, node in zip(report.tensors, qmodel.model.nodes, strict=True):
        values = tensors[node.output]
        assert row.node == node.name
        assert row.bottom == pytest.approx(np.mean(values == -128))
        assert row.top == pytest.approx(np.mean(values == 127))
    logits = report.tensors[-1]
    assert logits.bottom + logits.top > 0.5  # the narrowed logits do clamp
    assert logits.high == pytest.approx(logits.scale * (127 - logits.zero_point))


def test_report_accuracy_with_int8_and_with_float_activations() -> None:
    data = load_dataset(DATASET)
    x, y = data.x_val[:60], data.y_val[:60]
    qmodel = _resnet8()
    report = clamping_report(qmodel, x, y)
    int8_logits = engine.run_int8(qmodel, quantize_input(qmodel, x))
    float_logits = engine.run_fp32(qmodel.model, x)
    assert report.int8_accuracy == pytest.approx(np.mean(int8_logits.argmax(-1) == y))
    assert report.float_accuracy == pytest.approx(np.mean(float_logits.argmax(-1) == y))
    assert clamping_report(qmodel, x).int8_accuracy is None


def test_inspect_shows_clamping_on_a_data_set(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(RESNET8_CIFAR10), "--dataset", DATASET, "--samples", "20"]) == 0
    out = capsys.readouterr().out
    section = out.split(f"## Activations on {DATASET} (validation split, 20 samples)")[1]
    assert section.count("\n| ") == 16  # the header, its rule and the 14 nodes
    assert "| 3 | model/activation_2/Relu;model/add/add | Add | [0, " in section
    assert "| floor (0) |" in section
    assert "- accuracy with int8 activations " in section


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ("eurosat:size=16", "inputs [16, 16, 3] do not fit the model's [32, 32, 3]"),
        ("no-such-set", "no-such-set"),
    ],
)
def test_inspect_refuses_a_data_set_that_does_not_fit(
    dataset: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(RESNET8_CIFAR10), "--dataset", dataset]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qsched inspect: ") and message in err
    assert "Traceback" not in err
