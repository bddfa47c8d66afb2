"""Pipelining: step t+1's eval requests go out right behind step t's update, before its
acks are in, and the run still ends with the single-process weights; a wrong ack voids
the board's next results and resynchronises it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from conftest import WrappedInProcTransport

from qsched.daemon.engine import EngineConfig, StepEngine
from qsched.daemon.fleet import Fleet, FleetEvent
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.firmware.virtual.faults import FaultPlan
from qsched.protocol.codec import decode
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.base import Link
from qsched.zo.trainer import train_zo
from qsched.zo.workload import TrainState

SPEC = JobSpec(
    name="pipe",
    steps=9,
    eval_every=4,
    batch_size=8,
    policy=PolicySpec(name="fixed", config={"q": 6}),
)

Trace = list[tuple[str, str, str, int]]  # (board, "out" | "in", message type, step)


class _TracingLink:
    """The daemon's end of a link that records every message's type and step, in order."""

    def __init__(self, inner: Link, board: str, trace: Trace) -> None:
        self._inner, self._board, self._trace = inner, board, trace

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def _note(self, direction: str, payload: bytes) -> None:
        msg = decode(payload)
        self._trace.append((self._board, direction, msg.type, getattr(msg, "step", -1)))

    async def send(self, payload: bytes) -> None:
        self._note("out", payload)
        await self._inner.send(payload)

    async def incoming(self) -> AsyncIterator[bytes]:
        async for payload in self._inner.incoming():
            self._note("in", payload)
            yield payload

    async def close(self) -> None:
        await self._inner.close()


async def _run(
    pipeline: bool, faults: dict[str, list[str]], trace_applies: bool = False
) -> tuple[int, Trace, list[FleetEvent]]:
    trace: Trace = []
    events: list[FleetEvent] = []
    transport = WrappedInProcTransport(lambda link, board: _TracingLink(link, board, trace))
    config = EngineConfig(pipeline=pipeline, audit_every=0)
    async with (
        transport,
        Fleet(transport, on_event=events.append) as fleet,
        asyncio.TaskGroup() as tasks,
    ):
        boards = []
        for i in range(3):
            board_id = f"vb-{i:02d}"
            plan = FaultPlan.parse(faults.get(board_id, []), seed=SPEC.seed).for_board(board_id)
            agent = BoardAgent(board_id, latency=LatencyProfile.off(), faults=plan)
            boards.append(tasks.create_task(serve_link(agent, transport.inner.attach(board_id))))
        while len([s for s in fleet.boards() if s.hello is not None]) < 3:
            await fleet.wait_changed(0.05)
        engine = StepEngine(SPEC, fleet, config=config)
        if trace_applies:  # the daemon's own updates, in the trace as ("daemon", "apply")
            apply_update = engine.workload.apply_update

            def traced(state: TrainState, t: int, pairs: list[tuple[int, float]]) -> TrainState:
                trace.append(("daemon", "apply", "", t))
                return apply_update(state, t, pairs)

            engine.workload.apply_update = traced  # type: ignore[method-assign]
        result = await engine.run()
        for board in boards:
            board.cancel()
    return result.state.checksum(), trace, events


_REQUESTS = ("eval_request", "eval_slice_request")


def _eval_before_ack(trace: Trace, board: str, t: int) -> bool:
    """Whether the daemon sent board's EvalRequest(t+1) before the board's UpdateAck(t) came in."""
    mine = [(d, kind, step) for b, d, kind, step in trace if b == board]
    # The request is for keys, or for a batch slice when the planner splits.
    sent = next(i for i, x in enumerate(mine) if x in {("out", k, t + 1) for k in _REQUESTS})
    acked = mine.index(("in", "update_ack", t))
    return sent < acked


@pytest.mark.parametrize("pipeline", [True, False])
async def test_engine_pipeline_same_weights_and_order(pipeline: bool) -> None:
    """With and without pipelining: the reference weights; requests overtake acks only when on."""
    checksum, trace, _ = await _run(pipeline, {})
    assert checksum == train_zo(SPEC).state.checksum()
    # Step 1 is no validation step (eval_every 4): its update carries step 2's requests.
    assert all(_eval_before_ack(trace, b, 1) == pipeline for b in ("vb-00", "vb-01", "vb-02"))
    # A validation step waits for every ack: step 4's requests follow step 3's acks.
    assert not any(_eval_before_ack(trace, b, 3) for b in ("vb-00", "vb-01", "vb-02"))


async def test_engine_pipeline_wrong_ack_voids_next_results() -> None:
    """A wrong checksum at a pipelined step: the board is faulted, resynchronised, and exact."""
    checksum, trace, events = await _run(True, {"vb-01": ["bad-checksum:step=1"]})
    assert checksum == train_zo(SPEC).state.checksum()
    faulty = [e for e in events if e.kind == "board_faulty"]
    assert (
        faulty
        and faulty[0].board_id == "vb-01"
        and faulty[0].message.startswith("step 1: checksum")
    )
    assert any(e.kind == "board_resynced" and e.board_id == "vb-01" for e in events)
    resync = trace.index(
        next(x for x in trace if x[:3] == ("vb-01", "out", "set_weights") and x[3] > 1)
    )
    # Full weights, then back to work: keys, or batch slices when the planner splits.
    work = {("vb-01", "out", kind, 5) for kind in _REQUESTS}
    assert work & set(trace[resync:])


async def test_engine_pipeline_daemon_updates_its_weights_after_a_board_acked() -> None:
    """Pipelined, the daemon computes its own copy of step t's update once a board has
    acknowledged it (boards that share its cores take theirs first), even when every
    ack comes 20 ms late; the weights and the ack checks are as before."""
    late = {f"vb-{i:02d}": ["delay:step=1:0.02"] for i in range(3)}
    checksum, trace, _ = await _run(True, late, trace_applies=True)
    assert checksum == train_zo(SPEC).state.checksum()
    applies = {t: i for i, (who, _, _, t) in enumerate(trace) if who == "daemon"}
    for t in (0, 1, 4, 5):  # pipelined steps (not validation steps, not the last)
        first_ack = next(i for i, x in enumerate(trace) if x[1:] == ("in", "update_ack", t))
        assert first_ack < applies[t]
