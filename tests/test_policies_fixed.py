"""fixed: the same q for every step."""

from __future__ import annotations

import numpy as np

from qsched.policies import EvalReport, PolicyContext, StepReport, create_policy
from qsched.protocol.jobspec import PolicySpec

CONTEXT = PolicyContext(total_steps=100, steps_per_epoch=10.0, eval_every=10)


def test_fixed_default_is_eight() -> None:
    """Without config, fixed runs q = 8."""
    assert create_policy(PolicySpec(name="fixed"), CONTEXT).q == 8


def test_fixed_never_changes() -> None:
    """Neither steps with any loss nor validations change q."""
    policy = create_policy(PolicySpec(name="fixed", config={"q": 3}), CONTEXT)
    qs = []
    for t in range(50):
        qs.append(policy.on_step(StepReport(t, 3, 10.0 - t, np.ones(3), 2 * t)))
        qs.append(policy.on_eval(EvalReport(t, 1.0, 0.0)))
    assert set(qs) == {3}
