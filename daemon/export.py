"""A trained model as a file: the INT8 ``.tflite`` or the float weights as ``.npz``.

The daemon's export command and ``qsched train`` write the same bytes.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from qsched.daemon.errors import ExportError
from qsched.zo.workload import TrainState, Workload

__all__ = ["EXPORT_FORMATS", "ExportError", "default_format", "export_model"]

EXPORT_FORMATS = ("tflite", "npz")


def default_format(workload: Workload) -> str:
    """``tflite`` for an INT8 job (it runs in LiteRT), ``npz`` for an FP32 one."""
    return "tflite" if workload.int8 else "npz"


def export_model(workload: Workload, state: TrainState, fmt: str) -> bytes:
    """The model with the weights of ``state``, as the bytes of a ``fmt`` file.

    Args:
        workload: the job's workload.
        state: the weights to write.
        fmt: ``tflite`` (INT8 jobs only) or ``npz`` (every weight and bias by layer).

    Returns:
        The file's bytes.

    Raises:
        ExportError: an unknown format, ``tflite`` for an FP32 job, or an imported
            model whose file cannot take the trained layers in place (two layers that
            share a buffer, channels recalibrated apart in a per-tensor layer).
    """
    if fmt == "tflite":
        if not workload.int8:
            raise ExportError("tflite export needs an INT8 job; use format npz")
        from qsched.zo.tflite_io import export_tflite

        try:
            return export_tflite(workload.to_quant_model(state))
        except ValueError as exc:  # the source file cannot hold what training changed
            raise ExportError(f"tflite export: {exc}") from None
    if fmt == "npz":
        return _npz_bytes(workload, state)
    raise ExportError(f"unknown export format {fmt!r}")


def _npz_bytes(workload: Workload, state: TrainState) -> bytes:
    model = workload.to_model(state)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for node in model.param_nodes():
        arrays[f"{node.name}/weight"] = np.asarray(node.weight)
        if getattr(node, "bias", None) is not None:
            arrays[f"{node.name}/bias"] = np.asarray(node.bias)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy stubs: **kwds also meets allow_pickle: bool
    return buffer.getvalue()
