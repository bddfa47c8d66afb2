"""Evaluations of the boards of one process computed together (``EvalCoalescer``): each
board gets the bits it would compute alone, concurrent requests share engine calls,
and a request's own mistakes stay its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from qsched.firmware.virtual.coalesce import EvalCoalescer
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.intloss import batch_losses_of_totals
from qsched.zo.workload import TrainState, Workload

STEP = 3


class _CountingWorkload:
    """A workload that counts its engine calls (the coalescer's only use of it)."""

    def __init__(self, workload: Workload) -> None:
        self.inner = workload
        self.calls: list[list[int]] = []
        self.slices: list[list[tuple[int, int]]] = []

    def perturbed_losses(self, state: TrainState, step: int, ks: Sequence[int]) -> Any:
        self.calls.append(list(ks))
        return self.inner.perturbed_losses(state, step, ks)

    def perturbed_slice_sums(
        self, state: TrainState, step: int, ks: Sequence[int], slices: Sequence[tuple[int, int]]
    ) -> Any:
        self.calls.append(list(ks))
        self.slices.append(list(slices))
        return self.inner.perturbed_slice_sums(state, step, ks, slices)


def _workload(numerics: str, estimator: str = "two_sided") -> Workload:
    spec = JobSpec(
        name="coalesce",
        steps=8,
        batch_size=4,
        numerics=numerics,  # type: ignore[arg-type]
        estimator=estimator,  # type: ignore[arg-type]
        policy=PolicySpec(name="fixed", config={"q": 16}),
    )
    return Workload.from_spec(spec)


def _coalescer(workload: Workload) -> tuple[EvalCoalescer, _CountingWorkload]:
    counting = _CountingWorkload(workload)
    return EvalCoalescer(counting, threading.Lock()), counting  # type: ignore[arg-type]


# Keys of four boards: disjoint, out of order, and one key every board shares.
SHARDS = [[0, 1, 2], [7, 5], [3, 9, 11, 4], [9]]


@pytest.mark.parametrize(
    ("numerics", "estimator"),
    [("fp32", "two_sided"), ("int8", "two_sided"), ("int8", "one_sided")],
)
def test_concurrent_boards_get_their_own_keys_bit_for_bit_in_one_call(
    numerics: str, estimator: str
) -> None:
    workload = _workload(numerics, estimator)
    state = workload.initial_state().frozen()
    coalescer, counting = _coalescer(workload)

    async def boards() -> list[Any]:
        return await asyncio.gather(*(coalescer.losses(state, STEP, ks) for ks in SHARDS))

    results = asyncio.run(boards())
    assert len(counting.calls) == 1  # every request joined the first one's group
    assert sorted(counting.calls[0]) == sorted({k for ks in SHARDS for k in ks})
    for ks, got in zip(SHARDS, results, strict=True):
        alone = workload.perturbed_losses(state, STEP, ks)
        assert list(got.plus) == ks
        assert got.plus == alone.plus and got.minus == alone.minus and got.base == alone.base


def test_slices_share_one_call_and_sum_to_the_single_board_sums() -> None:
    workload = _workload("int8")
    state = workload.initial_state().frozen()
    coalescer, counting = _coalescer(workload)
    # Slices that split the batch, one that overlaps them, and a one-sample slice.
    requests = [(ks, start, 2) for ks in SHARDS for start in (0, 2)] + [([2, 6], 1, 3), ([6], 3, 1)]

    async def boards() -> list[Any]:
        return await asyncio.gather(
            *(coalescer.loss_sums(state, STEP, ks, start, count) for ks, start, count in requests)
        )

    results = asyncio.run(boards())
    assert len(counting.calls) == 1  # every slice's keys perturbed once, in one call
    assert counting.slices == [[(0, 2), (2, 2), (1, 3), (3, 1)]]
    for (ks, start, count), got in zip(requests, results, strict=True):
        alone = workload.perturbed_loss_sums(state, STEP, ks, start, count)
        assert list(got.plus) == ks
        assert got.plus == alone.plus and got.minus == alone.minus


def test_a_workload_computes_several_slices_as_each_alone() -> None:
    workload = _workload("int8", "one_sided")
    state = workload.initial_state().frozen()
    slices = [(3, 1), (0, 4), (1, 2)]
    together = workload.perturbed_slice_sums(state, STEP, [5, 1, 8], slices)
    for (start, count), got in zip(slices, together, strict=True):
        assert got == workload.perturbed_loss_sums(state, STEP, [5, 1, 8], start, count)
    # The whole batch's sums give perturbed_losses' batch losses, computed without slices.
    whole = workload.perturbed_losses(state, STEP, [5, 1, 8])
    assert together[1].base is not None
    assert batch_losses_of_totals([together[1].base], 4) == [whole.base]
    assert batch_losses_of_totals(list(together[1].plus.values()), 4) == list(whole.plus.values())
    with pytest.raises(ValueError, match="outside the batch"):
        workload.perturbed_slice_sums(state, STEP, [5], [(0, 2), (3, 2)])
    with pytest.raises(ValueError, match="no batch slice"):
        workload.perturbed_slice_sums(state, STEP, [5], [])


def test_requests_on_different_weights_or_steps_are_not_mixed() -> None:
    workload = _workload("int8")
    before = workload.initial_state().frozen()
    after = workload.apply_update(before, 0, [(0, 0.5), (1, -0.25)]).frozen()
    coalescer, counting = _coalescer(workload)
    asks = [(before, STEP, [0, 1]), (after, STEP, [0, 1]), (before, STEP + 1, [0, 1])]

    async def boards() -> list[Any]:
        return await asyncio.gather(*(coalescer.losses(s, step, ks) for s, step, ks in asks))

    results = asyncio.run(boards())
    assert len(counting.calls) == 3
    for (state, step, ks), got in zip(asks, results, strict=True):
        assert got.plus == workload.perturbed_losses(state, step, ks).plus
    assert results[0].plus != results[1].plus  # the weights differ, so do the losses


def test_a_request_with_a_repeated_key_is_refused_alone() -> None:
    workload = _workload("fp32")
    state = workload.initial_state().frozen()
    coalescer, _ = _coalescer(workload)

    async def boards() -> list[Any]:
        return await asyncio.gather(
            coalescer.losses(state, STEP, [4, 4]),
            coalescer.losses(state, STEP, [4, 5]),
            return_exceptions=True,
        )

    refused, answered = asyncio.run(boards())
    assert isinstance(refused, ValueError) and "repeated" in str(refused)
    assert answered.plus == workload.perturbed_losses(state, STEP, [4, 5]).plus


def test_a_board_that_stops_waiting_does_not_cancel_the_others() -> None:
    workload = _workload("fp32")
    state = workload.initial_state().frozen()
    coalescer, counting = _coalescer(workload)

    async def boards() -> Any:
        quitter = asyncio.create_task(coalescer.losses(state, STEP, [0]))
        stayer = asyncio.create_task(coalescer.losses(state, STEP, [1]))
        await asyncio.sleep(0)  # both joined one group
        quitter.cancel()
        return await stayer

    got = asyncio.run(boards())
    assert len(counting.calls) == 1
    assert got.plus == workload.perturbed_losses(state, STEP, [1]).plus
