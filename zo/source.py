"""Where an imported model came from: the user's ``.tflite`` file and its edges.

A converter's file has more at its edges than qsched trains: a QUANTIZE from float or
uint8 input, a SOFTMAX and a DEQUANTIZE after the logits. The importer keeps those as
adapters and trains the int8 graph in between; the loss is taken on the int8 logits,
and the adapters never reach a board. ``SourceFile`` remembers the original bytes, what
its input and output tensors declare and where each layer's int8 weights lie in the
file, so that export writes the user's own file back with only the trained weight bytes
changed: the same operators, tensors, names, types and quantisation, ready to replace
the original in a deployment. A job that recalibrated scales (SPEC "Scale
recalibration") also changes, in place, the layers' weight scales, biases and bias
scales.
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
        weight_scale_bytes: per layer, where its weight's float32 scales lie.
        bias_bytes: per layer with a bias, where its int32 bias lies.
        bias_scale_bytes: per layer with a bias, where the bias tensor's scales lie.
    """

    data: bytes
    input: EdgeTensor
    output: EdgeTensor
    input_ops: tuple[str, ...] = ()
    output_ops: tuple[str, ...] = ()
    folded_ops: tuple[str, ...] = ()
    weight_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)
    weight_scale_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)
    bias_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)
    bias_scale_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)

    def with_weights(
        self,
        weights: dict[str, npt.NDArray[np.int8]],
        scales: dict[str, npt.NDArray[np.float32]] | None = None,
        biases: dict[str, npt.NDArray[np.int32]] | None = None,
    ) -> bytes:
        """The original file with these layers' int8 weights written in place.

        Args:
            weights: layer name to its int8 weight, in the file's layout.
            scales: layer name to its per-channel weight scales; where they differ from
                the file's (recalibrated by powers of two), they are written and the bias
                tensor's scales are multiplied alike.
            biases: layer name to its int32 bias, written where it differs.

        Returns:
            The new file's bytes (the same length as the original).

        Raises:
            ValueError: a layer the file does not hold, an array of another size, or two
                layers that share one buffer in the file given different contents.
        """
        out = bytearray(self.data)
        written: dict[tuple[int, int], bytes] = {}
        for name, weight in weights.items():
            self._write(out, written, name, "weight", self.weight_bytes, weight.astype(np.int8))
        for name, new in (scales or {}).items():
            old = self._read(name, self.weight_scale_bytes, "<f4")
            new32 = np.asarray(new, dtype=np.float32)
            if old is not None and old.size == 1 < new32.size:  # one scale for the tensor
                if np.any(new32 != new32[0]):
                    raise ValueError(
                        f"layer {name!r} has one weight scale in the source file, "
                        "and recalibration gave its channels different scales"
                    )
                new32 = new32[:1]
            if old is None or np.array_equal(old, new32):
                continue
            self._write(out, written, name, "weight scale", self.weight_scale_bytes, new32)
            bias_scales = self._read(name, self.bias_scale_bytes, "<f4")
            if bias_scales is not None:  # the same power of two: bias = in * weight scale
                ratio = new32 / old.astype(np.float32)  # 2^e: the quotient is exact
                moved = (bias_scales.astype(np.float32) * ratio).astype(np.float32)
                self._write(out, written, name, "bias scale", self.bias_scale_bytes, moved)
        for name, bias in (biases or {}).items():
            old = self._read(name, self.bias_bytes, "<i4")
            if old is not None and not np.array_equal(old, bias):
                self._write(out, written, name, "bias", self.bias_bytes, bias.astype(np.int32))
        return bytes(out)

    def _read(
        self, name: str, spans: dict[str, tuple[int, int]], dtype: str
    ) -> npt.NDArray[np.generic] | None:
        """A layer's array as the file holds it, or None where the file has none."""
        if name not in spans:
            return None
        offset, length = spans[name]
        return np.frombuffer(self.data, dtype, length // np.dtype(dtype).itemsize, offset)

    @staticmethod
    def _write(
        out: bytearray,
        written: dict[tuple[int, int], bytes],
        name: str,
        what: str,
        spans: dict[str, tuple[int, int]],
        values: npt.NDArray[np.generic],
    ) -> None:
        if name not in spans:
            raise ValueError(f"layer {name!r} has no {what} in the source file")
        offset, length = spans[name]
        raw = np.ascontiguousarray(values).astype(values.dtype.newbyteorder("<")).tobytes()
        if len(raw) != length:
            raise ValueError(f"layer {name!r}: {len(raw)} {what} bytes, the file has {length}")
        if written.setdefault((offset, length), raw) != raw:
            # A converter may store equal constants once; trained apart, they cannot be.
            raise ValueError(f"layer {name!r} shares its {what} bytes with another layer")
        out[offset : offset + length] = raw
