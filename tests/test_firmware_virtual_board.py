"""The virtual board agent in-process: session, bit-identical compute, typed errors."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence

import numpy as np
import pytest

from qsched.firmware.virtual import board as board_module
from qsched.firmware.virtual.board import (
    BoardAgent,
    DatasetCatalog,
    LatencyProfile,
)
from qsched.protocol.codec import encode
from qsched.protocol.identity import dataset_hash64, model_hash64
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.messages import (
    MAX_PAYLOAD,
    ApplyUpdate,
    DataMessage,
    Error,
    EvalRequest,
    EvalResult,
    Heartbeat,
    Hello,
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
from qsched.zo.blob import trainable_layers
from qsched.zo.workload import TrainState, Workload

CHUNK = 1000


def chunks(blob: bytes, size: int = CHUNK) -> list[tuple[int, bytes]]:
    """(offset, bytes) pieces of a blob."""
    return [(off, blob[off : off + size]) for off in range(0, len(blob), size)]


def load_messages(workload: Workload) -> list[DataMessage]:
    """What a daemon sends a new board for a job: model, data set, job config."""
    blob = workload.model_blob()
    ds = workload.dataset
    msgs: list[DataMessage] = [
        LoadModel(total=len(blob), offset=off, crc32=zlib.crc32(blob), chunk=part)
        for off, part in chunks(blob)
    ]
    msgs.append(
        SelectDataset(
            name=ds.name,
            dataset_hash=dataset_hash64(ds.content_hash),
            train_size=len(ds.x_train),
            val_size=len(ds.x_val),
        )
    )
    msgs.append(job_config(workload.spec))
    return msgs


def weight_messages(workload: Workload, state: TrainState) -> list[SetWeights]:
    """SetWeights chunks of a state (params then buffer, as the checksum covers)."""
    raw = state.weight_bytes()
    cfg = job_config(workload.spec)
    return [
        SetWeights(
            total=len(raw),
            offset=off,
            job_id=cfg.job_id,
            step=state.step,
            checksum=state.checksum(),
            chunk=part,
        )
        for off, part in chunks(raw, 700)
    ]


async def send_all(agent: BoardAgent, msgs: Sequence[DataMessage]) -> list[DataMessage]:
    """Hand messages to the agent in order; collect every answer."""
    out: list[DataMessage] = []
    for msg in msgs:
        out += await agent.handle(msg)
    return out


def eval_request(workload: Workload, step: int, ks: Sequence[int]) -> EvalRequest:
    """An EvalRequest of the job for ``ks`` at ``step``."""
    cfg = job_config(workload.spec)
    return EvalRequest(
        job_id=cfg.job_id,
        step=step,
        batch_size=cfg.batch_size,
        eps=cfg.eps,
        estimator=cfg.estimator,
        ks=tuple(ks),
    )


@pytest.fixture(scope="module")
def int8_workload() -> Workload:
    """The digits MLP in INT8, FP16 buffer (the demo's job)."""
    return Workload.from_spec(JobSpec(numerics="int8", batch_size=32, seed=11))


@pytest.fixture(scope="module")
def fp32_workload() -> Workload:
    """The digits MLP in FP32, one-sided, last layer trainable."""
    return Workload.from_spec(
        JobSpec(
            numerics="fp32",
            estimator="one_sided",
            eps=0.01,
            batch_size=16,
            seed=5,
            trainable="last:1",
        )
    )


async def loaded_agent(workload: Workload, board_id: str = "vb-0", **options: object) -> BoardAgent:
    """An agent that went through the load sequence."""
    agent = BoardAgent(board_id, latency=LatencyProfile.off(), **options)  # type: ignore[arg-type]
    answers = await send_all(agent, load_messages(workload))
    assert [a.resource for a in answers if isinstance(a, Loaded)] == [
        "model",
        "dataset",
        "job_config",
    ]
    return agent


async def test_agent_hello_reports_what_it_holds(int8_workload: Workload) -> None:
    """Hello names the board and, after loading, the model and data set hashes."""
    agent = BoardAgent("vb-7", latency=LatencyProfile.off())
    empty = agent.hello()
    assert (empty.board_id, empty.npu, empty.model_hash, empty.dataset_hash) == (
        "vb-7",
        "virtual",
        0,
        0,
    )
    assert empty.max_payload == MAX_PAYLOAD
    await send_all(agent, load_messages(int8_workload))
    full = agent.hello()
    assert full.model_hash == model_hash64(int8_workload.model_blob())
    assert full.dataset_hash == dataset_hash64(int8_workload.dataset.content_hash)
    assert agent.state == "ready"


async def test_agent_eval_matches_workload_int8(int8_workload: Workload) -> None:
    """Two-sided INT8 losses are the bits Workload.perturbed_losses computes."""
    agent = await loaded_agent(int8_workload)
    ks = (0, 1, 2, 5, 9)
    (result,) = await agent.handle(eval_request(int8_workload, 0, ks))
    expected = int8_workload.perturbed_losses(int8_workload.initial_state(), 0, ks)
    assert isinstance(result, EvalResult)
    assert result.ks == ks
    assert list(result.loss_plus) == [expected.plus[k] for k in ks]
    assert list(result.loss_minus) == [expected.minus[k] for k in ks]


async def test_agent_eval_matches_workload_fp32_one_sided(fp32_workload: Workload) -> None:
    """One-sided FP32 losses (frozen prefix) and L0 match the workload exactly."""
    agent = await loaded_agent(fp32_workload)
    ks = (3, 4, 5)
    (result,) = await agent.handle(eval_request(fp32_workload, 0, ks))
    expected = fp32_workload.perturbed_losses(fp32_workload.initial_state(), 0, ks)
    assert isinstance(result, EvalResult)
    assert list(result.loss_plus) == [expected.plus[k] for k in ks]
    assert result.loss_zero == expected.base and result.loss_minus == ()


async def test_agent_updates_equal_workload_checksums(int8_workload: Workload) -> None:
    """Three updates: every UpdateAck checksum equals Workload.apply_update's."""
    agent = await loaded_agent(int8_workload)
    cfg = job_config(int8_workload.spec)
    state = int8_workload.initial_state()
    for step in range(3):
        pairs = [(0, 0.75), (2, -1.5), (7, 0.25 * (step + 1))]
        state = int8_workload.apply_update(state, step, pairs)
        msg = ApplyUpdate(
            job_id=cfg.job_id,
            step=step,
            ks=tuple(k for k, _ in pairs),
            coefficients=tuple(c for _, c in pairs),
        )
        (ack,) = await agent.handle(msg)
        assert ack == UpdateAck(job_id=cfg.job_id, step=step, checksum=state.checksum())
        assert (await agent.handle(msg)) == [ack]  # a duplicate delivery gets the same ack
    assert agent.train_state is not None and agent.train_state.step == 3
    heartbeat = agent.heartbeat()
    assert (heartbeat.step, heartbeat.job_id, heartbeat.state) == (3, cfg.job_id, "ready")


async def test_agent_set_weights_resynchronises(int8_workload: Workload) -> None:
    """SetWeights (chunked) installs a later state; evaluation then matches at its step."""
    state = int8_workload.initial_state()
    for step in range(2):
        state = int8_workload.apply_update(state, step, [(1, 2.5), (3, -3.0)])
    agent = await loaded_agent(int8_workload)
    answers = await send_all(agent, weight_messages(int8_workload, state))
    assert answers == [
        Loaded(
            resource="weights",
            job_id=job_config(int8_workload.spec).job_id,
            crc32=state.checksum(),
            size=len(state.weight_bytes()),
        )
    ]
    assert agent.train_state is not None and agent.train_state.checksum() == state.checksum()
    (result,) = await agent.handle(eval_request(int8_workload, 2, (4, 6)))
    expected = int8_workload.perturbed_losses(state, 2, (4, 6))
    assert isinstance(result, EvalResult) and list(result.loss_plus) == [
        expected.plus[4],
        expected.plus[6],
    ]


async def test_agent_set_weights_refuses_int8_shifts_out_of_range() -> None:
    """An INT8-buffer state whose shifts lie outside 7..15 is malformed at once (as in C)."""
    workload = Workload.from_spec(JobSpec(accumulator="int8", batch_size=16, seed=3))
    state = workload.initial_state()
    assert state.buffer is not None
    buffer = state.buffer.copy()
    buffer[-1] = 16  # the last tensor's shift
    bad = TrainState(0, state.params, buffer)
    agent = await loaded_agent(workload)
    answers = await send_all(agent, weight_messages(workload, bad))
    assert len(answers) == 1 and isinstance(answers[0], Error) and answers[0].code == "malformed"
    assert "shifts" in answers[0].detail


async def test_agent_validate_matches_workload(int8_workload: Workload) -> None:
    """ValidateRequest returns the workload's loss sum and accuracy on the slice."""
    agent = await loaded_agent(int8_workload)
    cfg = job_config(int8_workload.spec)
    (result,) = await agent.handle(ValidateRequest(job_id=cfg.job_id, step=0, start=10, count=100))
    loss_sum, correct, count = int8_workload.validate(int8_workload.initial_state(), 10, 100)
    assert isinstance(result, ValidateResult)
    assert (result.loss_sum, result.correct, result.count) == (loss_sum, correct, count)


async def test_agent_ping_and_reset(int8_workload: Workload) -> None:
    """Ping gets a Heartbeat echoing the nonce; Reset drops the job and says Hello again."""
    agent = await loaded_agent(int8_workload)
    (beat,) = await agent.handle(Ping(nonce=1234))
    assert isinstance(beat, Heartbeat) and beat.nonce == 1234
    (hello,) = await agent.handle(Reset(scope="soft"))
    assert isinstance(hello, Hello) and hello.model_hash == 0
    assert hello.dataset_hash == dataset_hash64(
        int8_workload.dataset.content_hash
    )  # soft keeps the data set
    assert agent.state == "idle"
    (hello,) = await agent.handle(Reset(scope="hard"))
    assert isinstance(hello, Hello) and hello.dataset_hash == 0


def error_of(answers: list[DataMessage]) -> Error:
    """The single Error among the answers."""
    assert len(answers) == 1 and isinstance(answers[0], Error), answers
    return answers[0]


async def test_agent_bad_bytes_get_typed_errors() -> None:
    """Garbage, a future version and an unknown type code are refused by kind."""
    agent = BoardAgent("vb-0", latency=LatencyProfile.off())
    assert error_of(await agent.handle_bytes(b"\x00\x01garbage")).code == "malformed"
    good = encode(Ping(nonce=1))
    assert (
        error_of(await agent.handle_bytes(good[:2] + b"\x09" + good[3:])).code
        == "unsupported_version"
    )
    assert error_of(await agent.handle_bytes(good[:3] + b"\x60" + good[4:])).code == "unknown_type"
    assert error_of(await agent.handle_bytes(good + b"\x00")).code == "malformed"
    (beat,) = await agent.handle_bytes(good)  # still serving
    assert isinstance(beat, Heartbeat)


async def test_agent_refuses_wrong_job_step_and_order(int8_workload: Workload) -> None:
    """not_ready before loading, unknown_job, stale_step, and a board message sent to a board."""
    fresh = BoardAgent("vb-0", latency=LatencyProfile.off())
    assert error_of(await fresh.handle(eval_request(int8_workload, 0, (0,)))).code == "not_ready"
    agent = await loaded_agent(int8_workload)
    request = eval_request(int8_workload, 0, (0,))
    wrong_job = request.model_copy(update={"job_id": request.job_id ^ 1})
    assert error_of(await agent.handle(wrong_job)).code == "unknown_job"
    stale = error_of(await agent.handle(request.model_copy(update={"step": 4})))
    assert (stale.code, stale.step, stale.ref_type) == ("stale_step", 4, 0x45)
    assert (
        error_of(await agent.handle(request.model_copy(update={"batch_size": 3}))).code
        == "malformed"
    )
    assert error_of(await agent.handle(agent.hello())).code == "unknown_type"
    assert await agent.handle(Error(code="internal", detail="daemon confused")) == []
    assert isinstance((await agent.handle(request))[0], EvalResult)


async def test_agent_refuses_bad_model_and_data(int8_workload: Workload) -> None:
    """A model with a wrong CRC, an unknown data set and a wrong hash get typed errors."""
    agent = BoardAgent(
        "vb-0", latency=LatencyProfile.off(), datasets=DatasetCatalog(builtins=False)
    )
    blob = int8_workload.model_blob()
    bad = LoadModel(total=len(blob), offset=0, crc32=zlib.crc32(blob) ^ 1, chunk=blob[:CHUNK])
    answers = await agent.handle(bad)
    assert answers == []  # an intermediate chunk
    answers = await send_all(
        agent,
        [bad.model_copy(update={"offset": off, "chunk": part}) for off, part in chunks(blob)[1:]],
    )
    assert error_of(answers).code == "crc_mismatch"
    select = load_messages(int8_workload)[-2]
    assert error_of(await agent.handle(select)).code == "dataset_missing"
    held = BoardAgent("vb-1", latency=LatencyProfile.off())
    assert isinstance(select, SelectDataset)
    wrong = select.model_copy(update={"dataset_hash": select.dataset_hash ^ 1})
    assert error_of(await held.handle(wrong)).code == "dataset_missing"
    corrupt = blob[:100] + bytes([blob[100] ^ 0xFF]) + blob[101:]
    whole = LoadModel(total=len(corrupt), offset=0, crc32=zlib.crc32(corrupt), chunk=corrupt[:8192])
    assert error_of(await held.handle(whole)).code == "model_invalid"


async def test_agent_refuses_bad_weights(int8_workload: Workload) -> None:
    """SetWeights with a wrong checksum or a wrong size is refused; the old state stays."""
    agent = await loaded_agent(int8_workload)
    state = int8_workload.initial_state()
    msgs = weight_messages(int8_workload, state)
    bad_crc = [m.model_copy(update={"checksum": m.checksum ^ 1}) for m in msgs]
    assert error_of(await send_all(agent, bad_crc)).code == "crc_mismatch"
    short = b"\x01" * 10
    cfg = job_config(int8_workload.spec)
    msg = SetWeights(
        total=10, offset=0, job_id=cfg.job_id, step=0, checksum=zlib.crc32(short), chunk=short
    )
    assert error_of(await agent.handle(msg)).code == "malformed"
    assert agent.train_state is not None and agent.train_state.checksum() == state.checksum()


def test_blob_trainable_layers_follow_the_spec(fp32_workload: Workload) -> None:
    """The blob's trainable flags name the spec's trainable layers."""
    assert trainable_layers(fp32_workload.model_blob()) == fp32_workload.trainable_layers


async def test_agent_numeric_error_on_non_finite_loss(fp32_workload: Workload) -> None:
    """FP32 weights that overflow the logits give Error(numeric), not a bad EvalResult."""
    agent = await loaded_agent(fp32_workload)
    state = fp32_workload.initial_state()
    huge = TrainState(0, np.full_like(state.params, 3e38), None)
    answers = await send_all(agent, weight_messages(fp32_workload, huge))
    assert isinstance(answers[-1], Loaded)
    assert error_of(await agent.handle(eval_request(fp32_workload, 0, (0,)))).code == "numeric"


async def test_agent_busy_while_computing(int8_workload: Workload) -> None:
    """A second request handed over during a computation gets Error(busy); Ping still works."""
    agent = await loaded_agent(int8_workload)
    first = asyncio.create_task(agent.handle(eval_request(int8_workload, 0, tuple(range(64)))))
    while agent.state != "busy":
        await asyncio.sleep(0)
    assert error_of(await agent.handle(eval_request(int8_workload, 0, (0,)))).code == "busy"
    assert isinstance((await agent.handle(Ping(nonce=5)))[0], Heartbeat)
    assert isinstance((await first)[0], EvalResult)


async def test_agent_chunk_at_offset_zero_restarts(int8_workload: Workload) -> None:
    """A transfer cut short and started again from offset 0 completes normally."""
    agent = BoardAgent("vb-0", latency=LatencyProfile.off())
    blob = int8_workload.model_blob()
    msgs = [
        LoadModel(total=len(blob), offset=off, crc32=zlib.crc32(blob), chunk=part)
        for off, part in chunks(blob)
    ]
    assert await send_all(agent, msgs[:2]) == []
    answers = await send_all(agent, msgs)
    assert answers == [Loaded(resource="model", crc32=zlib.crc32(blob), size=len(blob))]


async def test_agent_shared_updates_stay_per_board(int8_workload: Workload) -> None:
    """Boards of one process share update results only when their weights are equal."""
    cfg = job_config(int8_workload.spec)
    state = int8_workload.initial_state()
    other = int8_workload.apply_update(state, 0, [(9, 4.0)])
    other = TrainState(0, other.params, other.buffer)  # different weights, same step
    alike = [await loaded_agent(int8_workload, f"vb-{i}") for i in range(2)]
    odd = await loaded_agent(int8_workload, "vb-odd")
    await send_all(odd, weight_messages(int8_workload, other))
    msg = ApplyUpdate(job_id=cfg.job_id, step=0, ks=(1, 2), coefficients=(3.0, -3.0))
    acks = [(await agent.handle(msg))[0] for agent in [*alike, odd]]
    expected = [
        int8_workload.apply_update(s, 0, msg.pairs()).checksum() for s in (state, state, other)
    ]
    assert [a.checksum for a in acks if isinstance(a, UpdateAck)] == expected
    assert expected[0] != expected[2]


async def test_agents_of_a_process_share_one_frozen_state(int8_workload: Workload) -> None:
    """Boards of one process that apply the same updates hold one read-only state, with
    the bits of a board that computed each update alone."""
    cfg = job_config(int8_workload.spec)
    agents = [await loaded_agent(int8_workload, f"vb-{i}") for i in range(3)]
    alone = int8_workload.initial_state()
    for step, pairs in enumerate([((1, 2), (3.0, -3.0)), ((0, 5), (-2.0, 7.5))]):
        msg = ApplyUpdate(job_id=cfg.job_id, step=step, ks=pairs[0], coefficients=pairs[1])
        acks = [(await agent.handle(msg))[0] for agent in agents]
        alone = int8_workload.apply_update(alone, step, msg.pairs())
        assert [a.checksum for a in acks if isinstance(a, UpdateAck)] == [alone.checksum()] * 3
    held = [agent.train_state for agent in agents]
    assert held[0] is held[1] is held[2]
    assert held[0] is not None and held[0].is_frozen()
    with pytest.raises(ValueError, match="read-only"):
        held[0].params[0] = 0


async def test_agents_take_the_update_another_board_applied_to_the_same_weights(
    int8_workload: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Boards of one process handed the same decoded update on the same frozen weights
    take the first board's result by identity, without keying the update again; an
    equal message decoded apart goes through the memo by value; all ack the bits of a
    board that computed the update alone."""
    cfg = job_config(int8_workload.spec)
    agents = [await loaded_agent(int8_workload, f"vb-same-{i}") for i in range(3)]
    first = ApplyUpdate(job_id=cfg.job_id, step=0, ks=(2, 9), coefficients=(0.75, -1.5))
    for agent in agents:  # from here on the three hold one frozen state
        await agent.handle(first)
    keyed: list[int] = []
    update_key = board_module._Shared.update_key

    def counted(*args: object) -> object:
        keyed.append(1)
        return update_key(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(board_module._Shared, "update_key", staticmethod(counted))
    msg = ApplyUpdate(job_id=cfg.job_id, step=1, ks=(3, 8), coefficients=(-0.25, 2.0))
    acks = [(await agents[0].handle(msg))[0]]
    by_first = len(keyed)
    acks.append((await agents[1].handle(msg))[0])
    assert by_first > 0 and len(keyed) == by_first
    twin = ApplyUpdate.model_validate(msg.model_dump())
    assert twin == msg and twin is not msg
    acks.append((await agents[2].handle(twin))[0])
    assert len(keyed) > by_first
    alone = int8_workload.apply_update(int8_workload.initial_state(), 0, first.pairs())
    alone = int8_workload.apply_update(alone, 1, msg.pairs())
    assert [a.checksum for a in acks if isinstance(a, UpdateAck)] == [alone.checksum()] * 3


@pytest.mark.parametrize(("limit", "in_worker"), [(1 << 30, False), (0, True)])
async def test_agent_small_updates_are_applied_without_a_worker_thread(
    int8_workload: Workload, monkeypatch: pytest.MonkeyPatch, limit: int, in_worker: bool
) -> None:
    """An update small enough is applied right away on the event loop (no thread hop
    for the boards of a process to wait on); a larger one goes to the worker; both
    give Workload.apply_update's checksum."""
    monkeypatch.setattr(board_module, "_INLINE_UPDATE_WORK", limit)
    agent = await loaded_agent(int8_workload, f"vb-inline-{limit}")
    threads: list[object] = []
    to_thread = asyncio.to_thread

    async def counted(fn: object, *args: object) -> object:
        threads.append(fn)
        return await to_thread(fn, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(board_module.asyncio, "to_thread", counted)
    cfg = job_config(int8_workload.spec)
    # An update no other test applies: boards of this process memoise each one.
    ks = (4, 6) if in_worker else (5, 7)
    msg = ApplyUpdate(job_id=cfg.job_id, step=0, ks=ks, coefficients=(1.25, -0.5))
    (ack,) = await agent.handle(msg)
    expected = int8_workload.apply_update(int8_workload.initial_state(), 0, msg.pairs())
    assert isinstance(ack, UpdateAck) and ack.checksum == expected.checksum()
    assert bool(threads) is in_worker
