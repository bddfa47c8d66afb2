"""Post-training quantisation to TFLite's int8 scheme, and the way back to floats.

- Weights: symmetric per output channel, ``scale = max|w| / 127``, values in [-127, 127].
- Activations: asymmetric int8 from the calibration min/max (widened to include 0),
  with the TFLite converter's zero-point nudging (``GetAsymmetricQuantizationParams``,
  float32 arithmetic).
- Biases: int32 with ``scale = float32(in_scale * w_scale[c])``, zero point 0.
- Pools and Reshape keep their input's parameters, as TFLite's int8 kernels require.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import numpy as np
import numpy.typing as npt

from qsched.zo.engine import fp32_tensors
from qsched.zo.fixedpoint import round_half_away
from qsched.zo.graph import (
    AvgPool,
    Concat,
    Conv2D,
    GlobalAvgPool,
    Logistic,
    MaxPool,
    Model,
    Pad,
    ParamNode,
    QuantizedLayer,
    QuantModel,
    Reshape,
    TensorQuant,
)
from qsched.zo.lookup import LOGISTIC_OUTPUT

__all__ = [
    "asymmetric_params",
    "dequantize_output",
    "dequantize_weights",
    "quantize_input",
    "quantize_model",
    "quantize_weight",
    "weight_channel_axis",
]

F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]
_QMIN: Final = -128
_QMAX: Final = 127
_WMAX: Final = 127
_CALIBRATION_BATCH: Final = 64
# Ops whose int8 output shares the input's parameters (TFLite copies or averages bytes).
_PASSTHROUGH = (AvgPool, MaxPool, GlobalAvgPool, Pad, Reshape)


def asymmetric_params(lo: float, hi: float) -> TensorQuant:
    """int8 scale and nudged zero point for a real range, as the TFLite converter does.

    Args:
        lo: observed minimum.
        hi: observed maximum.

    Returns:
        The tensor's quantisation; a range of only zeros gets scale 1.
    """
    f = np.float32
    lo32 = min(f(lo), f(0.0))
    hi32 = max(f(hi), f(0.0))
    scale = (hi32 - lo32) / (f(_QMAX) - f(_QMIN))
    if scale == 0:
        return TensorQuant(scale=1.0, zero_point=0)
    zp_from_min = f(_QMIN) - lo32 / scale
    if zp_from_min < _QMIN:
        zp = _QMIN
    elif zp_from_min > _QMAX:
        zp = _QMAX
    else:
        zp = int(round_half_away(zp_from_min))
    return TensorQuant(scale=float(scale), zero_point=zp)


def weight_channel_axis(node: ParamNode) -> int:
    """The output-channel axis of a stored weight: 3 for depthwise 1HWO, else 0."""
    return 3 if isinstance(node, Conv2D) and node.depthwise else 0


def quantize_weight(weight: F32, axis: int) -> tuple[I8, F32]:
    """Symmetric per-channel int8 quantisation.

    An all-zero channel borrows the largest scale of its layer (1/127 if the whole
    layer is zero), so ZO steps on it still move the output.

    Args:
        weight: float weights.
        axis: output-channel axis.

    Returns:
        ``(int8 weights, float32 scale per channel)``.
    """
    w = np.moveaxis(np.asarray(weight, dtype=np.float32), axis, 0)
    peak = np.abs(w.reshape(w.shape[0], -1)).max(axis=1)
    scales = (peak / np.float32(_WMAX)).astype(np.float32)
    fallback = scales.max() if scales.max() > 0 else np.float32(1.0 / _WMAX)
    scales = np.where(scales > 0, scales, fallback).astype(np.float32)
    shape = (-1,) + (1,) * (w.ndim - 1)
    q = np.clip(round_half_away(w / scales.reshape(shape)), -_WMAX, _WMAX).astype(np.int8)
    return np.moveaxis(q, 0, axis), scales


def _bias(bias: F32, in_scale: float, w_scales: F32) -> npt.NDArray[np.int32]:
    scale = np.float32(in_scale) * w_scales.astype(np.float32)
    q: F32 = round_half_away(np.asarray(bias, dtype=np.float32) / scale)
    return np.clip(q, -(2**31), 2**31 - 1).astype(np.int32)


def _ranges(model: Model, x: F32) -> dict[str, tuple[float, float]]:
    """Calibration min / max of every tensor, over all samples."""
    ranges: dict[str, tuple[float, float]] = {}
    for i in range(0, x.shape[0], _CALIBRATION_BATCH):
        for name, value in fp32_tensors(model, x[i : i + _CALIBRATION_BATCH]).items():
            lo, hi = float(value.min()), float(value.max())
            old = ranges.get(name, (lo, hi))
            ranges[name] = (min(lo, old[0]), max(hi, old[1]))
    return ranges


def _shared_concat_ranges(
    model: Model, ranges: dict[str, tuple[float, float]]
) -> dict[str, tuple[float, float]]:
    """One range for a Concat's inputs and output (TFLite's int8 kernel copies bytes, so
    they must share scale and zero point), as TensorFlow's converter arranges."""
    out = dict(ranges)
    changed = True
    while changed:  # joins of joins: until every chain shares one range
        changed = False
        for node in model.nodes:
            if isinstance(node, Concat):
                names = [*node.inputs, node.output]
                joint = (min(out[n][0] for n in names), max(out[n][1] for n in names))
                changed |= any(out[n] != joint for n in names)
                out.update(dict.fromkeys(names, joint))
    return out


def quantize_model(model: Model, calibration_inputs: npt.ArrayLike) -> QuantModel:
    """Post-training quantisation from float calibration data.

    Args:
        model: the float model.
        calibration_inputs: ``(N, *input_shape)`` representative float inputs.

    Returns:
        The ``QuantModel`` (activation parameters for every tensor, int8 layers).
    """
    x = np.asarray(calibration_inputs, dtype=np.float32)
    if x.shape[0] == 0:
        raise ValueError("calibration needs at least one sample")
    ranges = _shared_concat_ranges(model, _ranges(model, x))
    tensors = {model.input_name: asymmetric_params(*ranges[model.input_name])}
    for node in model.nodes:
        if isinstance(node, _PASSTHROUGH):
            tensors[node.output] = tensors[node.inputs[0]]
        elif isinstance(node, Logistic):
            tensors[node.output] = LOGISTIC_OUTPUT  # fixed by TFLite's int8 kernel
        else:
            tensors[node.output] = asymmetric_params(*ranges[node.output])
    for node in model.nodes:
        params = {(tensors[t].scale, tensors[t].zero_point) for t in [*node.inputs, node.output]}
        if isinstance(node, Concat) and len(params) != 1:
            # An input whose parameters are another tensor's (a pool's output) cannot move.
            raise ValueError(f"layer {node.name!r}: Concat inputs cannot share one scale here")
    layers = {}
    for node in model.param_nodes():
        q, scales = quantize_weight(node.weight, weight_channel_axis(node))
        in_scale = tensors[node.inputs[0]].scale
        layers[node.name] = QuantizedLayer(q, scales, _bias(node.bias, in_scale, scales))
    return QuantModel(model=model, tensors=tensors, layers=layers)


def quantize_input(qmodel: QuantModel, x: npt.ArrayLike) -> I8:
    """TFLite QUANTIZE of the model input: ``clamp(round(x / scale) + zp)`` in float32."""
    tq = qmodel.tensors[qmodel.model.input_name]
    q: F32 = round_half_away(np.asarray(x, dtype=np.float32) / np.float32(tq.scale))
    out: I8 = np.clip(q + tq.zero_point, _QMIN, _QMAX).astype(np.int8)
    return out


def dequantize_output(qmodel: QuantModel, y_q: npt.ArrayLike) -> F32:
    """TFLite DEQUANTIZE of the model output: ``scale * (q - zp)``."""
    tq = qmodel.tensors[qmodel.model.output_name]
    centred: npt.NDArray[np.int64] = np.asarray(y_q, dtype=np.int64) - tq.zero_point
    return (float(np.float32(tq.scale)) * centred).astype(np.float32)


def dequantize_weights(qmodel: QuantModel) -> Model:
    """The float view of the INT8 model's current weights (a new ``Model``).

    Weights are ``q * scale[c]``, biases ``q_b * in_scale * scale[c]``; the graph is
    copied node by node, so the result shares no mutable state with ``qmodel``.
    """
    model = qmodel.model
    nodes = []
    for node in model.nodes:
        layer = qmodel.layers.get(node.name)
        if layer is None:
            nodes.append(dataclasses.replace(node, inputs=list(node.inputs)))
            continue
        assert isinstance(node, ParamNode)
        axis = weight_channel_axis(node)
        shape = [1] * layer.weight.ndim
        shape[axis] = -1
        scales = layer.weight_scales.astype(np.float32)
        weight = (layer.weight.astype(np.float32) * scales.reshape(shape)).astype(np.float32)
        bias_scale = np.float32(qmodel.tensors[node.inputs[0]].scale) * scales
        bias = (layer.bias.astype(np.float32) * bias_scale).astype(np.float32)
        nodes.append(dataclasses.replace(node, inputs=list(node.inputs), weight=weight, bias=bias))
    return Model(
        model.name,
        model.input_name,
        tuple(model.input_shape),
        nodes,
        model.output_name,
        model.num_classes,
    )
