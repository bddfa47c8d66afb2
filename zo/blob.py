"""The model blob LoadModel ships, and the dataset blob a C host board holds.

A compact little-endian binary format with fixed-width records, so the C board agent
parses it in place with no heap (``protocol/SPEC.md`` section "Model blob" is the
normative layout). It carries the graph (one record per operation), every tensor's
shape and quantisation, the per-channel requantisation multipliers and shifts already
computed (the board does no float math), int8 weights and int32 biases (INT8) or float32
weights and biases (FP32), and the integer loss's exp table.

    header (64 B) | loss table (256 x u32) | tensors (52 B each) | ops (140 B each) | data

Every array in the data section starts at a multiple of 4 bytes from the data section's
start; record fields that refer to arrays hold such offsets.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from qsched.zo import intloss
from qsched.zo import kernels_int8 as ki
from qsched.zo.datasets import Dataset
from qsched.zo.engine import SINGLE_ROUNDING, infer_shapes
from qsched.zo.errors import BlobError
from qsched.zo.graph import (
    Activation,
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
from qsched.zo.lookup import TABLE_NODES, TABLE_SIZE, TableNode, unary_table

if TYPE_CHECKING:
    from qsched.zo.workload import TrainState, Workload

__all__ = [
    "BLOB_MAGIC",
    "BLOB_VERSION",
    "DATASET_MAGIC",
    "MAX_NAME",
    "MAX_OPS",
    "MAX_RANK",
    "MAX_TENSORS",
    "BlobError",
    "DatasetBlob",
    "blob_name",
    "decode_blob",
    "decode_dataset_blob",
    "encode_blob",
    "encode_dataset_blob",
    "trainable_layers",
]

BLOB_MAGIC: Final = b"QZMB"
BLOB_VERSION: Final = 1
DATASET_MAGIC: Final = b"QZDS"
DATASET_VERSION: Final = 1
MAX_TENSORS: Final = 256
MAX_OPS: Final = 128
MAX_RANK: Final = 3  # per-sample shape, batch excluded
MAX_NAME: Final = 32  # bytes, NUL padded; a name uses at most 31
NO_TENSOR: Final = 0xFFFF
NO_OFFSET: Final = 0xFFFFFFFF

NUMERICS_INT8: Final = 1
NUMERICS_FP32: Final = 2
FLAG_SINGLE_ROUNDING: Final = 1
DTYPE_INT8: Final = 1
DTYPE_FP32: Final = 2
OP_TRAINABLE: Final = 1

_HEADER = struct.Struct("<4sHBBHHHHIIIIII24x")
_TENSOR = struct.Struct("<32sBBH3HHfi")
_OP = struct.Struct("<32sBBBBHHHH6Hhhii4H8I7ii")
_TABLE = struct.Struct("<256I")
_DATASET_HEADER = struct.Struct("<4sHHIIIHB1x3HHfi32s")

OPCODES: Final[dict[type, int]] = {
    Conv2D: 1,
    Dense: 3,
    ReLU: 4,
    ReLU6: 5,
    Add: 6,
    AvgPool: 7,
    MaxPool: 8,
    GlobalAvgPool: 9,
    Reshape: 10,
    Mean: 11,
    Pad: 12,
    Concat: 13,
    Mul: 14,
    Logistic: 15,
    HardSwish: 16,
    MulConstant: 17,
}
OPCODE_DEPTHWISE: Final = 2
ACTIVATIONS: Final[dict[str, int]] = {"none": 0, "relu": 1, "relu6": 2}
PADDINGS: Final[dict[str, int]] = {"same": 0, "valid": 1}


# --------------------------------------------------------------------------- encoding


class _Data:
    """The data section: arrays appended at 4-byte aligned offsets."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, array: npt.NDArray[np.generic]) -> int:
        raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        offset = self.size
        pad = (-len(raw)) % 4
        self.parts.append(raw + b"\0" * pad)
        self.size += len(raw) + pad
        return offset


def blob_name(name: str) -> bytes:
    """A tensor's or layer's name as the blob stores it (SPEC "Model blob").

    A name of at most 31 UTF-8 bytes is kept. A longer one (converters write names of
    hundreds of bytes) becomes its first bytes, cut to 22 at a character boundary, ``~``
    and the 8 hex digits of the CRC-32 of the whole name: 31 bytes, readable, and the same
    on every machine.

    Raises:
        BlobError: the name holds a NUL byte.
    """
    raw = name.encode()
    if b"\0" in raw:
        raise BlobError(f"name {name!r} holds a NUL byte")
    if len(raw) < MAX_NAME:
        return raw
    head = raw[:_NAME_HEAD].decode("utf-8", errors="ignore").encode()
    return head + b"~" + f"{zlib.crc32(raw):08x}".encode()


_NAME_HEAD: Final = MAX_NAME - 1 - 9  # bytes of the name kept before "~" and the CRC


def _f32_bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


@dataclass
class _Source:
    """What an encoding needs, whichever object it came from."""

    model: Model
    qmodel: QuantModel | None
    trainable: list[str]
    weights: Mapping[str, npt.NDArray[np.generic]]  # current weights per layer (int8 or float32)
    biases: Mapping[str, npt.NDArray[np.generic]]


def _source(
    obj: Workload | QuantModel | Model, state: TrainState | None, trainable: Sequence[str] | None
) -> _Source:
    from qsched.zo.workload import Workload

    if isinstance(obj, Workload):
        st = state if state is not None else obj.initial_state()
        exported: QuantModel | Model = (
            obj.to_quant_model(st) if obj.qmodel is not None else obj.to_model(st)
        )
        return _source(exported, None, obj.trainable_layers)
    if state is not None:
        raise BlobError("a state can only be given with a Workload")
    if isinstance(obj, QuantModel):
        model, qmodel = obj.model, obj
        weights = {n: layer.weight for n, layer in obj.layers.items()}
        biases = {n: layer.bias for n, layer in obj.layers.items()}
    else:
        model, qmodel = obj, None
        weights = {n.name: np.asarray(n.weight, np.float32) for n in obj.param_nodes()}
        biases = {n.name: np.asarray(n.bias, np.float32) for n in obj.param_nodes()}
    names = [n.name for n in model.param_nodes()]
    chosen = names if trainable is None else [n for n in names if n in set(trainable)]
    return _Source(model, qmodel, chosen, weights, biases)


def encode_blob(
    obj: Workload | QuantModel | Model,
    *,
    state: TrainState | None = None,
    trainable: Sequence[str] | None = None,
    single_rounding: bool = SINGLE_ROUNDING,
) -> bytes:
    """Encode a model (INT8 from a QuantModel, FP32 from a Model) as a model blob.

    Args:
        obj: a Workload (its model, trainable layers and, with ``state``, its current
            weights), a QuantModel or a Model.
        state: the weights to ship (Workload only; default its initial state).
        trainable: trainable layers (QuantModel/Model only; default all).
        single_rounding: the requantisation variant the boards must use.

    Returns:
        The blob.

    Raises:
        BlobError: a limit of the format is exceeded.
    """
    src = _source(obj, state, trainable)
    shapes = infer_shapes(src.model)
    tensor_names = [src.model.input_name, *[n.output for n in src.model.nodes]]
    if len(set(tensor_names)) != len(tensor_names):
        raise BlobError("tensor names must be unique")
    for kind, names in (("tensor", tensor_names), ("layer", [n.name for n in src.model.nodes])):
        stored = [blob_name(n) for n in names]
        if len(set(stored)) != len(stored):
            raise BlobError(f"two {kind} names are the same once shortened to {MAX_NAME - 1} bytes")
    if len(tensor_names) > MAX_TENSORS or len(src.model.nodes) > MAX_OPS:
        raise BlobError(
            f"model has {len(tensor_names)} tensors / {len(src.model.nodes)} ops; "
            f"limits {MAX_TENSORS}/{MAX_OPS}"
        )
    index = {name: i for i, name in enumerate(tensor_names)}
    tensors = b"".join(_tensor_record(name, shapes[name], src.qmodel) for name in tensor_names)
    data = _Data()
    ops: list[bytes] = []
    flat = 0
    for node in src.model.nodes:
        record, flat = _op_record(node, src, index, shapes, data, flat)
        ops.append(record)
    body = _table_bytes(src) + tensors + b"".join(ops) + b"".join(data.parts)
    numerics = NUMERICS_INT8 if src.qmodel is not None else NUMERICS_FP32
    scale = src.qmodel.tensors[src.model.output_name].scale if src.qmodel is not None else 0.0
    header = _HEADER.pack(
        BLOB_MAGIC,
        BLOB_VERSION,
        numerics,
        FLAG_SINGLE_ROUNDING if single_rounding else 0,
        len(tensor_names),
        len(src.model.nodes),
        index[src.model.input_name],
        index[src.model.output_name],
        src.model.num_classes,
        flat,
        data.size,
        zlib.crc32(body),
        _f32_bits(scale) if src.qmodel is not None else 0,
        intloss.scale_q24(scale) if src.qmodel is not None else 0,
    )
    return header + body


def _table_bytes(src: _Source) -> bytes:
    if src.qmodel is None:
        return bytes(_TABLE.size)
    table = intloss.exp_table(src.qmodel.tensors[src.model.output_name].scale)
    return _TABLE.pack(*(int(v) for v in table))


def _tensor_record(name: str, shape: tuple[int, ...], qmodel: QuantModel | None) -> bytes:
    if not 1 <= len(shape) <= MAX_RANK or any(not 0 < d < 65536 for d in shape):
        raise BlobError(f"tensor {name!r}: shape {shape} outside the format's limits")
    dims = (*shape, *([0] * (MAX_RANK - len(shape))))
    if qmodel is None:
        return _TENSOR.pack(blob_name(name), len(shape), DTYPE_FP32, 0, *dims, 0, 0.0, 0)
    tq = qmodel.tensors.get(name)
    if tq is None:
        raise BlobError(f"tensor {name!r} has no quantisation parameters")
    return _TENSOR.pack(
        blob_name(name),
        len(shape),
        DTYPE_INT8,
        0,
        *dims,
        0,
        float(np.float32(tq.scale)),
        int(tq.zero_point),
    )


def _op_record(
    node: Node,
    src: _Source,
    index: dict[str, int],
    shapes: Mapping[str, tuple[int, ...]],
    data: _Data,
    flat: int,
) -> tuple[bytes, int]:
    """One op record; appends the op's arrays to ``data``; returns the next flat offset."""
    opcode = (
        OPCODE_DEPTHWISE if isinstance(node, Conv2D) and node.depthwise else OPCODES[type(node)]
    )
    activation: Activation = getattr(node, "activation", "none")
    padding: Padding = getattr(node, "padding", "valid")
    ins = [index[t] for t in node.inputs] + [NO_TENSOR]
    window = stride = (0, 0)
    groups = 0
    if isinstance(node, (AvgPool, MaxPool)):
        window, stride = node.pool, node.stride
    if isinstance(node, Conv2D):
        window, stride, groups = (
            (int(node.weight.shape[1]), int(node.weight.shape[2])),
            node.stride,
            node.groups,
        )
    act_min, act_max, in_zp, out_zp, in1_zp = -128, 127, 0, 0, 0
    aux = [0] * 7
    arrays = [NO_OFFSET] * 5 + [0]  # weight, bias, multipliers, shifts, weight scales; channels
    w_dims = [0, 0, 0, 0]
    w_count = 0
    trainable = node.name in src.trainable
    param_offset = NO_OFFSET
    q = src.qmodel
    if q is not None:
        inp, out = q.tensors[node.inputs[0]], q.tensors[node.output]
        in_zp, out_zp = int(inp.zero_point), int(out.zero_point)
        act_min, act_max, aux, in1_zp = _int8_params(node, q, inp, out, aux, shapes)
    aux = _shape_aux(node, aux)
    if isinstance(node, (Conv2D, Dense)):
        weight, bias = src.weights[node.name], src.biases[node.name]
        w_dims = [*weight.shape, *([0] * (4 - weight.ndim))]
        w_count = int(weight.size)
        arrays[0] = data.add(weight.astype(np.int8 if q is not None else np.float32))
        arrays[1] = data.add(bias.astype(np.int32 if q is not None else np.float32))
        arrays[5] = int(bias.shape[0])
        if q is not None:
            stage = ki.prepare_output_stage(
                q.tensors[node.inputs[0]],
                q.layers[node.name].weight_scales,
                q.tensors[node.output],
                node.activation,
            )
            arrays[2] = data.add(stage.multiplier.astype(np.int32))
            arrays[3] = data.add(stage.shift.astype(np.int32))
            arrays[4] = data.add(np.asarray(q.layers[node.name].weight_scales, dtype=np.float32))
        if trainable:
            param_offset = flat
            flat += w_count + (0 if q is not None else int(bias.size))
    elif isinstance(node, TABLE_NODES) and q is not None:
        # The int8 function as its 256 values: a board looks them up (zo.lookup).
        table = unary_table(node, q.tensors[node.inputs[0]], q.tensors[node.output])
        arrays[0], w_count = data.add(table), TABLE_SIZE
    record = _OP.pack(
        blob_name(node.name),
        opcode,
        ACTIVATIONS[activation],
        PADDINGS[padding],
        OP_TRAINABLE if trainable else 0,
        ins[0],
        ins[1],
        index[node.output],
        0,
        *window,
        *stride,
        groups,
        0,
        act_min,
        act_max,
        in_zp,
        out_zp,
        *w_dims,
        *arrays[:5],
        w_count,
        arrays[5],
        param_offset,
        *aux,
        in1_zp,
    )
    return record, flat


def _shape_aux(node: Node, aux: list[int]) -> list[int]:
    """The aux words that describe a MEAN's or PAD's shape or a MUL's constant, in both
    numerics."""
    if isinstance(node, Mean):
        return [*aux[:2], int(node.keep_dims), 0, 0, 0, 0]
    if isinstance(node, Pad):
        (top, bottom), (left, right) = node.pads
        return [top, bottom, left, right, 0, 0, 0]
    if isinstance(node, MulConstant):
        bits = struct.unpack("<i", struct.pack("<f", node.constant_scale))[0]
        return [node.constant, node.constant_zero_point, bits, 0, 0, 0, 0]
    return aux


def _int8_params(
    node: Node,
    q: QuantModel,
    inp: TensorQuant,
    out: TensorQuant,
    aux: list[int],
    shapes: Mapping[str, tuple[int, ...]],
) -> tuple[int, int, list[int], int]:
    """Clamp range, auxiliary multipliers (ADD, RELU) and the second input's zero point."""
    activation: Activation = getattr(node, "activation", "none")
    lo, hi = ki.activation_range(activation, out)
    if isinstance(node, Add):
        p = ki.prepare_add(inp, q.tensors[node.inputs[1]], out, node.activation)
        aux = [
            p.left_shift,
            p.in1_multiplier,
            p.in1_shift,
            p.in2_multiplier,
            p.in2_shift,
            p.out_multiplier,
            p.out_shift,
        ]
        return p.act_min, p.act_max, aux, p.in2_zero_point
    if isinstance(node, (ReLU, ReLU6)):
        stage = ki.prepare_relu(inp, out, isinstance(node, ReLU6))
        return (
            stage.act_min,
            stage.act_max,
            [int(stage.multiplier[0]), int(stage.shift[0]), 0, 0, 0, 0, 0],
            0,
        )
    if isinstance(node, Concat):
        return lo, hi, aux, int(q.tensors[node.inputs[1]].zero_point)
    if isinstance(node, Mul):
        mul = ki.prepare_mul(inp, q.tensors[node.inputs[1]], out, node.activation)
        return (
            mul.act_min,
            mul.act_max,
            [mul.multiplier, mul.shift, 0, 0, 0, 0, 0],
            mul.b_zero_point,
        )
    if isinstance(node, Mean):
        h, w = shapes[node.inputs[0]][:2]
        mean = ki.prepare_mean(inp, out, h * w)
        return lo, hi, [mean.multiplier, mean.shift, 0, 0, 0, 0, 0], 0
    return lo, hi, aux, 0


# --------------------------------------------------------------------------- decoding


def _check_header(blob: bytes) -> tuple[int, ...]:
    if len(blob) < _HEADER.size + _TABLE.size:
        raise BlobError("model blob: truncated header")
    fields = _HEADER.unpack_from(blob)
    magic, version = fields[0], fields[1]
    if magic != BLOB_MAGIC or version != BLOB_VERSION:
        raise BlobError(f"model blob: bad magic {magic!r} or version {version}")
    n_tensors, n_ops, data_size, crc = fields[4], fields[5], fields[10], fields[11]
    if n_tensors > MAX_TENSORS or n_ops > MAX_OPS:
        raise BlobError(f"model blob: {n_tensors} tensors / {n_ops} ops exceed the limits")
    expected = _HEADER.size + _TABLE.size + n_tensors * _TENSOR.size + n_ops * _OP.size + data_size
    if len(blob) != expected:
        raise BlobError(f"model blob: {len(blob)} bytes, header says {expected}")
    if zlib.crc32(blob[_HEADER.size :]) != crc:
        raise BlobError("model blob: CRC mismatch")
    return tuple(fields)


def _read(data: bytes, offset: int, dtype: type[np.generic], count: int) -> npt.NDArray[np.generic]:
    end = offset + count * np.dtype(dtype).itemsize
    if offset % 4 or end > len(data):
        raise BlobError(f"model blob: array at {offset} (+{count}) outside the data section")
    return np.frombuffer(
        data, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=offset
    ).astype(dtype)


def decode_blob(blob: bytes) -> QuantModel | Model:
    """Parse a model blob back into a QuantModel (INT8) or a Model (FP32).

    INT8 float weights of the returned graph are the dequantised int8 weights.

    Args:
        blob: bytes from :func:`encode_blob`.

    Returns:
        The model.

    Raises:
        BlobError: malformed bytes.
    """
    fields = _check_header(blob)
    numerics, n_tensors, n_ops, in_idx, out_idx, num_classes = (
        fields[2],
        fields[4],
        fields[5],
        fields[6],
        fields[7],
        fields[8],
    )
    if numerics not in (NUMERICS_INT8, NUMERICS_FP32):
        raise BlobError(f"model blob: unknown numerics {numerics}")
    int8 = numerics == NUMERICS_INT8
    pos = _HEADER.size + _TABLE.size
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    quants: list[TensorQuant] = []
    for _ in range(n_tensors):
        raw, rank, _dtype, _r, d0, d1, d2, _r2, scale, zp = _TENSOR.unpack_from(blob, pos)
        pos += _TENSOR.size
        names.append(raw.rstrip(b"\0").decode())
        shapes.append((d0, d1, d2)[:rank])
        quants.append(TensorQuant(scale=float(scale), zero_point=int(zp)))
    data = blob[pos + n_ops * _OP.size :]
    nodes: list[Node] = []
    layers: dict[str, QuantizedLayer] = {}
    for _ in range(n_ops):
        node, layer = _decode_op(
            _OpFields(*_OP.unpack_from(blob, pos)), names, shapes, quants, data, int8
        )
        pos += _OP.size
        nodes.append(node)
        if layer is not None:
            layers[node.name] = layer
    if not (in_idx < n_tensors and out_idx < n_tensors):
        raise BlobError("model blob: input/output tensor index out of range")
    model = Model(
        name="blob",
        input_name=names[in_idx],
        input_shape=shapes[in_idx],
        nodes=nodes,
        output_name=names[out_idx],
        num_classes=int(num_classes),
    )
    if not int8:
        return model
    return QuantModel(model=model, tensors=dict(zip(names, quants, strict=True)), layers=layers)


def trainable_layers(blob: bytes) -> list[str]:
    """Names of the ops a model blob marks trainable, in model order.

    Args:
        blob: a model blob.

    Returns:
        The trainable layer names.

    Raises:
        BlobError: the blob's header, sizes or CRC are wrong.
    """
    header = _check_header(blob)
    n_tensors, n_ops = header[4], header[5]
    start = _HEADER.size + _TABLE.size + n_tensors * _TENSOR.size
    records = (_OpFields._make(_OP.unpack_from(blob, start + i * _OP.size)) for i in range(n_ops))
    return [record.name.rstrip(b"\0").decode() for record in records if record.flags & OP_TRAINABLE]


class _OpFields(NamedTuple):
    """One op record, field by field (SPEC "Model blob", op record table)."""

    name: bytes
    opcode: int
    activation: int
    padding: int
    flags: int
    in0: int
    in1: int
    out: int
    reserved0: int
    window_h: int
    window_w: int
    stride_h: int
    stride_w: int
    groups: int
    reserved1: int
    act_min: int
    act_max: int
    in_zp: int
    out_zp: int
    w_d0: int
    w_d1: int
    w_d2: int
    w_d3: int
    weight_offset: int
    bias_offset: int
    multiplier_offset: int
    shift_offset: int
    scales_offset: int
    weight_count: int
    channels: int
    param_offset: int
    aux0: int
    aux1: int
    aux2: int
    aux3: int
    aux4: int
    aux5: int
    aux6: int
    in1_zp: int


def _tensor_name(names: list[str], i: int, op: str) -> str:
    if i >= len(names):
        raise BlobError(f"model blob: op {op!r} refers to tensor {i} of {len(names)}")
    return names[i]


def _decode_op(
    f: _OpFields,
    names: list[str],
    shapes: list[tuple[int, ...]],
    quants: list[TensorQuant],
    data: bytes,
    int8: bool,
) -> tuple[Node, QuantizedLayer | None]:
    name = f.name.rstrip(b"\0").decode()
    inputs = [_tensor_name(names, f.in0, name)] + (
        [_tensor_name(names, f.in1, name)] if f.in1 != NO_TENSOR else []
    )
    output = _tensor_name(names, f.out, name)
    activation = cast(Activation, _key(ACTIVATIONS, f.activation, "activation"))
    padding = cast(Padding, _key(PADDINGS, f.padding, "padding"))
    window, stride = (f.window_h, f.window_w), (f.stride_h, f.stride_w)
    if f.opcode in (OPCODES[Conv2D], OPCODE_DEPTHWISE, OPCODES[Dense]):
        weight, bias, layer = _decode_weights(f, quants, data, int8)
        if f.opcode == OPCODES[Dense]:
            return Dense(name, inputs, output, weight, bias, activation), layer
        depthwise = f.opcode == OPCODE_DEPTHWISE
        return Conv2D(
            name, inputs, output, weight, bias, stride, padding, f.groups, depthwise, activation
        ), layer
    simple: dict[int, Node] = {
        OPCODES[ReLU]: ReLU(name, inputs, output),
        OPCODES[ReLU6]: ReLU6(name, inputs, output),
        OPCODES[Add]: Add(name, inputs, output, activation),
        OPCODES[AvgPool]: AvgPool(name, inputs, output, window, stride, padding),
        OPCODES[MaxPool]: MaxPool(name, inputs, output, window, stride, padding),
        OPCODES[GlobalAvgPool]: GlobalAvgPool(name, inputs, output),
        OPCODES[Reshape]: Reshape(name, inputs, output, shapes[f.out]),
        OPCODES[Mean]: Mean(name, inputs, output, keep_dims=bool(f.aux2)),
        OPCODES[Concat]: Concat(name, inputs, output),
        OPCODES[Mul]: Mul(name, inputs, output, activation),
        OPCODES[Pad]: Pad(name, inputs, output, pads=((f.aux0, f.aux1), (f.aux2, f.aux3))),
        OPCODES[Logistic]: Logistic(name, inputs, output),
        OPCODES[HardSwish]: HardSwish(name, inputs, output),
        OPCODES[MulConstant]: MulConstant(
            name,
            inputs,
            output,
            constant=f.aux0,
            constant_scale=struct.unpack("<f", struct.pack("<i", f.aux2))[0],
            constant_zero_point=f.aux1,
            activation=activation,
        ),
    }
    if f.opcode not in simple:
        raise BlobError(f"model blob: op {name!r} has unknown opcode {f.opcode}")
    node = simple[f.opcode]
    if isinstance(node, MulConstant) and not all(-128 <= v <= 127 for v in (f.aux0, f.aux1)):
        raise BlobError(f"model blob: op {name!r}: constant or zero point outside int8")
    if int8 and isinstance(node, TABLE_NODES):
        _check_table(node, f, quants, data)
    return node, None


def _check_table(node: TableNode, f: _OpFields, quants: list[TensorQuant], data: bytes) -> None:
    """A table op's 256 bytes must be its function of its tensors' parameters: a Python
    board computes them, a C board reads them, and both must give the same bits."""
    if f.weight_count != TABLE_SIZE:
        raise BlobError(f"model blob: op {node.name!r} needs a {TABLE_SIZE}-entry table")
    table = _read(data, f.weight_offset, np.int8, TABLE_SIZE)
    try:
        expected = unary_table(node, quants[f.in0], quants[f.out])
    except ValueError as exc:
        raise BlobError(f"model blob: op {node.name!r}: {exc}") from None
    if not np.array_equal(table, expected):
        raise BlobError(f"model blob: op {node.name!r}: table differs from its parameters'")


def _decode_weights(
    f: _OpFields, quants: list[TensorQuant], data: bytes, int8: bool
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], QuantizedLayer | None]:
    """Float weights and biases of a conv/dense op, and its QuantizedLayer in INT8 mode."""
    dims = [d for d in (f.w_d0, f.w_d1, f.w_d2, f.w_d3) if d]
    if int(np.prod(dims)) != f.weight_count:
        raise BlobError(f"model blob: weight dims {dims} do not hold {f.weight_count} values")
    if not int8:
        w_f32 = (
            _read(data, f.weight_offset, np.float32, f.weight_count)
            .reshape(dims)
            .astype(np.float32)
        )
        return w_f32, _read(data, f.bias_offset, np.float32, f.channels).astype(np.float32), None
    wq = _read(data, f.weight_offset, np.int8, f.weight_count).reshape(dims).astype(np.int8)
    bq = _read(data, f.bias_offset, np.int32, f.channels).astype(np.int32)
    scales = _read(data, f.scales_offset, np.float32, f.channels).astype(np.float32)
    _read(data, f.multiplier_offset, np.int32, f.channels)  # present and in bounds
    _read(data, f.shift_offset, np.int32, f.channels)
    axis = wq.ndim - 1 if f.opcode == OPCODE_DEPTHWISE else 0
    shape = [1] * wq.ndim
    shape[axis] = -1
    weight = (wq.astype(np.float32) * scales.reshape(shape)).astype(np.float32)
    in_scale = float(np.float32(quants[f.in0].scale))
    bias = (bq.astype(np.float64) * in_scale * scales.astype(np.float64)).astype(np.float32)
    return weight, bias, QuantizedLayer(weight=wq, weight_scales=scales, bias=bq)


def _key(table: dict[str, int], code: int, what: str) -> str:
    for key, value in table.items():
        if value == code:
            return key
    raise BlobError(f"model blob: unknown {what} code {code}")


# --------------------------------------------------------------------------- dataset blob


@dataclass(frozen=True)
class DatasetBlob:
    """A decoded dataset blob: int8 inputs, uint8 labels, and what identifies them."""

    x_train: npt.NDArray[np.int8]
    y_train: npt.NDArray[np.uint8]
    x_val: npt.NDArray[np.int8]
    y_val: npt.NDArray[np.uint8]
    num_classes: int
    input_scale: float
    input_zero_point: int
    content_hash: str


def encode_dataset_blob(dataset: Dataset, qmodel: QuantModel) -> bytes:
    """Quantise a data set with the model's input parameters and pack it for a C board.

    Args:
        dataset: the data set.
        qmodel: the INT8 model whose input quantisation applies.

    Returns:
        header (72 B) | x_train | y_train | x_val | y_val, each padded to 4 bytes.
    """
    from qsched.zo.quantize import quantize_input

    shape = dataset.input_shape
    if not 1 <= len(shape) <= MAX_RANK or dataset.num_classes > 256:
        raise BlobError(
            f"data set {dataset.name!r}: shape {shape} / {dataset.num_classes} classes "
            "outside the limits"
        )
    tq = qmodel.tensors[qmodel.model.input_name]
    dims = (*shape, *([0] * (MAX_RANK - len(shape))))
    header = _DATASET_HEADER.pack(
        DATASET_MAGIC,
        DATASET_VERSION,
        len(shape),
        len(dataset.x_train),
        len(dataset.x_val),
        int(np.prod(shape)),
        dataset.num_classes,
        0,
        *dims,
        0,
        float(np.float32(tq.scale)),
        int(tq.zero_point),
        bytes.fromhex(dataset.content_hash),
    )
    data = _Data()
    for array in (
        quantize_input(qmodel, dataset.x_train),
        dataset.y_train.astype(np.uint8),
        quantize_input(qmodel, dataset.x_val),
        dataset.y_val.astype(np.uint8),
    ):
        data.add(np.asarray(array))
    return header + b"".join(data.parts)


def decode_dataset_blob(blob: bytes) -> DatasetBlob:
    """Parse :func:`encode_dataset_blob` output.

    Args:
        blob: the bytes.

    Returns:
        The arrays and metadata.

    Raises:
        BlobError: malformed bytes.
    """
    if len(blob) < _DATASET_HEADER.size:
        raise BlobError("dataset blob: truncated header")
    f = _DATASET_HEADER.unpack_from(blob)
    if f[0] != DATASET_MAGIC or f[1] != DATASET_VERSION:
        raise BlobError(f"dataset blob: bad magic {f[0]!r} or version {f[1]}")
    rank, n_train, n_val, sample, classes = f[2], f[3], f[4], f[5], f[6]
    shape = tuple(f[8:11])[:rank]
    if int(np.prod(shape)) != sample:
        raise BlobError("dataset blob: sample size does not match the shape")
    sizes = [n_train * sample, n_train, n_val * sample, n_val]
    padded = [s + (-s) % 4 for s in sizes]
    if len(blob) != _DATASET_HEADER.size + sum(padded):
        raise BlobError("dataset blob: length does not match the header")
    pos = _DATASET_HEADER.size
    out = []
    for size, pad, dtype in zip(sizes, padded, (np.int8, np.uint8, np.int8, np.uint8), strict=True):
        out.append(np.frombuffer(blob, dtype=dtype, count=size, offset=pos).copy())
        pos += pad
    return DatasetBlob(
        x_train=out[0].reshape(n_train, *shape).astype(np.int8),
        y_train=out[1].astype(np.uint8),
        x_val=out[2].reshape(n_val, *shape).astype(np.int8),
        y_val=out[3].astype(np.uint8),
        num_classes=int(classes),
        input_scale=float(f[12]),
        input_zero_point=int(f[13]),
        content_hash=bytes(f[14]).hex(),
    )
