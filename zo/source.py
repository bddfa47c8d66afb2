"""Where an imported model came from: the user's ``.tflite`` file and its edges.

A converter's file has more at its edges than qsched trains: a QUANTIZE from float or
uint8 input, a SOFTMAX and a DEQUANTIZE after the logits. The importer keeps those as
adapters and trains the int8 graph in between; the loss is taken on the int8 logits,
and the adapters never reach a board. ``SourceFile`` remembers the original bytes, what
its input and output tensors declare and where each layer's int8 weights lie in the
file, so that export writes the user's own file back with only the trained weight bytes
changed: the same operators, tensors, names, types and quantisation, ready to replace
the original in a deployment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = ["EdgeTensor", "FileDType", "SourceFile"]

FileDType: TypeAlias = Literal["int8", "uint8", "float32"]


@dataclass(frozen=True)
class EdgeTensor:
    """The file's input or output tensor as it declares itself.

    Attributes:
        name: its name in the file.
        dtype: its element type.
        shape: the shape signature (``-1`` where the file leaves a dimension open).
        scale: quantisation scale (None for float32).
        zero_point: quantisation zero point (None for float32).
    """

    name: str
    dtype: FileDType
    shape: tuple[int, ...]
    scale: float | None = None
    zero_point: int | None = None

    def describe(self) -> str:
        """``float32 [-1, 32, 32, 3]`` or ``int8 [1, 10] scale 0.0039 zp -128``."""
        text = f"{self.dtype} {list(self.shape)}"
        if self.scale is not None:
            text += f" scale {self.scale:.6g} zp {self.zero_point}"
        return text


@dataclass(eq=False)
class SourceFile:
    """An imported ``.tflite`` file: what to write back and where the weights go.

    Attributes:
        data: the file's bytes, as read.
        input: the file's input tensor.
        output: the file's output tensor.
        input_ops: operators between the file's input and the trained graph's (QUANTIZE).
        output_ops: operators between the trained graph's output (the int8 logits) and
            the file's output, in order (SOFTMAX, DEQUANTIZE).
        folded_ops: operators the importer folded away (the shape arithmetic in front of
            a RESHAPE whose input shape is static).
        weight_bytes: per layer, the ``(offset, length)`` of its int8 weight in ``data``.
    """

    data: bytes
    input: EdgeTensor
    output: EdgeTensor
    input_ops: tuple[str, ...] = ()
    output_ops: tuple[str, ...] = ()
    folded_ops: tuple[str, ...] = ()
    weight_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)

    def with_weights(self, weights: dict[str, npt.NDArray[np.int8]]) -> bytes:
        """The original file with these layers' int8 weights written in place.

        Args:
            weights: layer name to its int8 weight, in the file's layout.

        Returns:
            The new file's bytes (the same length as the original).

        Raises:
            ValueError: a layer the file does not hold, a weight of another size, or two
                layers that share one buffer in the file given different weights.
        """
        out = bytearray(self.data)
        written: dict[tuple[int, int], bytes] = {}
        for name, weight in weights.items():
            if name not in self.weight_bytes:
                raise ValueError(f"layer {name!r} has no weights in the source file")
            offset, length = self.weight_bytes[name]
            raw = np.ascontiguousarray(weight, dtype=np.int8).tobytes()
            if len(raw) != length:
                raise ValueError(f"layer {name!r}: {len(raw)} weight bytes, the file has {length}")
            if written.setdefault((offset, length), raw) != raw:
                # A converter may store equal constants once; trained apart, they cannot be.
                raise ValueError(f"layer {name!r} shares its weight bytes with another layer")
            out[offset : offset + length] = raw
        return bytes(out)
