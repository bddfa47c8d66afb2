"""Model and dataset blobs: exact round trips, precomputed requantisation, damage detection."""

from __future__ import annotations

import copy
import struct
import zlib

import numpy as np
import pytest

from qsched.protocol.jobspec import JobSpec
from qsched.zo import engine
from qsched.zo import kernels_int8 as ki
from qsched.zo.blob import (
    BlobError,
    blob_name,
    decode_blob,
    decode_dataset_blob,
    encode_blob,
    encode_dataset_blob,
)
from qsched.zo.graph import (
    AvgPool,
    Conv2D,
    Dense,
    HardSwish,
    Logistic,
    MaxPool,
    Model,
    MulConstant,
    QuantModel,
    ReLU,
    ReLU6,
    Reshape,
)
from qsched.zo.lookup import unary_table
from qsched.zo.quantize import quantize_input, quantize_model
from qsched.zo.workload import Workload
from qsched.zo.zoo import build_model


def _every_op_model() -> Model:
    rng = np.random.default_rng(3)
    nodes = [
        Conv2D(
            "conv",
            ["input"],
            "conv",
            rng.normal(0, 0.3, (4, 3, 3, 1)).astype(np.float32),
            rng.normal(0, 0.1, 4).astype(np.float32),
        ),
        ReLU("relu", ["conv"], "relu"),
        MaxPool("maxpool", ["relu"], "maxpool"),
        AvgPool("avgpool", ["maxpool"], "avgpool", (2, 2), (1, 1), "same"),
        ReLU6("relu6", ["avgpool"], "relu6"),
        Reshape("flatten", ["relu6"], "flatten", (64,)),
        Dense(
            "dense",
            ["flatten"],
            "dense",
            rng.normal(0, 0.2, (10, 64)).astype(np.float32),
            np.zeros(10, np.float32),
        ),
    ]
    return Model("every_op", "input", (8, 8, 1), nodes, "dense", 10)


def _models() -> list[tuple[str, QuantModel, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for name, model in (
        ("every_op", _every_op_model()),
        ("resnet8", build_model("resnet8", (16, 16, 3), 10, seed=1)),
        ("mobilenetv2", build_model("mobilenetv2", (16, 16, 3), 10, seed=1)),
    ):
        x = rng.random((6, *model.input_shape), dtype=np.float32)
        out.append((name, quantize_model(model, x), x))
    return out


_MODELS = _models()


@pytest.mark.parametrize(("name", "qmodel", "x"), _MODELS, ids=[m[0] for m in _MODELS])
def test_blob_int8_round_trip_evaluates_identically(
    name: str, qmodel: QuantModel, x: np.ndarray
) -> None:
    """decode(encode(q)) re-encodes to the same bytes and gives the same int8 logits."""
    blob = encode_blob(qmodel)
    back = decode_blob(blob)
    assert isinstance(back, QuantModel)
    assert encode_blob(back) == blob
    x_q = quantize_input(qmodel, x)
    assert np.array_equal(engine.run_int8(back, x_q), engine.run_int8(qmodel, x_q)), name


def test_blob_fp32_round_trip() -> None:
    """An FP32 model round-trips with float32 weights and identical outputs."""
    model = build_model("cnn", (8, 8, 1), 10, seed=2)
    blob = encode_blob(model)
    back = decode_blob(blob)
    assert isinstance(back, Model) and encode_blob(back) == blob
    x = np.random.default_rng(1).random((5, 8, 8, 1), dtype=np.float32)
    assert np.array_equal(engine.run_fp32(back, x), engine.run_fp32(model, x))


def test_blob_carries_precomputed_requantisation() -> None:
    """The op records hold the per-channel multipliers and shifts the engine computes."""
    qmodel = quantize_model(
        _every_op_model(), np.random.default_rng(0).random((4, 8, 8, 1), dtype=np.float32)
    )
    blob = encode_blob(qmodel)
    header = struct.unpack_from("<4sHBBHHHHIIIIII", blob)
    n_tensors, n_ops = header[4], header[5]
    ops_at = 64 + 1024 + n_tensors * 52
    data_at = ops_at + n_ops * 140
    record = struct.unpack_from("<32sBBBBHHHH6Hhhii4H8I7ii", blob, ops_at)  # the conv
    assert record[0].rstrip(b"\0") == b"conv"
    mult_off, shift_off, channels = record[25], record[26], record[29]
    mult = np.frombuffer(blob, "<i4", channels, data_at + mult_off)
    shift = np.frombuffer(blob, "<i4", channels, data_at + shift_off)
    stage = ki.prepare_output_stage(
        qmodel.tensors["input"], qmodel.layers["conv"].weight_scales, qmodel.tensors["conv"], "none"
    )
    assert mult.tolist() == stage.multiplier.tolist() and shift.tolist() == stage.shift.tolist()


def test_blob_workload_state_and_trainable_offsets() -> None:
    """A workload's blob ships the given state's weights and marks trainable layers."""
    wl = Workload.from_spec(JobSpec(trainable="last:1", batch_size=8))
    state = wl.apply_update(wl.initial_state(), 0, [(0, 50.0)])
    back = decode_blob(encode_blob(wl, state=state))
    assert isinstance(back, QuantModel)
    assert np.array_equal(back.layers["dense_2"].weight.ravel(), state.params)
    header = struct.unpack_from("<4sHBBHHHHIIIIII", encode_blob(wl))
    assert header[9] == wl.num_params


def test_blob_rejects_damage() -> None:
    """A flipped byte, a truncation or a bad magic is a BlobError."""
    blob = Workload.from_spec(JobSpec(batch_size=8)).model_blob()
    flipped = bytearray(blob)
    flipped[-3] ^= 0x40
    for bad in (bytes(flipped), blob[:-4], b"ZZZZ" + blob[4:], blob[:10]):
        with pytest.raises(BlobError):
            decode_blob(bad)


def _long_named(model: Model) -> Model:
    """The model with converter-style names: hundreds of bytes, alike for 40 of them."""
    renamed = {model.input_name: model.input_name}
    for node in model.nodes:
        long = f"model/{'é' * 20}/{node.name}/" + "x" * 500
        renamed[node.output] = long
        node.inputs = [renamed[i] for i in node.inputs]
        node.name, node.output = long, long
    model.output_name = renamed[model.output_name]
    return model


def test_blob_shortens_long_names_deterministically() -> None:
    """Names over 31 bytes are stored as a head, '~' and their CRC-32: unique, readable
    UTF-8, and the decoded model evaluates as the original."""
    qmodel = _MODELS[0][1]
    long = QuantModel(
        model=_long_named(copy.deepcopy(qmodel.model)),
        tensors={},
        layers={},
    )
    renamed = dict(
        zip(
            [n.output for n in qmodel.model.nodes],
            [n.output for n in long.model.nodes],
            strict=True,
        )
    )
    long.tensors = {renamed.get(k, k): v for k, v in qmodel.tensors.items()}
    long.layers = {renamed[k]: v for k, v in qmodel.layers.items()}
    blob = encode_blob(long)
    back = decode_blob(blob)
    assert isinstance(back, QuantModel) and encode_blob(back) == blob
    names = [n.name for n in back.model.nodes]
    assert len(set(names)) == len(names) and all(len(n.encode()) <= 31 for n in names)
    assert names[0] == blob_name(long.model.nodes[0].name).decode() and "~" in names[0]
    x_q = quantize_input(qmodel, _MODELS[0][2])
    assert np.array_equal(engine.run_int8(back, x_q), engine.run_int8(qmodel, x_q))


def test_blob_name_rules() -> None:
    """Short names are kept; long ones are cut at a character boundary; NUL is refused."""
    assert blob_name("conv") == b"conv" and blob_name("x" * 31) == b"x" * 31
    cut = blob_name("é" * 40)
    assert len(cut) == 31 and cut.decode().startswith("é" * 11) and cut.count(b"~") == 1
    assert blob_name("a" * 40) != blob_name("a" * 41)
    with pytest.raises(BlobError, match="NUL"):
        blob_name("a\0b")


def test_dataset_blob_round_trip() -> None:
    """The dataset blob holds quantised inputs and labels, with the data set's hash."""
    wl = Workload.from_spec(JobSpec(batch_size=8))
    assert wl.qmodel is not None
    blob = encode_dataset_blob(wl.dataset, wl.qmodel)
    back = decode_dataset_blob(blob)
    assert back.content_hash == wl.dataset.content_hash
    assert np.array_equal(back.x_train, quantize_input(wl.qmodel, wl.dataset.x_train))
    assert np.array_equal(back.y_val, wl.dataset.y_val.astype(np.uint8))
    assert back.num_classes == 10 and back.x_val.shape == wl.dataset.x_val.shape
    with pytest.raises(BlobError):
        decode_dataset_blob(blob[:-1])


def test_blob_carries_mean_and_pad() -> None:
    """MEAN (with its folded multiplier) and PAD travel in the blob; the decoded model
    evaluates as the original, in INT8 and FP32."""
    from test_zo_tflite_litert import _mean_pad_model

    for keep_dims in (False, True):
        model = _mean_pad_model(keep_dims, 3)
        x = np.random.default_rng(0).normal(size=(4, 9, 9, 3)).astype(np.float32)
        qmodel = quantize_model(model, x)
        back = decode_blob(encode_blob(qmodel))
        assert isinstance(back, QuantModel)
        assert [type(n).__name__ for n in back.model.nodes] == [
            type(n).__name__ for n in model.nodes
        ]
        x_q = quantize_input(qmodel, x)
        assert np.array_equal(engine.run_int8(back, x_q), engine.run_int8(qmodel, x_q))
        fp32 = decode_blob(encode_blob(model))
        assert np.array_equal(engine.run_fp32(fp32, x), engine.run_fp32(model, x))


def test_blob_carries_logistic_and_hard_swish_tables() -> None:
    """LOGISTIC, HARD_SWISH and MUL by a constant travel as 256-byte tables: the decoded
    model evaluates as the original (INT8 and FP32), and a table that is not its
    parameters' is refused."""
    rng = np.random.default_rng(4)
    conv_w = rng.normal(0, 0.6, (4, 3, 3, 1)).astype(np.float32)
    nodes = [
        Conv2D("conv", ["input"], "conv", conv_w, rng.normal(0, 0.2, 4).astype(np.float32)),
        HardSwish("hswish", ["conv"], "hswish"),
        Logistic("sigmoid", ["hswish"], "sigmoid"),
        MulConstant("sixth", ["sigmoid"], "sixth", constant=-90, constant_scale=0.002,
                    constant_zero_point=-128, activation="relu"),
        Reshape("flatten", ["sixth"], "flatten", (256,)),
        Dense("dense", ["flatten"], "dense", rng.normal(0, 0.1, (10, 256)).astype(np.float32),
              np.zeros(10, np.float32)),
    ]  # fmt: skip
    model = Model("tables", "input", (8, 8, 1), nodes, "dense", 10)
    x = rng.normal(0, 2, (6, 8, 8, 1)).astype(np.float32)
    qmodel = quantize_model(model, x)
    blob = encode_blob(qmodel)
    back = decode_blob(blob)
    assert isinstance(back, QuantModel)
    x_q = quantize_input(qmodel, x)
    assert np.array_equal(engine.run_int8(back, x_q), engine.run_int8(qmodel, x_q))
    fp32 = decode_blob(encode_blob(model))
    assert np.array_equal(engine.run_fp32(fp32, x), engine.run_fp32(model, x))
    table = unary_table(nodes[2], qmodel.tensors["hswish"], qmodel.tensors["sigmoid"])
    at = blob.find(table.tobytes())
    assert at > 0
    damaged = bytearray(blob)
    damaged[at + 7] ^= 1
    with pytest.raises(BlobError, match="table differs"):
        decode_blob(_with_body_crc(damaged))
    # The MUL's constant (aux word 0 of its op record) past int8: refused, typed.
    record = blob.rfind(b"sixth".ljust(32, b"\0"))  # the op record, after the tensors
    damaged = bytearray(blob)
    struct.pack_into("<i", damaged, record + 108, 300)
    with pytest.raises(BlobError, match="outside int8"):
        decode_blob(_with_body_crc(damaged))


def _with_body_crc(blob: bytearray) -> bytes:
    """The blob with its header's CRC of the body recomputed (damage that passes it)."""
    header = struct.Struct("<4sHBBHHHHIIIIII24x")
    fields = list(header.unpack_from(blob))
    fields[11] = zlib.crc32(bytes(blob[header.size :]))
    header.pack_into(blob, 0, *fields)
    return bytes(blob)
