"""SPSA coefficients and projected gradients."""

from __future__ import annotations

import numpy as np
import pytest

from qsched.zo.spsa import LossError, LossPairs, coefficients, forward_passes, projected_gradients


def test_spsa_two_sided_coefficients() -> None:
    """c_k = -lr (L+ - L-) / (2 eps q), rounded once to float32, ascending k."""
    losses = LossPairs(plus={2: 1.5, 0: 1.0}, minus={0: 0.5, 2: 1.75})
    pairs = coefficients(losses, lr=0.1, eps=1e-3, q=2)
    assert [k for k, _ in pairs] == [0, 2]
    assert pairs[0][1] == float(np.float32(-0.1 * 0.5 / (2e-3 * 2)))
    assert pairs[1][1] == float(np.float32(-0.1 * -0.25 / (2e-3 * 2)))


def test_spsa_one_sided_coefficients() -> None:
    """One-sided: c_k = -lr (L+ - L0) / (eps q), needs L0."""
    losses = LossPairs(plus={0: 2.0, 1: 1.0}, minus={}, base=1.5)
    pairs = coefficients(losses, lr=2.0, eps=1.0, q=2, estimator="one_sided")
    assert pairs == [(0, -0.5), (1, 0.5)]
    with pytest.raises(LossError, match="L0"):
        coefficients(LossPairs(plus={0: 1.0}, minus={}), 1.0, 1.0, 1, "one_sided")


def test_spsa_projected_gradients() -> None:
    """g_k is the central difference along z_k."""
    g = projected_gradients(LossPairs(plus={5: 3.0}, minus={5: 1.0}), eps=0.5)
    assert g == {5: 2.0}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_spsa_rejects_non_finite(bad: float) -> None:
    """A NaN or infinite loss is a LossError naming k."""
    with pytest.raises(LossError) as info:
        coefficients(LossPairs(plus={0: 1.0, 1: bad}, minus={0: 1.0, 1: 1.0}), 1.0, 1.0, 2)
    assert info.value.k == 1


def test_spsa_rejects_missing() -> None:
    """Missing minus losses or a wrong count of ks are errors."""
    with pytest.raises(LossError, match="minus"):
        coefficients(LossPairs(plus={0: 1.0}, minus={}), 1.0, 1.0, 1)
    with pytest.raises(LossError, match="expected"):
        coefficients(LossPairs(plus={0: 1.0}, minus={0: 1.0}), 1.0, 1.0, 2)


def test_spsa_merge_shards() -> None:
    """Merging shards unions ks; conflicting duplicates are errors."""
    a = LossPairs(plus={0: 1.0}, minus={0: 2.0})
    b = LossPairs(plus={1: 3.0, 0: 1.0}, minus={1: 4.0, 0: 2.0})
    assert a.merged(b).ks == [0, 1]
    with pytest.raises(LossError):
        a.merged(LossPairs(plus={0: 1.5}, minus={0: 2.0}))


def test_spsa_forward_passes() -> None:
    """2q passes two-sided, q + 1 one-sided."""
    assert forward_passes(4) == 8
    assert forward_passes(4, "one_sided") == 5


def test_spsa_rounds_each_coefficient_as_numpy_float32_does() -> None:
    """Every coefficient is its float64 value rounded to float32 to nearest (as
    ``np.float32``), signed zeros kept and an overflow becoming infinity, on many keys."""
    rng = np.random.default_rng(7)
    scales = 10.0 ** rng.integers(-9, 9, 64)
    plus = {k: float(v) for k, v in enumerate(rng.normal(size=64) * scales)}
    minus = {k: float(v) for k, v in enumerate(rng.normal(size=64))}
    plus[3], minus[3] = 0.0, 0.0
    plus[5], minus[5] = 1e308, -1e308
    with np.errstate(over="ignore"):
        want = [np.float32(-0.3 * (plus[k] - minus[k]) / (2 * 1e-3 * 64)) for k in range(64)]
    pairs = coefficients(LossPairs(plus=plus, minus=minus), lr=0.3, eps=1e-3, q=64)
    assert [k for k, _ in pairs] == list(range(64))
    got = np.array([c for _, c in pairs], dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), np.array(want, dtype=np.float32).view(np.uint32))
    assert np.isinf(got[5]) and np.signbit(got[3])


def test_spsa_names_the_first_fault_in_key_order() -> None:
    """With several faults the error names the first key that has one (its L+ before
    its L-), as a loop over the keys would."""
    nan = float("nan")
    losses = LossPairs(plus={0: 1.0, 1: 1.0, 2: nan, 3: 1.0}, minus={0: 1.0, 1: nan, 2: 1.0})
    with pytest.raises(LossError, match="L- of perturbation 1") as info:
        coefficients(losses, 1.0, 1.0, 4)
    assert info.value.k == 1
    with pytest.raises(LossError, match="L\\+ of perturbation 2"):
        projected_gradients(LossPairs(plus={2: nan, 7: 1.0}, minus={2: nan, 7: nan}), 1.0)
