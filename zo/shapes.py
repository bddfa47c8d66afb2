"""Shape inference: every tensor's shape (without the batch axis), checking the graph.

The one place that knows how each node maps input shapes to its output shape; the
engine, the zoo's builder, the blob encoder and the board budgets all use it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from qsched.zo import kernels_fp32 as kf
from qsched.zo.errors import GraphError
from qsched.zo.graph import (
    Add,
    AvgPool,
    Concat,
    Conv2D,
    Dense,
    GlobalAvgPool,
    MaxPool,
    Mean,
    Model,
    Mul,
    Node,
    Pad,
    Reshape,
)

__all__ = ["Shape", "infer_shapes", "node_shape"]

Shape = tuple[int, ...]


def _hwc(node: Node, shape: Shape, what: str) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise GraphError(node.name, f"{what} needs an (H, W, C) input, got {shape}")
    return shape[0], shape[1], shape[2]


def _conv_shape(node: Conv2D, shape: Shape) -> Shape:
    h, w, c = _hwc(node, shape, "Conv2D")
    if node.weight.ndim != 4:
        raise GraphError(node.name, f"weight must be 4-D, got shape {node.weight.shape}")
    if node.depthwise:
        _, kh, kw, o = node.weight.shape
        if node.weight.shape[0] != 1 or o % c:
            raise GraphError(
                node.name, f"depthwise weight {node.weight.shape} does not fit {c} input channels"
            )
    else:
        o, kh, kw, ig = node.weight.shape
        if c % node.groups or o % node.groups or ig * node.groups != c:
            raise GraphError(
                node.name,
                f"weight {node.weight.shape} with groups={node.groups} "
                f"does not fit {c} input channels",
            )
    if node.bias.shape != (o,):
        raise GraphError(node.name, f"bias shape {node.bias.shape} != ({o},)")
    oh = kf.out_size(h, kh, node.stride[0], node.padding)
    ow = kf.out_size(w, kw, node.stride[1], node.padding)
    if oh < 1 or ow < 1:
        raise GraphError(node.name, f"kernel {kh}x{kw} does not fit input {h}x{w}")
    return (oh, ow, int(o))


def _dense_shape(node: Dense, shape: Shape) -> Shape:
    features = int(np.prod(shape))
    if node.weight.ndim != 2 or node.weight.shape[1] != features:
        raise GraphError(
            node.name, f"weight {node.weight.shape} does not take {features} input features {shape}"
        )
    if node.bias.shape != (node.weight.shape[0],):
        raise GraphError(node.name, f"bias shape {node.bias.shape} != ({node.weight.shape[0]},)")
    return (int(node.weight.shape[0]),)


def _pool_shape(node: AvgPool | MaxPool, shape: Shape) -> Shape:
    h, w, c = _hwc(node, shape, "pooling")
    oh = kf.out_size(h, node.pool[0], node.stride[0], node.padding)
    ow = kf.out_size(w, node.pool[1], node.stride[1], node.padding)
    if oh < 1 or ow < 1:
        raise GraphError(node.name, f"pool {node.pool} does not fit input {shape}")
    return (oh, ow, c)


def _pad_shape(node: Pad, shape: Shape) -> Shape:
    h, w, c = _hwc(node, shape, "Pad")
    (top, bottom), (left, right) = node.pads
    if min(top, bottom, left, right) < 0:
        raise GraphError(node.name, f"negative padding {node.pads}")
    return (h + top + bottom, w + left + right, c)


def node_shape(node: Node, shapes: Mapping[str, Shape]) -> Shape:
    """The output shape of ``node`` given the shapes of the tensors before it.

    Raises:
        GraphError: it reads a tensor not yet written, or the shapes do not fit.
    """
    missing = [name for name in node.inputs if name not in shapes]
    if missing:
        raise GraphError(node.name, f"reads tensors not produced before it: {missing}")
    ins = [tuple(shapes[name]) for name in node.inputs]
    shape = ins[0]
    if isinstance(node, Conv2D):
        return _conv_shape(node, shape)
    if isinstance(node, Dense):
        return _dense_shape(node, shape)
    if isinstance(node, Add):
        if len(ins) != 2 or ins[0] != ins[1]:
            raise GraphError(node.name, f"Add needs two inputs of one shape, got {ins}")
        return shape
    if isinstance(node, AvgPool | MaxPool):
        return _pool_shape(node, shape)
    if isinstance(node, GlobalAvgPool):
        return (_hwc(node, shape, "global pooling")[2],)
    if isinstance(node, Mean):
        c = _hwc(node, shape, "Mean")[2]
        return (1, 1, c) if node.keep_dims else (c,)
    if isinstance(node, Pad):
        return _pad_shape(node, shape)
    if isinstance(node, Mul):
        gate = (
            len(ins) == 2 and len(ins[1]) == 3 and ins[1][:2] == (1, 1) and ins[1][2] == shape[-1]
        )
        if len(ins) != 2 or (ins[0] != ins[1] and not (len(shape) == 3 and gate)):
            raise GraphError(
                node.name, f"Mul needs equal shapes or an (H, W, C) x (1, 1, C), got {ins}"
            )
        return shape
    if isinstance(node, Concat):
        if len(ins) != 2 or len(ins[0]) != len(ins[1]) or ins[0][:-1] != ins[1][:-1]:
            raise GraphError(
                node.name, f"Concat needs two tensors differing in channels, got {ins}"
            )
        return (*shape[:-1], shape[-1] + ins[1][-1])
    if isinstance(node, Reshape):
        if int(np.prod(node.shape)) != int(np.prod(shape)):
            raise GraphError(node.name, f"cannot reshape {shape} to {node.shape}")
        return tuple(node.shape)
    return shape  # ReLU, ReLU6


def infer_shapes(model: Model) -> dict[str, Shape]:
    """Shape (without the batch axis) of every tensor; raises ``GraphError`` on a mismatch.

    Args:
        model: the graph.

    Returns:
        Tensor name to shape, for the input and every node output.
    """
    shapes: dict[str, Shape] = {model.input_name: tuple(model.input_shape)}
    for node in model.nodes:
        if node.output in shapes:
            raise GraphError(node.name, f"writes tensor {node.output!r} a second time")
        shapes[node.output] = node_shape(node, shapes)
    if model.output_name not in shapes:
        raise GraphError(model.output_name, "model output is not produced by any layer")
    return shapes
