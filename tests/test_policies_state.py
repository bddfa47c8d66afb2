"""Policy state: JSON round trips, and a resumed policy decides exactly like an
uninterrupted one."""

from __future__ import annotations

import json
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

CONTEXT = PolicyContext(total_steps=120, steps_per_epoch=7.5, eval_every=5)

SPECS = [
    PolicySpec(name="fixed", config={"q": 5}),
    PolicySpec(name="qscheduler", config={"metric": "val_accuracy", "patience": 1, "cooldown": 1}),
    PolicySpec(name="qscheduler", config={"metric": "val_loss", "patience": 2, "cooldown": 0}),
    PolicySpec(name="qscheduler", config={"metric": "train_loss", "patience": 1, "smoothing": 0.7}),
    PolicySpec(
        name="qscheduler", config={"metric": "train_loss", "patience": 1, "average": "interval"}
    ),
    PolicySpec(name="linear", config={"qmax": 16}),
    PolicySpec(name="power", config={"alpha": 1.3, "beta": 0.7, "qmax": 16}),
    PolicySpec(name="variance", config={"window": 5, "patience": 1, "smoothing": 0.3}),
]

# An event is a step (kind 0: a loss) or a validation (kind 1: accuracy and loss).
EVENT = st.tuples(
    st.integers(0, 1),
    st.floats(0.0, 1.0, allow_nan=False),
    st.floats(0.01, 5.0, allow_nan=False),
)


def feed(policy: QPolicy, events: list[tuple[int, float, float]], start: int) -> list[int]:
    """Apply events start.. in order (step t = event index); return q after each."""
    qs = []
    for t, (kind, accuracy, loss) in enumerate(events[start:], start=start):
        if kind == 0:
            grads = np.linspace(-loss, loss, policy.q)
            qs.append(policy.on_step(StepReport(t, policy.q, loss, grads, 2 * t)))
        else:
            qs.append(policy.on_eval(EvalReport(t, loss, accuracy)))
    return qs


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-{len(s.config)}")
@settings(max_examples=40, deadline=None)
@given(events=st.lists(EVENT, min_size=1, max_size=120), cut=st.floats(0.0, 1.0))
def test_state_resume_matches_uninterrupted(
    spec: PolicySpec, events: list[tuple[int, float, float]], cut: float
) -> None:
    """Stop anywhere, save through JSON, load into a fresh policy: the q sequence continues
    unchanged."""
    split = int(cut * len(events))
    whole = create_policy(spec, CONTEXT)
    expected = feed(whole, events, 0)
    first = create_policy(spec, CONTEXT)
    head = feed(first, events[:split], 0)
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = create_policy(spec, CONTEXT)
    resumed.load_state_dict(saved)
    assert resumed.q == first.q
    assert head + feed(resumed, events, split) == expected
    assert resumed.state_dict() == whole.state_dict()


def test_state_is_plain_json() -> None:
    """Every built-in policy's state survives json.dumps with strict types."""
    for spec in SPECS:
        policy = create_policy(spec, CONTEXT)
        feed(policy, [(0, 0.5, 1.0), (1, 0.5, 1.0)] * 6, 0)
        state = policy.state_dict()
        assert json.loads(json.dumps(state, allow_nan=False)) == state


def test_state_of_another_policy_refused() -> None:
    """Loading a state saved by a different policy is a PolicyError."""
    state = create_policy(PolicySpec(name="fixed"), CONTEXT).state_dict()
    policy = create_policy(PolicySpec(name="qscheduler"), CONTEXT)
    with pytest.raises(PolicyError, match="belongs to policy 'fixed'"):
        policy.load_state_dict(state)


def test_state_missing_field_refused() -> None:
    """A state without one of the policy's fields names the missing field."""
    policy: Any = create_policy(PolicySpec(name="variance"), CONTEXT)
    state = policy.state_dict()
    del state["noisy"]
    with pytest.raises(PolicyError, match="'noisy'"):
        policy.load_state_dict(state)
