"""variance: raise q when the training loss no longer descends above its own noise."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from qsched.policies import PolicyContext, QPolicy, StepReport, create_policy
from qsched.policies.variance import noise_dominates
from qsched.protocol.jobspec import PolicySpec

CONTEXT = PolicyContext(total_steps=600, steps_per_epoch=20.0, eval_every=25)


def make(**config: Any) -> QPolicy:
    return create_policy(PolicySpec(name="variance", config=config), CONTEXT)


def run(policy: QPolicy, loss: Callable[[int], float], steps: int, seed: int = 0) -> list[int]:
    """Feed synthetic steps whose g_k spread like a gradient of norm 1; return q after each."""
    rng = np.random.default_rng(seed)
    qs = []
    forward = 0
    for t in range(steps):
        q = policy.q
        forward += 2 * q
        report = StepReport(t, q, loss(t), rng.normal(0.0, 1.0, q), forward)
        qs.append(policy.on_step(report))
    return qs


def test_noise_dominates_rule() -> None:
    """No descent, or a descent within 1/theta standard errors of zero, is noise-dominated."""
    assert noise_dominates(0.0, 0.0, 0.5)
    assert noise_dominates(-1.0, 0.0, 0.5)
    assert noise_dominates(1.0, 0.3, 0.5)  # sd 0.55 > 0.5 * 1
    assert not noise_dominates(1.0, 0.2, 0.5)  # sd 0.45 < 0.5 * 1


def test_variance_clean_descent_keeps_q() -> None:
    """A loss that falls clearly above its noise never raises q."""
    rng = random.Random(1)
    policy = make()
    qs = run(policy, lambda t: 2.3 * math.exp(-t / 300) + rng.gauss(0.0, 0.02), 600)
    assert set(qs) == {1}


def test_variance_noisy_plateau_raises_q() -> None:
    """A flat, noisy loss raises q one rung every `patience` windows, up the ladder."""
    rng = random.Random(2)
    policy = make(window=50, patience=2, qmax=32)
    qs = run(policy, lambda t: 1.0 + rng.gauss(0.0, 0.3), 600)
    assert qs[98] == 1
    assert qs[-1] >= 8
    assert qs == sorted(qs) and set(qs) <= {1, 2, 4, 8, 16, 32}


def test_variance_descent_buried_in_noise_raises_q() -> None:
    """The same descent as the clean case raises q once the step-to-step noise hides it."""
    rng = random.Random(3)
    policy = make()
    qs = run(policy, lambda t: 2.3 * math.exp(-t / 300) + rng.gauss(0.0, 1.5), 600)
    assert qs[-1] > 1


def test_variance_rising_loss_raises_q() -> None:
    """A loss that climbs steadily (the update's noise wins) is noise-dominated."""
    policy = make(window=20, patience=1)
    qs = run(policy, lambda t: 1.0 + 0.001 * t, 100)
    assert qs[18] == 1 and qs[19] == 2 and qs[-1] == 32


def test_variance_respects_qmax_and_allowed() -> None:
    """Raises follow the allowed values and stop at qmax."""
    rng = random.Random(4)
    policy = make(window=10, patience=1, qmax=6, allowed=[1, 3, 6])
    qs = run(policy, lambda t: 1.0 + rng.gauss(0.0, 1.0), 300)
    assert set(qs) <= {1, 3, 6} and qs[-1] == 6
