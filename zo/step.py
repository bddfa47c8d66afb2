"""One ZO training step as a pure function: what every runner of a job computes alike.

The single-process trainer (``trainer.py``) and the fleet's step engine
(``daemon/engine.py``) gather a step's losses differently (here, or sharded over
boards), then hand them to :func:`settle_step`, which turns them into the coefficients of
the update, the step's record and the policy's report. The cadences of validation and
checkpoints are defined here too, once, so the two runners cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qsched.policies import EvalReport, StepReport
from qsched.protocol.jobspec import JobSpec
from qsched.zo.lr_decay import lr_decay_factor
from qsched.zo.spsa import LossPairs, coefficients, forward_passes, projected_gradients

__all__ = [
    "EvalRecord",
    "SettledStep",
    "StepRecord",
    "checkpoint_due",
    "eval_record",
    "settle_step",
    "step_lr",
    "train_loss",
    "validates_after",
]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One finished step: its q, training loss and the cumulative forward passes."""

    step: int
    q: int
    train_loss: float
    forward_passes: int


@dataclass(frozen=True, slots=True)
class EvalRecord:
    """One validation, after step ``step``."""

    step: int
    val_loss: float
    val_accuracy: float
    forward_passes: int

    def report(self) -> EvalReport:
        """What the q policy hears of this validation."""
        return EvalReport(self.step, self.val_loss, self.val_accuracy)


@dataclass(frozen=True)
class SettledStep:
    """A step's losses turned into its update and its records.

    ``pairs`` are the ``(k, c_k)`` of the update (``ApplyUpdate``), ``record`` goes to the
    history and the metrics log, ``report`` to the q policy.
    """

    pairs: list[tuple[int, float]]
    record: StepRecord
    report: StepReport


def train_loss(losses: LossPairs) -> float:
    """The step's training loss: mean over k of (L+ + L-) / 2, or L0 one-sided."""
    if losses.base is not None:
        return float(losses.base)
    ks = losses.ks
    return float(sum((losses.plus[k] + losses.minus[k]) / 2.0 for k in ks) / len(ks))


def settle_step(
    spec: JobSpec,
    step: int,
    q: int,
    losses: LossPairs,
    passes_before: int,
    lr_scale: float = 1.0,
) -> SettledStep:
    """Coefficients, record and policy report of step ``step`` from its losses.

    Args:
        spec: the job (learning rate and its decay, ε, estimator).
        step: the step's index.
        q: the step's number of perturbations; ``losses`` holds keys ``0..q-1``.
        losses: the step's losses.
        passes_before: the forward passes of all earlier steps.
        lr_scale: the q policy's factor on ``spec.lr`` for this step (``lr_scale``).

    Returns:
        The update's pairs, the step's record and the policy's report.

    Raises:
        LossError: a loss is NaN or infinite, or a key is missing.
    """
    pairs = coefficients(losses, step_lr(spec, step, lr_scale), spec.eps, q, spec.estimator)
    grads = projected_gradients(losses, spec.eps, spec.estimator)
    passes = passes_before + forward_passes(q, spec.estimator)
    record = StepRecord(step, q, train_loss(losses), passes)
    gradients = np.array([grads[k] for k in range(q)])
    return SettledStep(pairs, record, StepReport(step, q, record.train_loss, gradients, passes))


def step_lr(spec: JobSpec, step: int, lr_scale: float = 1.0) -> float:
    """Step ``step``'s learning rate ``lr_t`` (SPEC 4.1): ``spec.lr`` times the q policy's
    factor ``lr_scale``, then times the decay's factor."""
    # The policy's factor first, then the decay's: without a decay the factor is 1.0
    # and the learning rate keeps the bits it had before decays existed.
    return spec.lr * lr_scale * lr_decay_factor(spec, step)


def validates_after(spec: JobSpec, step: int) -> bool:
    """Whether a validation follows step ``step``: every ``eval_every`` steps and the last."""
    return (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps


def checkpoint_due(steps_done: int, every: int) -> bool:
    """Whether a checkpoint is written once ``steps_done`` steps have run."""
    return steps_done % every == 0


def eval_record(step: int, loss_sum: float, correct: int, count: int, passes: int) -> EvalRecord:
    """The record of a validation from its sums over ``count`` samples."""
    return EvalRecord(step, loss_sum / count, correct / count, passes)
