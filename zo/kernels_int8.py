"""INT8 kernels with TFLite's reference integer semantics, on stacked tensors.

Each function mirrors one reference kernel (``reference/integer_ops/conv.h``,
``depthwise_conv.h``, ``fully_connected.h``, ``add.h``, ``pooling.h``) and is split as
TFLite splits it: ``prepare_*`` does the float math once (multipliers, activation
ranges), the kernel itself is integer-only. Tensors carry a leading set axis ``S`` as in
``kernels_fp32`` (1, or P perturbed copies).

Exact integer dot products through floating-point BLAS. A convolution or dense output
is ``sum_k w_k * (x_k - zp) + bias`` with ``|w_k| <= 128`` and ``|x_k - zp| <= 255``, so
every product is an integer of magnitude at most ``2^15`` and every partial sum of K
products is at most ``K * 2^15`` in magnitude. A binary floating-point format with a
p-bit significand represents every integer up to ``2^p`` exactly, and a sum of exactly
representable integers whose result is representable is computed exactly, whatever
the summation order or blocking BLAS uses (fused multiply-adds included). Hence:
float64 (p = 53) is exact for any ``K < 2^38``; float32 (p = 24) is exact while
``K * 255 * 128 < 2^24``, i.e. ``K <= 513`` — we use float32 only then. The same bound
``K * 2^15 < 2^31`` (K < 65536) keeps TFLite's own int32 accumulator from overflowing;
every model here is far below it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qsched.zo.fixedpoint import (
    multiply_by_quantized_multiplier,
    quantize_multiplier,
    round_half_away,
    wrap_int32,
)
from qsched.zo.graph import Activation, Padding, TensorQuant
from qsched.zo.kernels_fp32 import extract_patches, padded_windows, window_tap

__all__ = [
    "AddParams",
    "MeanParams",
    "MulParams",
    "OutputStage",
    "activation_range",
    "add",
    "avg_pool",
    "conv2d",
    "dense",
    "depthwise_conv2d",
    "global_avg_pool",
    "int_matmul",
    "max_pool",
    "mean",
    "mul",
    "pad",
    "patches",
    "prepare_add",
    "prepare_mean",
    "prepare_mul",
    "prepare_output_stage",
    "prepare_relu",
    "relu",
]

I8 = npt.NDArray[np.int8]
I64 = npt.NDArray[np.int64]
Array = npt.NDArray[Any]
INT8_MIN: Final = -128
INT8_MAX: Final = 127
# Largest |w * (x - zp)| for int8 w and x: 128 * 255 < 2^15.
_MAX_PRODUCT: Final = 128 * 255
_F32_EXACT: Final = 2**24


def activation_range(activation: Activation, out: TensorQuant) -> tuple[int, int]:
    """TFLite ``CalculateActivationRangeQuantized`` for int8 (float32 division, C round)."""

    def q(value: float) -> int:
        scaled = np.float32(value) / np.float32(out.scale)
        return int(out.zero_point) + int(round_half_away(scaled))

    if activation == "relu":
        return max(INT8_MIN, q(0.0)), INT8_MAX
    if activation == "relu6":
        return max(INT8_MIN, q(0.0)), min(INT8_MAX, q(6.0))
    return INT8_MIN, INT8_MAX


@dataclass(frozen=True)
class OutputStage:
    """What a conv / dense output needs after the dot product: requantise, shift, clamp."""

    multiplier: I64  # per output channel
    shift: I64
    input_zero_point: int
    output_zero_point: int
    act_min: int
    act_max: int

    def apply(self, acc: I64, single_rounding: bool = False) -> I8:
        """int32 accumulators (bias included, channels last) -> clamped int8."""
        rows, mult, shift = _tile_channels(acc, self.multiplier, self.shift)
        y: I64 = multiply_by_quantized_multiplier(
            rows, mult, shift, single_rounding=single_rounding
        )
        y += self.output_zero_point
        np.clip(y, self.act_min, self.act_max, out=y)
        return y.astype(np.int8).reshape(acc.shape)


_TILE_WIDTH: Final = 2048


def _tile_channels(acc: I64, mult: I64, shift: I64) -> tuple[I64, I64, I64]:
    """View ``(..., C)`` as wide rows of whole channel groups, with tiled parameters.

    Broadcasting a short per-channel vector makes numpy loop over C elements at a
    time; rows of k*C elements (k a power of two dividing the row count) run at full
    vector speed. Same values, same order of operations per element.
    """
    c = mult.shape[-1] if mult.ndim else 1
    if mult.ndim != 1 or acc.shape[-1] != c or acc.size == 0:
        return acc, mult, shift
    rows = acc.size // c
    k = 1
    while k * 2 * c <= _TILE_WIDTH and rows % (k * 2) == 0:
        k *= 2
    wide = np.ascontiguousarray(acc).reshape(rows // k, k * c)
    return wide, np.tile(mult, k), np.tile(shift, k)


def prepare_output_stage(
    inp: TensorQuant, weight_scales: npt.ArrayLike, out: TensorQuant, activation: Activation
) -> OutputStage:
    """TFLite ``PopulateConvolutionQuantizationParams`` (per-channel int8).

    The effective scale is computed as the reference does: the float32 scales widened to
    double, ``in * w[c] / out``.
    """
    ws = np.asarray(weight_scales, dtype=np.float32).astype(np.float64)
    effective = float(np.float32(inp.scale)) * ws / float(np.float32(out.scale))
    mult, shift = quantize_multiplier(effective)
    lo, hi = activation_range(activation, out)
    return OutputStage(mult, shift, int(inp.zero_point), int(out.zero_point), lo, hi)


def _exact_dtype(k: int) -> type[np.floating]:
    """float32 while K products cannot leave its exact-integer range, else float64."""
    return np.float32 if k * _MAX_PRODUCT < _F32_EXACT else np.float64


def int_matmul(a: Array, b: Array) -> I64:
    """Exact integer matmul ``a @ b`` of small integers (|a| <= 255, |b| <= 128) via BLAS.

    Shared left operands (``a`` with set axis 1 against ``b`` with P sets) become one
    matmul against all P weight sets side by side.
    """
    k = a.shape[-1]
    ft = _exact_dtype(k)
    af = a.astype(ft, copy=False)
    # Weights are small next to activations: a contiguous copy keeps BLAS on its fast path.
    bf = np.ascontiguousarray(b, dtype=ft)
    if af.shape[0] == 1 and bf.shape[0] > 1 and af.ndim == 3:
        p, _, o = bf.shape
        wide = np.matmul(af[0], bf.transpose(1, 0, 2).reshape(k, p * o))
        out = wide.reshape(-1, p, o).transpose(1, 0, 2)
    elif bf.shape[0] == 1 and bf.ndim == 3:
        s, m, _ = af.shape
        out = np.matmul(af.reshape(s * m, k), bf[0]).reshape(s, m, -1)
    else:
        out = np.matmul(af, bf)
    exact: I64 = out.astype(np.int64)  # exact integers already: no rounding needed
    return exact


def _centred(x: I8, zero_point: int, dtype: type[np.floating]) -> npt.NDArray[np.floating]:
    """x - zp (TFLite's ``input_val + input_offset``), exact in the float type given."""
    out: npt.NDArray[np.floating] = x.astype(dtype)
    out -= zero_point
    return out


def conv2d(
    x: I8,
    weight: I8,
    bias: I64,
    stage: OutputStage,
    stride: tuple[int, int],
    padding: Padding,
    groups: int = 1,
    single_rounding: bool = False,
    cols: npt.NDArray[np.floating] | None = None,
) -> I8:
    """Per-channel int8 convolution (``reference_integer_ops::ConvPerChannel``).

    Args:
        x: ``(S, N, H, W, C)`` int8.
        weight: ``(S', O, kh, kw, C // groups)`` int8.
        bias: ``(S', O)`` int32 values.
        stage: from ``prepare_output_stage``.
        cols: ``patches(x, ...)`` computed once and reused across calls.

    Returns:
        ``(max(S, S'), N, OH, OW, O)`` int8.
    """
    _, o, kh, kw, ig = weight.shape
    if cols is None:
        cols = patches(x, (kh, kw), stride, padding, stage.input_zero_point, ig)
    s, n, oh, ow, k = cols.shape
    m = n * oh * ow
    if groups == 1:
        w = weight.reshape(weight.shape[0], o, k)
        acc = int_matmul(cols.reshape(s, m, k), np.swapaxes(w, 1, 2))
    else:
        og = o // groups
        cg = (
            cols.reshape(s, m, kh * kw, groups, ig)
            .transpose(0, 3, 1, 2, 4)
            .reshape(s, groups, m, kh * kw * ig)
        )
        wg = weight.reshape(weight.shape[0], groups, og, kh * kw * ig)
        wf = np.swapaxes(wg, 2, 3).astype(cg.dtype)
        acc4 = np.matmul(cg, wf).astype(np.int64)
        acc = acc4.transpose(0, 2, 1, 3).reshape(-1, m, o)
    acc += bias[:, None, :]
    return stage.apply(acc, single_rounding).reshape(-1, n, oh, ow, o)


def patches(
    x: I8,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: Padding,
    zero_point: int,
    in_per_group: int | None = None,
) -> npt.NDArray[np.floating]:
    """Centred im2col in the exact float type for its dot-product length.

    Padding cells contribute 0, as the reference kernel skips them.
    """
    k = kernel[0] * kernel[1] * (in_per_group or x.shape[-1])
    xc = _centred(x, zero_point, _exact_dtype(k))
    cols: npt.NDArray[np.floating] = extract_patches(xc, kernel, stride, padding, 0)
    return cols


def depthwise_conv2d(
    x: I8,
    weight: I8,
    bias: I64,
    stage: OutputStage,
    stride: tuple[int, int],
    padding: Padding,
    single_rounding: bool = False,
) -> I8:
    """Per-channel int8 depthwise convolution (``DepthwiseConvPerChannel``), 1HWO weights."""
    _, _, kh, kw, o = weight.shape
    ft = _exact_dtype(kh * kw)
    xc = _centred(x, stage.input_zero_point, ft)
    if o != xc.shape[-1]:
        xc = np.repeat(xc, o // xc.shape[-1], axis=-1)
    xp, oh, ow = padded_windows(xc, (kh, kw), stride, padding, 0)
    wt = weight[:, 0].astype(ft)[:, None, None, None]
    acc = window_tap(xp, 0, 0, oh, ow, stride) * wt[..., 0, 0, :]
    term = np.empty_like(acc)
    for i in range(kh):
        for j in range(kw):
            if i or j:
                np.multiply(window_tap(xp, i, j, oh, ow, stride), wt[..., i, j, :], out=term)
                acc += term
    acc64 = acc.astype(np.int64)
    acc64 += bias[:, None, None, None, :]
    return stage.apply(acc64, single_rounding)


def dense(x: I8, weight: I8, bias: I64, stage: OutputStage, single_rounding: bool = False) -> I8:
    """Per-channel int8 fully connected: ``(S, N, F) x (S', O, F) -> (S, N, O)``."""
    xc = _centred(x, stage.input_zero_point, _exact_dtype(x.shape[-1]))
    acc = int_matmul(xc, np.swapaxes(weight, 1, 2))
    acc += bias[:, None, :]
    return stage.apply(acc, single_rounding)


@dataclass(frozen=True)
class AddParams:
    """TFLite int8 ADD parameters (``add.cc`` Prepare)."""

    left_shift: int
    in1_zero_point: int
    in1_multiplier: int
    in1_shift: int
    in2_zero_point: int
    in2_multiplier: int
    in2_shift: int
    out_zero_point: int
    out_multiplier: int
    out_shift: int
    act_min: int
    act_max: int


def prepare_add(
    a: TensorQuant, b: TensorQuant, out: TensorQuant, activation: Activation
) -> AddParams:
    """Input and output multipliers: inputs rescaled to twice the larger input scale."""
    left_shift = 20
    sa, sb, so = np.float32(a.scale), np.float32(b.scale), np.float32(out.scale)
    twice_max = 2.0 * float(max(sa, sb))  # exact: a float32 doubled
    m1, s1 = quantize_multiplier(float(sa) / twice_max)
    m2, s2 = quantize_multiplier(float(sb) / twice_max)
    mo, so_ = quantize_multiplier(twice_max / float(np.float32((1 << left_shift) * so)))
    lo, hi = activation_range(activation, out)
    return AddParams(
        left_shift,
        int(a.zero_point),
        int(m1),
        int(s1),
        int(b.zero_point),
        int(m2),
        int(s2),
        int(out.zero_point),
        int(mo),
        int(so_),
        lo,
        hi,
    )


def add(a: I8, b: I8, p: AddParams, single_rounding: bool = False) -> I8:
    """Element-wise int8 add (``reference_integer_ops::AddElementwise``)."""
    sr = single_rounding
    x1 = (a.astype(np.int64) - p.in1_zero_point) << p.left_shift
    x2 = (b.astype(np.int64) - p.in2_zero_point) << p.left_shift
    y1 = multiply_by_quantized_multiplier(x1, p.in1_multiplier, p.in1_shift, single_rounding=sr)
    y2 = multiply_by_quantized_multiplier(x2, p.in2_multiplier, p.in2_shift, single_rounding=sr)
    raw: I64 = multiply_by_quantized_multiplier(
        y1 + y2, p.out_multiplier, p.out_shift, single_rounding=sr
    )
    raw += p.out_zero_point
    return np.clip(raw, p.act_min, p.act_max).astype(np.int8)


def prepare_relu(inp: TensorQuant, out: TensorQuant, six: bool) -> OutputStage:
    """Standalone RELU / RELU6 (``activations.cc``): rescale by in/out, then clamp.

    The multiplier is ``float(in_scale / out_scale)`` (a float32 quotient widened).
    """
    ratio = float(np.float32(inp.scale) / np.float32(out.scale))
    mult, shift = quantize_multiplier(np.array([ratio]))
    lo, hi = activation_range("relu6" if six else "relu", out)
    return OutputStage(mult, shift, int(inp.zero_point), int(out.zero_point), lo, hi)


def relu(x: I8, stage: OutputStage, single_rounding: bool = False) -> I8:
    """``out_zp + MultiplyByQuantizedMultiplier(x - in_zp)``, clamped to the ReLU range."""
    return stage.apply(x.astype(np.int64) - stage.input_zero_point, single_rounding)


def _round_div(total: I64, count: I64) -> I64:
    """The pooling division: halves away from zero, as ``(acc +- count/2) / count`` in C."""
    half = count // 2
    num = np.where(total > 0, total + half, total - half)
    # C division truncates toward zero.
    q = np.abs(num) // count
    return np.where(num < 0, -q, q)


def avg_pool(
    x: I8,
    pool: tuple[int, int],
    stride: tuple[int, int],
    padding: Padding,
    act: tuple[int, int] = (INT8_MIN, INT8_MAX),
) -> I8:
    """int8 AVERAGE_POOL_2D: integer sum of the in-bounds window, rounded division.

    Input and output share scale and zero point (TFLite requires it), so no rescale.
    """
    xp, oh, ow = padded_windows(x.astype(np.int64), pool, stride, padding, 0)
    ones = padded_windows(np.ones((1, 1, *x.shape[2:4], 1), np.int64), pool, stride, padding, 0)[0]
    total = np.zeros((*xp.shape[:2], oh, ow, xp.shape[-1]), np.int64)
    count = np.zeros((1, 1, oh, ow, 1), np.int64)
    for i in range(pool[0]):
        for j in range(pool[1]):
            total += window_tap(xp, i, j, oh, ow, stride)
            count += window_tap(ones, i, j, oh, ow, stride)
    return np.clip(_round_div(total, count), act[0], act[1]).astype(np.int8)


def max_pool(x: I8, pool: tuple[int, int], stride: tuple[int, int], padding: Padding) -> I8:
    """int8 MAX_POOL_2D over the in-bounds window."""
    xp, oh, ow = padded_windows(x.astype(np.int16), pool, stride, padding, INT8_MIN - 1)
    out: Array | None = None
    for i in range(pool[0]):
        for j in range(pool[1]):
            t = window_tap(xp, i, j, oh, ow, stride)
            out = t if out is None else np.maximum(out, t)
    assert out is not None
    return out.astype(np.int8)


def global_avg_pool(x: I8) -> I8:
    """AVERAGE_POOL_2D over the whole plane: ``(S, N, H, W, C) -> (S, N, C)``."""
    s, n, h, w, c = x.shape
    total = x.reshape(s, n, h * w, c).astype(np.int64).sum(axis=2)
    count = np.full((1, 1, 1), h * w, np.int64)
    return np.clip(_round_div(total, count), INT8_MIN, INT8_MAX).astype(np.int8)


@dataclass(frozen=True)
class MeanParams:
    """TFLite MEAN's requantisation over ``count`` elements (``reference_ops::
    QuantizedMeanOrSum``): the 1/count factor is folded into the multiplier."""

    multiplier: int
    shift: int
    input_zero_point: int
    output_zero_point: int
    count: int


def prepare_mean(inp: TensorQuant, out: TensorQuant, count: int) -> MeanParams:
    """Prepare and the count-dependent part of Eval, as the reference kernel does them.

    ``QuantizeMultiplier(in_scale / out_scale)`` (in double) gives (M, e); then with
    ``k = min(floor(log2 count), 32, 31 + e)`` the multiplier becomes ``(M << k) // count``
    (truncating, M >= 0) and the shift ``e - k``: exact to 31 bits for any count.
    """
    m, e = (int(v) for v in quantize_multiplier(float(inp.scale) / float(out.scale)))
    k = min(count.bit_length() - 1, 32, 31 + e)
    return MeanParams((m << k) // count, e - k, inp.zero_point, out.zero_point, count)


def mean(x: I8, p: MeanParams, keep_dims: bool) -> I8:
    """int8 MEAN over height and width: ``(S, N, H, W, C) -> (S, N, C)`` or ``(S, N, 1, 1, C)``.

    The int32 sum of the plane less ``in_zp * count`` (at most 2^7 * count in size, so
    no wrap below 2^24 elements), requantised with double rounding, plus the output zero
    point, clamped to int8.
    """
    s, n, h, w, c = x.shape
    total = x.reshape(s, n, h * w, c).astype(np.int64).sum(axis=2)
    centred = wrap_int32(total - p.input_zero_point * p.count)  # C's int32 arithmetic
    y = multiply_by_quantized_multiplier(centred, p.multiplier, p.shift) + p.output_zero_point
    out = np.clip(y, INT8_MIN, INT8_MAX).astype(np.int8)
    return out.reshape(s, n, 1, 1, c) if keep_dims else out


def pad(x: I8, pads: tuple[tuple[int, int], tuple[int, int]], value: int) -> I8:
    """int8 PAD of height and width with ``value`` (the output zero point); the input's
    bytes are copied unchanged, as TFLite does."""
    (top, bottom), (left, right) = pads
    widths = ((0, 0), (0, 0), (top, bottom), (left, right), (0, 0))
    return np.pad(x, widths, constant_values=np.int8(value))


def prepare_mul(
    a: TensorQuant, b: TensorQuant, out: TensorQuant, activation: Activation
) -> MulParams:
    """``QuantizeMultiplier(s_a * s_b / s_out)`` in double (TFLite's Prepare for MUL)."""
    real = float(np.float32(a.scale)) * float(np.float32(b.scale)) / float(np.float32(out.scale))
    m, e = (int(v) for v in quantize_multiplier(real))
    lo, hi = activation_range(activation, out)
    return MulParams(int(a.zero_point), int(b.zero_point), int(out.zero_point), m, e, lo, hi)


@dataclass(frozen=True)
class MulParams:
    """TFLite MUL's requantisation of the product of two centred int8 inputs."""

    a_zero_point: int
    b_zero_point: int
    out_zero_point: int
    multiplier: int
    shift: int
    act_min: int
    act_max: int


def mul(a: I8, b: I8, p: MulParams, single_rounding: bool = False) -> I8:
    """int8 MUL (``reference_integer_ops::MulElementwise``, broadcast as numpy does):
    ``out_zp + MultiplyByQuantizedMultiplier((a - zp_a) * (b - zp_b))``, clamped; the
    product of two centred int8 values is below 2^16, so int32 holds it."""
    product = (a.astype(np.int64) - p.a_zero_point) * (b.astype(np.int64) - p.b_zero_point)
    raw = multiply_by_quantized_multiplier(
        product, p.multiplier, p.shift, single_rounding=single_rounding
    )
    return np.clip(raw + p.out_zero_point, p.act_min, p.act_max).astype(np.int8)
