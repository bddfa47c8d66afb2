"""Virtual board faults, modelled latency, and serving an in-process link."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
from test_firmware_virtual_board import eval_request, load_messages, loaded_agent

from qsched.firmware.virtual import board as board_module
from qsched.firmware.virtual.board import BoardAgent, BoardCrash, LatencyProfile, serve_link
from qsched.firmware.virtual.faults import (
    BAD_CHECKSUM_MASK,
    LIE_OFFSET,
    CorruptingStream,
    Fault,
    FaultError,
    FaultPlan,
    parse_fault,
)
from qsched.firmware.virtual.latency import MOBILENETV2_035_128_MACS, NpuLatencyModel
from qsched.protocol.codec import decode, encode
from qsched.protocol.errors import ProtocolError
from qsched.protocol.framing import FrameEncoder, FrameReader
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.links.inproc import InProcTransport
from qsched.protocol.messages import (
    ApplyUpdate,
    EvalResult,
    Heartbeat,
    Hello,
    Ping,
    UpdateAck,
    ValidateRequest,
    ValidateResult,
    job_config,
)
from qsched.zo.workload import Workload


@pytest.fixture(scope="module")
def int8_workload() -> Workload:
    """The digits MLP in INT8 with a batch of 32."""
    return Workload.from_spec(JobSpec(numerics="int8", batch_size=32, seed=11))


def faults(*specs: str, board: str = "vb-0", seed: int = 0):  # type: ignore[no-untyped-def]
    """A board's faults from ``--fault`` texts."""
    return FaultPlan.parse(specs, seed).for_board(board)


def update(workload: Workload, step: int) -> ApplyUpdate:
    """A small update of the job at ``step``."""
    return ApplyUpdate(
        job_id=job_config(workload.spec).job_id, step=step, ks=(0, 3), coefficients=(1.5, -2.0)
    )


# ------------------------------------------------------------------ parsing and determinism


def test_fault_parse_every_kind() -> None:
    """Each kind parses with a probability or step=N; delay carries seconds."""
    assert parse_fault("drop:0.1") == Fault("drop", probability=0.1)
    assert parse_fault("delay:0.05:2.0") == Fault("delay", probability=0.05, seconds=2.0)
    assert parse_fault("delay:step=3:1.5") == Fault("delay", step=3, seconds=1.5)
    assert parse_fault("crash-at-step:7") == Fault("crash-at-step", step=7)
    assert parse_fault("corrupt:0.01") == Fault("corrupt", probability=0.01)
    assert parse_fault("lie:0.2") == Fault("lie", probability=0.2)
    assert parse_fault("bad-checksum:step=5") == Fault("bad-checksum", step=5)


@pytest.mark.parametrize(
    "text",
    [
        "explode:0.1",
        "drop",
        "drop:1.5",
        "drop:x",
        "delay:0.1",
        "crash-at-step:x",
        "delay:0.1:-1",
        "lie:0.1:2",
    ],
)
def test_fault_parse_rejects_bad_text(text: str) -> None:
    """Unknown kinds and bad arguments raise FaultError."""
    with pytest.raises(FaultError):
        parse_fault(text)


def test_fault_decisions_are_seeded_per_board_and_kind() -> None:
    """Same seed and board: same decisions; another board or seed: different ones."""

    def drops(board: str, seed: int, extra: tuple[str, ...] = ()) -> list[bool]:
        f = faults("drop:0.5", *extra, board=board, seed=seed)
        out = []
        for _ in range(64):
            f.lie(
                EvalResult(
                    job_id=1,
                    step=0,
                    compute_us=0,
                    estimator="two_sided",
                    ks=(0,),
                    loss_plus=(1.0,),
                    loss_minus=(1.0,),
                )
            )
            out.append(f.drop(None))
        return out

    reference = drops("vb-0", 1)
    assert reference == drops("vb-0", 1)
    assert reference == drops("vb-0", 1, ("lie:0.5",))  # another kind does not shift drop's stream
    assert reference != drops("vb-1", 1) and reference != drops("vb-0", 2)
    assert 16 < sum(reference) < 48


# ------------------------------------------------------------------ each fault does what it says


async def test_fault_drop_loses_the_answer(int8_workload: Workload) -> None:
    """drop:step=0 drops step 0's answers (the update still applies); drop:1 drops all."""
    agent = await loaded_agent(int8_workload, faults=faults("drop:step=0"))
    assert await agent.handle(eval_request(int8_workload, 0, (0,))) == []
    assert await agent.handle(update(int8_workload, 0)) == []
    assert agent.train_state is not None and agent.train_state.step == 1
    assert isinstance((await agent.handle(eval_request(int8_workload, 1, (0,))))[0], EvalResult)
    mute = BoardAgent("vb-1", latency=LatencyProfile.off(), faults=faults("drop:1.0", board="vb-1"))
    assert await mute.handle(Ping(nonce=1)) == []


async def test_fault_delay_holds_only_its_step(int8_workload: Workload) -> None:
    """delay:step=1:0.3 delays the answer about step 1 by at least 0.3 s, not step 0's."""
    agent = await loaded_agent(int8_workload, faults=faults("delay:step=1:0.3"))
    start = time.perf_counter()
    assert len(await agent.handle(update(int8_workload, 0))) == 1
    assert time.perf_counter() - start < 0.3
    start = time.perf_counter()
    (result,) = await agent.handle(eval_request(int8_workload, 1, (0,)))
    assert time.perf_counter() - start >= 0.3 and isinstance(result, EvalResult)


async def test_fault_crash_at_step(int8_workload: Workload) -> None:
    """crash-at-step:1 serves step 0 and dies on the first request for step 1."""
    agent = await loaded_agent(int8_workload, faults=faults("crash-at-step:1"))
    assert isinstance((await agent.handle(eval_request(int8_workload, 0, (0,))))[0], EvalResult)
    assert isinstance((await agent.handle(update(int8_workload, 0)))[0], UpdateAck)
    with pytest.raises(BoardCrash) as info:
        await agent.handle(eval_request(int8_workload, 1, (0,)))
    assert info.value.step == 1


async def test_fault_lie_reports_wrong_losses(int8_workload: Workload) -> None:
    """lie:1 shifts every L+ by LIE_OFFSET; L- stays true."""
    agent = await loaded_agent(int8_workload, faults=faults("lie:1.0"))
    (result,) = await agent.handle(eval_request(int8_workload, 0, (1, 2)))
    expected = int8_workload.perturbed_losses(int8_workload.initial_state(), 0, (1, 2))
    assert isinstance(result, EvalResult)
    assert list(result.loss_plus) == [expected.plus[k] + LIE_OFFSET for k in (1, 2)]
    assert list(result.loss_minus) == [expected.minus[k] for k in (1, 2)]


async def test_fault_bad_checksum_at_one_step(int8_workload: Workload) -> None:
    """bad-checksum:step=1 misreports step 1's checksum only; the weights stay right."""
    agent = await loaded_agent(int8_workload, faults=faults("bad-checksum:step=1"))
    state = int8_workload.initial_state()
    for step in range(3):
        state = int8_workload.apply_update(state, step, update(int8_workload, step).pairs())
        (ack,) = await agent.handle(update(int8_workload, step))
        assert isinstance(ack, UpdateAck)
        wrong = state.checksum() ^ BAD_CHECKSUM_MASK
        assert ack.checksum == (wrong if step == 1 else state.checksum())


class _Sink:
    """A byte stream that records writes."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    async def read(self) -> bytes:
        return b""

    async def write(self, data: bytes) -> None:
        self.written.append(data)

    async def close(self) -> None:
        return None


async def test_fault_corrupt_frames_fail_the_crc() -> None:
    """corrupt:1 flips bits of every serial frame; the receiver's frame check rejects each."""
    sink = _Sink()
    stream = CorruptingStream(sink, faults("corrupt:1.0"))
    encoder = FrameEncoder()
    frames = [encoder.data(encode(Ping(nonce=n)))[1] for n in range(20)]
    for frame in frames:
        await stream.write(frame)
    assert stream.corrupted == 20
    for sent, wire in zip(frames, sink.written, strict=True):
        assert wire != sent and len(wire) == len(sent)
        (got,) = FrameReader().feed(wire)
        assert isinstance(got, ProtocolError)


async def test_fault_corrupt_payloads_on_message_links() -> None:
    """On a message link (MQTT, in-process) corrupt:1 changes the payload bytes sent."""
    agent = BoardAgent("vb-0", latency=LatencyProfile.off(), faults=faults("corrupt:1.0"))
    async with InProcTransport() as transport:
        link = transport.attach("vb-0")
        daemon_end = (await anext(transport.events())).link  # type: ignore[union-attr]
        task = asyncio.create_task(serve_link(agent, link, corrupt_payloads=True))
        first = await anext(daemon_end.incoming())
        assert first != encode(agent.hello())
        await daemon_end.close()
        assert await task == "closed"


# ------------------------------------------------------------------ latency


async def test_latency_eval_sleeps_the_modelled_model(int8_workload: Workload) -> None:
    """Modelling MobileNetV2-0.35@128: one two-sided k on 32 samples takes >= 64 inferences."""
    latency = LatencyProfile.named("mobilenetv2-0.35-128")
    agent = await loaded_agent(int8_workload)
    agent.latency = latency
    modelled = NpuLatencyModel().forward_seconds(MOBILENETV2_035_128_MACS, 2 * 32)
    start = time.perf_counter()
    (result,) = await agent.handle(eval_request(int8_workload, 0, (0,)))
    assert time.perf_counter() - start >= modelled
    assert isinstance(result, EvalResult) and result.compute_us >= int(modelled * 1e6)


async def test_latency_answer_is_encoded_while_the_board_waits(
    int8_workload: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eval answer is built and encoded once, well before its modelled time is up, and
    those bytes are what the link sends; the answer still comes no earlier than due."""
    encoded_at: list[tuple[type, float]] = []
    real_encode = board_module._encode

    def recording_encode(msg: object) -> bytes:
        encoded_at.append((type(msg), time.perf_counter()))
        return real_encode(msg)  # type: ignore[arg-type]

    monkeypatch.setattr(board_module, "_encode", recording_encode)
    agent = await loaded_agent(int8_workload)
    agent.latency = LatencyProfile(macs_per_forward=MOBILENETV2_035_128_MACS, speed=8.0)
    modelled = NpuLatencyModel().forward_seconds(MOBILENETV2_035_128_MACS, 2 * 32) / 8.0
    start = time.perf_counter()
    (result,) = await agent.handle(eval_request(int8_workload, 0, (0,)))
    answered = time.perf_counter()
    assert answered - start >= modelled
    [encoded] = [at for kind, at in encoded_at if kind is EvalResult]
    assert answered - encoded >= modelled / 2
    assert agent.encoded(result) == encode(result)
    assert [kind for kind, _ in encoded_at].count(EvalResult) == 1  # not encoded again


async def test_latency_starts_when_the_request_arrived(int8_workload: Workload) -> None:
    """The modelled time runs from the request's arrival at the board's link, not from
    when the process got round to it; a request that arrived while the board was still
    busy starts when its previous answer was due."""
    agent = await loaded_agent(int8_workload)
    agent.latency = LatencyProfile(macs_per_forward=MOBILENETV2_035_128_MACS, speed=2.0)
    modelled = NpuLatencyModel().forward_seconds(MOBILENETV2_035_128_MACS, 2 * 32) / 2.0
    waited = 0.6 * modelled  # the request sat this long before the board was handed it
    arrived = time.perf_counter() - waited
    (result,) = await agent.handle_bytes(encode(eval_request(int8_workload, 0, (0,))), arrived)
    answered = time.perf_counter()
    assert isinstance(result, EvalResult)
    assert arrived + modelled <= answered < arrived + modelled + 0.5 * waited
    # A second request stamped as arriving before the first answer was due queues behind it.
    (second,) = await agent.handle_bytes(encode(eval_request(int8_workload, 0, (1,))), arrived)
    assert isinstance(second, EvalResult)
    assert time.perf_counter() >= arrived + 2 * modelled


async def test_serve_link_hands_the_answer_over_from_a_timer(
    int8_workload: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an in-process link the board's handling of a request ends at once and its
    answer is handed to the link by a timer when due: not earlier, and as encoded."""
    agent = await loaded_agent(int8_workload)
    agent.latency = LatencyProfile(macs_per_forward=MOBILENETV2_035_128_MACS, speed=8.0)
    modelled = NpuLatencyModel().forward_seconds(MOBILENETV2_035_128_MACS, 2 * 32) / 8.0
    returned: list[float] = []
    real_handle = agent.handle_bytes

    async def recording(*args: Any, **kwargs: Any) -> list[Any]:
        replies = await real_handle(*args, **kwargs)
        returned.append(time.perf_counter())
        return replies

    monkeypatch.setattr(agent, "handle_bytes", recording)
    async with InProcTransport() as transport:
        link = transport.attach("vb-0")
        daemon_end = (await anext(transport.events())).link  # type: ignore[union-attr]
        task = asyncio.create_task(serve_link(agent, link))
        inbox = daemon_end.incoming()
        assert isinstance(decode(await anext(inbox)), Hello)
        request = eval_request(int8_workload, 0, (0,))
        sent = time.perf_counter()
        await daemon_end.send(encode(request))
        answer = await anext(inbox)
        answered = time.perf_counter()
        assert isinstance(decode(answer), EvalResult)
        assert answered - sent >= modelled
        assert returned and answered - returned[0] >= modelled / 2  # handled long before
        await daemon_end.send(encode(Ping(nonce=5)))  # the board goes on as before
        pong = decode(await anext(inbox))
        assert isinstance(pong, Heartbeat) and pong.nonce == 5
        await daemon_end.close()
        assert await task == "closed"


async def test_inproc_link_stamps_arrivals() -> None:
    """An in-process link end reports when the message its incoming yields was sent."""
    async with InProcTransport() as transport:
        link = transport.attach("vb-0")
        daemon_end = (await anext(transport.events())).link  # type: ignore[union-attr]
        before = time.perf_counter()
        await daemon_end.send(b"first")
        sent = time.perf_counter()
        await asyncio.sleep(0.02)
        inbox = link.incoming()
        assert await anext(inbox) == b"first"
        assert link.last_arrival is not None and before <= link.last_arrival <= sent


async def test_latency_speed_and_validation(int8_workload: Workload) -> None:
    """A board twice as fast sleeps at least half the time; validation is timed per sample."""
    agent = await loaded_agent(int8_workload)
    agent.latency = LatencyProfile(macs_per_forward=MOBILENETV2_035_128_MACS, speed=2.0)
    cfg = job_config(int8_workload.spec)
    modelled = NpuLatencyModel().forward_seconds(MOBILENETV2_035_128_MACS, 40) / 2.0
    start = time.perf_counter()
    (result,) = await agent.handle(ValidateRequest(job_id=cfg.job_id, step=0, start=0, count=40))
    assert time.perf_counter() - start >= modelled
    assert isinstance(result, ValidateResult) and result.compute_us >= int(modelled * 1e6)


def test_latency_profile_computed_model_and_wire() -> None:
    """Without a modelled size the computed MACs count; serial time follows the baud rate."""
    profile = LatencyProfile(baud=9600)
    assert profile.forward_seconds(1000, 10) == pytest.approx(
        NpuLatencyModel().forward_seconds(1000, 10)
    )
    assert profile.wire_seconds(948) >= 948 * 10 / 9600
    assert LatencyProfile().wire_seconds(1000) == 0.0
    assert LatencyProfile.off().forward_seconds(10**9, 100) == 0.0
    with pytest.raises(ValueError):
        LatencyProfile.named("resnet-9000")


async def test_serve_link_hello_heartbeats_and_serial_time() -> None:
    """serve_link: Hello first, heartbeats on time, answers delayed by the modelled wire."""
    agent = BoardAgent("vb-0", latency=LatencyProfile(enabled=True, baud=9600))
    async with InProcTransport() as transport:
        link = transport.attach("vb-0")
        daemon_end = (await anext(transport.events())).link  # type: ignore[union-attr]
        task = asyncio.create_task(serve_link(agent, link, heartbeat_interval=0.05))
        inbox = daemon_end.incoming()
        assert isinstance(decode(await anext(inbox)), Hello)
        assert isinstance(decode(await anext(inbox)), Heartbeat)
        start = time.perf_counter()
        await daemon_end.send(encode(Ping(nonce=77)))
        while not isinstance(answer := decode(await anext(inbox)), Heartbeat) or answer.nonce != 77:
            pass
        wire = agent.latency.wire_seconds(len(encode(Ping(nonce=77)))) + agent.latency.wire_seconds(
            len(encode(answer))
        )
        assert time.perf_counter() - start >= wire
        await daemon_end.close()
        assert await task == "closed"


async def test_serve_link_crash_closes_the_link(int8_workload: Workload) -> None:
    """In-process, a crash fault closes the board's link instead of exiting."""
    agent = BoardAgent("vb-0", latency=LatencyProfile.off(), faults=faults("crash-at-step:0"))
    async with InProcTransport() as transport:
        link = transport.attach("vb-0")
        daemon_end = (await anext(transport.events())).link  # type: ignore[union-attr]
        task = asyncio.create_task(serve_link(agent, link))
        for msg in load_messages(int8_workload):
            await daemon_end.send(encode(msg))
        await daemon_end.send(encode(eval_request(int8_workload, 0, (0,))))
        assert await asyncio.wait_for(task, 10) == "crashed"
        assert daemon_end.closed


def test_flip_bits_never_writes_a_delimiter() -> None:
    """Corruption keeps frame delimiters where they were (and adds none)."""
    from qsched.firmware.virtual.faults import flip_bits

    rng = random.Random(3)
    data = bytes(range(1, 256)) + b"\x00" + bytes([1]) * 50
    for _ in range(200):
        out = flip_bits(data, rng, count=3)
        assert [i for i, b in enumerate(out) if b == 0] == [255]


async def test_serve_link_says_hello_again_after_reconnect() -> None:
    """When the link's connection count changes (MQTT reconnect), the board sends Hello again."""
    agent = BoardAgent("vb-0", latency=LatencyProfile.off())
    connects = [1]
    async with InProcTransport() as transport:
        link = transport.attach("vb-0")
        daemon_end = (await anext(transport.events())).link  # type: ignore[union-attr]
        task = asyncio.create_task(
            serve_link(agent, link, heartbeat_interval=60, connects=lambda: connects[0])
        )
        inbox = daemon_end.incoming()
        assert isinstance(decode(await anext(inbox)), Hello)
        connects[0] = 2
        assert isinstance(decode(await asyncio.wait_for(anext(inbox), 5)), Hello)
        await daemon_end.send(encode(Ping(nonce=9)))
        beat = decode(await asyncio.wait_for(anext(inbox), 5))
        assert isinstance(beat, Heartbeat) and beat.nonce == 9
        await daemon_end.close()
        assert await task == "closed"
