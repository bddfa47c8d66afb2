"""The model zoo: topologies, names, determinism, sizes."""

import numpy as np
import pytest

from qsched.zo.graph import Add, Conv2D, Dense, GlobalAvgPool, Reshape
from qsched.zo.zoo import (
    ZooError,
    available_models,
    build_model,
    infer_shapes,
    model_options,
    model_summary,
    replace_classifier,
    zoo_table,
)

SMALL = {
    "mlp": ((64,), {}),
    "cnn": ((8, 8, 1), {}),
    "resnet8": ((16, 16, 3), {"width": 0.5}),
    "resnet18": ((16, 16, 3), {"width": 0.125}),
    "mobilenetv2": (
        (16, 16, 3),
        {"width": 0.35, "stages": 4, "max_repeats": 2, "last_channels": 64},
    ),
}


def test_available_models_lists_all_five():
    """The zoo offers the five documented models."""
    assert available_models() == ["cnn", "mlp", "mobilenetv2", "resnet18", "resnet8"]


@pytest.mark.parametrize("name", sorted(SMALL))
def test_build_model_names_unique_and_output_shape(name):
    """Layer and tensor names are unique and the output is (num_classes,)."""
    shape, options = SMALL[name]
    model = build_model(name, shape, 7, seed=1, **options)
    names = [n.name for n in model.nodes]
    outputs = [n.output for n in model.nodes]
    assert len(set(names)) == len(names)
    assert len(set(outputs)) == len(outputs) and model.input_name not in outputs
    assert infer_shapes(model)[model.output_name] == (7,)
    assert model.num_classes == 7 and model.input_shape == shape


@pytest.mark.parametrize("name", sorted(SMALL))
def test_build_model_deterministic_per_seed(name):
    """The same seed gives the same weights; another seed gives other weights."""
    shape, options = SMALL[name]
    a, b, c = (build_model(name, shape, 10, seed=s, **options) for s in (3, 3, 4))
    for na, nb, nc in zip(a.param_nodes(), b.param_nodes(), c.param_nodes(), strict=True):
        assert na.weight.dtype == np.float32
        assert np.array_equal(na.weight, nb.weight) and np.array_equal(na.bias, nb.bias)
        assert not np.array_equal(na.weight, nc.weight)


def test_mlp_digits_topology_and_counts():
    """The default MLP is 64 -> 32 -> 10 with ReLU: 2,410 parameters."""
    model = build_model("mlp", (64,), 10, seed=0)
    dense = model.param_nodes()
    assert [n.name for n in dense] == ["dense_1", "dense_2"]
    assert [n.weight.shape for n in dense] == [(32, 64), (10, 32)]
    assert [n.activation for n in dense] == ["relu", "none"]
    assert model_summary(model) == (64 * 32 + 32 + 32 * 10 + 10, 64 * 32 + 32 * 10)


def test_mlp_hidden_option_and_image_input():
    """Hidden sizes are an option; an image input is flattened first."""
    model = build_model("mlp", (8, 8, 1), 10, seed=0, hidden=(16, 12))
    assert isinstance(model.nodes[0], Reshape) and model.nodes[0].shape == (64,)
    assert [n.weight.shape for n in model.param_nodes()] == [(16, 64), (12, 16), (10, 12)]


def test_cnn_macs_match_hand_count():
    """The CNN's MACs are the sum over conv and dense layers computed by hand."""
    model = build_model("cnn", (8, 8, 1), 10, seed=0)
    conv1 = 8 * 8 * 8 * 9 * 1
    conv2 = 4 * 4 * 16 * 9 * 8
    dense = 4 * 4 * 16 * 10
    params = (8 * 9 + 8) + (16 * 9 * 8 + 16) + (256 * 10 + 10)
    assert model_summary(model) == (params, conv1 + conv2 + dense)


def test_cnn_gap_head():
    """head='gap' ends with global average pooling before the classifier."""
    model = build_model("cnn", (8, 8, 1), 10, seed=0, head="gap")
    assert isinstance(model.nodes[-2], GlobalAvgPool)
    assert model.param_nodes()[-1].weight.shape == (10, 16)


def test_resnet8_matches_mlperf_tiny_size():
    """ResNet-8 at 32x32x3 has MLPerf Tiny's 78k parameters and 12.5M MACs (BN folded)."""
    params, macs = model_summary(build_model("resnet8", (32, 32, 3), 10, seed=0))
    assert 77_000 < params < 79_000
    assert 12_000_000 < macs < 13_000_000


def test_resnet_downsampling_uses_1x1_stride2_shortcut():
    """A stage's first block downsamples with a 1x1 stride-2 shortcut conv and an Add."""
    model = build_model("resnet8", (32, 32, 3), 10, seed=0)
    sc = model.node("stage2.block1.shortcut")
    assert isinstance(sc, Conv2D) and sc.weight.shape[1:3] == (1, 1) and sc.stride == (2, 2)
    add = model.node("stage2.block1.add")
    assert isinstance(add, Add) and set(add.inputs) == {
        "stage2.block1.conv2",
        "stage2.block1.shortcut",
    }
    assert infer_shapes(model)["stage3.block1.add"] == (8, 8, 64)


def test_resnet18_has_four_stages_of_two_blocks():
    """ResNet-18 has 8 residual Adds, 3 shortcut convs and widths 64..512 x width."""
    model = build_model("resnet18", (32, 32, 3), 10, seed=0, width=0.25)
    adds = [n.name for n in model.nodes if isinstance(n, Add)]
    assert adds == [f"stage{s}.block{b}.add" for s in range(1, 5) for b in (1, 2)]
    assert [n.name for n in model.nodes if n.name.endswith("shortcut")] == [
        f"stage{s}.block1.shortcut" for s in (2, 3, 4)
    ]
    last = model.node("stage4.block2.conv2")
    assert isinstance(last, Conv2D) and last.weight.shape[0] == 128


def test_resnet18_imagenet_stem_for_large_inputs():
    """At 96x96 and above the stem is a 7x7 stride-2 conv and a max pool."""
    model = build_model("resnet18", (96, 96, 3), 10, seed=0)
    stem = model.node("stem.conv")
    assert isinstance(stem, Conv2D) and stem.weight.shape[1:3] == (7, 7)
    assert infer_shapes(model)["stem.pool"][:2] == (24, 24)


def test_mobilenetv2_inverted_residuals():
    """MobileNetV2 blocks: 1x1 expand relu6, depthwise 3x3 relu6, linear project, Add at
    stride 1."""
    model = build_model("mobilenetv2", (32, 32, 3), 10, seed=0, width=0.35)
    expand, dw, project = (
        model.node(f"stage2.block2.{p}") for p in ("expand", "depthwise", "project")
    )
    assert (
        isinstance(expand, Conv2D)
        and expand.activation == "relu6"
        and expand.weight.shape[1:3] == (1, 1)
    )
    assert (
        isinstance(dw, Conv2D)
        and dw.depthwise
        and dw.weight.shape == (1, 3, 3, expand.weight.shape[0])
    )
    assert dw.groups == expand.weight.shape[0] and dw.activation == "relu6"
    assert isinstance(project, Conv2D) and project.activation == "none"
    assert isinstance(model.node("stage2.block2.add"), Add)
    names = {n.name for n in model.nodes}
    assert "stage2.block1.add" not in names  # stride 2: no residual


def test_mobilenetv2_reduced_depth_is_smaller():
    """Fewer stages and repeats shrink the parameter count."""
    full, _ = model_summary(build_model("mobilenetv2", (32, 32, 3), 10, seed=0))
    small, _ = model_summary(
        build_model(
            "mobilenetv2", (32, 32, 3), 10, seed=0, stages=4, max_repeats=2, last_channels=128
        )
    )
    assert small < full / 4


def test_he_init_scale():
    """Conv weights are drawn with standard deviation sqrt(2 / fan_in)."""
    model = build_model("resnet18", (32, 32, 3), 10, seed=0, width=1.0)
    conv = model.node("stage4.block1.conv1")
    assert isinstance(conv, Conv2D)
    w = conv.weight
    fan_in = 3 * 3 * 256
    assert abs(float(w.std()) - np.sqrt(2 / fan_in)) < 0.02 * np.sqrt(2 / fan_in)


def test_build_model_rejects_unknown_name_and_option():
    """Unknown models and options raise ZooError naming the alternatives."""
    with pytest.raises(ZooError, match="available"):
        build_model("vgg", (8, 8, 1), 10, 0)
    with pytest.raises(ZooError, match="depth"):
        build_model("cnn", (8, 8, 1), 10, 0, depth=3)
    with pytest.raises(ZooError, match="H, W, C"):
        build_model("resnet8", (64,), 10, 0)


def test_zoo_table_lists_every_model():
    """The table has one row per model with its parameter count."""
    table = zoo_table()
    for name in available_models():
        params, _ = model_summary(build_model(name))
        row = next(line for line in table.splitlines() if line.startswith(name + " "))
        assert f"{params:,}" in row


def test_zoo_table_lists_options_with_their_defaults():
    """Each model's options line names every option; building with them changes nothing."""
    table = zoo_table()
    for name in available_models():
        options = model_options(name)
        line = next(line for line in table.splitlines() if line.startswith(f"  {name} "))
        assert all(f"{key}={value!r}" in line for key, value in options.items())
        spelled_out = build_model(name, **options)
        assert model_summary(spelled_out) == model_summary(build_model(name))
    assert model_options("mobilenetv2")["width"] == 0.35
    with pytest.raises(ZooError, match="unknown model"):
        model_options("vgg")


def test_dense_classifier_is_last():
    """Every model ends with a Dense classifier writing the output tensor."""
    for name, (shape, options) in SMALL.items():
        model = build_model(name, shape, 5, seed=0, **options)
        assert isinstance(model.nodes[-1], Dense) and model.nodes[-1].output == model.output_name


def test_replace_classifier_new_head_same_backbone():
    """replace_classifier keeps every backbone weight and gives a fresh head of the new size."""
    model = build_model("cnn", (8, 8, 1), 10, seed=0)
    new = replace_classifier(model, 4, seed=1)
    assert new.num_classes == 4 and infer_shapes(new)[new.output_name] == (4,)
    for old, kept in zip(model.param_nodes()[:-1], new.param_nodes()[:-1], strict=True):
        assert kept.name == old.name and np.array_equal(kept.weight, old.weight)
        assert kept.weight is not old.weight
    assert new.nodes[-1].name == "dense_1" and new.param_nodes()[-1].weight.shape == (4, 256)
    assert model.num_classes == 10 and model.param_nodes()[-1].weight.shape == (10, 256)


@pytest.mark.parametrize(
    ("value", "words"),
    [(-5, "must not be negative"), (float("nan"), "must not be negative"), (0, "options")],
)
def test_zoo_bad_sizes_name_the_option(value: object, words: str) -> None:
    """A negative, NaN or zero size is a ZooError naming the model's options."""
    with pytest.raises(ZooError, match=words) as refused:
        build_model("mlp", hidden=value)
    assert "hidden" in str(refused.value) and "'mlp'" in str(refused.value)
