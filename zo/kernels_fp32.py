"""FP32 kernels of every graph operation, NHWC, on *stacked* tensors.

Every activation carries a leading set axis ``S``: ``(S, N, H, W, C)`` or ``(S, N, F)``.
``S == 1`` is one model; ``S == P`` holds P perturbed copies of the same model. Weights
carry the same axis (``(S', O, kh, kw, I)``) and broadcast against the activations, so
one code path serves a plain forward and P perturbed forwards.

Bit-identity across batching. Two boards evaluating the same perturbation ``k`` must
report the same loss whether ``k`` was evaluated alone or among others, and a sample's
result must not depend on the other samples of its batch (a cached prefix is computed
on a whole data set, then indexed). BLAS does not promise either: its kernels sum in an
order that depends on the matrix shape (a one-row product takes a matrix-vector path,
ragged row tails take other micro-kernels) and, in some kernels, on where a row sits
in its tile (OpenBLAS's Haswell SGEMM rounds rows 6-11 of each 12-row tile
differently from rows 0-5). So every matrix product here is ``row_wise_matmul``: one
BLAS call of the same ``(1, K) x (K, O)`` shape per row and per weight set, whatever
the batch or the number of sets. numpy loops over the rows in C; a 2-run digits grid
took no longer than with 64-row blocks. Reductions (pools, depthwise sums) are
sequential element-wise adds in a fixed window order. Nothing here sums across ``S``.

Geometry follows TFLite: SAME output size ``ceil(in / stride)``, VALID
``ceil((in - k + 1) / stride)``, total padding ``max(0, (out - 1) * stride + k - in)``
with the odd element after (bottom / right); pools average over the in-bounds part of a
window only.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qsched.zo.graph import Activation, Padding

__all__ = [
    "add",
    "apply_activation",
    "avg_pool",
    "conv2d",
    "dense",
    "depthwise_conv2d",
    "extract_patches",
    "global_avg_pool",
    "max_pool",
    "out_size",
    "pad_amounts",
    "padded_windows",
    "relu",
    "relu6",
    "row_wise_matmul",
    "window_tap",
]

F32 = npt.NDArray[np.float32]
Array = npt.NDArray[Any]
_RELU6_MAX: Final = np.float32(6.0)


def out_size(size: int, kernel: int, stride: int, padding: Padding) -> int:
    """TFLite's output size of a window op along one axis (dilation 1)."""
    if padding == "same":
        return (size + stride - 1) // stride
    return (size + stride - kernel) // stride


def pad_amounts(size: int, kernel: int, stride: int, padding: Padding) -> tuple[int, int]:
    """(before, after) padding along one axis; TFLite puts the odd element after."""
    out = out_size(size, kernel, stride, padding)
    total = max(0, (out - 1) * stride + kernel - size)
    return total // 2, total - total // 2


def _pad_hw(x: Array, pads: tuple[tuple[int, int], tuple[int, int]], fill: float | int) -> Array:
    if pads == ((0, 0), (0, 0)):
        return x
    widths = [(0, 0), (0, 0), pads[0], pads[1], (0, 0)]
    return np.pad(x, widths, mode="constant", constant_values=fill)


def padded_windows(
    x: Array,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: Padding,
    fill: float | int,
) -> tuple[Array, int, int]:
    """Padded input and output size: ``x[:, :, i::sh][:oh]`` is window row offset i."""
    _, _, h, w, _ = x.shape
    oh = out_size(h, kernel[0], stride[0], padding)
    ow = out_size(w, kernel[1], stride[1], padding)
    pads = (
        pad_amounts(h, kernel[0], stride[0], padding),
        pad_amounts(w, kernel[1], stride[1], padding),
    )
    return _pad_hw(x, pads, fill), oh, ow


def window_tap(xp: Array, i: int, j: int, oh: int, ow: int, stride: tuple[int, int]) -> Array:
    """The input element under window offset (i, j) for every output position."""
    sh, sw = stride
    return xp[:, :, i : i + (oh - 1) * sh + 1 : sh, j : j + (ow - 1) * sw + 1 : sw, :]


def extract_patches(
    x: Array,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: Padding,
    fill: float | int = 0,
) -> Array:
    """im2col: ``(S, N, H, W, C) -> (S, N, OH, OW, kh * kw * C)``, taps in (kh, kw, C) order.

    The order matches the OHWI weight layout, so a convolution is one matmul with the
    weight reshaped to ``(O, kh * kw * I)``. Padding cells take ``fill``.
    """
    if kernel == (1, 1) and stride == (1, 1):
        return x
    xp, oh, ow = padded_windows(x, kernel, stride, padding, fill)
    s, n, _, _, c = xp.shape
    st = xp.strides
    view = np.lib.stride_tricks.as_strided(
        xp,
        shape=(s, n, oh, ow, kernel[0], kernel[1], c),
        strides=(st[0], st[1], st[2] * stride[0], st[3] * stride[1], st[2], st[3], st[4]),
        writeable=False,
    )
    return view.reshape(s, n, oh, ow, kernel[0] * kernel[1] * c)


def row_wise_matmul(a: Array, b: Array) -> F32:
    """``a @ b`` over stacked operands with a batch-independent order of operations.

    Args:
        a: ``(..., M, K)`` float32 rows.
        b: ``(..., K, O)`` float32, leading axes broadcast against ``a``'s.

    Returns:
        ``(..., M, O)`` float32; row i depends only on ``a[..., i, :]`` and ``b``, and
        is the same bits whatever M and wherever the row sits.
    """
    rows = np.ascontiguousarray(a, dtype=np.float32)[..., :, None, :]
    b_c = np.ascontiguousarray(b, dtype=np.float32)[..., None, :, :]
    out: F32 = np.matmul(rows, b_c)[..., 0, :]
    return out


def apply_activation(y: F32, activation: Activation) -> F32:
    """A fused activation on a float tensor."""
    if activation == "relu":
        return relu(y)
    if activation == "relu6":
        return relu6(y)
    return y


def relu(x: F32) -> F32:
    return np.maximum(x, np.float32(0.0))


def relu6(x: F32) -> F32:
    return np.minimum(np.maximum(x, np.float32(0.0)), _RELU6_MAX)


def conv2d(
    x: F32,
    weight: F32,
    bias: F32,
    stride: tuple[int, int],
    padding: Padding,
    groups: int = 1,
    activation: Activation = "none",
) -> F32:
    """Grouped 2-D convolution on stacked tensors.

    Args:
        x: ``(S, N, H, W, C)``.
        weight: ``(S', O, kh, kw, C // groups)``, S' broadcast against S.
        bias: ``(S', O)``.
        stride, padding, groups, activation: as ``graph.Conv2D``.

    Returns:
        ``(max(S, S'), N, OH, OW, O)`` float32.
    """
    _, o, kh, kw, ig = weight.shape
    cols = extract_patches(x, (kh, kw), stride, padding, 0.0)
    s, n, oh, ow, k = cols.shape
    m = n * oh * ow
    if groups == 1:
        w = weight.reshape(weight.shape[0], o, k)
        y = row_wise_matmul(cols.reshape(s, m, k), np.swapaxes(w, 1, 2))
    else:
        og = o // groups
        # Patches are (kh, kw, C); group g reads channels [g*ig, (g+1)*ig) of every tap.
        cg = (
            cols.reshape(s, m, kh * kw, groups, ig)
            .transpose(0, 3, 1, 2, 4)
            .reshape(s, groups, m, kh * kw * ig)
        )
        wg = weight.reshape(weight.shape[0], groups, og, kh * kw * ig)
        y = row_wise_matmul(cg, np.swapaxes(wg, 2, 3)).transpose(0, 2, 1, 3).reshape(-1, m, o)
    y = y + bias[:, None, :]
    return apply_activation(y.reshape(-1, n, oh, ow, o).astype(np.float32, copy=False), activation)


def depthwise_conv2d(
    x: F32,
    weight: F32,
    bias: F32,
    stride: tuple[int, int],
    padding: Padding,
    activation: Activation = "none",
) -> F32:
    """Depthwise convolution (TFLite 1HWO weights, depth multiplier ``O / C``).

    Args:
        x: ``(S, N, H, W, C)``.
        weight: ``(S', 1, kh, kw, O)`` with ``O = C * multiplier``; output channel
            ``o`` reads input channel ``o // multiplier``.
        bias: ``(S', O)``.

    Returns:
        ``(max(S, S'), N, OH, OW, O)`` float32.
    """
    _, _, kh, kw, o = weight.shape
    c = x.shape[-1]
    if o != c:
        x = np.repeat(x, o // c, axis=-1)
    xp, oh, ow = padded_windows(x, (kh, kw), stride, padding, 0.0)
    wt = weight[:, 0][:, None, None, None]  # (S', 1, 1, 1, kh, kw, O)
    acc: Array | None = None
    for i in range(kh):
        for j in range(kw):
            term = window_tap(xp, i, j, oh, ow, stride) * wt[..., i, j, :]
            acc = term if acc is None else acc + term
    assert acc is not None
    y = acc + bias[:, None, None, None, :]
    return apply_activation(y.astype(np.float32, copy=False), activation)


def dense(x: F32, weight: F32, bias: F32, activation: Activation = "none") -> F32:
    """Fully connected: ``(S, N, F) x (S', O, F) -> (max(S, S'), N, O)``."""
    y = row_wise_matmul(x, np.swapaxes(weight, 1, 2)) + bias[:, None, :]
    return apply_activation(y.astype(np.float32, copy=False), activation)


def add(a: F32, b: F32, activation: Activation = "none") -> F32:
    return apply_activation((a + b).astype(np.float32, copy=False), activation)


def avg_pool(x: F32, pool: tuple[int, int], stride: tuple[int, int], padding: Padding) -> F32:
    """Average over the in-bounds part of each window (TFLite excludes padding)."""
    xp, oh, ow = padded_windows(x, pool, stride, padding, 0.0)
    ones = padded_windows(
        np.ones((1, 1, *x.shape[2:4], 1), np.float32), pool, stride, padding, 0.0
    )[0]
    total: Array | None = None
    count: Array | None = None
    for i in range(pool[0]):
        for j in range(pool[1]):
            t = window_tap(xp, i, j, oh, ow, stride)
            c = window_tap(ones, i, j, oh, ow, stride)
            total = t if total is None else total + t
            count = c if count is None else count + c
    assert total is not None and count is not None
    return (total / count).astype(np.float32, copy=False)


def max_pool(x: F32, pool: tuple[int, int], stride: tuple[int, int], padding: Padding) -> F32:
    """Maximum over the in-bounds part of each window."""
    xp, oh, ow = padded_windows(x, pool, stride, padding, -np.inf)
    out: Array | None = None
    for i in range(pool[0]):
        for j in range(pool[1]):
            t = window_tap(xp, i, j, oh, ow, stride)
            out = t if out is None else np.maximum(out, t)
    assert out is not None
    return out.astype(np.float32, copy=False)


def logistic(x: F32) -> F32:
    """1 / (1 + exp(-x)) in float32."""
    one = np.float32(1.0)
    y: F32 = (one / (one + np.exp(-x))).astype(np.float32, copy=False)
    return y


def hard_swish(x: F32) -> F32:
    """x * relu6(x + 3) / 6 in float32, in that order (TFLite's reference)."""
    gate = np.minimum(np.maximum(x + np.float32(3.0), np.float32(0.0)), _RELU6_MAX)
    y: F32 = (x * gate / np.float32(6.0)).astype(np.float32, copy=False)
    return y


def mul(a: F32, b: F32, activation: Activation) -> F32:
    """Element-wise product (numpy broadcasting: a ``(1, 1, C)`` gate spreads over H, W)."""
    return apply_activation((a * b).astype(np.float32, copy=False), activation)


def pad(x: F32, pads: tuple[tuple[int, int], tuple[int, int]]) -> F32:
    """Zero padding of height and width: ``(S, N, H, W, C)``."""
    (top, bottom), (left, right) = pads
    return np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right), (0, 0)))


def global_avg_pool(x: F32) -> F32:
    """Mean over height and width, ``(S, N, H, W, C) -> (S, N, C)``, summed in row order
    (also MEAN over axes 1 and 2, which has no other FP32 form)."""
    s, n, h, w, c = x.shape
    flat = x.reshape(s, n, h * w, c)
    total = flat[:, :, 0].copy()
    for i in range(1, h * w):
        total += flat[:, :, i]
    return (total / np.float32(h * w)).astype(np.float32, copy=False)
