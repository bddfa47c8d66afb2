"""int8 unary operators as 256-entry tables: LOGISTIC, HARD_SWISH, MUL by a constant.

An int8 operator of one int8 input is a function of 256 values, so it is computed once
per layer, at Prepare, for every input byte, and a forward pass is one lookup per
element. The tables equal TFLite's reference kernels bit for bit:

- LOGISTIC: TFLite's int8 kernel is itself a table (``PopulateLookupTable`` in
  ``activations.cc``): dequantise in float32, ``1 / (1 + exp(-x))`` in float32, divide
  by the output scale (a float32 multiplication by its reciprocal), round half away
  from zero. The output is fixed at scale 1/256, zero point -128 (TFLite refuses other
  parameters).
- HARD_SWISH: ``reference_ops::HardSwish`` on int16 fixed point (a high-resolution
  input, a "relu-ish" multiplier in [0, 1], one truncating high multiplication), each
  step here as it is there, for all 256 inputs.
- MUL by a one-element constant: TFLite's int8 MUL (``kernels_int8.mul``) with the
  constant as its second input, for all 256 inputs.

Tables are ``int8[256]`` indexed by ``x + 128``. The model blob carries them (SPEC
"Model blob"), so a C board looks values up and never needs ``expf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from qsched.zo import kernels_int8 as ki
from qsched.zo.fixedpoint import quantize_multiplier, round_half_away
from qsched.zo.graph import HardSwish, Logistic, MulConstant, TensorQuant

__all__ = [
    "LOGISTIC_OUTPUT",
    "TABLE_NODES",
    "TABLE_SIZE",
    "HardSwishParams",
    "TableNode",
    "hard_swish_params",
    "hard_swish_table",
    "logistic_table",
    "look_up",
    "mul_constant_table",
    "unary_table",
]

I8 = npt.NDArray[np.int8]

TABLE_SIZE: Final = 256
# TFLite's int8 LOGISTIC output: scale 1/256, zero point -128 ([0, 1) in 256 steps).
LOGISTIC_OUTPUT: Final = TensorQuant(scale=1.0 / 256.0, zero_point=-128)
_INT16_MIN, _INT16_MAX = -(2**15), 2**15 - 1


def look_up(x: I8, table: I8) -> I8:
    """Apply a 256-entry table to int8 values (any shape)."""
    return table[x.astype(np.int16) + 128]


TableNode = Logistic | HardSwish | MulConstant
TABLE_NODES: Final = (Logistic, HardSwish, MulConstant)


def unary_table(node: TableNode, inp: TensorQuant, out: TensorQuant) -> I8:
    """The table of a LOGISTIC, HARD_SWISH or MUL-by-constant node for its tensors'
    parameters."""
    if isinstance(node, Logistic):
        return logistic_table(inp, out)
    if isinstance(node, MulConstant):
        return mul_constant_table(node, inp, out)
    return hard_swish_table(inp, out)


def mul_constant_table(node: MulConstant, inp: TensorQuant, out: TensorQuant) -> I8:
    """TFLite's int8 MUL of every input byte by the node's constant."""
    constant = TensorQuant(node.constant_scale, node.constant_zero_point)
    params = ki.prepare_mul(inp, constant, out, node.activation)
    x = np.arange(-128, 128, dtype=np.int8)
    return ki.mul(x, np.full(TABLE_SIZE, node.constant, dtype=np.int8), params)


def logistic_table(inp: TensorQuant, out: TensorQuant) -> I8:
    """TFLite's int8 LOGISTIC table for these input and output parameters."""
    f32 = np.float32
    in_scale, inverse = f32(inp.scale), f32(1.0) / f32(out.scale)
    table = np.empty(TABLE_SIZE, dtype=np.int8)
    for i, v in enumerate(range(-128, 128)):
        x = in_scale * f32(v - int(inp.zero_point))
        # float32 exp, correctly rounded (what libm's expf returns for these arguments);
        # past float32's range it is infinite and the quotient 0, as there.
        with np.errstate(over="ignore"):
            e = f32(math.exp(min(-float(x), 100.0)))
        y = f32(1.0) / (f32(1.0) + e)
        rescaled = f32(round_half_away(f32(y * inverse)))
        q = int(rescaled + f32(int(out.zero_point)))
        table[i] = min(max(q, -128), 127)
    return table


@dataclass(frozen=True)
class HardSwishParams:
    """TFLite's ``HardSwishParams``: two int16 fixed-point multipliers and exponents."""

    input_zero_point: int
    output_zero_point: int
    reluish_multiplier: int
    reluish_exponent: int
    output_multiplier: int
    output_exponent: int


def _int16_multiplier(real: float) -> tuple[int, int]:
    """``QuantizeMultiplier`` then ``DownScaleInt32ToInt16Multiplier``."""
    m, e = (int(v) for v in quantize_multiplier(real))
    if m >= 2**31 - 1 - 2**15:
        return _INT16_MAX, e
    return (m + 2**15) >> 16, e


def hard_swish_params(inp: TensorQuant, out: TensorQuant) -> HardSwishParams:
    """``HardSwishPrepare``: the scale ratios in float32, widened to double.

    Raises:
        ValueError: an output multiplier of 1 or more (TFLite refuses it).
    """
    f32 = np.float32
    hires = f32(1.0 / 128.0) * f32(inp.scale)
    reluish = _int16_multiplier(float(hires / (f32(3.0) / f32(32768.0))))
    output = _int16_multiplier(float(hires / f32(out.scale)))
    if output[1] > 0:
        raise ValueError("HARD_SWISH: the output scale must exceed the input scale / 128")
    return HardSwishParams(int(inp.zero_point), int(out.zero_point), *reluish, *output)


def _wrap16(v: int) -> int:
    return ((v + 2**15) & 0xFFFF) - 2**15


def _saturate16(v: int) -> int:
    return min(max(v, _INT16_MIN), _INT16_MAX)


def _srdhm16(a: int, b: int) -> int:
    """gemmlowp's int16 SaturatingRoundingDoublingHighMul (nudge, truncating divide)."""
    if a == b == _INT16_MIN:
        return _INT16_MAX
    ab = a * b
    v = ab + ((1 << 14) if ab >= 0 else 1 - (1 << 14))
    return _wrap16(v // 2**15 if v >= 0 else -((-v) // 2**15))


def _sdhm16(a: int, b: int) -> int:
    """TFLite's SaturatingDoublingHighMul: like the above, truncating with no nudge."""
    if a == b == _INT16_MIN:
        return _INT16_MAX
    ab = a * b
    return _wrap16(ab // 2**15 if ab >= 0 else -((-ab) // 2**15))


def _rdbpot16(x: int, exponent: int) -> int:
    """gemmlowp's RoundingDivideByPOT on int16 (its mask is an int16 too)."""
    mask = _wrap16((1 << exponent) - 1)
    remainder = _wrap16(x & mask)
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return _wrap16((x >> exponent) + (1 if remainder > threshold else 0))


def _hard_swish_one(v: int, p: HardSwishParams) -> int:
    hires = _wrap16((v - p.input_zero_point) * 128)
    preshift_output = _srdhm16(hires, p.output_multiplier)
    reluish = hires
    if p.reluish_exponent > 0:
        reluish = _saturate16(reluish * 2 ** (p.reluish_exponent - 1))
    reluish = _srdhm16(reluish, p.reluish_multiplier)
    if p.reluish_exponent > 0:
        reluish = _saturate16(reluish * 2)
    if p.reluish_exponent < 0:
        reluish = _rdbpot16(reluish, -p.reluish_exponent)
    reluish = (reluish + (1 << 15)) >> 1  # [-1, 1] -> [0, 1]
    y = _rdbpot16(_sdhm16(reluish, preshift_output), -p.output_exponent)
    y = _wrap16(y + p.output_zero_point)
    return min(max(y, -128), 127)


def hard_swish_table(inp: TensorQuant, out: TensorQuant) -> I8:
    """TFLite's reference int8 HARD_SWISH for every input byte."""
    p = hard_swish_params(inp, out)
    return np.array([_hard_swish_one(v, p) for v in range(-128, 128)], dtype=np.int8)
