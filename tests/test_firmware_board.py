"""The C board executable on a pseudo-terminal: protocol session and bit-exact training vs
Python."""

from __future__ import annotations

import os
import struct
import subprocess
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from qsched.firmware.native import BoardClient, board_executable
from qsched.protocol.codec import encode
from qsched.protocol.identity import dataset_hash64, model_hash64
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.messages import (
    MAX_CHUNK,
    PROTOCOL_VERSION,
    ApplyUpdate,
    Error,
    EvalRequest,
    EvalResult,
    EvalSliceRequest,
    EvalSliceResult,
    Heartbeat,
    Hello,
    JobConfig,
    Loaded,
    LoadModel,
    Ping,
    Reset,
    SelectDataset,
    SetWeights,
    UpdateAck,
    ValidateRequest,
    ValidateResult,
    job_config,
)
from qsched.zo.blob import encode_dataset_blob
from qsched.zo.recalibrate import RECAL_EXP_MAX
from qsched.zo.workload import TrainState, Workload


@dataclass
class Job:
    """A default job as the daemon would prepare it for a board."""

    spec: JobSpec
    workload: Workload
    blob: bytes
    dataset_path: Path
    config: JobConfig


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The default job (mlp on digits, INT8 + FP16 buffer), its blobs on disk."""
    spec = JobSpec(seed=7, batch_size=16)
    workload = Workload.from_spec(spec)
    assert workload.qmodel is not None
    path = tmp_path_factory.mktemp("board") / "digits.qzds"
    path.write_bytes(encode_dataset_blob(workload.dataset, workload.qmodel))
    return Job(spec, workload, workload.model_blob(), path, job_config(spec))


@dataclass
class Board:
    client: BoardClient
    proc: subprocess.Popen[bytes]
    hello: Hello


def _start_board(job: Job, *extra: str) -> Iterator[Board]:
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [
            str(board_executable(sanitized=True)),
            os.ttyname(slave),
            "--dataset",
            str(job.dataset_path),
            *extra,
        ],
        stderr=subprocess.PIPE,
    )
    client = BoardClient(master)
    try:
        # Our copy of the slave side stays open until the board has opened its own:
        # a pty master whose slave is closed everywhere reads as an I/O error.
        hello = client.recv(timeout=10)
        os.close(slave)
        slave = -1
        assert isinstance(hello, Hello)
        yield Board(client, proc, hello)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
        os.close(master)
        if slave >= 0:
            os.close(slave)
        assert b"ERROR: AddressSanitizer" not in err and b"runtime error" not in err, err.decode()


@pytest.fixture
def board(job: Job) -> Iterator[Board]:
    """A sanitizer build of the C board serving a fresh pseudo-terminal."""
    yield from _start_board(job, "--board-id", "c-test-0")


def _load(board: Board, job: Job) -> None:
    blob = job.blob
    crc = zlib.crc32(blob)
    answer = None
    for offset in range(0, len(blob), MAX_CHUNK):
        chunk = blob[offset : offset + MAX_CHUNK]
        board.client.send(LoadModel(total=len(blob), offset=offset, crc32=crc, chunk=chunk))
    answer = board.client.recv()
    assert answer == Loaded(resource="model", crc32=crc, size=len(blob))
    ds = job.workload.dataset
    select = SelectDataset(
        name=ds.name,
        dataset_hash=dataset_hash64(ds.content_hash),
        train_size=len(ds.x_train),
        val_size=len(ds.x_val),
    )
    assert isinstance(board.client.request(select), Loaded)
    loaded = board.client.request(job.config)
    assert loaded == Loaded(
        resource="job_config",
        job_id=job.config.job_id,
        crc32=zlib.crc32(encode(job.config)),
        size=len(encode(job.config)),
    )


def test_board_hello_identifies_the_board(board: Board) -> None:
    """The first message is a Hello with the board's id, no model and the C firmware's limits."""
    assert board.hello.board_id == "c-test-0"
    assert board.hello.npu == "none"
    assert board.hello.model_hash == 0 and board.hello.dataset_hash == 0
    assert board.hello.max_payload == 12288


def test_board_ping_gets_heartbeat(board: Board) -> None:
    """A Ping is answered by a Heartbeat echoing its nonce, state idle before a job."""
    answer = board.client.request(Ping(nonce=0xDEADBEEF))
    assert isinstance(answer, Heartbeat)
    assert answer.nonce == 0xDEADBEEF and answer.state == "idle"


def test_board_training_matches_python_bit_for_bit(board: Board, job: Job) -> None:
    """Losses and weight checksums equal the Python workload's at every step."""
    _load(board, job)
    wl, state = job.workload, job.workload.initial_state()
    rng = np.random.default_rng(3)
    for step in range(3):
        ks = (0, 1, 2, 5) if step != 1 else tuple(range(10))
        result = board.client.request(
            EvalRequest(
                job_id=job.config.job_id,
                step=step,
                batch_size=16,
                eps=1.0,
                estimator="two_sided",
                ks=ks,
            )
        )
        assert isinstance(result, EvalResult), result
        want = wl.perturbed_losses(state, step, ks)
        assert result.loss_plus == tuple(want.plus[k] for k in ks)
        assert result.loss_minus == tuple(want.minus[k] for k in ks)
        coefficients = tuple(float(np.float32(c)) for c in rng.standard_normal(len(ks)) * 0.7)
        ack = board.client.request(
            ApplyUpdate(job_id=job.config.job_id, step=step, ks=ks, coefficients=coefficients)
        )
        state = wl.apply_update(state, step, list(zip(ks, coefficients, strict=True)))
        assert ack == UpdateAck(job_id=job.config.job_id, step=step, checksum=state.checksum())
    loss_sum, correct, count = wl.validate(state, 10, 100)
    result = board.client.request(
        ValidateRequest(job_id=job.config.job_id, step=3, start=10, count=100)
    )
    assert result == ValidateResult(
        job_id=job.config.job_id,
        step=3,
        start=10,
        count=count,
        loss_sum=loss_sum,
        correct=correct,
        compute_us=result.compute_us,  # type: ignore[union-attr]
    )
    beat = board.client.request(Ping(nonce=1))
    assert isinstance(beat, Heartbeat) and beat.state == "ready" and beat.step == 3


def _slice_request(
    config: JobConfig, step: int, ks: tuple[int, ...], start: int, count: int
) -> EvalSliceRequest:
    return EvalSliceRequest(
        job_id=config.job_id,
        step=step,
        batch_size=config.batch_size,
        eps=config.eps,
        estimator=config.estimator,
        slice_start=start,
        slice_count=count,
        ks=ks,
    )


@pytest.mark.parametrize("estimator", ["two_sided", "one_sided"])
def test_board_slice_sums_match_python_and_the_whole_batch(
    board: Board, job: Job, estimator: str
) -> None:
    """EvalSliceResult's Q16 loss sums equal Workload's, at four steps, up to 512 keys;
    summed over slices that cover the batch, floor(sum / B) / 65536 is the whole-batch
    EvalResult's float32 loss bit for bit (SPEC 6.10)."""
    spec = job.spec.model_copy(update={"estimator": estimator})
    config = job_config(spec)
    _load(board, job)
    assert isinstance(board.client.request(config), Loaded)
    base = job.workload
    wl = Workload(spec, base.model, base.qmodel, base.dataset, base.trainable_layers)
    state = wl.initial_state()
    two_sided = estimator == "two_sided"
    batch = spec.batch_size
    ks = (0, 3, 9)
    for step, slices in enumerate(
        ([(0, 5), (5, 1), (6, 10)], [(0, 16)], [(i, 1) for i in range(16)])
    ):
        whole = board.client.request(
            EvalRequest(
                job_id=config.job_id,
                step=step,
                batch_size=batch,
                eps=config.eps,
                estimator=config.estimator,
                ks=ks,
            )
        )
        assert isinstance(whole, EvalResult), whole
        plus = dict.fromkeys(ks, 0)
        minus = dict.fromkeys(ks, 0)
        zero = 0
        for start, count in slices:
            result = board.client.request(_slice_request(config, step, ks, start, count))
            assert isinstance(result, EvalSliceResult), result
            assert (result.job_id, result.step, result.estimator) == (
                config.job_id,
                step,
                estimator,
            )
            assert (result.slice_start, result.slice_count, result.ks) == (start, count, ks)
            want = wl.perturbed_loss_sums(state, step, ks, start, count)
            assert result.sum_plus == tuple(want.plus[k] for k in ks)
            assert result.sum_minus == tuple(want.minus[k] for k in ks if two_sided)
            assert result.sum_zero == want.base
            for k, value in zip(ks, result.sum_plus, strict=True):
                plus[k] += value
            for k, value in zip(ks, result.sum_minus, strict=False):  # () one-sided
                minus[k] += value
            zero += result.sum_zero or 0

        def loss(total: int) -> float:
            return float(np.float32((total // batch) / 65536.0))

        assert whole.loss_plus == tuple(loss(plus[k]) for k in ks)
        if two_sided:
            assert whole.loss_minus == tuple(loss(minus[k]) for k in ks)
        else:
            assert whole.loss_zero == loss(zero)
        coefficients = (0.5, -0.25, 1.5)
        ack = board.client.request(
            ApplyUpdate(job_id=config.job_id, step=step, ks=ks, coefficients=coefficients)
        )
        state = wl.apply_update(state, step, list(zip(ks, coefficients, strict=True)))
        assert ack == UpdateAck(job_id=config.job_id, step=step, checksum=state.checksum())
    many = tuple(range(1, 1024, 2))  # MAX_SLICE_KS keys: a 9 KiB answer, in segments
    result = board.client.request(_slice_request(config, 3, many, 10, 6))
    want = wl.perturbed_loss_sums(state, 3, many, 10, 6)
    assert isinstance(result, EvalSliceResult), result
    assert result.sum_plus == tuple(want.plus[k] for k in many)
    assert result.sum_minus == tuple(want.minus[k] for k in many if two_sided)
    assert result.sum_zero == want.base


def test_board_refuses_bad_slice_requests(board: Board, job: Job) -> None:
    """A slice request is checked as an EvalRequest is (Errors with ref_type 0x4B); the
    codec refuses a slice past the batch and more than 512 keys, as Python's does."""
    request = _slice_request(job.config, 0, (0, 1), 4, 8)
    assert board.client.request(request).code == "not_ready"  # type: ignore[union-attr]
    _load(board, job)
    stale = board.client.request(request.model_copy(update={"step": 2}))
    assert isinstance(stale, Error) and (stale.code, stale.ref_type) == ("stale_step", 0x4B)
    for change in ({"batch_size": 12}, {"eps": 2.0}, {"estimator": "one_sided"}):
        other = board.client.request(request.model_copy(update=change))
        assert isinstance(other, Error) and (other.code, other.ref_type) == ("malformed", 0x4B)
    raw = bytearray(encode(request))
    raw[19:23] = struct.pack("<HH", 9, 8)  # slice_start, slice_count: ends at 17 of 16
    board.client.send_payload(bytes(raw))
    assert board.client.recv() == Error(
        code="malformed", ref_type=0x4B, detail="the slice ends after the batch"
    )
    too_many = encode(request.model_copy(update={"ks": tuple(range(512))}))
    board.client.send_payload(too_many[:-4] + struct.pack("<HH", 513, 0))
    answer = board.client.recv()
    assert isinstance(answer, Error) and (answer.code, answer.ref_type) == ("malformed", 0x4B)
    assert isinstance(board.client.request(request), EvalSliceResult)


def test_board_set_weights_resynchronises(board: Board, job: Job) -> None:
    """SetWeights installs weights + buffer at a step; the next update matches Python."""
    _load(board, job)
    wl = job.workload
    rng = np.random.default_rng(9)
    params = rng.integers(-127, 128, wl.num_params).astype(np.int8)
    buffer = (rng.uniform(-1, 1, wl.num_params) * 0.9).astype(np.float16)
    state = TrainState(40, params, buffer)
    assert state.weight_bytes() == params.tobytes() + buffer.astype("<f2").tobytes()
    _send_weights(board, job.config, state)
    pairs = [(3, 0.25), (4, -1.5)]
    ack = board.client.request(
        ApplyUpdate(job_id=job.config.job_id, step=40, ks=(3, 4), coefficients=(0.25, -1.5))
    )
    assert ack == UpdateAck(
        job_id=job.config.job_id, step=40, checksum=wl.apply_update(state, 40, pairs).checksum()
    )


def test_board_refuses_bad_requests_with_typed_errors(board: Board, job: Job) -> None:
    """Not ready, stale steps, unknown jobs and undecodable bytes each get their Error code."""
    request = EvalRequest(
        job_id=job.config.job_id, step=0, batch_size=16, eps=1.0, estimator="two_sided", ks=(0,)
    )
    assert board.client.request(request).code == "not_ready"  # type: ignore[union-attr]
    _load(board, job)
    stale = board.client.request(request.model_copy(update={"step": 5}))
    assert isinstance(stale, Error) and stale.code == "stale_step"
    other = board.client.request(request.model_copy(update={"job_id": job.config.job_id ^ 1}))
    assert isinstance(other, Error) and other.code == "unknown_job"
    board.client.send_payload(b"QS" + bytes([PROTOCOL_VERSION]) + b"\x48\x01")
    assert board.client.recv() == Error(
        code="malformed", ref_type=0x48, detail="message shorter than its layout"
    )
    board.client.send_payload(b"QS" + bytes([PROTOCOL_VERSION + 1]) + b"\x48\x01\x00\x00\x00")
    assert board.client.recv().code == "unsupported_version"  # type: ignore[union-attr]


def test_board_answers_a_frame_longer_than_any_message(
    board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A well-formed frame whose payload exceeds MAX_PAYLOAD: too_large, and nothing overrun."""
    from qsched.protocol import framing

    monkeypatch.setattr(framing, "MAX_PAYLOAD", 1 << 16)  # our side would refuse to send it
    # Zero bytes keep COBS at one byte of overhead each, so the frame fits the board's reader.
    board.client.send_payload(b"QS" + bytes([PROTOCOL_VERSION]) + b"\x45" + bytes(12300))
    answer = board.client.recv()
    assert isinstance(answer, Error) and answer.code == "too_large" and answer.ref_type == 0
    assert isinstance(board.client.request(Ping(nonce=7)), Heartbeat)  # still serving
    assert board.proc.poll() is None


def test_board_reset_answers_hello_with_model_hash(board: Board, job: Job) -> None:
    """After loading, a soft Reset drops the job and the Hello reports no model again."""
    _load(board, job)
    hello = board.client.request(Reset(scope="soft"))
    assert isinstance(hello, Hello) and hello.model_hash == 0
    assert hello.dataset_hash == dataset_hash64(job.workload.dataset.content_hash)
    assert model_hash64(job.blob) != 0


def test_board_survives_mutated_messages(board: Board, job: Job) -> None:
    """Mutated messages (sanitizer build) get answers or typed Errors; the board stays alive."""
    _load(board, job)
    cfg = job.config
    valid = [
        EvalRequest(
            job_id=cfg.job_id, step=0, batch_size=16, eps=1.0, estimator="two_sided", ks=(0, 1, 2)
        ),
        ApplyUpdate(job_id=cfg.job_id, step=0, ks=(0, 3), coefficients=(0.5, -0.5)),
        _slice_request(cfg, 0, (0, 2), 3, 4),
        ValidateRequest(job_id=cfg.job_id, step=0, start=0, count=5),
        SetWeights(total=9, offset=0, job_id=cfg.job_id, step=0, checksum=1, chunk=b"\x01\x02\x03"),
        LoadModel(total=100, offset=0, crc32=5, chunk=b"\x00" * 10),
        cfg,
        Ping(nonce=3),
    ]
    rng = np.random.default_rng(17)
    for i in range(150):
        raw = bytearray(encode(valid[i % len(valid)]))
        for _ in range(int(rng.integers(1, 4))):
            raw[int(rng.integers(2, len(raw)))] = int(rng.integers(0, 256))
        board.client.send_payload(bytes(raw[: int(rng.integers(4, len(raw) + 1))]))
    board.client.send(Ping(nonce=0x5150))
    while True:
        answer = board.client.recv(timeout=30, heartbeats=True)
        if isinstance(answer, Heartbeat) and answer.nonce == 0x5150:
            break
    assert board.proc.poll() is None


def test_board_answers_ping_while_computing(board: Board, job: Job) -> None:
    """A Ping during a long evaluation gets a busy Heartbeat before the EvalResult."""
    _load(board, job)
    big = job_config(job.spec.model_copy(update={"batch_size": 2048}))
    assert isinstance(board.client.request(big), Loaded)
    ks = tuple(range(24))
    board.client.send(
        EvalRequest(
            job_id=big.job_id, step=0, batch_size=2048, eps=1.0, estimator="two_sided", ks=ks
        )
    )
    board.client.send(Ping(nonce=99))
    first = board.client.recv(timeout=60)
    assert first == Heartbeat(
        nonce=99, uptime_ms=first.uptime_ms, state="busy", job_id=big.job_id, step=0
    )  # type: ignore[union-attr]
    assert isinstance(board.client.recv(timeout=120), EvalResult)


@pytest.mark.parametrize(("lr_unit", "unit_scale"), [("int8_step", 1.0), ("weight", 1e-5)])
def test_board_int8_accumulator_job_matches_python(
    board: Board, job: Job, lr_unit: str, unit_scale: float
) -> None:
    """With the INT8 accumulation buffer, checksums equal Python's across two rescales,
    with the learning rate in int8 steps and in weight units (channel gains)."""
    spec = job.spec.model_copy(update={"accumulator": "int8", "lr_unit": lr_unit})
    config, wl = _configure(board, job, spec)
    state = wl.initial_state()
    rng = np.random.default_rng(4)
    for step in range(33):
        ks = (0, 1, 2)
        scale = (2e-3 if step < 16 else 3.0) * unit_scale
        coefficients = tuple(float(np.float32(c)) for c in rng.standard_normal(3) * scale)
        ack = board.client.request(
            ApplyUpdate(job_id=config.job_id, step=step, ks=ks, coefficients=coefficients)
        )
        state = wl.apply_update(state, step, list(zip(ks, coefficients, strict=True)))
        assert ack == UpdateAck(job_id=config.job_id, step=step, checksum=state.checksum()), (
            f"step {step}"
        )
    result = board.client.request(
        EvalRequest(
            job_id=config.job_id, step=33, batch_size=16, eps=1.0, estimator="two_sided", ks=(4,)
        )
    )
    want = wl.perturbed_losses(state, 33, (4,))
    assert isinstance(result, EvalResult) and result.loss_plus == (want.plus[4],)


def test_board_recalibrating_job_matches_python(board: Board, job: Job) -> None:
    """A recalibrating job: weights with scale exponents from SetWeights give Python's
    losses, the update of a due step recalibrates to Python's checksum, and exponents out
    of range or a recalibrating INT8-accumulator job are refused."""
    spec = job.spec.model_copy(update={"recalibrate_every": 4})
    config, wl = _configure(board, job, spec)
    assert wl.recalibration is not None
    rng = np.random.default_rng(5)
    params = rng.integers(-127, 128, wl.num_params).astype(np.int8)
    buffer = (rng.uniform(-1, 1, wl.num_params) * 0.9).astype(np.float16)
    exps = rng.integers(0, 3, wl.recalibration.channels).astype(np.int8)
    state = TrainState(39, params, buffer, exps)
    _send_weights(board, config, state)
    result = board.client.request(
        EvalRequest(
            job_id=config.job_id, step=39, batch_size=16, eps=1.0, estimator="two_sided", ks=(2, 5)
        )
    )
    want = wl.perturbed_losses(state, 39, (2, 5))
    assert isinstance(result, EvalResult)
    assert result.loss_plus == (want.plus[2], want.plus[5])
    assert result.loss_minus == (want.minus[2], want.minus[5])
    ack = board.client.request(
        ApplyUpdate(job_id=config.job_id, step=39, ks=(2, 5), coefficients=(0.5, -0.75))
    )
    after = wl.apply_update(state, 39, [(2, 0.5), (5, -0.75)])
    assert after.scale_exps is not None and not np.array_equal(after.scale_exps, exps)
    assert ack == UpdateAck(job_id=config.job_id, step=39, checksum=after.checksum())
    too_far = TrainState(39, params, buffer, np.full_like(exps, RECAL_EXP_MAX + 1))
    refused = _send_weights(board, config, too_far, expect_loaded=False)
    assert isinstance(refused, Error) and refused.code == "malformed"
    acc8 = job_config(spec.model_copy(update={"accumulator": "int8", "recalibrate_every": 0}))
    bad = acc8.model_copy(update={"recalibrate_every": 4})
    assert isinstance(board.client.request(bad), Loaded)
    refusal = board.client.recv()
    assert isinstance(refusal, Error) and refusal.code == "model_invalid"


def _configure(board: Board, job: Job, spec: JobSpec) -> tuple[JobConfig, Workload]:
    """Load the job's model and data set on the board, configure ``spec``; its workload."""
    config = job_config(spec)
    _load(board, job)
    assert isinstance(board.client.request(config), Loaded)
    base = job.workload
    return config, Workload(spec, base.model, base.qmodel, base.dataset, base.trainable_layers)


def _send_weights(
    board: Board, config: JobConfig, state: TrainState, expect_loaded: bool = True
) -> object:
    raw = state.weight_bytes()
    for offset in range(0, len(raw), MAX_CHUNK):
        board.client.send(
            SetWeights(
                total=len(raw),
                offset=offset,
                job_id=config.job_id,
                step=state.step,
                checksum=zlib.crc32(raw),
                chunk=raw[offset : offset + MAX_CHUNK],
            )
        )
    answer = board.client.recv()
    if expect_loaded:
        assert answer == Loaded(
            resource="weights", job_id=config.job_id, crc32=zlib.crc32(raw), size=len(raw)
        )
    return answer
