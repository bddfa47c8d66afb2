"""Imported models on the fleet: C boards (host build and the emulated Cortex-M55) train a
user's .tflite model to the single-process weights, long tensor names and the new
operators (MEAN, PAD, CONCATENATION, MUL, LOGISTIC, HARD_SWISH) included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_firmware_fleet import _assert_same_training, _closed_cleanly, _train, python_pty
from tflite_checks import synthetic_images

from qsched.firmware.native import m55_unavailable_reason, start_host_board
from qsched.firmware.qemu import start_qemu_board
from qsched.firmware.virtual.board import DatasetCatalog
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.blob import encode_dataset_blob
from qsched.zo.data import RESNET8_CIFAR10
from qsched.zo.datasets import load_dataset
from qsched.zo.graph import Concat, Conv2D, Dense, Mean, Model, Mul, Pad, Reshape
from qsched.zo.quantize import quantize_model
from qsched.zo.tflite_io import export_tflite
from qsched.zo.trainer import train_zo
from qsched.zo.workload import Workload

pytestmark = pytest.mark.slow
__all__ = ["python_pty"]  # the fixture, shared with test_firmware_fleet
FIXED4 = PolicySpec(name="fixed", config={"q": 4})


def _mean_pad_backbone(path: Path) -> Path:
    """A small model with PAD, CONCATENATION, MEAN and a MUL channel gate (squeeze and
    excite) for 8x8 digits, quantised and written as .tflite."""
    rng = np.random.default_rng(5)
    nodes = [
        Conv2D("c1", ["input"], "c1", rng.normal(0, 0.5, (4, 3, 3, 1)).astype(np.float32),
               rng.normal(0, 0.1, 4).astype(np.float32), activation="relu"),
        Pad("pad", ["c1"], "pad", pads=((0, 1), (1, 0))),
        *[Conv2D(n, ["pad"], n, rng.normal(0, 0.3, (3, 3, 3, 4)).astype(np.float32),
                 rng.normal(0, 0.1, 3).astype(np.float32), stride=(2, 2), padding="valid",
                 activation="relu") for n in ("c2a", "c2b")],
        Concat("c2", ["c2a", "c2b"], "c2"),
        Mean("squeeze", ["c2"], "squeeze", keep_dims=True),
        Conv2D("gate", ["squeeze"], "gate", rng.normal(0, 0.5, (6, 1, 1, 6)).astype(np.float32),
               rng.normal(0, 0.1, 6).astype(np.float32), activation="relu6"),
        Mul("excite", ["c2", "gate"], "excite"),
        Mean("gap", ["excite"], "gap", keep_dims=True),
        Reshape("flat", ["gap"], "flat", (6,)),
        Dense("head", ["flat"], "head", rng.normal(0, 0.4, (10, 6)).astype(np.float32),
              np.zeros(10, np.float32)),
    ]  # fmt: skip
    model = Model("mean_pad_digits", "input", (8, 8, 1), nodes, "head", 10)
    x = load_dataset("digits").x_train[:64]
    path.write_bytes(export_tflite(quantize_model(model, x)))
    return path


def _dataset_blob(spec: JobSpec, path: Path) -> Path:
    workload = Workload.from_spec(spec)
    assert workload.qmodel is not None
    path.write_bytes(encode_dataset_blob(workload.dataset, workload.qmodel))
    return path


def _held(spec: JobSpec) -> DatasetCatalog:
    """What the Python board holds: the job's data set under the name the daemon selects."""
    data = load_dataset(spec.dataset)
    return DatasetCatalog(preloaded={data.name: data})


async def _on_host_board(
    spec: JobSpec, tmp_path: Path, python_pty: tuple[int, str], *, sanitized: bool = False
) -> None:
    """Train ``spec`` on a host C board and a Python board; assert the reference weights."""
    data = _dataset_blob(spec, tmp_path / "data.qzds")
    board = start_host_board(tmp_path / "c-0", dataset=data, board_id="c-0", sanitized=sanitized)
    boards = ["c-0", "py-0"]
    try:
        paths = [str(board.link_path), python_pty[1]]
        result = await _train(paths, [python_pty[0]], boards, spec, _held(spec))
    finally:
        _closed_cleanly(board)
    _assert_same_training(result, train_zo(spec), boards)


async def _on_m55(spec: JobSpec, tmp_path: Path, python_pty: tuple[int, str]) -> None:
    """Train ``spec`` on the emulated Cortex-M55 and a Python board; assert the reference."""
    data = _dataset_blob(spec, tmp_path / "data.qzds")
    m55 = start_qemu_board(tmp_path / "m55-0", dataset=data)
    boards = ["qemu-an547", "py-0"]
    try:
        paths = [str(m55.link_path), python_pty[1]]
        result = await _train(paths, [python_pty[0]], boards, spec, _held(spec))
    finally:
        m55.close()
    _assert_same_training(result, train_zo(spec), boards)


async def test_imported_resnet8_on_a_c_board_matches_reference(
    tmp_path: Path, python_pty: tuple[int, str]
) -> None:
    """MLPerf Tiny's ResNet-8 (converter names of 40-80 bytes, SOFTMAX kept aside), its head
    fine-tuned by a C board and a Python board: the single-process weights."""
    spec = JobSpec(
        name="r8-fleet",
        dataset="eurosat:size=32,scale=255,limit_per_class=4",
        backbone=str(RESNET8_CIFAR10),
        numerics="int8",
        trainable="last:2",
        steps=4,
        eval_every=4,
        batch_size=8,
        policy=FIXED4,
    )
    await _on_host_board(spec, tmp_path, python_pty)


def _mean_pad_spec(tmp_path: Path) -> JobSpec:
    backbone = _mean_pad_backbone(tmp_path / "mean_pad.tflite")
    return JobSpec(
        name="mean-pad",
        backbone=str(backbone),
        numerics="int8",
        steps=6,
        eval_every=3,
        batch_size=16,
        policy=FIXED4,
    )


async def test_imported_mean_pad_model_on_a_c_board_matches_reference(
    tmp_path: Path, python_pty: tuple[int, str]
) -> None:
    """A model with MEAN, PAD, CONCATENATION and a MUL gate, every layer trained, on a C
    board (sanitizer build) and a Python board: the single-process weights."""
    await _on_host_board(_mean_pad_spec(tmp_path), tmp_path, python_pty, sanitized=True)


@pytest.mark.qemu
@pytest.mark.skipif(m55_unavailable_reason() is not None, reason=str(m55_unavailable_reason()))
async def test_imported_mean_pad_model_on_the_emulated_m55_matches_reference(
    tmp_path: Path, python_pty: tuple[int, str]
) -> None:
    """The same imported model on the emulated Cortex-M55 and a Python board."""
    await _on_m55(_mean_pad_spec(tmp_path), tmp_path, python_pty)


def _fixture_spec(name: str, tmp_path: Path) -> JobSpec:
    """A converter-made fixture's last two layers on a synthetic 16x16x3 data set."""
    path = synthetic_images((16, 16, 3), tmp_path / "synthetic.npz", count=120)
    fixture = Path(__file__).parent / "fixtures" / "tflite" / name
    return JobSpec(
        name="fixture",
        dataset=str(path),
        backbone=str(fixture),
        numerics="int8",
        trainable="last:2",
        steps=4,
        eval_every=4,
        batch_size=8,
        policy=FIXED4,
    )


@pytest.mark.parametrize(
    "name", ["cnn_gap_float_io.tflite", "se_hardswish_int8.tflite", "mobilenetv3_block_int8.tflite"]
)
async def test_converter_fixture_on_a_c_board_matches_reference(
    name: str, tmp_path: Path, python_pty: tuple[int, str]
) -> None:
    """TensorFlow's float-in, float-out CNN (QUANTIZE, MEAN, SOFTMAX, DEQUANTIZE) and its
    squeeze-and-excite CNNs (HARD_SWISH, LOGISTIC, MUL; MobileNetV3's hard_sigmoid gate,
    a MUL by 1/6; the gate's layer trains through them) on a C board and a Python board:
    the single-process weights."""
    await _on_host_board(_fixture_spec(name, tmp_path), tmp_path, python_pty, sanitized=True)


@pytest.mark.qemu
@pytest.mark.skipif(m55_unavailable_reason() is not None, reason=str(m55_unavailable_reason()))
async def test_converter_fixture_on_the_emulated_m55_matches_reference(
    tmp_path: Path, python_pty: tuple[int, str]
) -> None:
    """TensorFlow's int8 squeeze-and-excite CNN (HARD_SWISH, LOGISTIC, MUL, MEAN, SOFTMAX)
    on the emulated Cortex-M55 and a Python board."""
    await _on_m55(_fixture_spec("se_hardswish_int8.tflite", tmp_path), tmp_path, python_pty)
