"""``power``: AdaZeta's power-law growth of q with the epoch.

    q = min(max(floor(alpha * epoch ** beta), 1), qmax),   epoch = t / steps_per_epoch

with t the step about to run (``whole_epochs`` uses floor(epoch), so q changes only at
epoch boundaries, as in the paper's per-epoch schedule). Only t matters, so nothing
but q is stored.
"""

from __future__ import annotations

import math
from typing import ClassVar

from pydantic import Field

from .base import MAX_Q, PolicyConfig, QPolicy, StepReport

__all__ = ["PowerConfig", "PowerPolicy"]


class PowerConfig(PolicyConfig):
    """Config of ``power``."""

    alpha: float = Field(default=2.0, gt=0, description="scale of the power law")
    beta: float = Field(default=1.0, ge=0, description="exponent of the power law")
    qmax: int = Field(default=32, ge=1, le=MAX_Q, description="q is never above this")
    whole_epochs: bool = Field(
        default=False, description="use completed epochs, floor(t / steps_per_epoch)"
    )


class PowerPolicy(QPolicy):
    """q = alpha * epoch ** beta, clamped to [1, qmax]."""

    name: ClassVar[str] = "power"
    Config: ClassVar[type[PolicyConfig]] = PowerConfig
    config: PowerConfig

    def q_at(self, step: int) -> int:
        """Return q for a step index.

        Args:
            step: 0-based step about to run.

        Returns:
            The power law's q for that step.
        """
        epoch = step / self.context.steps_per_epoch
        if self.config.whole_epochs:
            epoch = float(math.floor(epoch))
        raw = float(self.config.alpha * epoch**self.config.beta)
        return min(max(math.floor(raw), 1), self.config.qmax)

    def initial_q(self) -> int:
        """Return q of step 0."""
        return self.q_at(0)

    def on_step(self, report: StepReport) -> int:
        """Return the power law's q for the step after ``report.step``."""
        self._q = self.q_at(report.step + 1)
        return self._q
