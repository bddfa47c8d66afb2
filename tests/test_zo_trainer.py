"""Single-process ZO training: resumption to the bit, learning, history."""

from __future__ import annotations

import pytest

from qsched.policies import FixedPolicy
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.step import EvalRecord, StepRecord
from qsched.zo.trainer import TrainResult, train_zo
from qsched.zo.workload import TrainState, Workload


def _short(**kwargs: object) -> JobSpec:
    base: dict[str, object] = {"steps": 40, "batch_size": 32, "eval_every": 10}
    base.update(kwargs)
    return JobSpec.model_validate(base)


@pytest.mark.parametrize("accumulator", ["fp16", "int8"])
def test_trainer_resume_from_saved_state_is_bit_identical(accumulator: str) -> None:
    """Save mid-run (state bytes + policy state), restore, continue: same checksum."""
    spec = _short(accumulator=accumulator)
    workload = Workload.from_spec(spec)
    straight = train_zo(spec, workload=workload)
    first = train_zo(spec, workload=workload, stop_at=17)
    assert first.state.step == 17 and not first.done
    saved = TrainResult(
        spec,
        TrainState.from_bytes(first.state.to_bytes()),
        first.policy_state,
        first.steps,
        first.evals,
        first.forward_passes,
    )
    resumed = train_zo(spec, workload=Workload.from_spec(spec), resume=saved)
    assert resumed.done
    assert resumed.state.checksum() == straight.state.checksum()
    assert [s.q for s in resumed.steps] == [s.q for s in straight.steps]
    assert resumed.forward_passes == straight.forward_passes


@pytest.mark.parametrize(
    ("options", "floor"),
    [({}, 0.45), ({"accumulator": "int8"}, 0.45), ({"numerics": "fp32"}, 0.35)],
)
def test_trainer_beats_chance_on_digits(options: dict[str, str], floor: float) -> None:
    """300 steps with q = 4 clearly beat 10% accuracy and lower the loss, in every numerics."""
    spec = _short(
        steps=300, eval_every=100, policy=PolicySpec(name="fixed", config={"q": 4}), **options
    )
    result = train_zo(spec)
    assert result.evals[-1].val_loss < result.evals[0].val_loss
    assert result.final_accuracy > floor


def test_trainer_records_history_and_calls_back() -> None:
    """Every step is recorded with q and cumulative passes; evals every eval_every."""
    seen: list[tuple[StepRecord, EvalRecord | None]] = []
    spec = _short(steps=25, eval_every=10, policy=PolicySpec(name="fixed", config={"q": 3}))
    result = train_zo(spec, on_step=lambda s, e: seen.append((s, e)))
    assert [s.step for s in result.steps] == list(range(25))
    assert all(s.q == 3 for s in result.steps)
    assert result.steps[-1].forward_passes == result.forward_passes == 25 * 6
    assert [e.step for e in result.evals] == [9, 19, 24]
    assert len(seen) == 25 and seen[9][1] == result.evals[0]
    assert result.policy_state["policy"] == "fixed"


def test_trainer_accepts_policy_object_and_rejects_other_spec() -> None:
    """A given policy drives q; resuming another spec's result is an error."""
    from qsched.policies import FixedConfig
    from qsched.zo.trainer import policy_context

    spec = _short(steps=5, eval_every=5)
    workload = Workload.from_spec(spec)
    policy = FixedPolicy(FixedConfig(q=2), policy_context(spec, workload))
    result = train_zo(spec, policy, workload=workload)
    assert {s.q for s in result.steps} == {2}
    with pytest.raises(ValueError, match="another job"):
        train_zo(_short(steps=6), resume=result)


def test_trainer_applies_the_policys_lr_scale() -> None:
    """qscheduler with lr_full_q 4 runs its q = 1 step at lr / 4: the same bits as a job
    whose lr is a quarter, and not those of the job's own lr."""
    quarter = _short(steps=1, lr=0.0125, policy=PolicySpec(name="qscheduler"))
    scaled = _short(steps=1, lr=0.05, policy=PolicySpec(name="qscheduler", config={"lr_full_q": 4}))
    plain = _short(steps=1, lr=0.05, policy=PolicySpec(name="qscheduler"))
    checksum = train_zo(scaled).state.checksum()
    assert checksum == train_zo(quarter).state.checksum()
    assert checksum != train_zo(plain).state.checksum()


class _NanLrScale(FixedPolicy):
    """A plugin whose learning-rate factor is not a number."""

    def lr_scale(self, q: int) -> float:
        del q
        return float("nan")


def test_trainer_refuses_a_policy_lr_scale_that_is_not_finite() -> None:
    """A plugin's lr scale is checked where it is used, like its q."""
    from qsched.policies import FixedConfig, PolicyError
    from qsched.zo.trainer import policy_context

    spec = _short(steps=2, eval_every=2)
    workload = Workload.from_spec(spec)
    policy = _NanLrScale(FixedConfig(q=2), policy_context(spec, workload))
    with pytest.raises(PolicyError, match="lr scale nan"):
        train_zo(spec, policy, workload=workload)


def test_a_diverging_run_ends_in_one_loss_error_without_numpy_warnings() -> None:
    """An FP32 learning rate far too large makes the losses overflow: the user gets the
    LossError naming the key, not numpy's overflow and invalid-value warnings first."""
    import warnings

    from qsched.zo.spsa import LossError

    spec = _short(numerics="fp32", lr=1e30, policy=PolicySpec(name="fixed", config={"q": 4}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(LossError, match="not finite"):
            train_zo(spec)
    assert [str(w.message) for w in caught] == []
