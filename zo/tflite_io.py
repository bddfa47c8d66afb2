"""``.tflite`` import and export of INT8 models.

A model imported from a user's file is written back in that file's form (see
``qsched.zo.source``). qsched's own form, for the models it quantises itself, is a
microcontroller model: int8 input and output with their quantisation parameters,
per-channel symmetric int8 weights, int32 biases. It runs in
the LiteRT interpreter and gives the INT8 engine's outputs bit for bit with the
reference kernels. Reading it back returns the same graph, weights and scales. A float
model is quantised first (``qsched.zo.quantize``); there is no FP32 export.

Tensor names in the file: activations keep their graph names; a layer's parameters are
``<layer>/weight`` and ``<layer>/bias``.
"""

from __future__ import annotations

import os
from pathlib import Path

from qsched.zo._tflite_common import TFLiteError, TFLiteFormatError
from qsched.zo._tflite_export import build_tflite
from qsched.zo._tflite_import import parse_tflite
from qsched.zo.graph import QuantModel

__all__ = [
    "TFLiteError",
    "TFLiteFormatError",
    "export_tflite",
    "import_tflite",
    "read_tflite",
    "weight_tensor_name",
    "write_tflite",
]


def weight_tensor_name(layer: str) -> str:
    """The ``.tflite`` tensor name of a layer's int8 weight (to feed it as an input)."""
    return f"{layer}/weight"


def export_tflite(
    qmodel: QuantModel,
    *,
    batch: int = 1,
    weights_as_inputs: bool = False,
    own_form: bool = False,
) -> bytes:
    """Serialise an INT8 model as ``.tflite`` bytes.

    An imported model is written in the form of the file it came from (its operators,
    tensors, names, types and quantisation, its QUANTIZE, SOFTMAX and DEQUANTIZE), only
    the trained weight bytes changed, so it replaces the original wherever that ran.

    Args:
        qmodel: the quantised model.
        batch: batch dimension of the input and activation shapes (an interpreter can
            resize it later; qsched's own form only).
        weights_as_inputs: make the int8 weights graph inputs instead of constants, so
            one interpreter can evaluate many weight sets (perturbations); such a file
            is for evaluation and cannot be imported back (qsched's own form).
        own_form: write qsched's own form (int8 in and out, no adapters) even for an
            imported model.

    Returns:
        The file's bytes.

    Raises:
        TFLiteError: a layer has no ``.tflite`` form or lacks quantisation parameters.
    """
    source = qmodel.source
    if source is not None and not (own_form or weights_as_inputs):
        layers = qmodel.layers
        return source.with_weights(
            {name: layer.weight for name, layer in layers.items()},
            scales={name: layer.weight_scales for name, layer in layers.items()},
            biases={name: layer.bias for name, layer in layers.items()},
        )
    data: bytes = build_tflite(qmodel, batch=batch, weights_as_inputs=weights_as_inputs)
    return data


def import_tflite(data: bytes) -> QuantModel:
    """Read an int8 ``.tflite`` model.

    Args:
        data: the file's bytes.

    Returns:
        The INT8 model; float weights on the graph are the dequantised int8 weights.

    Raises:
        TFLiteFormatError: the bytes are not a well-formed ``.tflite`` flatbuffer.
        TFLiteError: the model uses an operator or feature we do not support (the
            message names it).
    """
    return parse_tflite(data)


def write_tflite(path: str | os.PathLike[str], qmodel: QuantModel) -> None:
    """Write ``qmodel`` to ``path`` atomically (temporary file, fsync, rename).

    Args:
        path: destination file.
        qmodel: the quantised model.
    """
    data = export_tflite(qmodel)
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def read_tflite(path: str | os.PathLike[str]) -> QuantModel:
    """Read an int8 ``.tflite`` model from ``path``.

    Args:
        path: the file.

    Returns:
        The INT8 model (see ``import_tflite``).

    Raises:
        TFLiteError: as ``import_tflite``, the message led by the file's path.
        OSError: the file cannot be read.
    """
    try:
        return import_tflite(Path(path).read_bytes())
    except TFLiteError as exc:
        raise type(exc)(f"{path}: {exc}") from None
