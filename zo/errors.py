"""The numeric core's errors, one place for all of them: each says what input was wrong.

Every one is a ValueError or RuntimeError subclass with a sentence a user can act on;
the modules that raise them import them from here."""

from __future__ import annotations

__all__ = [
    "BackpropError",
    "BlobError",
    "DatasetError",
    "GraphError",
    "IntLossError",
    "LossError",
    "NativeError",
    "StateError",
    "TFLiteError",
    "TFLiteFormatError",
    "WorkloadError",
    "ZooError",
]


class DatasetError(ValueError):
    """A data set that cannot be found, read or split as asked."""


class GraphError(ValueError):
    """A malformed graph: the message names the node (layer) at fault."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(f"layer {node!r}: {message}")
        self.node = node


class WorkloadError(ValueError):
    """A job spec the workload cannot build (unknown layer, backbone mismatch, ...)."""


class StateError(ValueError):
    """A train state that does not fit the workload, or bytes that are not a state."""


class ZooError(ValueError):
    """An unknown model name or an option the model cannot honour."""


class TFLiteError(ValueError):
    """A model that cannot be written as, or read from, a ``.tflite`` file we support."""


class TFLiteFormatError(TFLiteError):
    """The bytes are not a well-formed ``.tflite`` flatbuffer."""


class BlobError(ValueError):
    """Bytes that are not a valid blob, or a model the format cannot carry."""


class LossError(ValueError):
    """A loss that cannot enter the estimate (NaN, infinite, or missing)."""

    def __init__(self, message: str, k: int | None = None) -> None:
        super().__init__(message)
        self.k = k


class IntLossError(ValueError):
    """Inputs the integer loss cannot represent (bad scale, label, shape)."""


class BackpropError(ValueError):
    """A training request the trainer cannot honour (bad layer names, sizes, options)."""


class NativeError(RuntimeError):
    """A native kernel failed (out of memory) or was called while unavailable."""
