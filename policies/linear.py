"""``linear``: MeZO's linear ramp of q over the run.

    n_t = max(1, floor(t / T * n)),  capped at n

with t the step about to run, T the job's total steps and n the final q (``qmax``).
With ``allowed`` set, n_t is rounded down onto those values (the lowest one when n_t
is below all of them). The rule only depends on t, so nothing but q is stored.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, ValidationInfo, field_validator

from ._math import floor_allowed, validate_allowed
from .base import MAX_Q, PolicyConfig, QPolicy, StepReport

__all__ = ["LinearConfig", "LinearPolicy"]


class LinearConfig(PolicyConfig):
    """Config of ``linear``."""

    qmax: int = Field(default=32, ge=1, le=MAX_Q, description="final q, reached at the last step")
    allowed: tuple[int, ...] | None = Field(
        default=None, description="if set, q is rounded down onto these sorted, unique values"
    )

    @field_validator("allowed")
    @classmethod
    def _check_allowed(
        cls, allowed: tuple[int, ...] | None, info: ValidationInfo
    ) -> tuple[int, ...] | None:
        qmax = info.data.get("qmax")
        if allowed is None or qmax is None:
            return allowed
        # The ramp starts wherever the ladder starts, so any first value will do as q0.
        return validate_allowed(allowed, allowed[0] if allowed else 1, qmax)


class LinearPolicy(QPolicy):
    """q grows linearly with the step index, up to qmax at the end of the run."""

    name: ClassVar[str] = "linear"
    Config: ClassVar[type[PolicyConfig]] = LinearConfig
    config: LinearConfig

    def q_at(self, step: int) -> int:
        """Return q for a step index.

        Args:
            step: 0-based step about to run.

        Returns:
            The ramp's q for that step.
        """
        # Integer arithmetic: floor(t * n / T) exactly, with no float rounding at the edges.
        q = min(max(1, step * self.config.qmax // self.context.total_steps), self.config.qmax)
        if self.config.allowed is not None:
            q = floor_allowed(q, self.config.allowed)
        return q

    def initial_q(self) -> int:
        """Return q of step 0."""
        return self.q_at(0)

    def on_step(self, report: StepReport) -> int:
        """Return the ramp's q for the step after ``report.step``."""
        self._q = self.q_at(report.step + 1)
        return self._q
