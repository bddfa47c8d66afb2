"""One task group per job: a child's error does not cancel its siblings, and no task of a
job outlives it, however the job ends."""

from __future__ import annotations

import asyncio

import pytest

from qsched.daemon.engine import EngineConfig, JobError, StepEngine
from qsched.daemon.engine.context import JobTasks
from qsched.daemon.fleet import Fleet
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.firmware.virtual.faults import FaultPlan
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.inproc import InProcTransport

SPEC = JobSpec(
    name="tasks", steps=12, eval_every=4, policy=PolicySpec(name="fixed", config={"q": 6})
)


def _job_tasks() -> set[str]:
    """Names of the engine's background tasks still alive (loads, shards, updates)."""
    names = {t.get_name() for t in asyncio.all_tasks() if not t.done()}
    kinds = ("].sync", "].eval[", "].update[")
    return {n for n in names if n.startswith("fleet[") and any(k in n for k in kinds)}


async def test_job_tasks_child_error_reaches_its_reader_only() -> None:
    """A child that raises hands the error to whoever reads its outcome; a sibling runs on."""

    async def fails() -> int:
        raise ValueError("board said no")

    async def works() -> int:
        await asyncio.sleep(0.01)
        return 7

    async with JobTasks("j") as tasks:
        bad, good = tasks.spawn(fails(), "bad"), tasks.spawn(works(), "good")
        await asyncio.wait([bad, good])
        with pytest.raises(ValueError, match="board said no"):
            bad.result().get()
        assert good.result().get() == 7


async def test_job_tasks_exit_cancels_children_and_refuses_new_ones() -> None:
    """Leaving the group cancels what still runs; nothing can start afterwards."""
    async with JobTasks("j") as tasks:
        sleeper = tasks.spawn(asyncio.sleep(3600), "sleeper")
    assert sleeper.cancelled()
    with pytest.raises(RuntimeError, match="not running"):
        tasks.spawn(asyncio.sleep(0), "late")


async def test_job_tasks_let_the_jobs_own_error_through() -> None:
    """The body's exception leaves the group as itself, not wrapped in an ExceptionGroup."""
    with pytest.raises(JobError):
        async with JobTasks("j") as tasks:
            tasks.spawn(asyncio.sleep(3600), "sleeper")
            raise JobError("numeric", "a loss is NaN")


async def _run(engine_stop: str, faults: list[str]) -> None:
    """Run the job on 3 boards (vb-0 faulty), end it as ``engine_stop`` says, check the tasks."""
    plans = [FaultPlan.parse(faults, seed=1), FaultPlan.parse([]), FaultPlan.parse([])]
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        endpoints = [transport.attach(f"vb-{i}") for i in range(3)]
        async with asyncio.TaskGroup() as boards:
            for endpoint, plan in zip(endpoints, plans, strict=True):
                agent = BoardAgent(
                    endpoint.board_id,
                    latency=LatencyProfile.off(),
                    faults=plan.for_board(endpoint.board_id),
                )
                boards.create_task(serve_link(agent, endpoint))
            config = EngineConfig(step_deadline_s=0.2, deadline_factor=1.0)
            engine = StepEngine(SPEC, fleet, config=config)
            run = asyncio.create_task(engine.run())
            if engine_stop == "stop":
                while engine.step < 5:
                    await asyncio.sleep(0.01)
                engine.stop()
            result = await run
            assert _job_tasks() == set()
            assert result.status == ("completed" if engine_stop == "end" else "stopped")
            for endpoint in endpoints:
                await endpoint.close()


@pytest.mark.parametrize("how", ["end", "stop"])
async def test_engine_leaves_no_task_behind(how: str) -> None:
    """Completed or stopped, with a board answering late: no load, shard or update task is left."""
    await _run(how, ["delay:step=3:1.0"])
