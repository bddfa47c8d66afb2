"""The engine: shapes, errors, and batched perturbed evaluation equal to separate passes."""

from __future__ import annotations

import numpy as np
import pytest

from qsched.zo import native
from qsched.zo.engine import (
    bench_engine,
    infer_shapes,
    prefix_activations,
    prepare_int8,
    run_fp32,
    run_fp32_perturbed,
    run_int8,
    run_int8_perturbed,
)
from qsched.zo.graph import (
    Add,
    AvgPool,
    Conv2D,
    Dense,
    GlobalAvgPool,
    GraphError,
    Model,
    ReLU,
)
from qsched.zo.quantize import quantize_input, quantize_model


def _model(rng: np.random.Generator) -> Model:
    """A small residual CNN touching every kind of node the engine batches."""

    def r(*shape: int, k: float = 0.4) -> np.ndarray:
        return (rng.normal(size=shape) * k).astype(np.float32)

    nodes = [
        Conv2D("stem", ["x"], "t1", r(8, 3, 3, 2), r(8, k=0.1), stride=(2, 2), activation="relu6"),
        Conv2D(
            "dw",
            ["t1"],
            "t2",
            r(1, 3, 3, 8),
            r(8, k=0.1),
            groups=8,
            depthwise=True,
            activation="relu",
        ),
        Conv2D("pw", ["t2"], "t3", r(8, 1, 1, 8), r(8, k=0.1)),
        Add("res", ["t1", "t3"], "t4"),
        Conv2D("grp", ["t4"], "t5", r(12, 3, 3, 4), r(12, k=0.1), groups=2),
        ReLU("act", ["t5"], "t6"),
        AvgPool("pool", ["t6"], "t7", pool=(3, 3), stride=(1, 1), padding="same"),
        GlobalAvgPool("gap", ["t7"], "t8"),
        Dense("fc", ["t8"], "y", r(5, 12), r(5, k=0.1)),
    ]
    return Model("tiny", "x", (9, 9, 2), nodes, "y", 5)


@pytest.fixture(scope="module")
def setup() -> tuple[Model, np.ndarray]:
    rng = np.random.default_rng(0)
    return _model(rng), rng.normal(size=(6, 9, 9, 2)).astype(np.float32)


def _int8_sets(qm, names, p, rng):
    sets = {}
    for name in names:
        w = qm.layers[name].weight.astype(np.int16)
        sets[name] = np.clip(w + rng.integers(-3, 4, size=(p, *w.shape)), -127, 127).astype(np.int8)
    return sets


def test_infer_shapes_follows_tflite_geometry(setup) -> None:
    """SAME with stride 2 on 9 gives 5; global pooling drops the plane."""
    model, _ = setup
    shapes = infer_shapes(model)
    assert shapes["t1"] == (5, 5, 8) and shapes["t5"] == (5, 5, 12)
    assert shapes["t8"] == (12,) and shapes["y"] == (5,)


@pytest.mark.parametrize("names", [["fc"], ["grp", "fc"], ["stem", "dw", "pw", "grp", "fc"]])
def test_int8_perturbed_equals_separate_passes(setup, names) -> None:
    """Each of P batched INT8 evaluations equals its own run_int8, bit for bit."""
    model, x = setup
    qm = quantize_model(model, x)
    xq = quantize_input(qm, x)
    sets = _int8_sets(qm, names, 5, np.random.default_rng(1))
    batched = run_int8_perturbed(qm, xq, sets)
    assert batched.shape == (5, 6, 5) and batched.dtype == np.int8
    for p in range(5):
        np.testing.assert_array_equal(
            batched[p], run_int8(qm, xq, {k: v[p] for k, v in sets.items()})
        )
    assert not all(np.array_equal(batched[0], batched[p]) for p in range(1, 5))


def test_int8_perturbed_chunks_agree(setup) -> None:
    """A tiny memory budget (one copy per chunk) changes no bit."""
    model, x = setup
    qm = quantize_model(model, x)
    xq = quantize_input(qm, x)
    sets = _int8_sets(qm, ["pw", "fc"], 4, np.random.default_rng(2))
    np.testing.assert_array_equal(
        run_int8_perturbed(qm, xq, sets, max_bytes=1), run_int8_perturbed(qm, xq, sets)
    )


@pytest.mark.skipif(not native.available(), reason="native kernels not built or disabled")
@pytest.mark.parametrize("names", [["fc"], ["stem", "dw", "pw", "grp", "fc"]])
def test_int8_prepared_native_and_numpy_paths_agree(setup, names) -> None:
    """One prepared model, evaluated again and again, gives the same bits on either kernel path."""
    model, x = setup
    qm = quantize_model(model, x)
    xq = quantize_input(qm, x)
    on_c, on_numpy = prepare_int8(qm, use_native=True), prepare_int8(qm, use_native=False)
    for seed in range(3):  # the same prepared objects serve every call
        sets = _int8_sets(qm, names, 4, np.random.default_rng(seed))
        expected = run_int8_perturbed(on_numpy, xq, sets)
        np.testing.assert_array_equal(run_int8_perturbed(on_c, xq, sets), expected)
        np.testing.assert_array_equal(run_int8_perturbed(qm, xq, sets), expected)
        single = {k: v[0] for k, v in sets.items()}
        np.testing.assert_array_equal(run_int8(on_c, xq, single), run_int8(on_numpy, xq, single))


def test_fp32_perturbed_equals_separate_passes(setup) -> None:
    """FP32 batching is bit-identical too (per-slice BLAS, fixed-order sums)."""
    model, x = setup
    rng = np.random.default_rng(3)
    sets = {}
    for name in ["dw", "grp", "fc"]:
        node = model.node(name)
        assert isinstance(node, (Conv2D, Dense))
        signs = rng.choice(np.array([-1, 1], np.float32), size=(4, *node.weight.shape))
        sets[name] = (node.weight + np.float32(0.01) * signs, np.stack([node.bias] * 4))
    batched = run_fp32_perturbed(model, x, sets, max_bytes=2**14)
    for p in range(4):
        single = run_fp32(model, x, {k: (w[p], b[p]) for k, (w, b) in sets.items()})
        assert np.array_equal(batched[p], single)


def test_prefix_activations_resume_and_take(setup) -> None:
    """Running from a cached prefix, or a subset of it, equals the full pass."""
    model, x = setup
    qm = quantize_model(model, x)
    xq = quantize_input(qm, x)
    pre = prefix_activations(qm, xq, ["grp", "fc"])
    assert set(pre.tensors) == {"t4"} and pre.batch == 6
    np.testing.assert_array_equal(run_int8(qm, pre), run_int8(qm, xq))
    np.testing.assert_array_equal(run_int8(qm, pre.take([4, 1])), run_int8(qm, xq[[4, 1]]))
    sets = _int8_sets(qm, ["fc"], 3, np.random.default_rng(4))
    np.testing.assert_array_equal(
        run_int8_perturbed(qm, pre, sets), run_int8_perturbed(qm, xq, sets)
    )
    fpre = prefix_activations(model, x, "pw")
    assert set(fpre.tensors) == {"t1", "t2"}
    assert np.array_equal(run_fp32(model, fpre), run_fp32(model, x))


def test_errors_name_the_layer(setup) -> None:
    """Shape mismatches raise GraphError naming the layer at fault."""
    model, x = setup
    with pytest.raises(GraphError, match="'fc'"):
        run_fp32(model, x, {"fc": (np.zeros((5, 11), np.float32), np.zeros(5, np.float32))})
    with pytest.raises(GraphError, match="'x'"):
        run_fp32(model, x[:, :8])
    qm = quantize_model(model, x)
    with pytest.raises(GraphError, match="'grp'"):
        run_int8_perturbed(qm, quantize_input(qm, x), {"grp": np.zeros((2, 12, 3, 3, 8), np.int8)})
    bad = Model(
        "bad",
        "x",
        (4,),
        [Dense("d", ["x"], "y", np.zeros((3, 5), np.float32), np.zeros(3, np.float32))],
        "y",
        3,
    )
    with pytest.raises(GraphError, match="'d'"):
        infer_shapes(bad)
    with pytest.raises(GraphError, match="int8"):
        run_int8(qm, x)


def test_bench_engine_reports_timings(setup) -> None:
    """The micro-benchmark runs and reports positive times."""
    model, x = setup
    result = bench_engine(quantize_model(model, x), batch=4, sets=4, trainable=["fc"], repeats=1)
    assert result["single_s"] > 0 and result["batched_s"] > 0 and result["speedup"] > 0


def test_fp32_results_do_not_depend_on_batch(setup) -> None:
    """A sample's FP32 logits are the same bits alone, in a batch, or from a cached prefix."""
    model, x = setup
    whole = run_fp32(model, x)
    one_by_one = np.concatenate([run_fp32(model, x[i : i + 1]) for i in range(len(x))])
    assert np.array_equal(whole, one_by_one)
    pre = prefix_activations(model, x, ["grp"])
    assert np.array_equal(run_fp32(model, pre.take([5, 2])), run_fp32(model, x[[5, 2]]))


def test_small_budget_runs_samples_in_slices(setup) -> None:
    """A budget below one batch slices the samples; no bit changes, in either mode."""
    model, x = setup
    qm = quantize_model(model, x)
    xq = quantize_input(qm, x)
    np.testing.assert_array_equal(run_int8(qm, xq, max_bytes=1), run_int8(qm, xq))
    assert np.array_equal(run_fp32(model, x, max_bytes=1), run_fp32(model, x))
    pre = prefix_activations(qm, xq, "fc", max_bytes=1)
    np.testing.assert_array_equal(pre.tensors["t8"], prefix_activations(qm, xq, "fc").tensors["t8"])


def test_weights_inside_cached_prefix_are_refused(setup) -> None:
    """New weights for a layer the cached prefix already ran raise instead of being ignored."""
    model, x = setup
    qm = quantize_model(model, x)
    xq = quantize_input(qm, x)
    pre = prefix_activations(qm, xq, "grp")
    with pytest.raises(GraphError, match=r"'pw'.*prefix"):
        run_int8_perturbed(qm, pre, _int8_sets(qm, ["pw"], 2, np.random.default_rng(5)))
    with pytest.raises(ValueError, match="no weight sets"):
        run_int8_perturbed(qm, xq, {})
