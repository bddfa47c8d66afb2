"""``qsched inspect``: a user's model file described, supported or not."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_zo_tflite_import_real import _with_opcodes

from qsched.firmware.model_report import main
from qsched.zo._tflite_common import schema
from qsched.zo.data import RESNET8_CIFAR10


def test_inspect_real_model(capsys: pytest.CaptureFixture[str]) -> None:
    """ResNet-8: its edges, all 16 operators with their roles, the layers and board memory."""
    assert main([str(RESNET8_CIFAR10)]) == 0
    out = capsys.readouterr().out
    assert "- input: `input_1_int8` int8 [-1, 32, 32, 3] scale 1 zp -128" in out
    assert "after SOFTMAX" in out and "| 15 | SOFTMAX | Identity_int8 [1, 10] | adapter" in out
    assert out.count(" | layer |\n") == 15
    assert "## Layers (77,706 parameters, 12,501,632 MACs per sample)" in out
    assert "| 13 | model/dense/MatMul;model/dense/BiasAdd | Dense | [10] | 650 | 640 | yes |" in out
    assert "| last layer | 640 |" in out and "| all layers | 77360 |" in out


def test_inspect_lists_every_unsupported_operator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file qsched cannot train: every operator still listed, the unknown ones marked, and
    the reason; status 1."""
    op = schema.BuiltinOperator
    path = tmp_path / "odd.tflite"
    path.write_bytes(_with_opcodes(RESNET8_CIFAR10.read_bytes(), {op.ADD: op.TANH}))
    assert main([str(path)]) == 1
    out = capsys.readouterr().out
    assert out.count("| UNSUPPORTED |") == 3 and "| 3 | TANH |" in out
    assert "Does not import: unsupported operators: TANH (operators #3, #7, #11)" in out


def test_inspect_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a model: one line and status 1; a missing file: status 2 and one line."""
    junk = tmp_path / "junk.tflite"
    junk.write_bytes(b"\x00" * 64)
    assert main([str(junk)]) == 1
    assert (
        capsys.readouterr().out.strip()
        == f"{junk}: not a .tflite file: missing the TFL3 file identifier"
    )
    assert main([str(tmp_path / "absent.tflite")]) == 2
    assert "No such file" in capsys.readouterr().err
