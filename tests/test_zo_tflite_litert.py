"""The INT8 engine against LiteRT's reference kernels, bit for bit, on exported zoo models."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tflite_checks import assert_every_tensor, interpreter, invoke, truncated

from qsched.zo import prng
from qsched.zo.engine import run_int8, run_int8_perturbed
from qsched.zo.graph import (
    Concat,
    Conv2D,
    Dense,
    HardSwish,
    Logistic,
    Mean,
    Model,
    Mul,
    MulConstant,
    Pad,
    QuantModel,
    Reshape,
    TensorQuant,
)
from qsched.zo.lookup import LOGISTIC_OUTPUT
from qsched.zo.quantize import quantize_input, quantize_model
from qsched.zo.tflite_io import export_tflite, import_tflite, weight_tensor_name
from qsched.zo.zoo import build_model

# Small sizes keep the suite fast: each model has the block structure of its family.
_ZOO: dict[str, tuple[str, tuple[int, ...], dict[str, Any]]] = {
    "cnn": ("cnn", (8, 8, 1), {}),
    "resnet_blocks": ("resnet8", (16, 16, 3), {"width": 0.5}),
    "mobilenetv2_blocks": (
        "mobilenetv2",
        (16, 16, 3),
        {"stages": 4, "max_repeats": 2, "last_channels": 64},
    ),
}
_BATCH = 8


def _quantised(key: str, seed: int = 0) -> tuple[QuantModel, np.ndarray]:
    """A zoo model after PTQ on random data, and an int8 input batch."""
    name, shape, options = _ZOO[key]
    model = build_model(name, input_shape=shape, seed=seed, **options)
    rng = np.random.default_rng(seed)
    qm = quantize_model(model, rng.normal(size=(32, *shape)).astype(np.float32))
    x = quantize_input(qm, rng.normal(size=(_BATCH, *shape)).astype(np.float32))
    return qm, x


@pytest.mark.parametrize("key", sorted(_ZOO))
def test_tflite_litert_bit_exact_every_tensor(key: str) -> None:
    """Every activation of the engine equals LiteRT's reference kernels' (int8, bit for bit)."""
    qm, x = _quantised(key)
    tensor = invoke(interpreter(export_tflite(qm, batch=_BATCH)), x)
    assert_every_tensor(qm, tensor, x)
    logits = tensor(qm.model.output_name)
    assert len(np.unique(logits)) > 10  # a saturated output would prove nothing


def test_tflite_litert_bit_exact_perturbed() -> None:
    """run_int8_perturbed equals LiteRT fed the same perturbed weights as graph inputs."""
    qm, x = _quantised("mobilenetv2_blocks", seed=1)
    names = [n.name for n in qm.model.param_nodes()]
    sets: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for k in range(2):
        for sign in (1, -1):
            for n in names:
                w = qm.layers[n].weight
                z = prng.rademacher(7, 3, k, w.size).reshape(w.shape)
                sets[n].append(
                    np.clip(w + sign * 2 * z.astype(np.int16), -127, 127).astype(np.int8)
                )
    ours = run_int8_perturbed(qm, x, {n: np.stack(v) for n, v in sets.items()})
    it = interpreter(export_tflite(qm, batch=_BATCH, weights_as_inputs=True))
    inputs = {d["name"]: d["index"] for d in it.get_input_details()}
    it.set_tensor(inputs[qm.model.input_name], x)
    for p in range(4):
        for n in names:
            it.set_tensor(inputs[weight_tensor_name(n)], sets[n][p])
        it.invoke()
        theirs = it.get_tensor(it.get_output_details()[0]["index"])
        np.testing.assert_array_equal(ours[p], theirs, err_msg=f"weight set {p}")
    assert not np.array_equal(ours[0], ours[1])


@pytest.mark.parametrize("key", sorted(_ZOO))
def test_tflite_zoo_round_trip(key: str) -> None:
    """A quantised zoo model survives export -> import: graph, weights, scales, outputs."""
    qm, x = _quantised(key, seed=2)
    back = import_tflite(export_tflite(qm))
    assert [type(n) for n in back.model.nodes] == [type(n) for n in qm.model.nodes]
    assert [n.name for n in back.model.nodes] == [n.name for n in qm.model.nodes]
    assert {k: (v.scale, v.zero_point) for k, v in back.tensors.items()} == {
        k: (v.scale, v.zero_point) for k, v in qm.tensors.items()
    }
    for name, layer in qm.layers.items():
        np.testing.assert_array_equal(back.layers[name].weight, layer.weight)
        np.testing.assert_array_equal(back.layers[name].weight_scales, layer.weight_scales)
        np.testing.assert_array_equal(back.layers[name].bias, layer.bias)
    np.testing.assert_array_equal(run_int8(back, x), run_int8(qm, x))


def _mean_pad_model(keep_dims: bool, seed: int) -> Model:
    """conv -> PAD (uneven, like a stride-2 MobileNet) -> two convs -> CONCATENATION ->
    MEAN -> dense."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0, 0.4, (6, 3, 3, 3)).astype(np.float32)
    halves = [
        Conv2D(
            name,
            ["pad"],
            name,
            rng.normal(0, 0.3, (4, 3, 3, 6)).astype(np.float32),
            rng.normal(0, 0.1, 4).astype(np.float32),
            stride=(2, 2),
            padding="valid",
            activation="relu",
        )
        for name in ("c2a", "c2b")
    ]
    nodes: list[Any] = [
        Conv2D("c1", ["input"], "c1", w1, rng.normal(0, 0.1, 6).astype(np.float32)),
        Pad("pad", ["c1"], "pad", pads=((0, 1), (1, 2))),
        *halves,
        Concat("c2", ["c2a", "c2b"], "c2"),
        Mean("gap", ["c2"], "gap", keep_dims=keep_dims),
    ]
    last = "gap"
    if keep_dims:
        nodes.append(Reshape("flat", ["gap"], "flat", (8,)))
        last = "flat"
    wd = rng.normal(0, 0.3, (5, 8)).astype(np.float32)
    nodes.append(Dense("head", [last], "head", wd, np.zeros(5, np.float32)))
    return Model("mean_pad", "input", (9, 9, 3), nodes, "head", 5)


@pytest.mark.parametrize("keep_dims", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tflite_litert_mean_and_pad_bit_exact(keep_dims: bool, seed: int) -> None:
    """MEAN over height and width (requantised), PAD with the zero point and CONCATENATION
    equal LiteRT's reference kernels on every tensor, and the file reads back to the same
    graph."""
    model = _mean_pad_model(keep_dims, seed)
    rng = np.random.default_rng(seed)
    qm = quantize_model(model, rng.normal(size=(32, 9, 9, 3)).astype(np.float32))
    assert qm.tensors["gap"].scale != qm.tensors["c2"].scale  # MEAN really requantises
    x = quantize_input(qm, rng.normal(size=(_BATCH, 9, 9, 3)).astype(np.float32))
    data = export_tflite(qm, batch=_BATCH)
    assert_every_tensor(qm, invoke(interpreter(data), x), x)
    back = import_tflite(data)
    assert [type(n).__name__ for n in back.model.nodes] == [type(n).__name__ for n in model.nodes]
    np.testing.assert_array_equal(run_int8(back, x), run_int8(qm, x))


def test_tflite_mean_requantises_like_the_reference_for_many_counts() -> None:
    """The folded 1/count multiplier: every plane size 1..40x40 and odd scale ratios give
    LiteRT's MEAN, including counts that are not powers of two."""
    rng = np.random.default_rng(7)
    for side in (1, 3, 7, 13, 40):
        model = Model("m", "input", (side, side, 4), [Mean("m", ["input"], "m")], "m", 4)
        ratio = float(rng.uniform(0.05, 20))
        qm = QuantModel(
            model,
            {
                "input": TensorQuant(0.05, int(rng.integers(-20, 20))),
                "m": TensorQuant(0.05 * ratio, 3),
            },
            {},
        )
        x = rng.integers(-128, 128, size=(_BATCH, side, side, 4), dtype=np.int8)
        theirs = invoke(interpreter(export_tflite(qm, batch=_BATCH)), x)("m")
        np.testing.assert_array_equal(run_int8(qm, x), theirs, err_msg=f"{side}x{side}")


def test_tflite_concatenation_of_three_becomes_a_chain() -> None:
    """A three-input CONCATENATION (as converters write) imports as two joins and equals
    LiteRT on the logits."""
    from qsched.zo._tflite_common import pack_model, schema

    rng = np.random.default_rng(4)
    convs = [
        Conv2D(
            n,
            ["input"],
            n,
            rng.normal(0, 0.4, (2, 1, 1, 3)).astype(np.float32),
            np.zeros(2, np.float32),
        )
        for n in ("a", "b", "c")
    ]
    nodes: list[Any] = [*convs, Concat("ab", ["a", "b"], "ab"), Concat("abc", ["ab", "c"], "abc")]
    nodes.append(Mean("gap", ["abc"], "gap"))
    nodes.append(
        Dense(
            "head",
            ["gap"],
            "head",
            rng.normal(0, 0.3, (4, 6)).astype(np.float32),
            np.zeros(4, np.float32),
        )
    )
    qm = quantize_model(
        Model("cat3", "input", (5, 5, 3), nodes, "head", 4),
        rng.normal(size=(16, 5, 5, 3)).astype(np.float32),
    )
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(export_tflite(qm, batch=_BATCH), 0))
    graph = model.subgraphs[0]
    names = [t.name.decode() for t in graph.tensors]
    first = next(op for op in graph.operators if names[op.outputs[0]] == "ab")
    second = next(op for op in graph.operators if names[op.outputs[0]] == "abc")
    second.inputs = [*first.inputs, names.index("c")]
    graph.operators.remove(first)
    data = pack_model(model)
    back = import_tflite(data)
    assert [type(n).__name__ for n in back.model.nodes].count("Concat") == 2
    x = quantize_input(qm, rng.normal(size=(_BATCH, 5, 5, 3)).astype(np.float32))
    np.testing.assert_array_equal(run_int8(back, x), invoke(interpreter(data), x)("head"))


def _pointwise_conv(
    rng: np.random.Generator,
    name: str,
    src: str,
    channels: tuple[int, int],
    act: str,
    stds: tuple[float, float],
) -> Conv2D:
    """A 1x1 convolution ``channels = (out, in)`` with normal weights and biases of the
    given standard deviations (weights drawn first)."""
    cout, cin = channels
    w = rng.normal(0, stds[0], (cout, 1, 1, cin)).astype(np.float32)
    b = rng.normal(0, stds[1], cout).astype(np.float32)
    return Conv2D(name, [src], name, w, b, activation=act)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tflite_mul_elementwise_and_channel_gate_bit_exact(seed: int) -> None:
    """MUL of two activations, and of an (H, W, C) map by a (1, 1, C) gate (squeeze-and-
    excite's shape), equals LiteRT's reference kernels on every tensor."""
    rng = np.random.default_rng(seed)

    def conv(name: str, src: str, cout: int, cin: int, act: str = "none") -> Conv2D:
        return _pointwise_conv(rng, name, src, (cout, cin), act, stds=(0.5, 0.2))

    nodes: list[Any] = [
        conv("a", "input", 4, 3),
        conv("b", "input", 4, 3, "relu"),
        Mul("ab", ["a", "b"], "ab"),
        Mean("squeeze", ["ab"], "squeeze", keep_dims=True),
        conv("gate", "squeeze", 4, 4, "relu6"),
        Mul("excite", ["ab", "gate"], "excite", activation="relu"),
        Mean("gap", ["excite"], "gap"),
        Dense(
            "head",
            ["gap"],
            "head",
            rng.normal(0, 0.4, (3, 4)).astype(np.float32),
            np.zeros(3, np.float32),
        ),
    ]
    qm = quantize_model(
        Model("mul", "input", (6, 6, 3), nodes, "head", 3),
        rng.normal(size=(32, 6, 6, 3)).astype(np.float32),
    )
    x = quantize_input(qm, rng.normal(size=(_BATCH, 6, 6, 3)).astype(np.float32))
    data = export_tflite(qm, batch=_BATCH)
    assert_every_tensor(qm, invoke(interpreter(data), x), x)
    np.testing.assert_array_equal(run_int8(import_tflite(data), x), run_int8(qm, x))


def _table_node(op: type, rng: np.random.Generator) -> Any:
    if op is not MulConstant:
        return op("op", ["input"], "op")
    return MulConstant(
        "op",
        ["input"],
        "op",
        constant=int(rng.integers(-128, 128)),
        constant_scale=float(np.float32(10 ** rng.uniform(-3, 0))),
        constant_zero_point=int(rng.integers(-128, 128)),
        activation=str(rng.choice(["none", "relu", "relu6"])),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("op", [Logistic, HardSwish, MulConstant])
def test_tflite_table_ops_bit_exact_for_every_input_byte(op: type) -> None:
    """LOGISTIC, HARD_SWISH and MUL-by-constant tables equal LiteRT's reference kernels on
    all 256 inputs, over input scales from 3e-4 to 1, every zero point, output scales
    around the input's and (MUL) constants of any value, scale and fused activation."""
    rng = np.random.default_rng(7)
    x = np.arange(-128, 128, dtype=np.int8).reshape(1, 16, 16, 1)
    for _ in range(40):
        s_in = float(np.float32(10 ** rng.uniform(-3.5, 0)))
        inp = TensorQuant(s_in, int(rng.integers(-128, 128)))
        out = LOGISTIC_OUTPUT
        if op is not Logistic:
            s_out = float(np.float32(s_in * 10 ** rng.uniform(-0.5, 0.7)))
            out = TensorQuant(s_out, int(rng.integers(-128, 128)))
        model = Model("table", "input", (16, 16, 1), [_table_node(op, rng)], "op", 256)
        qm = QuantModel(model, {"input": inp, "op": out}, {})
        theirs = invoke(interpreter(export_tflite(qm, batch=1)), x)("op")
        np.testing.assert_array_equal(run_int8(qm, x), theirs, err_msg=f"{inp} -> {out}")


def test_tflite_hard_swish_and_sigmoid_gate_model_bit_exact() -> None:
    """MobileNetV3's pattern (conv -> HARD_SWISH, a squeeze-and-excite gate through
    LOGISTIC) after PTQ equals LiteRT on every tensor and survives export and import."""
    rng = np.random.default_rng(3)

    def conv(name: str, src: str, cout: int, cin: int, act: str = "none") -> Conv2D:
        return _pointwise_conv(rng, name, src, (cout, cin), act, stds=(0.6, 0.3))

    nodes: list[Any] = [
        conv("expand", "input", 6, 3),
        HardSwish("hswish", ["expand"], "hswish"),
        Mean("squeeze", ["hswish"], "squeeze", keep_dims=True),
        conv("reduce", "squeeze", 3, 6, "relu"),
        conv("gate", "reduce", 6, 3),
        Logistic("sigmoid", ["gate"], "sigmoid"),
        Mul("excite", ["hswish", "sigmoid"], "excite"),
        Mean("gap", ["excite"], "gap"),
        Dense("head", ["gap"], "head", rng.normal(0, 0.4, (3, 6)).astype(np.float32),
              np.zeros(3, np.float32)),
    ]  # fmt: skip
    qm = quantize_model(
        Model("se", "input", (6, 6, 3), nodes, "head", 3),
        rng.normal(0, 2, size=(32, 6, 6, 3)).astype(np.float32),
    )
    assert qm.tensors["sigmoid"] == LOGISTIC_OUTPUT
    x = quantize_input(qm, rng.normal(0, 2, size=(_BATCH, 6, 6, 3)).astype(np.float32))
    data = export_tflite(qm, batch=_BATCH)
    assert_every_tensor(qm, invoke(interpreter(data), x), x)
    assert len(np.unique(run_int8(truncated(qm, 1), x))) > 50  # hard_swish sees a range
    np.testing.assert_array_equal(run_int8(import_tflite(data), x), run_int8(qm, x))
