"""Scale recalibration: the rule, what it keeps, and a job that uses it (SPEC "Scale
recalibration")."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo import engine
from qsched.zo.data import RESNET8_CIFAR10
from qsched.zo.recalibrate import (
    RECAL_EXP_MAX,
    ChannelLayout,
    effective_bias,
    effective_scales,
    exp_limits,
    recalibrate,
    recalibration_due,
)
from qsched.zo.trainer import train_zo
from qsched.zo.workload import TrainState, Workload


def _layout(channels: int, per_channel: int, minor: bool = False) -> ChannelLayout:
    n = channels * per_channel
    ones = np.full(channels, 1 << 30, np.int64)
    return ChannelLayout.of([(n, channels, minor)], ones, np.full(channels, -8, np.int64))


def test_a_saturated_channel_doubles_and_keeps_its_real_values() -> None:
    """w + b before equals 2 (w' + b') after, up to one binary16 rounding of b'."""
    rng = np.random.default_rng(3)
    layout = _layout(4, 50)
    w = rng.integers(-127, 128, 200).astype(np.int8)
    w[:50] = np.clip(w[:50], -126, 126)  # channel 0 does not reach the clamp
    w[60], w[120], w[170] = 127, -127, -127  # channels 1, 2 and 3 do
    b = rng.uniform(-0.99, 0.99, 200).astype(np.float16)
    new_w, new_b, exps = recalibrate(w, b, np.zeros(4, np.int8), layout)
    assert exps.tolist() == [0, 1, 1, 1]
    assert np.array_equal(new_w[:50], w[:50]) and np.array_equal(new_b[:50], b[:50])
    before = w[50:].astype(np.float64) + b[50:].astype(np.float64)
    after = 2 * (new_w[50:].astype(np.float64) + new_b[50:].astype(np.float64))
    assert np.max(np.abs(after - before)) <= 2 * 2.0**-11  # half an ulp of binary16 below 1
    assert np.abs(new_w[50:]).max() <= 64


def test_halving_rounds_toward_zero_and_carries_the_half_step() -> None:
    """Odd weights: 5 -> 2 with +0.5 in the buffer, -5 -> -2 with -0.5."""
    layout = _layout(1, 4)
    w = np.array([127, 5, -5, -127], np.int8)
    b = np.array([0.0, 0.25, 0.25, -0.5], np.float16)
    new_w, new_b, _ = recalibrate(w, b, np.zeros(1, np.int8), layout)
    assert new_w.tolist() == [63, 2, -2, -63]
    assert new_b.tolist() == [0.5, 0.625, -0.375, -0.75]


def test_channel_minor_tensors_interleave_their_channels() -> None:
    """Depthwise 1HWC: element j is in channel j mod C."""
    layout = _layout(3, 2, minor=True)
    w = np.array([127, 1, 2, 3, 4, 5], np.int8)  # channel 0 holds elements 0 and 3
    new_w, _, exps = recalibrate(w, np.zeros(6, np.float16), np.zeros(3, np.int8), layout)
    assert exps.tolist() == [1, 0, 0] and new_w.tolist() == [63, 1, 2, 1, 4, 5]


def test_exponents_stop_at_their_limit() -> None:
    """At most RECAL_EXP_MAX doublings, fewer when the requantisation shift would pass 30,
    none for a zero multiplier."""
    multipliers, shifts = np.array([1 << 30, 1 << 30, 0, 1 << 30]), np.array([-20, 27, -3, 31])
    assert exp_limits(multipliers, shifts).tolist() == [RECAL_EXP_MAX, 3, 0, 0]
    layout = ChannelLayout.of([(4, 4, False)], multipliers, shifts)
    w = np.full(4, 127, np.int8)
    exps = np.array([RECAL_EXP_MAX, 2, 0, 0], np.int8)
    _, _, grown = recalibrate(w, np.zeros(4, np.float16), exps, layout)
    assert grown.tolist() == [RECAL_EXP_MAX, 3, 0, 0]


def test_effective_scales_and_biases() -> None:
    """Scales times 2^e exactly; biases divided by 2^e, halves away from zero."""
    scales = np.array([0.0123, 3.5e-5], np.float32)
    assert np.array_equal(effective_scales(scales, [2, 0]), np.array([0.0492, 3.5e-5], np.float32))
    bias = [3, -3, 5, 6, -6, 7]
    assert effective_bias(bias, [1, 1, 2, 2, 2, 0]).tolist() == [2, -2, 1, 2, -2, 7]


def test_due_after_every_nth_step() -> None:
    """After the updates of steps N-1, 2N-1, ...; never when off."""
    assert [s for s in range(12) if recalibration_due(s, 4)] == [3, 7, 11]
    assert not any(recalibration_due(s, 0) for s in range(12))


def test_job_spec_allows_recalibration_only_with_the_fp16_buffer() -> None:
    """FP32 has no scales and the INT8 accumulator has its own rescaling."""
    JobSpec(numerics="int8", recalibrate_every=10)
    with pytest.raises(ValidationError, match="recalibrate_every"):
        JobSpec(numerics="fp32", recalibrate_every=10)
    with pytest.raises(ValidationError, match="recalibrate_every"):
        JobSpec(numerics="int8", accumulator="int8", recalibrate_every=10)


def _spec(**changes: object) -> JobSpec:
    base: dict[str, object] = {
        "dataset": "digits",
        "model": "mlp",
        "model_options": {"hidden": 16},
        "numerics": "int8",
        "steps": 40,
        "batch_size": 16,
        "lr": 2.0,  # large: the weights reach the clamp within the run
        "eval_every": 20,
        "recalibrate_every": 5,
        "policy": PolicySpec(name="fixed", config={"q": 4}),
    }
    return JobSpec.model_validate({**base, **changes})


@pytest.fixture(scope="module")
def trained() -> tuple[Workload, TrainState]:
    spec = _spec()
    wl = Workload.from_spec(spec)
    return wl, train_zo(spec, workload=wl).state


def test_a_job_recalibrates_and_its_state_carries_the_exponents(
    trained: tuple[Workload, TrainState],
) -> None:
    """Channels grow during the run; the exponents are in the weight bytes and checksum."""
    wl, state = trained
    assert state.scale_exps is not None and state.scale_exps.max() > 0
    assert wl.recalibration is not None and state.scale_exps.size == wl.recalibration.channels
    assert state.weight_bytes().endswith(state.scale_exps.tobytes())
    again = wl.initial_state().with_weight_bytes(state.weight_bytes(), state.step)
    assert again.checksum() == state.checksum()
    assert TrainState.from_bytes(state.to_bytes()).checksum() == state.checksum()


def test_the_forward_pass_runs_the_recalibrated_model(
    trained: tuple[Workload, TrainState],
) -> None:
    """Validation under the exponents equals the exported model run from scratch."""
    wl, state = trained
    exported = wl.to_quant_model(state)
    logits = engine.run_int8(exported, wl._x_val[:64])
    _, correct, count = wl.validate(state, 0, 64)
    assert correct == int((np.argmax(logits, axis=-1) == wl.dataset.y_val[:64]).sum())
    assert count == 64
    scales = exported.layers[wl.trainable_layers[0]].weight_scales
    base = wl.qmodel.layers[wl.trainable_layers[0]].weight_scales  # type: ignore[union-attr]
    assert np.any(scales != base)


def test_resuming_a_recalibrating_job_gives_the_same_bits(
    trained: tuple[Workload, TrainState],
) -> None:
    """Stop between recalibrations, serialise, resume: the same final checksum."""
    spec = _spec()
    first = train_zo(spec, stop_at=17)
    first.state = TrainState.from_bytes(first.state.to_bytes())
    assert train_zo(spec, resume=first).state.checksum() == trained[1].checksum()


def test_off_the_state_has_no_exponents_and_the_bits_are_unchanged() -> None:
    """recalibrate_every = 0 is the fixed-scale job, and a version 1 state still reads."""
    state = Workload.from_spec(_spec(recalibrate_every=0)).initial_state()
    assert state.scale_exps is None
    raw = state.to_bytes()
    v1 = raw[:4] + (1).to_bytes(2, "little") + raw[6:24] + raw[28:]
    assert TrainState.from_bytes(v1).checksum() == state.checksum()


CONV = (
    "model/batch_normalization_6/FusedBatchNormV3;model/conv2d_7/BiasAdd/ReadVariableOp/"
    "resource;model/conv2d_7/BiasAdd;model/conv2d_8/Conv2D;model/conv2d_7/Conv2D"
)


def _resnet8_job(trainable: str | list[str]) -> tuple[Workload, TrainState]:
    spec = JobSpec(
        dataset="eurosat:size=32,scale=255",
        backbone=str(RESNET8_CIFAR10),
        numerics="int8",
        trainable=trainable,
        steps=1,
        batch_size=8,
        recalibrate_every=1,
        policy=PolicySpec(name="fixed", config={"q": 1}),
    )
    wl = Workload.from_spec(spec)
    return wl, train_zo(spec, workload=wl).state


def test_an_imported_model_exports_its_recalibrated_layers_in_place() -> None:
    """The user's own file comes back with the grown scales, the biases and the bias
    tensors' scales rewritten: read again, it computes what the job computes."""
    from qsched.daemon.export import export_model
    from qsched.zo.tflite_io import import_tflite

    wl, state = _resnet8_job([CONV])
    assert state.scale_exps is not None and state.scale_exps.max() > 0
    data = export_model(wl, state, "tflite")
    original = RESNET8_CIFAR10.read_bytes()
    assert len(data) == len(original) and data != original
    back = import_tflite(data)
    trained = wl.to_quant_model(state)
    assert np.array_equal(back.layers[CONV].weight_scales, trained.layers[CONV].weight_scales)
    assert np.array_equal(back.layers[CONV].bias, trained.layers[CONV].bias)
    x = wl._x_val[:16]
    assert np.array_equal(engine.run_int8(back, x), engine.run_int8(trained, x))


def test_a_per_tensor_layer_recalibrated_apart_cannot_go_back_in_place() -> None:
    """The file's dense layer has one scale; its channels grew apart: a clear ExportError."""
    from qsched.daemon.errors import ExportError
    from qsched.daemon.export import export_model

    wl, state = _resnet8_job("last:1")
    assert state.scale_exps is not None and len(set(state.scale_exps.tolist())) > 1
    with pytest.raises(ExportError, match="one weight scale in the source file"):
        export_model(wl, state, "tflite")
