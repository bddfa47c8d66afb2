"""Step engine on in-process fleets of virtual boards: the reference weights, sharding,
reassignment, faulty boards, waiting for boards, resume."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from qsched.daemon.engine import EngineConfig, StepEngine
from qsched.daemon.fleet import Fleet
from qsched.daemon.state import StateStore
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.lab.harness import run_job_inprocess
from qsched.protocol.control import Event
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.inproc import InProcTransport
from qsched.protocol.messages import Error, EvalRequest
from qsched.zo.trainer import train_zo

FIXED8 = PolicySpec(name="fixed", config={"q": 8})


def _spec(**over: object) -> JobSpec:
    base: dict[str, object] = {
        "name": "t",
        "steps": 10,
        "eval_every": 4,
        "policy": FIXED8,
        "checkpoint_every": 3,
    }
    base.update(over)
    return JobSpec.model_validate(base)


async def test_engine_inprocess_matches_trainer() -> None:
    """Four in-process boards train an INT8 job to the single-process trainer's exact weights."""
    spec = _spec()
    reference = train_zo(spec)
    result = await run_job_inprocess(spec, boards=4)
    assert result.status == "completed"
    assert result.state.checksum() == reference.state.checksum()
    assert result.steps == reference.steps
    assert result.evals == reference.evals
    assert result.faults == 0


async def test_engine_qscheduler_trajectory_matches_trainer() -> None:
    """With the default adaptive policy the fleet's q trajectory equals the reference's."""
    spec = JobSpec(name="qs", steps=30, eval_every=5, batch_size=32)
    reference = train_zo(spec)
    result = await run_job_inprocess(spec, boards=2)
    assert [s.q for s in result.steps] == [s.q for s in reference.steps]
    assert result.state.checksum() == reference.state.checksum()


async def test_engine_lr_following_q_matches_trainer() -> None:
    """qscheduler's lr_full_q scales the daemon's coefficients exactly as the trainer's."""
    policy = PolicySpec(name="qscheduler", config={"lr_full_q": 8})
    spec = JobSpec(name="qs", steps=30, eval_every=5, batch_size=32, policy=policy)
    reference = train_zo(spec)
    result = await run_job_inprocess(spec, boards=2)
    assert [s.q for s in result.steps] == [s.q for s in reference.steps]
    assert result.state.checksum() == reference.state.checksum()
    unscaled = train_zo(spec.model_copy(update={"policy": PolicySpec(name="qscheduler")}))
    assert result.state.checksum() != unscaled.state.checksum()


async def test_engine_shards_follow_throughput() -> None:
    """A board modelled four times faster is given more keys than a slow one."""
    spec = _spec(steps=6, policy=PolicySpec(name="fixed", config={"q": 16}), batch_size=16)
    latency = LatencyProfile(macs_per_forward=2_000_000)
    result = await run_job_inprocess(
        spec, boards=2, latency=latency, speeds=[1.0, 4.0], config=EngineConfig(audit_every=0)
    )
    assert result.work["vb-01"] > 2 * result.work["vb-00"]
    assert result.state.checksum() == train_zo(spec).state.checksum()


async def test_engine_late_board_reassigned() -> None:
    """A board that answers step 2 late has its keys reassigned; the weights are unchanged."""
    spec = _spec(steps=5)
    events: list[Event] = []
    # No audits: an audit key overlapping its shard could cover a late board's only key.
    config = EngineConfig(step_deadline_s=0.3, deadline_factor=1.0, audit_every=0)
    result = await run_job_inprocess(
        spec,
        boards=3,
        config=config,
        faults=["delay:step=2:1.5"],
        fault_boards=["vb-01"],
        on_event=events.append,
    )
    assert result.reassigned > 0
    assert any(e.kind == "board_faulty" and e.board_id == "vb-01" for e in events)
    assert result.state.checksum() == train_zo(spec).state.checksum()


async def test_engine_lying_board_faulty_and_resynced() -> None:
    """A board that lies about losses is caught by the audit, marked faulty, resynchronised."""
    spec = _spec(steps=6)
    collected: list[Event] = []
    result = await run_job_inprocess(
        spec, boards=3, faults=["lie:step=2"], fault_boards=["vb-02"], on_event=collected.append
    )
    faulty = [e for e in collected if e.kind == "board_faulty"]
    assert [e.board_id for e in faulty] == ["vb-02"]
    assert any(e.kind == "board_resynced" and e.board_id == "vb-02" for e in collected)
    assert result.state.checksum() == train_zo(spec).state.checksum()


class _NumericBoard(BoardAgent):
    """A board whose losses are not finite: it refuses every evaluation with ``numeric``."""

    async def handle(self, msg, arrived=None, *, hold=True):  # type: ignore[no-untyped-def]
        if isinstance(msg, EvalRequest):
            return [
                Error(
                    code="numeric",
                    ref_type=0x45,
                    job_id=msg.job_id,
                    step=msg.step,
                    detail="loss is nan",
                )
            ]
        return await super().handle(msg)


async def _fleet_job(
    spec: JobSpec, agents: list[BoardAgent], **engine_options: object
) -> tuple[StepEngine, object]:
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        endpoints = [transport.attach(a.board_id) for a in agents]
        async with asyncio.TaskGroup() as tasks:
            for agent, endpoint in zip(agents, endpoints, strict=True):
                tasks.create_task(serve_link(agent, endpoint))
            engine = StepEngine(spec, fleet, **engine_options)  # type: ignore[arg-type]
            try:
                result = await engine.run()
            finally:
                for endpoint in endpoints:
                    await endpoint.close()
    return engine, result


async def test_engine_numeric_error_marks_board_faulty() -> None:
    """A board answering Error(numeric) is faulty, its keys go elsewhere, nothing is lost."""
    spec = _spec(steps=4)
    agents = [
        BoardAgent("good", latency=LatencyProfile.off()),
        _NumericBoard("nan", latency=LatencyProfile.off()),
    ]
    engine, result = await _fleet_job(spec, agents)
    assert engine.faults >= 1
    assert result.state.checksum() == train_zo(spec).state.checksum()  # type: ignore[attr-defined]


async def test_engine_no_boards_waits_and_says_so() -> None:
    """Without boards the job waits with a status saying so, then runs when a board arrives."""
    spec = _spec(steps=3)
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        engine = StepEngine(spec, fleet)
        job = asyncio.create_task(engine.run())
        await asyncio.sleep(0.5)
        assert not job.done()
        assert "waiting for boards" in engine.status_line
        endpoint = transport.attach("late-board")
        board = asyncio.create_task(
            serve_link(BoardAgent("late-board", latency=LatencyProfile.off()), endpoint)
        )
        result = await asyncio.wait_for(job, 60)
        await endpoint.close()
        await board
    assert result.status == "completed"
    assert result.state.checksum() == train_zo(spec).state.checksum()


def _stop_after(step: int, engines: list[StepEngine]) -> Callable[[Event], None]:
    """An event hook that stops the first engine of ``engines`` after step ``step``."""

    def hook(event: Event) -> None:
        if event.kind == "step" and event.step == step:
            engines[0].stop(shutdown=True)

    return hook


# qscheduler at the top of a one-rung ladder from its first validation, where every
# later validation is a stall (no accuracy gains 0.5): each halves the rate.
_HALVING = PolicySpec(
    name="qscheduler",
    config={
        "q0": 2,
        "qmax": 2,
        "metric": "val_accuracy",
        "min_delta": 0.5,
        "patience": 1,
        "cooldown": 0,
        "lr_halvings": 3,
    },
)


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"lr_decay": "linear", "lr_decay_start": 0.3, "lr_end": 0.25},
        {"policy": _HALVING, "eval_every": 2},
    ],
    ids=["constant_lr", "lr_decay", "lr_halvings"],
)
async def test_engine_stop_and_resume_bit_identical(
    tmp_path: pytest.TempPathFactory, over: dict[str, object]
) -> None:
    """A job stopped mid-run and resumed from its checkpoint ends at the reference weights,
    with a constant learning rate, one that decays over the steps, and one the policy
    halves before and after the stop."""
    spec = _spec(steps=9, **{"policy": PolicySpec(name="qscheduler"), **over})
    store = StateStore(tmp_path)  # type: ignore[arg-type]
    job_dir = store.create_job("t", spec.model_dump(mode="json"), status="running")

    engine_box: list[StepEngine] = []
    stop_at_five = _stop_after(4, engine_box)
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        endpoint = transport.attach("b0")
        board = asyncio.create_task(
            serve_link(BoardAgent("b0", latency=LatencyProfile.off()), endpoint)
        )
        engine = StepEngine(spec, fleet, job_dir=job_dir, on_event=stop_at_five)
        engine_box.append(engine)
        first = await engine.run()
        assert first.state.step == 5
        checkpoint = job_dir.load_checkpoint()
        assert checkpoint is not None and checkpoint.step == 5
        second = StepEngine(spec, fleet, job_dir=job_dir, resume=checkpoint)
        result = await second.run()
        await endpoint.close()
        await board
    reference = train_zo(spec)
    assert result.status == "completed"
    assert result.state.checksum() == reference.state.checksum()
    assert result.steps == reference.steps


async def test_recalibrating_job_resumes_on_a_new_board_bit_identical(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """Scale recalibration every 2 steps, stopped at step 5 and resumed on a board that
    never saw the job: SetWeights carries the exponents, the end is the reference's."""
    spec = _spec(steps=9, recalibrate_every=2)
    store = StateStore(tmp_path)  # type: ignore[arg-type]
    job_dir = store.create_job("t", spec.model_dump(mode="json"), status="running")

    engines: list[StepEngine] = []
    stop_at_five = _stop_after(4, engines)
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        for name in ("b0", "b1"):
            endpoint = transport.attach(name)
            board = asyncio.create_task(
                serve_link(BoardAgent(name, latency=LatencyProfile.off()), endpoint)
            )
            if not engines:
                engines.append(StepEngine(spec, fleet, job_dir=job_dir, on_event=stop_at_five))
                first = await engines[0].run()
                checkpoint = job_dir.load_checkpoint()
                assert checkpoint is not None and checkpoint.step == 5
                assert first.state.scale_exps is not None and first.state.scale_exps.max() > 0
            else:
                result = await StepEngine(spec, fleet, job_dir=job_dir, resume=checkpoint).run()
            await endpoint.close()
            await board
    assert result.status == "completed"
    assert result.state.checksum() == train_zo(spec).state.checksum()


async def test_engine_drained_board_gets_no_work() -> None:
    """A drained board keeps its weights in step but is given no keys."""
    spec = _spec(steps=4)
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        endpoints = [transport.attach(name) for name in ("keep", "drain")]
        boards = [
            asyncio.create_task(serve_link(BoardAgent(e.board_id, latency=LatencyProfile.off()), e))
            for e in endpoints
        ]
        while len([s for s in fleet.boards() if s.hello is not None]) < 2:
            await fleet.wait_changed(0.1)
        drained = fleet.find("drain")
        assert drained is not None
        drained.draining = True
        engine = StepEngine(spec, fleet)
        result = await engine.run()
        assert drained.step == spec.steps  # it followed every update
        for endpoint in endpoints:
            await endpoint.close()
        await asyncio.gather(*boards)
    assert engine.work == {"keep": 4 * 8}
    assert result.state.checksum() == train_zo(spec).state.checksum()


@pytest.mark.parametrize(
    ("numerics", "estimator", "accumulator"),
    [
        ("fp32", "two_sided", "fp16"),
        ("fp32", "one_sided", "fp16"),
        ("int8", "one_sided", "fp16"),
        ("int8", "two_sided", "int8"),
    ],
)
async def test_engine_numerics_variants_match_trainer(
    numerics: str, estimator: str, accumulator: str
) -> None:
    """FP32, the one-sided estimator and the INT8 accumulator also reach the reference weights."""
    spec = _spec(
        steps=5, numerics=numerics, estimator=estimator, accumulator=accumulator, batch_size=16
    )
    result = await run_job_inprocess(spec, boards=3)
    reference = train_zo(spec)
    assert result.state.checksum() == reference.state.checksum()
    assert result.evals == reference.evals and result.faults == 0


async def test_engine_wrong_checksum_resyncs_board() -> None:
    """A board whose UpdateAck checksum differs is resynchronised with SetWeights and works on."""
    spec = _spec(steps=6)
    events: list[Event] = []
    result = await run_job_inprocess(
        spec,
        boards=2,
        faults=["bad-checksum:step=2"],
        fault_boards=["vb-01"],
        on_event=events.append,
    )
    kinds = [(e.kind, e.board_id) for e in events if e.board_id is not None]
    assert ("board_faulty", "vb-01") in kinds and ("board_resynced", "vb-01") in kinds
    assert next(e for e in events if e.kind == "board_faulty").message.startswith(
        "step 2: checksum"
    )
    assert result.work["vb-01"] > 0 and result.state.checksum() == train_zo(spec).state.checksum()


def test_halving_policy_halves_before_and_after_the_resume_point() -> None:
    """The halving case above is one: one halving is in the step-5 checkpoint, three at the
    end, and they change the weights."""
    spec = _spec(steps=9, eval_every=2, policy=_HALVING)
    assert train_zo(spec, stop_at=5).policy_state["lr_halvings"] == 1
    reference = train_zo(spec)
    assert reference.policy_state["lr_halvings"] == 3
    unhalved = PolicySpec(name="qscheduler", config={**_HALVING.config, "lr_halvings": 0})
    plain = train_zo(spec.model_copy(update={"policy": unhalved}))
    assert reference.state.checksum() != plain.state.checksum()
