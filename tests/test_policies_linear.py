"""linear: MeZO's ramp n_t = max(1, floor(t / T * n))."""

from __future__ import annotations

from typing import Any

import numpy as np

from qsched.policies import PolicyContext, QPolicy, StepReport, create_policy
from qsched.protocol.jobspec import PolicySpec


def run(total: int, steps: int, **config: Any) -> list[int]:
    """q of steps 0..steps-1 under the ramp."""
    context = PolicyContext(total_steps=total, steps_per_epoch=10.0, eval_every=10)
    policy: QPolicy = create_policy(PolicySpec(name="linear", config=config), context)
    qs = [policy.q]
    for t in range(steps - 1):
        qs.append(policy.on_step(StepReport(t, qs[-1], 1.0, np.zeros(qs[-1]), t)))
    return qs


def test_linear_ramp_formula() -> None:
    """Each step's q is max(1, floor(t * n / T)) with n = qmax."""
    qs = run(100, 100, qmax=8)
    assert qs == [max(1, t * 8 // 100) for t in range(100)]
    assert qs[0] == 1 and qs[99] == 7 and qs[50] == 4


def test_linear_capped_past_the_end() -> None:
    """Steps past the planned total stay at qmax."""
    assert run(20, 40, qmax=8)[20:] == [8] * 20


def test_linear_rounds_down_to_allowed() -> None:
    """With allowed values, the ramp's q is rounded down onto them."""
    qs = run(64, 64, qmax=32, allowed=[1, 2, 4, 8, 16, 32])
    assert set(qs) <= {1, 2, 4, 8, 16}
    assert qs[24] == 8  # floor(24 * 32 / 64) = 12 -> 8
    assert qs == sorted(qs)
