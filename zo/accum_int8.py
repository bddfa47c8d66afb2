"""INT8 accumulation buffer with periodic power-of-two rescaling (INT8 mode option).

The seed paper keeps the update remainder of every int8 weight in an FP16 buffer and
names an INT8 buffer with periodic rescaling as future work; this is that option
(``JobSpec.accumulator == "int8"``), specified in ``protocol/SPEC.md`` section "INT8
accumulation buffer". Each trainable tensor t has a shift ``sigma_t`` in [7, 15]: a
buffer value ``b`` means ``b * 2**-sigma_t`` int8 weight steps. A step:

    delta_i = sum_k c_k z_ki  (* gain_i)           (float32, as update.accumulate_delta)
    r       = rint(clamp(delta_i * 2**sigma, -2**24, 2**24))     nearest, ties to even
    acc     = b_i + r                              (int32)
    m       = sign(acc) * (|acc| >> sigma)         whole steps, toward zero
    w_i     = clamp(w_i + m, -127, 127)
    b_i     = clamp(acc - m * 2**sigma, -127, 127)

At sigma = 7 the remainder always fits (|acc - m 2**7| < 128); a larger sigma gives a
finer resolution for small updates but can saturate. Every ``RESCALE_EVERY`` steps (after
the update of step t with (t + 1) mod R == 0), per tensor: if more than 1/64 of its
buffer sits at +-127 and sigma > 7, sigma -= 1 and b = sign(b) * ((|b| + 1) >> 1);
otherwise, if every |b| < 64 and sigma < 15, sigma += 1 and b = 2 b (exact).

The state is one int8 array: the n buffer values, then one sigma per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from qsched.zo.update import INT8_WEIGHT_MAX, accumulate_delta

__all__ = [
    "INITIAL_SHIFT",
    "RESCALE_EVERY",
    "SATURATION_DIVISOR",
    "SHIFT_MAX",
    "SHIFT_MIN",
    "apply",
    "initial_state",
    "rescale",
    "split_state",
]

SHIFT_MIN: Final = 7  # the remainder of a whole-step move always fits int8
SHIFT_MAX: Final = 15
INITIAL_SHIFT: Final = 7
RESCALE_EVERY: Final = 16
SATURATION_DIVISOR: Final = 64  # coarsen when more than size / 64 values sit at the rails
_BUFFER_MAX: Final = 127
_ROUND_LIMIT: Final = np.float32(2.0**24)

I8 = npt.NDArray[np.int8]


def initial_state(tensor_sizes: Sequence[int]) -> I8:
    """Zero buffer and sigma = INITIAL_SHIFT for every tensor.

    Args:
        tensor_sizes: element counts of the flat vector's tensors, in order.

    Returns:
        int8 state of length sum(sizes) + len(sizes).
    """
    n = int(sum(tensor_sizes))
    state = np.zeros(n + len(tensor_sizes), dtype=np.int8)
    state[n:] = INITIAL_SHIFT
    return state


def split_state(state: I8, tensor_sizes: Sequence[int]) -> tuple[I8, I8]:
    """(buffer, shifts) views of a state; checks its length and shift range."""
    n = int(sum(tensor_sizes))
    if state.dtype != np.int8 or state.shape != (n + len(tensor_sizes),):
        raise ValueError(f"INT8 accumulator state must be int8 of length {n + len(tensor_sizes)}")
    shifts = state[n:]
    if np.any((shifts < SHIFT_MIN) | (shifts > SHIFT_MAX)):
        raise ValueError(f"INT8 accumulator shifts must be in [{SHIFT_MIN}, {SHIFT_MAX}]")
    return state[:n], shifts


def _per_element(shifts: I8, tensor_sizes: Sequence[int]) -> npt.NDArray[np.int64]:
    return np.repeat(shifts.astype(np.int64), np.asarray(tensor_sizes, dtype=np.int64))


def apply(
    weights: I8,
    state: I8,
    tensor_sizes: Sequence[int],
    seed: int,
    step: int,
    pairs: Sequence[tuple[int, float]],
    gain: npt.NDArray[np.float32] | None = None,
) -> tuple[I8, I8]:
    """One update with the INT8 buffer (module docstring); returns new (weights, state).

    Args:
        weights: the int8 flat trainable vector.
        state: the accumulator state (``initial_state`` layout).
        tensor_sizes: element counts of the vector's tensors.
        seed: job seed.
        step: the step the pairs belong to.
        pairs: (k, c_k) float32 coefficients.
        gain: per-element channel gains (weight-unit learning rate), else none.

    Returns:
        The new weights and state (new arrays).
    """
    buffer, shifts = split_state(state, tensor_sizes)
    if weights.shape != buffer.shape:
        raise ValueError("weights and INT8 accumulator differ in size")
    delta = accumulate_delta(seed, step, pairs, weights.size, gain)
    sigma = _per_element(shifts, tensor_sizes)
    # Scaling by a power of two is exact in float32 (short of overflow, which the clamp
    # absorbs); the clamp keeps rint's result exact in int32.
    scaled = delta * np.exp2(sigma).astype(np.float32)
    r = np.rint(np.clip(scaled, -_ROUND_LIMIT, _ROUND_LIMIT)).astype(np.int64)
    acc = buffer.astype(np.int64) + r
    moves = np.sign(acc) * (np.abs(acc) >> sigma)
    new_weights = np.clip(
        weights.astype(np.int64) + moves, -INT8_WEIGHT_MAX, INT8_WEIGHT_MAX
    ).astype(np.int8)
    remainder = np.clip(acc - (moves << sigma), -_BUFFER_MAX, _BUFFER_MAX).astype(np.int8)
    new_state = np.concatenate([remainder, shifts]).astype(np.int8)
    if (step + 1) % RESCALE_EVERY == 0:
        new_state = rescale(new_state, tensor_sizes)
    return new_weights, new_state


def rescale(state: I8, tensor_sizes: Sequence[int]) -> I8:
    """The periodic rescaling of every tensor's buffer (module docstring).

    Args:
        state: accumulator state.
        tensor_sizes: element counts of the tensors.

    Returns:
        A new state.
    """
    buffer, shifts = split_state(state, tensor_sizes)
    out_buffer = buffer.astype(np.int64)
    out_shifts = shifts.copy()
    start = 0
    for t, size in enumerate(tensor_sizes):
        part = out_buffer[start : start + size]
        saturated = int(np.count_nonzero(np.abs(part) == _BUFFER_MAX))
        if saturated * SATURATION_DIVISOR > size and out_shifts[t] > SHIFT_MIN:
            out_shifts[t] -= 1
            part[:] = np.sign(part) * ((np.abs(part) + 1) >> 1)
        elif size and int(np.abs(part).max()) < 64 and out_shifts[t] < SHIFT_MAX:
            out_shifts[t] += 1
            part[:] = part * 2
        start += size
    return np.concatenate([out_buffer.astype(np.int8), out_shifts]).astype(np.int8)
