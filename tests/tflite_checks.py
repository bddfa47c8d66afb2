"""What the ``.tflite`` tests share: the LiteRT interpreter as the oracle (its reference
kernels, every tensor kept, compared with the engine tensor by tensor), the check that
an export changed nothing of the user's file but one layer's weights, and a synthetic
image set of any input shape to train imported models on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from ai_edge_litert.interpreter import Interpreter, OpResolverType

from qsched.zo.engine import run_int8
from qsched.zo.graph import Model, QuantModel


def interpreter(
    data: bytes, input_shape: Sequence[int] | None = None, *, reference: bool = True
) -> Interpreter:
    """An interpreter on ``data`` that keeps every tensor, resized to ``input_shape``
    (with the batch) when given; ``reference`` picks LiteRT's reference kernels."""
    resolver = (
        OpResolverType.BUILTIN_REF
        if reference
        else OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    )
    it = Interpreter(
        model_content=data,
        experimental_op_resolver_type=resolver,
        experimental_preserve_all_tensors=True,
    )
    if input_shape is not None:
        it.resize_tensor_input(it.get_input_details()[0]["index"], list(input_shape))
    it.allocate_tensors()
    return it


Tensors = Callable[[str], np.ndarray]


def invoke(it: Interpreter, fed: np.ndarray) -> Tensors:
    """Run ``fed`` through ``it``; returns the tensor of a given name after the run."""
    it.set_tensor(it.get_input_details()[0]["index"], fed)
    it.invoke()
    index = {d["name"]: d["index"] for d in it.get_tensor_details()}
    return lambda name: it.get_tensor(index[name])


def truncated(qm: QuantModel, k: int) -> QuantModel:
    """The model up to and including node k, whose output becomes the model output."""
    m = qm.model
    nodes = m.nodes[: k + 1]
    sub = Model(m.name, m.input_name, m.input_shape, nodes, nodes[-1].output, m.num_classes)
    names = {n.name for n in nodes}
    return QuantModel(sub, qm.tensors, {n: lay for n, lay in qm.layers.items() if n in names})


def assert_every_tensor(qm: QuantModel, tensor: Tensors, x: np.ndarray) -> None:
    """Each node's output from the engine on ``x`` equals LiteRT's tensor of that name."""
    for k, node in enumerate(qm.model.nodes):
        ours = run_int8(truncated(qm, k), x)
        theirs = tensor(node.output)
        assert ours.shape == theirs.shape, node.name
        np.testing.assert_array_equal(ours, theirs, err_msg=f"layer {node.name}")


def assert_only_layer_changed(
    exported: bytes, original: bytes, qm: QuantModel, layer: str, *, moved: bool = True
) -> None:
    """``exported`` is ``original`` with bytes changed inside ``layer``'s weights only (and,
    when ``moved``, some changed: the layer did train)."""
    assert qm.source is not None and len(exported) == len(original)
    start, length = qm.source.weight_bytes[layer]
    changed = np.flatnonzero(np.frombuffer(exported, np.uint8) != np.frombuffer(original, np.uint8))
    assert changed.size or not moved
    assert not changed.size or (start <= changed.min() and changed.max() < start + length)


def synthetic_images(shape: Sequence[int], path: Path, count: int = 200) -> Path:
    """A 10-class image set of ``shape`` written as ``.npz`` (4/5 train, 1/5 val); the
    class shifts the pixel values, so there is something to learn."""
    rng = np.random.default_rng(0)
    y = np.arange(count) % 10
    x = rng.random((count, *shape), dtype=np.float32) * 0.5 + (y / 20.0).reshape(-1, 1, 1, 1)
    cut = count * 4 // 5
    np.savez(path, x_train=x[:cut], y_train=y[:cut], x_val=x[cut:], y_val=y[cut:])
    return path
