"""A run's history: its step and validation records, packed.

A run keeps one record per step for as long as it runs (the daemon for the whole job).
As Python objects that is 160 bytes a step and one object a step for the garbage
collector to walk at every full collection; packed into fixed-size binary records it is
24 bytes a step and nothing for the collector. The packed bytes are also what a
checkpoint stores (``qsched.daemon.checkpoints``), so writing one costs a copy, not a
conversion of every record.

A history reads like a sequence of records (index, slice, iterate, compare with a list
of records); each access builds the record from its bytes. Every field round-trips
exactly: integers as unsigned 32 or 64 bits, floats as IEEE 754 doubles.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from typing import Any, ClassVar, Generic, Self, TypeVar, overload

from qsched.zo.step import EvalRecord, StepRecord

__all__ = ["EvalHistory", "StepHistory"]

_R = TypeVar("_R", StepRecord, EvalRecord)


class _PackedRecords(Sequence[_R], Generic[_R]):
    """Records of one kind, in order, each ``LAYOUT.size`` bytes (see the module docstring)."""

    RECORD: ClassVar[type[Any]]
    LAYOUT: ClassVar[struct.Struct]  # the record's fields in declaration order

    __slots__ = ("_data",)

    def __init__(self, records: Iterable[_R] = ()) -> None:
        self._data = bytearray()
        for record in records:
            self.append(record)

    @classmethod
    def from_packed(cls, data: bytes | bytearray) -> Self:
        """A history from ``packed()`` bytes.

        Raises:
            ValueError: the bytes are not a whole number of records.
        """
        if len(data) % cls.LAYOUT.size:
            raise ValueError(f"{len(data)} bytes are not whole {cls.LAYOUT.size}-byte records")
        history = cls()
        history._data = bytearray(data)
        return history

    def append(self, record: _R) -> None:
        """Add ``record`` at the end."""
        self._data += self.LAYOUT.pack(*(getattr(record, f.name) for f in fields(record)))

    def packed(self) -> bytes:
        """The records' bytes (``from_packed`` reads them back)."""
        return bytes(self._data)

    def copy(self) -> Self:
        """An independent history with the same records."""
        return self.from_packed(self._data)

    def __len__(self) -> int:
        return len(self._data) // self.LAYOUT.size

    @overload
    def __getitem__(self, index: int) -> _R: ...

    @overload
    def __getitem__(self, index: slice) -> list[_R]: ...

    def __getitem__(self, index: int | slice) -> _R | list[_R]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        count = len(self)
        position = index + count if index < 0 else index
        if not 0 <= position < count:
            raise IndexError(f"record {index} of {count}")
        record: _R = self.RECORD(*self.LAYOUT.unpack_from(self._data, position * self.LAYOUT.size))
        return record

    def __iter__(self) -> Iterator[_R]:
        # Over a copy: appending while a caller iterates must not find the buffer exported.
        return (self.RECORD(*values) for values in self.LAYOUT.iter_unpack(self.packed()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _PackedRecords | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} records)"


class StepHistory(_PackedRecords[StepRecord]):
    """A run's step records: step and q (unsigned 32 bits), train_loss (double),
    forward_passes (unsigned 64 bits), little-endian."""

    RECORD = StepRecord
    LAYOUT = struct.Struct("<IIdQ")
    __slots__ = ()


class EvalHistory(_PackedRecords[EvalRecord]):
    """A run's validation records: step (unsigned 32 bits), val_loss and val_accuracy
    (doubles), forward_passes (unsigned 64 bits), little-endian."""

    RECORD = EvalRecord
    LAYOUT = struct.Struct("<IddQ")
    __slots__ = ()
