"""The .tflite writer and reader: round trip, LiteRT runs the file, typed errors."""

from __future__ import annotations

import contextlib
from pathlib import Path

import flatbuffers
import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as tfl
from ai_edge_litert.interpreter import Interpreter, OpResolverType

from qsched.zo.engine import run_int8
from qsched.zo.fixedpoint import multiply_by_quantized_multiplier, quantize_multiplier
from qsched.zo.graph import (
    Add,
    AvgPool,
    Conv2D,
    Dense,
    GlobalAvgPool,
    MaxPool,
    Model,
    QuantizedLayer,
    QuantModel,
    ReLU,
    ReLU6,
    Reshape,
    TensorQuant,
)
from qsched.zo.tflite_io import (
    TFLiteError,
    TFLiteFormatError,
    export_tflite,
    import_tflite,
    read_tflite,
    weight_tensor_name,
    write_tflite,
)

_PASS_THROUGH = (AvgPool, MaxPool, GlobalAvgPool, Reshape)


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


def _every_op_model() -> Model:
    """A small graph that uses every operator the writer knows."""
    nodes = [
        Conv2D("conv", ["input"], "conv", _zeros(8, 3, 3, 3), _zeros(8), activation="relu"),
        Conv2D(
            "dw",
            ["conv"],
            "dw",
            _zeros(1, 3, 3, 16),
            _zeros(16),
            stride=(2, 2),
            groups=8,
            depthwise=True,
            activation="relu6",
        ),
        Conv2D("pw", ["dw"], "pw", _zeros(16, 1, 1, 16), _zeros(16), padding="valid"),
        Add("add", ["pw", "dw"], "add"),
        ReLU6("relu6", ["add"], "relu6"),
        MaxPool("maxpool", ["relu6"], "maxpool"),
        ReLU("relu", ["maxpool"], "relu"),
        AvgPool("avgpool", ["relu"], "avgpool", pool=(3, 3), stride=(1, 1), padding="same"),
        Conv2D("conv2", ["avgpool"], "conv2", _zeros(16, 3, 3, 8), _zeros(16), groups=2),
        GlobalAvgPool("gap", ["conv2"], "gap"),
        Dense("fc1", ["gap"], "fc1", _zeros(12, 16), _zeros(12), activation="relu"),
        Reshape("reshape", ["fc1"], "reshape", shape=(12,)),
        Dense("fc2", ["reshape"], "logits", _zeros(10, 12), _zeros(10)),
    ]
    return Model("every_op", "input", (12, 12, 3), nodes, "logits", 10)


def _quantise_randomly(model: Model, seed: int) -> QuantModel:
    """Random int8 weights and plausible scales (pools and reshapes keep their input's)."""
    rng = np.random.default_rng(seed)
    tensors = {model.input_name: TensorQuant(float(np.float32(0.02)), -3)}
    layers = {}
    for node in model.nodes:
        if isinstance(node, _PASS_THROUGH):
            tensors[node.output] = tensors[node.inputs[0]]
            continue
        scale = float(np.float32(rng.uniform(0.02, 0.08)))
        tensors[node.output] = TensorQuant(scale, int(rng.integers(-20, 20)))
        if isinstance(node, Conv2D | Dense):
            out_ch = node.weight.shape[3 if isinstance(node, Conv2D) and node.depthwise else 0]
            layers[node.name] = QuantizedLayer(
                weight=rng.integers(-127, 128, size=node.weight.shape).astype(np.int8),
                weight_scales=rng.uniform(0.002, 0.01, size=out_ch).astype(np.float32),
                bias=rng.integers(-2000, 2000, size=out_ch).astype(np.int32),
            )
    return QuantModel(model, tensors, layers)


def _run(data: bytes, x: np.ndarray, feeds: dict[str, np.ndarray] | None = None) -> np.ndarray:
    it = Interpreter(model_content=data, experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    it.allocate_tensors()
    by_name = {d["name"]: d["index"] for d in it.get_input_details()}
    it.set_tensor(it.get_input_details()[0]["index"], x)
    for name, value in (feeds or {}).items():
        it.set_tensor(by_name[name], value)
    it.invoke()
    return np.array(it.get_tensor(it.get_output_details()[0]["index"]))


def _assert_same_model(a: QuantModel, b: QuantModel) -> None:
    ma, mb = a.model, b.model
    assert (ma.name, ma.input_name, ma.input_shape, ma.output_name, ma.num_classes) == (
        mb.name,
        mb.input_name,
        mb.input_shape,
        mb.output_name,
        mb.num_classes,
    )
    assert len(ma.nodes) == len(mb.nodes)
    for na, nb in zip(ma.nodes, mb.nodes, strict=True):
        assert type(na) is type(nb)
        skip = {"weight", "bias"}
        assert {k: v for k, v in vars(na).items() if k not in skip} == {
            k: v for k, v in vars(nb).items() if k not in skip
        }
    assert {k: (v.scale, v.zero_point) for k, v in a.tensors.items()} == {
        k: (v.scale, v.zero_point) for k, v in b.tensors.items()
    }
    assert a.layers.keys() == b.layers.keys()
    for name, la in a.layers.items():
        lb = b.layers[name]
        np.testing.assert_array_equal(la.weight, lb.weight)
        np.testing.assert_array_equal(la.weight_scales, lb.weight_scales)
        np.testing.assert_array_equal(la.bias, lb.bias)


def _repack(data: bytes, edit) -> bytes:
    """Decode a file, apply ``edit`` to its object tree, encode again."""
    model = tfl.ModelT.InitFromObj(tfl.Model.GetRootAs(data, 0))
    edit(model)
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def test_tflite_round_trip_every_op() -> None:
    """export -> import returns the same graph, int8 weights, biases and scales."""
    qm = _quantise_randomly(_every_op_model(), seed=1)
    back = import_tflite(export_tflite(qm))
    _assert_same_model(qm, back)
    again = export_tflite(back)
    assert again == export_tflite(qm)


def test_tflite_import_dequantises_float_weights() -> None:
    """Imported float weights are the int8 weights times their per-channel scales."""
    qm = _quantise_randomly(_every_op_model(), seed=2)
    back = import_tflite(export_tflite(qm))
    dw = back.model.node("dw")
    assert isinstance(dw, Conv2D)
    layer = back.layers["dw"]
    np.testing.assert_array_equal(dw.weight, layer.weight * layer.weight_scales[None, None, None])


def test_tflite_file_write_read(tmp_path: Path) -> None:
    """write_tflite leaves one complete file that read_tflite reads back."""
    qm = _quantise_randomly(_every_op_model(), seed=3)
    path = tmp_path / "model.tflite"
    write_tflite(path, qm)
    assert [p.name for p in tmp_path.iterdir()] == ["model.tflite"]
    assert path.read_bytes() == export_tflite(qm)
    _assert_same_model(qm, read_tflite(path))


def test_tflite_litert_runs_int8_in_int8_out() -> None:
    """LiteRT's reference kernels run the file; input and output are int8 with our qparams."""
    qm = _quantise_randomly(_every_op_model(), seed=4)
    it = Interpreter(
        model_content=export_tflite(qm, batch=3),
        experimental_op_resolver_type=OpResolverType.BUILTIN_REF,
    )
    it.allocate_tensors()
    (inp,), (out,) = it.get_input_details(), it.get_output_details()
    assert inp["dtype"] == np.int8 and out["dtype"] == np.int8
    assert tuple(inp["shape"]) == (3, 12, 12, 3) and tuple(out["shape"]) == (3, 10)
    q_out = qm.tensors["logits"]
    assert out["quantization"] == (pytest.approx(q_out.scale), q_out.zero_point)


def test_tflite_weights_as_inputs_match_constants() -> None:
    """Feeding weights as graph inputs gives the constant-weight file's outputs, perturbed too."""
    qm = _quantise_randomly(_every_op_model(), seed=5)
    x = np.random.default_rng(0).integers(-128, 128, size=(2, 12, 12, 3)).astype(np.int8)
    fed = export_tflite(qm, batch=2, weights_as_inputs=True)
    feeds = {weight_tensor_name(n): lay.weight for n, lay in qm.layers.items()}
    np.testing.assert_array_equal(_run(fed, x, feeds), _run(export_tflite(qm, batch=2), x))
    qm.layers["conv"].weight = np.clip(
        qm.layers["conv"].weight.astype(np.int16) + 1, -127, 127
    ).astype(np.int8)
    feeds[weight_tensor_name("conv")] = qm.layers["conv"].weight
    np.testing.assert_array_equal(_run(fed, x, feeds), _run(export_tflite(qm, batch=2), x))


@pytest.mark.parametrize("seed", [20, 21, 22])
def test_tflite_every_op_bit_exact(seed: int) -> None:
    """The engine equals LiteRT's reference kernels on grouped conv, pools, RELU, ADD, FC."""
    qm = _quantise_randomly(_every_op_model(), seed=seed)
    x = np.random.default_rng(seed).integers(-128, 128, size=(4, 12, 12, 3)).astype(np.int8)
    theirs = _run(export_tflite(qm, batch=4), x)
    np.testing.assert_array_equal(run_int8(qm, x), theirs)
    assert len(np.unique(theirs)) > 5


def test_tflite_weights_as_inputs_not_importable() -> None:
    """A file whose weights are graph inputs is refused on import with a clear error."""
    qm = _quantise_randomly(_every_op_model(), seed=6)
    with pytest.raises(TFLiteError, match="graph inputs"):
        import_tflite(export_tflite(qm, weights_as_inputs=True))


def test_tflite_unsupported_op_named() -> None:
    """An operator we do not support is named in the error (builtin name)."""
    data = export_tflite(_quantise_randomly(_every_op_model(), seed=7))

    def to_softmax(model) -> None:
        code = model.operatorCodes[model.subgraphs[0].operators[4].opcodeIndex]
        code.builtinCode = code.deprecatedBuiltinCode = tfl.BuiltinOperator.SOFTMAX

    with pytest.raises(TFLiteError, match="SOFTMAX") as info:
        import_tflite(_repack(data, to_softmax))
    assert not isinstance(info.value, TFLiteFormatError)


def test_tflite_float_model_refused() -> None:
    """A float32 model is refused with a message saying to quantise it."""
    data = export_tflite(_quantise_randomly(_every_op_model(), seed=8))

    def to_float(model) -> None:
        model.subgraphs[0].tensors[0].type = tfl.TensorType.FLOAT32

    with pytest.raises(TFLiteError, match="quantise"):
        import_tflite(_repack(data, to_float))


def test_tflite_corrupt_file_typed_error() -> None:
    """Bad identifier, truncation and garbage raise TFLiteFormatError."""
    data = export_tflite(_quantise_randomly(_every_op_model(), seed=9))
    with pytest.raises(TFLiteFormatError, match="TFL3"):
        import_tflite(b"\x00" * 4 + b"XXXX" + data[8:])
    with pytest.raises(TFLiteFormatError):
        import_tflite(data[:64])
    with pytest.raises(TFLiteFormatError):
        import_tflite(b"")
    with pytest.raises(TFLiteFormatError):
        import_tflite(data[:8] + bytes(range(256)) * 4)


def test_tflite_flipped_bytes_never_leak_other_errors() -> None:
    """Random byte flips either decode or raise TFLiteError, never another exception."""
    data = bytearray(export_tflite(_quantise_randomly(_every_op_model(), seed=10)))
    rng = np.random.default_rng(11)
    for _ in range(200):
        bad = bytearray(data)
        for pos in rng.integers(8, len(bad), size=4):
            bad[pos] = int(rng.integers(0, 256))
        with contextlib.suppress(TFLiteError):
            import_tflite(bytes(bad))


def test_tflite_export_missing_qparams() -> None:
    """Exporting a layer without quantisation parameters names the layer."""
    qm = _quantise_randomly(_every_op_model(), seed=12)
    del qm.tensors["pw"]
    with pytest.raises(TFLiteError, match="'pw'"):
        export_tflite(qm)
    qm = _quantise_randomly(_every_op_model(), seed=12)
    del qm.layers["fc1"]
    with pytest.raises(TFLiteError, match=r"'fc1'.*quantise"):
        export_tflite(qm)


def test_tflite_export_pool_requires_same_qparams() -> None:
    """A pool or reshape whose output quantisation differs from its input's is refused."""
    qm = _quantise_randomly(_every_op_model(), seed=13)
    qm.tensors["maxpool"] = TensorQuant(qm.tensors["relu6"].scale * 2, 0)
    with pytest.raises(TFLiteError, match="'maxpool'"):
        export_tflite(qm)


def _rounding_case(kind: str, seed: int) -> tuple[QuantModel, np.ndarray, int]:
    """A one-input-channel layer whose accumulators hit requantisation near-ties.

    With weights 1 the accumulator is ``x + bias[o]``; every int8 x over 64 output
    channels with spread biases covers thousands of accumulators. Returns the model, the
    input batch and how many outputs single and double rounding disagree on (so a test
    can prove the case discriminates).
    """
    rng = np.random.default_rng(seed)
    out_ch, in_scale, out_scale = 64, 2.0**-7, float(np.float32(0.05))
    bias = rng.integers(8_000, 30_000, size=out_ch).astype(np.int32) * rng.choice([-1, 1], out_ch)
    # Scale each channel so its largest |accumulator| lands near 100 output steps.
    w_scales = (100 * out_scale / (in_scale * (np.abs(bias) + 128))).astype(np.float32)
    x = np.arange(-128, 128, dtype=np.int8)
    acc = x.astype(np.int64)[:, None] + bias[None, :]
    effective = float(np.float32(in_scale)) * w_scales.astype(np.float64) / out_scale
    mult, shift = quantize_multiplier(effective)
    single = multiply_by_quantized_multiplier(acc, mult, shift, single_rounding=True)
    double = multiply_by_quantized_multiplier(acc, mult, shift, single_rounding=False)
    shapes = {"dense": (out_ch, 1), "conv": (out_ch, 1, 1, 1), "depthwise": (1, 1, 1, out_ch)}
    weight = np.ones(shapes[kind], np.int8)
    if kind == "dense":
        node: Dense | Conv2D = Dense(
            "layer", ["input"], "out", _zeros(*weight.shape), _zeros(out_ch)
        )
        in_shape: tuple[int, ...] = (1,)
    else:
        node = Conv2D(
            "layer",
            ["input"],
            "out",
            _zeros(*weight.shape),
            _zeros(out_ch),
            depthwise=kind == "depthwise",
        )
        in_shape, x = (1, 1, 1), x.reshape(-1, 1, 1, 1)
    model = Model(f"{kind}_ties", "input", in_shape, [node], "out", out_ch)
    layer = QuantizedLayer(weight, w_scales, bias)
    tensors = {"input": TensorQuant(in_scale, 0), "out": TensorQuant(out_scale, 0)}
    return (
        QuantModel(model, tensors, {"layer": layer}),
        x.reshape(-1, *in_shape),
        int((single != double).sum()),
    )


@pytest.mark.parametrize("kind", ["dense", "conv", "depthwise"])
def test_tflite_requantisation_rounding_matches_reference(kind: str) -> None:
    """Near requantisation ties the engine rounds as LiteRT's reference kernel does."""
    qm, x, disagreements = _rounding_case(kind, seed=14)
    assert disagreements > 0  # single and double rounding differ here: the case decides
    np.testing.assert_array_equal(run_int8(qm, x), _run(export_tflite(qm, batch=256), x))


def test_tflite_dense_flattens_image_input() -> None:
    """A Dense straight on a feature map exports, runs exactly and round-trips."""
    model = Model(
        "flat",
        "input",
        (4, 4, 2),
        [
            Conv2D("conv", ["input"], "conv", _zeros(3, 3, 3, 2), _zeros(3), activation="relu"),
            Dense("fc", ["conv"], "logits", _zeros(5, 48), _zeros(5)),
        ],
        "logits",
        5,
    )
    qm = _quantise_randomly(model, seed=15)
    x = np.random.default_rng(15).integers(-128, 128, size=(3, 4, 4, 2)).astype(np.int8)
    data = export_tflite(qm, batch=3)
    np.testing.assert_array_equal(run_int8(qm, x), _run(data, x))
    _assert_same_model(qm, import_tflite(data))


def test_tflite_out_of_order_operators_refused() -> None:
    """Operators that read a tensor before any operator writes it are refused."""
    data = export_tflite(_quantise_randomly(_every_op_model(), seed=16))

    def swap(model) -> None:
        ops = model.subgraphs[0].operators
        ops[0], ops[1] = ops[1], ops[0]

    with pytest.raises(TFLiteError, match="no earlier operator"):
        import_tflite(_repack(data, swap))


def test_tflite_import_without_metadata() -> None:
    """A file from another tool (no qsched metadata) imports; layers take output names."""
    qm = _quantise_randomly(_every_op_model(), seed=17)

    def strip(model) -> None:
        model.metadata = None

    back = import_tflite(_repack(export_tflite(qm), strip))
    assert [n.output for n in back.model.nodes] == [n.output for n in qm.model.nodes]
    assert [n.name for n in back.model.nodes] == [n.output for n in qm.model.nodes]
    np.testing.assert_array_equal(back.layers["logits"].weight, qm.layers["fc2"].weight)
    assert back.model.num_classes == 10
