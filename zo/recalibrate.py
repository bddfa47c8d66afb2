"""Dynamic scale recalibration of INT8 weights (SPEC section "Scale recalibration").

Post-training quantisation gives each output channel the scale ``max|w| / 127``, so
every channel's largest weight starts at the int8 clamp: an update that would grow it
is lost, and the perturbations around it are one-sided. Training a fresh head grows
its weights several times over (in FP32 by 3-4x on the MLPerf Tiny ResNet-8 head), so
with fixed scales the INT8 model cannot follow.

With ``JobSpec.recalibrate_every = N``, after the update of every step ``t`` with
``(t + 1) mod N == 0``, each trainable channel with a weight at +-127 doubles its scale
(up to a limit): its weights halve toward zero and the half step an odd weight loses
goes to its FP16 buffer, which already holds fractions of a step, so ``(w + b) * s``
stays what it was up to one binary16 rounding of the buffer. The state records the
doublings as one exponent ``e_c`` per channel; everything a forward pass and an update
use follows from it and the blob, with integer arithmetic and powers of two only:

    scale   s_c * 2^e_c                       (float32, exact)
    shift   blob shift + e_c                  (the requantisation multiplier doubles)
    bias    round_half_away(b_c / 2^e_c)      (integer)
    gain    g(s_c * 2^e_c)                    (SPEC 4.2's weight-unit gain)

The statistic (a weight at the clamp) is the state's own, so every implementation
decides alike with no message; the exponents travel with the weights (``SetWeights``,
checkpoints) and the checksum covers them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from qsched.zo.update import INT8_WEIGHT_MAX, element_channels, to_fp16_saturating

__all__ = [
    "RECAL_EXP_MAX",
    "ChannelLayout",
    "doubling_counts",
    "effective_bias",
    "effective_scales",
    "exp_limits",
    "recalibrate",
    "recalibration_due",
]

# At most 2^8 times the calibrated scale: beyond, a channel's range is not the problem.
RECAL_EXP_MAX: Final = 8
# The largest requantisation shift a kernel takes (SPEC "Model blob": shifts in [-31, 30]).
_SHIFT_MAX: Final = 30

I8 = npt.NDArray[np.int8]
I64 = npt.NDArray[np.int64]
F16 = npt.NDArray[np.float16]
F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class ChannelLayout:
    """Which channel each element of the flat vector is in, and how far each may grow.

    ``element_channel[i]`` indexes the job's channels (every trainable tensor's output
    channels, in flat-vector order); ``exp_limit[c]`` is the largest exponent channel
    ``c`` may reach.
    """

    element_channel: I64
    exp_limit: I64

    @classmethod
    def of(
        cls, tensors: Sequence[tuple[int, int, bool]], multipliers: I64, shifts: I64
    ) -> ChannelLayout:
        """The layout of tensors given as ``(elements, channels, channel_minor)``
        (``update.element_channels``); ``multipliers`` and ``shifts`` are the blob's
        requantisation parameters of every channel, in the same order."""
        return cls(element_channels(tensors), exp_limits(multipliers, shifts))

    @property
    def channels(self) -> int:
        """The number of channels (and of exponents in the state)."""
        return int(self.exp_limit.size)


def exp_limits(multipliers: npt.ArrayLike, shifts: npt.ArrayLike) -> I64:
    """Per channel, ``min(RECAL_EXP_MAX, 30 - shift)``, floored at 0; 0 for a zero
    multiplier (an output flushed to zero has no range to widen)."""
    mult = np.asarray(multipliers, dtype=np.int64)
    shift = np.asarray(shifts, dtype=np.int64)
    limit = np.clip(_SHIFT_MAX - shift, 0, RECAL_EXP_MAX)
    return np.where(mult == 0, 0, limit).astype(np.int64)


def recalibration_due(step: int, every: int) -> bool:
    """Whether the update of ``step`` is followed by a recalibration."""
    return every > 0 and (step + 1) % every == 0


def recalibrate(weights: I8, buffer: F16, exps: I8, layout: ChannelLayout) -> tuple[I8, F16, I8]:
    """One recalibration of the state (new arrays; the inputs are not modified).

    A channel grows when one of its weights is at +-127 and its exponent is below its
    limit. Each weight ``w`` of a growing channel becomes ``t = w / 2`` toward zero and
    its buffer value ``b`` becomes ``f16(f32(b) * 0.5 + (w - 2 t) * 0.5)``: float32 with
    no rounding, then one rounding to binary16 (nearest even, saturating).
    """
    wide = weights.astype(np.int64)
    peak = np.zeros(layout.channels, dtype=np.int64)
    np.maximum.at(peak, layout.element_channel, np.abs(wide))
    old = exps.astype(np.int64)
    grows = (peak >= INT8_WEIGHT_MAX) & (old < layout.exp_limit)
    moving = grows[layout.element_channel]
    halves = np.sign(wide) * (np.abs(wide) >> 1)
    carried = ((wide - 2 * halves).astype(np.float32) * np.float32(0.5)).astype(np.float32)
    rebuffered = buffer.astype(np.float32) * np.float32(0.5) + carried
    new_w = np.where(moving, halves, wide).astype(np.int8)
    new_b = np.where(moving, to_fp16_saturating(rebuffered), buffer).astype(np.float16)
    return new_w, new_b, (old + grows).astype(np.int8)


def effective_scales(scales: npt.ArrayLike, exps: npt.ArrayLike) -> F32:
    """``s_c * 2^e_c`` in float32 (exact for every normal scale)."""
    s = np.asarray(scales, dtype=np.float32)
    out: F32 = np.ldexp(s, np.asarray(exps, dtype=np.int32)).astype(np.float32)
    return out


def effective_bias(bias: npt.ArrayLike, exps: npt.ArrayLike) -> npt.NDArray[np.int32]:
    """``round_half_away(b_c / 2^e_c)`` in integers: ``sign(b) * ((|b| + h) >> e)``
    with ``h = 2^(e-1)`` (0 when ``e = 0``)."""
    b = np.asarray(bias, dtype=np.int64)
    e = np.asarray(exps, dtype=np.int64)
    half = np.where(e > 0, np.left_shift(1, np.maximum(e - 1, 0)), 0)
    out: npt.NDArray[np.int32] = (np.sign(b) * ((np.abs(b) + half) >> e)).astype(np.int32)
    return out


def doubling_counts(exps: npt.ArrayLike) -> list[int]:
    """How many channels have exponent 0, 1, 2, ...: how often recalibration doubled
    their scales (the last entry is the largest exponent reached)."""
    return [int(n) for n in np.bincount(np.asarray(exps, dtype=np.int64).ravel())]
