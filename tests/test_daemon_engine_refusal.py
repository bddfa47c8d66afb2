"""SPEC 9.2: a model that no board can load ends the job as failed, with the reason."""

from __future__ import annotations

import asyncio

import pytest

from qsched.daemon.engine import EngineConfig, JobError, StepEngine
from qsched.daemon.fleet import Fleet
from qsched.protocol.codec import decode, encode
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.links.inproc import InProcLink, InProcTransport
from qsched.protocol.messages import (
    TYPE_CODES,
    Error,
    Heartbeat,
    Hello,
    JobConfig,
    Loaded,
    LoadModel,
    Ping,
    SelectDataset,
)

SPEC = JobSpec(name="refused", steps=5, batch_size=8)


async def _refusing_board(link: InProcLink, board_id: str) -> None:
    """A board that takes the job and the data set but refuses every model it is sent."""
    await link.send(
        encode(
            Hello(
                board_id=board_id,
                firmware_version="test-1",
                npu="virtual",
                ram_kib=64,
                max_batch=64,
            )
        )
    )
    async for raw in link.incoming():
        msg = decode(raw)
        if isinstance(msg, JobConfig):
            await link.send(
                encode(Loaded(resource="job_config", job_id=msg.job_id, crc32=0, size=0))
            )
        elif isinstance(msg, SelectDataset):
            await link.send(encode(Loaded(resource="dataset", crc32=0, size=0)))
        elif isinstance(msg, LoadModel) and msg.offset + len(msg.chunk) >= msg.total:
            error = Error(
                code="model_invalid",
                ref_type=TYPE_CODES[LoadModel],
                detail="operator 99 unsupported",
            )
            await link.send(encode(error))
        elif isinstance(msg, Ping):
            await link.send(encode(Heartbeat(nonce=msg.nonce, uptime_ms=1, state="idle")))


async def test_engine_model_refused_by_every_board_fails_job() -> None:
    """Every ready board answers model_invalid: the run fails at once, naming the reason."""
    config = EngineConfig(reply_timeout_s=2.0, resync_backoff_s=0.05)
    events: list[str] = []
    async with (
        InProcTransport() as transport,
        Fleet(transport) as fleet,
        asyncio.TaskGroup() as tasks,
    ):
        boards = [
            tasks.create_task(_refusing_board(transport.attach(f"rf-{i}"), f"rf-{i}"))
            for i in range(2)
        ]
        while len([s for s in fleet.boards() if s.hello is not None]) < 2:
            await fleet.wait_changed(0.05)
        engine = StepEngine(SPEC, fleet, config=config, on_event=lambda e: events.append(e.kind))
        with pytest.raises(JobError) as failed:
            await asyncio.wait_for(engine.run(), 10.0)
        for board in boards:
            board.cancel()
    assert failed.value.reason == "model_invalid" and "operator 99" in failed.value.detail
    assert engine.job_state == "failed" and "job_failed" in events
    assert "no board can load the model" in engine.status_line


async def test_engine_model_refused_by_one_board_others_train() -> None:
    """One board refuses the model, another loads it: the job completes on the one that can."""
    from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link

    config = EngineConfig(reply_timeout_s=2.0, resync_backoff_s=0.05)
    async with (
        InProcTransport() as transport,
        Fleet(transport) as fleet,
        asyncio.TaskGroup() as tasks,
    ):
        refusing = tasks.create_task(_refusing_board(transport.attach("rf-0"), "rf-0"))
        good = tasks.create_task(
            serve_link(BoardAgent("ok-0", latency=LatencyProfile.off()), transport.attach("ok-0"))
        )
        while len([s for s in fleet.boards() if s.hello is not None]) < 2:
            await fleet.wait_changed(0.05)
        result = await asyncio.wait_for(StepEngine(SPEC, fleet, config=config).run(), 30.0)
        refusing.cancel()
        good.cancel()
    assert result.status == "completed" and set(result.work) == {"ok-0"}
