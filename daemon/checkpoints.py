"""A run's checkpoint: what a bit-identical resume needs, in the state directory's format.

The daemon writes one every ``checkpoint_every`` steps and on stop; ``qsched train
--out`` writes the same, so a single-process run resumes like a daemon job.

The run's history goes in as its packed records (``qsched.zo.history``), a copy of bytes
whatever the job's length. Serialising every record as JSON at every checkpoint made a
checkpoint's cost grow with the job (0.64 s at step 100,000, on the event loop, every
100 steps).
"""

from __future__ import annotations

import struct
from typing import Final

from qsched.daemon.state import Checkpoint
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.history import EvalHistory, StepHistory
from qsched.zo.step import EvalRecord, StepRecord
from qsched.zo.trainer import TrainResult
from qsched.zo.workload import TrainState

__all__ = ["checkpoint_of", "restore_checkpoint"]

_COUNTS: Final = struct.Struct("<II")  # steps, then validations, before their records


def _pack(result: TrainResult) -> bytes:
    """The history section: the record counts, the step records, the validation records."""
    counts = _COUNTS.pack(len(result.steps), len(result.evals))
    return counts + result.steps.packed() + result.evals.packed()


def _unpack(history: bytes) -> tuple[StepHistory, EvalHistory]:
    if len(history) < _COUNTS.size:
        raise ValueError("checkpoint history is shorter than its record counts")
    steps, evals = _COUNTS.unpack_from(history)
    split = _COUNTS.size + steps * StepHistory.LAYOUT.size
    if len(history) != split + evals * EvalHistory.LAYOUT.size:
        raise ValueError("checkpoint history does not match its record counts")
    return (
        StepHistory.from_packed(history[_COUNTS.size : split]),
        EvalHistory.from_packed(history[split:]),
    )


def checkpoint_of(result: TrainResult, policy: PolicySpec) -> Checkpoint:
    """A checkpoint holding everything a bit-identical resume needs.

    Args:
        result: the run so far (state, policy state, history).
        policy: the policy in use (it may differ from the spec's after change_policy).

    Returns:
        The checkpoint.
    """
    return Checkpoint(
        step=result.state.step,
        train_state=result.state.to_bytes(),
        policy_state=result.policy_state,
        extra={
            "forward_passes": result.forward_passes,
            "wall_s": result.wall_s,
            "policy": policy.model_dump(mode="json"),
        },
        history=_pack(result),
    )


def restore_checkpoint(spec: JobSpec, checkpoint: Checkpoint) -> tuple[TrainResult, PolicySpec]:
    """The run and policy a checkpoint holds (also one whose history is JSON records,
    as checkpoints were written before the packed history).

    Args:
        spec: the job's spec.
        checkpoint: its newest checkpoint.

    Returns:
        (result so far, the policy in use).

    Raises:
        ValueError: the packed history is inconsistent.
    """
    extra = checkpoint.extra
    if checkpoint.history:
        steps, evals = _unpack(checkpoint.history)
    else:
        steps = StepHistory(StepRecord(**r) for r in checkpoint.metrics)
        evals = EvalHistory(EvalRecord(**e) for e in extra.get("evals", []))
    result = TrainResult(
        spec=spec,
        state=TrainState.from_bytes(checkpoint.train_state),
        policy_state=dict(checkpoint.policy_state),
        steps=steps,
        evals=evals,
        forward_passes=int(extra.get("forward_passes", 0)),
        wall_s=float(extra.get("wall_s", 0.0)),
    )
    policy = PolicySpec.model_validate(extra["policy"]) if "policy" in extra else spec.policy
    return result, policy
