"""A run's checkpoint: what a bit-identical resume needs, in the state directory's format.

The daemon writes one every ``checkpoint_every`` steps and on stop; ``qsched train
--out`` writes the same, so a single-process run resumes like a daemon job.

The run's history (one record per step and per validation) is packed into fixed-size
binary records, and a ``HistoryWriter`` packs each record once: a run's records only
grow, so each checkpoint packs the ones since the previous checkpoint and copies the
rest. Serialising the whole history as JSON at every checkpoint made a checkpoint's cost
grow with the job (0.64 s at step 100,000, on the event loop, every 100 steps).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Final, Generic, TypeVar

from qsched.daemon.state import Checkpoint
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.step import EvalRecord, StepRecord
from qsched.zo.trainer import TrainResult
from qsched.zo.workload import TrainState

__all__ = ["HistoryWriter", "checkpoint_of", "restore_checkpoint"]

# Little-endian records: a step (step, q, train_loss, forward_passes) and a validation
# (step, val_loss, val_accuracy, forward_passes); float64 holds the float fields exactly.
_STEP: Final = struct.Struct("<IIdQ")
_EVAL: Final = struct.Struct("<IddQ")
_COUNTS: Final = struct.Struct("<II")  # steps, then validations

_R = TypeVar("_R", StepRecord, EvalRecord)


class _Packed(Generic[_R]):
    """One kind of record, packed in order; each record packed once."""

    def __init__(
        self, layout: struct.Struct, fields: Callable[[_R], tuple[float | int, ...]]
    ) -> None:
        self._layout = layout
        self._fields: Callable[[_R], tuple[float | int, ...]] = fields
        self._data = bytearray()
        self._last: _R | None = None  # the last record packed (identity: append-only check)
        self.count = 0

    def update(self, records: Sequence[_R]) -> bytearray:
        """The packed ``records``: those since the last call added to what was packed,
        or all of them again when ``records`` is not an extension of what was packed."""
        if self.count > len(records) or (self.count and records[self.count - 1] is not self._last):
            self._data.clear()
            self.count = 0
        pack, fields = self._layout.pack, self._fields
        for record in records[self.count :]:
            self._data += pack(*fields(record))
        self.count = len(records)
        self._last = records[-1] if records else None
        return self._data


class HistoryWriter:
    """A run's step and validation records, packed for its checkpoints (see the module
    docstring). Keep one per run; a fresh one packs everything once."""

    def __init__(self) -> None:
        self._steps = _Packed[StepRecord](
            _STEP, lambda r: (r.step, r.q, r.train_loss, r.forward_passes)
        )
        self._evals = _Packed[EvalRecord](
            _EVAL, lambda e: (e.step, e.val_loss, e.val_accuracy, e.forward_passes)
        )

    def pack(self, result: TrainResult) -> bytes:
        """The history section of a checkpoint of ``result``."""
        steps = self._steps.update(result.steps)
        evals = self._evals.update(result.evals)
        return _COUNTS.pack(self._steps.count, self._evals.count) + steps + evals


def _unpack(history: bytes) -> tuple[list[StepRecord], list[EvalRecord]]:
    if len(history) < _COUNTS.size:
        raise ValueError("checkpoint history is shorter than its record counts")
    steps, evals = _COUNTS.unpack_from(history)
    split = _COUNTS.size + steps * _STEP.size
    if len(history) != split + evals * _EVAL.size:
        raise ValueError("checkpoint history does not match its record counts")
    return (
        [StepRecord(*r) for r in _STEP.iter_unpack(history[_COUNTS.size : split])],
        [EvalRecord(*e) for e in _EVAL.iter_unpack(history[split:])],
    )


def checkpoint_of(
    result: TrainResult, policy: PolicySpec, history: HistoryWriter | None = None
) -> Checkpoint:
    """A checkpoint holding everything a bit-identical resume needs.

    Args:
        result: the run so far (state, policy state, history).
        policy: the policy in use (it may differ from the spec's after change_policy).
        history: the run's writer, which packs only the records since its last call
            (None: all of them are packed).

    Returns:
        The checkpoint.
    """
    return Checkpoint(
        step=result.state.step,
        train_state=result.state.to_bytes(),
        policy_state=result.policy_state,
        extra={
            "forward_passes": result.forward_passes,
            "wall_s": result.wall_s,
            "policy": policy.model_dump(mode="json"),
        },
        history=(history or HistoryWriter()).pack(result),
    )


def restore_checkpoint(spec: JobSpec, checkpoint: Checkpoint) -> tuple[TrainResult, PolicySpec]:
    """The run and policy a checkpoint holds (also one whose history is JSON records,
    as checkpoints were written before the packed history).

    Args:
        spec: the job's spec.
        checkpoint: its newest checkpoint.

    Returns:
        (result so far, the policy in use).

    Raises:
        ValueError: the packed history is inconsistent.
    """
    extra = checkpoint.extra
    if checkpoint.history:
        steps, evals = _unpack(checkpoint.history)
    else:
        steps = [StepRecord(**r) for r in checkpoint.metrics]
        evals = [EvalRecord(**e) for e in extra.get("evals", [])]
    result = TrainResult(
        spec=spec,
        state=TrainState.from_bytes(checkpoint.train_state),
        policy_state=dict(checkpoint.policy_state),
        steps=steps,
        evals=evals,
        forward_passes=int(extra.get("forward_passes", 0)),
        wall_s=float(extra.get("wall_s", 0.0)),
    )
    policy = PolicySpec.model_validate(extra["policy"]) if "policy" in extra else spec.policy
    return result, policy
