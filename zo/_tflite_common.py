"""Shared pieces of the ``.tflite`` reader and writer: the schema module, errors, names.

The flatbuffer schema comes from the module generated for LiteRT
(``ai_edge_litert.schema_py_generated``); TensorFlow is not needed.
"""

from __future__ import annotations

from typing import Any

import flatbuffers
from ai_edge_litert import schema_py_generated as _schema

from qsched.zo.errors import TFLiteError, TFLiteFormatError
from qsched.zo.graph import Activation

__all__ = [
    "FILE_IDENTIFIER",
    "METADATA_NAME",
    "SCHEMA_VERSION",
    "TFLiteError",
    "TFLiteFormatError",
    "activation_code",
    "activation_name",
    "op_name",
    "pack_model",
    "schema",
]

schema: Any = _schema

FILE_IDENTIFIER = b"TFL3"
SCHEMA_VERSION = 3
# Metadata entry holding what TFLite has no field for (model and layer names, classes).
METADATA_NAME = "qsched.graph"

_OP_NAMES: dict[int, str] = {
    value: key
    for key, value in vars(_schema.BuiltinOperator).items()
    if not key.startswith("_") and isinstance(value, int)
}

_ACT_CODES: dict[Activation, int] = {
    "none": _schema.ActivationFunctionType.NONE,
    "relu": _schema.ActivationFunctionType.RELU,
    "relu6": _schema.ActivationFunctionType.RELU6,
}


def op_name(code: int) -> str:
    """The builtin operator's schema name (``CONV_2D``) for its numeric code."""
    return _OP_NAMES.get(code, f"builtin operator #{code}")


def activation_code(activation: Activation) -> int:
    """The schema's fused-activation code for a graph activation name."""
    return int(_ACT_CODES[activation])


def activation_name(code: int, where: str) -> Activation:
    """The graph activation name for a fused-activation code.

    Args:
        code: ``ActivationFunctionType`` value read from the file.
        where: the operator, for the error message.

    Returns:
        ``"none"``, ``"relu"`` or ``"relu6"``.
    """
    for name, value in _ACT_CODES.items():
        if value == code:
            return name
    raise TFLiteError(f"{where}: unsupported fused activation (ActivationFunctionType {code})")


def pack_model(model: Any) -> bytes:
    """The ``.tflite`` bytes of a schema ``ModelT`` (object API), file identifier included."""
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())
