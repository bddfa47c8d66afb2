"""INT8 kernels against a straightforward scalar rewrite of TFLite's reference formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qsched.zo import kernels_int8 as ki
from qsched.zo.graph import TensorQuant

IN = TensorQuant(scale=0.05, zero_point=-3)
OUT = TensorQuant(scale=0.1, zero_point=5)


# ---- scalar TFLite arithmetic, plain Python integers


def _c_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _srdhm(a: int, b: int) -> int:
    if a == b == -(2**31):
        return 2**31 - 1
    ab = a * b
    return _c_div(ab + ((1 << 30) if ab >= 0 else 1 - (1 << 30)), 1 << 31)


def _rdbpot(x: int, e: int) -> int:
    mask = (1 << e) - 1
    return (x >> e) + (1 if (x & mask) > (mask >> 1) + (x < 0) else 0)


def _mbqm(x: int, m: int, s: int, single: bool = False) -> int:
    if single:
        return (x * m + (1 << (30 - s))) >> (31 - s)
    return _rdbpot(_srdhm(x << max(s, 0), m), max(-s, 0))


def _qm(real: float) -> tuple[int, int]:
    mant, exp = math.frexp(real)
    q = math.floor(mant * 2**31 + 0.5)
    return (q // 2, exp + 1) if q == 2**31 else (q, exp)


def _c_round(v: float) -> int:
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def _act(activation: str, out: TensorQuant) -> tuple[int, int]:
    def q(f: float) -> int:
        return out.zero_point + _c_round(float(np.float32(f) / np.float32(out.scale)))

    lo = max(-128, q(0.0)) if activation in ("relu", "relu6") else -128
    hi = min(127, q(6.0)) if activation == "relu6" else 127
    return lo, hi


def _requant(
    acc: int, in_scale: float, w_scale: float, activation: str, single: bool = False
) -> int:
    real = float(np.float32(in_scale)) * float(np.float32(w_scale)) / float(np.float32(OUT.scale))
    m, s = _qm(real)
    lo, hi = _act(activation, OUT)
    return min(hi, max(lo, _mbqm(acc, m, s, single) + OUT.zero_point))


def _geometry(size: int, k: int, s: int, padding: str) -> tuple[int, int]:
    if padding == "valid":
        return -(-(size - k + 1) // s), 0
    out = -(-size // s)
    return out, max(0, (out - 1) * s + k - size) // 2


# ---- random operands


def _operands(
    rng: np.random.Generator, xshape: tuple[int, ...], wshape: tuple[int, ...], channels: int
):
    x = rng.integers(-128, 128, xshape).astype(np.int8)
    w = rng.integers(-127, 128, wshape).astype(np.int8)
    bias = rng.integers(-3000, 3000, channels).astype(np.int64)
    scales = rng.uniform(0.002, 0.02, channels).astype(np.float32)
    return x, w, bias, scales


@pytest.mark.parametrize(
    ("stride", "padding", "groups", "activation"),
    [
        ((1, 1), "same", 1, "none"),
        ((2, 2), "same", 1, "relu"),
        ((2, 1), "valid", 2, "relu6"),
        ((1, 2), "same", 3, "none"),
    ],
)
def test_conv2d_matches_scalar_reference(stride, padding, groups, activation) -> None:
    """ConvPerChannel: skipped padding taps, per-channel requantisation, clamps."""
    rng = np.random.default_rng([*stride, groups])
    n, h, w_, c, o, k = 2, 6, 5, 6, 6, 3
    x, w, bias, scales = _operands(rng, (n, h, w_, c), (o, k, k, c // groups), o)
    stage = ki.prepare_output_stage(IN, scales, OUT, activation)
    got = ki.conv2d(x[None], w[None], bias[None], stage, stride, padding, groups)[0]
    oh, top = _geometry(h, k, stride[0], padding)
    ow, left = _geometry(w_, k, stride[1], padding)
    ig, og = c // groups, o // groups
    assert got.shape == (n, oh, ow, o)
    for b in range(n):
        for oy in range(oh):
            for ox in range(ow):
                for oc in range(o):
                    acc, g = 0, oc // og
                    for ky in range(k):
                        for kx in range(k):
                            iy, ix = oy * stride[0] - top + ky, ox * stride[1] - left + kx
                            if 0 <= iy < h and 0 <= ix < w_:
                                for ic in range(ig):
                                    acc += int(w[oc, ky, kx, ic]) * (
                                        int(x[b, iy, ix, g * ig + ic]) - IN.zero_point
                                    )
                    want = _requant(acc + int(bias[oc]), IN.scale, scales[oc], activation)
                    assert got[b, oy, ox, oc] == want, (b, oy, ox, oc)


@pytest.mark.parametrize(
    ("stride", "padding", "mult"), [((1, 1), "same", 1), ((2, 2), "same", 2), ((2, 2), "valid", 1)]
)
def test_depthwise_conv2d_matches_scalar_reference(stride, padding, mult) -> None:
    """DepthwiseConvPerChannel with 1HWO weights and a depth multiplier."""
    rng = np.random.default_rng([*stride, mult])
    n, h, w_, c, k = 2, 6, 7, 3, 3
    o = c * mult
    x, w, bias, scales = _operands(rng, (n, h, w_, c), (1, k, k, o), o)
    stage = ki.prepare_output_stage(IN, scales, OUT, "relu6")
    got = ki.depthwise_conv2d(x[None], w[None], bias[None], stage, stride, padding)[0]
    oh, top = _geometry(h, k, stride[0], padding)
    ow, left = _geometry(w_, k, stride[1], padding)
    for b in range(n):
        for oy in range(oh):
            for ox in range(ow):
                for oc in range(o):
                    acc = int(bias[oc])
                    for ky in range(k):
                        for kx in range(k):
                            iy, ix = oy * stride[0] - top + ky, ox * stride[1] - left + kx
                            if 0 <= iy < h and 0 <= ix < w_:
                                acc += int(w[0, ky, kx, oc]) * (
                                    int(x[b, iy, ix, oc // mult]) - IN.zero_point
                                )
                    assert got[b, oy, ox, oc] == _requant(acc, IN.scale, scales[oc], "relu6")


@pytest.mark.parametrize("single", [False, True])
def test_dense_matches_scalar_reference(single: bool) -> None:
    """FullyConnected per channel, under both requantisation roundings."""
    rng = np.random.default_rng(5)
    x, w, bias, scales = _operands(rng, (4, 20), (7, 20), 7)
    stage = ki.prepare_output_stage(IN, scales, OUT, "relu")
    got = ki.dense(x[None], w[None], bias[None], stage, single_rounding=single)[0]
    for b in range(4):
        for oc in range(7):
            acc = sum(int(w[oc, i]) * (int(x[b, i]) - IN.zero_point) for i in range(20)) + int(
                bias[oc]
            )
            assert got[b, oc] == _requant(acc, IN.scale, scales[oc], "relu", single)


def test_add_matches_scalar_reference() -> None:
    """AddElementwise: left shift 20, input multipliers, output multiplier, clamp."""
    rng = np.random.default_rng(6)
    qa, qb, qo = TensorQuant(0.031, 7), TensorQuant(0.0125, -20), TensorQuant(0.04, 3)
    a = rng.integers(-128, 128, (3, 50)).astype(np.int8)
    b = rng.integers(-128, 128, (3, 50)).astype(np.int8)
    got = ki.add(a[None], b[None], ki.prepare_add(qa, qb, qo, "relu"))[0]
    twice = 2.0 * float(max(np.float32(qa.scale), np.float32(qb.scale)))
    m1, s1 = _qm(float(np.float32(qa.scale)) / twice)
    m2, s2 = _qm(float(np.float32(qb.scale)) / twice)
    mo, so = _qm(twice / float(np.float32(qo.scale) * np.float32(2**20)))
    lo, hi = _act("relu", qo)
    for i, j in np.ndindex(a.shape):
        v1 = _mbqm((int(a[i, j]) - qa.zero_point) << 20, m1, s1)
        v2 = _mbqm((int(b[i, j]) - qb.zero_point) << 20, m2, s2)
        assert got[i, j] == min(hi, max(lo, _mbqm(v1 + v2, mo, so) + qo.zero_point))


def test_relu_rescales_and_clamps() -> None:
    """Standalone RELU6: rescale by in/out, add the output zero point, clamp to [0, 6]."""
    x = np.arange(-128, 128, dtype=np.int8).reshape(1, 1, 256)
    out = TensorQuant(0.03, -100)
    got = ki.relu(x, ki.prepare_relu(IN, out, six=True))[0, 0]
    m, s = _qm(float(np.float32(IN.scale) / np.float32(out.scale)))
    lo, hi = _act("relu6", out)
    want = [
        min(hi, max(lo, _mbqm(int(v) - IN.zero_point, m, s) + out.zero_point)) for v in x.ravel()
    ]
    assert got.tolist() == want


def _pool_ref(x: np.ndarray, pool, stride, padding, avg: bool) -> np.ndarray:
    n, h, w, c = x.shape
    oh, top = _geometry(h, pool[0], stride[0], padding)
    ow, left = _geometry(w, pool[1], stride[1], padding)
    y = np.zeros((n, oh, ow, c), np.int64)
    for b, oy, ox, ch in np.ndindex(n, oh, ow, c):
        y0, x0 = oy * stride[0] - top, ox * stride[1] - left
        vals = [
            int(x[b, iy, ix, ch])
            for iy in range(max(y0, 0), min(y0 + pool[0], h))
            for ix in range(max(x0, 0), min(x0 + pool[1], w))
        ]
        if avg:
            acc, cnt = sum(vals), len(vals)
            y[b, oy, ox, ch] = (
                _c_div(acc + cnt // 2, cnt) if acc > 0 else _c_div(acc - cnt // 2, cnt)
            )
        else:
            y[b, oy, ox, ch] = max(vals)
    return y


@pytest.mark.parametrize(
    ("pool", "stride", "padding"),
    [((2, 2), (2, 2), "valid"), ((3, 3), (2, 2), "same"), ((3, 2), (1, 1), "same")],
)
def test_pools_match_scalar_reference(pool, stride, padding) -> None:
    """AVERAGE_POOL_2D rounds halves away from zero over in-bounds cells; MAX_POOL_2D."""
    rng = np.random.default_rng(list(pool) + list(stride))
    x = rng.integers(-128, 128, (2, 7, 6, 4)).astype(np.int8)
    np.testing.assert_array_equal(
        ki.avg_pool(x[None], pool, stride, padding)[0], _pool_ref(x, pool, stride, padding, True)
    )
    np.testing.assert_array_equal(
        ki.max_pool(x[None], pool, stride, padding)[0], _pool_ref(x, pool, stride, padding, False)
    )


def test_global_avg_pool_rounds_negative_halves_away() -> None:
    """Whole-plane average: -2.5 -> -3, 2.5 -> 3, -1 -> -1, -1.5 -> -2."""
    x = np.array([[-3, -2], [2, 3], [-1, -1], [-1, -2]], np.int8).T.reshape(1, 1, 1, 2, 4)
    assert ki.global_avg_pool(x)[0, 0].tolist() == [-3, 3, -1, -2]


@pytest.mark.parametrize("k", [513, 514, 3000])
def test_int_matmul_exact_at_extremes(k: int) -> None:
    """Float BLAS dot products equal int64 ones at the largest magnitudes, both precisions."""
    rng = np.random.default_rng(k)
    a = rng.choice(np.array([-255, 255, 254], np.int16), size=(1, 3, k))
    a[0, 0] = 255
    b = rng.choice(np.array([-128, 127], np.int16), size=(4, k, 5))
    b[:, :, 0] = -128
    got = ki.int_matmul(a, b)
    want = np.matmul(a.astype(np.int64), b.astype(np.int64))
    assert got.shape == (4, 3, 5)
    np.testing.assert_array_equal(got, want)
