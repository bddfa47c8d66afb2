"""The model graph: a small set of operations, NHWC tensors, TFLite weight layouts.

One representation serves FP32 training, INT8 inference with TFLite semantics, the
``.tflite`` importer/exporter and the model blob the boards load. A ``Model`` is a list
of nodes in execution (topological) order; each node reads named tensors and writes
one. Float weights live on the node; the INT8 form of the same model adds a
``QuantModel`` with int8 weights, int32 biases and activation quantisation parameters.

Weight layouts are TFLite's, so the flat trainable vector (SPEC section 3) is the same
bytes on every side: Conv2D ``(out, kh, kw, in/groups)``, depthwise ``(1, kh, kw, out)``,
Dense ``(out, in)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from qsched.zo.errors import GraphError
from qsched.zo.source import SourceFile

__all__ = [
    "Activation",
    "Add",
    "AvgPool",
    "Concat",
    "Conv2D",
    "Dense",
    "GlobalAvgPool",
    "GraphError",
    "HardSwish",
    "Logistic",
    "MaxPool",
    "Mean",
    "Model",
    "Mul",
    "MulConstant",
    "Node",
    "Pad",
    "Padding",
    "ParamNode",
    "QuantModel",
    "QuantizedLayer",
    "ReLU",
    "ReLU6",
    "Reshape",
    "TensorQuant",
]

Activation: TypeAlias = Literal["none", "relu", "relu6"]
Padding: TypeAlias = Literal["same", "valid"]
F32 = npt.NDArray[np.float32]


@dataclass(eq=False)
class _NodeFields:
    """Fields every node has: its name, the tensors it reads and the one it writes."""

    name: str
    inputs: list[str]
    output: str


@dataclass(eq=False)
class Conv2D(_NodeFields):
    """2-D convolution, NHWC. ``groups == in_channels`` with the 1HWO layout is depthwise."""

    weight: F32
    bias: F32
    stride: tuple[int, int] = (1, 1)
    padding: Padding = "same"
    groups: int = 1
    depthwise: bool = False
    activation: Activation = "none"


@dataclass(eq=False)
class Dense(_NodeFields):
    """Fully connected layer on a (batch, features) tensor; weight is (out, in)."""

    weight: F32
    bias: F32
    activation: Activation = "none"


@dataclass(eq=False)
class ReLU(_NodeFields):
    """max(x, 0)."""


@dataclass(eq=False)
class ReLU6(_NodeFields):
    """min(max(x, 0), 6)."""


@dataclass(eq=False)
class Logistic(_NodeFields):
    """1 / (1 + exp(-x)); in INT8 the output is fixed at scale 1/256, zero point -128."""


@dataclass(eq=False)
class HardSwish(_NodeFields):
    """x * relu6(x + 3) / 6 (MobileNetV3's activation)."""


@dataclass(eq=False)
class Add(_NodeFields):
    """Element-wise sum of two tensors of one shape (residual connections)."""

    activation: Activation = "none"


@dataclass(eq=False)
class _Pool(_NodeFields):
    """A pooling window slid over height and width."""

    pool: tuple[int, int] = (2, 2)
    stride: tuple[int, int] = (2, 2)
    padding: Padding = "valid"


@dataclass(eq=False)
class AvgPool(_Pool):
    """Mean over each window (TFLite AVERAGE_POOL_2D)."""


@dataclass(eq=False)
class MaxPool(_Pool):
    """Maximum over each window (TFLite MAX_POOL_2D)."""


@dataclass(eq=False)
class GlobalAvgPool(_NodeFields):
    """Mean over height and width: (N, H, W, C) -> (N, C)."""


@dataclass(eq=False)
class Mul(_NodeFields):
    """Element-wise product of two tensors (TFLite MUL); the second may be ``(1, 1, C)``
    against an ``(H, W, C)`` first (a channel gate), broadcast over height and width."""

    activation: Activation = "none"


@dataclass(eq=False)
class MulConstant(_NodeFields):
    """Product with one constant (TFLite MUL by a one-element tensor, as converters write
    hard_sigmoid's 1/6). The constant is kept as the file holds it: the int8
    ``constant`` with its scale and zero point; its real value is ``value``."""

    constant: int = 127
    constant_scale: float = 1.0 / 127.0
    constant_zero_point: int = 0
    activation: Activation = "none"

    @property
    def value(self) -> np.float32:
        """The constant in real units (float32)."""
        return np.float32(self.constant_scale) * np.float32(
            self.constant - self.constant_zero_point
        )


@dataclass(eq=False)
class Concat(_NodeFields):
    """Two tensors joined along the channel (last) axis (TFLite CONCATENATION); in INT8
    both inputs and the output share one scale and zero point, as TFLite's int8 kernel
    requires, so the bytes are copied."""


@dataclass(eq=False)
class Mean(_NodeFields):
    """Mean over height and width (TFLite MEAN, axes 1 and 2), requantised in INT8:
    (N, H, W, C) -> (N, C), or (N, 1, 1, C) with ``keep_dims``."""

    keep_dims: bool = False


@dataclass(eq=False)
class Pad(_NodeFields):
    """Constant padding of height and width (TFLite PAD): ``pads`` is ((top, bottom),
    (left, right)); the value is 0.0, in INT8 the output zero point."""

    pads: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))


@dataclass(eq=False)
class Reshape(_NodeFields):
    """Reshape to ``(batch, *shape)``; ``shape`` excludes the batch dimension."""

    shape: tuple[int, ...] = ()


Node: TypeAlias = (
    Conv2D
    | Dense
    | ReLU
    | ReLU6
    | Logistic
    | HardSwish
    | Add
    | AvgPool
    | MaxPool
    | GlobalAvgPool
    | Mean
    | Pad
    | Concat
    | Mul
    | MulConstant
    | Reshape
)
ParamNode: TypeAlias = Conv2D | Dense


@dataclass(eq=False)
class Model:
    """A float model: input tensor name and shape (without batch), nodes in order, output name."""

    name: str
    input_name: str
    input_shape: tuple[int, ...]
    nodes: list[Node]
    output_name: str
    num_classes: int

    def param_nodes(self) -> list[ParamNode]:
        """The nodes that hold weights, in model order."""
        return [n for n in self.nodes if isinstance(n, (Conv2D, Dense))]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no layer named {name!r}; layers: {[n.name for n in self.nodes]}")


@dataclass(eq=False)
class TensorQuant:
    """Asymmetric int8 quantisation of an activation tensor: real = scale * (q - zero_point)."""

    scale: float
    zero_point: int


@dataclass(eq=False)
class QuantizedLayer:
    """INT8 form of a Conv2D or Dense node: per-channel symmetric weights, int32 bias."""

    weight: npt.NDArray[np.int8]
    weight_scales: F32  # one per output channel
    bias: npt.NDArray[np.int32]  # scale = input_scale * weight_scale, zero point 0


@dataclass(eq=False)
class QuantModel:
    """The INT8 model: the float graph plus the quantisation of every tensor and weight.

    Scales stay fixed during training; only ``layers[*].weight`` values move.
    """

    model: Model
    tensors: dict[str, TensorQuant] = field(default_factory=dict)
    layers: dict[str, QuantizedLayer] = field(default_factory=dict)
    # The user's file an imported model came from (export writes it back), else None.
    source: SourceFile | None = None
