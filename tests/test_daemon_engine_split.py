"""Split forward passes (SPEC 6.10): when boards outnumber a step's keys, INT8 jobs cut
each key's batch into slices over several boards and still train to the single-process
trainer's bits; FP32 jobs and jobs with splitting off never split."""

from __future__ import annotations

import pytest

from qsched.daemon.engine import EngineConfig
from qsched.firmware.virtual.board import LatencyProfile
from qsched.lab.harness import run_job_inprocess
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.trainer import train_zo

# Modelled NPU time well above the host's compute: every board measures the same rate.
LATENCY = LatencyProfile(macs_per_forward=20_000_000)


def _spec(**over: object) -> JobSpec:
    """Two keys a step on a batch of 4: four boards are busier with 2 slices a key."""
    base: dict[str, object] = {
        "name": "split",
        "steps": 6,
        "eval_every": 3,
        "batch_size": 4,
        "numerics": "int8",
        "policy": PolicySpec(name="fixed", config={"q": 2}),
    }
    base.update(over)
    return JobSpec.model_validate(base)


@pytest.mark.parametrize("estimator", ["two_sided", "one_sided"])
async def test_split_batches_match_trainer(estimator: str) -> None:
    """Every step is split, and the weights, losses and q trajectory are the reference's."""
    spec = _spec(estimator=estimator)
    reference = train_zo(spec)
    result = await run_job_inprocess(spec, boards=4, latency=LATENCY)
    assert result.status == "completed"
    assert result.split_steps >= spec.steps - 2  # the first steps may start with fewer boards
    assert result.state.checksum() == reference.state.checksum()
    assert result.steps == reference.steps
    assert result.faults == 0


@pytest.mark.parametrize("pipeline", [True, False])
async def test_a_step_is_planned_once_when_its_split_is_chosen(
    pipeline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Choosing a step's split plans every unit for each candidate; the step's first plan
    takes the chosen candidate's plan instead of planning again: with no reassignment,
    the daemon plans again at most once (the first step may have started among fewer
    boards than its plan sees), and the bits are the reference's."""
    import qsched.daemon.engine.context as context_module

    replans: list[int] = []
    plan_units = context_module.plan_units

    def counted(*args: object) -> object:
        replans.append(1)
        return plan_units(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(context_module, "plan_units", counted)
    spec = _spec()
    config = EngineConfig(pipeline=pipeline, audit_every=0)
    result = await run_job_inprocess(spec, boards=4, latency=LATENCY, config=config)
    assert result.state.checksum() == train_zo(spec).state.checksum()
    assert result.reassigned == 0 and len(replans) <= 1


async def test_split_batches_not_pipelined_match_trainer() -> None:
    """Without pipelining the collector plans the split itself: the same bits."""
    spec = _spec()
    result = await run_job_inprocess(
        spec, boards=4, latency=LATENCY, config=EngineConfig(pipeline=False)
    )
    assert result.split_steps >= spec.steps - 2  # the first steps may start with fewer boards
    assert result.state.checksum() == train_zo(spec).state.checksum()


async def test_split_batches_catch_a_lying_board() -> None:
    """A board whose slice sums are wrong is found by the audit and the run stays exact."""
    spec = _spec(steps=5)
    result = await run_job_inprocess(
        spec, boards=4, latency=LATENCY, faults=["lie:0.5"], fault_boards=["vb-01"]
    )
    assert result.split_steps >= spec.steps - 2  # the first steps may start with fewer boards
    assert result.faults >= 1
    assert result.state.checksum() == train_zo(spec).state.checksum()


async def test_split_batches_survive_a_crashed_board() -> None:
    """A board that dies mid-job leaves its slices to the others (reassigned)."""
    spec = _spec(steps=6)
    result = await run_job_inprocess(
        spec, boards=4, faults=["crash-at-step:3"], fault_boards=["vb-02"]
    )
    assert result.status == "completed"
    assert result.state.checksum() == train_zo(spec).state.checksum()


async def test_fp32_jobs_are_never_split() -> None:
    """FP32's float mean is not a sum of slices: whole batches only."""
    spec = _spec(numerics="fp32", lr=0.05, eps=0.01)
    result = await run_job_inprocess(spec, boards=4, latency=LATENCY)
    assert result.split_steps == 0
    assert result.state.checksum() == train_zo(spec).state.checksum()


async def test_split_batches_off() -> None:
    """``split_batches=False`` keeps whole batches; the bits are the same either way."""
    spec = _spec()
    result = await run_job_inprocess(
        spec, boards=4, latency=LATENCY, config=EngineConfig(split_batches=False)
    )
    assert result.split_steps == 0
    assert result.state.checksum() == train_zo(spec).state.checksum()
