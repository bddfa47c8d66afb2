"""A run's checkpoint: its packed history, and checkpoints of the earlier layout."""

from __future__ import annotations

import math
import struct
from dataclasses import asdict

import pytest

from qsched.daemon.checkpoints import checkpoint_of, restore_checkpoint
from qsched.daemon.state import Checkpoint, StateDirError
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.history import EvalHistory, StepHistory
from qsched.zo.step import EvalRecord, StepRecord
from qsched.zo.trainer import TrainResult, train_zo

SPEC = JobSpec(steps=30, eval_every=10, policy=PolicySpec(name="fixed", config={"q": 2}))


@pytest.fixture(scope="module")
def result() -> TrainResult:
    return train_zo(SPEC)


def _extended(result: TrainResult, steps: int) -> TrainResult:
    """``result`` with ``steps`` more step records and one more validation."""
    more = [StepRecord(len(result.steps) + i, 4, 0.25 * i, 1000 + i) for i in range(steps)]
    return TrainResult(
        spec=result.spec,
        state=result.state,
        policy_state=result.policy_state,
        steps=StepHistory([*result.steps, *more]),
        evals=EvalHistory([*result.evals, EvalRecord(99, math.inf, 0.5, 2**40)]),
        forward_passes=result.forward_passes,
        wall_s=result.wall_s,
    )


def test_a_checkpoint_restores_the_run_exactly(result: TrainResult) -> None:
    """State, policy state, every step and validation record (float fields to the bit,
    an infinite loss and a large pass count included) come back from the file's bytes."""
    run = _extended(result, 3)
    data = checkpoint_of(run, SPEC.policy).to_bytes()
    restored, policy = restore_checkpoint(SPEC, Checkpoint.from_bytes(data))
    assert restored.steps == run.steps and restored.evals == run.evals
    assert [r.train_loss.hex() for r in restored.steps] == [r.train_loss.hex() for r in run.steps]
    assert restored.state.checksum() == run.state.checksum()
    assert restored.policy_state == run.policy_state and policy == SPEC.policy
    assert (restored.forward_passes, restored.wall_s) == (run.forward_passes, run.wall_s)


def test_a_checkpoint_of_the_earlier_layout_still_restores(result: TrainResult) -> None:
    """A checkpoint written before the packed history (records as JSON in the header)
    resumes to the same run."""
    new = checkpoint_of(result, SPEC.policy)
    old = Checkpoint(
        step=new.step,
        train_state=new.train_state,
        policy_state=new.policy_state,
        metrics=[asdict(r) for r in result.steps],
        extra={**new.extra, "evals": [asdict(e) for e in result.evals]},
    )
    restored, _ = restore_checkpoint(SPEC, Checkpoint.from_bytes(old.to_bytes()))
    assert restored.steps == result.steps and restored.evals == result.evals


def test_a_damaged_history_is_refused(result: TrainResult) -> None:
    """A changed or cut history fails the checkpoint's checks (the state directory then
    falls back to the previous checkpoint)."""
    data = bytearray(checkpoint_of(result, SPEC.policy).to_bytes())
    flipped = bytes(data[:-1]) + bytes([data[-1] ^ 1])
    with pytest.raises(StateDirError, match="history hash"):
        Checkpoint.from_bytes(flipped)
    with pytest.raises(StateDirError, match="truncated"):
        Checkpoint.from_bytes(bytes(data[:-4]))
    wrong_counts = Checkpoint(step=1, train_state=b"", history=struct.pack("<II", 5, 0))
    with pytest.raises(ValueError, match="record counts"):
        restore_checkpoint(SPEC, wrong_counts)
