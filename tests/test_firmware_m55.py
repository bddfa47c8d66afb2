"""The firmware on an emulated Cortex-M55 (QEMU mps3-an547): self-test and a training session."""

from __future__ import annotations

import os
import re
import tty
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from qsched.firmware.native import BoardClient, m55_unavailable_reason
from qsched.firmware.qemu import QemuBoard, run_selftest, start_qemu_board
from qsched.protocol.identity import dataset_hash64
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.messages import (
    ApplyUpdate,
    EvalRequest,
    EvalResult,
    Hello,
    Loaded,
    SelectDataset,
    UpdateAck,
    ValidateRequest,
    ValidateResult,
    job_config,
)
from qsched.zo import accum_int8
from qsched.zo.blob import encode_dataset_blob
from qsched.zo.prng import batch_indices
from qsched.zo.update import apply_int8_fp16
from qsched.zo.workload import Workload

pytestmark = [
    pytest.mark.qemu,
    pytest.mark.skipif(m55_unavailable_reason() is not None, reason=str(m55_unavailable_reason())),
]

# The update series of m55/selftest_main.c, replayed here.
DIGEST_SEED = 0x0123456789ABCDEF
DIGEST_WEIGHTS = 1000
KINDS = (
    "frame",
    "stream",
    "msg",
    "bad",
    "philox",
    "rademacher",
    "batch",
    "fp32",
    "int8_fp16",
    "log2",
    "table",
    "loss",
)


@pytest.fixture(scope="module")
def selftest_line() -> str:
    """The result line of the self-test image."""
    return run_selftest()


def test_m55_selftest_passes_every_vector(selftest_line: str) -> None:
    """The protocol's vectors all pass on the Cortex-M55, every kind counted, none skipped."""
    assert selftest_line.startswith("QS-SELFTEST PASS"), selftest_line
    counts = dict(re.findall(r"(\w+)=(\d+)/0", selftest_line))
    for kind in KINDS:
        assert int(counts.get(kind, 0)) > 0, f"{kind} not exercised: {selftest_line}"
    assert " skipped=0 " in selftest_line


def test_m55_selftest_digest_equals_python(selftest_line: str) -> None:
    """Five INT8 + FP16 updates on the M55 end with the checksum numpy computes."""
    weights = ((np.arange(DIGEST_WEIGHTS) * 37) % 255 - 127).astype(np.int8)
    buffer = np.zeros(DIGEST_WEIGHTS, dtype=np.float16)
    for t in range(5):
        bits = [0x3E000000 + k * 0x123457 + t * 0x7771 + ((k & 1) << 31) for k in range(8)]
        cs = np.array(bits, dtype=np.uint32).view(np.float32)
        weights, buffer = apply_int8_fp16(
            weights, buffer, DIGEST_SEED, t, [(3 * k, float(c)) for k, c in enumerate(cs)]
        )
    digest = zlib.crc32(buffer.astype("<f2").tobytes(), zlib.crc32(weights.tobytes()))
    batch = zlib.crc32(batch_indices(DIGEST_SEED, 3, 64, 1797).astype("<u4").tobytes())
    assert f" digest={digest:x} " in selftest_line
    assert selftest_line.endswith(f" batch={batch:x}")


def test_m55_selftest_int8_accumulator_equals_python(selftest_line: str) -> None:
    """34 updates with the INT8 accumulator (two rescales) on the M55 end as numpy's."""
    sizes = [600, 7, 393]
    weights = ((np.arange(DIGEST_WEIGHTS) * 37) % 255 - 127).astype(np.int8)
    state = accum_int8.initial_state(sizes)
    refined = []
    for t in range(34):
        exponent = 0x3A000000 if t < 16 else 0x40000000
        bits = [exponent + k * 0x12345 + t * 0x777 + ((k & 1) << 31) for k in range(8)]
        cs = np.array(bits, dtype=np.uint32).view(np.float32)
        weights, state = accum_int8.apply(
            weights, state, sizes, DIGEST_SEED, t, [(3 * k, float(c)) for k, c in enumerate(cs)]
        )
        if t == 15:
            refined = state[-3:].tolist()
    assert min(refined) > 7  # the series does exercise the rescaling
    digest = zlib.crc32(state.tobytes(), zlib.crc32(weights.tobytes()))
    assert f" acc8={digest:x} " in selftest_line


@pytest.fixture
def m55_board(
    tmp_path: Path, default_job: tuple[JobSpec, Workload, Path]
) -> Iterator[tuple[QemuBoard, BoardClient]]:
    """The C agent on QEMU's Cortex-M55 holding the digits data set, and a client on its pty."""
    board = start_qemu_board(tmp_path / "m55-0", dataset=default_job[2])
    fd = os.open(board.link_path, os.O_RDWR | os.O_NOCTTY)
    tty.setraw(fd)
    try:
        yield board, BoardClient(fd)
    finally:
        os.close(fd)
        board.close()


@pytest.fixture(scope="module")
def default_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobSpec, Workload, Path]:
    """The default model (mlp on digits, INT8) and its data set blob."""
    spec = JobSpec(seed=11, batch_size=16)
    workload = Workload.from_spec(spec)
    assert workload.qmodel is not None
    path = tmp_path_factory.mktemp("m55") / "digits.qzds"
    path.write_bytes(encode_dataset_blob(workload.dataset, workload.qmodel))
    return spec, workload, path


def test_m55_board_trains_like_python(
    m55_board: tuple[QemuBoard, BoardClient], default_job: tuple[JobSpec, Workload, Path]
) -> None:
    """Over its pty, the emulated M55 returns Python's losses and checksums at every step."""
    _, client = m55_board
    spec, wl, _ = default_job
    config = job_config(spec)
    first = client.recv(timeout=15)  # the Hello, repeated when our first message arrives
    ds = wl.dataset
    select = SelectDataset(
        name=ds.name,
        dataset_hash=dataset_hash64(ds.content_hash),
        train_size=len(ds.x_train),
        val_size=len(ds.x_val),
    )
    if not isinstance(first, Hello):
        pytest.fail(f"expected a Hello, got {first!r}")
    answers = client.load_job(wl.model_blob(), select, config)
    assert all(isinstance(a, Loaded) for a in answers), answers
    state = wl.initial_state()
    for step, ks in enumerate(((0, 1, 2), (4, 7))):
        result = client.request(
            EvalRequest(
                job_id=config.job_id,
                step=step,
                batch_size=16,
                eps=1.0,
                estimator="two_sided",
                ks=ks,
            )
        )
        want = wl.perturbed_losses(state, step, ks)
        assert isinstance(result, EvalResult), result
        assert result.loss_plus == tuple(want.plus[k] for k in ks)
        assert result.loss_minus == tuple(want.minus[k] for k in ks)
        coefficients = tuple(0.375 * (i + 1) * (-1) ** i for i in range(len(ks)))
        ack = client.request(
            ApplyUpdate(job_id=config.job_id, step=step, ks=ks, coefficients=coefficients)
        )
        state = wl.apply_update(state, step, list(zip(ks, coefficients, strict=True)))
        assert ack == UpdateAck(job_id=config.job_id, step=step, checksum=state.checksum())
    loss_sum, correct, count = wl.validate(state, 0, 40)
    result = client.request(ValidateRequest(job_id=config.job_id, step=2, start=0, count=40))
    assert isinstance(result, ValidateResult)
    assert (result.loss_sum, result.correct, result.count) == (loss_sum, correct, count)
