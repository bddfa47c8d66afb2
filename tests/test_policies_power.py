"""power: AdaZeta's q = min(max(floor(alpha * epoch^beta), 1), qmax)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qsched.policies import PolicyContext, StepReport, create_policy
from qsched.protocol.jobspec import PolicySpec

CONTEXT = PolicyContext(total_steps=1000, steps_per_epoch=25.0, eval_every=25)


def run(steps: int, **config: Any) -> list[int]:
    """q of steps 0..steps-1 under the power law."""
    policy = create_policy(PolicySpec(name="power", config=config), CONTEXT)
    qs = [policy.q]
    for t in range(steps - 1):
        qs.append(policy.on_step(StepReport(t, qs[-1], 1.0, np.zeros(qs[-1]), t)))
    return qs


def test_power_formula() -> None:
    """q follows the power law in fractional epochs, clamped to [1, qmax]."""
    qs = run(500, alpha=1.5, beta=0.5, qmax=6)
    expected = [min(max(math.floor(1.5 * (t / 25.0) ** 0.5), 1), 6) for t in range(500)]
    assert qs == expected
    assert qs[0] == 1 and qs[-1] == 6


def test_power_whole_epochs_changes_at_boundaries() -> None:
    """With whole_epochs, q only changes where a new epoch begins."""
    qs = run(200, alpha=2.0, beta=1.0, qmax=32, whole_epochs=True)
    changes = [t for t in range(1, 200) if qs[t] != qs[t - 1]]
    assert changes and all(t % 25 == 0 for t in changes)
    assert qs[25] == 2 and qs[100] == 8
