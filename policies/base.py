"""The q policy interface: what a policy is told, and what it answers.

The training loop (outside this package) owns the policy. It asks ``initial_q()`` once,
then after every step calls ``on_step`` and after every validation ``on_eval``; each
hook returns q for the next step. A policy does no I/O; everything it may use arrives
in a :class:`PolicyContext` at construction and in the reports.

A policy is a pure function of its config, its context and the reports it has seen,
in order. ``state_dict()`` is plain JSON (ints, floats, strings, lists, dicts, None)
and ``load_state_dict`` restores a policy that continues exactly as if never stopped.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict

from qsched.protocol.messages import MAX_KS

from .errors import PolicyError

__all__ = [
    "EvalReport",
    "JSONDict",
    "PolicyConfig",
    "PolicyContext",
    "QPolicy",
    "StepReport",
    "checked_lr_scale",
    "state_field",
]

JSONDict = dict[str, Any]


@dataclass(frozen=True)
class PolicyContext:
    """Facts about the job a policy may use."""

    total_steps: int
    steps_per_epoch: float  # training-set size / batch size
    eval_every: int

    def __post_init__(self) -> None:
        if self.total_steps < 1 or self.eval_every < 1 or not self.steps_per_epoch > 0:
            raise PolicyError(
                "policy context needs total_steps >= 1, steps_per_epoch > 0 and eval_every >= 1, "
                f"got {self.total_steps}, {self.steps_per_epoch}, {self.eval_every}"
            )


@dataclass(frozen=True)
class StepReport:
    """What the loop reports after every training step."""

    step: int  # the step just finished, 0-based
    q: int  # q used for it
    train_loss: float  # mean over k of (L+ + L-)/2, or L0 for the one-sided estimator
    projected_grads: npt.NDArray[np.floating[Any]]  # shape (q,): g_k = (L+ - L-) / (2 eps)
    forward_passes: int  # cumulative forward passes so far


@dataclass(frozen=True)
class EvalReport:
    """What the loop reports after every periodic validation."""

    step: int
    val_loss: float
    val_accuracy: float  # 0..1


# The most perturbations one step may have. One EvalRequest carries at most MAX_KS keys
# (the wire's bound) and the daemon holds a step's losses and projected gradients; 1024
# pairs of forward passes a step is far past where more q pays (see docs/results/).
MAX_Q: Final = MAX_KS


def checked_q(policy: QPolicy) -> int:
    """The policy's q for the next step, refused unless it is an integer in 1..MAX_Q.

    A plugin policy is code the daemon did not write: its q is checked where it is used.

    Raises:
        PolicyError: q is not an int, or outside 1..MAX_Q.
    """
    q = policy.q
    if isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= MAX_Q:
        raise PolicyError(
            f"policy {policy.name!r} chose q={q!r}; q must be an integer in 1..{MAX_Q}"
        )
    return q


def checked_lr_scale(policy: QPolicy, q: int) -> float:
    """The policy's learning-rate factor for a step at ``q``, refused unless finite, > 0.

    Raises:
        PolicyError: the factor is not a finite positive float, or computing it failed.
    """
    try:
        scale = policy.lr_scale(q)
    except Exception as exc:  # a plugin's code: its failure is the job's policy error
        raise PolicyError(f"policy {policy.name!r} failed to give an lr scale: {exc}") from exc
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < math.inf:
        raise PolicyError(
            f"policy {policy.name!r} chose lr scale {scale!r} at q={q}; "
            "it must be a finite number > 0"
        )
    return float(scale)


class PolicyConfig(BaseModel):
    """Base of every policy's configuration: unknown fields are an error, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class QPolicy(abc.ABC):
    """A policy that decides q, the number of perturbation samples per step.

    Subclasses set ``name`` and ``Config``, implement ``initial_q`` and override the
    hooks they need; hooks not overridden keep q. Subclasses with their own state
    extend ``state_dict`` / ``load_state_dict`` through ``super()``.
    """

    name: ClassVar[str]
    Config: ClassVar[type[PolicyConfig]]

    def __init__(self, config: PolicyConfig, context: PolicyContext) -> None:
        """Bind a validated config and the job's facts.

        Args:
            config: an instance of this policy's ``Config``.
            context: facts about the job.
        """
        if not isinstance(config, self.Config):
            raise TypeError(
                f"policy {self.name!r} needs a {self.Config.__name__}, got {type(config).__name__}"
            )
        self.config = config
        self.context = context
        self._q = self.initial_q()

    @abc.abstractmethod
    def initial_q(self) -> int:
        """Return q for step 0 (a function of config and context only)."""

    def on_step(self, report: StepReport) -> int:
        """Take a step's report; return q for the next step.

        Args:
            report: the finished step.

        Returns:
            q for the next step.
        """
        del report
        return self._q

    def on_eval(self, report: EvalReport) -> int:
        """Take a validation's report; return q for the next step.

        Args:
            report: the finished validation.

        Returns:
            q for the next step.
        """
        del report
        return self._q

    @property
    def q(self) -> int:
        """q for the next step."""
        return self._q

    def lr_scale(self, q: int) -> float:
        """The factor on the job's learning rate for a step at ``q`` (1.0: lr at every q).

        Read like ``q``, before the step's reports: a function of the config, ``q`` and
        the state the step starts from, which a checkpoint keeps, so the daemon, a
        resumed job and the single-process trainer compute the same bits.
        """
        del q
        return 1.0

    def state_dict(self) -> JSONDict:
        """Return the policy's state as plain JSON."""
        return {"policy": self.name, "q": self._q}

    def load_state_dict(self, state: JSONDict) -> None:
        """Restore a state from ``state_dict`` (possibly after a JSON round trip).

        Args:
            state: a mapping produced by ``state_dict`` of the same policy.

        Raises:
            PolicyError: the state belongs to another policy or lacks a field.
        """
        if state.get("policy") != self.name:
            raise PolicyError(f"state belongs to policy {state.get('policy')!r}, not {self.name!r}")
        self._q = int(state_field(state, "q"))


def state_field(state: JSONDict, key: str) -> Any:
    """Read a required field of a saved state, with a clear error when it is missing."""
    try:
        return state[key]
    except KeyError:
        raise PolicyError(f"saved policy state lacks the field {key!r}") from None
