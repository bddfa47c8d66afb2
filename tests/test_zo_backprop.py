"""The first-order trainer: gradients of every op, training, trainable subsets."""

import importlib

import numpy as np
import pytest

from qsched.zo import backprop
from qsched.zo.backprop import (
    BackpropError,
    _augmented,
    evaluate,
    forward,
    loss_and_grads,
    resolve_trainable,
    softmax_cross_entropy,
    train_backprop,
)
from qsched.zo.datasets import load_digits, split_classes
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
    Pad,
    ReLU,
    ReLU6,
    Reshape,
)
from qsched.zo.zoo import build_model, replace_classifier


def _every_op_model(padding, rng, dtype=np.float64):
    """A tiny graph using every op: conv, depthwise (multiplier 2), grouped conv, pools, Add, ..."""

    def w(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    nodes = [
        Conv2D("conv", ["input"], "conv", w(4, 3, 3, 2), w(4), padding=padding, activation="relu"),
        Conv2D(
            "dw",
            ["conv"],
            "dw",
            w(1, 3, 3, 8, scale=2.0),
            w(8),
            stride=(2, 2),
            padding="same",
            groups=4,
            depthwise=True,
            activation="relu6",
        ),
        Conv2D("grouped", ["dw"], "grouped", w(4, 3, 3, 4), w(4), padding="same", groups=2),
        Conv2D(
            "shortcut", ["conv"], "shortcut", w(4, 1, 1, 4), w(4), stride=(2, 2), padding="same"
        ),
        Add("add", ["grouped", "shortcut"], "add", activation="relu"),
        ReLU("relu", ["add"], "relu"),
        AvgPool("avg", ["relu"], "avg", (2, 2), (1, 1), padding),
        MaxPool("max", ["avg"], "max", (2, 2), (2, 2), "same"),
        ReLU6("relu6", ["max"], "relu6"),
        Reshape("flat", ["relu6"], "flat", (16,)),
        Dense("dense_a", ["flat"], "dense_a", w(4, 16), w(4), activation="relu"),
        GlobalAvgPool("gap", ["max"], "gap"),
        Add("join", ["dense_a", "gap"], "join"),
        HardSwish("hswish", ["max"], "hswish"),
        Pad("pad", ["hswish"], "pad", pads=((1, 0), (0, 2))),
        Mean("squeeze", ["pad"], "squeeze", keep_dims=True),
        Logistic("sigmoid", ["squeeze"], "sigmoid"),
        MulConstant("sixth", ["sigmoid"], "sixth", constant=50, constant_scale=0.01),
        Mul("excite", ["pad", "sixth"], "excite"),
        Mul("square", ["excite", "excite"], "square", activation="relu"),
        Mean("mean", ["square"], "mean", keep_dims=True),
        Reshape("mflat", ["mean"], "mflat", (4,)),
        Concat("cat", ["join", "mflat"], "cat"),
        Dense("head", ["cat"], "head", w(3, 8), w(3)),
    ]
    side = 8 if padding == "same" else 10
    return Model("every_op", "input", (side, side, 2), nodes, "head", 3)


def _loss(model, x, y):
    return softmax_cross_entropy(forward(model, x), y)[0]


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_backprop_gradcheck_every_op(padding):
    """Analytic gradients of every layer equal central finite differences (float64)."""
    rng = np.random.default_rng(11)
    model = _every_op_model(padding, rng)
    x = rng.uniform(0, 3, (4, *model.input_shape))
    y = np.array([0, 1, 2, 1])
    _, grads = loss_and_grads(model, x, y)
    assert set(grads) == {n.name for n in model.param_nodes()}
    dw_out = forward(Model("m", "input", model.input_shape, model.nodes[:2], "dw", 3), x)
    assert np.any(dw_out == 6) and np.any((dw_out > 0) & (dw_out < 6))  # relu6 both regimes
    h = 1e-6
    for node in model.param_nodes():
        for arr, grad in zip((node.weight, node.bias), grads[node.name], strict=True):
            flat, gflat = arr.reshape(-1), grad.reshape(-1)
            for i in rng.choice(flat.size, size=min(flat.size, 6), replace=False):
                keep = flat[i]
                flat[i] = keep + h
                up = _loss(model, x, y)
                flat[i] = keep - h
                down = _loss(model, x, y)
                flat[i] = keep
                numeric = (up - down) / (2 * h)
                assert abs(numeric - gflat[i]) <= 1e-6 + 1e-5 * abs(numeric), (node.name, i)


def test_backprop_avgpool_same_counts_in_bounds_only():
    """A SAME average pool divides by the number of in-bounds elements (TFLite)."""
    model = Model(
        "p",
        "input",
        (2, 2, 1),
        [AvgPool("avg", ["input"], "avg", (2, 2), (1, 1), "same")],
        "avg",
        2,
    )
    out = forward(model, np.array([[1.0, 2.0], [3.0, 4.0]], np.float32).reshape(1, 2, 2, 1))
    assert np.array_equal(out[0, :, :, 0], np.array([[2.5, 3.0], [3.5, 4.0]], np.float32))


def test_backprop_conv_same_padding_odd_element_after():
    """SAME padding of a 3x3 stride-2 conv on a 4x4 input puts the extra pad row/column after."""
    weight = np.zeros((1, 3, 3, 1), np.float32)
    weight[0, 0, 0, 0] = 1.0  # picks the top-left element of each window
    conv = Conv2D("c", ["input"], "c", weight, np.zeros(1, np.float32), (2, 2), "same")
    model = Model("c", "input", (4, 4, 1), [conv], "c", 2)
    x = np.arange(16, dtype=np.float32).reshape(1, 4, 4, 1)
    # total padding 1 -> 0 before, 1 after: windows start at rows/cols 0 and 2.
    assert np.array_equal(forward(model, x)[0, :, :, 0], np.array([[0, 2], [8, 10]], np.float32))


def test_softmax_cross_entropy_uniform_and_gradient():
    """Equal logits give log K; the gradient is (softmax - onehot) / N."""
    loss, grad = softmax_cross_entropy(np.zeros((2, 4), np.float32), [1, 3])
    assert loss == pytest.approx(np.log(4), rel=1e-6)
    expected = np.full((2, 4), 0.25 / 2, np.float32)
    expected[0, 1] -= 0.5
    expected[1, 3] -= 0.5
    assert np.allclose(grad, expected) and grad.dtype == np.float32


def test_train_backprop_mlp_digits_reaches_90_percent():
    """The MLP trained with Adam for 300 steps reaches >= 90 % validation accuracy on digits."""
    ds = load_digits(flat=True)
    model = build_model("mlp", ds.input_shape, 10, seed=0)
    trained, history = train_backprop(model, ds, steps=300, lr=1e-2, batch_size=64, seed=0)
    assert history.val_accuracy[-1] >= 0.90
    assert evaluate(trained, ds.x_val, ds.y_val)[1] == history.val_accuracy[-1]
    assert np.mean(history.train_loss[-20:]) < 0.5 * np.mean(history.train_loss[:20])


def test_train_backprop_cnn_sgd_momentum_learns():
    """SGD with momentum trains the CNN on digits well above chance."""
    ds = load_digits()
    model = build_model("cnn", ds.input_shape, 10, seed=1)
    _, history = train_backprop(
        model, ds, steps=150, lr=0.05, batch_size=32, seed=1, optimizer="sgd", eval_every=50
    )
    assert history.eval_steps == [50, 100, 150]
    assert history.val_accuracy[-1] >= 0.8


def test_train_backprop_leaves_input_and_is_deterministic():
    """The input model is not mutated and the same seed gives bit-identical weights."""
    ds = load_digits(flat=True)
    model = build_model("mlp", ds.input_shape, 10, seed=0)
    before = [n.weight.copy() for n in model.param_nodes()]
    a, _ = train_backprop(model, ds, steps=20, lr=1e-2, seed=3)
    b, _ = train_backprop(model, ds, steps=20, lr=1e-2, seed=3)
    c, _ = train_backprop(model, ds, steps=20, lr=1e-2, seed=4)
    assert all(
        np.array_equal(w, n.weight) for w, n in zip(before, model.param_nodes(), strict=True)
    )
    wa, wb, wc = (m.param_nodes()[0].weight for m in (a, b, c))
    assert np.array_equal(wa, wb) and not np.array_equal(wa, wc)
    assert wa.dtype == np.float32


def test_dihedral_augmentation_is_the_eight_symmetries():
    """Each augmented image is one of the square's 8 symmetries of its original, all 8
    occur, and a seed draws the same ones again."""
    x = np.arange(2000 * 3 * 3, dtype=np.float32).reshape(2000, 3, 3, 1)
    out = _augmented(x, np.random.default_rng(0))
    again = _augmented(x, np.random.default_rng(0))
    assert np.array_equal(out, again)
    seen = set()
    for original, got in zip(x, out, strict=True):
        forms = [np.rot90(original, k) for k in range(4)]
        forms += [f[:, ::-1] for f in forms]
        matches = [i for i, f in enumerate(forms) if np.array_equal(f, got)]
        assert len(matches) == 1
        seen.add(matches[0])
    assert seen == set(range(8))


def test_train_backprop_augment_keeps_minibatches_and_learns():
    """Augmentation has its own stream: it changes the weights, not which samples a step
    draws, still learns, and refuses non-square inputs."""
    ds = load_digits()
    model = build_model("cnn", ds.input_shape, 10, seed=0)
    plain, _ = train_backprop(model, ds, steps=5, lr=1e-2, seed=1)
    aug, _ = train_backprop(model, ds, steps=5, lr=1e-2, seed=1, augment="dihedral")
    assert not np.array_equal(plain.param_nodes()[0].weight, aug.param_nodes()[0].weight)
    _, history = train_backprop(model, ds, steps=200, lr=1e-2, seed=1, augment="dihedral")
    assert history.val_accuracy[-1] >= 0.6
    with pytest.raises(BackpropError, match="square"):
        train_backprop(build_model("mlp", (64,), 10), load_digits(flat=True), 1, augment="dihedral")
    with pytest.raises(BackpropError, match="augment"):
        train_backprop(model, ds, 1, augment="mixup")  # type: ignore[arg-type]


def test_train_backprop_trainable_last_layer_only():
    """With trainable='last:1' only the classifier moves; the backbone stays bit-identical."""
    ds = load_digits()
    model = build_model("cnn", ds.input_shape, 10, seed=0)
    trained, _ = train_backprop(model, ds, steps=10, lr=1e-2, trainable="last:1")
    old, new = model.param_nodes(), trained.param_nodes()
    for o, n in zip(old[:-1], new[:-1], strict=True):
        assert np.array_equal(o.weight, n.weight) and np.array_equal(o.bias, n.bias)
    assert not np.array_equal(old[-1].weight, new[-1].weight)


def test_train_backprop_transfer_head_on_unseen_classes():
    """A backbone pretrained on digits 0-4 supports a new head trained alone on digits 5-9."""
    src, tgt = split_classes(load_digits(), [0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    backbone, _ = train_backprop(
        build_model("cnn", src.input_shape, 5, seed=0), src, steps=150, lr=1e-2, batch_size=32
    )
    fresh = replace_classifier(backbone, tgt.num_classes, seed=1)
    assert evaluate(fresh, tgt.x_val, tgt.y_val)[1] < 0.5
    tuned, history = train_backprop(
        fresh, tgt, steps=100, lr=1e-2, batch_size=32, trainable="last:1"
    )
    assert history.val_accuracy[-1] >= 0.85
    assert np.array_equal(tuned.param_nodes()[0].weight, backbone.param_nodes()[0].weight)


def test_train_backprop_frozen_prefix_runs_once_same_result(monkeypatch):
    """With a frozen backbone the prefix's outputs are computed once for every sample;
    the trained head and the history match the per-step forward up to float rounding,
    and a prefix over the memory budget falls back to the per-step forward."""
    src, _ = split_classes(load_digits(), [0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    model = build_model("cnn", src.input_shape, 5, seed=0)
    calls = []
    original = backprop._prefix_outputs
    monkeypatch.setattr(
        backprop, "_prefix_outputs", lambda *a: calls.append(len(a[1])) or original(*a)
    )
    cached, h1 = train_backprop(model, src, 60, lr=1e-2, trainable="last:1", eval_every=20)
    assert calls == [len(src.x_train), len(src.x_val)]
    monkeypatch.setattr(backprop, "_FROZEN_BUDGET_BYTES", 0)
    direct, h2 = train_backprop(model, src, 60, lr=1e-2, trainable="last:1", eval_every=20)
    assert len(calls) == 2
    np.testing.assert_allclose(
        cached.param_nodes()[-1].weight, direct.param_nodes()[-1].weight, rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(h1.train_loss, h2.train_loss, rtol=1e-4)
    assert h1.eval_steps == h2.eval_steps == [20, 40, 60]
    np.testing.assert_allclose(h1.val_accuracy, h2.val_accuracy, atol=1 / len(src.x_val))


def test_loss_and_grads_stops_at_first_trainable():
    """Frozen layers get no gradients; listed layers do."""
    model = build_model("resnet8", (8, 8, 3), 4, seed=0, width=0.25)
    x = np.random.default_rng(0).uniform(0, 1, (2, 8, 8, 3)).astype(np.float32)
    _, grads = loss_and_grads(model, x, [0, 3], trainable=["stage3.block1.conv2", "head.dense"])
    assert set(grads) == {"stage3.block1.conv2", "head.dense"}
    head = model.node("head.dense")
    assert isinstance(head, Dense) and grads["head.dense"][0].shape == head.weight.shape


def test_resolve_trainable_forms_and_errors():
    """'all', None, 'last:N' and name lists resolve in model order; bad requests raise."""
    model = build_model("mlp", (64,), 10, seed=0, hidden=(8, 8))
    assert resolve_trainable(model, None) == ["dense_1", "dense_2", "dense_3"]
    assert resolve_trainable(model, "all") == ["dense_1", "dense_2", "dense_3"]
    assert resolve_trainable(model, "last:2") == ["dense_2", "dense_3"]
    assert resolve_trainable(model, ["dense_3", "dense_1"]) == ["dense_1", "dense_3"]
    with pytest.raises(BackpropError, match="last:N"):
        resolve_trainable(model, "last:4")
    with pytest.raises(BackpropError, match="not parametrised"):
        resolve_trainable(model, ["flatten"])


def test_forward_rejects_wrong_input_shape():
    """An input of the wrong shape raises BackpropError naming the expected shape."""
    model = build_model("cnn", (8, 8, 1), 10, seed=0)
    with pytest.raises(BackpropError, match="takes inputs"):
        forward(model, np.zeros((1, 64), np.float32))


def _engine():
    try:
        return importlib.import_module("qsched.zo.engine")
    except ModuleNotFoundError:
        pytest.skip("qsched.zo.engine (the FP32 inference engine) is not built yet")


@pytest.mark.parametrize(
    ("name", "shape", "options"),
    [
        ("mlp", (64,), {}),
        ("cnn", (8, 8, 1), {}),
        ("resnet8", (16, 16, 3), {"width": 0.5}),
        ("resnet18", (16, 16, 3), {"width": 0.125}),
        ("mobilenetv2", (16, 16, 3), {"stages": 4, "max_repeats": 2, "last_channels": 32}),
    ],
)
def test_forward_matches_engine_run_fp32(name, shape, options):
    """The trainer's forward equals the inference engine's FP32 forward on every zoo model."""
    engine = _engine()
    model = build_model(name, shape, 10, seed=2, **options)
    x = np.random.default_rng(3).uniform(0, 1, (5, *shape)).astype(np.float32)
    ours, theirs = forward(model, x), np.asarray(engine.run_fp32(model, x))
    assert theirs.shape == ours.shape
    assert np.allclose(ours, theirs, rtol=1e-4, atol=1e-5 * float(np.abs(theirs).max()))


def test_forward_matches_engine_every_op():
    """Both forwards agree on the every-op graph (SAME and VALID), in float32."""
    engine = _engine()
    for padding in ("same", "valid"):
        model = _every_op_model(padding, np.random.default_rng(5), np.float32)
        x = np.random.default_rng(6).uniform(0, 3, (3, *model.input_shape)).astype(np.float32)
        assert np.allclose(
            forward(model, x), np.asarray(engine.run_fp32(model, x)), rtol=1e-4, atol=1e-5
        )
