"""The model zoo: small networks for microcontroller-sized training, built as ``Model`` graphs.

Every model is built deterministically from ``seed`` (He-style normal initialisation from
a ``numpy`` Generator), with stable, unique layer names (``dense_1``,
``stage2.block1.conv2``) because the flat trainable vector, ``trainable`` layer lists
and checkpoints all refer to layers by name. Each layer's output tensor carries the
layer's name; the input tensor is ``input``.

Batch normalisation is not part of the graph (it folds into the convolutions on
export), so the residual networks keep their activations in range with a Fixup-style
initialisation: the last convolution of each residual branch is scaled by
``num_blocks ** -0.5``.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from qsched.zo.errors import ZooError
from qsched.zo.graph import (
    Activation,
    Add,
    AvgPool,
    Conv2D,
    Dense,
    GlobalAvgPool,
    GraphError,
    MaxPool,
    Model,
    Node,
    Padding,
    ReLU,
    ReLU6,
    Reshape,
)
from qsched.zo.shapes import infer_shapes, node_shape

__all__ = [
    "DEFAULT_INPUT_SHAPES",
    "ZooError",
    "available_models",
    "build_model",
    "conv_output_size",
    "infer_shapes",
    "model_options",
    "model_summary",
    "node_macs",
    "replace_classifier",
    "zoo_table",
]

F32 = npt.NDArray[np.float32]
Shape = tuple[int, ...]

# The input each model is designed for when the caller gives none (zoo table, demos).
DEFAULT_INPUT_SHAPES: dict[str, Shape] = {
    "mlp": (64,),
    "cnn": (8, 8, 1),
    "resnet8": (32, 32, 3),
    "resnet18": (32, 32, 3),
    "mobilenetv2": (32, 32, 3),
}


# --------------------------------------------------------------------------- shapes


def conv_output_size(size: int, kernel: int, stride: int, padding: Padding) -> int:
    """Output length of a convolution or pool along one axis, TFLite rules.

    Args:
        size: input length.
        kernel: window length.
        stride: step between windows.
        padding: ``"same"`` (output ``ceil(size / stride)``) or ``"valid"``.

    Returns:
        The output length (at least 1 for valid inputs).
    """
    if padding == "same":
        return -(-size // stride)
    return (size - kernel) // stride + 1


def node_macs(node: Node, out_shape: Shape) -> int:
    """Multiply-accumulates of one node per sample (convolutions and dense layers)."""
    if isinstance(node, Conv2D):
        per_output = int(node.weight.shape[1] * node.weight.shape[2])
        if not node.depthwise:
            per_output *= int(node.weight.shape[3])
        return math.prod(out_shape) * per_output
    if isinstance(node, Dense):
        return int(node.weight.size)
    return 0


def model_summary(model: Model) -> tuple[int, int]:
    """Parameter count (weights and biases) and multiply-accumulates per sample.

    Args:
        model: the graph.

    Returns:
        ``(params, macs)``; MACs count convolutions and dense layers only.
    """
    shapes = infer_shapes(model)
    params = sum(int(n.weight.size + n.bias.size) for n in model.param_nodes())
    macs = sum(node_macs(n, shapes[n.output]) for n in model.nodes)
    return params, macs


# --------------------------------------------------------------------------- builder


class _Builder:
    """Appends nodes, tracks tensor shapes and draws initial weights from one Generator."""

    def __init__(self, name: str, input_shape: Shape, num_classes: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.model = Model(name, "input", tuple(input_shape), [], "input", num_classes)
        self.shapes: dict[str, Shape] = {"input": tuple(input_shape)}
        self.names: set[str] = set()

    def _append(self, node: Node) -> str:
        if node.name in self.names:
            raise ZooError(f"duplicate layer name {node.name!r}")
        self.names.add(node.name)
        self.shapes[node.output] = node_shape(node, self.shapes)
        self.model.nodes.append(node)
        self.model.output_name = node.output
        return str(node.output)

    def _he(self, shape: Shape, fan_in: int, gain: float = 1.0) -> F32:
        std = gain * math.sqrt(2.0 / fan_in)
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def conv(
        self,
        name: str,
        x: str,
        out: int,
        kernel: int = 3,
        stride: int = 1,
        activation: Activation = "none",
        gain: float = 1.0,
    ) -> str:
        cin = self.shapes[x][-1]
        weight = self._he((out, kernel, kernel, cin), kernel * kernel * cin, gain)
        node = Conv2D(
            name,
            [x],
            name,
            weight,
            np.zeros(out, np.float32),
            stride=(stride, stride),
            padding="same",
            activation=activation,
        )
        return self._append(node)

    def depthwise(self, name: str, x: str, stride: int, activation: Activation) -> str:
        cin = self.shapes[x][-1]
        weight = self._he((1, 3, 3, cin), 9)
        node = Conv2D(
            name,
            [x],
            name,
            weight,
            np.zeros(cin, np.float32),
            stride=(stride, stride),
            padding="same",
            groups=cin,
            depthwise=True,
            activation=activation,
        )
        return self._append(node)

    def dense(self, name: str, x: str, out: int, activation: Activation = "none") -> str:
        fan_in = self.shapes[x][0]
        # The classifier gets LeCun scaling (gain 1/sqrt 2) so initial logits stay near 1.
        gain = 1.0 if activation != "none" else math.sqrt(0.5)
        weight = self._he((out, fan_in), fan_in, gain)
        return self._append(Dense(name, [x], name, weight, np.zeros(out, np.float32), activation))

    def add(self, name: str, a: str, b: str, activation: Activation = "none") -> str:
        return self._append(Add(name, [a, b], name, activation))

    def relu(self, name: str, x: str, six: bool = False) -> str:
        return self._append((ReLU6 if six else ReLU)(name, [x], name))

    def flatten(self, name: str, x: str) -> str:
        return self._append(Reshape(name, [x], name, (math.prod(self.shapes[x]),)))

    def gap(self, name: str, x: str) -> str:
        return self._append(GlobalAvgPool(name, [x], name))

    def pool(self, name: str, x: str, kind: str, size: int, stride: int, padding: Padding) -> str:
        cls = MaxPool if kind == "max" else AvgPool
        return self._append(cls(name, [x], name, (size, size), (stride, stride), padding))


# --------------------------------------------------------------------------- models


def _int_tuple(value: Any, option: str) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    if isinstance(value, str):
        value = [v for v in value.replace("x", ",").split(",") if v.strip()]
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError) as exc:
        raise ZooError(f"option {option}: expected integers, got {value!r}") from exc


def _scaled(channels: float, width: float, divisor: int = 1) -> int:
    """Channels times width, rounded to a multiple of ``divisor`` without losing > 10 %."""
    value = channels * width
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def _flat_input(b: _Builder) -> str:
    return b.flatten("flatten", "input") if len(b.model.input_shape) > 1 else "input"


def _mlp(b: _Builder, hidden: Any = (32,)) -> None:
    """Dense layers with ReLU; an image input is flattened first."""
    x = _flat_input(b)
    sizes = _int_tuple(hidden, "hidden")
    for i, size in enumerate(sizes, start=1):
        x = b.dense(f"dense_{i}", x, size, "relu")
    b.dense(f"dense_{len(sizes) + 1}", x, b.model.num_classes)


def _cnn(b: _Builder, channels: Any = (8, 16), head: str = "flatten") -> None:
    """A 3x3 conv, then 3x3 stride-2 convs, then flatten (or global average pool) and dense."""
    _require_image(b)
    x = "input"
    for i, ch in enumerate(_int_tuple(channels, "channels"), start=1):
        x = b.conv(f"conv_{i}", x, ch, 3, 1 if i == 1 else 2, "relu")
    if head == "flatten":
        x = b.flatten("flatten", x)
    elif head == "gap":
        x = b.gap("pool", x)
    else:
        raise ZooError(f"cnn head must be 'flatten' or 'gap', got {head!r}")
    b.dense("dense_1", x, b.model.num_classes)


def _require_image(b: _Builder) -> None:
    if len(b.model.input_shape) != 3:
        raise ZooError(f"{b.model.name} needs an (H, W, C) input, got {b.model.input_shape}")


def _basic_block(b: _Builder, prefix: str, x: str, out: int, stride: int, gain: float) -> str:
    """conv3x3 relu, conv3x3, plus the shortcut (1x1 stride-s conv when the shape changes), relu."""
    h = b.conv(f"{prefix}.conv1", x, out, 3, stride, "relu")
    h = b.conv(f"{prefix}.conv2", h, out, 3, 1, "none", gain)
    shortcut = x
    if stride != 1 or b.shapes[x][-1] != out:
        shortcut = b.conv(f"{prefix}.shortcut", x, out, 1, stride)
    return b.add(f"{prefix}.add", h, shortcut, "relu")


def _resnet(b: _Builder, widths: Sequence[int], blocks: Sequence[int], stem: str) -> None:
    _require_image(b)
    if stem == "imagenet":
        x = b.conv("stem.conv", "input", widths[0], 7, 2, "relu")
        x = b.pool("stem.pool", x, "max", 3, 2, "same")
    elif stem == "small":
        x = b.conv("stem.conv", "input", widths[0], 3, 1, "relu")
    else:
        raise ZooError(f"stem must be 'small', 'imagenet' or 'auto', got {stem!r}")
    gain = sum(blocks) ** -0.5
    for s, (width, count) in enumerate(zip(widths, blocks, strict=True), start=1):
        for k in range(1, count + 1):
            stride = 2 if (k == 1 and s > 1) else 1
            x = _basic_block(b, f"stage{s}.block{k}", x, width, stride, gain)
    x = b.gap("head.pool", x)
    b.dense("head.dense", x, b.model.num_classes)


def _auto_stem(b: _Builder, stem: str) -> str:
    if stem != "auto":
        return stem
    return "imagenet" if min(b.model.input_shape[:2]) >= 96 else "small"


def _resnet8(b: _Builder, width: float = 1.0, stem: str = "small") -> None:
    """MLPerf Tiny's ResNet-8: stem 16, three stages of one basic block (16, 32, 64)."""
    widths = [_scaled(c, width) for c in (16, 32, 64)]
    _resnet(b, widths, (1, 1, 1), _auto_stem(b, stem))


def _resnet18(b: _Builder, width: float = 0.25, stem: str = "auto") -> None:
    """ResNet-18: four stages of two basic blocks (64, 128, 256, 512 times ``width``)."""
    widths = [_scaled(c, width) for c in (64, 128, 256, 512)]
    _resnet(b, widths, (2, 2, 2, 2), _auto_stem(b, stem))


# (expansion t, channels c, repeats n, first stride s) of MobileNetV2.
_MBV2_SETTINGS = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _inverted_residual(b: _Builder, prefix: str, x: str, expand: int, out: int, stride: int) -> str:
    cin = b.shapes[x][-1]
    h = x
    if expand != 1:
        h = b.conv(f"{prefix}.expand", h, cin * expand, 1, 1, "relu6")
    h = b.depthwise(f"{prefix}.depthwise", h, stride, "relu6")
    h = b.conv(f"{prefix}.project", h, out, 1, 1, "none", math.sqrt(0.5))
    if stride == 1 and cin == out:
        h = b.add(f"{prefix}.add", h, x)
    return h


def _mobilenetv2(
    b: _Builder,
    width: float = 0.35,
    stages: int = 7,
    max_repeats: int = 4,
    stem_stride: int = 0,
    last_channels: int = 0,
) -> None:
    """MobileNetV2 with a width multiplier; ``stages`` and ``max_repeats`` cut depth for small
    inputs.

    ``stem_stride`` 0 picks 2 for inputs of 64 pixels or more, else 1; ``last_channels``
    0 keeps the paper's 1280 (scaled up, never down, with ``width``).
    """
    _require_image(b)
    if not 1 <= stages <= len(_MBV2_SETTINGS):
        raise ZooError(f"mobilenetv2 stages must be 1..{len(_MBV2_SETTINGS)}, got {stages}")
    stride0 = stem_stride or (2 if min(b.model.input_shape[:2]) >= 64 else 1)
    x = b.conv("stem.conv", "input", _scaled(32, width, 8), 3, stride0, "relu6")
    for s, (t, c, n, first) in enumerate(_MBV2_SETTINGS[:stages], start=1):
        for k in range(1, min(n, max_repeats) + 1):
            stride = first if k == 1 else 1
            x = _inverted_residual(b, f"stage{s}.block{k}", x, t, _scaled(c, width, 8), stride)
    last = last_channels or _scaled(1280, max(1.0, width), 8)
    x = b.conv("head.conv", x, last, 1, 1, "relu6")
    x = b.gap("head.pool", x)
    b.dense("head.dense", x, b.model.num_classes)


_BUILDERS: dict[str, Callable[..., None]] = {
    "mlp": _mlp,
    "cnn": _cnn,
    "resnet8": _resnet8,
    "resnet18": _resnet18,
    "mobilenetv2": _mobilenetv2,
}


@dataclass(frozen=True)
class _Entry:
    name: str
    params: int
    macs: int
    input_shape: Shape
    layers: int


def available_models() -> list[str]:
    """Names accepted by :func:`build_model`, sorted."""
    return sorted(_BUILDERS)


def build_model(
    name: str,
    input_shape: Sequence[int] | None = None,
    num_classes: int = 10,
    seed: int = 0,
    **options: Any,
) -> Model:
    """Build a zoo model with deterministic initial weights.

    Args:
        name: one of :func:`available_models`.
        input_shape: per-sample input shape, ``(H, W, C)`` or ``(features,)``; ``None``
            takes the model's default (:data:`DEFAULT_INPUT_SHAPES`).
        num_classes: size of the output (logits).
        seed: seeds the ``numpy`` Generator that draws every weight.
        **options: model options — mlp: ``hidden``; cnn: ``channels``, ``head``;
            resnet8/resnet18: ``width``, ``stem``; mobilenetv2: ``width``, ``stages``,
            ``max_repeats``, ``stem_stride``, ``last_channels``.

    Returns:
        The model; its name is ``name``.

    Raises:
        ZooError: unknown name or option, or an input the model cannot take.
    """
    if name not in _BUILDERS:
        raise ZooError(f"unknown model {name!r}; available: {available_models()}")
    if num_classes < 2:
        raise ZooError(f"num_classes must be at least 2, got {num_classes}")
    shape = tuple(int(d) for d in (input_shape or DEFAULT_INPUT_SHAPES[name]))
    build = _BUILDERS[name]
    known = [p for p in inspect.signature(build).parameters if p != "b"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ZooError(f"model {name!r} has no option(s) {unknown}; options: {known}")
    for key, value in options.items():
        _check_option(name, key, value)
    builder = _Builder(name, shape, num_classes, seed)
    try:
        build(builder, **options)
    except GraphError as exc:
        raise ZooError(f"model {name!r} does not fit input {shape}: {exc}") from exc
    except (ValueError, ZeroDivisionError) as exc:  # a zero size, say: name the options
        raise ZooError(f"model {name!r} cannot be built with options {options}: {exc}") from exc
    return builder.model


def _check_option(model: str, key: str, value: Any) -> None:
    """No size, width or stride a model option gives (one number or several) is negative
    or non-finite (0 may mean "automatic", as mobilenetv2's ``stem_stride``)."""
    values = value if isinstance(value, list | tuple) else [value]
    for item in values:
        number = isinstance(item, int | float) and not isinstance(item, bool)
        if number and not (math.isfinite(item) and item >= 0):
            raise ZooError(f"model {model!r}: option {key}={value!r} must not be negative")


def replace_classifier(model: Model, num_classes: int, seed: int = 0) -> Model:
    """A copy of ``model`` whose final Dense layer is freshly initialised for ``num_classes``.

    The transfer setting: a backbone pretrained on source classes gets a new head for
    the target classes; every other weight is copied unchanged.

    Args:
        model: a model ending in a Dense classifier.
        num_classes: outputs of the new head.
        seed: seeds the new head's weights (same scheme as :func:`build_model`).

    Returns:
        The new model; the head keeps its layer name.
    """
    last = model.nodes[-1] if model.nodes else None
    if not isinstance(last, Dense) or last.output != model.output_name:
        raise ZooError(f"model {model.name!r} does not end in a Dense classifier")
    if num_classes < 2:
        raise ZooError(f"num_classes must be at least 2, got {num_classes}")
    nodes: list[Node] = [copy.deepcopy(n) for n in model.nodes[:-1]]
    fan_in = int(last.weight.shape[1])
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((num_classes, fan_in)) * math.sqrt(1.0 / fan_in)).astype(
        np.float32
    )
    head = Dense(
        last.name,
        list(last.inputs),
        last.output,
        weight,
        np.zeros(num_classes, np.float32),
        last.activation,
    )
    return Model(
        model.name,
        model.input_name,
        tuple(model.input_shape),
        [*nodes, head],
        model.output_name,
        num_classes,
    )


def _entries() -> list[_Entry]:
    out = []
    for name in available_models():
        model = build_model(name)
        params, macs = model_summary(model)
        out.append(_Entry(name, params, macs, model.input_shape, len(model.param_nodes())))
    return out


def model_options(name: str) -> dict[str, Any]:
    """The options :func:`build_model` takes for a model, with their defaults.

    Args:
        name: one of :func:`available_models`.

    Returns:
        Option name -> default value, in the builder's order.

    Raises:
        ZooError: unknown name.
    """
    if name not in _BUILDERS:
        raise ZooError(f"unknown model {name!r}; available: {available_models()}")
    params = inspect.signature(_BUILDERS[name]).parameters.values()
    return {p.name: p.default for p in params if p.name != "b"}


def _options_lines() -> list[str]:
    # Sizes in the table depend on these (ResNet-18 at width 0.25 is not the 11M-parameter net).
    lines = [
        "",
        "options (JobSpec.model_options), defaults as above; the input size follows the data set:",
    ]
    for name in available_models():
        text = ", ".join(f"{k}={v!r}" for k, v in model_options(name).items())
        lines.append(f"  {name:<12} {text}")
    return lines


def zoo_table() -> str:
    """A printable table of every model at its default size: input, layers, parameters, MACs."""
    rows = [("model", "input", "param layers", "params", "MACs")]
    for e in _entries():
        shape = "x".join(str(d) for d in e.input_shape)
        rows.append((e.name, shape, str(e.layers), f"{e.params:,}", f"{e.macs:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [
            c.ljust(w) if j < 2 else c.rjust(w)
            for j, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join([*lines, *_options_lines()])
