"""A real model a user brings: MLPerf Tiny's pretrained int8 ResNet-8 (CIFAR-10, made by
TensorFlow's converter) imports, runs bit-exact against LiteRT's reference kernels, and
exports back in its own form."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tflite_checks import assert_every_tensor, assert_only_layer_changed, interpreter, invoke

from qsched.zo._tflite_common import pack_model, schema
from qsched.zo.data import RESNET8_CIFAR10
from qsched.zo.engine import run_int8
from qsched.zo.graph import QuantizedLayer
from qsched.zo.tflite_io import TFLiteError, export_tflite, import_tflite, read_tflite

RESNET8 = RESNET8_CIFAR10
_BATCH = 4


def _images(seed: int = 0) -> np.ndarray:
    """CIFAR-like int8 input: the file's input is pixels 0..255 at scale 1, zero point -128."""
    rng = np.random.default_rng(seed)
    return rng.integers(-128, 128, size=(_BATCH, 32, 32, 3), dtype=np.int8)


def test_import_real_resnet8_signature_and_adapters() -> None:
    """The file's int8 input and SOFTMAX output are kept as its signature; the trained
    graph ends at the int8 logits of the dense layer."""
    qm = read_tflite(RESNET8)
    assert qm.model.input_shape == (32, 32, 3) and qm.model.num_classes == 10
    source = qm.source
    assert source is not None and source.output_ops == ("SOFTMAX",) and source.input_ops == ()
    assert source.input.describe() == "int8 [-1, 32, 32, 3] scale 1 zp -128"
    assert source.output.describe() == "int8 [-1, 10] scale 0.00390625 zp -128"
    assert qm.model.nodes[-1].name.startswith("model/dense/")
    assert len(qm.model.param_nodes()) == 10


def test_import_real_resnet8_bit_exact_every_tensor() -> None:
    """Every activation of the engine equals LiteRT's on the user's own file."""
    qm = read_tflite(RESNET8)
    x = _images()
    assert_every_tensor(qm, invoke(interpreter(RESNET8.read_bytes(), x.shape), x), x)
    assert len(np.unique(run_int8(qm, x))) > 10


def test_import_real_resnet8_exports_its_own_form() -> None:
    """Unchanged weights export to the very bytes read; trained ones change only weight
    bytes, and LiteRT on the exported file gives the engine's logits."""
    data = RESNET8.read_bytes()
    qm = import_tflite(data)
    assert export_tflite(qm) == data
    rng = np.random.default_rng(1)
    dense = qm.model.nodes[-1].name
    old = qm.layers[dense]
    moved = np.clip(old.weight.astype(np.int16) + rng.integers(-3, 4, old.weight.shape), -127, 127)
    qm.layers[dense] = QuantizedLayer(moved.astype(np.int8), old.weight_scales, old.bias)
    exported = export_tflite(qm)
    assert_only_layer_changed(exported, data, qm, dense)
    x = _images(2)
    it = interpreter(exported, x.shape)
    np.testing.assert_array_equal(run_int8(qm, x), invoke(it, x)(qm.model.output_name))
    assert it.get_output_details()[0]["dtype"] == np.int8  # still the file's softmax output


def test_import_real_resnet8_own_form_still_available() -> None:
    """``own_form`` writes qsched's own file (int8 logits out, no SOFTMAX), which reads back."""
    qm = read_tflite(RESNET8)
    back = import_tflite(export_tflite(qm, own_form=True))
    assert back.source is not None and back.source.output_ops == ()
    x = _images(3)
    np.testing.assert_array_equal(run_int8(back, x), run_int8(qm, x))


def _with_opcodes(data: bytes, renames: dict[int, int]) -> bytes:
    """The file with some operator codes replaced (an operator qsched lacks, say)."""
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    for code in model.operatorCodes:
        new = renames.get(max(code.builtinCode, code.deprecatedBuiltinCode))
        if new is not None:
            code.builtinCode = code.deprecatedBuiltinCode = new
    return pack_model(model)


def test_import_errors_name_the_file_and_every_operator(tmp_path: Path) -> None:
    """Unknown operators: one TFLiteError naming the path and every one, with its places."""
    op = schema.BuiltinOperator
    renames = {op.ADD: op.TANH, op.AVERAGE_POOL_2D: op.ELU}
    path = tmp_path / "user model.tflite"
    path.write_bytes(_with_opcodes(RESNET8.read_bytes(), renames))
    with pytest.raises(TFLiteError) as info:
        read_tflite(path)
    message = str(info.value)
    assert message.startswith(f"{path}: unsupported operators: ")
    assert "TANH (operators #3, #7, #11)" in message and "ELU (operator #12)" in message
    path.write_bytes(b"not a model at all")
    with pytest.raises(TFLiteError, match=r"user model\.tflite: not a \.tflite file"):
        read_tflite(path)


def test_import_real_resnet8_trains_and_exports_in_its_own_form(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`qsched train` fine-tunes ResNet-8's last layer on EuroSAT at 32x32 (pixels 0..255,
    as the file's input expects); the exported file keeps the original signature and
    LiteRT on it gives the trained engine's logits."""
    from qsched.daemon.train import main

    spec = {
        "name": "r8",
        "dataset": "eurosat:size=32,scale=255",
        "backbone": str(RESNET8),
        "numerics": "int8",
        "trainable": "last:1",
        "steps": 12,
        "eval_every": 6,
        "batch_size": 16,
        "policy": {"name": "fixed", "config": {"q": 4}},
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert main(["--spec", str(path), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    exported = (tmp_path / "run" / "export" / "r8.tflite").read_bytes()
    trained = import_tflite(exported)
    # Only the head moved.
    assert_only_layer_changed(exported, RESNET8.read_bytes(), trained, trained.model.nodes[-1].name)
    x = _images(4)
    it = interpreter(exported, x.shape)
    details = it.get_input_details()[0], it.get_output_details()[0]
    assert [d["dtype"] for d in details] == [np.int8, np.int8]
    assert details[1]["quantization"] == (0.00390625, -128)  # SOFTMAX's output, as before
    tensor = invoke(it, x)
    np.testing.assert_array_equal(run_int8(trained, x), tensor(trained.model.output_name))


def test_readme_example_spec_resolves() -> None:
    """The README's job spec is valid, and its backbone and data set load (from the
    repository root, where the README's commands run)."""
    from qsched.protocol.jobspec import JobSpec
    from qsched.zo.workload import Workload

    root = Path(__file__).parents[1]
    spec = JobSpec.model_validate(
        json.loads((root / "docs/examples/resnet8-eurosat.json").read_text())
    )
    assert spec.backbone is not None and (root / spec.backbone).exists()
    spec = spec.model_copy(update={"backbone": str(root / spec.backbone)})
    workload = Workload.from_spec(spec)
    assert workload.trainable_layers == [workload.model.nodes[-1].name]
    assert workload.dataset.name == "eurosat32x255"  # the name the README's boards hold
