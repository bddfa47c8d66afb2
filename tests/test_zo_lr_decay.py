"""The learning rate's linear decay: its factor, its validation and its place in a step."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.lr_decay import lr_decay_factor
from qsched.zo.spsa import LossPairs, coefficients
from qsched.zo.step import settle_step
from qsched.zo.trainer import train_zo


def _linear(steps: int, lr_end: float = 0.0) -> JobSpec:
    return JobSpec(numerics="fp32", steps=steps, lr_decay="linear", lr_end=lr_end)


def test_linear_factor_starts_at_one_and_falls_to_lr_end() -> None:
    """1.0 at step 0, then 1 - (1 - lr_end) * t / steps: lr_end is reached after the last step."""
    spec = _linear(steps=4, lr_end=0.2)
    factors = [lr_decay_factor(spec, t) for t in range(5)]
    assert factors[0] == 1.0
    assert factors == [1.0 - 0.8 * (t / 4) for t in range(5)]
    assert factors[4] == pytest.approx(0.2)
    assert all(a > b for a, b in itertools.pairwise(factors))


def test_late_decay_holds_the_rate_then_falls_to_lr_end() -> None:
    """With lr_decay_start 0.5 the first half runs at the full rate; then the factor falls
    linearly to lr_end; a start of 0 is the decay from step 0, to the bit."""
    late = _linear(steps=8, lr_end=0.2).model_copy(update={"lr_decay_start": 0.5})
    factors = [lr_decay_factor(late, t) for t in range(9)]
    assert factors[:5] == [1.0] * 5
    assert factors[5:] == [1.0 - 0.8 * ((t / 8 - 0.5) / 0.5) for t in range(5, 9)]
    assert factors[8] == pytest.approx(0.2)
    from_zero = _linear(steps=7, lr_end=0.3)
    assert [lr_decay_factor(from_zero, t) for t in range(7)] == [
        1.0 - 0.7 * (t / 7) for t in range(7)
    ]


def test_no_decay_is_exactly_one() -> None:
    """The default keeps every step's learning rate, to the bit."""
    spec = JobSpec(numerics="fp32", steps=10)
    assert spec.lr_decay == "none"
    assert {lr_decay_factor(spec, t) for t in range(10)} == {1.0}


def test_spec_refuses_decay_shapes_out_of_range_or_without_a_decay() -> None:
    """lr_end is a factor in [0, 1], lr_decay_start a share in [0, 1), and both only mean
    something with a decay."""
    with pytest.raises(ValidationError, match="lr_end"):
        JobSpec(numerics="fp32", lr_end=0.5)
    with pytest.raises(ValidationError, match="lr_decay_start"):
        JobSpec(numerics="fp32", lr_decay_start=0.5)
    with pytest.raises(ValidationError, match="lr_decay_start"):
        JobSpec(numerics="fp32", lr_decay="linear", lr_decay_start=1.0)
    with pytest.raises(ValidationError, match="lr_end"):
        JobSpec(numerics="fp32", lr_decay="linear", lr_end=1.5)
    with pytest.raises(ValidationError, match="lr_decay"):
        JobSpec(numerics="fp32", lr_decay="cosine")


def test_settle_step_multiplies_the_policy_factor_by_the_decay() -> None:
    """Step t's coefficients are those of lr * lr_scale * f_t, in that order."""
    spec = _linear(steps=10, lr_end=0.1)
    losses = LossPairs(plus={0: 2.5, 1: 2.25}, minus={0: 2.0, 1: 2.75})
    settled = settle_step(spec, 7, 2, losses, 0, 0.25)
    step_lr = spec.lr * 0.25 * (1.0 - 0.9 * (7 / 10))
    assert settled.pairs == coefficients(losses, step_lr, spec.eps, 2)
    assert settled.pairs != coefficients(losses, spec.lr * 0.25, spec.eps, 2)


def test_trainer_with_decay_leaves_step_zero_and_changes_the_rest() -> None:
    """The first step runs at the full rate; later steps at a smaller one."""
    fixed = PolicySpec(name="fixed", config={"q": 2})
    constant = JobSpec(numerics="fp32", batch_size=16, steps=3, policy=fixed)
    decayed = constant.model_copy(update={"lr_decay": "linear"})
    assert train_zo(decayed.model_copy(update={"steps": 1})).state.checksum() == (
        train_zo(constant.model_copy(update={"steps": 1})).state.checksum()
    )
    assert train_zo(decayed).state.checksum() != train_zo(constant).state.checksum()
