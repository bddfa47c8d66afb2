"""Step engine audits: lies in reassigned shards and late answers never reach the weights."""

from __future__ import annotations

import asyncio
import time

from qsched.daemon.engine import EngineConfig, StepEngine, fleet_event
from qsched.daemon.fleet import Fleet
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.firmware.virtual.faults import FaultPlan, replace_losses
from qsched.lab.harness import run_job_inprocess
from qsched.protocol.codec import decode
from qsched.protocol.control import Event
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.inproc import InProcTransport
from qsched.protocol.messages import DataMessage, EvalRequest, EvalResult, Loaded, Ping, SetWeights
from qsched.zo.trainer import train_zo

FIXED8 = PolicySpec(name="fixed", config={"q": 8})


def _spec(**over: object) -> JobSpec:
    base: dict[str, object] = {
        "name": "t",
        "steps": 5,
        "eval_every": 5,
        "policy": FIXED8,
        "checkpoint_every": 5,
    }
    base.update(over)
    return JobSpec.model_validate(base)


class _ReassignLiar(BoardAgent):
    """Answers its first request of each step honestly and lies in every later one
    (reassigned keys)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.seen: dict[int, int] = {}
        self.lies = 0

    async def handle(self, msg, arrived=None, *, hold=True):  # type: ignore[no-untyped-def]
        replies = await super().handle(msg, arrived, hold=hold)
        if isinstance(msg, EvalRequest):
            self.seen[msg.step] = self.seen.get(msg.step, 0) + 1
            if self.seen[msg.step] > 1:
                self.lies += 1
                return [replace_losses(r) if isinstance(r, EvalResult) else r for r in replies]
        return replies


async def _run(
    spec: JobSpec, agents: list[BoardAgent], config: EngineConfig, events: list[Event]
) -> int:
    membership = lambda e: events.append(fleet_event(e))  # noqa: E731
    async with InProcTransport() as transport, Fleet(transport, on_event=membership) as fleet:
        endpoints = [transport.attach(a.board_id) for a in agents]
        async with asyncio.TaskGroup() as tasks:
            for agent, endpoint in zip(agents, endpoints, strict=True):
                tasks.create_task(serve_link(agent, endpoint))
            while len([s for s in fleet.boards() if s.hello is not None]) < len(agents):
                await fleet.wait_changed(0.05)
            engine = StepEngine(spec, fleet, config=config, on_event=events.append)
            try:
                result = await engine.run()
            finally:
                for endpoint in endpoints:
                    await endpoint.close()
    return result.state.checksum()


async def test_engine_audit_lie_in_reassigned_shard_caught() -> None:
    """A board lying only in a shard reassigned to it (after another's was late) is caught;
    weights match."""
    spec = _spec()
    off = LatencyProfile.off()
    late = FaultPlan.parse(["delay:step=2:1.0"], seed=spec.seed).for_board("vb-00")
    liar = _ReassignLiar("vb-01", latency=off)
    agents = [BoardAgent("vb-00", latency=off, faults=late), liar]
    events: list[Event] = []
    config = EngineConfig(step_deadline_s=0.3, deadline_factor=1.0)
    checksum = await _run(spec, agents, config, events)
    assert liar.lies > 0
    assert any(
        e.kind == "board_faulty" and e.board_id == "vb-01" and "disagree" in e.message
        for e in events
    )
    assert checksum == train_zo(spec).state.checksum()


async def test_engine_audit_combined_faults_match_reference() -> None:
    """Two clean boards and three with lies, drops, delays and bad checksums end at the
    reference."""
    spec = _spec(steps=30, eval_every=10, checkpoint_every=10)
    faults = ["lie:0.05", "drop:0.05", "delay:0.05:0.6", "bad-checksum:0.05"]
    config = EngineConfig(
        step_deadline_s=0.3, deadline_factor=1.0, reply_timeout_s=0.5, resync_backoff_s=0.05
    )
    result = await run_job_inprocess(
        spec, boards=5, config=config, faults=faults, fault_boards=["vb-02", "vb-03", "vb-04"]
    )
    assert result.faults > 0
    assert result.state.checksum() == train_zo(spec).state.checksum()


async def test_engine_corrupted_payloads_never_stop_the_job() -> None:
    """Bit flips in whole payloads (a message link has no frame CRC) are dropped when they
    no longer decode and resynchronised when they hit a checksum; the job completes every
    step and the clean boards end holding the daemon's weights.

    Reference bits are not promised here: a flip inside an unaudited loss decodes as a
    valid, wrong value (docs/ARCHITECTURE.md, "Audits"); on MQTT, TCP's checks stand in
    for the serial links' CRC."""
    spec = _spec(steps=20, eval_every=10, checkpoint_every=10)
    off = LatencyProfile.off()
    plan = FaultPlan.parse(["corrupt:0.1"], seed=spec.seed)
    agents = [BoardAgent(f"vb-{i:02d}", latency=off) for i in range(2)]
    agents += [
        BoardAgent(f"vb-{i:02d}", latency=off, faults=plan.for_board(f"vb-{i:02d}"))
        for i in range(2, 5)
    ]
    corrupted = 0

    def counted(corrupt):  # type: ignore[no-untyped-def]
        def wrapper(data: bytes) -> bytes:
            nonlocal corrupted
            out = corrupt(data)
            corrupted += out != data
            return out

        return wrapper

    for agent in agents[2:]:
        agent.faults.corrupt = counted(agent.faults.corrupt)  # type: ignore[method-assign]
    config = EngineConfig(
        step_deadline_s=0.3, deadline_factor=1.0, reply_timeout_s=0.5, resync_backoff_s=0.05
    )
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        endpoints = [transport.attach(a.board_id) for a in agents]
        async with asyncio.TaskGroup() as tasks:
            for agent, endpoint in zip(agents, endpoints, strict=True):
                tasks.create_task(serve_link(agent, endpoint, corrupt_payloads=True))
            engine = StepEngine(spec, fleet, config=config)
            try:
                result = await engine.run()
            finally:
                for endpoint in endpoints:
                    await endpoint.close()
    assert corrupted > 0
    assert result.status == "completed"
    assert result.state.step == spec.steps and len(result.steps) == spec.steps
    for agent in agents[:2]:
        assert agent.train_state is not None
        assert agent.train_state.checksum() == result.state.checksum()


class _LosesWeightsReply(BoardAgent):
    """Never answers its first ``SetWeights`` (the reply is lost); later ones normally."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.swallowed = 0

    async def handle(self, msg, arrived=None, *, hold=True):  # type: ignore[no-untyped-def]
        replies = await super().handle(msg, arrived, hold=hold)
        if (
            isinstance(msg, SetWeights)
            and self.swallowed == 0
            and any(isinstance(r, Loaded) for r in replies)
        ):
            self.swallowed += 1
            return []
        return replies


async def test_engine_lost_resync_reply_does_not_stall_others() -> None:
    """A board whose SetWeights reply is lost does not hold up the step: the others train on."""
    spec = _spec(steps=8, eval_every=8, checkpoint_every=8)
    off = LatencyProfile.off()
    bad = FaultPlan.parse(["bad-checksum:step=1"], seed=spec.seed).for_board("vb-02")
    agents = [
        BoardAgent("vb-00", latency=off),
        BoardAgent("vb-01", latency=off),
        _LosesWeightsReply("vb-02", latency=off, faults=bad),
    ]
    events: list[Event] = []
    config = EngineConfig(step_deadline_s=0.3, resync_timeout_s=30.0)
    started = time.perf_counter()
    checksum = await _run(spec, agents, config, events)
    assert agents[2].swallowed == 1  # type: ignore[attr-defined]
    assert time.perf_counter() - started < 10.0  # far less than the resync timeout
    assert checksum == train_zo(spec).state.checksum()


class _HangsAt(BoardAgent):
    """Stops answering anything (heartbeats included) from the first message about step
    ``at`` on."""

    def __init__(self, *args: object, at: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.at = at
        self.release = asyncio.Event()
        self.hung = False

    async def handle_bytes(
        self, data: bytes, arrived: float | None = None, *, hold: bool = True
    ) -> list[DataMessage]:
        msg = decode(data)
        if not isinstance(msg, Ping) and getattr(msg, "step", 0) >= self.at:
            self.hung = True
        if self.hung:
            await self.release.wait()
            return []
        return await super().handle_bytes(data, arrived, hold=hold)


async def test_engine_hung_board_costs_a_step_deadline() -> None:
    """A board that hangs (link open, no answers) during a validation costs a step deadline,
    not a reply timeout."""
    spec = _spec(steps=8, eval_every=4, checkpoint_every=8)
    off = LatencyProfile.off()
    hung = _HangsAt("vb-02", latency=off, at=4)  # ValidateRequest(step 4) after step 3
    agents = [BoardAgent("vb-00", latency=off), BoardAgent("vb-01", latency=off), hung]
    config = EngineConfig(step_deadline_s=0.5, reply_timeout_s=20.0)
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        endpoints = [transport.attach(a.board_id) for a in agents]
        async with asyncio.TaskGroup() as tasks:
            for agent, endpoint in zip(agents, endpoints, strict=True):
                tasks.create_task(
                    serve_link(agent, endpoint, heartbeat_interval=3600.0 if agent is hung else 1.0)
                )
            while len([s for s in fleet.boards() if s.hello is not None]) < len(agents):
                await fleet.wait_changed(0.05)
            started = time.perf_counter()
            try:
                result = await StepEngine(spec, fleet, config=config).run()
            finally:
                hung.release.set()
                for endpoint in endpoints:
                    await endpoint.close()
            elapsed = time.perf_counter() - started
    assert hung.hung
    assert elapsed < 5.0  # about two step deadlines (the validation slice, the resync); not 20 s
    assert result.state.checksum() == train_zo(spec).state.checksum()
