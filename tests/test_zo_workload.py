"""The ZO workload facade: construction, perturbed losses, sharded updates, state I/O."""

from __future__ import annotations

import numpy as np
import pytest

from qsched.protocol.jobspec import JobSpec
from qsched.zo import accum_int8, engine, intloss, prng, update
from qsched.zo.spsa import LossPairs, coefficients
from qsched.zo.workload import StateError, TrainState, Workload, WorkloadError


@pytest.fixture(scope="module")
def int8_workload() -> Workload:
    return Workload.from_spec(JobSpec(batch_size=32))


@pytest.fixture(scope="module")
def fp32_workload() -> Workload:
    return Workload.from_spec(JobSpec(numerics="fp32", batch_size=32))


def test_workload_construction_deterministic(int8_workload: Workload) -> None:
    """Two constructions from one spec give the same weights, scales and blob."""
    again = Workload.from_spec(int8_workload.spec)
    assert again.initial_state().checksum() == int8_workload.initial_state().checksum()
    assert again.model_blob() == int8_workload.model_blob()
    other = Workload.from_spec(int8_workload.spec.model_copy(update={"seed": 7}))
    assert other.initial_state().checksum() != int8_workload.initial_state().checksum()


def test_workload_trainable_selection() -> None:
    """'last:N' and name lists pick layers; an unknown name lists the layers."""
    wl = Workload.from_spec(JobSpec(trainable="last:1"))
    assert wl.trainable_layers == ["dense_2"]
    assert wl.num_params == wl.qmodel.layers["dense_2"].weight.size
    with pytest.raises(WorkloadError, match="dense_1"):
        Workload.from_spec(JobSpec(trainable=["nope"]))


def _direct_int8_loss(wl: Workload, weights: np.ndarray, step: int) -> float:
    assert wl.qmodel is not None
    idx = wl.batch(step)
    layers, start = {}, 0
    for name in wl.trainable_layers:
        shape = wl.qmodel.layers[name].weight.shape
        size = int(np.prod(shape))
        layers[name] = weights[start : start + size].reshape(shape)
        start += size
    scale = wl.qmodel.tensors[wl.model.output_name].scale
    x_q = wl._x_train[idx]  # the quantised training inputs
    logits = engine.run_int8(wl.qmodel, x_q, layers)
    per = intloss.loss_q16(
        logits, wl.dataset.y_train[idx], intloss.exp_table(scale), intloss.scale_q24(scale)
    )
    return float(intloss.q16_to_float(intloss.batch_loss_q16(per)))


@pytest.mark.parametrize("trainable", ["all", "last:1"])
def test_workload_int8_losses_match_direct_evaluation(trainable: str) -> None:
    """Batched perturbed losses equal one plain run_int8 per perturbed weight vector."""
    wl = Workload.from_spec(JobSpec(batch_size=16, trainable=trainable))
    state = wl.initial_state()
    losses = wl.perturbed_losses(state, 3, [0, 5])
    for k in (0, 5):
        for sign, got in ((1, losses.plus[k]), (-1, losses.minus[k])):
            weights = update.perturb_int8(state.params.astype(np.int8), wl.spec.seed, 3, k, 1, sign)
            assert got == _direct_int8_loss(wl, weights, 3)


def test_workload_fp32_losses_match_direct_evaluation(fp32_workload: Workload) -> None:
    """FP32 perturbed losses equal the float CE of run_fp32 with perturb_fp32 weights."""
    wl = fp32_workload
    state = wl.initial_state()
    losses = wl.perturbed_losses(state, 2, [1])
    theta = update.perturb_fp32(state.params.astype(np.float32), wl.spec.seed, 2, 1, wl.spec.eps, 1)
    params, start = {}, 0
    for node in wl.model.param_nodes():
        w_size, b_size = node.weight.size, node.bias.size
        w = theta[start : start + w_size].reshape(node.weight.shape)
        b = theta[start + w_size : start + w_size + b_size]
        params[node.name] = (w, b)
        start += w_size + b_size
    idx = wl.batch(2)
    logits = engine.run_fp32(wl.model, wl.dataset.x_train[idx], params)
    expected = intloss.float_cross_entropy(logits, wl.dataset.y_train[idx]).mean(dtype=np.float32)
    assert losses.plus[1] == float(expected)


@pytest.mark.parametrize("numerics", ["int8", "fp32"])
@pytest.mark.parametrize("estimator", ["two_sided", "one_sided"])
def test_workload_perturbed_sets_are_the_reference_perturbations(
    numerics: str, estimator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each row of the batched perturbation is update.perturb_int8 / perturb_fp32 of its
    key and sign, to the bit: saturated int8 weights, negative and zero floats, keys
    perturbed in several groups (a small group size forced here)."""
    from qsched.zo import workload as workload_module

    spec = JobSpec(numerics=numerics, estimator=estimator, eps=2 if numerics == "int8" else 0.01)
    wl = Workload.from_spec(spec)
    state = wl.initial_state()
    params = state.params.copy()
    params[:8] = (127, -127, 126, -126, 0, 1, -1, 0) if numerics == "int8" else 0.0
    if numerics == "fp32":
        params[1] = -0.0
    state = TrainState(state.step, params, state.buffer, state.scale_exps)
    monkeypatch.setattr(workload_module, "_PERTURB_ELEMENTS", 2 * wl.num_params)
    keys = [9, 0, 4, 2**32 - 1, 7]
    got_keys, sets = wl._perturbed_sets(state, 11, keys)
    assert got_keys == keys
    signs = (1, -1) if estimator == "two_sided" else (1,)
    expected = []
    for k in keys:
        for sign in signs:
            if numerics == "int8":
                expected.append(update.perturb_int8(params, spec.seed, 11, k, 2, sign))
            else:
                expected.append(update.perturb_fp32(params, spec.seed, 11, k, spec.eps, sign))
    if estimator == "one_sided":
        expected.append(params)
    assert sets.dtype == params.dtype and sets.shape == (len(expected), wl.num_params)
    for row, want in zip(sets, expected, strict=True):
        assert row.tobytes() == want.astype(params.dtype).tobytes()
    if numerics == "int8":  # the clamp is reached both ways
        assert {127, -127} <= set(sets[:, :4].ravel().tolist())


@pytest.mark.parametrize("spec_kwargs", [{}, {"numerics": "fp32"}, {"accumulator": "int8"}])
def test_workload_sharded_steps_bit_identical(spec_kwargs: dict[str, str]) -> None:
    """ks split across 3 boards give the same losses and the same final checksum."""
    wl = Workload.from_spec(JobSpec(batch_size=16, **spec_kwargs))
    whole = wl.initial_state()
    sharded = [wl.initial_state() for _ in range(3)]
    q = 6
    for step in range(4):
        full = wl.perturbed_losses(whole, step, range(q))
        parts = [wl.perturbed_losses(sharded[0], step, ks) for ks in ([4, 0], [2], [1, 3, 5])]
        merged = parts[0].merged(parts[1]).merged(parts[2])
        assert dict(merged.plus) == dict(full.plus) and dict(merged.minus) == dict(full.minus)
        pairs = coefficients(merged, wl.spec.lr, wl.spec.eps, q)
        whole = wl.apply_update(whole, step, coefficients(full, wl.spec.lr, wl.spec.eps, q))
        sharded = [wl.apply_update(s, step, pairs) for s in sharded]
    assert {s.checksum() for s in sharded} == {whole.checksum()}
    assert whole.checksum() != wl.initial_state().checksum()


def test_workload_one_sided_losses() -> None:
    """The one-sided estimator returns L+ per k and the unperturbed L0."""
    wl = Workload.from_spec(JobSpec(batch_size=16, estimator="one_sided"))
    state = wl.initial_state()
    losses = wl.perturbed_losses(state, 0, [0, 1])
    assert losses.minus == {} and losses.base is not None
    assert losses.base == _direct_int8_loss(wl, state.params, 0)


def test_workload_state_bytes_round_trip(int8_workload: Workload) -> None:
    """to_bytes/from_bytes keeps every bit; damaged bytes are a StateError."""
    state = int8_workload.initial_state()
    state = int8_workload.apply_update(state, 0, [(0, 0.75), (1, -0.3)])
    back = TrainState.from_bytes(state.to_bytes())
    assert back.step == 1 and back.checksum() == state.checksum()
    assert np.array_equal(back.params, state.params) and back.buffer is not None
    with pytest.raises(StateError):
        TrainState.from_bytes(state.to_bytes()[:-1])
    with pytest.raises(StateError):
        TrainState.from_bytes(b"XXXX" + state.to_bytes()[4:])


def test_workload_checksum_is_spec_crc(int8_workload: Workload) -> None:
    """The checksum is CRC-32 over int8 weights then the FP16 buffer bytes."""
    import zlib

    state = int8_workload.initial_state()
    assert state.buffer is not None
    expected = zlib.crc32(state.buffer.tobytes(), zlib.crc32(state.params.tobytes()))
    assert state.checksum() == expected


def test_frozen_state_is_read_only_and_keeps_its_checksum(int8_workload: Workload) -> None:
    """A frozen state cannot be written, so its checksum is kept; one whose arrays are
    views of other memory is frozen as a copy, so writes through the views cannot reach it."""
    state = int8_workload.initial_state()
    frozen = state.frozen()
    assert frozen.is_frozen() and not state.is_frozen() and frozen.frozen() is frozen
    assert frozen.checksum() == state.checksum()
    with pytest.raises(ValueError, match="read-only"):
        frozen.params[0] = 1
    assert state.buffer is not None
    memory = state.params.copy()
    view = TrainState(0, memory[:], state.buffer)
    shared = view.frozen()
    assert shared is not view and shared.checksum() == state.checksum()
    memory[0] = 0 if memory[0] else 1
    assert shared.checksum() == state.checksum() != view.checksum()


def test_workload_update_checks_step(int8_workload: Workload) -> None:
    """An update for another step, or a foreign state, is refused."""
    state = int8_workload.initial_state()
    with pytest.raises(StateError, match="step"):
        int8_workload.apply_update(state, 1, [(0, 1.0)])
    with pytest.raises(StateError):
        int8_workload.apply_update(TrainState(0, state.params.astype(np.float32)), 0, [(0, 1.0)])


def test_workload_validate_slices_add_up(int8_workload: Workload) -> None:
    """Data-parallel validation slices sum exactly to the whole."""
    state = int8_workload.initial_state()
    total = int8_workload.validate(state)
    a = int8_workload.validate(state, 0, 100)
    b = int8_workload.validate(state, 100)
    assert total[2] == len(int8_workload.dataset.x_val) == a[2] + b[2]
    assert total[0] == a[0] + b[0] and total[1] == a[1] + b[1]
    assert 1.5 < total[0] / total[2] < 3.5  # near ln(10) for an untrained model


def test_workload_validation_with_frozen_layers_matches_the_full_model() -> None:
    """With a frozen prefix, validation (the validation split runs through the prefix
    once and is cached) counts what a plain run of the whole model counts, for the whole
    set and a slice, before and after a step; every slice takes the one cached copy."""
    wl = Workload.from_spec(JobSpec(batch_size=16, trainable="last:1"))
    state = wl.initial_state()
    for current in (state, wl.apply_update(state, 0, [(0, 40.0), (3, -25.0)])):
        logits = engine.run_int8(wl.to_quant_model(current), wl._x_val)
        hits = np.argmax(logits, axis=-1) == wl.dataset.y_val
        assert wl.validate(current)[1] == int(hits.sum())
        assert wl.validate(current, 100, 50)[1] == int(hits[100:150].sum())
    cached = wl._prefix["val"]
    assert wl.validate(current, 300, 59)[1] == int(hits[300:359].sum())
    assert set(wl._prefix) == {"val"} and wl._prefix["val"] is cached


def test_workload_export_matches_state(int8_workload: Workload) -> None:
    """to_quant_model carries the state's int8 weights and evaluates like the workload."""
    wl = int8_workload
    state = wl.apply_update(wl.initial_state(), 0, [(0, 40.0)])
    qmodel = wl.to_quant_model(state)
    assert np.array_equal(
        np.concatenate([qmodel.layers[n].weight.ravel() for n in wl.trainable_layers]), state.params
    )
    logits = engine.run_int8(qmodel, wl._x_val[:50])
    assert (
        int((np.argmax(logits, axis=-1) == wl.dataset.y_val[:50]).sum())
        == wl.validate(state, 0, 50)[1]
    )
    float_model = wl.to_model(state)
    assert float_model.param_nodes()[0].weight.dtype == np.float32


def test_workload_int8_accumulator_state_layout() -> None:
    """The INT8 accumulator state is the buffer then one shift per tensor."""
    wl = Workload.from_spec(JobSpec(accumulator="int8", batch_size=16))
    state = wl.initial_state()
    assert state.buffer is not None and state.buffer.dtype == np.int8
    assert state.buffer.shape == (wl.num_params + len(wl.tensor_sizes),)
    assert np.all(state.buffer[wl.num_params :] == accum_int8.INITIAL_SHIFT)


def test_accum_int8_whole_steps_and_remainder() -> None:
    """Deltas in 1/128 units move whole steps into the weight and keep the remainder."""
    sizes = [4]
    state = accum_int8.initial_state(sizes)
    weights = np.array([0, 10, 126, -5], dtype=np.int8)
    # One pair: c z_k with z from Philox; choose c so |delta| = 1.5 steps.
    new_w, new_s = accum_int8.apply(weights, state, sizes, seed=1, step=0, pairs=[(0, 1.5)])
    z = 1 - 2 * prng.rademacher_bits(1, 0, 0, 4).astype(np.int64)
    assert new_w.tolist() == np.clip(weights + z, -127, 127).tolist()
    assert new_s[:4].tolist() == (z * 64).tolist()
    assert new_s[4] == accum_int8.INITIAL_SHIFT


def test_accum_int8_rescale_rules() -> None:
    """Small buffers gain a bit of resolution; saturated ones lose one."""
    sizes = [3, 2]
    state = np.array([10, -20, 30, 127, -127, 9, 9], dtype=np.int8)
    out = accum_int8.rescale(state, sizes)
    assert out.tolist() == [20, -40, 60, 64, -64, 10, 8]
    coarse = accum_int8.rescale(out, sizes)
    assert coarse.tolist() == [40, -80, 120, 64, -64, 11, 8]
    with pytest.raises(ValueError, match="shifts"):
        accum_int8.split_state(np.array([0, 0, 0, 0, 0, 3, 7], dtype=np.int8), sizes)


def test_accum_int8_matches_fp16_on_coarse_deltas() -> None:
    """With deltas that are multiples of 1/128, INT8 and FP16 buffers move weights alike."""
    rng = np.random.default_rng(0)
    n = 300
    weights = rng.integers(-100, 100, n).astype(np.int8)
    w8, s8 = weights.copy(), accum_int8.initial_state([n])
    w16, b16 = weights.copy(), np.zeros(n, dtype=np.float16)
    for step in range(10):  # below RESCALE_EVERY, so no rescaling
        pairs = [(k, float(rng.integers(-200, 200)) / 128.0) for k in range(3)]
        w8, s8 = accum_int8.apply(w8, s8, [n], 5, step, pairs)
        w16, b16 = update.apply_int8_fp16(w16, b16, 5, step, pairs)
        assert np.array_equal(w8, w16)
        assert np.array_equal(s8[:n].astype(np.float32) / 128.0, b16.astype(np.float32))


def test_workload_rejects_duplicate_ks(int8_workload: Workload) -> None:
    """A repeated perturbation index is an error."""
    with pytest.raises(ValueError, match="repeated"):
        int8_workload.perturbed_losses(int8_workload.initial_state(), 0, [1, 1])


def test_workload_loss_pairs_are_exact_q16(int8_workload: Workload) -> None:
    """INT8 losses are Q16 integers divided by 65536."""
    losses: LossPairs = int8_workload.perturbed_losses(int8_workload.initial_state(), 0, [0])
    for value in (*losses.plus.values(), *losses.minus.values()):
        assert (value * 65536).is_integer()


def test_learning_rate_units_and_their_defaults() -> None:
    """INT8 learning rates are in weight units by default (0.05); int8 steps keep 3000;
    FP32 rates are weight units only; a stored spec from before lr_unit ran in steps."""
    assert (JobSpec().lr, JobSpec().lr_unit) == (0.05, "weight")
    assert JobSpec(lr_unit="int8_step").lr == 3000.0
    assert JobSpec.model_validate({"lr_unit": "int8_step", "lr": 7}).lr == 7.0
    assert JobSpec(numerics="fp32").lr == 0.02
    with pytest.raises(ValueError, match="weight units"):
        JobSpec(numerics="fp32", lr_unit="int8_step")
    old = JobSpec().model_dump()
    del old["lr_unit"]
    old["lr"] = 3000.0
    assert JobSpec.from_stored(old).lr_unit == "int8_step"
    assert JobSpec.from_stored({**old, "numerics": "fp32", "lr": 0.02}).lr_unit == "weight"


def test_update_gain_is_each_weights_channel_gain() -> None:
    """Per element, 1 / s^2 of its channel: output channels of dense and conv weights, the
    last axis of depthwise ones; an update moves a weight by delta times that gain."""
    spec = JobSpec(model="mobilenetv2", dataset="eurosat:size=16", trainable="all", batch_size=4)
    wl = Workload.from_spec(spec)
    gain = wl.update_gain
    assert gain is not None and gain.dtype == np.float32 and gain.size == wl.num_params
    assert Workload.from_spec(spec.model_copy(update={"lr_unit": "int8_step"})).update_gain is None
    kinds = set()
    for seg in wl.segments:
        node, layer = wl.model.node(seg.layer), wl.qmodel.layers[seg.layer]  # type: ignore[union-attr]
        part = gain[seg.start : seg.stop].reshape(layer.weight.shape)
        s = layer.weight_scales.astype(np.float64)
        expected = (1.0 / (s * s)).astype(np.float32)
        depthwise = getattr(node, "depthwise", False)
        kinds.add((type(node).__name__, depthwise))
        if depthwise:
            np.testing.assert_array_equal(part, np.broadcast_to(expected, part.shape))
        else:
            np.testing.assert_array_equal(
                part, expected.reshape(-1, *[1] * (part.ndim - 1)) * np.ones_like(part)
            )
    assert kinds >= {("Conv2D", True), ("Conv2D", False), ("Dense", False)}
    delta = update.accumulate_delta(spec.seed, 0, [(0, 1e-6)], wl.num_params)
    np.testing.assert_array_equal(
        update.accumulate_delta(spec.seed, 0, [(0, 1e-6)], wl.num_params, gain), delta * gain
    )
    assert update.channel_gains([0.0, np.nan, 1e-30, 0.5]).tolist() == [
        0.0, 0.0, float(np.finfo(np.float32).max), 4.0
    ]  # fmt: skip
