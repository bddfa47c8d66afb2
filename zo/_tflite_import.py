"""Read an int8 ``.tflite`` flatbuffer back into a ``QuantModel``.

Accepts the operators the writer emits (and the same operators from other tools):
CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED, ADD, MUL (of activations, or by one int8
constant), AVERAGE_POOL_2D, MAX_POOL_2D, MEAN (over height and width), PAD and PADV2
(height and width, with the zero point), CONCATENATION (channel axis), RESHAPE, RELU,
RELU6, LOGISTIC, HARD_SWISH.
QUANTIZE, SOFTMAX and DEQUANTIZE at the file's edges are kept as adapters
(``qsched.zo.source``), and shape arithmetic feeding a RESHAPE is folded. An
AVERAGE_POOL_2D over the whole feature map whose only reader is a RESHAPE to ``(batch,
C)`` becomes one ``GlobalAvgPool``. Float weights on the graph nodes are the dequantised
int8 weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qsched.zo._tflite_common import (
    FILE_IDENTIFIER,
    METADATA_NAME,
    TFLiteError,
    TFLiteFormatError,
    activation_name,
    op_name,
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
    Model,
    Mul,
    MulConstant,
    Node,
    Pad,
    Padding,
    QuantizedLayer,
    QuantModel,
    ReLU,
    ReLU6,
    Reshape,
    TensorQuant,
)
from qsched.zo.source import EdgeTensor, FileDType, SourceFile

__all__ = ["ADAPTER_OPERATORS", "FOLDABLE_OPERATORS", "SUPPORTED_OPERATORS", "parse_tflite"]

_OP = schema.BuiltinOperator
_TT = schema.TensorType
_PADDING: dict[int, Padding] = {schema.Padding.SAME: "same", schema.Padding.VALID: "valid"}


@dataclass
class _Reader:
    """The decoded subgraph plus the graph being rebuilt from it."""

    model: Any
    graph: Any
    names: list[str] = field(default_factory=list)
    names_meta: list[str] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    tensors: dict[str, TensorQuant] = field(default_factory=dict)
    layers: dict[str, QuantizedLayer] = field(default_factory=dict)
    readers: dict[int, list[int]] = field(default_factory=dict)
    # layer -> its weight tensor and bias tensor (-1: none), where export writes them back
    param_tensors: dict[str, tuple[int, int]] = field(default_factory=dict)

    def tensor(self, index: int, where: str) -> Any:
        if not 0 <= index < len(self.graph.tensors or []):
            raise TFLiteFormatError(f"{where}: tensor index {index} out of range")
        return self.graph.tensors[index]

    def shape(self, index: int, where: str) -> tuple[int, ...]:
        return tuple(int(d) for d in (self.tensor(index, where).shape or []))

    def activation(self, index: int, where: str) -> str:
        """Record an int8 activation tensor's quantisation; return its name."""
        t, name = self.tensor(index, where), self.names[index]
        if t.type != _TT.INT8:
            raise TFLiteError(
                f"{where}: tensor {name!r} is not int8 (TensorType {t.type}); "
                "only int8 models are supported, quantise a float model first"
            )
        q = t.quantization
        if q is None or q.scale is None or len(q.scale) != 1:
            raise TFLiteError(f"{where}: tensor {name!r} lacks per-tensor quantisation")
        zp = int(q.zeroPoint[0]) if q.zeroPoint is not None and len(q.zeroPoint) else 0
        self.tensors[name] = TensorQuant(float(np.float32(q.scale[0])), zp)
        return name

    def data(self, index: int, where: str, dtype: type[np.generic]) -> npt.NDArray[Any]:
        """A constant tensor's values in its shape."""
        t, name = self.tensor(index, where), self.names[index]
        buffers = self.model.buffers or []
        if not 0 <= t.buffer < len(buffers):
            raise TFLiteFormatError(
                f"{where}: tensor {name!r} names buffer {t.buffer} of {len(buffers)}"
            )
        raw = buffers[t.buffer].data
        if raw is None or len(raw) == 0:
            raise TFLiteError(
                f"{where}: tensor {name!r} has no constant data "
                "(weights given as graph inputs cannot be imported)"
            )
        shape = self.shape(index, where)
        arr = np.frombuffer(np.asarray(raw, dtype=np.uint8).tobytes(), dtype=dtype)
        if arr.size != int(np.prod(shape)):
            raise TFLiteFormatError(
                f"{where}: tensor {name!r} has {arr.size} values for shape {shape}"
            )
        return arr.reshape(shape).copy()


def _decode(data: bytes) -> Any:
    if len(data) < 8 or data[4:8] != FILE_IDENTIFIER:
        raise TFLiteFormatError("not a .tflite file: missing the TFL3 file identifier")
    try:
        root = schema.Model.GetRootAs(data, 0)
        model = schema.ModelT.InitFromObj(root)
    except Exception as exc:  # a corrupt flatbuffer fails anywhere inside the decoder
        raise TFLiteFormatError(f"malformed .tflite flatbuffer: {exc!r}") from exc
    if not model.subgraphs:
        raise TFLiteFormatError("the .tflite file has no subgraph")
    if len(model.subgraphs) != 1:
        raise TFLiteError(f"only single-subgraph models are supported, got {len(model.subgraphs)}")
    return model


def _metadata(model: Any) -> dict[str, Any]:
    for md in model.metadata or []:
        name = md.name.decode() if isinstance(md.name, bytes) else md.name
        if name == METADATA_NAME and 0 <= md.buffer < len(model.buffers or []):
            raw = model.buffers[md.buffer].data
            try:
                info = json.loads(bytes(np.asarray(raw, dtype=np.uint8)).decode())
            except (ValueError, TypeError) as exc:
                raise TFLiteFormatError(f"unreadable {METADATA_NAME} metadata") from exc
            return info if isinstance(info, dict) else {}
    return {}


def _opcode(model: Any, op: Any) -> int:
    codes = model.operatorCodes or []
    if not 0 <= op.opcodeIndex < len(codes):
        raise TFLiteFormatError(f"operator code index {op.opcodeIndex} out of range")
    oc = codes[op.opcodeIndex]
    # Files from before schema 3a keep the code only in the deprecated int8 field.
    code = max(int(oc.builtinCode), int(oc.deprecatedBuiltinCode))
    if code == _OP.CUSTOM:
        custom = oc.customCode.decode() if isinstance(oc.customCode, bytes) else oc.customCode
        raise TFLiteError(f"unsupported operator CUSTOM ({custom!r})")
    return code


def _per_channel(r: _Reader, index: int, where: str, channel_dim: int) -> QuantizedLayer:
    """Read an int8 weight (symmetric, per channel) and check its quantisation."""
    t = r.tensor(index, where)
    if t.type != _TT.INT8:
        raise TFLiteError(f"{where}: weight is not int8 (TensorType {t.type})")
    weight = r.data(index, where, np.int8)
    out_ch = weight.shape[channel_dim]
    q = t.quantization
    scales = np.asarray(q.scale if q is not None and q.scale is not None else [], dtype=np.float32)
    if scales.size == 1:
        scales = np.full(out_ch, scales[0], dtype=np.float32)
    elif scales.size != out_ch or (q.quantizedDimension or 0) != channel_dim:
        raise TFLiteError(
            f"{where}: weight needs per-channel scales on dimension "
            f"{channel_dim} ({out_ch}), got {scales.size}"
        )
    if q.zeroPoint is not None and np.any(np.asarray(q.zeroPoint) != 0):
        raise TFLiteError(f"{where}: weight zero points must be 0 (symmetric)")
    return QuantizedLayer(
        weight=weight, weight_scales=scales, bias=np.zeros(out_ch, dtype=np.int32)
    )


def _bias(r: _Reader, op: Any, where: str, layer: QuantizedLayer) -> None:
    if len(op.inputs) < 3 or op.inputs[2] < 0:
        return
    t = r.tensor(op.inputs[2], where)
    if t.type != _TT.INT32:
        raise TFLiteError(f"{where}: bias is not int32 (TensorType {t.type})")
    bias = r.data(op.inputs[2], where, np.int32)
    if bias.shape != layer.bias.shape:
        raise TFLiteFormatError(f"{where}: bias shape {bias.shape} != {layer.bias.shape}")
    layer.bias = bias


def _float_params(
    layer: QuantizedLayer, in_scale: float, channel_dim: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    shape = [1] * layer.weight.ndim
    shape[channel_dim] = -1
    weight = layer.weight.astype(np.float32) * layer.weight_scales.reshape(shape)
    bias = layer.bias.astype(np.float32) * (np.float32(in_scale) * layer.weight_scales)
    return weight.astype(np.float32), bias.astype(np.float32)


def _check_arity(op: Any, where: str, n_in: int) -> None:
    if op.inputs is None or op.outputs is None or len(op.inputs) < n_in or len(op.outputs) != 1:
        raise TFLiteFormatError(f"{where}: wrong number of inputs or outputs")


def _options(op: Any, expected: int, where: str) -> Any:
    if op.builtinOptionsType != expected or op.builtinOptions is None:
        raise TFLiteFormatError(f"{where}: missing or wrong builtin options")
    return op.builtinOptions


def _conv(r: _Reader, op: Any, code: int, where: str) -> Node:
    _check_arity(op, where, 2)
    depthwise = code == _OP.DEPTHWISE_CONV_2D
    expected = (
        schema.BuiltinOptions.DepthwiseConv2DOptions
        if depthwise
        else schema.BuiltinOptions.Conv2DOptions
    )
    o = _options(op, expected, where)
    if (o.dilationHFactor or 1) != 1 or (o.dilationWFactor or 1) != 1:
        raise TFLiteError(f"{where}: dilated convolution is not supported")
    x = r.activation(op.inputs[0], where)
    in_shape = r.shape(op.inputs[0], where)
    dim = 3 if depthwise else 0
    layer = _per_channel(r, op.inputs[1], where, dim)
    _bias(r, op, where, layer)
    out = r.activation(op.outputs[0], where)
    cin, filt_in = in_shape[-1], layer.weight.shape[3]
    if not depthwise and (filt_in == 0 or cin % filt_in):
        raise TFLiteFormatError(f"{where}: filter depth {filt_in} does not divide {cin}")
    weight, bias = _float_params(layer, r.tensors[x].scale, dim)
    name = _claim(r, out, layer, _param_tensors(op))
    return Conv2D(
        name,
        [x],
        out,
        weight,
        bias,
        stride=(int(o.strideH), int(o.strideW)),
        padding=_padding(o.padding, where),
        groups=cin if depthwise else cin // filt_in,
        depthwise=depthwise,
        activation=activation_name(o.fusedActivationFunction, where),
    )


def _dense(r: _Reader, op: Any, where: str) -> Node:
    _check_arity(op, where, 2)
    o = _options(op, schema.BuiltinOptions.FullyConnectedOptions, where)
    if o.weightsFormat != schema.FullyConnectedOptionsWeightsFormat.DEFAULT or o.keepNumDims:
        raise TFLiteError(f"{where}: only the default weight format without keep_num_dims")
    x = r.activation(op.inputs[0], where)
    in_shape = r.shape(op.inputs[0], where)
    layer = _per_channel(r, op.inputs[1], where, 0)
    if (
        layer.weight.ndim != 2
        or len(in_shape) < 2
        or layer.weight.shape[1] != int(np.prod(in_shape[1:]))
    ):
        raise TFLiteError(f"{where}: weight {layer.weight.shape} does not fit input {in_shape}")
    _bias(r, op, where, layer)
    out = r.activation(op.outputs[0], where)
    weight, bias = _float_params(layer, r.tensors[x].scale, 0)
    return Dense(
        _claim(r, out, layer, _param_tensors(op)),
        [x],
        out,
        weight,
        bias,
        activation=activation_name(o.fusedActivationFunction, where),
    )


def _padding(code: int, where: str) -> Padding:
    if code not in _PADDING:
        raise TFLiteFormatError(f"{where}: unknown padding {code}")
    return _PADDING[code]


def _param_tensors(op: Any) -> tuple[int, int]:
    """A conv or dense operator's weight and bias tensors (-1: no bias)."""
    return int(op.inputs[1]), int(op.inputs[2]) if len(op.inputs) > 2 else -1


def _claim(
    r: _Reader,
    out: str,
    layer: QuantizedLayer | None = None,
    params: tuple[int, int] | None = None,
) -> str:
    """The next node's provisional name, its output tensor's (see ``_rename``)."""
    if layer is not None:
        r.layers[out] = layer
    if params is not None:
        r.param_tensors[out] = params
    return out


def _rename(r: _Reader) -> None:
    """Layer names from the file's metadata, when it lists one per node and no repeats."""
    meta = r.names_meta
    if len(meta) != len(r.nodes) or len(set(meta)) != len(meta):
        return
    layers, params = {}, {}
    for node, name in zip(r.nodes, meta, strict=True):
        if node.name in r.layers:
            layers[name] = r.layers[node.name]
            params[name] = r.param_tensors[node.name]
        node.name = name
    r.layers, r.param_tensors = layers, params


def _pool(r: _Reader, op: Any, code: int, ops: list[Any], where: str) -> tuple[Node, int]:
    """A pooling node; returns it and how many operators it consumed (1, or 2 when fused)."""
    _check_arity(op, where, 1)
    o = _options(op, schema.BuiltinOptions.Pool2DOptions, where)
    if o.fusedActivationFunction != schema.ActivationFunctionType.NONE:
        raise TFLiteError(f"{where}: fused activation on pooling is not supported")
    x = r.activation(op.inputs[0], where)
    in_shape, out_shape = r.shape(op.inputs[0], where), r.shape(op.outputs[0], where)
    pool, stride = (int(o.filterHeight), int(o.filterWidth)), (int(o.strideH), int(o.strideW))
    padding = _padding(o.padding, where)
    nxt = _global_reshape(r, op, ops)
    if (
        code == _OP.AVERAGE_POOL_2D
        and nxt is not None
        and len(in_shape) == 4
        and pool == in_shape[1:3]
        and padding == "valid"
        and out_shape[1:3] == (1, 1)
    ):
        r.activation(op.outputs[0], where)
        out = r.activation(nxt.outputs[0], where)
        return GlobalAvgPool(_claim(r, out), [x], out), 2
    out = r.activation(op.outputs[0], where)
    cls = AvgPool if code == _OP.AVERAGE_POOL_2D else MaxPool
    return cls(_claim(r, out), [x], out, pool=pool, stride=stride, padding=padding), 1


def _global_reshape(r: _Reader, op: Any, ops: list[Any]) -> Any:
    """The RESHAPE to (batch, C) that alone reads this pool's output, if it is next."""
    out = op.outputs[0]
    if not ops or r.readers.get(out) != [id(ops[0])] or out in (r.graph.outputs or []):
        return None
    nxt = ops[0]
    if _opcode(r.model, nxt) != _OP.RESHAPE or not nxt.outputs:
        return None
    return nxt if len(r.shape(nxt.outputs[0], "RESHAPE")) == 2 else None


def _constant_ints(r: _Reader, index: int, where: str) -> list[int]:
    t = r.tensor(index, where)
    dtype = np.int64 if t.type == _TT.INT64 else np.int32
    if t.type not in (_TT.INT32, _TT.INT64):
        raise TFLiteError(f"{where}: {r.names[index]!r} is not an int32 constant")
    return [int(v) for v in r.data(index, where, dtype).reshape(-1)]


def _mean(r: _Reader, op: Any, where: str) -> Node:
    """MEAN over height and width of an NHWC tensor (GlobalAveragePooling2D)."""
    _check_arity(op, where, 2)
    o = _options(op, schema.BuiltinOptions.ReducerOptions, where)
    x = r.activation(op.inputs[0], where)
    rank = len(r.shape(op.inputs[0], where))
    axes = sorted({a % rank for a in _constant_ints(r, op.inputs[1], where)}) if rank else []
    if rank != 4 or axes != [1, 2]:
        raise TFLiteError(f"{where}: MEAN is supported over height and width (axes 1, 2) only")
    out = r.activation(op.outputs[0], where)
    return Mean(_claim(r, out), [x], out, keep_dims=bool(o.keepDims))


def _pad(r: _Reader, op: Any, where: str) -> Node:
    """PAD or PADV2 of height and width with the zero point (what a converter writes)."""
    _check_arity(op, where, 2)
    x = r.activation(op.inputs[0], where)
    pads = _constant_ints(r, op.inputs[1], where)
    out = r.activation(op.outputs[0], where)
    if len(pads) != 8 or pads[:2] != [0, 0] or pads[6:] != [0, 0] or min(pads) < 0:
        raise TFLiteError(f"{where}: PAD is supported on height and width only, got {pads}")
    a, b = r.tensors[x], r.tensors[out]
    if (a.scale, a.zero_point) != (b.scale, b.zero_point):
        raise TFLiteError(f"{where}: PAD whose output is quantised unlike its input")
    if len(op.inputs) > 2 and op.inputs[2] >= 0:
        value = int(r.data(op.inputs[2], where, np.int8).reshape(-1)[0])
        if value != r.tensors[out].zero_point:
            raise TFLiteError(f"{where}: PADV2 with a value other than zero is not supported")
    top, bottom, left, right = pads[2:6]
    return Pad(_claim(r, out), [x], out, pads=((top, bottom), (left, right)))


def _is_constant(r: _Reader, index: int, where: str) -> bool:
    buffer = r.tensor(index, where).buffer
    return 0 < buffer < len(r.model.buffers or []) and r.model.buffers[buffer].data is not None


def _mul(r: _Reader, op: Any, where: str) -> Node:
    """MUL of two activations, broadcast only as a (1, 1, C) channel gate, or of an
    activation by a one-element int8 constant (hard_sigmoid's 1/6)."""
    _check_arity(op, where, 2)
    o = _options(op, schema.BuiltinOptions.MulOptions, where)
    act = activation_name(o.fusedActivationFunction, where)
    constants = [i for i in op.inputs[:2] if _is_constant(r, i, where)]
    if not constants:
        xs = [r.activation(i, where) for i in op.inputs[:2]]
        out = r.activation(op.outputs[0], where)
        return Mul(_claim(r, out), xs, out, activation=act)
    c = constants[0]
    t = r.tensor(c, where)
    one_value = int(np.prod(t.shape if t.shape is not None else [1])) == 1
    if len(constants) != 1 or t.type != schema.TensorType.INT8 or not one_value:
        raise TFLiteError(f"{where}: MUL by a constant is supported for one int8 value only")
    q = t.quantization
    if q is None or q.scale is None or len(q.scale) != 1:
        raise TFLiteError(f"{where}: MUL's constant has no per-tensor quantisation")
    (x,) = [r.activation(i, where) for i in op.inputs[:2] if i != c]
    out = r.activation(op.outputs[0], where)
    return MulConstant(
        _claim(r, out),
        [x],
        out,
        constant=int(r.data(c, where, np.int8).reshape(-1)[0]),
        constant_scale=float(np.float32(q.scale[0])),
        constant_zero_point=int(q.zeroPoint[0]) if q.zeroPoint is not None else 0,
        activation=act,
    )


def _concatenation(r: _Reader, op: Any, where: str) -> Node:
    """CONCATENATION on the channel axis, inputs and output quantised alike (TFLite's
    int8 kernel requires it). More than two inputs become a chain of two-input joins
    whose intermediate tensors share those parameters."""
    _check_arity(op, where, 2)
    o = _options(op, schema.BuiltinOptions.ConcatenationOptions, where)
    rank = len(r.shape(op.outputs[0], where))
    if o.axis % rank != rank - 1 or o.fusedActivationFunction != schema.ActivationFunctionType.NONE:
        raise TFLiteError(f"{where}: CONCATENATION is supported on the channel axis only")
    xs = [r.activation(i, where) for i in op.inputs]
    out = r.activation(op.outputs[0], where)
    q = r.tensors[out]
    if any((r.tensors[x].scale, r.tensors[x].zero_point) != (q.scale, q.zero_point) for x in xs):
        raise TFLiteError(f"{where}: CONCATENATION inputs quantised unlike its output")
    left = xs[0]
    for k, right in enumerate(xs[1:-1]):
        joined = f"{out}/join{k}"
        r.tensors[joined] = q
        r.nodes.append(Concat(_claim(r, joined), [left, right], joined))
        left = joined
    return Concat(_claim(r, out), [left, xs[-1]], out)


def _node(r: _Reader, op: Any, code: int, ops: list[Any], where: str) -> tuple[Node, int]:
    if code in (_OP.CONV_2D, _OP.DEPTHWISE_CONV_2D):
        return _conv(r, op, code, where), 1
    if code == _OP.FULLY_CONNECTED:
        return _dense(r, op, where), 1
    if code in (_OP.AVERAGE_POOL_2D, _OP.MAX_POOL_2D):
        return _pool(r, op, code, ops, where)
    _check_arity(op, where, 1)
    if code == _OP.ADD:
        _check_arity(op, where, 2)
        o = _options(op, schema.BuiltinOptions.AddOptions, where)
        xs = [r.activation(i, where) for i in op.inputs[:2]]
        out = r.activation(op.outputs[0], where)
        return Add(
            _claim(r, out), xs, out, activation=activation_name(o.fusedActivationFunction, where)
        ), 1
    if code == _OP.MEAN:
        return _mean(r, op, where), 1
    if code == _OP.CONCATENATION:
        return _concatenation(r, op, where), 1
    if code == _OP.MUL:
        return _mul(r, op, where), 1
    if code in (_OP.PAD, _OP.PADV2):
        return _pad(r, op, where), 1
    x = r.activation(op.inputs[0], where)
    out = r.activation(op.outputs[0], where)
    if code == _OP.RESHAPE:
        return Reshape(_claim(r, out), [x], out, shape=r.shape(op.outputs[0], where)[1:]), 1
    if code == _OP.RELU:
        return ReLU(_claim(r, out), [x], out), 1
    if code == _OP.RELU6:
        return ReLU6(_claim(r, out), [x], out), 1
    if code == _OP.HARD_SWISH:
        return HardSwish(_claim(r, out), [x], out), 1
    if code == _OP.LOGISTIC:
        q = r.tensor(op.outputs[0], where).quantization
        if (
            q is None
            or q.scale is None
            or list(q.scale) != [1.0 / 256]
            or list(q.zeroPoint) != [-128]
        ):
            raise TFLiteError(
                f"{where}: LOGISTIC's int8 output must be scale 1/256, zero point -128"
            )
        return Logistic(_claim(r, out), [x], out), 1
    raise TFLiteError(f"unsupported operator {op_name(code)}")


def parse_tflite(data: bytes) -> QuantModel:
    """Decode ``.tflite`` bytes into a ``QuantModel``.

    Args:
        data: the file's bytes.

    Returns:
        The INT8 model with its graph, int8 weights, int32 biases and scales.

    Raises:
        TFLiteFormatError: malformed bytes; TFLiteError: an unsupported model.
    """
    try:
        return _parse(bytes(data))
    except TFLiteError:
        raise
    except Exception as exc:  # the flatbuffer decoder trusts its input; garbage fails anywhere
        raise TFLiteFormatError(f"malformed .tflite model: {exc!r}") from exc


def _parse(data: bytes) -> QuantModel:
    model = _decode(data)
    graph = model.subgraphs[0]
    info = _metadata(model)
    r = _Reader(model=model, graph=graph)
    r.names = [
        (t.name.decode() if isinstance(t.name, bytes) else (t.name or f"t{i}"))
        for i, t in enumerate(graph.tensors or [])
    ]
    r.names_meta = [str(n) for n in info.get("nodes", [])]
    ops = list(graph.operators or [])
    _normalise(graph, ops)
    edges = _strip_edges(r, ops)
    ops, folded = _fold_shape_arithmetic(r, edges.ops)
    for op in ops:
        for i in op.inputs or []:
            r.readers.setdefault(int(i), []).append(id(op))
    # Every unknown operator at once, before any is built: the user sees the whole list.
    _check_supported(model, ops)
    k = 0
    while k < len(ops):
        code = _opcode(model, ops[k])
        node, used = _node(r, ops[k], code, ops[k + 1 :], f"operator #{k} ({op_name(code)})")
        r.nodes.append(node)
        k += used
    _rename(r)
    qmodel = _quant_model(r, info, edges)
    qmodel.source = _source(data, r, edges, folded)
    return qmodel


def _check_supported(model: Any, ops: list[Any]) -> None:
    unsupported: dict[str, list[int]] = {}
    for k, op in enumerate(ops):
        code = _opcode(model, op)
        if code not in _SUPPORTED:
            unsupported.setdefault(op_name(code), []).append(k)
    if unsupported:
        listed = ", ".join(
            f"{name} (operator{'s' if len(at) > 1 else ''} {', '.join(f'#{k}' for k in at)})"
            for name, at in unsupported.items()
        )
        raise TFLiteError(f"unsupported operators: {listed}; see docs/ARCHITECTURE.md")


@dataclass
class _Edges:
    """The trained graph's input and output inside the file, and the adapters around it."""

    ops: list[Any]  # the operators left once the adapters are taken off
    model_input: int
    model_output: int
    input_ops: list[str] = field(default_factory=list)
    output_ops: list[str] = field(default_factory=list)


def _strip_edges(r: _Reader, ops: list[Any]) -> _Edges:
    """Take the QUANTIZE off a float or uint8 input and the SOFTMAX, DEQUANTIZE and
    QUANTIZE after the int8 logits: they are adapters, not layers to train."""
    inputs, outputs = r.graph.inputs, r.graph.outputs
    if len(inputs) != 1 or len(outputs) != 1:
        raise TFLiteError(
            f"expected one input and one output, got {len(inputs)} inputs and "
            f"{len(outputs)} outputs (weights as graph inputs cannot be imported)"
        )
    edges = _Edges(ops=list(ops), model_input=inputs[0], model_output=outputs[0])
    while r.tensor(edges.model_input, "model input").type != _TT.INT8:
        readers = [op for op in edges.ops if edges.model_input in op.inputs]
        if len(readers) != 1 or _opcode(r.model, readers[0]) != _OP.QUANTIZE:
            break
        _check_input_adapter(r, edges.model_input, readers[0].outputs[0])
        edges.ops.remove(readers[0])
        edges.input_ops.append("QUANTIZE")
        edges.model_input = readers[0].outputs[0]
    while True:
        producer = next((op for op in edges.ops if edges.model_output in op.outputs), None)
        if producer is None or _opcode(r.model, producer) not in _OUTPUT_ADAPTERS:
            break
        source = producer.inputs[0]
        if any(source in op.inputs for op in edges.ops if op is not producer):
            break  # the logits feed something else too: not a pure output adapter
        edges.ops.remove(producer)
        edges.output_ops.insert(0, op_name(_opcode(r.model, producer)))
        edges.model_output = source
    return edges


def _check_input_adapter(r: _Reader, file_input: int, quantised: int) -> None:
    """Data are fed to the trained graph quantised once with its int8 input's parameters.
    That is the file's own QUANTIZE for a float input; for a uint8 input it is exact only
    when the requantisation is the identity shifted by 128 (what converters write)."""
    t = r.tensor(file_input, "model input")
    if t.type == _TT.FLOAT32:
        return
    q = t.quantization
    if t.type != _TT.UINT8 or q is None or q.scale is None or len(q.scale) != 1:
        raise TFLiteError(f"model input {r.names[file_input]!r}: type {t.type} is not supported")
    r.activation(quantised, "QUANTIZE")
    inner = r.tensors[r.names[quantised]]
    zp = int(q.zeroPoint[0]) if q.zeroPoint is not None and len(q.zeroPoint) else 0
    if float(np.float32(q.scale[0])) != inner.scale or zp - 128 != inner.zero_point:
        raise TFLiteError(
            "a uint8 input requantised to another scale or zero point than "
            "(same scale, zero point - 128) is not supported"
        )


def _fold_shape_arithmetic(r: _Reader, ops: list[Any]) -> tuple[list[Any], list[str]]:
    """Drop SHAPE, STRIDED_SLICE and PACK whose results only ever reach a RESHAPE's shape
    input (Keras's Flatten with an open batch): every shape here is static, and RESHAPE
    takes its output shape from its output tensor."""
    foldable = {id(op) for op in ops if _opcode(r.model, op) in _SHAPE_OPS}
    changed = True
    while changed:
        changed = False
        for op in ops:
            if id(op) in foldable and not _feeds_only_shapes(r, op, ops, foldable):
                foldable.discard(id(op))
                changed = True
    kept = [op for op in ops if id(op) not in foldable]
    folded = [op_name(_opcode(r.model, op)) for op in ops if id(op) in foldable]
    return kept, folded


def _feeds_only_shapes(r: _Reader, op: Any, ops: list[Any], foldable: set[int]) -> bool:
    for out in op.outputs:
        if out in r.graph.outputs:
            return False
        for reader in ops:
            if out not in reader.inputs or id(reader) in foldable:
                continue
            is_shape = _opcode(r.model, reader) == _OP.RESHAPE and reader.inputs[1:2] == [out]
            if not is_shape or reader.inputs[0] == out:
                return False
    return True


def _source(data: bytes, r: _Reader, edges: _Edges, folded: list[str]) -> SourceFile:
    return SourceFile(
        data=data,
        input=_edge_tensor(r, r.graph.inputs[0]),
        output=_edge_tensor(r, r.graph.outputs[0]),
        input_ops=tuple(edges.input_ops),
        output_ops=tuple(edges.output_ops),
        folded_ops=tuple(folded),
        **_layer_spans(data, r.param_tensors),
    )


_FILE_DTYPES: dict[int, FileDType] = {
    _TT.INT8: "int8",
    _TT.UINT8: "uint8",
    _TT.FLOAT32: "float32",
}


def _edge_tensor(r: _Reader, index: int) -> EdgeTensor:
    t = r.tensor(index, "model edge")
    if t.type not in _FILE_DTYPES:
        raise TFLiteError(f"tensor {r.names[index]!r}: type {t.type} at the model's edge")
    signature = _ints(t.shapeSignature) or list(r.shape(index, "model edge"))
    q = t.quantization
    quantised = q is not None and q.scale is not None and len(q.scale) == 1
    return EdgeTensor(
        name=r.names[index],
        dtype=_FILE_DTYPES[t.type],
        shape=tuple(signature),
        scale=float(np.float32(q.scale[0])) if quantised else None,
        zero_point=int(q.zeroPoint[0]) if quantised and q.zeroPoint is not None else None,
    )


def _layer_spans(
    data: bytes, params: dict[str, tuple[int, int]]
) -> dict[str, dict[str, tuple[int, int]]]:
    """Where each layer's weight bytes, weight scales, bias bytes and bias scales lie in
    the file, ``(offset, length)`` per layer (a layer without bias has no bias spans)."""
    root = schema.Model.GetRootAs(data, 0)
    graph = root.Subgraphs(0)
    spans: dict[str, dict[str, tuple[int, int]]] = {
        "weight_bytes": {},
        "weight_scale_bytes": {},
        "bias_bytes": {},
        "bias_scale_bytes": {},
    }
    for name, (weight, bias) in params.items():
        for tensor, kind in ((weight, "weight"), (bias, "bias")):
            if tensor < 0:
                continue
            t = graph.Tensors(tensor)
            buffer = root.Buffers(t.Buffer())._tab
            spans[f"{kind}_bytes"][name] = _vector_span(buffer, _BUFFER_DATA, 1)
            quantization = t.Quantization()
            if quantization is not None and quantization.ScaleLength() > 0:
                scales = _vector_span(quantization._tab, _QUANTIZATION_SCALE, 4)
                spans[f"{kind}_scale_bytes"][name] = scales
    return spans


# Vtable slots of the flatbuffer fields export rewrites in place.
_BUFFER_DATA: Final = 4  # Buffer.data, [ubyte]
_QUANTIZATION_SCALE: Final = 8  # QuantizationParameters.scale, [float]


def _vector_span(table: Any, slot: int, width: int) -> tuple[int, int]:
    """``(offset, bytes)`` of the vector of ``width``-byte elements in a table's field."""
    field = table.Offset(slot)
    return int(table.Vector(field)), int(table.VectorLen(field)) * width


def _ints(values: Any) -> list[int]:
    return [] if values is None else [int(v) for v in values]


def _normalise(graph: Any, ops: list[Any]) -> None:
    """Index vectors as Python lists (the decoder returns numpy arrays or None)."""
    graph.inputs, graph.outputs = _ints(graph.inputs), _ints(graph.outputs)
    for t in graph.tensors or []:
        t.shape = _ints(t.shape)
    for op in ops:
        op.inputs, op.outputs = _ints(op.inputs), _ints(op.outputs)


_OUTPUT_ADAPTERS = frozenset({_OP.SOFTMAX, _OP.DEQUANTIZE, _OP.QUANTIZE})
_SHAPE_OPS = frozenset({_OP.SHAPE, _OP.STRIDED_SLICE, _OP.PACK})
_SUPPORTED = frozenset(
    {
        _OP.CONV_2D,
        _OP.DEPTHWISE_CONV_2D,
        _OP.FULLY_CONNECTED,
        _OP.ADD,
        _OP.AVERAGE_POOL_2D,
        _OP.MAX_POOL_2D,
        _OP.RESHAPE,
        _OP.RELU,
        _OP.RELU6,
        _OP.MEAN,
        _OP.PAD,
        _OP.PADV2,
        _OP.CONCATENATION,
        _OP.MUL,
        _OP.LOGISTIC,
        _OP.HARD_SWISH,
    }
)


# By schema name (``qsched inspect``): what the importer turns into layers, what it keeps
# as adapters at the file's edges, and the shape arithmetic it can fold away.
SUPPORTED_OPERATORS = frozenset(op_name(code) for code in _SUPPORTED)
ADAPTER_OPERATORS = frozenset(op_name(code) for code in _OUTPUT_ADAPTERS)
FOLDABLE_OPERATORS = frozenset(op_name(code) for code in _SHAPE_OPS)


def _quant_model(r: _Reader, info: dict[str, Any], edges: _Edges) -> QuantModel:
    graph = r.graph
    in_name = r.activation(edges.model_input, "model input")
    out_name = r.activation(edges.model_output, "model output (the logits)")
    in_shape = r.shape(edges.model_input, "input")
    out_shape = r.shape(edges.model_output, "output")
    model = Model(
        name=str(
            info.get(
                "name",
                graph.name.decode() if isinstance(graph.name, bytes) else graph.name or "imported",
            )
        ),
        input_name=in_name,
        input_shape=in_shape[1:],
        nodes=r.nodes,
        output_name=out_name,
        num_classes=int(info.get("num_classes", out_shape[-1] if out_shape else 0)),
    )
    produced = {in_name}
    for node in r.nodes:
        missing = [i for i in node.inputs if i not in produced]
        if missing:
            raise TFLiteError(
                f"layer {node.name!r} reads {missing}, which no earlier "
                "operator produces (constant or out-of-order activations)"
            )
        produced.add(node.output)
    if out_name not in produced:
        raise TFLiteError(f"the model output {out_name!r} is produced by no operator")
    used = produced
    tensors = {k: v for k, v in r.tensors.items() if k in used}
    return QuantModel(model=model, tensors=tensors, layers=r.layers)
