"""Models made the ordinary way: Keras models converted by TensorFlow's TFLiteConverter
with full-integer quantisation (``tests/fixtures/tflite/``, made by ``make_fixtures.py``).
Each imports, equals LiteRT's reference kernels bit for bit from the file's own input
type, trains its last layer through ``qsched train``, exports in its own form and is
described by ``qsched inspect``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tflite_checks import assert_every_tensor, interpreter, invoke, synthetic_images

from qsched.daemon.train import main as train_main
from qsched.firmware.model_report import main as inspect_main
from qsched.zo._tflite_common import pack_model, schema
from qsched.zo.graph import QuantModel
from qsched.zo.quantize import quantize_input
from qsched.zo.tflite_io import export_tflite, import_tflite, read_tflite

FIXTURES = Path(__file__).parent / "fixtures" / "tflite"
FILES = sorted(p.name for p in FIXTURES.glob("*.tflite"))
_BATCH = 3


def _file_input(qm: QuantModel, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A batch in the file's own input type, and what the engine is fed for it."""
    assert qm.source is not None
    x = rng.random((_BATCH, *qm.model.input_shape), dtype=np.float32)
    if qm.source.input.dtype == "float32":
        return x, quantize_input(qm, x)
    pixels = np.round(x * 255).astype(np.int64)
    if qm.source.input.dtype == "uint8":
        return pixels.astype(np.uint8), (pixels - 128).astype(np.int8)
    return (pixels - 128).astype(np.int8), (pixels - 128).astype(np.int8)


def _up_to_logits(data: bytes, qm: QuantModel) -> bytes:
    """The file without its output adapters (its graph output: the int8 logits).

    LiteRT's reference SOFTMAX aborts the process in Prepare on logits as wide as the
    random MobileNetV2's (a CHECK on its fixed-point input scaling); the adapters are
    not what is trained, so the comparison stops at the logits.
    """
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    graph = model.subgraphs[0]
    names = [t.name.decode() for t in graph.tensors]
    logits = names.index(qm.model.output_name)
    last = next(i for i, op in enumerate(graph.operators) if logits in list(op.outputs))
    graph.operators, graph.outputs = graph.operators[: last + 1], [logits]
    return pack_model(model)


def test_fixtures_are_all_here() -> None:
    """The converter-made files, each under 1 MB, with their README."""
    assert len(FILES) == 9 and (FIXTURES / "README.md").exists()
    assert all((FIXTURES / f).stat().st_size < 1 << 20 for f in FILES)


@pytest.mark.parametrize("name", FILES)
def test_fixture_bit_exact_from_its_own_input(name: str) -> None:
    """Fed in the file's input type (float32, uint8 or int8), LiteRT's every tensor of the
    trained graph equals the engine's."""
    qm = read_tflite(FIXTURES / name)
    fed, x = _file_input(qm, np.random.default_rng(1))
    it = interpreter(_up_to_logits((FIXTURES / name).read_bytes(), qm), fed.shape)
    assert_every_tensor(qm, invoke(it, fed), x)


@pytest.mark.parametrize("name", FILES)
def test_fixture_exports_in_its_own_form(name: str) -> None:
    """Untouched, the export is the file itself; the signature is the file's."""
    data = (FIXTURES / name).read_bytes()
    qm = import_tflite(data)
    assert export_tflite(qm) == data
    it = interpreter(export_tflite(qm), (_BATCH, *qm.model.input_shape), reference=False)
    source = qm.source
    assert source is not None
    assert it.get_input_details()[0]["dtype"] == np.dtype(source.input.dtype)
    assert it.get_output_details()[0]["dtype"] == np.dtype(source.output.dtype)


@pytest.mark.parametrize("name", FILES)
def test_fixture_trains_last_layer_and_new_head(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`qsched train` fine-tunes the last layer (export: the file's form, only the head's
    weights changed) and, with ``head: new``, a fresh head (export: qsched's own form)."""
    shape = read_tflite(FIXTURES / name).model.input_shape
    data = synthetic_images(shape, tmp_path / "data.npz")
    base = {
        "name": "fx",
        "dataset": str(data),
        "backbone": str(FIXTURES / name),
        "numerics": "int8",
        "trainable": "last:1",
        "steps": 6,
        "eval_every": 3,
        "batch_size": 8,
        "policy": {"name": "fixed", "config": {"q": 2}},
    }
    for head, form in (("keep", "source"), ("new", "own")):
        spec = {**base, "model_options": {"head": head}}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        out = tmp_path / f"run-{head}"
        assert train_main(["--spec", str(tmp_path / "spec.json"), "--out", str(out)]) == 0
        exported = import_tflite((out / "export" / "fx.tflite").read_bytes())
        original = (FIXTURES / name).read_bytes()
        assert exported.source is not None
        if form == "source":
            assert exported.source.input == import_tflite(original).source.input  # type: ignore[union-attr]
            assert len(exported.source.data) == len(original)
        else:
            assert exported.source.input.dtype == "int8" and exported.source.output_ops == ()
    capsys.readouterr()


def test_fixture_mobilenetv2_inspect(capsys: pytest.CaptureFixture[str]) -> None:
    """qsched inspect on MobileNetV2 0.35: 66 operators, depthwise layers, board memory."""
    assert inspect_main([str(FIXTURES / "mobilenetv2_a035_int8.tflite")]) == 0
    out = capsys.readouterr().out
    assert "DEPTHWISE_CONV_2D" in out and "MEAN" in out and "| last layer |" in out
    assert "UNSUPPORTED" not in out


@pytest.mark.parametrize("name", FILES)
def test_fixture_inspect_lists_every_operator(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """qsched inspect on every fixture: one row per operator of the file, none refused,
    and the board memory of the trained layers."""
    data = (FIXTURES / name).read_bytes()
    model = schema.Model.GetRootAs(data, 0)
    count = model.Subgraphs(0).OperatorsLength()
    assert inspect_main([str(FIXTURES / name)]) == 0
    out = capsys.readouterr().out
    assert "UNSUPPORTED" not in out and "Does not import" not in out
    assert f"| {count - 1} |" in out and "| last layer |" in out
