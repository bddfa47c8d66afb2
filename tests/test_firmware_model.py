"""The C INT8 model runtime against the Python engine: every op, bit for bit; the memory budget."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from qsched.firmware.budget import memory_budget
from qsched.firmware.native import ToolProcess
from qsched.protocol.jobspec import JobSpec
from qsched.zo import engine
from qsched.zo.blob import encode_blob
from qsched.zo.graph import AvgPool, Conv2D, Dense, MaxPool, Model, ReLU, ReLU6, Reshape
from qsched.zo.quantize import quantize_input, quantize_model
from qsched.zo.workload import Workload
from qsched.zo.zoo import build_model


@pytest.fixture(scope="module")
def tool() -> Iterator[ToolProcess]:
    """The sanitizer build of the C test tool."""
    with ToolProcess(sanitized=True) as proc:
        yield proc


def _weights(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.3).astype(np.float32)


def _every_op_model() -> Model:
    """A graph with the ops the zoo does not use: pools with padding, grouped conv, ReLU(6)
    nodes."""
    rng = np.random.default_rng(5)
    nodes = [
        Conv2D(
            "conv", ["input"], "conv", _weights(rng, 8, 3, 3, 4), _weights(rng, 8), padding="same"
        ),
        ReLU("relu", ["conv"], "relu"),
        MaxPool("maxpool", ["relu"], "maxpool", pool=(3, 3), stride=(2, 2), padding="same"),
        Conv2D(
            "grouped",
            ["maxpool"],
            "grouped",
            _weights(rng, 8, 3, 3, 4),
            _weights(rng, 8),
            groups=2,
            padding="same",
            activation="relu6",
        ),
        Conv2D(
            "dw",
            ["grouped"],
            "dw",
            _weights(rng, 1, 3, 3, 16),
            _weights(rng, 16),
            stride=(2, 2),
            padding="same",
            groups=8,
            depthwise=True,
        ),
        ReLU6("relu6", ["dw"], "relu6"),
        AvgPool("avgpool", ["relu6"], "avgpool", pool=(3, 3), stride=(1, 1), padding="same"),
        Reshape("flatten", ["avgpool"], "flatten", shape=(64,)),
        Dense("dense", ["flatten"], "dense", _weights(rng, 10, 64), _weights(rng, 10)),
    ]
    return Model("every_op", "input", (8, 8, 4), nodes, "dense", 10)


MODELS = {
    "mlp": lambda: build_model("mlp", (8, 8, 1), 10, seed=1),
    "cnn_gap": lambda: build_model("cnn", (8, 8, 1), 10, seed=1, head="gap"),
    "resnet8": lambda: build_model("resnet8", (8, 8, 3), 10, seed=1),
    "mobilenetv2": lambda: build_model("mobilenetv2", (16, 16, 3), 10, seed=1),
    "every_op": _every_op_model,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_forward_matches_engine(tool: ToolProcess, tmp_path: Path, name: str) -> None:
    """Logits of the C runtime equal engine.run_int8's for zoo models and every op."""
    model = MODELS[name]()
    x = np.random.default_rng(0).uniform(0, 1, (48, *model.input_shape)).astype(np.float32)
    qmodel = quantize_model(model, x)
    path = tmp_path / f"{name}.qzmb"
    path.write_bytes(encode_blob(qmodel))
    xq = quantize_input(qmodel, x[:6])
    want = engine.run_int8(qmodel, xq).astype(np.int8)
    assert tool.ask(f"forward {path} {xq.tobytes().hex()}") == want.tobytes().hex()


def test_model_rejects_corrupt_blobs(tool: ToolProcess, tmp_path: Path) -> None:
    """A flipped byte, a truncated blob or a wrong magic is refused, never run."""
    model = MODELS["cnn_gap"]()
    blob = bytearray(
        encode_blob(quantize_model(model, np.zeros((4, *model.input_shape), np.float32)))
    )
    cases = {
        "flip": blob[:200] + bytes([blob[200] ^ 1]) + blob[201:],
        "short": blob[:-3],
        "magic": b"XZMB" + blob[4:],
    }
    for label, data in cases.items():
        path = tmp_path / f"{label}.qzmb"
        path.write_bytes(bytes(data))
        assert tool.ask(f"forward {path} 00").startswith("err "), label


def test_model_budget_matches_c_runtime(tool: ToolProcess, tmp_path: Path) -> None:
    """The Python memory budget (README table) equals what the C runtime prepares."""
    workload = Workload.from_spec(JobSpec(model="cnn", dataset="digits"))
    budget = memory_budget(workload)
    path = tmp_path / "cnn.qzmb"
    path.write_bytes(workload.model_blob())
    assert tool.ask(f"budget {path}") == f"{budget.blob} {budget.params} {budget.arena}"


def test_model_survives_mutated_blobs(tool: ToolProcess, tmp_path: Path) -> None:
    """Random byte mutations of a valid blob (CRC fixed up) never crash the sanitizer build."""
    import struct
    import zlib

    model = MODELS["resnet8"]()
    blob = bytearray(
        encode_blob(quantize_model(model, np.zeros((4, *model.input_shape), np.float32)))
    )
    rng = np.random.default_rng(21)
    body_end = (
        64
        + 1024
        + 52 * struct.unpack_from("<H", blob, 8)[0]
        + 140 * struct.unpack_from("<H", blob, 10)[0]
    )
    refused = 0
    for i in range(60):
        data = bytearray(blob)
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(64, body_end))  # headers and records, where the structure is
            data[pos] = int(rng.integers(0, 256))
        struct.pack_into("<I", data, 28, zlib.crc32(bytes(data[64:])))
        path = tmp_path / f"m{i}.qzmb"
        path.write_bytes(bytes(data))
        answer = tool.ask(f"forward {path} {'00' * 192}")
        refused += answer.startswith("err ")
    assert refused > 0  # most mutations of records are caught by Prepare
