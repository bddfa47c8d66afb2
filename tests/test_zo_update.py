"""The update arithmetic: FP32 and INT8 with the FP16 accumulation buffer."""

import numpy as np
import pytest

from qsched.zo import native, update
from qsched.zo.prng import rademacher, rademacher_bits
from qsched.zo.update import (
    accumulate_delta,
    apply_fp32,
    apply_int8_fp16,
    perturb_int8,
    to_fp16_saturating,
)


def test_apply_fp32_matches_sequential_reference():
    """The vectorised FP32 update equals a scalar loop in ascending k."""
    theta = np.linspace(-1, 1, 50, dtype=np.float32)
    pairs = [(3, 0.125), (0, -0.3), (7, 1e-3)]
    out = apply_fp32(theta, 5, 9, pairs)
    zs = {k: rademacher(5, 9, k, 50) for k, _ in pairs}
    for i in range(50):
        acc = np.float32(0)
        for k, c in sorted(pairs):
            acc = np.float32(acc + np.float32(c) * np.float32(zs[k][i]))
        assert out[i] == np.float32(theta[i] + acc)


def _delta_one_k_at_a_time(seed: int, step: int, pairs: list[tuple[int, float]], size: int):
    delta = np.zeros(size, dtype=np.float32)
    for k, c in sorted(pairs):
        c32 = np.float32(c)
        delta = delta + np.where(rademacher_bits(seed, step, k, size), -c32, c32)
    return delta


@pytest.mark.parametrize("kernel", ["native", "numpy"])
@pytest.mark.parametrize("size", [1, 2, 37, 4096])
@pytest.mark.parametrize("seed", range(6))
def test_accumulate_delta_sums_in_ascending_k_to_the_bit(kernel, size, seed, monkeypatch):
    """The keys' terms are added in ascending k, as a loop would: with magnitudes that
    make the order matter, signed zeros and an overflow, over several Philox chunks,
    down to a one-weight vector (where a numpy reduction would sum pairwise); in the
    native kernel (``native.accumulate_signed``) as in numpy's row-by-row sum."""
    if kernel == "native" and not native.available():
        pytest.skip("the native kernels are not built here")
    monkeypatch.setattr(native, "available", lambda: kernel == "native")
    monkeypatch.setattr(update, "_BITS_PER_CALL", 12 * size)  # 12 keys per chunk
    rng = np.random.default_rng([size, seed])
    coefficients = (rng.normal(size=23) * 10.0 ** rng.integers(-8, 9, size=23)).astype(np.float32)
    coefficients[[2, 11]] = [0.0, -0.0]
    if seed % 2:  # two huge terms: some elements overflow to inf (and hide the order)
        coefficients[[17, 18]] = 3e38
    pairs = [
        (int(k), float(c)) for k, c in zip(rng.permutation(500)[:23], coefficients, strict=True)
    ]
    with np.errstate(over="ignore"):
        got = accumulate_delta(4, 2, pairs, size)
        want = _delta_one_k_at_a_time(4, 2, pairs, size)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_apply_int8_moves_whole_steps_and_keeps_remainder():
    """An INT8 weight moves by trunc(buffer) and the buffer keeps the fraction."""
    weights = np.array([0, 126, -127, 5], dtype=np.int8)
    buffer = np.array([0.75, 0.5, -0.5, -0.25], dtype=np.float16)
    z = rademacher(1, 1, 0, 4)
    new_w, new_b = apply_int8_fp16(weights, buffer, 1, 1, [(0, 0.5)])
    summed = (buffer.astype(np.float32) + 0.5 * z).astype(np.float16).astype(np.float32)
    moves = np.trunc(summed)
    assert np.array_equal(new_w, np.clip(weights + moves, -127, 127).astype(np.int8))
    assert np.array_equal(new_b.astype(np.float32), summed - moves)
    assert np.all(np.abs(new_b.astype(np.float32)) < 1)


def test_apply_int8_saturates_at_127():
    """A large update pins the weight at +-127 instead of wrapping."""
    weights = np.full(64, 120, dtype=np.int8)
    new_w, _ = apply_int8_fp16(weights, np.zeros(64, np.float16), 2, 2, [(0, 50.0)])
    assert new_w.max() == 127 and new_w.min() == 70


def test_fp16_buffer_saturates_instead_of_inf():
    """Rounding to FP16 clamps to the largest finite value."""
    out = to_fp16_saturating(np.array([1e9, -1e9], dtype=np.float32))
    assert np.all(np.isfinite(out)) and out[0] == np.float16(65504)


def test_update_rejects_repeated_k():
    """Two coefficients for one k is a protocol error, not a silent double update."""
    with pytest.raises(ValueError, match="repeat"):
        apply_fp32(np.zeros(4, np.float32), 0, 0, [(1, 0.1), (1, 0.2)])


def test_perturb_int8_saturates():
    """Perturbed int8 weights stay in [-127, 127]."""
    w = np.array([127, -127, 0] * 10, dtype=np.int8)
    for sign in (1, -1):
        p = perturb_int8(w, 3, 4, 5, 2, sign)
        assert p.max() <= 127 and p.min() >= -127


def test_native_accumulate_refuses_mismatched_shapes():
    """The C sum checks its arrays' shapes before it touches memory."""
    if not native.available():
        pytest.skip("the native kernels are not built here")
    with pytest.raises(ValueError, match="one coefficient per row"):
        native.accumulate_signed(
            np.zeros(4, np.float32), np.zeros((2, 5), np.bool_), np.zeros(2, np.float32)
        )
    with pytest.raises(ValueError, match="bool array"):
        native.accumulate_signed(
            np.zeros(4, np.float32), np.zeros((2, 4), np.int64), np.zeros(2, np.float32)
        )
    with pytest.raises(ValueError, match="contiguous float32"):
        native.accumulate_signed(
            np.zeros(8, np.float32)[::2], np.zeros((2, 4), np.bool_), np.zeros(2, np.float32)
        )
