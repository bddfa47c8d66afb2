"""qscheduler: raise q along the ladder only when the judged metric stalls."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsched.policies import (
    EvalReport,
    PolicyContext,
    PolicyError,
    QPolicy,
    StepReport,
    create_policy,
)
from qsched.protocol.jobspec import PolicySpec

CONTEXT = PolicyContext(total_steps=1000, steps_per_epoch=10.0, eval_every=10)


def make(**config: Any) -> QPolicy:
    config.setdefault("metric", "val_accuracy")
    config.setdefault("payoff", "off")  # the plateau rule alone; payoff has its own tests
    return create_policy(PolicySpec(name="qscheduler", config=config), CONTEXT)


def evals(policy: QPolicy, values: list[float], metric: str = "val_accuracy") -> list[int]:
    """Feed one validation per value; return q after each."""
    out = []
    for i, value in enumerate(values):
        acc, loss = (value, 1.0) if metric == "val_accuracy" else (0.5, value)
        out.append(policy.on_eval(EvalReport(step=10 * i, val_loss=loss, val_accuracy=acc)))
    return out


def step(policy: QPolicy, t: int, loss: float) -> int:
    grads = np.zeros(policy.q)
    return policy.on_step(StepReport(t, policy.q, loss, grads, 2 * (t + 1)))


def test_qscheduler_starts_at_q0() -> None:
    """Step 0 runs with q0."""
    assert make().q == 1
    assert make(q0=4, qmax=16).q == 4


def test_qscheduler_raises_after_patience() -> None:
    """A flat metric raises q one rung every `patience` validations after the first."""
    policy = make(patience=3, cooldown=0)
    assert evals(policy, [0.5] * 7) == [1, 1, 1, 2, 2, 2, 4]


def test_qscheduler_steady_improvement_keeps_q() -> None:
    """A metric that improves by more than min_delta at every validation never raises q."""
    policy = make(patience=1, cooldown=0)
    assert evals(policy, [0.5 + 0.02 * i for i in range(20)]) == [1] * 20


def test_qscheduler_min_delta_margin() -> None:
    """Gains below min_delta count as stalls; gains above it do not."""
    small = make(patience=2, cooldown=0, min_delta=0.002)
    assert evals(small, [0.5, 0.5015, 0.5015]) == [1, 1, 2]
    large = make(patience=2, cooldown=0, min_delta=0.002)
    assert evals(large, [0.5, 0.5025, 0.505]) == [1, 1, 1]


def test_qscheduler_small_gains_accumulate() -> None:
    """The best only moves on a real improvement, so slow gains add up until they count."""
    policy = make(patience=1, cooldown=0, min_delta=0.002)
    assert evals(policy, [0.5, 0.5015, 0.503, 0.5035]) == [1, 2, 2, 4]


def test_qscheduler_loss_metric_direction() -> None:
    """For val_loss lower is better: a falling loss keeps q, a rising one raises it."""
    falling = make(metric="val_loss", patience=2, cooldown=0)
    assert evals(falling, [2.0 * 0.9**i for i in range(6)], "val_loss")[-1] == 1
    rising = make(metric="val_loss", patience=2, cooldown=0)
    assert evals(rising, [1.0 + 0.1 * i for i in range(6)], "val_loss")[-1] == 4


def test_qscheduler_loss_threshold_is_relative() -> None:
    """For losses min_delta is a fraction of the best: 0.1% gains on a loss of 100 are stalls."""
    policy = make(metric="val_loss", patience=1, cooldown=0, min_delta=0.002)
    assert evals(policy, [100.0 - 0.1 * i for i in range(3)], "val_loss") == [1, 2, 4]


def test_qscheduler_direction_override() -> None:
    """An explicit direction wins over the metric's natural sense."""
    policy = make(direction="min", patience=1, cooldown=0)
    assert evals(policy, [0.9 - 0.05 * i for i in range(6)]) == [1] * 6


def test_qscheduler_cooldown_ignores_stalls_after_raise() -> None:
    """The `cooldown` validations after a raise do not count toward patience."""
    policy = make(patience=1, cooldown=2)
    assert evals(policy, [0.5] * 8) == [1, 2, 2, 2, 4, 4, 4, 8]


def test_qscheduler_best_kept_across_raise() -> None:
    """After a raise the metric must beat the old best: a partial recovery is still a stall."""
    policy = make(patience=1, cooldown=0, min_delta=0.002)
    assert evals(policy, [0.8, 0.7, 0.75, 0.81]) == [1, 2, 4, 4]


def test_qscheduler_payoff_hold_waits_for_the_rung_to_improve() -> None:
    """payoff=hold: a raise that did not beat the old best holds q until the rung improves."""
    policy = make(patience=1, cooldown=0, payoff="hold")
    assert evals(policy, [0.5, 0.5, 0.5, 0.5, 0.6, 0.6]) == [1, 2, 2, 2, 2, 4]
    off = make(patience=1, cooldown=0)
    assert evals(off, [0.5, 0.5, 0.5, 0.5, 0.6, 0.6]) == [1, 2, 4, 8, 8, 16]


def test_qscheduler_payoff_stop_keeps_q_for_good() -> None:
    """payoff=stop: after an unpaid raise q never moves again, even after later gains."""
    policy = make(patience=1, cooldown=0, payoff="stop", payoff_window=0)
    assert evals(policy, [0.5, 0.5, 0.5, 0.6, 0.6, 0.6]) == [1, 2, 2, 2, 2, 2]


def test_qscheduler_payoff_paid_raise_keeps_climbing() -> None:
    """A rung that improved on the previous rung's best may be raised from as usual."""
    policy = make(patience=1, cooldown=0, payoff="stop")
    assert evals(policy, [0.5, 0.5, 0.6, 0.6, 0.7, 0.7]) == [1, 2, 2, 4, 4, 8]


def test_qscheduler_payoff_window_holds_before_stopping() -> None:
    """payoff_window: an unpaid rung is held, and may still pay, until the window ends the climb."""
    late = make(patience=1, cooldown=0, payoff="stop", payoff_window=3)
    assert evals(late, [0.5, 0.5, 0.5, 0.5, 0.5, 0.6, 0.6]) == [1, 2, 2, 2, 2, 2, 2]
    paid = make(patience=1, cooldown=0, payoff="stop", payoff_window=3)
    assert evals(paid, [0.5, 0.5, 0.5, 0.6, 0.6]) == [1, 2, 2, 2, 4]


def test_qscheduler_payoff_default_is_off() -> None:
    """By default an unpaid raise does not hold q: every stall climbs a rung, up to qmax."""
    policy = create_policy(
        PolicySpec(
            name="qscheduler", config={"metric": "val_accuracy", "patience": 1, "cooldown": 0}
        ),
        CONTEXT,
    )
    assert evals(policy, [0.5] * 7 + [0.6, 0.6]) == [1, 2, 4, 8, 16, 32, 32, 32, 32]


def test_qscheduler_payoff_state_round_trip() -> None:
    """The payoff flags survive a save and load: the resumed policy holds like the original."""
    policy = make(patience=1, cooldown=0, payoff="stop", payoff_window=0)
    evals(policy, [0.5, 0.5, 0.5])
    resumed = make(patience=1, cooldown=0, payoff="stop", payoff_window=0)
    resumed.load_state_dict(policy.state_dict())
    assert evals(resumed, [0.6, 0.6, 0.6]) == [2, 2, 2]


def test_qscheduler_train_loss_metric_uses_smoothed_loss() -> None:
    """With metric train_loss the smoothed step loss is judged: falling keeps q, flat raises."""
    falling = make(metric="train_loss", patience=2, cooldown=0, smoothing=0.5)
    flat = make(metric="train_loss", patience=2, cooldown=0, smoothing=0.5)
    assert flat.on_eval(EvalReport(0, 1.0, 0.5)) == 1  # nothing to judge before a step
    for t in range(100):
        step(falling, t, 3.0 * 0.98**t)
        step(flat, t, 3.0 + (0.01 if t % 2 else -0.01))
        if t % 10 == 9:
            falling.on_eval(EvalReport(t, 1.0, 0.5))
            flat.on_eval(EvalReport(t, 1.0, 0.5))
    assert falling.q == 1
    assert flat.q >= 8


def run_interval(policy: QPolicy, intervals: list[list[float]]) -> list[int]:
    """Feed each interval's step losses, then one validation; return q after each validation."""
    out, t = [], 0
    for losses in intervals:
        for loss in losses:
            step(policy, t, loss)
            t += 1
        out.append(policy.on_eval(EvalReport(t, 1.0, 0.5)))
    return out


def test_qscheduler_interval_average_judges_the_steps_since_the_last_validation() -> None:
    """average=interval judges the mean step loss since the previous validation, then
    restarts it."""
    policy = make(metric="train_loss", average="interval", patience=2, cooldown=0)
    # best 1.0; 3.0 stalls once; 0.5 improves. Had the mean not restarted, the third
    # value would be mean(1, 1, 3, 3, 0.5) = 1.7, a second stall and a raise.
    assert run_interval(policy, [[1.0, 1.0], [3.0, 3.0], [0.5]]) == [1, 1, 1]
    assert run_interval(policy, [[0.6, 0.6], [0.5, 0.7]]) == [1, 2]  # means 0.6, 0.6: two stalls


def test_qscheduler_interval_average_differs_from_the_ema() -> None:
    """A late spike within an interval moves the EMA more than the interval mean."""
    intervals = [[2.0] * 10, [1.0] * 9 + [9.0]]  # interval means 2.0 and 1.8
    interval = make(metric="train_loss", average="interval", patience=1, cooldown=0)
    smoothed = make(metric="train_loss", average="ema", smoothing=0.5, patience=1, cooldown=0)
    assert run_interval(interval, intervals) == [1, 1]  # 1.8 beats 2.0 by 10 %
    assert run_interval(smoothed, intervals) == [1, 2]  # the EMA ends near 5: a stall


def test_qscheduler_state_without_interval_fields_loads() -> None:
    """A state saved before `average` existed resumes, with an empty interval."""
    policy = make(metric="train_loss", average="interval", patience=1, cooldown=0)
    run_interval(policy, [[1.0, 1.0]])
    state = policy.state_dict()
    del state["interval_sum"], state["interval_steps"]
    resumed = make(metric="train_loss", average="interval", patience=1, cooldown=0)
    resumed.load_state_dict(state)
    assert run_interval(resumed, [[1.5]]) == [2]


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=60),
    ladder=st.sets(st.integers(2, 40), max_size=5),
    qmax=st.integers(1, 40),
    patience=st.integers(1, 4),
    cooldown=st.integers(0, 3),
)
def test_qscheduler_ladder_invariants(
    values: list[float], ladder: set[int], qmax: int, patience: int, cooldown: int
) -> None:
    """On any metric sequence q stays on the ladder, never exceeds qmax and never drops."""
    allowed = sorted({1} | {v for v in ladder if v <= qmax})
    policy = make(qmax=qmax, allowed=allowed, patience=patience, cooldown=cooldown)
    qs = [policy.q, *evals(policy, values)]
    assert all(q in allowed and q <= qmax for q in qs)
    assert all(b >= a for a, b in itertools.pairwise(qs))
    # A raise always lands on the next rung: no rung is skipped.
    rungs = [*allowed, allowed[-1]]
    assert all(b in (a, rungs[allowed.index(a) + 1]) for a, b in itertools.pairwise(qs))


def test_qscheduler_default_judges_training_loss() -> None:
    """By default a falling training loss keeps q even while validation accuracy is flat."""
    policy = create_policy(PolicySpec(name="qscheduler"), CONTEXT)
    for t in range(300):
        step(policy, t, 3.0 * 0.99**t)
        if t % 10 == 9:
            policy.on_eval(EvalReport(t, 1.0, 0.5))
    assert policy.q == 1


def test_qscheduler_lr_follows_q_below_lr_full_q() -> None:
    """lr_full_q N: a step at q < N gets lr * q / N, from N on the job's lr; 0 keeps lr."""
    assert [make().lr_scale(q) for q in (1, 2, 32)] == [1.0, 1.0, 1.0]
    policy = make(lr_full_q=8)
    assert [policy.lr_scale(q) for q in (1, 2, 4, 8, 16)] == [0.125, 0.25, 0.5, 1.0, 1.0]
    assert make(lr_full_q=3).lr_scale(2) == 2 / 3


def test_qscheduler_lr_full_q_is_checked() -> None:
    """A negative lr_full_q, or one above the largest q, is refused with the field named."""
    for bad in (-1, 1025):
        with pytest.raises(PolicyError, match="lr_full_q"):
            make(lr_full_q=bad)


def test_qscheduler_halves_the_rate_at_the_top_after_stalls() -> None:
    """lr_halvings H: at qmax a stall halves lr_scale instead of raising q, H times at
    most, with the cooldown after each halving as after a raise; below the top q climbs
    as before and the rate keeps its factor."""
    policy = make(qmax=4, patience=1, cooldown=1, lr_halvings=2, lr_full_q=4)
    qs, scales = [], []
    for value in [0.5] * 9:
        qs.append(evals(policy, [value])[0])
        scales.append(policy.lr_scale(policy.q))
    assert qs == [1, 2, 2, 4, 4, 4, 4, 4, 4]
    assert scales == [0.25, 0.5, 0.5, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    assert policy.state_dict()["lr_halvings"] == 2


def test_qscheduler_improvement_at_the_top_keeps_the_rate() -> None:
    """At the top an improving metric never halves; without lr_halvings a stall does not."""
    improving = make(qmax=2, patience=1, cooldown=0, lr_halvings=3)
    evals(improving, [0.5, 0.5, 0.6, 0.7, 0.8, 0.9])
    assert improving.q == 2 and improving.lr_scale(2) == 1.0
    plain = make(qmax=2, patience=1, cooldown=0)
    evals(plain, [0.5] * 6)
    assert plain.lr_scale(2) == 1.0 and plain.state_dict()["lr_halvings"] == 0


def test_qscheduler_halvings_survive_a_save_and_load() -> None:
    """A resumed policy keeps its halvings (the factor of the next step) and stops at H."""
    policy = make(qmax=2, patience=1, cooldown=0, lr_halvings=2)
    evals(policy, [0.5, 0.5, 0.5])
    assert policy.lr_scale(2) == 0.5
    resumed = make(qmax=2, patience=1, cooldown=0, lr_halvings=2)
    resumed.load_state_dict(policy.state_dict())
    assert resumed.lr_scale(2) == 0.5
    evals(resumed, [0.5, 0.5, 0.5])
    assert resumed.lr_scale(2) == 0.25


def test_qscheduler_halvings_are_checked() -> None:
    """A bad lr_halvings config, or a saved count outside 0..30, is a PolicyError."""
    for bad in (-1, 31):
        with pytest.raises(PolicyError, match="lr_halvings"):
            make(lr_halvings=bad)
    policy = make(lr_halvings=2)
    for bad_count in (-1, 31):
        with pytest.raises(PolicyError, match="lr_halvings"):
            policy.load_state_dict({**policy.state_dict(), "lr_halvings": bad_count})
    old = policy.state_dict()
    del old["lr_halvings"]  # a state saved before the field existed
    policy.load_state_dict(old)
    assert policy.lr_scale(1) == 1.0


def test_qscheduler_payoff_hold_holds_the_rate_at_the_top() -> None:
    """With payoff hold, a top rung that never beat the previous best neither halves nor
    climbs; once it improves, its next stall halves."""
    policy = make(qmax=2, patience=1, cooldown=0, payoff="hold", lr_halvings=2)
    evals(policy, [0.5, 0.5, 0.5, 0.5])  # raised to 2, which never pays
    assert policy.q == 2 and policy.lr_scale(2) == 1.0
    evals(policy, [0.6, 0.6])  # paid, then a stall
    assert policy.lr_scale(2) == 0.5
