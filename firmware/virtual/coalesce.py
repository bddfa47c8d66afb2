"""Evaluations asked by the boards of one process at about the same time, computed together.

A fleet of virtual boards in one process gets one step's shard plan at once: every board
asks for the losses of a few perturbations on the same weights and the same minibatch.
Computed board by board, the host pays an engine call and a thread hop per board, and
from about 64 boards per process that per-call cost, not the forward passes, fills the
host's cores. A real fleet has no such cost: each board has its own NPU.

``EvalCoalescer`` is a group commit. The first request for a (state, step) opens a
group, of whole-batch requests or of batch slices, and queues its computation; requests
for the same group that arrive before the computation takes the workload's lock join it.
The computation evaluates the union of the group's perturbation keys, on the union of
its slices' samples, in one ``Workload`` call, and every board gets its own keys' values
on its own slice. The bits are the ones each board would compute alone: a key's loss
does not depend on which other keys share the engine call (the determinism contract's
shard invariance, in FP32 as in INT8), a sample's loss not on the other samples
evaluated with it, and a slice's sums are exact integers.

Each board still sleeps out its own modelled NPU time, so the fleet's timing is unchanged;
only the host's cost of simulating it falls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from qsched.zo.spsa import LossPairs, LossSums
from qsched.zo.workload import TrainState, Workload, float_warnings_silenced

__all__ = ["EvalCoalescer"]

# (start, count) of a batch slice; None: whole keys over the whole batch.
_Slice = tuple[int, int] | None
# A group's result: whole-batch losses, or the sums of each of its slices.
_Result = LossPairs | dict[tuple[int, int], LossSums]


@dataclass
class _Group:
    """Requests on one state and step, computed in one engine call: whole-batch ones,
    or batch slices (``slices``: the union of the requests' slices)."""

    state: TrainState
    step: int
    slices: dict[tuple[int, int], None] | None  # None: whole-batch requests
    keys: dict[int, None]  # the union of the requests' keys, in arrival order
    closed: bool = False  # set once its computation holds the lock: later requests wait
    task: asyncio.Task[_Result] | None = None


class EvalCoalescer:
    """Computes the evaluations of the boards sharing one workload in as few calls as it can.

    Args:
        workload: the workload the boards of this process share.
        lock: held while computing; the process's other computations on the workload
            (updates, validations) take it too.
    """

    def __init__(self, workload: Workload, lock: threading.Lock) -> None:
        self._workload = workload
        self._lock = lock
        self._groups_lock = threading.Lock()  # guards _open and the groups' keys and closed
        # (event loop id, step, sliced) -> the groups still taking requests
        self._open: dict[tuple[object, ...], list[_Group]] = {}

    async def losses(self, state: TrainState, step: int, ks: Sequence[int]) -> LossPairs:
        """``Workload.perturbed_losses`` of ``ks``, computed with the concurrent requests."""
        result = await self._evaluate(state, step, ks, None)
        assert isinstance(result, LossPairs)
        return result

    async def loss_sums(
        self, state: TrainState, step: int, ks: Sequence[int], start: int, count: int
    ) -> LossSums:
        """``Workload.perturbed_loss_sums`` of ``ks``, computed with the concurrent requests."""
        result = await self._evaluate(state, step, ks, (start, count))
        assert isinstance(result, LossSums)
        return result

    async def _evaluate(
        self, state: TrainState, step: int, ks: Sequence[int], batch_slice: _Slice
    ) -> LossPairs | LossSums:
        keys = [int(k) for k in ks]
        if len(set(keys)) != len(keys):  # the union would hide it: check it per request
            raise ValueError(f"repeated perturbation index in {keys}")
        task = self._join(state, step, batch_slice, keys)
        # shield: a board that stops waiting must not cancel the other boards' computation
        result = await asyncio.shield(task)
        if isinstance(result, dict):
            assert batch_slice is not None
            return _restricted(result[batch_slice], keys)
        return _restricted(result, keys)

    def _join(
        self, state: TrainState, step: int, batch_slice: _Slice, keys: list[int]
    ) -> asyncio.Task[_Result]:
        """Add ``keys`` (and the slice) to an open group for the request, or open one
        and start it."""
        loop = asyncio.get_running_loop()
        where = (id(loop), step, batch_slice is not None)
        with self._groups_lock:
            for group in self._open.get(where, []):
                if not group.closed and group.state is state:  # boards share frozen states
                    assert group.task is not None
                    group.keys.update(dict.fromkeys(keys))
                    if group.slices is not None and batch_slice is not None:
                        group.slices[batch_slice] = None
                    return group.task
            slices = None if batch_slice is None else {batch_slice: None}
            group = _Group(state, step, slices, dict.fromkeys(keys))
            self._open.setdefault(where, []).append(group)
            group.task = loop.create_task(self._compute(group, where))
            return group.task

    async def _compute(self, group: _Group, where: tuple[object, ...]) -> _Result:
        try:
            await asyncio.sleep(0)  # the other requests of this loop turn join before it runs
            return await asyncio.to_thread(self._run, group, where)
        finally:
            self._close(group, where)  # cancelled before it ran: nobody may join it now

    def _run(self, group: _Group, where: tuple[object, ...]) -> _Result:
        """In a worker thread: close the group once the workload is free, and compute it."""
        with self._lock, float_warnings_silenced():
            keys = self._close(group, where)
            if group.slices is None:
                return self._workload.perturbed_losses(group.state, group.step, keys)
            slices = list(group.slices)
            sums = self._workload.perturbed_slice_sums(group.state, group.step, keys, slices)
            return dict(zip(slices, sums, strict=True))

    def _close(self, group: _Group, where: tuple[object, ...]) -> list[int]:
        """Stop ``group`` taking requests; returns its keys."""
        with self._groups_lock:
            group.closed = True
            still_open = [g for g in self._open.get(where, []) if g is not group]
            if still_open:
                self._open[where] = still_open
            else:
                self._open.pop(where, None)
            return list(group.keys)


def _restricted(result: LossPairs | LossSums, keys: list[int]) -> LossPairs | LossSums:
    """The part of a group's result that one request asked for."""
    if isinstance(result, LossSums):
        return LossSums(
            plus={k: result.plus[k] for k in keys},
            minus={k: result.minus[k] for k in keys if k in result.minus},
            base=result.base,
        )
    return LossPairs(
        plus={k: result.plus[k] for k in keys},
        minus={k: result.minus[k] for k in keys if k in result.minus},
        base=result.base,
    )
