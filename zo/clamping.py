"""Where an INT8 model's activations reach the ends of their int8 range on real inputs.

Activation scales are fixed by calibration and stay fixed while a job trains (scale
recalibration widens weights' scales only), so training can push a tensor past the range
calibration gave it: its values then clamp at -128 or 127, and a perturbation that
moves them further changes no loss. This report runs a model over a data set and gives,
per node output, the share of values at each end, and the model's accuracy with int8
activations against the same (dequantised) weights with float activations: what the
activation ranges cost, in one comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from qsched.zo import engine
from qsched.zo.graph import QuantModel
from qsched.zo.quantize import quantize_input

__all__ = ["ClampingReport", "TensorClamping", "clamping_report"]

# Samples per forward pass: every tensor of a slice is kept at once.
_SLICE = 100


@dataclass(frozen=True)
class TensorClamping:
    """One node's output over the data set."""

    index: int  # the node's position in the graph
    node: str
    op: str
    scale: float
    zero_point: int
    bottom: float  # share of values at -128
    top: float  # share of values at 127

    @property
    def low(self) -> float:
        """The real value -128 stands for."""
        return self.scale * (-128 - self.zero_point)

    @property
    def high(self) -> float:
        """The real value 127 stands for."""
        return self.scale * (127 - self.zero_point)


@dataclass(frozen=True)
class ClampingReport:
    """Every node output's clamping, and accuracy (None without labels that fit)."""

    samples: int
    tensors: list[TensorClamping]
    int8_accuracy: float | None
    float_accuracy: float | None


def clamping_report(
    qmodel: QuantModel, x: npt.ArrayLike, y: npt.ArrayLike | None = None
) -> ClampingReport:
    """Run ``qmodel`` over real-valued inputs ``x`` (``(N, *input_shape)``, the units the
    model's input quantisation expects) and count, per node output, the values at -128
    and at 127. With labels ``y`` the accuracy of the int8 logits and of the float view
    (``qmodel.model``: dequantised weights, float activations) on the same inputs."""
    model = qmodel.model
    x_real = np.asarray(x, dtype=np.float32)
    prepared = engine.prepare_int8(qmodel)
    bottom = dict.fromkeys((n.output for n in model.nodes), 0)
    top = dict(bottom)
    sizes = dict(bottom)
    predictions = []
    for start in range(0, len(x_real), _SLICE):
        tensors = engine.int8_tensors(
            prepared, quantize_input(qmodel, x_real[start : start + _SLICE])
        )
        for name in bottom:
            values = tensors[name]
            bottom[name] += int(np.count_nonzero(values == -128))
            top[name] += int(np.count_nonzero(values == 127))
            sizes[name] += values.size
        predictions.append(np.argmax(tensors[model.output_name], axis=-1))
    rows = [
        TensorClamping(
            i,
            node.name,
            type(node).__name__,
            float(qmodel.tensors[node.output].scale),
            int(qmodel.tensors[node.output].zero_point),
            bottom[node.output] / max(sizes[node.output], 1),
            top[node.output] / max(sizes[node.output], 1),
        )
        for i, node in enumerate(model.nodes)
    ]
    int8_acc = float_acc = None
    if y is not None and len(x_real):
        labels = np.asarray(y)
        int8_acc = float(np.mean(np.concatenate(predictions) == labels))
        float_logits = engine.run_fp32(model, x_real)
        float_acc = float(np.mean(np.argmax(float_logits, axis=-1) == labels))
    return ClampingReport(len(x_real), rows, int8_acc, float_acc)
