"""``qscheduler``: start with few perturbations, raise q only when progress stalls.

The rule, judged at every validation:

1. Read the metric: validation accuracy (higher is better), validation loss, or the
   training loss smoothed by an exponential moving average over steps (``smoothing``
   is the weight of the past) or, with ``average`` "interval", averaged over the steps
   since the previous validation; both lower is better. ``direction`` overrides the sense.
2. The first validation sets the best value. Later ones count as an improvement when
   they beat the best by more than ``min_delta`` - an absolute margin for accuracy, a
   fraction of |best| for losses (``threshold_mode`` "auto"), so the defaults need no
   tuning per dataset.
3. An improvement stores the new best and clears the count of stalled validations;
   otherwise the count goes up - except during the ``cooldown`` validations right
   after a raise, which give the new q time to act and are not held against it.
4. When ``patience`` validations in a row did not improve, q moves to the next
   allowed value (never above ``qmax``, never down) and the count restarts.
5. At the top of the ladder a stall cannot raise q; with ``lr_halvings`` = H it
   halves the step's learning rate instead, at most H times (then the count restarts
   and the cooldown applies, as after a raise; a payoff rule that holds q holds the
   rate too).
6. Optionally, ``payoff`` asks each raise to pay for itself: a rung above q0 that has
   not improved on the best reached before it by the time it stalls is not raised
   from: q is held while the rung may still pay off, and ``stop`` ends the climb for
   good once ``payoff_window`` validations have passed since the raise; ``hold`` keeps
   q until the rung improves (then climbing may resume). ``off`` (the default) raises
   anyway. q is never lowered.

The default metric is the smoothed training loss: it sees every step rather than a
validation set whose size sets the resolution of the accuracy, its relative threshold
needs no per-dataset scale, and it notices a diverging loss that a slowly creeping
accuracy hides.

``payoff`` exists because a plateau is not always made of gradient noise: when the
curve is limited by something more perturbations do not fix (the step size, the
capacity of the trainable layers), the plateau rule climbs to ``qmax`` and spends
passes for nothing. A raise that did not beat the previous rung's best is that
evidence - but only when the loss is quiet. It is off by default because with a noisy
loss the previous rung's best is often a chance low that the next rung needs longer
than ``payoff_window`` to beat, and ``stop`` then ends the climb at a small q by chance
(on held-out seeds of the EuroSAT transfer setting it stopped at q=4-8 in 3 of 10 runs).

The best value is kept across a raise: raising q does not change the weights, so the
new q must beat what the old q already reached to count as progress; resetting it
would let the first noisy dip-and-recover after a raise pass for improvement.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field

from ._ladder import LadderConfig
from ._math import Direction, ema, improved, next_allowed
from .base import (
    MAX_Q,
    EvalReport,
    JSONDict,
    PolicyConfig,
    PolicyContext,
    QPolicy,
    StepReport,
    state_field,
)
from .errors import PolicyError

__all__ = ["QSchedulerConfig", "QSchedulerPolicy"]

Metric = Literal["val_accuracy", "val_loss", "train_loss"]
Payoff = Literal["off", "hold", "stop"]
Average = Literal["ema", "interval"]

# 2^-30 of any sane rate is far below a float32 coefficient's resolution of the losses.
MAX_LR_HALVINGS = 30


class QSchedulerConfig(LadderConfig):
    """Config of ``qscheduler``."""

    metric: Metric = Field(default="train_loss", description="what progress is judged on")
    direction: Literal["auto", "max", "min"] = Field(
        default="auto", description="auto: max for accuracy, min for losses"
    )
    patience: int = Field(
        default=2, ge=1, description="validations without improvement before a raise"
    )
    min_delta: float = Field(
        default=0.01, ge=0, description="smallest change that counts as improvement"
    )
    threshold_mode: Literal["auto", "abs", "rel"] = Field(
        default="auto",
        description="min_delta absolute or relative to |best|; "
        "auto: abs for accuracy, rel for losses",
    )
    cooldown: int = Field(
        default=1, ge=0, description="validations after a raise that do not count as stalled"
    )
    smoothing: float = Field(
        default=0.9, ge=0, lt=1, description="EMA weight of the past for metric train_loss"
    )
    average: Average = Field(
        default="ema",
        description="metric train_loss: ema (exponential moving average over steps) or "
        "interval (mean over the steps since the previous validation)",
    )
    payoff_window: int = Field(
        default=5,
        ge=0,
        description="validations after a raise an unpaid rung is held "
        "before payoff=stop ends the climb",
    )
    lr_full_q: int = Field(
        default=0,
        ge=0,
        le=MAX_Q,
        description="0: the job's lr at every q; N: a step at q < N uses lr * q / N, "
        "so the step size follows the estimate's noise on the low rungs",
    )
    lr_halvings: int = Field(
        default=0,
        ge=0,
        le=MAX_LR_HALVINGS,
        description="0: q at qmax keeps the rate; H: up to H stalls at qmax each halve "
        "the learning rate, so the noise of the top rung settles",
    )
    payoff: Payoff = Field(
        default="off",
        description="a rung above q0 that has not improved on the previous rung's best: "
        "off: raise anyway; hold: keep q until it improves; stop: keep q for good",
    )


class QSchedulerPolicy(QPolicy):
    """Plateau-driven q: climb the ladder when the metric stops improving."""

    name: ClassVar[str] = "qscheduler"
    Config: ClassVar[type[PolicyConfig]] = QSchedulerConfig
    config: QSchedulerConfig

    def __init__(self, config: PolicyConfig, context: PolicyContext) -> None:
        super().__init__(config, context)
        self._best: float | None = None
        self._stalled = 0
        self._cooldown_left = 0
        self._train_ema: float | None = None
        self._paid = True  # q0 needs no payoff: it has no previous rung
        self._stopped = False
        self._since_raise = 0
        self._interval_sum = 0.0  # training losses since the previous validation
        self._interval_steps = 0
        self._halvings = 0  # learning-rate halvings at the top of the ladder so far

    def initial_q(self) -> int:
        """Return q0."""
        return self.config.q0

    @property
    def direction(self) -> Direction:
        """The sense of the metric in force."""
        if self.config.direction != "auto":
            return self.config.direction
        return "max" if self.config.metric == "val_accuracy" else "min"

    def lr_scale(self, q: int) -> float:
        """``q / lr_full_q`` below ``lr_full_q``, else 1.0 (always 1.0 when it is 0),
        halved once for each halving so far (exact: a power of two)."""
        full = self.config.lr_full_q
        return math.ldexp(1.0 if q >= full else q / full, -self._halvings)

    def _relative(self) -> bool:
        if self.config.threshold_mode == "auto":
            return self.config.metric != "val_accuracy"
        return self.config.threshold_mode == "rel"

    def on_step(self, report: StepReport) -> int:
        """Fold the step's training loss into the smoothed training loss; q is unchanged."""
        loss = float(report.train_loss)
        self._train_ema = ema(self._train_ema, loss, self.config.smoothing)
        self._interval_sum += loss
        self._interval_steps += 1
        return self._q

    def _metric_value(self, report: EvalReport) -> float | None:
        if self.config.metric == "val_accuracy":
            return float(report.val_accuracy)
        if self.config.metric == "val_loss":
            return float(report.val_loss)
        if self.config.average == "interval":
            return self._interval_sum / self._interval_steps if self._interval_steps else None
        return self._train_ema

    def on_eval(self, report: EvalReport) -> int:
        """Judge progress at a validation and raise q after ``patience`` stalls.

        Args:
            report: the finished validation.

        Returns:
            q for the next step.
        """
        value = self._metric_value(report)
        self._interval_sum, self._interval_steps = 0.0, 0
        if value is None:
            return self._q  # train_loss metric before any step: nothing to judge yet
        if self._best is None:
            self._best = value
            return self._q
        self._since_raise += 1
        in_cooldown = self._cooldown_left > 0
        if in_cooldown:
            self._cooldown_left -= 1
        cfg = self.config
        if improved(value, self._best, cfg.min_delta, self.direction, self._relative()):
            self._best = value
            self._stalled = 0
            self._paid = True
        elif not in_cooldown:
            self._stalled += 1
        if self._stalled >= cfg.patience:
            self._raise()
        return self._q

    def _raise(self) -> None:
        """Climb one rung after a stall, unless the payoff rule holds q."""
        cfg = self.config
        if cfg.payoff != "off" and not self._paid:
            # The last raise bought no progress: more passes would not either.
            late = self._since_raise >= cfg.payoff_window
            self._stopped = self._stopped or (cfg.payoff == "stop" and late)
            self._stalled = 0
            return
        if self._stopped:
            return
        raised = next_allowed(self._q, cfg.ladder(), cfg.qmax)
        if raised != self._q:
            self._q = raised
            self._paid = False
            self._since_raise = 0
        elif self._halvings < cfg.lr_halvings:
            # At the top more passes are not to be had: a smaller step averages the
            # top rung's remaining noise instead.
            self._halvings += 1
        else:
            return
        self._stalled = 0
        self._cooldown_left = cfg.cooldown

    def state_dict(self) -> JSONDict:
        """Return q, the best metric, the stall and cooldown counts, the smoothed loss, the
        payoff flags and the learning-rate halvings."""
        state = super().state_dict()
        state.update(
            best=self._best,
            stalled=self._stalled,
            cooldown_left=self._cooldown_left,
            train_ema=self._train_ema,
            paid=self._paid,
            stopped=self._stopped,
            since_raise=self._since_raise,
            interval_sum=self._interval_sum,
            interval_steps=self._interval_steps,
            lr_halvings=self._halvings,
        )
        return state

    def load_state_dict(self, state: JSONDict) -> None:
        """Restore a state from ``state_dict``."""
        super().load_state_dict(state)
        best = state_field(state, "best")
        train_ema = state_field(state, "train_ema")
        self._best = None if best is None else float(best)
        self._stalled = int(state_field(state, "stalled"))
        self._cooldown_left = int(state_field(state, "cooldown_left"))
        self._train_ema = None if train_ema is None else float(train_ema)
        self._paid = bool(state_field(state, "paid"))
        self._stopped = bool(state_field(state, "stopped"))
        self._since_raise = int(state_field(state, "since_raise"))
        # States saved before `average` existed lack the interval: it restarts empty.
        self._interval_sum = float(state.get("interval_sum", 0.0))
        self._interval_steps = int(state.get("interval_steps", 0))
        # States saved before `lr_halvings` existed never halved.
        halvings = int(state.get("lr_halvings", 0))
        if not 0 <= halvings <= MAX_LR_HALVINGS:
            raise PolicyError(f"saved lr_halvings {halvings} is outside 0..{MAX_LR_HALVINGS}")
        self._halvings = halvings
