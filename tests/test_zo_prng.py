"""The Philox4x32-10 PRNG and the perturbation / batch streams derived from it."""

import numpy as np
import pytest

from qsched.zo.prng import batch_indices, philox4x32, rademacher, rademacher_bits, rademacher_rows

# Known-answer tests of Philox4x32-10 (the Random123 distribution's kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_philox_known_answers(counter, key, expected):
    """Philox4x32-10 reproduces the published known-answer vectors."""
    out = philox4x32(np.array([counter], dtype=np.uint32), key)
    assert tuple(int(x) for x in out[0]) == expected


def test_rademacher_is_prefix_stable_and_balanced():
    """A longer vector starts with the shorter one; signs are roughly balanced."""
    long = rademacher(7, 3, 5, 10_000)
    assert np.array_equal(rademacher(7, 3, 5, 333), long[:333])
    assert set(np.unique(long)) == {-1, 1}
    assert abs(int(long.sum())) < 400


def test_rademacher_differs_by_key_parts():
    """Changing seed, step or k changes the perturbation."""
    base = rademacher_bits(1, 2, 3, 256)
    for other in (
        rademacher_bits(2, 2, 3, 256),
        rademacher_bits(1, 3, 3, 256),
        rademacher_bits(1, 2, 4, 256),
    ):
        assert not np.array_equal(base, other)


def test_rademacher_bit_layout_matches_spec():
    """Bit i of the stream is bit (i mod 32) of word (i mod 128) div 32 of block i div 128."""
    seed, step, k = 0x0123456789ABCDEF, 11, 4
    bits = rademacher_bits(seed, step, k, 300)
    block2 = philox4x32(
        np.array([[2, step, k, 0]], dtype=np.uint32), (seed & 0xFFFFFFFF, seed >> 32)
    )[0]
    i = 2 * 128 + 1 * 32 + 5
    assert bits[i] == bool((int(block2[1]) >> 5) & 1)


def test_batch_indices_in_range_and_deterministic():
    """Batch indices lie in [0, N) and depend only on (seed, step)."""
    idx = batch_indices(9, 100, 37, 1797)
    assert idx.min() >= 0 and idx.max() < 1797
    assert np.array_equal(idx, batch_indices(9, 100, 37, 1797))
    assert not np.array_equal(idx, batch_indices(9, 101, 37, 1797))


def test_prng_rejects_out_of_range_keys():
    """Seeds and steps outside their word sizes are refused, not wrapped."""
    with pytest.raises(ValueError, match="seed"):
        rademacher_bits(-1, 0, 0, 8)
    with pytest.raises(ValueError, match="step"):
        rademacher_bits(0, 2**32, 0, 8)


def test_rademacher_rows_are_each_keys_bits():
    """Several keys from one Philox call give each key's own bits; no key, no row."""
    rows = rademacher_rows(5, 7, [3, 0, 2**32 - 1], 300)
    assert rows.shape == (3, 300)
    for row, k in zip(rows, (3, 0, 2**32 - 1), strict=True):
        assert np.array_equal(row, rademacher_bits(5, 7, k, 300))
    assert rademacher_rows(5, 7, [], 300).shape == (0, 300)
    with pytest.raises(ValueError, match="k"):
        rademacher_rows(5, 7, [1, 2**32], 8)


@pytest.mark.parametrize("trial", range(4))
def test_native_sign_bits_match_numpy(trial):
    """The C kernel (``native.rademacher_rows``) gives numpy's Philox bits: whole and
    partial blocks, one element, the extremes of step and k, seeds above 2**32."""
    from qsched.zo import native, prng

    if not native.available():
        pytest.skip("the native kernels are not built here")
    rng = np.random.default_rng(trial)
    cases = [(2**64 - 1, 2**32 - 1, [0, 2**32 - 1], 1), (0, 0, [0], 128), (5, 1, [3], 129)]
    for _ in range(40):
        seed = int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2))
        ks = sorted({int(k) for k in rng.integers(0, 2**32, size=int(rng.integers(1, 6)))})
        cases.append((seed, int(rng.integers(0, 2**32)), ks, int(rng.integers(1, 2000))))
    for seed, step, ks, size in cases:
        got = rademacher_rows(seed, step, ks, size)
        want = prng._rademacher_rows_numpy(seed, step, ks, size)
        assert got.dtype == np.bool_ and got.shape == (len(ks), size)
        assert np.array_equal(got, want), (seed, step, ks, size)
