"""``variance``: raise q when the noise of training progress drowns its signal.

Why not the spread of the g_k alone. With Rademacher z_k, g_k = <grad L_B, z_k> + O(eps^2),
so for a fixed step the g_k are zero-mean with variance ||grad L_B||^2: their mean is no
signal, and their spread only measures the gradient norm. The update direction
(1/q) sum_k g_k z_k has mean grad L_B and a relative variance of about (d + 1) / q for d
weights - a known constant, whatever the state of training. Its first-order effect on
the loss, the projection <grad L_B, g_k z_k> = g_k^2, has relative variance about 2 / q,
again a constant. What the ZO noise costs shows up at second order: one step's expected
change of the loss is about -lr * ||grad||^2 * (1 - lr * tr(H) / (2 q)), so when the
noise term catches up with the descent term, the loss stops going down - and raising
q is what shrinks that term. The symptom is therefore measured where it appears: in
the drift of the training loss, against that drift's own noise.

The rule, a norm test (Byrd et al. 2012; Bollapragada et al. 2018) in time. Training
losses are collected in windows of ``window`` consecutive steps. For each window:

    r   = - least-squares slope of the training loss over the step index  (signal)
    se2 = squared standard error of that slope, from the residuals        (noise)

Windows are combined by exponential moving averages with weight ``smoothing`` on the
past: R = EMA(r), V = EMA(se2), and S, the sum of the squared EMA weights, so that
V * S is the variance of R for independent windows. Noise dominates when

    R <= 0   or   V * S > theta^2 * R^2

(theta = 0.5: the averaged descent is less than two standard errors from zero). After
``patience`` windows in a row in which noise dominates, q moves to the next allowed
value (never above qmax, never down) and the averages restart, because the old
windows describe the old q. The same test with a batch size in place of q is the norm
test for adaptive batch sizes; here the minibatch noise of the loss sets the scale
the descent must rise above.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from ._ladder import LadderConfig
from ._math import ema, next_allowed, ols_drift
from .base import (
    JSONDict,
    PolicyConfig,
    PolicyContext,
    QPolicy,
    StepReport,
    state_field,
)

__all__ = ["VarianceConfig", "VariancePolicy", "noise_dominates"]


class VarianceConfig(LadderConfig):
    """Config of ``variance``."""

    theta: float = Field(
        default=0.5, gt=0, description="noise may be at most theta times the signal"
    )
    window: int = Field(default=50, ge=3, description="steps per window of the drift estimate")
    patience: int = Field(
        default=2, ge=1, description="noise-dominated windows in a row before a raise"
    )
    smoothing: float = Field(default=0.5, ge=0, lt=1, description="EMA weight of past windows")


def noise_dominates(signal: float, noise_var: float, theta: float) -> bool:
    """The test: the averaged descent is not clearly above its noise.

    Args:
        signal: averaged loss decrease per step (positive when the loss goes down).
        noise_var: variance of that average.
        theta: the allowed noise-to-signal ratio.

    Returns:
        True when the signal is not positive or its variance exceeds theta^2 * signal^2.
    """
    return signal <= 0.0 or noise_var > theta * theta * signal * signal


class VariancePolicy(QPolicy):
    """Noise-driven q: climb when the training loss no longer descends above its noise."""

    name: ClassVar[str] = "variance"
    Config: ClassVar[type[PolicyConfig]] = VarianceConfig
    config: VarianceConfig

    def __init__(self, config: PolicyConfig, context: PolicyContext) -> None:
        super().__init__(config, context)
        self._restart()
        self._noisy = 0

    def _restart(self) -> None:
        self._losses: list[float] = []
        self._signal: float | None = None
        self._noise: float | None = None
        self._weight2 = 0.0  # sum of squared EMA weights

    def initial_q(self) -> int:
        """Return q0."""
        return self.config.q0

    def on_step(self, report: StepReport) -> int:
        """Collect the step's loss; at the end of a window, run the test.

        Args:
            report: the finished step.

        Returns:
            q for the next step.
        """
        self._losses.append(float(report.train_loss))
        if len(self._losses) >= self.config.window:
            self._close_window()
        return self._q

    def _close_window(self) -> None:
        cfg = self.config
        slope, se2 = ols_drift(self._losses)
        self._losses = []
        first = self._signal is None
        self._signal = ema(self._signal, -slope, cfg.smoothing)
        self._noise = ema(self._noise, se2, cfg.smoothing)
        f = cfg.smoothing
        self._weight2 = 1.0 if first else f * f * self._weight2 + (1.0 - f) ** 2
        if not noise_dominates(self._signal, self._noise * self._weight2, cfg.theta):
            self._noisy = 0
            return
        self._noisy += 1
        if self._noisy >= cfg.patience:
            raised = next_allowed(self._q, cfg.ladder(), cfg.qmax)
            if raised != self._q:
                self._q = raised
                self._noisy = 0
                self._restart()

    def state_dict(self) -> JSONDict:
        """Return q, the open window's losses, the averages and the count of noisy windows."""
        state = super().state_dict()
        state.update(
            losses=list(self._losses),
            signal=self._signal,
            noise=self._noise,
            weight2=self._weight2,
            noisy=self._noisy,
        )
        return state

    def load_state_dict(self, state: JSONDict) -> None:
        """Restore a state from ``state_dict``."""
        super().load_state_dict(state)
        signal = state_field(state, "signal")
        noise = state_field(state, "noise")
        self._losses = [float(v) for v in state_field(state, "losses")]
        self._signal = None if signal is None else float(signal)
        self._noise = None if noise is None else float(noise)
        self._weight2 = float(state_field(state, "weight2"))
        self._noisy = int(state_field(state, "noisy"))
