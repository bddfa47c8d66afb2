"""Post-training quantisation: parameters, weights, model agreement, float views."""

from __future__ import annotations

import numpy as np
import pytest

from qsched.zo.engine import run_fp32, run_int8
from qsched.zo.graph import (
    Conv2D,
    Dense,
    GlobalAvgPool,
    MaxPool,
    Model,
    Reshape,
)
from qsched.zo.quantize import (
    asymmetric_params,
    dequantize_output,
    dequantize_weights,
    quantize_input,
    quantize_model,
    quantize_weight,
)


def _cnn(rng: np.random.Generator) -> Model:
    def r(*shape: int, k: float = 0.4) -> np.ndarray:
        return (rng.normal(size=shape) * k).astype(np.float32)

    nodes = [
        Conv2D("c1", ["x"], "t1", r(8, 3, 3, 1), r(8, k=0.1), activation="relu"),
        Conv2D(
            "dw",
            ["t1"],
            "t2",
            r(1, 3, 3, 8),
            r(8, k=0.1),
            stride=(2, 2),
            groups=8,
            depthwise=True,
            activation="relu6",
        ),
        MaxPool("mp", ["t2"], "t3"),
        Reshape("flat", ["t3"], "t4", shape=(2 * 2 * 8,)),
        Dense("fc1", ["t4"], "t5", r(16, 32), r(16, k=0.1), activation="relu"),
        Dense("fc", ["t5"], "y", r(10, 16), r(10, k=0.1)),
    ]
    return Model("cnn", "x", (8, 8, 1), nodes, "y", 10)


@pytest.mark.parametrize(
    ("lo", "hi"), [(-1.0, 1.0), (0.0, 6.0), (-3.0, -1.0), (0.5, 2.0), (-0.01, 7.3)]
)
def test_asymmetric_params_represent_zero_and_range(lo: float, hi: float) -> None:
    """0 maps to the zero point exactly; the widened range fits within a step."""
    tq = asymmetric_params(lo, hi)
    assert -128 <= tq.zero_point <= 127
    lo0, hi0 = min(lo, 0.0), max(hi, 0.0)
    assert tq.scale == pytest.approx((hi0 - lo0) / 255, rel=1e-6)
    assert tq.scale * (-128 - tq.zero_point) <= lo0 + tq.scale
    assert tq.scale * (127 - tq.zero_point) >= hi0 - tq.scale


def test_asymmetric_params_one_sided_ranges() -> None:
    """A non-negative range gets zero point -128, a non-positive one 127."""
    assert asymmetric_params(0.0, 6.0).zero_point == -128
    assert asymmetric_params(-4.0, 0.0).zero_point == 127
    assert asymmetric_params(0.0, 0.0).scale == 1.0


def test_quantize_weight_per_channel() -> None:
    """Each channel's largest |w| maps to 127; rounding error is at most half a step."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(1, 3, 3, 5)).astype(np.float32) * np.array(
        [0.1, 1, 3, 0.01, 2], np.float32
    )
    q, scales = quantize_weight(w, axis=3)
    assert q.dtype == np.int8 and scales.shape == (5,)
    assert np.abs(q).reshape(-1, 5).max(axis=0).tolist() == [127] * 5
    assert np.all(np.abs(q * scales - w) <= scales / 2 + 1e-7)


def test_quantize_weight_zero_channel_borrows_scale() -> None:
    """An all-zero channel gets a usable scale, so ZO steps on it change the output."""
    w = np.zeros((3, 4), np.float32)
    w[1] = [0.5, -1.27, 0.0, 1.0]
    q, scales = quantize_weight(w, axis=0)
    assert np.all(scales > 0)
    assert scales[0] == scales[1] == scales[2]
    assert q[0].tolist() == [0, 0, 0, 0]


def test_ptq_argmax_agrees_with_fp32() -> None:
    """INT8 logits of a PTQ model pick the FP32 class on most samples."""
    rng = np.random.default_rng(2)
    model = _cnn(rng)
    x = rng.normal(size=(200, 8, 8, 1)).astype(np.float32)
    qm = quantize_model(model, x[:100])
    y_float = run_fp32(model, x)
    y_int = dequantize_output(qm, run_int8(qm, quantize_input(qm, x)))
    agreement = np.mean(y_float.argmax(axis=1) == y_int.argmax(axis=1))
    assert agreement >= 0.9
    assert np.abs(y_int - y_float).max() < 0.1 * np.abs(y_float).max()


def test_ptq_tensor_parameters_follow_tflite_rules() -> None:
    """Pools and reshapes keep their input's parameters; biases use in * w scales."""
    rng = np.random.default_rng(3)
    model = _cnn(rng)
    qm = quantize_model(model, rng.normal(size=(32, 8, 8, 1)).astype(np.float32))
    assert qm.tensors["t3"] is qm.tensors["t2"] and qm.tensors["t4"] is qm.tensors["t3"]
    assert qm.tensors["t1"].zero_point == -128  # ReLU output: range starts at 0
    layer, node = qm.layers["fc1"], model.node("fc1")
    bias_scale = np.float32(qm.tensors["t4"].scale) * layer.weight_scales
    assert isinstance(node, Dense)
    np.testing.assert_allclose(layer.bias * bias_scale, node.bias, atol=float(bias_scale.max()))


def test_quantize_input_round_trip() -> None:
    """quantize_input then dequantise is within half a step inside the calibrated range."""
    rng = np.random.default_rng(4)
    model = Model(
        "m",
        "x",
        (4,),
        [Dense("fc", ["x"], "y", np.eye(4, dtype=np.float32), np.zeros(4, np.float32))],
        "y",
        4,
    )
    x = rng.uniform(-2, 3, size=(50, 4)).astype(np.float32)
    qm = quantize_model(model, x)
    tq = qm.tensors["x"]
    xq = quantize_input(qm, x)
    assert xq.dtype == np.int8
    assert np.all(
        np.abs(tq.scale * (xq.astype(np.float32) - tq.zero_point) - x) <= tq.scale / 2 + 1e-6
    )
    out = dequantize_output(qm, np.array([[qm.tensors["y"].zero_point] * 4], np.int8))
    assert out.tolist() == [[0.0] * 4]


def test_dequantize_weights_is_a_float_view() -> None:
    """Re-quantising the float view gives the same int8 weights; the model is a copy."""
    rng = np.random.default_rng(5)
    model = _cnn(rng)
    model.nodes.insert(3, GlobalAvgPool("unused_gap", ["t3"], "g"))
    qm = quantize_model(model, rng.normal(size=(16, 8, 8, 1)).astype(np.float32))
    view = dequantize_weights(qm)
    assert [type(n) for n in view.nodes] == [type(n) for n in model.nodes]
    for node in view.param_nodes():
        layer = qm.layers[node.name]
        q, _ = quantize_weight(node.weight, 3 if getattr(node, "depthwise", False) else 0)
        np.testing.assert_array_equal(q, layer.weight)
        assert node.weight is not model.node(node.name).weight
    view.nodes[0].inputs.append("extra")
    assert model.nodes[0].inputs == ["x"]
