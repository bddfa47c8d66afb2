"""First-order (backpropagation) FP32 training: the baseline every ZO run is compared with.

It also pretrains backbones for the transfer setting (pretrain on source classes with
backprop, then train the last layers on the boards with ZO). Every graph operation has
a forward that keeps what its backward needs and a backward that returns the input
gradients and, for Conv2D and Dense, the weight and bias gradients.

Geometry follows TFLite, as the inference engine does: SAME output size
``ceil(in / stride)`` with the odd padding element after; pools average over the
in-bounds part of a window. The kernels keep the dtype they are given, so the gradient
check runs the same code in float64.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from qsched.zo.datasets import Dataset
from qsched.zo.errors import BackpropError
from qsched.zo.graph import (
    Activation,
    Add,
    AvgPool,
    Concat,
    Conv2D,
    Dense,
    GlobalAvgPool,
    HardSwish,
    Logistic,
    MaxPool,
    Mean,
    Model,
    Mul,
    MulConstant,
    Node,
    Pad,
    Padding,
    ReLU,
    ReLU6,
    Reshape,
)
from qsched.zo.shapes import infer_shapes

__all__ = [
    "BackpropError",
    "History",
    "evaluate",
    "forward",
    "loss_and_grads",
    "resolve_trainable",
    "softmax_cross_entropy",
    "train_backprop",
]

Array: TypeAlias = npt.NDArray[np.floating[Any]]
Grads: TypeAlias = dict[str, tuple[Array, Array]]
Optimizer: TypeAlias = Literal["adam", "sgd"]
Augment: TypeAlias = Literal["none", "dihedral"]

# What a frozen prefix's outputs may take in memory, train and validation sets together.
_FROZEN_BUDGET_BYTES = 1 << 30
_CHUNK = 256  # samples per forward pass when evaluating or running a frozen prefix


# --------------------------------------------------------------------------- geometry


def _pads(size: int, kernel: int, stride: int, padding: Padding) -> tuple[int, int, int]:
    """(output size, padding before, padding after) along one axis, TFLite rules."""
    out = -(-size // stride) if padding == "same" else (size - kernel) // stride + 1
    total = max(0, (out - 1) * stride + kernel - size) if padding == "same" else 0
    return out, total // 2, total - total // 2


@dataclass(frozen=True)
class _Window:
    kh: int
    kw: int
    sh: int
    sw: int
    oh: int
    ow: int
    pads: tuple[tuple[int, int], tuple[int, int]]

    @classmethod
    def of(
        cls,
        shape: tuple[int, ...],
        kernel: tuple[int, int],
        stride: tuple[int, int],
        padding: Padding,
    ) -> _Window:
        oh, t, b = _pads(shape[1], kernel[0], stride[0], padding)
        ow, left, right = _pads(shape[2], kernel[1], stride[1], padding)
        return cls(kernel[0], kernel[1], stride[0], stride[1], oh, ow, ((t, b), (left, right)))

    def pad(self, x: Array, fill: float = 0.0) -> Array:
        if self.pads == ((0, 0), (0, 0)):
            return x
        return np.pad(x, ((0, 0), *self.pads, (0, 0)), constant_values=fill)

    def tap(self, xp: Array, i: int, j: int) -> Array:
        """The (N, oh, ow, C) input values under window offset (i, j)."""
        return xp[
            :,
            i : i + self.sh * (self.oh - 1) + 1 : self.sh,
            j : j + self.sw * (self.ow - 1) + 1 : self.sw,
        ]

    def taps(self) -> list[tuple[int, int]]:
        return [(i, j) for i in range(self.kh) for j in range(self.kw)]

    def unpad(self, xp: Array) -> Array:
        (t, b), (left, right) = self.pads
        return xp[:, t : xp.shape[1] - b, left : xp.shape[2] - right]


def _patches(xp: Array, w: _Window) -> Array:
    """im2col: (N, oh, ow, kh, kw, C) view-copy of the padded input."""
    view = sliding_window_view(xp, (w.kh, w.kw), axis=(1, 2))  # (N, H', W', C, kh, kw)
    view = view[:, :: w.sh, :: w.sw][:, : w.oh, : w.ow]
    return np.ascontiguousarray(view.transpose(0, 1, 2, 4, 5, 3))


# --------------------------------------------------------------------------- activations


def _act(z: Array, activation: Activation) -> Array:
    if activation == "relu":
        return np.maximum(z, 0)
    if activation == "relu6":
        return np.clip(z, 0, 6)
    return z


def _act_grad(y: Array, dy: Array, activation: Activation) -> Array:
    """Gradient through the activation, from its output (the mask is where it is linear)."""
    if activation == "relu":
        return dy * (y > 0)
    if activation == "relu6":
        return dy * ((y > 0) & (y < 6))
    return dy


# --------------------------------------------------------------------------- ops
# Each forward returns (output, context); each backward takes (node, context, dy) and
# returns (input gradients, parameter gradients or None).

_Ctx: TypeAlias = tuple[Any, ...]
_Back: TypeAlias = tuple[list[Array], tuple[Array, Array] | None]


def _conv_fwd(node: Conv2D, x: Array) -> tuple[Array, _Ctx]:
    if node.depthwise:
        return _dw_fwd(node, x)
    out, kh, kw, _ = node.weight.shape
    w = _Window.of(x.shape, (kh, kw), node.stride, node.padding)
    cols = _patches(w.pad(x), w)
    g = node.groups
    m = cols.shape[0] * w.oh * w.ow
    if g == 1:
        z = cols.reshape(m, -1) @ node.weight.reshape(out, -1).T
    else:
        # (M, kh*kw, G, I/G) -> (G, M, kh*kw*I/G) against (G, O/G, kh*kw*I/G).
        cg = cols.reshape(m, kh * kw, g, -1).transpose(2, 0, 1, 3).reshape(g, m, -1)
        wg = node.weight.reshape(g, out // g, -1)
        z = (cg @ wg.transpose(0, 2, 1)).transpose(1, 0, 2).reshape(m, out)
    y = _act(z.reshape(cols.shape[0], w.oh, w.ow, out) + node.bias, node.activation)
    return y, (cols, w, x.shape, y)


def _conv_bwd(node: Conv2D, ctx: _Ctx, dy: Array, need_dx: bool) -> _Back:
    if node.depthwise:
        return _dw_bwd(node, ctx, dy, need_dx)
    cols, w, xshape, y = ctx
    out, kh, kw, _ = node.weight.shape
    dz = _act_grad(y, dy, node.activation)
    m = dz.shape[0] * w.oh * w.ow
    dzf = dz.reshape(m, out)
    g = node.groups
    grads = (dz.sum(axis=(0, 1, 2)),)
    if g == 1:
        dw = dzf.T @ cols.reshape(m, -1)
        if not need_dx:
            return [], (dw.reshape(node.weight.shape), *grads)
        dcols = dzf @ node.weight.reshape(out, -1)
    else:
        cg = cols.reshape(m, kh * kw, g, -1).transpose(2, 0, 1, 3).reshape(g, m, -1)
        dzg = dzf.reshape(m, g, out // g).transpose(1, 0, 2)  # (G, M, O/G)
        dw = dzg.transpose(0, 2, 1) @ cg  # (G, O/G, K)
        if not need_dx:
            return [], (dw.reshape(node.weight.shape), *grads)
        dcg = dzg @ node.weight.reshape(g, out // g, -1)  # (G, M, kh*kw*I/G)
        dcols = dcg.reshape(g, m, kh * kw, -1).transpose(1, 2, 0, 3)
    dcols = dcols.reshape(cols.shape)
    dxp = np.zeros(
        (xshape[0], xshape[1] + sum(w.pads[0]), xshape[2] + sum(w.pads[1]), xshape[3]),
        dtype=dz.dtype,
    )
    for i, j in w.taps():
        w.tap(dxp, i, j)[...] += dcols[:, :, :, i, j, :]
    return [w.unpad(dxp)], (dw.reshape(node.weight.shape), *grads)


def _dw_fwd(node: Conv2D, x: Array) -> tuple[Array, _Ctx]:
    _, kh, kw, out = node.weight.shape
    mult = out // x.shape[3]
    w = _Window.of(x.shape, (kh, kw), node.stride, node.padding)
    xp = w.pad(x)
    if mult > 1:  # output channel o reads input channel o // mult (TFLite's depth multiplier)
        xp = np.repeat(xp, mult, axis=3)
    z = np.zeros((x.shape[0], w.oh, w.ow, out), dtype=np.result_type(x, node.weight))
    for i, j in w.taps():
        z += w.tap(xp, i, j) * node.weight[0, i, j]
    y = _act(z + node.bias, node.activation)
    return y, (xp, w, x.shape, y, mult)


def _dw_bwd(node: Conv2D, ctx: _Ctx, dy: Array, need_dx: bool) -> _Back:
    xp, w, _, y, mult = ctx
    dz = _act_grad(y, dy, node.activation)
    dw = np.zeros_like(node.weight, dtype=dz.dtype)
    dxp = np.zeros(xp.shape, dtype=dz.dtype)
    for i, j in w.taps():
        dw[0, i, j] = np.einsum("nhwc,nhwc->c", dz, w.tap(xp, i, j))
        if need_dx:
            w.tap(dxp, i, j)[...] += dz * node.weight[0, i, j]
    if not need_dx:
        return [], (dw, dz.sum(axis=(0, 1, 2)))
    if mult > 1:
        dxp = dxp.reshape(*dxp.shape[:3], -1, mult).sum(axis=4)
    return [w.unpad(dxp)], (dw, dz.sum(axis=(0, 1, 2)))


def _dense_fwd(node: Dense, x: Array) -> tuple[Array, _Ctx]:
    y = _act(x @ node.weight.T + node.bias, node.activation)
    return y, (x, y)


def _dense_bwd(node: Dense, ctx: _Ctx, dy: Array, need_dx: bool) -> _Back:
    x, y = ctx
    dz = _act_grad(y, dy, node.activation)
    return [dz @ node.weight] if need_dx else [], (dz.T @ x, dz.sum(axis=0))


def _pool_fwd(node: AvgPool | MaxPool, x: Array) -> tuple[Array, _Ctx]:
    w = _Window.of(x.shape, node.pool, node.stride, node.padding)
    if isinstance(node, MaxPool):
        cols = _patches(w.pad(x, -np.inf), w).reshape(x.shape[0], w.oh, w.ow, -1, x.shape[3])
        arg = cols.argmax(axis=3)
        return np.take_along_axis(cols, arg[:, :, :, None], axis=3)[:, :, :, 0], (w, x.shape, arg)
    # The divisor counts only in-bounds elements of each window (TFLite).
    count = np.zeros((1, w.oh, w.ow, 1), dtype=x.dtype)
    ones = w.pad(np.ones((1, *x.shape[1:3], 1), dtype=x.dtype))
    xp = w.pad(x)
    total = np.zeros((x.shape[0], w.oh, w.ow, x.shape[3]), dtype=x.dtype)
    for i, j in w.taps():
        total += w.tap(xp, i, j)
        count += w.tap(ones, i, j)
    return total / count, (w, x.shape, count)


def _pool_bwd(node: AvgPool | MaxPool, ctx: _Ctx, dy: Array) -> _Back:
    w, xshape, extra = ctx
    dxp = np.zeros(
        (xshape[0], xshape[1] + sum(w.pads[0]), xshape[2] + sum(w.pads[1]), xshape[3]),
        dtype=dy.dtype,
    )
    for t, (i, j) in enumerate(w.taps()):
        if isinstance(node, MaxPool):
            w.tap(dxp, i, j)[...] += dy * (extra == t)
        else:
            w.tap(dxp, i, j)[...] += dy / extra
    return [w.unpad(dxp)], None


def _fwd(node: Node, xs: list[Array]) -> tuple[Array, _Ctx]:
    if isinstance(node, Conv2D):
        return _conv_fwd(node, xs[0])
    if isinstance(node, Dense):
        return _dense_fwd(node, xs[0])
    if isinstance(node, (AvgPool, MaxPool)):
        return _pool_fwd(node, xs[0])
    if isinstance(node, Add):
        y = _act(xs[0] + xs[1], node.activation)
        return y, (y,)
    if isinstance(node, (ReLU, ReLU6)):
        y = _act(xs[0], "relu" if isinstance(node, ReLU) else "relu6")
        return y, (y,)
    if isinstance(node, Logistic):
        y = 1.0 / (1.0 + np.exp(-xs[0]))
        return y, (y,)
    if isinstance(node, MulConstant):
        y = _act(xs[0] * node.value.astype(xs[0].dtype), node.activation)
        return y, (y,)
    if isinstance(node, HardSwish):
        x = xs[0]
        return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0, (x,)
    if isinstance(node, GlobalAvgPool):
        return xs[0].mean(axis=(1, 2)), (xs[0].shape,)
    if isinstance(node, Reshape):
        return xs[0].reshape(xs[0].shape[0], *node.shape), (xs[0].shape,)
    if isinstance(node, Mean):
        y = xs[0].mean(axis=(1, 2))
        return (y[:, None, None, :] if node.keep_dims else y), (xs[0].shape,)
    if isinstance(node, Pad):
        (top, bottom), (left, right) = node.pads
        return np.pad(xs[0], ((0, 0), (top, bottom), (left, right), (0, 0))), (xs[0].shape,)
    if isinstance(node, Concat):
        return np.concatenate(xs, axis=-1), (xs[0].shape[-1],)
    if isinstance(node, Mul):
        y = _act(xs[0] * xs[1], node.activation)
        return y, (y, xs[0], xs[1])
    raise BackpropError(f"layer {node.name!r}: no backprop rule for {type(node).__name__}")


def _bwd(node: Node, ctx: _Ctx, dy: Array, need_dx: bool = True) -> _Back:
    if isinstance(node, Conv2D):
        return _conv_bwd(node, ctx, dy, need_dx)
    if isinstance(node, Dense):
        return _dense_bwd(node, ctx, dy, need_dx)
    if isinstance(node, (AvgPool, MaxPool)):
        return _pool_bwd(node, ctx, dy)
    if isinstance(node, Add):
        dz = _act_grad(ctx[0], dy, node.activation)
        return [dz, dz], None
    if isinstance(node, (ReLU, ReLU6)):
        return [_act_grad(ctx[0], dy, "relu" if isinstance(node, ReLU) else "relu6")], None
    if isinstance(node, Logistic):
        y = ctx[0]
        return [dy * y * (1.0 - y)], None
    if isinstance(node, MulConstant):
        dz = _act_grad(ctx[0], dy, node.activation)
        return [dz * node.value.astype(dz.dtype)], None
    if isinstance(node, HardSwish):
        x = ctx[0]  # 0 below -3, 1 above 3, (2x + 3) / 6 between
        slope = np.where(x < -3.0, 0.0, np.where(x > 3.0, 1.0, (2.0 * x + 3.0) / 6.0))
        return [dy * slope], None
    if isinstance(node, GlobalAvgPool):
        n, h, w, c = ctx[0]
        return [np.broadcast_to(dy[:, None, None, :] / (h * w), (n, h, w, c))], None
    if isinstance(node, Reshape):
        return [dy.reshape(ctx[0])], None
    if isinstance(node, Mean):
        n, h, w, c = ctx[0]
        flat = dy.reshape(n, c)
        return [np.broadcast_to(flat[:, None, None, :] / (h * w), (n, h, w, c))], None
    if isinstance(node, Pad):
        n, h, w, c = ctx[0]
        top, left = node.pads[0][0], node.pads[1][0]
        return [dy[:, top : top + h, left : left + w, :]], None
    if isinstance(node, Concat):
        split = ctx[0]
        return [dy[..., :split], dy[..., split:]], None
    if isinstance(node, Mul):
        y, a, b = ctx
        dz = _act_grad(y, dy, node.activation)
        db = dz * a
        if b.shape != a.shape:  # a (1, 1, C) gate: its gradient sums over height and width
            db = db.sum(axis=(1, 2), keepdims=True)
        return [dz * b, db], None
    raise BackpropError(f"layer {node.name!r}: no backprop rule for {type(node).__name__}")


# --------------------------------------------------------------------------- graph


def _check_input(model: Model, x: Array) -> None:
    if tuple(x.shape[1:]) != tuple(model.input_shape):
        raise BackpropError(
            f"model {model.name!r} takes inputs {model.input_shape}, got {x.shape[1:]}"
        )


def forward(model: Model, x: npt.ArrayLike) -> Array:
    """Logits of the float model for a batch (float32 unless the model holds float64).

    Args:
        model: the graph.
        x: ``(N, *model.input_shape)`` inputs.

    Returns:
        ``(N, num_classes)`` logits.
    """
    tensors = {model.input_name: _as_input(model, x)}
    _run_nodes(model, tensors, 0)
    return tensors[model.output_name]


def _as_input(model: Model, x: npt.ArrayLike) -> Array:
    xa = np.asarray(x)
    xa = xa.astype(np.float32) if xa.dtype != np.float64 else xa
    _check_input(model, xa)
    return xa


def _run_nodes(
    model: Model, tensors: dict[str, Array], start: int, stop: int | None = None
) -> list[_Ctx]:
    """Run ``model.nodes[start:stop]`` on ``tensors`` (filled in place); their contexts."""
    ctxs: list[_Ctx] = []
    for node in model.nodes[start:stop]:
        tensors[node.output], ctx = _fwd(node, [tensors[t] for t in node.inputs])
        ctxs.append(ctx)
    return ctxs


def softmax_cross_entropy(logits: Array, labels: npt.ArrayLike) -> tuple[float, Array]:
    """Mean softmax cross-entropy and its gradient with respect to the logits.

    Args:
        logits: ``(N, K)``.
        labels: ``(N,)`` integers in ``0..K-1``.

    Returns:
        ``(loss, dlogits)``; ``dlogits`` has the logits' shape and dtype.
    """
    y = np.asarray(labels, dtype=np.int64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    logsum = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    logp = shifted - logsum
    rows = np.arange(len(y))
    loss = float(-logp[rows, y].mean())
    grad = np.exp(logp)
    grad[rows, y] -= 1
    return loss, (grad / len(y)).astype(logits.dtype)


def resolve_trainable(model: Model, trainable: str | Sequence[str] | None) -> list[str]:
    """The names of the trainable parametrised layers, in model order.

    Args:
        model: the graph.
        trainable: ``None`` or ``"all"``, ``"last:N"``, or a list of layer names.

    Returns:
        Layer names (Conv2D and Dense only).

    Raises:
        BackpropError: unknown or parameter-free layer names, or a bad ``last:N``.
    """
    names = [n.name for n in model.param_nodes()]
    if trainable is None or trainable == "all":
        return names
    if isinstance(trainable, str):
        head, _, count = trainable.partition(":")
        if head != "last" or not count.isdigit() or not 1 <= int(count) <= len(names):
            raise BackpropError(
                f"trainable {trainable!r}: expected 'all', 'last:N' with N in 1..{len(names)}, "
                "or a list of layer names"
            )
        return names[-int(count) :]
    unknown = sorted(set(trainable) - set(names))
    if unknown:
        raise BackpropError(
            f"trainable layers {unknown} are not parametrised layers of {model.name!r}: {names}"
        )
    return [n for n in names if n in set(trainable)]


def loss_and_grads(
    model: Model, x: npt.ArrayLike, y: npt.ArrayLike, trainable: str | Sequence[str] | None = None
) -> tuple[float, Grads]:
    """Mean cross-entropy of a batch and the gradients of the trainable layers.

    Backward stops at the earliest trainable layer, so a frozen backbone costs a
    forward pass only.

    Args:
        model: the graph (not modified).
        x: a batch of inputs.
        y: its labels.
        trainable: as :func:`resolve_trainable`.

    Returns:
        ``(loss, {layer: (weight_grad, bias_grad)})``.
    """
    names = set(resolve_trainable(model, trainable))
    first = _first_trainable(model, names)
    return _loss_and_grads_from(model, {model.input_name: _as_input(model, x)}, y, names, first, 0)


def _first_trainable(model: Model, names: set[str]) -> int:
    return min(i for i, n in enumerate(model.nodes) if n.name in names)


def _loss_and_grads_from(
    model: Model,
    tensors: dict[str, Array],
    y: npt.ArrayLike,
    names: set[str],
    first: int,
    start: int,
) -> tuple[float, Grads]:
    """Loss and gradients with ``tensors`` holding what ``model.nodes[start:]`` read."""
    ctxs: list[_Ctx] = [()] * start + _run_nodes(model, tensors, start)
    loss, dlogits = softmax_cross_entropy(tensors[model.output_name], y)
    return loss, _backward(model, ctxs, dlogits, names, first)


def _backward(model: Model, ctxs: list[_Ctx], dlogits: Array, names: set[str], first: int) -> Grads:
    del_tensors: dict[str, Array] = {model.output_name: dlogits}
    grads: Grads = {}
    for idx in range(len(model.nodes) - 1, first - 1, -1):
        node = model.nodes[idx]
        dy = del_tensors.pop(node.output, None)
        if dy is None:
            continue  # the output does not reach the loss
        # Nothing before the earliest trainable layer needs a gradient.
        dxs, pgrad = _bwd(node, ctxs[idx], dy, need_dx=idx > first)
        if pgrad is not None and node.name in names:
            grads[node.name] = pgrad
        for tensor, dx in zip(node.inputs, dxs, strict=False):
            prev = del_tensors.get(tensor)
            del_tensors[tensor] = dx if prev is None else prev + dx
    return grads


def evaluate(
    model: Model, x: npt.ArrayLike, y: npt.ArrayLike, batch_size: int = _CHUNK
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of the float model on a data set.

    Args:
        model: the graph.
        x: inputs.
        y: labels.
        batch_size: evaluation chunk size (memory only; results do not depend on it).

    Returns:
        ``(loss, accuracy)``, accuracy in ``[0, 1]``.
    """
    xa = np.asarray(x)
    if len(xa) == 0:
        raise BackpropError("cannot evaluate on an empty set")
    return _scored(model, {model.input_name: xa}, y, 0, batch_size)


def _scored(
    model: Model, inputs: dict[str, Array], y: npt.ArrayLike, start: int, batch_size: int
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model.nodes[start:]`` run on ``inputs`` (the
    tensors those nodes read, one row per sample) in chunks of ``batch_size``."""
    ya = np.asarray(y, dtype=np.int64)
    total, correct = 0.0, 0
    for lo in range(0, len(ya), batch_size):
        tensors = {t: a[lo : lo + batch_size] for t, a in inputs.items()}
        if start == 0:
            tensors[model.input_name] = _as_input(model, tensors[model.input_name])
        _run_nodes(model, tensors, start)
        logits, yb = tensors[model.output_name], ya[lo : lo + batch_size]
        total += softmax_cross_entropy(logits, yb)[0] * len(yb)
        correct += int((logits.argmax(axis=1) == yb).sum())
    return total / len(ya), correct / len(ya)


# --------------------------------------------------------------------------- training


@dataclass
class History:
    """Per-step training loss and the validation metrics at each evaluation step."""

    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    val_accuracy: list[float] = field(default_factory=list)


class _Optimiser:
    """Adam or SGD with momentum over a dict of (weight, bias) arrays, updated in place."""

    def __init__(self, kind: Optimizer, momentum: float, weight_decay: float) -> None:
        if kind not in ("adam", "sgd"):
            raise BackpropError(f"optimizer must be 'adam' or 'sgd', got {kind!r}")
        self.kind, self.momentum, self.weight_decay = kind, momentum, weight_decay
        self.m: dict[int, Array] = {}
        self.v: dict[int, Array] = {}
        self.t = 0

    def step(self, params: list[Array], grads: list[Array], lr: float) -> None:
        self.t += 1
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            g = g + self.weight_decay * p if self.weight_decay else g
            m = self.m.setdefault(i, np.zeros_like(p))
            if self.kind == "sgd":
                m *= self.momentum
                m += g
                p -= (lr * m).astype(p.dtype)
                continue
            v = self.v.setdefault(i, np.zeros_like(p))
            m *= 0.9
            m += 0.1 * g
            v *= 0.999
            v += 0.001 * g * g
            mhat, vhat = m / (1 - 0.9**self.t), v / (1 - 0.999**self.t)
            p -= (lr * mhat / (np.sqrt(vhat) + 1e-8)).astype(p.dtype)


class _Batches:
    """Minibatch indices from shuffled epochs; a new permutation when one runs out."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n, self.batch_size = n, batch_size
        self.perm = self.rng.permutation(n)
        self.pos = 0

    def take(self) -> npt.NDArray[np.int64]:
        if self.pos + self.batch_size > self.n:
            self.perm, self.pos = self.rng.permutation(self.n), 0
        start, self.pos = self.pos, self.pos + self.batch_size
        return np.asarray(self.perm[start : self.pos], dtype=np.int64)


def _augmented(x: Array, rng: np.random.Generator) -> Array:
    """Each image under one of the square's 8 symmetries (flips and quarter turns), drawn
    from ``rng``: for top-down imagery such as EuroSAT every one is another valid sample."""
    out = np.empty_like(x)
    kinds = rng.integers(0, 8, size=len(x))
    for kind in range(8):
        sel = np.flatnonzero(kinds == kind)
        if sel.size:
            turned = np.rot90(x[sel], k=kind % 4, axes=(1, 2))
            out[sel] = turned[:, :, ::-1] if kind >= 4 else turned
    return out


@dataclass
class _Frozen:
    """The tensors a frozen prefix ``model.nodes[:start]`` hands the trainable rest, for
    every training and validation sample: the prefix runs once, not once per step."""

    start: int
    train: dict[str, Array]
    val: dict[str, Array]

    @classmethod
    def of(cls, model: Model, dataset: Dataset, start: int) -> _Frozen | None:
        """None when nothing is frozen or its outputs would not fit the budget."""
        if start == 0:
            return None
        later = {t for n in model.nodes[start:] for t in n.inputs} | {model.output_name}
        made = {model.input_name} | {n.output for n in model.nodes[:start]}
        boundary = sorted(made & later)
        shapes = infer_shapes(model)
        itemsize = _as_input(model, dataset.x_train[:1]).itemsize
        per_sample = itemsize * sum(math.prod(shapes[t]) for t in boundary)
        if per_sample * (len(dataset.x_train) + len(dataset.x_val)) > _FROZEN_BUDGET_BYTES:
            return None
        return cls(
            start,
            _prefix_outputs(model, dataset.x_train, start, boundary),
            _prefix_outputs(model, dataset.x_val, start, boundary),
        )

    def evaluate(self, model: Model, y: npt.ArrayLike) -> tuple[float, float]:
        """:func:`evaluate` on the validation set, from the stored prefix outputs."""
        return _scored(model, self.val, y, self.start, _CHUNK)


def _prefix_outputs(model: Model, x: Array, start: int, boundary: list[str]) -> dict[str, Array]:
    parts: dict[str, list[Array]] = {t: [] for t in boundary}
    for lo in range(0, len(x), _CHUNK):
        tensors = {model.input_name: _as_input(model, x[lo : lo + _CHUNK])}
        _run_nodes(model, tensors, 0, start)
        for t in boundary:
            parts[t].append(tensors[t])
    return {t: np.concatenate(chunks) for t, chunks in parts.items()}


def _flat_grads(names: list[str], grads: Grads, nodes: dict[str, Conv2D | Dense]) -> list[Array]:
    out: list[Array] = []
    for n in names:
        # A layer whose output does not reach the loss gets zero gradients.
        zero = (np.zeros_like(nodes[n].weight), np.zeros_like(nodes[n].bias))
        out.extend(grads.get(n, zero))
    return out


def _lr_at(step: int, steps: int, lr: float, schedule: str) -> float:
    if schedule == "cosine":
        return lr * 0.5 * (1 + math.cos(math.pi * step / steps))
    return lr


def train_backprop(
    model: Model,
    dataset: Dataset,
    steps: int,
    lr: float = 1e-2,
    batch_size: int = 64,
    seed: int = 0,
    optimizer: Optimizer = "adam",
    trainable: str | Sequence[str] | None = None,
    *,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    schedule: Literal["constant", "cosine"] = "constant",
    eval_every: int = 0,
    augment: Augment = "none",
) -> tuple[Model, History]:
    """Train a copy of ``model`` with minibatch backpropagation.

    Args:
        model: the starting model (left unchanged).
        dataset: train and validation data; its input shape must be the model's.
        steps: number of minibatch updates.
        lr: learning rate (peak learning rate with ``schedule="cosine"``).
        batch_size: samples per step (at most the training set size).
        seed: seeds the ``numpy`` Generator that shuffles the minibatches.
        optimizer: ``"adam"`` or ``"sgd"`` (with ``momentum``).
        trainable: ``None``/``"all"``, ``"last:N"`` or layer names; other layers stay fixed.
        momentum: SGD momentum.
        weight_decay: L2 coefficient added to the gradients.
        schedule: ``"constant"`` or ``"cosine"`` decay to zero.
        eval_every: validate every this many steps (0: only after the last step).
        augment: ``"dihedral"``: each training image under a random one of the square's
            8 symmetries (its own Generator, seeded from ``seed``, so the minibatches
            are the same as without); square images only.

    Returns:
        ``(trained_model, history)``.
    """
    if steps < 1 or not 1 <= batch_size <= len(dataset.x_train):
        raise BackpropError(f"need steps >= 1 and 1 <= batch_size <= {len(dataset.x_train)}")
    if schedule not in ("constant", "cosine"):
        raise BackpropError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    shape = dataset.x_train.shape
    if augment not in ("none", "dihedral"):
        raise BackpropError(f"augment must be 'none' or 'dihedral', got {augment!r}")
    if augment == "dihedral" and (len(shape) != 4 or shape[1] != shape[2]):
        raise BackpropError(f"augment 'dihedral' needs square images, got {shape[1:]}")
    flips = np.random.default_rng([seed, 1]) if augment == "dihedral" else None
    trained = copy.deepcopy(model)
    names = resolve_trainable(trained, trainable)
    trainable_set = set(names)
    first = _first_trainable(trained, trainable_set)
    # Frozen layers give every sample the same outputs each step: computed once (not with
    # augmentation, whose inputs change). Same results up to float summation order.
    frozen = _Frozen.of(trained, dataset, first) if flips is None else None
    nodes = {n.name: n for n in trained.param_nodes()}
    opt = _Optimiser(optimizer, momentum, weight_decay)
    batches = _Batches(len(dataset.x_train), batch_size, seed)
    history = History()
    for step in range(1, steps + 1):
        idx = batches.take()
        y = dataset.y_train[idx]
        if frozen is not None:
            tensors = {t: a[idx] for t, a in frozen.train.items()}
            loss, grads = _loss_and_grads_from(trained, tensors, y, trainable_set, first, first)
        else:
            x = dataset.x_train[idx] if flips is None else _augmented(dataset.x_train[idx], flips)
            loss, grads = loss_and_grads(trained, x, y, names)
        params = [a for n in names for a in (nodes[n].weight, nodes[n].bias)]
        opt.step(params, _flat_grads(names, grads, nodes), _lr_at(step - 1, steps, lr, schedule))
        history.train_loss.append(loss)
        if step == steps or (eval_every and step % eval_every == 0):
            val_loss, val_acc = (
                frozen.evaluate(trained, dataset.y_val)
                if frozen is not None
                else evaluate(trained, dataset.x_val, dataset.y_val)
            )
            history.eval_steps.append(step)
            history.val_loss.append(val_loss)
            history.val_accuracy.append(val_acc)
    return trained, history
