"""The in-process fleet harness: a job on virtual boards inside one event loop.

Experiments, the demo's tests and the engine's tests use it: the real step engine and
fleet over the in-process transport, each board a real ``BoardAgent`` serving its link.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from qsched.daemon.engine import EngineConfig, JobResult, StepEngine, fleet_event
from qsched.daemon.fleet import Fleet, FleetEvent
from qsched.daemon.state import JobDir
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.firmware.virtual.faults import FaultPlan
from qsched.protocol.control import Event
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.links.inproc import InProcTransport

__all__ = ["run_job_inprocess"]


async def run_job_inprocess(
    spec: JobSpec,
    boards: int = 4,
    *,
    config: EngineConfig | None = None,
    latency: Any = None,
    faults: Sequence[str] = (),
    fault_boards: Sequence[str] | None = None,
    speeds: Sequence[float] | None = None,
    job_dir: JobDir | None = None,
    on_event: Callable[[Event], None] | None = None,
    corrupt_payloads: bool = False,
) -> JobResult:
    """Train ``spec`` on ``boards`` virtual boards in this event loop (experiments, demo, tests).

    Args:
        spec: the job.
        boards: how many virtual boards (ids ``vb-00``, ``vb-01``, ...).
        config: engine knobs.
        latency: a ``LatencyProfile`` for every board (default: none, as fast as the CPU).
        faults: fault specs (``qsched board --fault`` syntax) for the boards in ``fault_boards``.
        fault_boards: which boards get ``faults`` (default: all).
        speeds: per-board speed multipliers of the latency model (heterogeneous fleets).
        job_dir: where metrics and checkpoints go (None: nowhere).
        on_event: control-plane events.
        corrupt_payloads: the ``corrupt`` fault flips bits of whole payloads, as on MQTT
            (no frame CRC: a flipped loss decodes as a valid, wrong value).

    Returns:
        The job's result.
    """
    plan = FaultPlan.parse(list(faults), seed=spec.seed)
    no_faults = FaultPlan.parse([])
    base = latency if latency is not None else LatencyProfile.off()

    def membership(event: FleetEvent) -> None:
        if on_event is not None:
            on_event(fleet_event(event, spec.name))

    async with InProcTransport() as transport, Fleet(transport, on_event=membership) as fleet:
        endpoints = []
        async with asyncio.TaskGroup() as tasks:
            for i in range(boards):
                board_id = f"vb-{i:02d}"
                speed = speeds[i] if speeds is not None else base.speed
                profile = LatencyProfile(
                    base.macs_per_forward, speed, base.baud, base.enabled, base.npu
                )
                chosen = fault_boards is None or board_id in fault_boards
                agent = BoardAgent(
                    board_id,
                    latency=profile,
                    faults=(plan if chosen else no_faults).for_board(board_id),
                )
                endpoint = transport.attach(board_id)
                endpoints.append(endpoint)
                tasks.create_task(
                    serve_link(agent, endpoint, corrupt_payloads=corrupt_payloads),
                    name=f"board[{board_id}].serve",
                )
            engine = StepEngine(spec, fleet, config=config, job_dir=job_dir, on_event=on_event)
            try:
                return await engine.run()
            finally:
                for endpoint in endpoints:
                    await endpoint.close()
