"""FP32 kernels against plain loop implementations on small random cases."""

from __future__ import annotations

import numpy as np
import pytest

from qsched.zo import kernels_fp32 as kf


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.normal(size=shape).astype(np.float32)


def _geometry(size: int, k: int, s: int, padding: str) -> tuple[int, int]:
    """(output size, padding before) by TFLite's rules, written out independently."""
    if padding == "valid":
        return -(-(size - k + 1) // s), 0
    out = -(-size // s)
    return out, max(0, (out - 1) * s + k - size) // 2


def _loop_conv(x, w, b, stride, padding, groups):
    n, h, wd, _ = x.shape
    o, kh, kw, ig = w.shape
    oh, top = _geometry(h, kh, stride[0], padding)
    ow, left = _geometry(wd, kw, stride[1], padding)
    og = o // groups
    y = np.zeros((n, oh, ow, o), np.float64)
    for bi in range(n):
        for oy in range(oh):
            for ox in range(ow):
                for oc in range(o):
                    g = oc // og
                    acc = float(b[oc])
                    for ky in range(kh):
                        for kx in range(kw):
                            iy, ix = oy * stride[0] - top + ky, ox * stride[1] - left + kx
                            if 0 <= iy < h and 0 <= ix < wd:
                                acc += float(
                                    np.dot(x[bi, iy, ix, g * ig : (g + 1) * ig], w[oc, ky, kx])
                                )
                    y[bi, oy, ox, oc] = acc
    return y


def _loop_depthwise(x, w, b, stride, padding):
    n, h, wd, c = x.shape
    _, kh, kw, o = w.shape
    mult = o // c
    oh, top = _geometry(h, kh, stride[0], padding)
    ow, left = _geometry(wd, kw, stride[1], padding)
    y = np.zeros((n, oh, ow, o), np.float64)
    for bi in range(n):
        for oy in range(oh):
            for ox in range(ow):
                for oc in range(o):
                    acc = float(b[oc])
                    for ky in range(kh):
                        for kx in range(kw):
                            iy, ix = oy * stride[0] - top + ky, ox * stride[1] - left + kx
                            if 0 <= iy < h and 0 <= ix < wd:
                                acc += float(x[bi, iy, ix, oc // mult]) * float(w[0, ky, kx, oc])
                    y[bi, oy, ox, oc] = acc
    return y


def _loop_pool(x, pool, stride, padding, reduce):
    n, h, wd, c = x.shape
    oh, top = _geometry(h, pool[0], stride[0], padding)
    ow, left = _geometry(wd, pool[1], stride[1], padding)
    y = np.zeros((n, oh, ow, c), np.float64)
    for oy in range(oh):
        for ox in range(ow):
            y0, x0 = oy * stride[0] - top, ox * stride[1] - left
            window = x[:, max(y0, 0) : y0 + pool[0], max(x0, 0) : x0 + pool[1], :]
            y[:, oy, ox, :] = reduce(window.reshape(n, -1, c), axis=1)
    return y


@pytest.mark.parametrize(
    ("hw", "kernel", "stride", "padding", "groups"),
    [
        ((7, 6), (3, 3), (1, 1), "same", 1),
        ((7, 6), (3, 3), (2, 2), "same", 1),
        ((8, 8), (3, 2), (2, 1), "valid", 1),
        ((6, 7), (1, 1), (1, 1), "same", 1),
        ((6, 6), (2, 2), (2, 2), "same", 2),
        ((5, 7), (3, 3), (2, 3), "valid", 3),
    ],
)
def test_conv2d_matches_loops(hw, kernel, stride, padding, groups) -> None:
    """Strides, SAME / VALID padding (odd pad after) and grouped convolution."""
    rng = np.random.default_rng([*hw, *kernel, *stride, groups])
    c, o = 6, 6
    x = _rand(rng, 2, *hw, c)
    w = _rand(rng, o, *kernel, c // groups)
    b = _rand(rng, o)
    got = kf.conv2d(x[None], w[None], b[None], stride, padding, groups)[0]
    np.testing.assert_allclose(
        got, _loop_conv(x, w, b, stride, padding, groups), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("stride", "padding", "mult"), [((1, 1), "same", 1), ((2, 2), "same", 2), ((2, 1), "valid", 3)]
)
def test_depthwise_conv2d_matches_loops(stride, padding, mult) -> None:
    """1HWO depthwise weights with a depth multiplier: output o reads channel o // mult."""
    rng = np.random.default_rng(mult)
    x = _rand(rng, 2, 7, 6, 3)
    w = _rand(rng, 1, 3, 3, 3 * mult)
    b = _rand(rng, 3 * mult)
    got = kf.depthwise_conv2d(x[None], w[None], b[None], stride, padding)[0]
    np.testing.assert_allclose(got, _loop_depthwise(x, w, b, stride, padding), rtol=1e-5, atol=1e-5)


def test_dense_and_activations() -> None:
    """x W^T + b, then ReLU and ReLU6 clamps."""
    rng = np.random.default_rng(7)
    x, w, b = _rand(rng, 5, 8) * 4, _rand(rng, 3, 8), _rand(rng, 3)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + b
    np.testing.assert_allclose(kf.dense(x[None], w[None], b[None])[0], ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        kf.dense(x[None], w[None], b[None], "relu")[0], np.maximum(ref, 0), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        kf.dense(x[None], w[None], b[None], "relu6")[0], np.clip(ref, 0, 6), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("pool", "stride", "padding"),
    [((2, 2), (2, 2), "valid"), ((3, 3), (2, 2), "same"), ((3, 2), (1, 2), "same")],
)
def test_pools_match_loops(pool, stride, padding) -> None:
    """Average pools count only in-bounds cells; max pools ignore padding."""
    rng = np.random.default_rng(11)
    x = _rand(rng, 2, 7, 6, 3)
    np.testing.assert_allclose(
        kf.avg_pool(x[None], pool, stride, padding)[0],
        _loop_pool(x, pool, stride, padding, np.mean),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_array_equal(
        kf.max_pool(x[None], pool, stride, padding)[0], _loop_pool(x, pool, stride, padding, np.max)
    )


def test_global_avg_pool_and_add() -> None:
    """Global pooling is the spatial mean; Add sums and applies its activation."""
    rng = np.random.default_rng(12)
    x = _rand(rng, 3, 4, 5, 6)
    np.testing.assert_allclose(
        kf.global_avg_pool(x[None])[0], x.mean(axis=(1, 2)), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(kf.add(x[None], x[None], "relu")[0], np.maximum(x + x, 0))


def test_stacked_weights_equal_separate_calls() -> None:
    """P stacked weight sets give, per set, the bits of an unstacked call."""
    rng = np.random.default_rng(13)
    x = _rand(rng, 1, 3, 7, 7, 4)
    w = _rand(rng, 5, 8, 3, 3, 4)
    b = _rand(rng, 5, 8)
    stacked = kf.conv2d(x, w, b, (2, 2), "same")
    for p in range(5):
        assert np.array_equal(
            stacked[p], kf.conv2d(x, w[p : p + 1], b[p : p + 1], (2, 2), "same")[0]
        )


@pytest.mark.parametrize("k, o", [(64, 32), (300, 10), (72, 8), (1024, 5)])
def test_row_wise_matmul_rows_do_not_depend_on_their_position(k: int, o: int) -> None:
    """A row's product is the same bits alone, at any position of a batch, from any address."""
    rng = np.random.default_rng(k)
    a = rng.standard_normal((2, 70, k)).astype(np.float32)
    b = rng.standard_normal((2, k, o)).astype(np.float32)
    whole = kf.row_wise_matmul(a, b)
    for i in range(a.shape[1]):
        buffer = np.zeros(2 * k + 3, np.float32)  # an odd offset: the row is not aligned
        row = buffer[3:].reshape(2, 1, k)
        row[...] = a[:, i : i + 1]
        assert np.array_equal(kf.row_wise_matmul(row, b), whole[:, i : i + 1]), i
