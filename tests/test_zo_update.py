"""The update arithmetic: FP32 and INT8 with the FP16 accumulation buffer."""

import numpy as np
import pytest

from qsched.zo.prng import rademacher
from qsched.zo.update import apply_fp32, apply_int8_fp16, perturb_int8, to_fp16_saturating


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
