"""A run's checkpoint: what a bit-identical resume needs, in the state directory's format.

The daemon writes one every ``checkpoint_every`` steps and on stop; ``qsched train
--out`` writes the same, so a single-process run resumes like a daemon job.
"""

from __future__ import annotations

from dataclasses import asdict

from qsched.daemon.state import Checkpoint
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.step import EvalRecord, StepRecord
from qsched.zo.trainer import TrainResult
from qsched.zo.workload import TrainState

__all__ = ["checkpoint_of", "restore_checkpoint"]


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
        metrics=[asdict(r) for r in result.steps],
        extra={
            "evals": [asdict(e) for e in result.evals],
            "forward_passes": result.forward_passes,
            "wall_s": result.wall_s,
            "policy": policy.model_dump(mode="json"),
        },
    )


def restore_checkpoint(spec: JobSpec, checkpoint: Checkpoint) -> tuple[TrainResult, PolicySpec]:
    """The run and policy a checkpoint holds.

    Args:
        spec: the job's spec.
        checkpoint: its newest checkpoint.

    Returns:
        (result so far, the policy in use).
    """
    extra = checkpoint.extra
    result = TrainResult(
        spec=spec,
        state=TrainState.from_bytes(checkpoint.train_state),
        policy_state=dict(checkpoint.policy_state),
        steps=[StepRecord(**r) for r in checkpoint.metrics],
        evals=[EvalRecord(**e) for e in extra.get("evals", [])],
        forward_passes=int(extra.get("forward_passes", 0)),
        wall_s=float(extra.get("wall_s", 0.0)),
    )
    policy = PolicySpec.model_validate(extra["policy"]) if "policy" in extra else spec.policy
    return result, policy
