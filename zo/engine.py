"""The forward engine: FP32 and INT8 evaluation of a model, one or P perturbed copies.

A ZO step evaluates the same batch under 2q perturbed weight sets. What they share is
computed once:

- the batch and the frozen prefix (nodes before the first perturbed layer) run with a
  set axis of 1; ``prefix_activations`` goes further and caches that prefix across
  calls (for a whole data set, then ``Activations.take`` picks a minibatch);
- the first perturbed layer's input patches (im2col) are built once and multiplied
  against all P weight sets;
- the suffix runs on stacked tensors ``(P, N, ...)``, in chunks of P sized to a memory
  budget.

INT8 layers run on the native C kernels (``native``) when they are built, else on the
numpy kernels (``kernels_int8``); both give the same bits, and the native ones need no
wide temporaries, so chunks of P are then sized by the int8 tensors alone.

INT8 arithmetic is exact, so batching changes no bit. FP32 results are also
independent of batching: the kernels only use per-slice BLAS calls and fixed-order
element-wise sums (see ``kernels_fp32``), so ``run_fp32_perturbed(...)[p]`` equals
``run_fp32`` with the p-th weights, bit for bit, on one machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from qsched.zo import kernels_fp32 as kf
from qsched.zo import kernels_int8 as ki
from qsched.zo import native
from qsched.zo.graph import (
    Add,
    AvgPool,
    Concat,
    Conv2D,
    Dense,
    GlobalAvgPool,
    GraphError,
    HardSwish,
    Logistic,
    MaxPool,
    Mean,
    Model,
    Mul,
    MulConstant,
    Node,
    Pad,
    QuantModel,
    ReLU,
    ReLU6,
    Reshape,
    TensorQuant,
)
from qsched.zo.lookup import TABLE_NODES, look_up, unary_table
from qsched.zo.shapes import infer_shapes

__all__ = [
    "DEFAULT_MAX_BYTES",
    "ROUNDING_BY_OP",
    "SINGLE_ROUNDING",
    "Activations",
    "PreparedInt8",
    "bench_engine",
    "fp32_tensors",
    "infer_shapes",
    "int8_tensors",
    "prefix_activations",
    "prepare_int8",
    "run_fp32",
    "run_fp32_perturbed",
    "run_int8",
    "run_int8_perturbed",
]

# Requantisation rounding per kernel (``fixedpoint.multiply_by_quantized_multiplier``),
# measured against LiteRT's interpreter with the reference op resolver (ai-edge-litert
# 2.3, per-op isolation on random models and on hand-made tie cases): CONV_2D,
# DEPTHWISE_CONV_2D and ADD use the reference double rounding; FULLY_CONNECTED
# (per-channel int8) rounds once, ``(x * m + 2^(30 - s)) >> (31 - s)``. RELU cannot tell
# the two apart (its ties fall below the clamp) and keeps the double rounding.
# ``SINGLE_ROUNDING`` is what the model blob's flag carries: FULLY_CONNECTED's variant.
SINGLE_ROUNDING: Final = True
ROUNDING_BY_OP: Final[dict[str, bool]] = {
    "conv2d": False,
    "depthwise_conv2d": False,
    "dense": SINGLE_ROUNDING,
    "add": False,
    "mul": False,
    "relu": False,
}
# Working-set budget for one chunk of perturbed copies or samples (activations and
# patches). Results never depend on it; 16-64 MiB chunks measured fastest on MobileNetV2
# with every layer perturbed, and it bounds the memory of many boards in one host.
DEFAULT_MAX_BYTES: Final = 64 * 2**20

Array: TypeAlias = npt.NDArray[Any]
F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]
Env: TypeAlias = dict[str, Array]


@dataclass(frozen=True)
class Activations:
    """Tensors live after the first ``position`` nodes ran, batch first (no set axis)."""

    position: int
    tensors: dict[str, Array]
    quantized: bool

    @property
    def batch(self) -> int:
        return int(next(iter(self.tensors.values())).shape[0])

    def take(self, index: npt.ArrayLike) -> Activations:
        """The same activations for a subset of samples (e.g. a minibatch of a data set)."""
        idx = np.asarray(index)
        return Activations(
            self.position, {k: v[idx] for k, v in self.tensors.items()}, self.quantized
        )


# ---------------------------------------------------------------------------- shapes


def _last_use(model: Model) -> dict[str, int]:
    last: dict[str, int] = {}
    for i, node in enumerate(model.nodes):
        for name in node.inputs:
            last[name] = i
    last[model.output_name] = len(model.nodes)
    return last


# ------------------------------------------------------------------------ FP32 nodes


@dataclass
class _Ctx:
    """What one evaluation carries: weights by layer (stacked) and the patch cache.

    ``shared`` names the tensors computed once for all copies (the prefix); only their
    patches are cached, since a chunk of one copy also has a set axis of 1. ``kernels``
    is the INT8 kernel module, ``native`` or ``kernels_int8`` (same signatures, same bits).
    """

    weights: dict[str, tuple[Array, Array]]
    cache: dict[str, Array]
    plan: _Plan
    stages: dict[str, Any] | None = None
    kernels: Any = ki
    shared: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _Plan:
    """What the graph alone decides: tensor shapes, each tensor's last use, and whether
    the kernels are lean (the native INT8 ones build no patches nor wide temporaries)."""

    shapes: dict[str, tuple[int, ...]]
    last_use: dict[str, int]
    lean: bool = False

    @classmethod
    def of(cls, model: Model, lean: bool = False) -> _Plan:
        return cls(infer_shapes(model), _last_use(model), lean)


def _fp32_node(node: Node, env: Env, ctx: _Ctx) -> Array:
    x = env[node.inputs[0]]
    y: Array
    if isinstance(node, Conv2D):
        w, b = ctx.weights[node.name]
        if node.depthwise:
            y = kf.depthwise_conv2d(x, w, b, node.stride, node.padding, node.activation)
        else:
            y = kf.conv2d(x, w, b, node.stride, node.padding, node.groups, node.activation)
    elif isinstance(node, Dense):
        w, b = ctx.weights[node.name]
        y = kf.dense(x.reshape(*x.shape[:2], -1), w, b, node.activation)
    elif isinstance(node, Add):
        y = kf.add(x, env[node.inputs[1]], node.activation)
    elif isinstance(node, ReLU):
        y = kf.relu(x)
    elif isinstance(node, ReLU6):
        y = kf.relu6(x)
    elif isinstance(node, Logistic):
        y = kf.logistic(x)
    elif isinstance(node, HardSwish):
        y = kf.hard_swish(x)
    elif isinstance(node, MulConstant):
        y = kf.apply_activation((x * node.value).astype(np.float32), node.activation)
    elif isinstance(node, Mean):
        y = kf.global_avg_pool(x)
        y = y.reshape(*y.shape[:2], 1, 1, -1) if node.keep_dims else y
    elif isinstance(node, Pad):
        y = kf.pad(x, node.pads)
    elif isinstance(node, Concat):
        y = _concat(x, env[node.inputs[1]])
    elif isinstance(node, Mul):
        y = kf.mul(x, env[node.inputs[1]], node.activation)
    else:
        y = _shape_op(node, x, kf)
    return y


def _concat(a: Array, b: Array) -> Array:
    """Channels of ``a`` then ``b``; either may be one shared copy (P = 1) of a frozen
    layer's output while the other holds P perturbed copies."""
    if a.shape[0] != b.shape[0]:
        p = max(a.shape[0], b.shape[0])
        a, b = (np.broadcast_to(t, (p, *t.shape[1:])) for t in (a, b))
    return np.concatenate([a, b], axis=-1)


def _shape_op(node: Node, x: Array, kernels: Any) -> Array:
    """Ops whose FP32 and INT8 forms take the same arguments."""
    y: Array
    if isinstance(node, AvgPool):
        y = kernels.avg_pool(x, node.pool, node.stride, node.padding)
    elif isinstance(node, MaxPool):
        y = kernels.max_pool(x, node.pool, node.stride, node.padding)
    elif isinstance(node, GlobalAvgPool):
        y = kernels.global_avg_pool(x)
    elif isinstance(node, Reshape):
        y = x.reshape(*x.shape[:2], *node.shape)
    else:
        raise GraphError(node.name, f"unsupported operation {type(node).__name__}")
    return y


# ------------------------------------------------------------------------ INT8 nodes


def _tq(qmodel: QuantModel, tensor: str, node: str) -> TensorQuant:
    try:
        return qmodel.tensors[tensor]
    except KeyError:
        raise GraphError(node, f"tensor {tensor!r} has no quantisation parameters") from None


def _prepare_int8(qmodel: QuantModel, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """TFLite's Prepare for every node: multipliers, shifts, activation ranges."""
    stages: dict[str, Any] = {}
    for node in qmodel.model.nodes:
        inp = _tq(qmodel, node.inputs[0], node.name)
        out = _tq(qmodel, node.output, node.name)
        if isinstance(node, (Conv2D, Dense)):
            if node.name not in qmodel.layers:
                raise GraphError(node.name, "layer has no quantized weights")
            scales = qmodel.layers[node.name].weight_scales
            stages[node.name] = ki.prepare_output_stage(inp, scales, out, node.activation)
        elif isinstance(node, Add):
            other = _tq(qmodel, node.inputs[1], node.name)
            stages[node.name] = ki.prepare_add(inp, other, out, node.activation)
        elif isinstance(node, (ReLU, ReLU6)):
            stages[node.name] = ki.prepare_relu(inp, out, isinstance(node, ReLU6))
        elif isinstance(node, Mul):
            other = _tq(qmodel, node.inputs[1], node.name)
            stages[node.name] = ki.prepare_mul(inp, other, out, node.activation)
        elif isinstance(node, TABLE_NODES):
            stages[node.name] = unary_table(node, inp, out)
        elif isinstance(node, Mean):
            h, w = shapes[node.inputs[0]][:2]
            stages[node.name] = ki.prepare_mean(inp, out, h * w)
        elif isinstance(node, Pad):
            stages[node.name] = out.zero_point  # PAD fills with the output zero point
        # Pools and Reshape do not rescale: TFLite's int8 kernels assume (debug-check
        # only) that the output shares the input's parameters and ignore the output's.
    return stages


def _int8_node(node: Node, env: Env, ctx: _Ctx) -> Array:
    """One INT8 node on ``ctx.kernels``: one call per layer for all P copies and N samples."""
    x = env[node.inputs[0]]
    assert ctx.stages is not None
    # OutputStage or AddParams by node type; None for the ops that do not rescale.
    stage: Any = ctx.stages.get(node.name)
    sr, kernels = ROUNDING_BY_OP, ctx.kernels
    y: Array
    if isinstance(node, Conv2D):
        w, b = ctx.weights[node.name]
        if node.depthwise:
            y = kernels.depthwise_conv2d(
                x, w, b, stage, node.stride, node.padding, sr["depthwise_conv2d"]
            )
        elif kernels is native:
            y = native.conv2d(x, w, b, stage, node.stride, node.padding, node.groups, sr["conv2d"])
        else:
            cols = _cached_patches(node, x, stage, ctx)
            y = ki.conv2d(
                x, w, b, stage, node.stride, node.padding, node.groups, sr["conv2d"], cols
            )
    elif isinstance(node, Dense):
        w, b = ctx.weights[node.name]
        y = kernels.dense(x.reshape(*x.shape[:2], -1), w, b, stage, sr["dense"])
    elif isinstance(node, Add):
        y = kernels.add(x, env[node.inputs[1]], stage, sr["add"])
    elif isinstance(node, (ReLU, ReLU6)):
        y = ki.relu(x, stage, sr["relu"])
    elif isinstance(node, TABLE_NODES):
        y = look_up(x, stage)
    elif isinstance(node, Mean):
        y = ki.mean(x, stage, node.keep_dims)
    elif isinstance(node, Pad):
        y = ki.pad(x, node.pads, stage)
    elif isinstance(node, Concat):
        y = _concat(x, env[node.inputs[1]])
    elif isinstance(node, Mul):
        y = ki.mul(x, env[node.inputs[1]], stage, sr["mul"])
    else:
        y = _shape_op(node, x, ki)
    return y


def _cached_patches(node: Conv2D, x: Array, stage: ki.OutputStage, ctx: _Ctx) -> Array | None:
    """A shared input's patches are built once per call and reused by every chunk of P."""
    if node.inputs[0] not in ctx.shared:
        return None
    if node.name not in ctx.cache:
        kernel = (node.weight.shape[1], node.weight.shape[2])
        ig = node.weight.shape[3]
        ctx.cache[node.name] = ki.patches(
            x, kernel, node.stride, node.padding, stage.input_zero_point, ig
        )
    return ctx.cache[node.name]


# ----------------------------------------------------------------------- interpreter

_NodeFn: TypeAlias = Callable[[Node, Env, _Ctx], Array]


def _run(
    model: Model,
    env: Env,
    start: int,
    stop: int,
    ctx: _Ctx,
    fn: _NodeFn,
    last: dict[str, int] | None = None,
) -> Env:
    """Run nodes [start, stop) on stacked tensors, dropping tensors after their last use."""
    last = ctx.plan.last_use if last is None else last
    for i in range(start, stop):
        node = model.nodes[i]
        env[node.output] = fn(node, env, ctx)
        for name in node.inputs:
            if last.get(name, -1) <= i:
                env.pop(name, None)
    return env


def _check_weight(node: Node, given: Array, expected: tuple[int, ...], what: str) -> None:
    if tuple(given.shape) != expected:
        raise GraphError(node.name, f"{what} shape {tuple(given.shape)} != expected {expected}")


def _start_env(model: Model, x: Array | Activations, quantized: bool) -> tuple[Env, int]:
    """Stacked (set axis 1) tensors to start from, and the index of the first node to run."""
    if isinstance(x, Activations):
        if x.quantized != quantized:
            raise GraphError(
                model.input_name, "activations were computed in the other numeric mode"
            )
        return {k: v[None] for k, v in x.tensors.items()}, x.position
    arr = np.asarray(x)
    if tuple(arr.shape[1:]) != tuple(model.input_shape):
        raise GraphError(
            model.input_name, f"input shape {arr.shape[1:]} != model input {model.input_shape}"
        )
    if quantized and arr.dtype != np.int8:
        raise GraphError(model.input_name, f"INT8 input must be int8, got {arr.dtype}")
    dtype = np.int8 if quantized else np.float32
    return {model.input_name: arr.astype(dtype, copy=False)[None]}, 0


def _fp32_weights(
    model: Model, params: Mapping[str, tuple[Array, Array]] | None, stacked: bool
) -> dict[str, tuple[Array, Array]]:
    params = params or {}
    unknown = set(params) - {n.name for n in model.param_nodes()}
    if unknown:
        raise GraphError(sorted(unknown)[0], "not a parametrised layer of the model")
    out: dict[str, tuple[Array, Array]] = {}
    for node in model.param_nodes():
        if node.name in params:
            w, b = (np.asarray(a, dtype=np.float32) for a in params[node.name])
            lead = (w.shape[0],) if stacked else ()
            _check_weight(node, w, (*lead, *node.weight.shape), "weight")
            _check_weight(node, b, (*lead, *node.bias.shape), "bias")
            out[node.name] = (w, b) if stacked else (w[None], b[None])
        else:
            out[node.name] = (
                node.weight.astype(np.float32)[None],
                node.bias.astype(np.float32)[None],
            )
    return out


def _int8_weights(
    qmodel: QuantModel, weights: Mapping[str, Array] | None, stacked: bool
) -> dict[str, tuple[Array, Array]]:
    weights = weights or {}
    nodes = qmodel.model.param_nodes()
    unknown = set(weights) - {n.name for n in nodes}
    if unknown:
        raise GraphError(sorted(unknown)[0], "not a parametrised layer of the model")
    out: dict[str, tuple[Array, Array]] = {}
    for node in nodes:
        layer = qmodel.layers.get(node.name)
        if layer is None:
            raise GraphError(node.name, "layer has no quantized weights")
        bias = layer.bias.astype(np.int64)[None]
        if node.name in weights:
            w = np.asarray(weights[node.name])
            if w.dtype != np.int8:
                raise GraphError(node.name, f"int8 weights expected, got {w.dtype}")
            lead = (w.shape[0],) if stacked else ()
            _check_weight(node, w, (*lead, *layer.weight.shape), "weight")
            out[node.name] = (w if stacked else w[None], bias)
        else:
            out[node.name] = (layer.weight[None], bias)
    return out


def _first_index(model: Model, names: Iterable[str]) -> int:
    wanted = set(names)
    for i, node in enumerate(model.nodes):
        if node.name in wanted:
            return i
    return len(model.nodes)


def _chunk_size(
    model: Model, plan: _Plan, start: int, batch: int, sets: int, max_bytes: int
) -> int:
    """How many perturbed copies fit the budget: the widest node output plus its patches.

    Lean kernels (the native INT8 ones) build no patches and no wide temporaries: a copy
    then needs its int8 tensors only (input, output and a skip connection live at once).
    """
    widest = 1
    for node in model.nodes[start:]:
        size = int(np.prod(plan.shapes[node.output]))
        if isinstance(node, Conv2D) and not node.depthwise and not plan.lean:
            size += size // node.weight.shape[0] * int(np.prod(node.weight.shape[1:])) * node.groups
        widest = max(widest, size)
    # Float64 intermediates, and a factor for the temporaries of one kernel.
    per_copy = widest * batch * (3 if plan.lean else 8 * 3)
    return int(max(1, min(sets, max_bytes // per_copy)))


def _run_by_samples(
    model: Model, env: Env, start: int, stop: int, ctx: _Ctx, fn: _NodeFn, max_bytes: int
) -> Env:
    """``_run`` over slices of the samples that fit the budget (results do not depend on it)."""
    n = int(next(iter(env.values())).shape[1])
    per = _chunk_size(model, ctx.plan, start, 1, n, max_bytes)
    if per >= n:
        return _run(model, env, start, stop, ctx, fn)
    parts = [
        _run(model, {k: v[:, i : i + per] for k, v in env.items()}, start, stop, ctx, fn)
        for i in range(0, n, per)
    ]
    return {k: np.concatenate([part[k] for part in parts], axis=1) for k in parts[0]}


def _evaluate(
    model: Model,
    env: Env,
    start: int,
    ctx: _Ctx,
    fn: _NodeFn,
    sets: dict[str, tuple[Array, Array]] | None,
    max_bytes: int,
) -> Array:
    """Run the model; with ``sets``, P stacked copies in chunks after a shared prefix."""
    if not sets:
        return _run_by_samples(model, env, start, len(model.nodes), ctx, fn, max_bytes)[
            model.output_name
        ]
    first = max(start, _first_index(model, sets))
    env = _run_by_samples(model, env, start, first, ctx, fn, max_bytes)
    ctx.shared = frozenset(env)
    p = next(iter(sets.values()))[0].shape[0]
    batch = next(iter(env.values())).shape[1]
    chunk = _chunk_size(model, ctx.plan, first, batch, p, max_bytes)
    outs = []
    base = dict(ctx.weights)
    for c0 in range(0, p, chunk):
        ctx.weights = {
            **base,
            **{
                k: (w[c0 : c0 + chunk], b if b.shape[0] == 1 else b[c0 : c0 + chunk])
                for k, (w, b) in sets.items()
            },
        }
        y = _run(model, dict(env), first, len(model.nodes), ctx, fn)[model.output_name]
        outs.append(np.broadcast_to(y, (min(chunk, p - c0), *y.shape[1:])))
    ctx.weights = base
    return np.concatenate(outs, axis=0)


# ------------------------------------------------------------------------ public API


def run_fp32(
    model: Model,
    x: Array | Activations,
    params: Mapping[str, tuple[Array, Array]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> F32:
    """FP32 forward pass.

    Args:
        model: the float model.
        x: ``(N, *input_shape)`` float input, or ``prefix_activations`` of it.
        params: layer name -> ``(W, b)`` replacing that layer's weights.
        max_bytes: working-set budget; a large batch runs in slices of samples.

    Returns:
        ``(N, num_classes)`` float32 logits (the output tensor).
    """
    plan = _Plan.of(model)
    env, start = _start_env(model, x, quantized=False)
    _check_after_prefix(model, params or {}, start)
    ctx = _Ctx(_fp32_weights(model, params, stacked=False), {}, plan)
    return np.ascontiguousarray(_evaluate(model, env, start, ctx, _fp32_node, None, max_bytes)[0])


def run_fp32_perturbed(
    model: Model,
    x: Array | Activations,
    param_sets: Mapping[str, tuple[Array, Array]],
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> F32:
    """P FP32 forward passes under P weight sets of some layers, sharing what is shared.

    Args:
        model: the float model.
        x: ``(N, *input_shape)`` input, or ``prefix_activations`` of it.
        param_sets: layer name -> ``(W (P, ...), b (P, ...))``; other layers keep theirs.
        max_bytes: working-set budget for one chunk of copies.

    Returns:
        ``(P, N, num_classes)`` float32; ``[p]`` equals ``run_fp32`` with the p-th weights.
    """
    plan = _Plan.of(model)
    _check_set_count(param_sets.values(), lambda v: np.shape(v[0])[0])
    env, start = _start_env(model, x, quantized=False)
    _check_after_prefix(model, param_sets, start)
    weights = _fp32_weights(model, None, stacked=False)
    sets = _fp32_weights(model, param_sets, stacked=True)
    sets = {k: sets[k] for k in param_sets}
    ctx = _Ctx(weights, {}, plan)
    return np.ascontiguousarray(_evaluate(model, env, start, ctx, _fp32_node, sets, max_bytes))


@dataclass(frozen=True)
class PreparedInt8:
    """An INT8 model after TFLite's Prepare, done once; evaluate it many times.

    Holds what does not change between forward passes: tensor shapes and last uses,
    requantisation parameters (multipliers, shifts, activation ranges), the frozen
    layers' weights, and the kernel module (native or numpy, chosen once). A ZO step
    evaluates 2q weight sets of the same model, so the workload prepares it once.
    """

    qmodel: QuantModel
    plan: _Plan
    stages: dict[str, Any]
    weights: dict[str, tuple[Array, Array]]
    kernels: Any

    def context(self) -> _Ctx:
        """A fresh evaluation context (its own patch cache) over the prepared state."""
        return _Ctx(dict(self.weights), {}, self.plan, self.stages, self.kernels)


def prepare_int8(qmodel: QuantModel, *, use_native: bool | None = None) -> PreparedInt8:
    """TFLite's Prepare for the whole model: validate it and compute what Eval reuses.

    Args:
        qmodel: the quantized model.
        use_native: the C kernels (True), the numpy kernels (False) or the C kernels when
            they are built (None); both give the same bits.

    Returns:
        The prepared model, for ``run_int8`` and ``run_int8_perturbed``.

    Raises:
        GraphError: a tensor without quantisation parameters or a layer without weights.
        NativeError: ``use_native`` is True but the C kernels are not available.
    """
    lean = native.available() if use_native is None else use_native
    if lean and not native.available():
        raise native.NativeError("native INT8 kernels are not available (see the logged warning)")
    plan = _Plan.of(qmodel.model, lean)
    weights = _int8_weights(qmodel, None, stacked=False)
    stages = _prepare_int8(qmodel, plan.shapes)
    return PreparedInt8(qmodel, plan, stages, weights, native if lean else ki)


def _prepared(model: QuantModel | PreparedInt8) -> PreparedInt8:
    return model if isinstance(model, PreparedInt8) else prepare_int8(model)


def run_int8(
    qmodel: QuantModel | PreparedInt8,
    x_q: Array | Activations,
    weights: Mapping[str, Array] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> I8:
    """INT8 forward pass with TFLite reference-kernel semantics.

    Args:
        qmodel: the quantized model, or ``prepare_int8`` of it (saves the preparation).
        x_q: ``(N, *input_shape)`` int8 input (see ``quantize.quantize_input``), or
            ``prefix_activations`` of it.
        weights: layer name -> int8 weight replacing that layer's.
        max_bytes: working-set budget; a large batch runs in slices of samples.

    Returns:
        ``(N, num_classes)`` int8 logits.
    """
    prepared = _prepared(qmodel)
    model = prepared.qmodel.model
    env, start = _start_env(model, x_q, quantized=True)
    _check_after_prefix(model, weights or {}, start)
    ctx = prepared.context()
    if weights:
        ctx.weights.update(_int8_weights(prepared.qmodel, weights, stacked=False))
    return np.ascontiguousarray(_evaluate(model, env, start, ctx, _int8_node, None, max_bytes)[0])


def run_int8_perturbed(
    qmodel: QuantModel | PreparedInt8,
    x_q: Array | Activations,
    weight_sets: Mapping[str, Array],
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> I8:
    """P INT8 forward passes under P int8 weight sets of some layers.

    Args:
        qmodel: the quantized model, or ``prepare_int8`` of it (saves the preparation).
        x_q: ``(N, *input_shape)`` int8 input, or ``prefix_activations`` of it.
        weight_sets: layer name -> int8 array ``(P, *weight.shape)``.
        max_bytes: working-set budget for one chunk of copies.

    Returns:
        ``(P, N, num_classes)`` int8; ``[p]`` equals ``run_int8`` with the p-th weights.
    """
    prepared = _prepared(qmodel)
    model = prepared.qmodel.model
    _check_set_count(weight_sets.values(), lambda v: np.shape(v)[0])
    env, start = _start_env(model, x_q, quantized=True)
    _check_after_prefix(model, weight_sets, start)
    sets = _int8_weights(prepared.qmodel, weight_sets, stacked=True)
    sets = {k: sets[k] for k in weight_sets}
    ctx = prepared.context()
    return np.ascontiguousarray(_evaluate(model, env, start, ctx, _int8_node, sets, max_bytes))


def _check_set_count(values: Iterable[Any], count: Callable[[Any], int]) -> None:
    counts = {count(v) for v in values}
    if not counts:
        raise ValueError("no weight sets given: name at least one layer")
    if len(counts) > 1:
        raise ValueError(f"weight sets disagree on the number of copies P: {sorted(counts)}")
    if 0 in counts:
        raise ValueError("weight sets hold no copies (P = 0)")


def _check_after_prefix(model: Model, names: Iterable[str], start: int) -> None:
    """Weights given for a layer inside a cached prefix would be silently ignored."""
    done = {node.name for node in model.nodes[:start]}
    for name in names:
        if name in done:
            raise GraphError(
                name, "layer lies inside the cached prefix; its weights cannot change here"
            )


def fp32_tensors(model: Model, x: Array) -> dict[str, F32]:
    """Every tensor of an FP32 forward pass, batch first (for calibration and debugging).

    Args:
        model: the float model.
        x: ``(N, *input_shape)`` input.

    Returns:
        Tensor name -> ``(N, ...)`` float32 values, the input included.
    """
    env, _ = _start_env(model, x, quantized=False)
    ctx = _Ctx(_fp32_weights(model, None, stacked=False), {}, _Plan.of(model))
    return _every_tensor(model, env, ctx, _fp32_node)


def int8_tensors(qmodel: QuantModel | PreparedInt8, x_q: Array) -> dict[str, I8]:
    """Every tensor of an INT8 forward pass, batch first (``fp32_tensors`` in INT8).

    Args:
        qmodel: the quantized model, or ``prepare_int8`` of it.
        x_q: ``(N, *input_shape)`` int8 input.

    Returns:
        Tensor name -> ``(N, ...)`` int8 values, the input included.
    """
    prepared = _prepared(qmodel)
    model = prepared.qmodel.model
    env, _ = _start_env(model, x_q, quantized=True)
    return _every_tensor(model, env, prepared.context(), _int8_node)


def _every_tensor(model: Model, env: Env, ctx: _Ctx, fn: _NodeFn) -> dict[str, Array]:
    """Run the whole model keeping every tensor (none dropped after its last use)."""
    keep = {name: len(model.nodes) for node in model.nodes for name in node.inputs}
    env = _run(model, env, 0, len(model.nodes), ctx, fn, keep)
    return {k: v[0] for k, v in env.items()}


def prefix_activations(
    model: Model | QuantModel,
    x: Array,
    trainable: str | Iterable[str],
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Activations:
    """Run the frozen prefix (the nodes before the first trainable layer) once.

    A whole data set may go in: samples run in slices that fit ``max_bytes``.

    Args:
        model: a float ``Model`` (FP32) or a ``QuantModel`` (INT8, then ``x`` is int8).
        x: ``(N, *input_shape)`` input.
        trainable: the trainable layer name(s).
        max_bytes: working-set budget.

    Returns:
        The live tensors at the first trainable layer; pass them as ``x`` to ``run_*``.
    """
    names = [trainable] if isinstance(trainable, str) else list(trainable)
    quantized = isinstance(model, QuantModel)
    graph = model.model if isinstance(model, QuantModel) else model
    known = {n.name for n in graph.nodes}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise GraphError(unknown[0], "no such layer")
    stop = _first_index(graph, names)
    env, start = _start_env(graph, x, quantized)
    if isinstance(model, QuantModel):
        ctx = prepare_int8(model).context()
        fn: _NodeFn = _int8_node
    else:
        ctx = _Ctx(_fp32_weights(graph, None, stacked=False), {}, _Plan.of(graph))
        fn = _fp32_node
    env = _run_by_samples(graph, env, start, stop, ctx, fn, max_bytes)
    return Activations(stop, {k: np.ascontiguousarray(v[0]) for k, v in env.items()}, quantized)


def bench_engine(
    qmodel: QuantModel,
    batch: int = 64,
    sets: int = 128,
    trainable: Iterable[str] | None = None,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, float]:
    """Micro-benchmark of the INT8 engine (a CLI helper, not a test).

    Args:
        qmodel: model to time.
        batch: samples per forward pass.
        sets: perturbed copies P.
        trainable: layers perturbed (default: all parametrised layers).
        repeats: timing repetitions (the best is reported).
        seed: input data seed.

    Returns:
        Seconds for one plain pass, for P looped passes (estimated from one), and for the
        batched P-copy evaluation, plus the speed-up.
    """
    rng = np.random.default_rng(seed)
    model = qmodel.model
    x = rng.integers(-128, 128, size=(batch, *model.input_shape), dtype=np.int8)
    names = list(trainable) if trainable is not None else [n.name for n in model.param_nodes()]
    wsets = {}
    for name in names:
        w = qmodel.layers[name].weight
        noise = rng.choice(np.array([-1, 1], np.int16), size=(sets, *w.shape))
        wsets[name] = np.clip(w.astype(np.int16) + noise, -127, 127).astype(np.int8)

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    prepared = prepare_int8(qmodel)
    single = best(lambda: run_int8(prepared, x))
    batched = best(lambda: run_int8_perturbed(prepared, x, wsets))
    looped = single * sets
    return {
        "single_s": single,
        "looped_estimate_s": looped,
        "batched_s": batched,
        "speedup": looped / batched,
    }
