"""Single-process ZO training: the fleet's step, run in one process.

Each step is exactly what the daemon and its boards do together: the policy's q, the
losses of perturbations k = 0..q-1 on the step's minibatch (``workload.py``), then the
pure step both share (``step.py``: coefficients, update, records, validation cadence). Used by the
experiment runner, by tests, and as the reference a fleet run must reproduce bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qsched.policies import PolicyContext, QPolicy, checked_lr_scale, checked_q, create_policy
from qsched.protocol.jobspec import JobSpec
from qsched.zo.history import EvalHistory, StepHistory
from qsched.zo.step import EvalRecord, StepRecord, eval_record, settle_step, validates_after
from qsched.zo.workload import TrainState, Workload, float_warnings_silenced

__all__ = ["TrainResult", "policy_context", "train_zo"]


@dataclass
class TrainResult:
    """Where a run stands: the state, the policy's saved state and the history.

    Pass it back as ``train_zo(..., resume=result)`` to continue the run.
    """

    spec: JobSpec
    state: TrainState
    policy_state: dict[str, Any]
    steps: StepHistory = field(default_factory=StepHistory)
    evals: EvalHistory = field(default_factory=EvalHistory)
    forward_passes: int = 0
    wall_s: float = 0.0

    @property
    def final_accuracy(self) -> float:
        """Validation accuracy of the last validation (NaN if none ran)."""
        return self.evals[-1].val_accuracy if self.evals else float("nan")

    @property
    def done(self) -> bool:
        """True once all the spec's steps ran."""
        return bool(self.state.step >= self.spec.steps)


def policy_context(spec: JobSpec, workload: Workload) -> PolicyContext:
    """The facts a q policy is given about a job."""
    return PolicyContext(
        total_steps=spec.steps,
        steps_per_epoch=len(workload.dataset.x_train) / spec.batch_size,
        eval_every=spec.eval_every,
    )


def train_zo(
    spec: JobSpec,
    policy: QPolicy | None = None,
    on_step: Callable[[StepRecord, EvalRecord | None], None] | None = None,
    *,
    workload: Workload | None = None,
    resume: TrainResult | None = None,
    stop_at: int | None = None,
) -> TrainResult:
    """Train with ZO steps in this process.

    Args:
        spec: the job.
        policy: the q policy (default: built from ``spec.policy``); with ``resume`` its
            state is restored from the result.
        on_step: called after every step with its record and the validation that
            followed it (or None).
        workload: a prebuilt workload for ``spec`` (saves the construction).
        resume: a previous result of the same spec to continue from.
        stop_at: stop before this step (default: ``spec.steps``).

    Returns:
        The result: final state, policy state, per-step and per-validation history.
    """
    wl = workload if workload is not None else Workload.from_spec(spec)
    qpolicy = policy if policy is not None else create_policy(spec.policy, policy_context(spec, wl))
    if resume is not None:
        if resume.spec != spec:
            raise ValueError("resume: the result belongs to another job spec")
        qpolicy.load_state_dict(resume.policy_state)
        result = TrainResult(
            spec,
            resume.state.copy(),
            dict(resume.policy_state),
            resume.steps.copy(),
            resume.evals.copy(),
            resume.forward_passes,
            resume.wall_s,
        )
    else:
        result = TrainResult(spec, wl.initial_state(), qpolicy.state_dict())
    end = spec.steps if stop_at is None else min(stop_at, spec.steps)
    started = time.perf_counter()
    while result.state.step < end:
        record, evaluation = _one_step(wl, qpolicy, result)
        if on_step is not None:
            on_step(record, evaluation)
    result.policy_state = qpolicy.state_dict()
    result.wall_s += time.perf_counter() - started
    return result


def _one_step(
    wl: Workload, policy: QPolicy, result: TrainResult
) -> tuple[StepRecord, EvalRecord | None]:
    spec, step, q = wl.spec, result.state.step, checked_q(policy)
    with float_warnings_silenced():
        losses = wl.perturbed_losses(result.state, step, range(q))
    lr_scale = checked_lr_scale(policy, q)
    settled = settle_step(spec, step, q, losses, result.forward_passes, lr_scale)
    result.state = wl.apply_update(result.state, step, settled.pairs)
    result.forward_passes = settled.record.forward_passes
    result.steps.append(settled.record)
    policy.on_step(settled.report)
    evaluation = None
    if validates_after(spec, step):
        evaluation = eval_record(step, *wl.validate(result.state), result.forward_passes)
        result.evals.append(evaluation)
        policy.on_eval(evaluation.report())
    return settled.record, evaluation
