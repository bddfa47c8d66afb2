"""Write a ``QuantModel`` as an int8 ``.tflite`` flatbuffer (schema version 3).

The file is what a microcontroller runs: int8 input, int8 output, per-channel int8
weights (quantised dimension 0 for CONV_2D and FULLY_CONNECTED, 3 for
DEPTHWISE_CONV_2D), int32 biases with zero point 0. ``GlobalAvgPool`` becomes an
AVERAGE_POOL_2D over the whole feature map followed by a RESHAPE to ``(batch, C)``,
the same semantics as the INT8 engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from qsched.zo._tflite_common import (
    METADATA_NAME,
    SCHEMA_VERSION,
    TFLiteError,
    activation_code,
    pack_model,
    schema,
)
from qsched.zo.graph import (
    Add,
    AvgPool,
    Concat,
    Conv2D,
    Dense,
    GlobalAvgPool,
    HardSwish,
    Logistic,
    MaxPool,
    Mean,
    Mul,
    MulConstant,
    Node,
    Pad,
    QuantizedLayer,
    QuantModel,
    ReLU,
    ReLU6,
    Reshape,
    TensorQuant,
)

__all__ = ["build_tflite"]

Shape = tuple[int, ...]
_OP = schema.BuiltinOperator
# Operator versions for int8 kernels (TFLite's op-version table); readers use them to
# check that their kernels know the op's features.
_VERSIONS = {
    _OP.CONV_2D: 3,
    _OP.DEPTHWISE_CONV_2D: 3,
    _OP.FULLY_CONNECTED: 4,
    _OP.ADD: 2,
    _OP.AVERAGE_POOL_2D: 2,
    _OP.MAX_POOL_2D: 2,
    _OP.RESHAPE: 1,
    _OP.RELU: 2,
    _OP.RELU6: 2,
    _OP.MEAN: 2,
    _OP.PAD: 2,
    _OP.CONCATENATION: 2,
    _OP.MUL: 2,
    _OP.LOGISTIC: 2,
    _OP.HARD_SWISH: 1,
}
_GROUPED_CONV_VERSION = 6
_PADDING = {"same": schema.Padding.SAME, "valid": schema.Padding.VALID}


def _out_size(size: int, kernel: int, stride: int, padding: str) -> int:
    """Output length of a window op along one axis, TensorFlow's SAME/VALID rule."""
    if padding == "same":
        return -(-size // stride)
    return (size - kernel) // stride + 1


@dataclass
class _Writer:
    """Accumulates tensors, buffers and operators of the single subgraph."""

    batch: int
    weights_as_inputs: bool
    tensors: list[Any] = field(default_factory=list)
    buffers: list[Any] = field(default_factory=lambda: [schema.BufferT()])
    operators: list[Any] = field(default_factory=list)
    opcodes: dict[tuple[int, int], int] = field(default_factory=dict)
    index: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, Shape] = field(default_factory=dict)
    weight_inputs: list[int] = field(default_factory=list)

    def tensor(
        self,
        name: str,
        shape: Shape,
        ttype: int,
        quant: Any = None,
        data: npt.NDArray[Any] | None = None,
    ) -> int:
        """Add a tensor (constant when ``data`` is given); return its index."""
        if name in self.index:
            raise TFLiteError(f"tensor {name!r} is written twice")
        t = schema.TensorT()
        t.name, t.shape, t.type, t.quantization = name, list(shape), ttype, quant
        t.buffer = 0
        if data is not None:
            t.buffer = len(self.buffers)
            buf = schema.BufferT()
            buf.data = np.frombuffer(np.ascontiguousarray(data).tobytes(), dtype=np.uint8)
            self.buffers.append(buf)
        self.index[name] = len(self.tensors)
        self.shapes[name] = shape
        self.tensors.append(t)
        return self.index[name]

    def activation(self, name: str, shape: Shape, tq: TensorQuant) -> int:
        """Add a non-constant int8 activation tensor with its scale and zero point."""
        return self.tensor(name, shape, schema.TensorType.INT8, _quant([tq.scale], [tq.zero_point]))

    def op(
        self,
        code: int,
        inputs: list[int],
        outputs: list[int],
        options: Any = None,
        options_type: int = 0,
        version: int | None = None,
    ) -> None:
        """Append an operator; the opcode table is shared by (code, version)."""
        key = (code, version if version is not None else _VERSIONS[code])
        if key not in self.opcodes:
            self.opcodes[key] = len(self.opcodes)
        o = schema.OperatorT()
        o.opcodeIndex, o.inputs, o.outputs = self.opcodes[key], inputs, outputs
        o.builtinOptionsType, o.builtinOptions = options_type, options
        self.operators.append(o)


def _quant(scales: list[float], zero_points: list[int], dim: int = 0) -> Any:
    q = schema.QuantizationParametersT()
    q.scale, q.zeroPoint, q.quantizedDimension = scales, zero_points, dim
    return q


def _qparams(qm: QuantModel, name: str, node: str) -> TensorQuant:
    try:
        return qm.tensors[name]
    except KeyError:
        raise TFLiteError(
            f"layer {node!r}: tensor {name!r} has no quantisation parameters"
        ) from None


def _layer(qm: QuantModel, node: str) -> QuantizedLayer:
    try:
        return qm.layers[node]
    except KeyError:
        raise TFLiteError(f"layer {node!r}: no int8 weights (quantise the model first)") from None


def _same_qparams(qm: QuantModel, node: Node) -> TensorQuant:
    """Output qparams of an op that moves int8 values without rescaling them.

    TFLite's int8 pooling and RESHAPE kernels read the input's scale and zero point and
    ignore the output's; a file with different ones would not mean what the graph means.
    """
    a, b = _qparams(qm, node.inputs[0], node.name), _qparams(qm, node.output, node.name)
    if np.float32(a.scale) != np.float32(b.scale) or a.zero_point != b.zero_point:
        raise TFLiteError(
            f"layer {node.name!r}: int8 {type(node).__name__} needs its input's "
            f"quantisation on its output ({a.scale}, {a.zero_point}) != "
            f"({b.scale}, {b.zero_point})"
        )
    return b


def _input_shape(w: _Writer, node: Node, rank: int) -> Shape:
    name = node.inputs[0]
    if name not in w.shapes:
        raise TFLiteError(f"layer {node.name!r}: input {name!r} is not produced before it")
    shape = w.shapes[name]
    if len(shape) != rank:
        raise TFLiteError(f"layer {node.name!r}: expects a rank-{rank} input, got shape {shape}")
    return shape


def _params(
    w: _Writer, qm: QuantModel, node: Conv2D | Dense, in_scale: float, channel_dim: int
) -> tuple[int, int]:
    """Write the int8 weight (constant or graph input) and int32 bias; return indices."""
    layer = _layer(qm, node.name)
    scales = np.asarray(layer.weight_scales, dtype=np.float32)
    out_ch = layer.weight.shape[channel_dim]
    if scales.shape != (out_ch,) or layer.bias.shape != (out_ch,):
        raise TFLiteError(
            f"layer {node.name!r}: {out_ch} output channels but {scales.size} weight scales "
            f"and {layer.bias.size} biases"
        )
    wq = _quant([float(s) for s in scales], [0] * out_ch, channel_dim)
    weight = np.asarray(layer.weight, dtype=np.int8)
    wname = f"{node.name}/weight"
    if w.weights_as_inputs:
        wi = w.tensor(wname, weight.shape, schema.TensorType.INT8, wq)
        w.weight_inputs.append(wi)
    else:
        wi = w.tensor(wname, weight.shape, schema.TensorType.INT8, wq, weight)
    # TFLite defines the bias scale as input_scale * weight_scale, computed in float32
    # by the converter; kernels do not read it, readers may.
    bias_scales = [float(np.float32(in_scale) * s) for s in scales]
    bq = _quant(bias_scales, [0] * out_ch, 0)
    bias = np.asarray(layer.bias, dtype=np.int32)
    bi = w.tensor(f"{node.name}/bias", bias.shape, schema.TensorType.INT32, bq, bias)
    return wi, bi


def _conv(w: _Writer, qm: QuantModel, node: Conv2D) -> None:
    n, h, wd, cin = _input_shape(w, node, 4)
    in_q = _qparams(qm, node.inputs[0], node.name)
    dim = 3 if node.depthwise else 0
    weight = _layer(qm, node.name).weight
    if weight.ndim != 4:
        raise TFLiteError(f"layer {node.name!r}: weight has shape {weight.shape}, expected 4-D")
    _, kh, kw, _ = weight.shape
    cout = weight.shape[dim]
    if node.depthwise:
        if weight.shape[0] != 1 or cout % cin:
            raise TFLiteError(
                f"layer {node.name!r}: depthwise weight {weight.shape} "
                f"does not fit {cin} input channels"
            )
    elif weight.shape[3] * node.groups != cin:
        raise TFLiteError(
            f"layer {node.name!r}: weight {weight.shape} with groups="
            f"{node.groups} does not fit {cin} input channels"
        )
    wi, bi = _params(w, qm, node, in_q.scale, dim)
    sh, sw = node.stride
    shape = (n, _out_size(h, kh, sh, node.padding), _out_size(wd, kw, sw, node.padding), cout)
    oi = w.activation(node.output, shape, _qparams(qm, node.output, node.name))
    act, pad = activation_code(node.activation), _PADDING[node.padding]
    if node.depthwise:
        o = schema.DepthwiseConv2DOptionsT()
        o.padding, o.strideH, o.strideW, o.fusedActivationFunction = pad, sh, sw, act
        o.depthMultiplier, o.dilationHFactor, o.dilationWFactor = cout // cin, 1, 1
        w.op(
            _OP.DEPTHWISE_CONV_2D,
            [w.index[node.inputs[0]], wi, bi],
            [oi],
            o,
            schema.BuiltinOptions.DepthwiseConv2DOptions,
        )
        return
    o = schema.Conv2DOptionsT()
    o.padding, o.strideH, o.strideW, o.fusedActivationFunction = pad, sh, sw, act
    o.dilationHFactor, o.dilationWFactor = 1, 1
    version = _GROUPED_CONV_VERSION if node.groups > 1 else None
    w.op(
        _OP.CONV_2D,
        [w.index[node.inputs[0]], wi, bi],
        [oi],
        o,
        schema.BuiltinOptions.Conv2DOptions,
        version,
    )


def _dense(w: _Writer, qm: QuantModel, node: Dense) -> None:
    src = w.shapes.get(node.inputs[0])
    if src is None or len(src) < 2:
        raise TFLiteError(
            f"layer {node.name!r}: input {node.inputs[0]!r} is not produced "
            "before it or has no feature axis"
        )
    # FULLY_CONNECTED flattens all but the batch axis itself, as the engine does.
    n, features = src[0], int(np.prod(src[1:]))
    weight = _layer(qm, node.name).weight
    if weight.ndim != 2 or weight.shape[1] != features:
        raise TFLiteError(
            f"layer {node.name!r}: weight {weight.shape} does not fit {features} input features"
        )
    wi, bi = _params(w, qm, node, _qparams(qm, node.inputs[0], node.name).scale, 0)
    oi = w.activation(node.output, (n, weight.shape[0]), _qparams(qm, node.output, node.name))
    o = schema.FullyConnectedOptionsT()
    o.fusedActivationFunction = activation_code(node.activation)
    o.weightsFormat, o.keepNumDims = schema.FullyConnectedOptionsWeightsFormat.DEFAULT, False
    w.op(
        _OP.FULLY_CONNECTED,
        [w.index[node.inputs[0]], wi, bi],
        [oi],
        o,
        schema.BuiltinOptions.FullyConnectedOptions,
    )


def _add(w: _Writer, qm: QuantModel, node: Add) -> None:
    if len(node.inputs) != 2:
        raise TFLiteError(f"layer {node.name!r}: ADD takes two inputs, got {len(node.inputs)}")
    shape = w.shapes.get(node.inputs[0])
    for name in node.inputs:
        if name not in w.shapes or w.shapes[name] != shape:
            raise TFLiteError(
                f"layer {node.name!r}: inputs {node.inputs} differ in shape "
                "or are not produced before it"
            )
    assert shape is not None
    oi = w.activation(node.output, shape, _qparams(qm, node.output, node.name))
    o = schema.AddOptionsT()
    o.fusedActivationFunction = activation_code(node.activation)
    w.op(_OP.ADD, [w.index[i] for i in node.inputs], [oi], o, schema.BuiltinOptions.AddOptions)


def _pool_op(
    w: _Writer,
    code: int,
    src: str,
    out: int,
    pool: tuple[int, int],
    stride: tuple[int, int],
    padding: str,
) -> None:
    o = schema.Pool2DOptionsT()
    o.padding, o.strideH, o.strideW = _PADDING[padding], stride[0], stride[1]
    o.filterHeight, o.filterWidth = pool
    o.fusedActivationFunction = schema.ActivationFunctionType.NONE
    w.op(code, [w.index[src]], [out], o, schema.BuiltinOptions.Pool2DOptions)


def _pool(w: _Writer, qm: QuantModel, node: AvgPool | MaxPool) -> None:
    n, h, wd, c = _input_shape(w, node, 4)
    (ph, pw), (sh, sw) = node.pool, node.stride
    shape = (n, _out_size(h, ph, sh, node.padding), _out_size(wd, pw, sw, node.padding), c)
    oi = w.activation(node.output, shape, _same_qparams(qm, node))
    code = _OP.AVERAGE_POOL_2D if isinstance(node, AvgPool) else _OP.MAX_POOL_2D
    _pool_op(w, code, node.inputs[0], oi, node.pool, node.stride, node.padding)


def _reshape_op(w: _Writer, node: str, src: str, out: int, shape: Shape) -> None:
    # The batch dimension is -1 so the interpreter can be resized to any batch.
    new_shape = np.asarray([-1, *shape], dtype=np.int32)
    si = w.tensor(f"{node}/shape", new_shape.shape, schema.TensorType.INT32, None, new_shape)
    o = schema.ReshapeOptionsT()
    o.newShape = [int(v) for v in new_shape]
    w.op(_OP.RESHAPE, [w.index[src], si], [out], o, schema.BuiltinOptions.ReshapeOptions)


def _global_pool(w: _Writer, qm: QuantModel, node: GlobalAvgPool) -> None:
    n, h, wd, c = _input_shape(w, node, 4)
    tq = _same_qparams(qm, node)
    pooled = f"{node.name}/pool"
    pi = w.activation(pooled, (n, 1, 1, c), tq)
    _pool_op(w, _OP.AVERAGE_POOL_2D, node.inputs[0], pi, (h, wd), (1, 1), "valid")
    oi = w.activation(node.output, (n, c), tq)
    _reshape_op(w, node.name, pooled, oi, (c,))


def _reshape(w: _Writer, qm: QuantModel, node: Reshape) -> None:
    src = _input_shape(w, node, len(w.shapes.get(node.inputs[0], ())))
    if int(np.prod(src[1:])) != int(np.prod(node.shape)):
        raise TFLiteError(f"layer {node.name!r}: cannot reshape {src[1:]} to {node.shape}")
    oi = w.activation(node.output, (src[0], *node.shape), _same_qparams(qm, node))
    _reshape_op(w, node.name, node.inputs[0], oi, node.shape)


def _mean(w: _Writer, qm: QuantModel, node: Mean) -> None:
    n, _, _, c = _input_shape(w, node, 4)
    axes = np.asarray([1, 2], dtype=np.int32)
    ai = w.tensor(f"{node.name}/axes", axes.shape, schema.TensorType.INT32, None, axes)
    shape = (n, 1, 1, c) if node.keep_dims else (n, c)
    oi = w.activation(node.output, shape, _qparams(qm, node.output, node.name))
    o = schema.ReducerOptionsT()
    o.keepDims = node.keep_dims
    w.op(_OP.MEAN, [w.index[node.inputs[0]], ai], [oi], o, schema.BuiltinOptions.ReducerOptions)


def _pad(w: _Writer, qm: QuantModel, node: Pad) -> None:
    n, h, wd, c = _input_shape(w, node, 4)
    (top, bottom), (left, right) = node.pads
    pads = np.asarray([[0, 0], [top, bottom], [left, right], [0, 0]], dtype=np.int32)
    pi = w.tensor(f"{node.name}/paddings", pads.shape, schema.TensorType.INT32, None, pads)
    shape = (n, h + top + bottom, wd + left + right, c)
    oi = w.activation(node.output, shape, _same_qparams(qm, node))
    w.op(
        _OP.PAD,
        [w.index[node.inputs[0]], pi],
        [oi],
        schema.PadOptionsT(),
        schema.BuiltinOptions.PadOptions,
    )


def _mul(w: _Writer, qm: QuantModel, node: Mul) -> None:
    shape = _input_shape(w, node, len(w.shapes.get(node.inputs[0], ())))
    oi = w.activation(node.output, shape, _qparams(qm, node.output, node.name))
    o = schema.MulOptionsT()
    o.fusedActivationFunction = activation_code(node.activation)
    inputs = [w.index[t] for t in node.inputs]
    w.op(_OP.MUL, inputs, [oi], o, schema.BuiltinOptions.MulOptions)


def _mul_constant(w: _Writer, qm: QuantModel, node: MulConstant) -> None:
    shape = _input_shape(w, node, len(w.shapes.get(node.inputs[0], ())))
    oi = w.activation(node.output, shape, _qparams(qm, node.output, node.name))
    cq = _quant([float(np.float32(node.constant_scale))], [node.constant_zero_point])
    value = np.array(node.constant, dtype=np.int8)
    ci = w.tensor(f"{node.name}/constant", (), schema.TensorType.INT8, cq, value)
    o = schema.MulOptionsT()
    o.fusedActivationFunction = activation_code(node.activation)
    w.op(_OP.MUL, [w.index[node.inputs[0]], ci], [oi], o, schema.BuiltinOptions.MulOptions)


def _concat(w: _Writer, qm: QuantModel, node: Concat) -> None:
    a = _input_shape(w, node, len(w.shapes.get(node.inputs[0], ())))
    b = w.shapes[node.inputs[1]]
    shape = (*a[:-1], a[-1] + b[-1])
    oi = w.activation(node.output, shape, _qparams(qm, node.output, node.name))
    o = schema.ConcatenationOptionsT()
    o.axis, o.fusedActivationFunction = -1, schema.ActivationFunctionType.NONE
    inputs = [w.index[t] for t in node.inputs]
    w.op(_OP.CONCATENATION, inputs, [oi], o, schema.BuiltinOptions.ConcatenationOptions)


_UNARY_CODES = {ReLU: _OP.RELU, ReLU6: _OP.RELU6, Logistic: _OP.LOGISTIC, HardSwish: _OP.HARD_SWISH}


def _unary(w: _Writer, qm: QuantModel, node: ReLU | ReLU6 | Logistic | HardSwish) -> None:
    shape = _input_shape(w, node, len(w.shapes.get(node.inputs[0], ())))
    oi = w.activation(node.output, shape, _qparams(qm, node.output, node.name))
    w.op(_UNARY_CODES[type(node)], [w.index[node.inputs[0]]], [oi])


def _write_node(w: _Writer, qm: QuantModel, node: Node) -> None:
    if isinstance(node, Conv2D):
        _conv(w, qm, node)
    elif isinstance(node, Dense):
        _dense(w, qm, node)
    elif isinstance(node, Add):
        _add(w, qm, node)
    elif isinstance(node, AvgPool | MaxPool):
        _pool(w, qm, node)
    elif isinstance(node, GlobalAvgPool):
        _global_pool(w, qm, node)
    elif isinstance(node, Reshape):
        _reshape(w, qm, node)
    elif isinstance(node, ReLU | ReLU6 | Logistic | HardSwish):
        _unary(w, qm, node)
    elif isinstance(node, Mean):
        _mean(w, qm, node)
    elif isinstance(node, Pad):
        _pad(w, qm, node)
    elif isinstance(node, Concat):
        _concat(w, qm, node)
    elif isinstance(node, Mul):
        _mul(w, qm, node)
    elif isinstance(node, MulConstant):
        _mul_constant(w, qm, node)
    else:
        raise TFLiteError(f"layer {node.name!r}: no .tflite form for {type(node).__name__}")


def _metadata(w: _Writer, qm: QuantModel) -> Any:
    info = {
        "name": qm.model.name,
        "num_classes": qm.model.num_classes,
        "nodes": [n.name for n in qm.model.nodes],
    }
    buf = schema.BufferT()
    buf.data = np.frombuffer(json.dumps(info).encode(), dtype=np.uint8)
    w.buffers.append(buf)
    md = schema.MetadataT()
    md.name, md.buffer = METADATA_NAME, len(w.buffers) - 1
    return md


def _model(w: _Writer, qm: QuantModel, inputs: list[int], output: int) -> Any:
    sg = schema.SubGraphT()
    sg.tensors, sg.operators, sg.name = w.tensors, w.operators, "main"
    sg.inputs, sg.outputs = inputs + w.weight_inputs, [output]
    codes = []
    for code, version in w.opcodes:
        oc = schema.OperatorCodeT()
        # deprecated_builtin_code is an int8 field: codes above 127 store 127 there.
        oc.builtinCode, oc.deprecatedBuiltinCode, oc.version = code, min(code, 127), version
        codes.append(oc)
    m = schema.ModelT()
    m.version, m.operatorCodes, m.subgraphs = SCHEMA_VERSION, codes, [sg]
    m.description = f"qsched int8 model {qm.model.name}"
    m.metadata = [_metadata(w, qm)]
    m.buffers = w.buffers
    return m


def build_tflite(qmodel: QuantModel, batch: int = 1, weights_as_inputs: bool = False) -> bytes:
    """Serialise an INT8 model to ``.tflite`` bytes.

    Args:
        qmodel: the quantised model.
        batch: the batch dimension written into the tensor shapes.
        weights_as_inputs: make every int8 weight tensor a graph input (after the data
            input, in model order) instead of a constant, so an interpreter can be fed
            perturbed weights without rebuilding it.

    Returns:
        The flatbuffer bytes, file identifier ``TFL3``.
    """
    if batch < 1:
        raise TFLiteError(f"batch must be positive, got {batch}")
    model = qmodel.model
    w = _Writer(batch=batch, weights_as_inputs=weights_as_inputs)
    in_q = _qparams(qmodel, model.input_name, "<input>")
    inp = w.activation(model.input_name, (batch, *model.input_shape), in_q)
    for node in model.nodes:
        _write_node(w, qmodel, node)
    if model.output_name not in w.index:
        raise TFLiteError(f"output tensor {model.output_name!r} is produced by no layer")
    return pack_model(_model(w, qmodel, [inp], w.index[model.output_name]))
