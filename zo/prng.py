"""Counter-based PRNG keyed by (job seed, step, k): Philox4x32-10.

Every random choice a board and the daemon must agree on comes from here, so the
algorithm, the key layout and the bit-to-value mapping are part of the wire protocol
(``protocol/SPEC.md``, section "PRNG") and are implemented again in C
(``firmware/core/prng.c``). Nothing here touches libm.

Layout of one Philox call:
    key     = (seed mod 2**32, seed >> 32)            # 64-bit job seed
    counter = (block, step, k, domain)                # four uint32 words
and each call yields four uint32 words, i.e. 128 random bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "DOMAIN_BATCH",
    "DOMAIN_PERTURB",
    "batch_indices",
    "philox4x32",
    "rademacher",
    "rademacher_bits",
    "rademacher_rows",
]

PHILOX_M0: Final = np.uint64(0xD2511F53)
PHILOX_M1: Final = np.uint64(0xCD9E8D57)
PHILOX_W0: Final = 0x9E3779B9
PHILOX_W1: Final = 0xBB67AE85
PHILOX_ROUNDS: Final = 10
MASK32: Final = np.uint64(0xFFFFFFFF)

# Counter word 3 separates independent streams of one (seed, step).
DOMAIN_PERTURB: Final = 0
DOMAIN_BATCH: Final = 1

U32 = npt.NDArray[np.uint32]


def philox4x32(counters: npt.NDArray[np.uint32], key: tuple[int, int]) -> npt.NDArray[np.uint32]:
    """Philox4x32-10 on many counters at once.

    Args:
        counters: array of shape (n, 4), dtype uint32.
        key: two uint32 key words.

    Returns:
        Array of shape (n, 4), dtype uint32: the random words for each counter.
    """
    c = counters.astype(np.uint64)
    c0, c1, c2, c3 = c[:, 0], c[:, 1], c[:, 2], c[:, 3]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + PHILOX_W0) & 0xFFFFFFFF
            k1 = (k1 + PHILOX_W1) & 0xFFFFFFFF
        # 32x32 -> 64-bit products fit uint64 exactly.
        p0 = PHILOX_M0 * c0
        p1 = PHILOX_M1 * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & MASK32
        c0 = hi1 ^ c1 ^ np.uint64(k0)
        c1 = lo1
        c2 = hi0 ^ c3 ^ np.uint64(k1)
        c3 = lo0
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32)


def _seed_key(seed: int) -> tuple[int, int]:
    if not 0 <= seed < 2**64:
        raise ValueError(f"job seed must be in [0, 2**64), got {seed}")
    return seed & 0xFFFFFFFF, seed >> 32


def _check_u32(name: str, value: int) -> None:
    if not 0 <= value < 2**32:
        raise ValueError(f"{name} must be in [0, 2**32), got {value}")


def rademacher_bits(seed: int, step: int, k: int, size: int) -> npt.NDArray[np.bool_]:
    """The sign bits of perturbation k at a step: True means z = -1.

    Parameter i takes bit (i mod 32) of word ((i mod 128) div 32) of Philox block
    (i div 128), counter (block, step, k, DOMAIN_PERTURB).
    """
    bits: npt.NDArray[np.bool_] = rademacher_rows(seed, step, [k], size)[0]
    return bits


def rademacher_rows(seed: int, step: int, ks: Sequence[int], size: int) -> npt.NDArray[np.bool_]:
    """``rademacher_bits`` of several k from one Philox call: shape (len(ks), size)."""
    _check_u32("step", step)
    for k in ks:
        _check_u32("k", k)
    if not ks:
        return np.zeros((0, size), dtype=np.bool_)
    from qsched.zo import native  # lazily: the native module imports the engine's kernels

    if native.available():  # the same bits; numpy's ten rounds cost more per call than work
        return native.rademacher_rows(_seed_key(seed), step, np.asarray(ks, dtype=np.uint32), size)
    return _rademacher_rows_numpy(seed, step, ks, size)


def _rademacher_rows_numpy(
    seed: int, step: int, ks: Sequence[int], size: int
) -> npt.NDArray[np.bool_]:
    """``rademacher_rows`` in numpy: the specification the native kernel matches."""
    blocks = (size + 127) // 128
    counters = np.zeros((len(ks), blocks, 4), dtype=np.uint32)
    counters[:, :, 0] = np.arange(blocks, dtype=np.uint32)
    counters[:, :, 1] = step
    counters[:, :, 2] = np.asarray(ks, dtype=np.uint32).reshape(-1, 1)
    counters[:, :, 3] = DOMAIN_PERTURB
    words = philox4x32(counters.reshape(-1, 4), _seed_key(seed)).reshape(len(ks), -1)
    # Little-endian bit order inside each word: bit 0 of word 0 is parameter 0.
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :size].astype(np.bool_)


def rademacher(seed: int, step: int, k: int, size: int) -> npt.NDArray[np.int8]:
    """Perturbation z_k as int8 values in {-1, +1}: bit 0 gives +1, bit 1 gives -1."""
    bits = rademacher_bits(seed, step, k, size)
    return (1 - 2 * bits.astype(np.int8)).astype(np.int8)


def batch_indices(
    seed: int, step: int, batch_size: int, dataset_size: int
) -> npt.NDArray[np.int64]:
    """Indices of a step's minibatch, drawn with replacement.

    Sample j takes word (j mod 4) of block (j div 4), counter (block, step, 0,
    DOMAIN_BATCH), and maps it to ``(word * dataset_size) >> 32`` (exact integer math).
    """
    _check_u32("step", step)
    if dataset_size <= 0 or batch_size <= 0:
        raise ValueError("batch_size and dataset_size must be positive")
    blocks = (batch_size + 3) // 4
    counters = np.zeros((blocks, 4), dtype=np.uint32)
    counters[:, 0] = np.arange(blocks, dtype=np.uint32)
    counters[:, 1] = step
    counters[:, 3] = DOMAIN_BATCH
    words = philox4x32(counters, _seed_key(seed)).reshape(-1)[:batch_size]
    return ((words.astype(np.uint64) * np.uint64(dataset_size)) >> np.uint64(32)).astype(np.int64)
