"""A run's history packed: it reads as the records it was given, to the bit."""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterable
from dataclasses import astuple, fields

import pytest

from qsched.zo.history import EvalHistory, StepHistory
from qsched.zo.step import EvalRecord, StepRecord

STEPS = [
    StepRecord(0, 1, 2.302585092994046, 2),
    StepRecord(1, 32, -0.0, 66),
    StepRecord(2**32 - 1, 2**16, math.inf, 2**64 - 1),
    StepRecord(3, 4, 5e-324, 74),
]


def _bits(records: Iterable[StepRecord]) -> list[tuple[object, ...]]:
    """Each record's fields, floats by their bits (so -0.0 and 0.0 differ)."""
    return [tuple(v.hex() if isinstance(v, float) else v for v in astuple(r)) for r in records]


def test_a_history_reads_back_what_was_appended() -> None:
    """Length, indices (negative too), slices, iteration and equality with the list of
    records; every field exact, the extremes of each width and signed zero included."""
    history = StepHistory()
    for record in STEPS:
        history.append(record)
    expected = list(STEPS)
    assert len(history) == 4 and history == expected and expected == history  # both ways
    assert _bits(history) == _bits(STEPS)
    assert history[0] == STEPS[0] and history[-1] == STEPS[-1] and history[1:3] == STEPS[1:3]
    assert math.copysign(1.0, history[1].train_loss) == -1.0
    with pytest.raises(IndexError):
        history[4]
    assert history != STEPS[:3] and StepHistory() == []


def test_packed_bytes_round_trip_and_copies_are_independent() -> None:
    """``from_packed(packed())`` is the same history; a copy does not see later appends;
    bytes that are not whole records are refused; a history pickles."""
    history = StepHistory(STEPS)
    again = StepHistory.from_packed(history.packed())
    assert _bits(again) == _bits(STEPS)
    copy = history.copy()
    history.append(StepRecord(4, 4, 0.5, 82))
    assert len(copy) == 4 and len(history) == 5
    assert pickle.loads(pickle.dumps(history)) == history
    with pytest.raises(ValueError, match="whole"):
        StepHistory.from_packed(history.packed()[:-1])


def test_appending_while_iterating_is_allowed() -> None:
    """An iteration in progress sees the records there were when it began."""
    history = StepHistory(STEPS)
    seen = []
    for record in history:
        seen.append(record)
        if len(history) < 6:
            history.append(StepRecord(len(history), 1, 0.0, 0))
    assert seen == STEPS and len(history) == 6


def test_each_layout_packs_every_field_of_its_record() -> None:
    """One format code per field of the record, so a field added to a record without
    its layout fails here."""
    for kind in (StepHistory, EvalHistory):
        codes = kind.LAYOUT.format.lstrip("<")
        assert len(codes) == len(fields(kind.RECORD)), kind.__name__
    evals = EvalHistory([EvalRecord(9, math.nan, 0.875, 640)])
    assert math.isnan(evals[0].val_loss) and evals[0].val_accuracy == 0.875
