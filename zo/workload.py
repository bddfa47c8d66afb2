"""The ZO workload: one job's model, data and numerics behind a small facade.

The daemon, the Python virtual boards, the experiment runner and the single-process
trainer all drive training through :class:`Workload`, so a step is computed the same way
everywhere:

    idx    = workload.batch(step)                            # Philox minibatch
    losses = workload.perturbed_losses(state, step, ks)       # on the boards, sharded by k
    pairs  = spsa.coefficients(losses, lr, eps, q)            # in the daemon, once
    state  = workload.apply_update(state, step, pairs)        # everywhere, bit-identical

Construction is a pure function of the :class:`JobSpec` (and an optional backbone).
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from qsched.protocol.jobspec import JobSpec
from qsched.zo import accum_int8, engine, intloss, prng, recalibrate, update
from qsched.zo import kernels_int8 as ki
from qsched.zo.datasets import Dataset, load_dataset
from qsched.zo.errors import StateError, WorkloadError, ZooError
from qsched.zo.graph import Conv2D, Dense, Model, QuantizedLayer, QuantModel
from qsched.zo.quantize import (
    asymmetric_params,
    dequantize_weights,
    quantize_input,
    quantize_model,
    quantize_weight,
    weight_channel_axis,
)
from qsched.zo.spsa import LossPairs, LossSums
from qsched.zo.zoo import build_model, replace_classifier

__all__ = [
    "CALIBRATION_SAMPLES",
    "DOMAIN_CALIBRATION",
    "LOGIT_RANGE",
    "StateError",
    "TrainState",
    "Workload",
    "WorkloadError",
    "calibration_indices",
    "float_warnings_silenced",
    "resolve_trainable",
    "widen_logits",
]

# A flat trainable vector or a stack of them: float32 (FP32) or int8 (INT8).
Flat: TypeAlias = npt.NDArray[Any]
Inputs: TypeAlias = "npt.NDArray[Any] | engine.Activations"
Split: TypeAlias = Literal["train", "val"]

# Philox domain (counter word 3) of the PTQ calibration subset; 0 and 1 are the protocol's.
DOMAIN_CALIBRATION: Final = 2
CALIBRATION_SAMPLES: Final = 512
# Smallest real half-range of the int8 logits (see widen_logits).
LOGIT_RANGE: Final = 8.0
# Perturbed weight sets evaluated per engine call are capped so that sets x parameters
# stays near this many elements (memory), whatever q and the model are.
_MAX_SET_ELEMENTS: Final = 1 << 24
# Keys perturbed together are capped so that keys x parameters stays near this many
# elements (the int32 temporaries of a group).
_PERTURB_ELEMENTS: Final = 1 << 20
_VALIDATION_CHUNK: Final = 1024

_STATE_MAGIC: Final = b"QZST"
_STATE_VERSION: Final = 2
_STATE_HEADER: Final = struct.Struct("<4sHBBQII")
_EXPS_COUNT: Final = struct.Struct("<I")  # version 2: the number of scale exponents
_PARAM_CODES: Final[dict[np.dtype[Any] | None, int]] = {
    np.dtype(np.float32): 1,
    np.dtype(np.int8): 2,
}
_BUFFER_CODES: Final[dict[np.dtype[Any] | None, int]] = {
    None: 0,
    np.dtype(np.float16): 1,
    np.dtype(np.int8): 2,
}


@dataclass(eq=False)
class TrainState:
    """Everything that changes during training: the flat trainable vector and its buffer.

    ``params`` is float32 (FP32 mode) or int8 (INT8 mode); ``buffer`` is the FP16
    accumulation buffer, the INT8 accumulator state (``accum_int8``), or None (FP32).
    ``scale_exps`` are the recalibration exponents, one int8 per trainable channel
    (``recalibrate.py``), or None when the job's scales stay fixed. ``step`` is the next
    step to run.
    """

    step: int
    params: Flat
    buffer: Flat | None = None
    scale_exps: Flat | None = None
    _checksum: int | None = field(default=None, init=False, repr=False)

    def _parts(self) -> list[Flat]:
        return [p for p in (self.params, self.buffer, self.scale_exps) if p is not None]

    def frozen(self) -> TrainState:
        """A read-only version of this state: itself when already frozen, else a read-only
        copy (a copy owns its memory, so no other array can write it). A frozen state can
        be shared (the boards of one process hold one state, not one copy each), and its
        checksum is computed once."""
        if self.is_frozen():
            return self
        state = self.copy()  # owns its memory, so no writable view of it exists
        for part in state._parts():
            part.flags.writeable = False
        return state

    def is_frozen(self) -> bool:
        """Whether no part of the state can be written (``frozen``)."""
        return all(not part.flags.writeable and part.base is None for part in self._parts())

    def weight_bytes(self) -> bytes:
        """The params' bytes, the buffer's, then the scale exponents, little-endian: what
        ``SetWeights`` carries and the checksum covers (SPEC section 5)."""
        return b"".join(_le_bytes(part) for part in self._parts())

    def checksum(self) -> int:
        """CRC-32 of :meth:`weight_bytes` (SPEC section 5); kept once the state is frozen."""
        if self._checksum is not None:
            return self._checksum
        checksum = zlib.crc32(self.weight_bytes())
        if self.is_frozen():
            self._checksum = checksum
        return checksum

    def with_weight_bytes(self, raw: bytes, step: int) -> TrainState:
        """A state of this one's shapes and dtypes holding ``raw`` (:meth:`weight_bytes`).

        Args:
            raw: params then buffer, little-endian.
            step: the step the new state is at.

        Returns:
            The new state.

        Raises:
            StateError: ``raw`` is not exactly as long as this state's weight bytes.
        """
        expected = sum(part.size * part.itemsize for part in self._parts())
        if len(raw) != expected:
            raise StateError(f"weights are {len(raw)} bytes, the job needs {expected}")
        offset, read = 0, []
        for part in self._parts():
            read.append(_read(raw, part.dtype, part.size, offset))
            offset += part.size * part.itemsize
        params = read.pop(0)
        buffer = read.pop(0) if self.buffer is not None else None
        exps = read.pop(0) if self.scale_exps is not None else None
        return TrainState(step, params, buffer, exps)

    def to_bytes(self) -> bytes:
        """Serialise: a 28-byte header (magic, version, codes, step, sizes), params,
        buffer, scale exponents.

        Returns:
            Little-endian bytes that :meth:`from_bytes` reads back.
        """
        buffer = self.buffer
        header = _STATE_HEADER.pack(
            _STATE_MAGIC,
            _STATE_VERSION,
            _PARAM_CODES[self.params.dtype],
            _BUFFER_CODES[None if buffer is None else buffer.dtype],
            self.step,
            self.params.size,
            0 if buffer is None else buffer.size,
        )
        exps = 0 if self.scale_exps is None else self.scale_exps.size
        return header + _EXPS_COUNT.pack(exps) + self.weight_bytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> TrainState:
        """Parse :meth:`to_bytes` output.

        Args:
            data: the serialised state.

        Returns:
            The state.

        Raises:
            StateError: wrong magic, version, codes or length.
        """
        if len(data) < _STATE_HEADER.size:
            raise StateError("train state: truncated header")
        magic, version, pcode, bcode, step, n_params, n_buffer = _STATE_HEADER.unpack_from(data)
        if magic != _STATE_MAGIC or version not in (1, _STATE_VERSION):
            raise StateError(f"train state: bad magic {magic!r} or version {version}")
        n_exps, header_size = 0, _STATE_HEADER.size
        if version >= 2:  # version 1 states (before recalibration) have no exponents
            if len(data) < header_size + _EXPS_COUNT.size:
                raise StateError("train state: truncated header")
            (n_exps,) = _EXPS_COUNT.unpack_from(data, header_size)
            header_size += _EXPS_COUNT.size
        pdtype = _code_dtype(_PARAM_CODES, pcode, "params")
        if pdtype is None:
            raise StateError("train state: params need a dtype")
        bdtype = _code_dtype(_BUFFER_CODES, bcode, "buffer")
        n_buffer_bytes = n_buffer * bdtype.itemsize if bdtype else 0
        expected = header_size + n_params * pdtype.itemsize + n_buffer_bytes + n_exps
        if len(data) != expected:
            raise StateError(f"train state: {len(data)} bytes, expected {expected}")
        offset = header_size
        params = _read(data, pdtype, n_params, offset)
        offset += n_params * pdtype.itemsize
        buffer = None if bdtype is None else _read(data, bdtype, n_buffer, offset)
        exps = _read(data, np.dtype(np.int8), n_exps, offset + n_buffer_bytes) if n_exps else None
        return cls(step=int(step), params=params, buffer=buffer, scale_exps=exps)

    def copy(self) -> TrainState:
        """A deep copy."""
        return TrainState(
            self.step,
            self.params.copy(),
            None if self.buffer is None else self.buffer.copy(),
            None if self.scale_exps is None else self.scale_exps.copy(),
        )


def float_warnings_silenced() -> np.errstate:
    """numpy's overflow, invalid-value and divide warnings off, for computing losses: a
    diverged run's non-finite losses reach the user as one typed error (``LossError``, a
    board's ``Error(numeric)``), so the warnings before it are noise."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore")


def _le_bytes(array: Flat) -> bytes:
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()


def _read(raw: bytes, dtype: np.dtype[Any], count: int, offset: int) -> Flat:
    """``count`` little-endian values of ``dtype`` at ``offset``, as a native array."""
    return np.frombuffer(raw, dtype.newbyteorder("<"), count, offset).astype(dtype)


def _code_dtype(
    codes: dict[np.dtype[Any] | None, int], code: int, what: str
) -> np.dtype[Any] | None:
    for dtype, value in codes.items():
        if value == code:
            return dtype
    raise StateError(f"train state: unknown {what} code {code}")


def resolve_trainable(model: Model, trainable: str | list[str]) -> list[str]:
    """The trainable parametrised layers, in model order.

    Args:
        model: the graph.
        trainable: "all", "last:N" or a list of layer names.

    Returns:
        Layer names in model order.

    Raises:
        WorkloadError: an unknown or parameter-free layer, or N too large.
    """
    names = [n.name for n in model.param_nodes()]
    if trainable == "all":
        return names
    if isinstance(trainable, str):
        if not trainable.startswith("last:"):
            raise WorkloadError(
                f"trainable must be 'all', 'last:N' or layer names, got {trainable!r}"
            )
        count = int(trainable.split(":", 1)[1])
        if not 0 < count <= len(names):
            raise WorkloadError(
                f"trainable {trainable!r}: the model has {len(names)} layers with weights: {names}"
            )
        return names[-count:]
    unknown = [t for t in trainable if t not in names]
    if unknown:
        raise WorkloadError(f"unknown trainable layer(s) {unknown}; layers with weights: {names}")
    return [n for n in names if n in set(trainable)]


@dataclass(frozen=True)
class _Segment:
    """One tensor of the flat trainable vector."""

    layer: str
    kind: Literal["weight", "bias"]
    start: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def stop(self) -> int:
        return self.start + self.size


class Workload:
    """One job's model, data and numerics (see the module docstring)."""

    def __init__(
        self,
        spec: JobSpec,
        model: Model,
        qmodel: QuantModel | None,
        dataset: Dataset,
        trainable: list[str],
    ) -> None:
        """Assemble a workload from parts (``from_spec`` builds them from a spec).

        Args:
            spec: the job (numerics, accumulator, estimator, seed, batch size, eps, lr).
            model: the float graph (INT8: the graph of ``qmodel``).
            qmodel: the INT8 model, or None in FP32 mode.
            dataset: the data set.
            trainable: trainable layer names.

        Raises:
            WorkloadError: unknown layers, no parameters, or numerics and qmodel disagree.
        """
        if (qmodel is not None) != (spec.numerics == "int8"):
            raise WorkloadError(
                f"numerics {spec.numerics!r} needs "
                f"{'a' if spec.numerics == 'int8' else 'no'} QuantModel"
            )
        self.spec = spec
        self.model = model
        self.qmodel = qmodel
        self.dataset = dataset
        # Model order, whatever order the caller listed them in: the flat vector's layout.
        self.trainable_layers = resolve_trainable(model, list(trainable))
        self.segments = self._layout()
        self.num_params = self.segments[-1].stop if self.segments else 0
        if self.num_params == 0:
            raise WorkloadError("no trainable parameters")
        self._loss_table: npt.NDArray[np.uint32] | None = None
        self._loss_scale_q24 = 0
        # Frozen-prefix activations of each split, computed on first use (see _inputs).
        self._prefix: dict[Split, engine.Activations] = {}
        # Prepared on the first pass, again when recalibration changes the exponents; one
        # (exponents, prepared) tuple, replaced whole, as boards may evaluate in threads.
        self._prepared: tuple[bytes | None, engine.PreparedInt8] | None = None
        self._gains_at: tuple[bytes | None, npt.NDArray[np.float32]] | None = None
        self._x_train: Flat = dataset.x_train
        self._x_val: Flat = dataset.x_val
        if qmodel is not None:
            scale = qmodel.tensors[model.output_name].scale
            self._loss_table = intloss.exp_table(scale)
            self._loss_scale_q24 = intloss.scale_q24(scale)
            self._x_train = quantize_input(qmodel, dataset.x_train)
            self._x_val = quantize_input(qmodel, dataset.x_val)
        self.recalibration = self._recalibration_layout() if spec.recalibrate_every else None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_spec(cls, spec: JobSpec, *, backbone: Model | QuantModel | None = None) -> Workload:
        """Build the workload a spec describes, deterministically.

        Args:
            spec: the job.
            backbone: a model to start from instead of the zoo's seeded initialisation
                (a QuantModel keeps its quantisation in INT8 mode).

        Returns:
            The workload.

        Raises:
            WorkloadError: the spec and the backbone or data do not fit.
        """
        dataset = load_dataset(spec.dataset)
        if backbone is None and spec.backbone is not None:
            backbone = _load_backbone(spec.backbone)
        if backbone is not None:
            backbone = _adapt_backbone(backbone, spec, dataset)
        if isinstance(backbone, QuantModel):
            model = backbone.model
        elif isinstance(backbone, Model):
            model = backbone
        else:
            model = build_model(
                spec.model,
                dataset.input_shape,
                dataset.num_classes,
                seed=spec.seed,
                **spec.model_options,
            )
        if (
            tuple(model.input_shape) != dataset.input_shape
            or model.num_classes != dataset.num_classes
        ):
            raise WorkloadError(
                f"model {model.name!r} takes {model.input_shape} -> {model.num_classes} classes, "
                f"data set {dataset.name!r} is {dataset.input_shape} -> {dataset.num_classes}"
            )
        qmodel = None
        if spec.numerics == "int8":
            if isinstance(backbone, QuantModel):
                qmodel = backbone
            else:
                calibration = dataset.x_train[calibration_indices(spec.seed, len(dataset.x_train))]
                qmodel = widen_logits(quantize_model(model, calibration))
        return cls(spec, model, qmodel, dataset, resolve_trainable(model, spec.trainable))

    def _layout(self) -> list[_Segment]:
        segments: list[_Segment] = []
        start = 0
        for name in self.trainable_layers:
            node = self.model.node(name)
            kinds: tuple[Literal["weight", "bias"], ...] = (
                ("weight",) if self.int8 else ("weight", "bias")
            )
            for kind in kinds:
                shape = tuple(int(d) for d in getattr(node, kind).shape)
                segments.append(_Segment(name, kind, start, shape))
                start = segments[-1].stop
        return segments

    @property
    def int8(self) -> bool:
        """True in INT8 mode."""
        return bool(self.spec.numerics == "int8")

    def _recalibration_layout(self) -> recalibrate.ChannelLayout:
        """The trainable channels and how far each may grow (the blob's requantisation
        parameters, as ``blob.encode_blob`` computes them)."""
        assert self.qmodel is not None  # the spec allows recalibration in INT8 only
        multipliers, shifts = [], []
        for s in self.segments:
            node = self.model.node(s.layer)
            assert isinstance(node, (Conv2D, Dense))  # trainable layers have weights
            stage = ki.prepare_output_stage(
                self.qmodel.tensors[node.inputs[0]],
                self.qmodel.layers[s.layer].weight_scales,
                self.qmodel.tensors[node.output],
                node.activation,
            )
            multipliers.append(stage.multiplier)
            shifts.append(stage.shift)
        limits = recalibrate.exp_limits(np.concatenate(multipliers), np.concatenate(shifts))
        return recalibrate.ChannelLayout(self._element_channel, limits)

    @functools.cached_property
    def _element_channel(self) -> npt.NDArray[np.int64]:
        """INT8: each flat-vector element's channel (SPEC 4.2), numbered across the
        trainable layers: what gains and recalibration index by."""
        assert self.qmodel is not None
        tensors = []
        for s in self.segments:
            node = self.model.node(s.layer)
            assert isinstance(node, (Conv2D, Dense))  # trainable layers have weights
            channels = len(self.qmodel.layers[s.layer].weight_scales)
            tensors.append((s.size, channels, weight_channel_axis(node) != 0))
        return update.element_channels(tensors)

    def _channel_exps(self, exps: Flat | None) -> dict[str, Flat]:
        """Each trainable layer's slice of the state's scale exponents."""
        if exps is None or self.qmodel is None:
            return {}
        out, first = {}, 0
        for s in self.segments:
            channels = len(self.qmodel.layers[s.layer].weight_scales)
            out[s.layer] = exps[first : first + channels]
            first += channels
        return out

    def quant_model_at(self, exps: Flat | None) -> QuantModel:
        """The INT8 model's quantisation under scale exponents ``exps`` (section "Scale
        recalibration"): trainable layers with scales ``s * 2^e`` and their biases
        rescaled; the weights are the blob's (a forward pass takes the state's)."""
        assert self.qmodel is not None
        per_layer = self._channel_exps(exps)
        if not per_layer:
            return self.qmodel
        layers = dict(self.qmodel.layers)
        for name, e in per_layer.items():
            old = layers[name]
            layers[name] = QuantizedLayer(
                old.weight,
                recalibrate.effective_scales(old.weight_scales, e),
                recalibrate.effective_bias(old.bias, e),
            )
        q = self.qmodel
        return QuantModel(model=q.model, tensors=q.tensors, layers=layers, source=q.source)

    def _prepared_at(self, exps: Flat | None) -> engine.PreparedInt8:
        key = None if exps is None else exps.tobytes()
        cached = self._prepared
        if cached is None or cached[0] != key:
            cached = (key, engine.prepare_int8(self.quant_model_at(exps)))
            self._prepared = cached
        return cached[1]

    @functools.cached_property
    def update_gain(self) -> npt.NDArray[np.float32] | None:
        """The gains of :meth:`update_gain_at` at the calibrated scales."""
        return self.update_gain_at(None)

    def update_gain_at(self, exps: Flat | None) -> npt.NDArray[np.float32] | None:
        """Per-element gains of an INT8 job with a weight-unit learning rate (SPEC 4.2):
        each weight's channel gain ``1 / s_c^2`` (``s_c`` recalibrated by ``exps``),
        channels along the weight's channel axis (output channels; the last axis of a
        depthwise weight). None otherwise."""
        if self.qmodel is None or self.spec.lr_unit != "weight":
            return None
        key = None if exps is None else exps.tobytes()
        cached = self._gains_at  # one tuple, replaced whole (see _prepared)
        if cached is None or cached[0] != key:
            cached = (key, self._gains(self.quant_model_at(exps)))
            self._gains_at = cached
        return cached[1]

    def _gains(self, qmodel: QuantModel) -> npt.NDArray[np.float32]:
        """Each element's channel gain under ``qmodel``'s weight scales."""
        scales = [qmodel.layers[s.layer].weight_scales for s in self.segments]
        gains = update.channel_gains(np.concatenate(scales)) if scales else np.zeros(0)
        return gains.astype(np.float32)[self._element_channel]

    @property
    def tensor_sizes(self) -> list[int]:
        """Sizes of the flat vector's tensors, in order (the INT8 accumulator's per-tensor
        scales)."""
        return [s.size for s in self.segments]

    # ------------------------------------------------------------------ state

    def initial_state(self) -> TrainState:
        """The state before step 0: the model's weights and a zero buffer."""
        if self.qmodel is None:
            parts = [
                np.asarray(getattr(self.model.node(s.layer), s.kind), np.float32).ravel()
                for s in self.segments
            ]
            return TrainState(0, np.concatenate(parts).astype(np.float32), None)
        params = np.concatenate(
            [self.qmodel.layers[s.layer].weight.ravel() for s in self.segments]
        ).astype(np.int8)
        if self.spec.accumulator == "int8":
            return TrainState(0, params, accum_int8.initial_state(self.tensor_sizes))
        exps = None
        if self.recalibration is not None:
            exps = np.zeros(self.recalibration.channels, dtype=np.int8)
        return TrainState(0, params, np.zeros(self.num_params, dtype=np.float16), exps)

    def check_state(self, state: TrainState) -> None:
        """Raise StateError unless ``state`` has this workload's sizes and dtypes."""
        dtype = np.int8 if self.int8 else np.float32
        if state.params.dtype != dtype or state.params.shape != (self.num_params,):
            raise StateError(
                f"state params are {state.params.dtype}{state.params.shape}, "
                f"expected {np.dtype(dtype)}({self.num_params},)"
            )
        expected = self.initial_state().buffer
        if (expected is None) != (state.buffer is None) or (
            expected is not None
            and state.buffer is not None
            and (expected.dtype != state.buffer.dtype or expected.shape != state.buffer.shape)
        ):
            raise StateError("state buffer does not match the job's accumulator")
        self._check_exps(state.scale_exps)
        if self.int8 and self.spec.accumulator == "int8" and state.buffer is not None:
            try:  # the shifts must be in range now, not fail the next update
                accum_int8.split_state(state.buffer, self.tensor_sizes)
            except ValueError as exc:
                raise StateError(str(exc)) from exc

    def _check_exps(self, exps: Flat | None) -> None:
        layout = self.recalibration
        if layout is None:
            if exps is not None:
                raise StateError("state has scale exponents, the job does not recalibrate")
            return
        if exps is None or exps.dtype != np.int8 or exps.shape != (layout.channels,):
            raise StateError(f"state needs {layout.channels} int8 scale exponents")
        if np.any(exps < 0) or np.any(exps.astype(np.int64) > layout.exp_limit):
            raise StateError("a scale exponent is outside [0, its channel's limit]")

    # ------------------------------------------------------------------ one step

    def batch(self, step: int) -> npt.NDArray[np.int64]:
        """The minibatch indices of a step (SPEC section 1)."""
        indices: npt.NDArray[np.int64] = prng.batch_indices(
            self.spec.seed, step, self.spec.batch_size, len(self.dataset.x_train)
        )
        return indices

    def perturbed_losses(self, state: TrainState, step: int, ks: Sequence[int]) -> LossPairs:
        """The losses of perturbations ``ks`` at ``step`` on the step's minibatch.

        Two-sided: L(theta + eps z_k) and L(theta - eps z_k) per k; one-sided: L(theta +
        eps z_k) per k and L(theta). All sets are evaluated in batched engine calls on one
        shared minibatch. INT8 losses are the integer loss's Q16 values as floats (exact).

        Args:
            state: the current state (its params are perturbed, never modified).
            step: the step (keys the batch and the perturbations).
            ks: perturbation indices, distinct.

        Returns:
            The losses.
        """
        keys, sets = self._perturbed_sets(state, step, ks)
        idx = self.batch(step)
        losses = self._set_losses(
            sets, self._inputs("train", idx), self.dataset.y_train[idx], state.scale_exps
        )
        return self._pairs(keys, losses)

    def perturbed_loss_sums(
        self, state: TrainState, step: int, ks: Sequence[int], start: int, count: int
    ) -> LossSums:
        """INT8: the sums of the per-sample Q16 losses over batch positions
        ``[start, start + count)`` of the step's minibatch, per key (SPEC 6.10).

        Summed over slices that cover the batch and floor-divided by the batch size, they
        give exactly the Q16 batch loss of ``perturbed_losses``.

        Raises:
            ValueError: FP32 mode (its float mean is not a sum), or a slice outside the batch.
        """
        return self.perturbed_slice_sums(state, step, ks, [(start, count)])[0]

    def perturbed_slice_sums(
        self,
        state: TrainState,
        step: int,
        ks: Sequence[int],
        slices: Sequence[tuple[int, int]],
    ) -> list[LossSums]:
        """``perturbed_loss_sums`` of several ``(start, count)`` slices of one step, in
        one engine call: the keys are perturbed once and each batch position is evaluated
        once. A sample's loss does not depend on the other samples evaluated with it, so
        every slice's sums are the bits it would get alone.

        Raises:
            ValueError: FP32 mode, no slice, or a slice outside the batch.
        """
        if not self.int8:
            raise ValueError("batch slices need INT8 numerics")
        if not slices:
            raise ValueError("no batch slice")
        for start, count in slices:
            if not (count >= 1 and start >= 0 and start + count <= self.spec.batch_size):
                raise ValueError(f"slice [{start}, {start + count}) outside the batch")
        keys, sets = self._perturbed_sets(state, step, ks)
        positions = sorted({p for start, count in slices for p in range(start, start + count)})
        idx = self.batch(step)[positions]
        per_sample = self._set_sample_losses(
            sets, self._inputs("train", idx), self.dataset.y_train[idx], state.scale_exps
        )
        column = {p: i for i, p in enumerate(positions)}
        out = []
        for start, count in slices:
            first = column[start]  # a slice's positions are consecutive columns
            sums = per_sample[:, first : first + count].sum(axis=1)
            pairs = self._pairs(keys, sums.tolist())
            out.append(
                LossSums(
                    plus={k: int(v) for k, v in pairs.plus.items()},
                    minus={k: int(v) for k, v in pairs.minus.items()},
                    base=None if pairs.base is None else int(pairs.base),
                )
            )
        return out

    def _perturbed_sets(
        self, state: TrainState, step: int, ks: Sequence[int]
    ) -> tuple[list[int], Flat]:
        """The keys and the weight sets to evaluate, one row each: per key +eps (and
        -eps two-sided), then one-sided the unperturbed weights."""
        self.check_state(state)
        keys = [int(k) for k in ks]
        if len(set(keys)) != len(keys):
            raise ValueError(f"repeated perturbation index in {keys}")
        per_key = 2 if self.spec.estimator == "two_sided" else 1
        rows = len(keys) * per_key + (per_key == 1)
        sets = np.empty((rows, self.num_params), dtype=state.params.dtype)
        # Keys in groups, so the temporaries stay near _PERTURB_ELEMENTS elements.
        group = max(1, _PERTURB_ELEMENTS // max(1, self.num_params))
        for first in range(0, len(keys), group):
            part = keys[first : first + group]
            negatives = prng.rademacher_rows(self.spec.seed, step, part, self.num_params)
            rows_of_part = sets[first * per_key : (first + len(part)) * per_key]
            self._perturb_into(rows_of_part, state.params, negatives, per_key)
        if per_key == 1:
            sets[-1] = state.params
        return keys, sets

    def _perturb_into(
        self, out: Flat, params: Flat, negatives: npt.NDArray[np.bool_], per_key: int
    ) -> None:
        """Rows params + eps z_k (and then params - eps z_k) of each key's sign bits, into
        ``out``; the bits of update.perturb_int8 and update.perturb_fp32."""
        # +1 or -1 per weight (np.where on a boolean array is several times slower)
        signs = 1 - 2 * negatives.view(np.uint8).astype(np.int32 if self.int8 else np.float32)
        if self.int8:
            moves = np.int32(int(self.spec.eps)) * signs
            wide = params.astype(np.int32)
            for row, moved in enumerate((wide + moves, wide - moves)[:per_key]):
                np.clip(moved, -update.INT8_WEIGHT_MAX, update.INT8_WEIGHT_MAX, out=moved)
                out[row::per_key] = moved  # in int8 range: the cast is exact
            return
        moves = np.float32(self.spec.eps) * signs  # +-eps exactly (-0.0 where eps is 0)
        np.add(params, moves, out=out[0::per_key])
        if per_key == 2:  # theta - d is theta + (-d) in IEEE 754, to the bit
            np.subtract(params, moves, out=out[1::per_key])

    def _pairs(self, keys: list[int], values: Sequence[float]) -> LossPairs:
        """One value per set of ``_perturbed_sets``, as LossPairs."""
        if self.spec.estimator == "two_sided":
            return LossPairs(
                plus={k: values[2 * i] for i, k in enumerate(keys)},
                minus={k: values[2 * i + 1] for i, k in enumerate(keys)},
            )
        return LossPairs(plus={k: values[i] for i, k in enumerate(keys)}, minus={}, base=values[-1])

    def _inputs(self, split: Split, idx: npt.NDArray[np.int64]) -> Inputs:
        """Inputs of samples ``idx`` of a split, or their cached frozen-prefix activations.

        With frozen layers before the first trainable one, the whole split runs through
        that prefix once, on first use, and later calls take its activations: the prefix
        never changes during a job. The whole split is kept, not the slice asked for, so
        boards of one process that share this workload and validate different slices
        share one copy, and a board whose slice changes computes nothing again.
        """
        x = self._x_train if split == "train" else self._x_val
        first = next(
            i for i, n in enumerate(self.model.nodes) if n.name in set(self.trainable_layers)
        )
        if first == 0:
            return x[idx]
        cached = self._prefix.get(split)
        if cached is None:
            source = self.qmodel if self.qmodel is not None else self.model
            cached = engine.prefix_activations(source, x, self.trainable_layers)
            self._prefix[split] = cached
        return cached.take(idx)

    def apply_update(
        self, state: TrainState, step: int, pairs: Sequence[tuple[int, float]]
    ) -> TrainState:
        """Apply the step's update pairs (SPEC section 4); returns a new state at step + 1.

        Args:
            state: the state at ``step``.
            step: the step the pairs belong to.
            pairs: (k, c_k) with c_k float32 values.

        Returns:
            The new state.

        Raises:
            StateError: the state is not at ``step``.
        """
        self.check_state(state)
        if state.step != step:
            raise StateError(f"state is at step {state.step}, update is for step {step}")
        seed = self.spec.seed
        if not self.int8:
            return TrainState(
                step + 1,
                update.apply_fp32(state.params.astype(np.float32), seed, step, pairs),
                None,
            )
        weights = state.params.astype(np.int8)
        if self.spec.accumulator == "int8":
            assert state.buffer is not None
            new_w, new_b = accum_int8.apply(
                weights,
                state.buffer.astype(np.int8),
                self.tensor_sizes,
                seed,
                step,
                pairs,
                self.update_gain,
            )
            return TrainState(step + 1, new_w, new_b)
        assert state.buffer is not None
        exps = state.scale_exps
        new_w, new_f16 = update.apply_int8_fp16(
            weights, state.buffer.astype(np.float16), seed, step, pairs, self.update_gain_at(exps)
        )
        if self.recalibration is not None and recalibrate.recalibration_due(
            step, self.spec.recalibrate_every
        ):
            assert exps is not None  # check_state: a recalibrating job's state has them
            new_w, new_f16, exps = recalibrate.recalibrate(new_w, new_f16, exps, self.recalibration)
        return TrainState(step + 1, new_w, new_f16, exps)

    # ------------------------------------------------------------------ evaluation

    def _set_losses(
        self,
        sets: Flat,
        x: Inputs,
        y: npt.NDArray[np.int64],
        exps: Flat | None,
    ) -> list[float]:
        """Mean batch loss of each flat weight set (a row), in engine calls of bounded size."""
        out: list[float] = []
        for per_sample in self._chunked_losses(sets, x, y, exps):
            if self.int8:
                out.extend(
                    float(intloss.q16_to_float(v)) for v in intloss.batch_loss_q16(per_sample)
                )
            else:
                out.extend(float(v) for v in per_sample.mean(axis=-1, dtype=np.float32))
        return out

    def _set_sample_losses(
        self, sets: Flat, x: Inputs, y: npt.NDArray[np.int64], exps: Flat | None
    ) -> npt.NDArray[np.int64]:
        """INT8: each set's per-sample Q16 losses (sets x samples)."""
        chunks = [c.astype(np.int64) for c in self._chunked_losses(sets, x, y, exps)]
        return np.concatenate(chunks, axis=0)

    def _chunked_losses(
        self, sets: Flat, x: Inputs, y: npt.NDArray[np.int64], exps: Flat | None
    ) -> Iterator[Flat]:
        """Per-sample losses (P, B) of the sets (rows), P bounded so one engine call stays
        small."""
        chunk = max(1, min(len(sets), _MAX_SET_ELEMENTS // max(1, self.num_params)))
        for start in range(0, len(sets), chunk):
            yield self._per_sample_losses(sets[start : start + chunk], x, y, exps)

    def _logits(self, stacked: Flat, x: Inputs, exps: Flat | None) -> Flat:
        """Logits (P, B, C) of P flat weight sets on one input batch (INT8: under the
        state's scale exponents ``exps``)."""
        count = stacked.shape[0]
        views = {s: stacked[:, s.start : s.stop].reshape(count, *s.shape) for s in self.segments}
        if self.qmodel is not None:
            weight_sets = {s.layer: views[s].astype(np.int8) for s in self.segments}
            prepared = self._prepared_at(exps)
            logits: Flat = engine.run_int8_perturbed(prepared, x, weight_sets)
            return logits
        param_sets = {
            layer: (views[self._segment(layer, "weight")], views[self._segment(layer, "bias")])
            for layer in self.trainable_layers
        }
        logits_f: Flat = engine.run_fp32_perturbed(self.model, x, param_sets)
        return logits_f

    def _per_sample_losses(
        self, stacked: Flat, x: Inputs, y: npt.NDArray[np.int64], exps: Flat | None
    ) -> Flat:
        """Per-sample losses (P, B): Q16 ints in INT8 mode, float32 in FP32 mode."""
        logits = self._logits(stacked, x, exps)
        if self.qmodel is not None:
            assert self._loss_table is not None
            q16: Flat = intloss.loss_q16(
                logits.astype(np.int8), y[None, :], self._loss_table, self._loss_scale_q24
            )
            return q16
        ce: Flat = intloss.float_cross_entropy(logits.astype(np.float32), y[None, :])
        return ce

    def _segment(self, layer: str, kind: str) -> _Segment:
        return next(s for s in self.segments if s.layer == layer and s.kind == kind)

    def validate(
        self, state: TrainState, start: int = 0, count: int | None = None
    ) -> tuple[float, int, int]:
        """Unperturbed loss and accuracy on a slice of the validation set.

        Boards validate data-parallel: each takes a slice and the daemon sums the results.

        Args:
            state: the weights to evaluate.
            start: first validation sample.
            count: number of samples (default: to the end).

        Returns:
            (sum of per-sample losses, number correct, number of samples). INT8 loss sums
            are sums of Q16 values divided by 65536 (exact).
        """
        self.check_state(state)
        n_val = len(self.dataset.x_val)
        stop = n_val if count is None else min(n_val, start + count)
        if not 0 <= start <= stop:
            raise ValueError(f"validation slice [{start}, {stop}) outside [0, {n_val}]")
        loss_sum, correct = 0.0, 0
        for lo in range(start, stop, _VALIDATION_CHUNK):
            hi = min(stop, lo + _VALIDATION_CHUNK)
            y = self.dataset.y_val[lo:hi]
            x = self._inputs("val", np.arange(lo, hi))
            logits = self._logits(state.params[None, :], x, state.scale_exps)[0]
            if self.qmodel is not None:
                assert self._loss_table is not None
                q16 = intloss.loss_q16(
                    logits.astype(np.int8), y, self._loss_table, self._loss_scale_q24
                )
                loss_sum += int(q16.astype(np.int64).sum()) / 65536.0
            else:
                loss_sum += float(
                    intloss.float_cross_entropy(logits.astype(np.float32), y)
                    .astype(np.float64)
                    .sum()
                )
            correct += int((np.argmax(logits, axis=-1) == y).sum())
        return loss_sum, correct, stop - start

    # ------------------------------------------------------------------ export

    def to_quant_model(self, state: TrainState) -> QuantModel:
        """The INT8 model with the state's weights and scales (the calibrated ones, or as
        recalibration left them; float view dequantised)."""
        self.check_state(state)
        if self.qmodel is None:
            raise WorkloadError("to_quant_model needs an INT8 job (numerics='int8')")
        layers = dict(self.quant_model_at(state.scale_exps).layers)
        for seg in self.segments:
            old = layers[seg.layer]
            weight = state.params[seg.start : seg.stop].astype(np.int8).reshape(seg.shape)
            layers[seg.layer] = QuantizedLayer(
                weight=weight, weight_scales=old.weight_scales, bias=old.bias
            )
        tensors, source = dict(self.qmodel.tensors), self.qmodel.source
        updated = QuantModel(model=self.model, tensors=tensors, layers=layers)
        model = dequantize_weights(updated)
        return QuantModel(model=model, tensors=tensors, layers=layers, source=source)

    def to_model(self, state: TrainState) -> Model:
        """The float model with the state's weights (INT8: the dequantised weights)."""
        if self.qmodel is not None:
            return self.to_quant_model(state).model
        self.check_state(state)
        nodes = list(self.model.nodes)
        for seg in self.segments:
            i = next(j for j, n in enumerate(nodes) if n.name == seg.layer)
            values = state.params[seg.start : seg.stop].reshape(seg.shape).astype(np.float32).copy()
            # Which field is set depends on the segment, so it is not checked per node type.
            changes: dict[str, Any] = {seg.kind: values}
            nodes[i] = replace(nodes[i], **changes)
        return replace(self.model, nodes=nodes)

    def model_blob(self) -> bytes:
        """The bytes LoadModel ships to the boards (``blob.encode_blob``)."""
        from qsched.zo.blob import encode_blob

        blob: bytes = encode_blob(self)
        return blob


def widen_logits(qmodel: QuantModel, logit_range: float = LOGIT_RANGE) -> QuantModel:
    """Widen the output tensor's range to at least [-logit_range, logit_range].

    Scales stay fixed while training, and a randomly initialised model's logits span a
    small range; calibrated as they are, the int8 logits would saturate as soon as
    training grows the class margins. The output's parameters enter no bias (a bias
    scale is input scale x weight scale), so only the last requantisation changes.

    Args:
        qmodel: a freshly quantised model.
        logit_range: the smallest half-range of the logits, in real units.

    Returns:
        A QuantModel sharing the layers, with the output's TensorQuant replaced.
    """
    name = qmodel.model.output_name
    old = qmodel.tensors[name]
    lo = min(old.scale * (-128 - old.zero_point), -logit_range)
    hi = max(old.scale * (127 - old.zero_point), logit_range)
    tensors = dict(qmodel.tensors)
    tensors[name] = asymmetric_params(lo, hi)
    return QuantModel(model=qmodel.model, tensors=tensors, layers=qmodel.layers)


def calibration_indices(
    seed: int, dataset_size: int, count: int = CALIBRATION_SAMPLES
) -> npt.NDArray[np.int64]:
    """The PTQ calibration subset: ``count`` indices from Philox domain 2 (sorted, unique)."""
    if dataset_size <= count:
        return np.arange(dataset_size, dtype=np.int64)
    blocks = (count + 3) // 4
    counters = np.zeros((blocks, 4), dtype=np.uint32)
    counters[:, 0] = np.arange(blocks, dtype=np.uint32)
    counters[:, 3] = DOMAIN_CALIBRATION
    words = prng.philox4x32(counters, (seed & 0xFFFFFFFF, seed >> 32)).reshape(-1)[:count]
    idx = (words.astype(np.uint64) * np.uint64(dataset_size)) >> np.uint64(32)
    return np.unique(idx.astype(np.int64))


# model_options of a job with a backbone (the zoo's options need no backbone).
BACKBONE_OPTIONS: Final = {"head": ("keep", "new")}


def _adapt_backbone(
    backbone: Model | QuantModel, spec: JobSpec, dataset: Dataset
) -> Model | QuantModel:
    """The backbone as the job's ``model_options`` ask: ``head: new`` replaces its last
    Dense layer by a fresh one for the data set's classes (fine-tuning for other classes)."""
    unknown = sorted(set(spec.model_options) - set(BACKBONE_OPTIONS))
    head = spec.model_options.get("head", "keep")
    if unknown or head not in BACKBONE_OPTIONS["head"]:
        raise WorkloadError(
            f"a job with a backbone takes model_options head='keep' or 'new', "
            f"got {dict(spec.model_options)}"
        )
    if head == "keep":
        return backbone
    try:
        if isinstance(backbone, Model):
            return replace_classifier(backbone, dataset.num_classes, spec.seed)
        return new_quantized_head(backbone, dataset.num_classes, spec.seed)
    except ZooError as exc:
        raise WorkloadError(f"backbone {spec.backbone!r}: {exc}") from None


def new_quantized_head(qmodel: QuantModel, num_classes: int, seed: int) -> QuantModel:
    """An INT8 model whose last Dense layer is fresh, for ``num_classes`` classes.

    The head's weights are drawn as the zoo draws them and quantised per channel; its
    bias is zero; its logits get the range ``[-LOGIT_RANGE, LOGIT_RANGE]`` (a fresh head's
    outputs start near zero and grow as it trains). Every other layer, tensor and scale
    is the backbone's. The result has no source file: its classes differ from the file's,
    so it exports in qsched's own form.
    """
    fresh = replace_classifier(qmodel.model, num_classes, seed)
    head = fresh.nodes[-1]
    assert isinstance(head, Dense)  # replace_classifier guarantees it
    weight, scales = quantize_weight(head.weight, 0)
    layers = dict(qmodel.layers)
    layers[head.name] = QuantizedLayer(weight, scales, np.zeros(num_classes, np.int32))
    tensors = dict(qmodel.tensors)
    tensors[head.output] = asymmetric_params(-LOGIT_RANGE, LOGIT_RANGE)
    model = dequantize_weights(QuantModel(model=fresh, tensors=tensors, layers=layers))
    return QuantModel(model=model, tensors=tensors, layers=layers)


def _load_backbone(path: str) -> Model | QuantModel:
    """A pretrained model from a .tflite (INT8) file."""
    if path.endswith(".tflite"):
        from qsched.zo.tflite_io import read_tflite

        try:
            return read_tflite(path)
        except OSError as exc:
            raise WorkloadError(f"backbone {path!r}: {exc.strerror or exc}") from None
    raise WorkloadError(f"backbone {path!r}: only .tflite files are supported")
