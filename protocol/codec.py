"""Binary data-plane codec: fixed-width little-endian fields, no varints, no heap.

A message is a 4-byte header (magic ``QS``, version, type code) and the fields of
its layout in order. Every field is fixed-width except length-prefixed strings and
blobs and the sample-key set; a C decoder walks it with one cursor into a fixed
buffer of ``MAX_PAYLOAD`` bytes. The layouts below are the single source of the
byte tables in ``protocol/SPEC.md`` section 6 (``layout_tables``). Encoding and decoding
walk them with each run of fixed-width fields packed into one struct (``_WIRE``): the
same bytes, read in fewer Python calls.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, cast, get_args

from pydantic import ValidationError

from qsched.protocol.errors import ProtocolError
from qsched.protocol.messages import (
    K_LIMIT,
    MAX_CHUNK,
    MAX_KS,
    MAX_PAYLOAD,
    MAX_SHARDS,
    MAX_SLICE_KS,
    PROTOCOL_VERSION,
    TYPE_CODES,
    Accumulator,
    ApplyUpdate,
    BoardErrorCode,
    DataMessage,
    Error,
    Estimator,
    EvalRequest,
    EvalResult,
    EvalSliceRequest,
    EvalSliceResult,
    Heartbeat,
    Hello,
    JobConfig,
    Loaded,
    LoadModel,
    LrUnit,
    NpuKind,
    Numerics,
    Ping,
    ReportedState,
    Reset,
    ResetScope,
    Resource,
    SelectDataset,
    SetWeights,
    Shard,
    StepOrder,
    UpdateAck,
    ValidateRequest,
    ValidateResult,
    WireModel,
    trusted,
    validated,
)

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "STEP_SHARED_CODES",
    "decode",
    "decode_shared",
    "encode",
    "encode_shared",
    "layout_tables",
    "peek_header",
]

MAGIC: Final = b"QS"
HEADER_SIZE: Final = 4
KSET_RANGE: Final = 0
KSET_LIST: Final = 1

_SCALARS: Final = {"B": "u8", "H": "u16", "I": "u32", "Q": "u64", "f": "f32", "d": "f64"}


@functools.cache
def _little_endian(code: str) -> struct.Struct:
    """The compiled little-endian layout of one struct code (decoding is per field)."""
    return struct.Struct("<" + code)


class _Reader:
    """A bounds-checked cursor; running off the end is a ``truncated`` ProtocolError."""

    __slots__ = ("data", "msg_type", "pos")

    def __init__(self, data: bytes, msg_type: int) -> None:
        self.data = data
        self.pos = HEADER_SIZE
        self.msg_type = msg_type

    def _advance(self, size: int) -> int:
        """Move past ``size`` bytes; returns where they start."""
        start, end = self.pos, self.pos + size
        if end > len(self.data):
            raise ProtocolError(
                "truncated",
                f"message ends at byte {len(self.data)}, layout needs {end}",
                msg_type=self.msg_type,
            )
        self.pos = end
        return start

    def take(self, size: int) -> bytes:
        start = self._advance(size)
        return self.data[start : self.pos]

    def unpack(self, code: str) -> Any:
        layout = _little_endian(code)
        (value,) = layout.unpack_from(self.data, self._advance(layout.size))
        return value

    def invalid(self, detail: str) -> ProtocolError:
        return ProtocolError("invalid_field", detail, msg_type=self.msg_type)


class _Field(Protocol):
    @property
    def name(self) -> str: ...

    def encode(self, msg: WireModel, out: bytearray) -> None: ...

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None: ...

    def describe(self) -> tuple[str, int | None, str]: ...


@dataclass(frozen=True)
class _Scalar:
    name: str
    code: str
    note: str = ""

    def encode(self, msg: WireModel, out: bytearray) -> None:
        out += _little_endian(self.code).pack(getattr(msg, self.name))

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None:
        fields[self.name] = reader.unpack(self.code)

    def describe(self) -> tuple[str, int | None, str]:
        return _SCALARS[self.code], struct.calcsize(self.code), self.note


@dataclass(frozen=True)
class _Enum:
    name: str
    choices: tuple[str, ...]

    def encode(self, msg: WireModel, out: bytearray) -> None:
        out.append(self.choices.index(getattr(msg, self.name)))

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None:
        index = reader.unpack("B")
        if index >= len(self.choices):
            raise reader.invalid(f"{self.name} code {index} is not defined")
        fields[self.name] = self.choices[index]

    def describe(self) -> tuple[str, int | None, str]:
        codes = ", ".join(f"{i} = {name}" for i, name in enumerate(self.choices))
        return "u8", 1, codes


@dataclass(frozen=True)
class _Text:
    """ASCII text: u8 length, then that many bytes (no terminator)."""

    name: str
    max_len: int

    def encode(self, msg: WireModel, out: bytearray) -> None:
        raw = str(getattr(msg, self.name)).encode("ascii")
        out.append(len(raw))
        out += raw

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None:
        size = reader.unpack("B")
        if size > self.max_len:
            raise reader.invalid(f"{self.name} is {size} bytes, at most {self.max_len}")
        raw = reader.take(size)
        if not raw.isascii():
            raise reader.invalid(f"{self.name} is not ASCII")
        fields[self.name] = raw.decode("ascii")

    def describe(self) -> tuple[str, int | None, str]:
        return "u8 n, n bytes", None, f"ASCII, n <= {self.max_len}"


@dataclass(frozen=True)
class _Blob:
    """Bytes: u16 length, then that many bytes."""

    name: str
    max_len: int

    def encode(self, msg: WireModel, out: bytearray) -> None:
        raw = bytes(getattr(msg, self.name))
        out += struct.pack("<H", len(raw))
        out += raw

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None:
        size = reader.unpack("H")
        if size > self.max_len:
            raise reader.invalid(f"{self.name} is {size} bytes, at most {self.max_len}")
        fields[self.name] = bytes(reader.take(size))

    def describe(self) -> tuple[str, int | None, str]:
        return "u16 n, n bytes", None, f"n <= {self.max_len}"


_RANGE_HEAD: Final = struct.Struct("<BHH")  # a k set's mode, count and range start


@dataclass(frozen=True)
class _KSet:
    """Strictly ascending uint16 keys: a range (start, count) when contiguous, else a list."""

    name: str = "ks"
    fewest: int = 1  # a StepOrder's shard may hold none
    most: int = MAX_KS

    def encode(self, msg: WireModel, out: bytearray) -> None:
        ks: tuple[int, ...] = getattr(msg, self.name)
        if not ks:
            out += struct.pack("<BHH", KSET_RANGE, 0, 0)
        elif ks[-1] - ks[0] + 1 == len(ks):
            out += struct.pack("<BHH", KSET_RANGE, len(ks), ks[0])
        else:
            out += struct.pack(f"<BH{len(ks)}H", KSET_LIST, len(ks), *ks)

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None:
        if reader.pos + _RANGE_HEAD.size <= len(reader.data):
            mode, count, start = _RANGE_HEAD.unpack_from(reader.data, reader.pos)
            if mode == KSET_RANGE and self.fewest <= count <= self.most:  # the common case
                reader.pos += _RANGE_HEAD.size
                fields[self.name] = tuple(range(start, start + count))
                return
        mode = reader.unpack("B")
        count = reader.unpack("H")
        if not self.fewest <= count <= self.most:
            raise reader.invalid(f"k count {count} outside [{self.fewest}, {self.most}]")
        if mode == KSET_RANGE:
            start = reader.unpack("H")
            fields[self.name] = tuple(range(start, start + count))
        elif mode == KSET_LIST:
            fields[self.name] = struct.unpack(f"<{count}H", reader.take(2 * count))
        else:
            raise reader.invalid(f"k set mode {mode} is not defined")

    def describe(self) -> tuple[str, int | None, str]:
        return (
            "k set",
            None,
            "u8 mode, u16 n; mode 0 (range): u16 start, keys start..start+n-1; "
            f"mode 1 (list): n x u16, strictly ascending; {self.fewest} <= n <= {self.most}",
        )


@dataclass(frozen=True)
class _Seq:
    """Scalars (float32 by default), as many as ``count`` says from the fields before."""

    name: str
    count: Callable[[Mapping[str, Any]], int]
    note: str
    code: str = "f"

    def encode(self, msg: WireModel, out: bytearray) -> None:
        values = getattr(msg, self.name)
        out += _little_endian(f"{len(values)}{self.code}").pack(*values)

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None:
        layout = _little_endian(f"{self.count(fields)}{self.code}")
        fields[self.name] = layout.unpack_from(reader.data, reader._advance(layout.size))

    def describe(self) -> tuple[str, int | None, str]:
        return f"{_SCALARS[self.code]} x n", None, self.note


@dataclass(frozen=True)
class _Optional:
    """One scalar (float32 by default) present only when ``present`` holds for the
    fields decoded before."""

    name: str
    present: Callable[[Mapping[str, Any]], bool]
    note: str
    code: str = "f"

    def encode(self, msg: WireModel, out: bytearray) -> None:
        value = getattr(msg, self.name)
        if value is not None:
            out += struct.pack("<" + self.code, value)

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None:
        if self.present(fields):
            fields[self.name] = reader.unpack(self.code)

    def describe(self) -> tuple[str, int | None, str]:
        return f"{_SCALARS[self.code]} or nothing", None, self.note


@dataclass(frozen=True)
class _Shards:
    """u16 count, then per shard the board id (as ``_Text``) and its k set."""

    name: str = "shards"

    def encode(self, msg: WireModel, out: bytearray) -> None:
        shards: tuple[Shard, ...] = getattr(msg, self.name)
        out += struct.pack("<H", len(shards))
        for shard in shards:
            for item in _SHARD_FIELDS:
                item.encode(shard, out)

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None:
        count = reader.unpack("H")
        if count > MAX_SHARDS:
            raise reader.invalid(f"{count} shards, at most {MAX_SHARDS}")
        shards = []
        for _ in range(count):
            part: dict[str, Any] = {}
            for item in _SHARD_FIELDS:
                item.decode(reader, part)
            shards.append(part)
        fields[self.name] = tuple(shards)

    def describe(self) -> tuple[str, int | None, str]:
        return (
            "u16 n, n shards",
            None,
            f"n <= {MAX_SHARDS}, distinct boards; each: board id (u8 length, ASCII, <= 32), "
            "u16 slice_start, u16 slice_count (0: the whole batch, an EvalRequest; else an "
            "EvalSliceRequest), then its k set, which may be empty (n = 0, start 0: the "
            "update alone)",
        )


_SHARD_FIELDS: Final = (
    _Text("board_id", 32),
    _Scalar("slice_start", "H"),
    _Scalar("slice_count", "H"),
    _KSet(fewest=0),
)


def _n_ks(fields: Mapping[str, Any]) -> int:
    return len(fields["ks"])


def _two_sided(fields: Mapping[str, Any]) -> bool:
    return bool(fields["estimator"] == "two_sided")


_ESTIMATOR = _Enum("estimator", get_args(Estimator))
_JOB = _Scalar("job_id", "I", "uint32 job id; 0 = none")
_STEP = _Scalar("step", "I")

_LAYOUTS: Final[dict[type[WireModel], tuple[_Field, ...]]] = {
    Hello: (
        # Frozen across versions: protocol_version stays at offset 4.
        _Scalar("protocol_version", "H", "highest version the board speaks"),
        _Enum("npu", get_args(NpuKind)),
        _Scalar("ram_kib", "I"),
        _Scalar("max_batch", "H"),
        _Scalar("max_payload", "I", "the board's receive buffer"),
        _Scalar(
            "model_hash", "Q", "SHA-256 of the model blob held, first 8 bytes as LE u64; 0 = none"
        ),
        _Scalar("dataset_hash", "Q", "the same for the dataset held"),
        _Text("board_id", 32),
        _Text("firmware_version", 24),
    ),
    Heartbeat: (
        _Scalar("nonce", "I", "the Ping's nonce, 0 if unsolicited"),
        _Scalar("uptime_ms", "I"),
        _Enum("state", get_args(ReportedState)),
        _JOB,
        _Scalar("step", "I", "the step its weights are at (section 9)"),
    ),
    EvalResult: (
        _JOB,
        _STEP,
        _Scalar("compute_us", "I"),
        _ESTIMATOR,
        _KSet(),
        _Seq("loss_plus", _n_ks, "L(theta + eps z_k), one per k"),
        _Seq(
            "loss_minus",
            lambda f: _n_ks(f) if _two_sided(f) else 0,
            "two-sided: L(theta - eps z_k) per k; one-sided: absent",
        ),
        _Optional("loss_zero", lambda f: not _two_sided(f), "one-sided only: L(theta)"),
    ),
    EvalSliceResult: (
        _JOB,
        _STEP,
        _Scalar("compute_us", "I"),
        _ESTIMATOR,
        _Scalar("slice_start", "H", "first sample of the slice, an index into the batch"),
        _Scalar("slice_count", "H", "samples in the slice, >= 1"),
        _KSet(most=MAX_SLICE_KS),
        _Seq("sum_plus", _n_ks, "sum of loss_16 over the slice at theta + eps z_k", "Q"),
        _Seq(
            "sum_minus",
            lambda f: _n_ks(f) if _two_sided(f) else 0,
            "two-sided: the same at theta - eps z_k; one-sided: absent",
            "Q",
        ),
        _Optional("sum_zero", lambda f: not _two_sided(f), "one-sided only: at theta", "Q"),
    ),
    UpdateAck: (_JOB, _STEP, _Scalar("checksum", "I", "CRC-32 of weights (section 5)")),
    ValidateResult: (
        _JOB,
        _STEP,
        _Scalar("start", "I"),
        _Scalar("count", "I"),
        _Scalar("loss_sum", "d", "sum of the per-sample losses"),
        _Scalar("correct", "I"),
        _Scalar("compute_us", "I"),
    ),
    Loaded: (
        _Enum("resource", get_args(Resource)),
        _JOB,
        _Scalar("crc32", "I", "CRC-32 of the resource as held"),
        _Scalar("size", "I", "bytes"),
    ),
    Error: (
        _Enum("code", get_args(BoardErrorCode)),
        _Scalar("ref_type", "B", "type code of the offending message; 0 = none"),
        _JOB,
        _STEP,
        _Text("detail", 64),
    ),
    LoadModel: (
        _Scalar("total", "I", "blob length"),
        _Scalar("offset", "I"),
        _Scalar("crc32", "I", "CRC-32 of the whole blob"),
        _Blob("chunk", MAX_CHUNK),
    ),
    SetWeights: (
        _Scalar("total", "I", "length of weights (+ buffer) bytes"),
        _Scalar("offset", "I"),
        _JOB,
        _Scalar("step", "I", "the step these weights are at"),
        _Scalar("checksum", "I", "CRC-32 of the whole byte string (section 5)"),
        _Blob("chunk", MAX_CHUNK),
    ),
    SelectDataset: (
        _Text("name", 32),
        _Scalar("dataset_hash", "Q"),
        _Scalar("train_size", "I"),
        _Scalar("val_size", "I"),
    ),
    JobConfig: (
        _JOB,
        _Scalar("seed", "Q"),
        _Enum("numerics", get_args(Numerics)),
        _ESTIMATOR,
        _Enum("accumulator", get_args(Accumulator)),
        _Scalar("batch_size", "H"),
        _Scalar("eps", "f", "INT8: a whole number of steps"),
        _Enum("lr_unit", get_args(LrUnit)),
        _Scalar(
            "recalibrate_every",
            "I",
            "INT8 + FP16 buffer: steps between scale recalibrations; 0 = off",
        ),
    ),
    EvalRequest: (
        _JOB,
        _STEP,
        _Scalar("batch_size", "H"),
        _Scalar("eps", "f"),
        _ESTIMATOR,
        _KSet(),
    ),
    EvalSliceRequest: (
        _JOB,
        _STEP,
        _Scalar("batch_size", "H"),
        _Scalar("eps", "f"),
        _ESTIMATOR,
        _Scalar("slice_start", "H", "first sample of the slice, an index into the batch"),
        _Scalar("slice_count", "H", ">= 1; slice_start + slice_count <= batch_size"),
        _KSet(most=MAX_SLICE_KS),
    ),
    ApplyUpdate: (_JOB, _STEP, _KSet(), _Seq("coefficients", _n_ks, "c_k, one per k")),
    ValidateRequest: (_JOB, _STEP, _Scalar("start", "I"), _Scalar("count", "I", ">= 1")),
    Ping: (_Scalar("nonce", "I"),),
    Reset: (_Enum("scope", get_args(ResetScope)),),
    StepOrder: (
        _JOB,
        _Scalar("step", "I", "the update's step; the shards are of step + 1"),
        _KSet(),
        _Seq("coefficients", _n_ks, "c_k, one per k"),
        _Scalar("batch_size", "H", "of the next step's requests"),
        _Scalar("eps", "f"),
        _ESTIMATOR,
        _Shards(),
    ),
}
_BY_CODE: Final[dict[int, type[WireModel]]] = {code: cls for cls, code in TYPE_CODES.items()}


@dataclass(frozen=True)
class _Packed:
    """Consecutive fixed-width fields (scalars and enums) read and written with one
    struct call, as a message's runs of them are: the same bytes as field by field.
    When the message ends inside the run, decoding goes field by field, so a short
    message is refused with the same words, and for the same first fault, as before."""

    items: tuple[_Scalar | _Enum, ...]

    @functools.cached_property
    def layout(self) -> struct.Struct:
        return struct.Struct(
            "<" + "".join(i.code if isinstance(i, _Scalar) else "B" for i in self.items)
        )

    @functools.cached_property
    def choices(self) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
        """(name, the enum's choices or None) per field."""
        return tuple((i.name, i.choices if isinstance(i, _Enum) else None) for i in self.items)

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The fields' names, in order."""
        return tuple(i.name for i in self.items)

    @functools.cached_property
    def enums(self) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
        """(position, name, choices) of each enum of the run."""
        return tuple(
            (n, i.name, i.choices) for n, i in enumerate(self.items) if isinstance(i, _Enum)
        )

    def encode(self, msg: WireModel, out: bytearray) -> None:
        values = [
            getattr(msg, name) if choices is None else choices.index(getattr(msg, name))
            for name, choices in self.choices
        ]
        out += self.layout.pack(*values)

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None:
        layout = self.layout
        if reader.pos + layout.size > len(reader.data):
            for item in self.items:
                item.decode(reader, fields)  # raises "truncated" where the bytes end
            return
        values = layout.unpack_from(reader.data, reader.pos)
        reader.pos += layout.size
        fields.update(zip(self.names, values, strict=True))
        for position, name, choices in self.enums:  # an enum's code becomes its name
            value = values[position]
            if value >= len(choices):
                raise reader.invalid(f"{name} code {value} is not defined")
            fields[name] = choices[value]


class _Step(Protocol):
    """What encoding and decoding walk: a field, or a run of fields as one."""

    def encode(self, msg: WireModel, out: bytearray) -> None: ...

    def decode(self, reader: _Reader, fields: dict[str, Any]) -> None: ...


def _packed(layout: tuple[_Field, ...]) -> tuple[_Step, ...]:
    """``layout`` with each run of two or more fixed-width fields as one ``_Packed``."""
    out: list[_Step] = []
    run: list[_Scalar | _Enum] = []
    for item in (*layout, None):
        if isinstance(item, _Scalar | _Enum):
            run.append(item)
            continue
        out.extend([_Packed(tuple(run))] if len(run) > 1 else run)
        run = []
        if item is not None:
            out.append(item)
    return tuple(out)


# What encode and decode walk: the layouts with their fixed-width runs packed.
_WIRE: Final = {cls: _packed(layout) for cls, layout in _LAYOUTS.items()}
_HEADERS: Final = {
    cls: MAGIC + struct.pack("<BB", PROTOCOL_VERSION, code) for cls, code in TYPE_CODES.items()
}

# The values each unsigned integer struct code can carry: a model's bound inside them is
# checked.
_WIRE_RANGES: Final = {c: (0, 2 ** (8 * struct.calcsize("<" + c)) - 1) for c in "BHIQ"}


@dataclass(frozen=True)
class _RangeAnswer:
    """An eval answer (``EvalResult``, ``EvalSliceResult``) in the form boards send it,
    its keys a range, decoded in three struct calls and checked here against every rule
    of its model, instead of the generic walk and the model's validation: a host decodes
    one per member board and step, and those two were most of its work per answer, on
    the way from its first member's answer to its last. Any other form (a list of keys,
    a bad field, a wrong length) returns None and takes the generic walk, which refuses
    it with the usual error. ``decode`` gives the same message either way (a test
    compares the two on random and broken bytes).

    The rules: the fixed fields' bounds that are narrower than their wire width (from
    the model's ``Ge``/``Le``, such as ``slice_count >= 1``), the estimator's code, the
    key count (the model's ``MinLen``/``MaxLen``) and the last key (``K_LIMIT``), finite
    float32 losses, and the exact length; the values' counts and the estimator agree by
    construction, as the layout reads them."""

    cls: type[WireModel]
    head: _Packed  # the fixed fields before the keys
    ks: str
    plus: _Seq
    minus: _Seq
    zero: _Optional

    @classmethod
    def of(cls, model: type[WireModel]) -> _RangeAnswer:
        head, ks, plus, minus, zero = _WIRE[model]
        assert isinstance(head, _Packed) and isinstance(ks, _KSet)
        assert isinstance(plus, _Seq) and isinstance(minus, _Seq) and isinstance(zero, _Optional)
        assert plus.code == minus.code == zero.code  # one struct reads them all
        return cls(model, head, ks.name, plus, minus, zero)

    @functools.cached_property
    def bounds(self) -> tuple[tuple[int, int, int], ...]:
        """(position, least, most) of each fixed field the model bounds more tightly
        than the wire does."""
        out = []
        for position, item in enumerate(self.head.items):
            if not isinstance(item, _Scalar) or item.code not in _WIRE_RANGES:
                continue
            least, most = _WIRE_RANGES[item.code]
            for rule in self.cls.model_fields[item.name].metadata:
                least = max(least, getattr(rule, "ge", least))
                most = min(most, getattr(rule, "le", most))
            if (least, most) != _WIRE_RANGES[item.code]:
                out.append((position, least, most))
        return tuple(out)

    @functools.cached_property
    def key_counts(self) -> tuple[int, int]:
        """The fewest and most keys the model takes."""
        rules = self.cls.model_fields[self.ks].metadata
        fewest = max((getattr(r, "min_length", 0) for r in rules), default=0)
        most = min((getattr(r, "max_length", MAX_KS) for r in rules), default=MAX_KS)
        return fewest, most

    def decode(self, data: bytes) -> WireModel | None:
        """The message in ``data`` (header checked by the caller), or None."""
        head = self.head.layout
        start = HEADER_SIZE + head.size + _RANGE_HEAD.size
        if len(data) < start:
            return None
        values = head.unpack_from(data, HEADER_SIZE)
        mode, count, first = _RANGE_HEAD.unpack_from(data, start - _RANGE_HEAD.size)
        fewest, most = self.key_counts
        if mode != KSET_RANGE or not fewest <= count <= most or first + count - 1 > K_LIMIT:
            return None
        for position, least, largest in self.bounds:
            if not least <= values[position] <= largest:
                return None
        fields = dict(zip(self.head.names, values, strict=True))
        for position, name, choices in self.head.enums:
            if values[position] >= len(choices):
                return None
            fields[name] = choices[values[position]]
        two_sided = _two_sided(fields)
        total = 2 * count if two_sided else count + 1
        layout = _little_endian(f"{total}{self.plus.code}")
        if len(data) != start + layout.size:
            return None
        numbers = layout.unpack_from(data, start)
        if self.plus.code == "f" and not all(map(math.isfinite, numbers)):
            return None
        fields[self.ks] = tuple(range(first, first + count))
        fields[self.plus.name] = numbers[:count]
        fields[self.minus.name] = numbers[count:] if two_sided else ()
        if not two_sided:  # absent two-sided: left to its default, as the generic walk does
            fields[self.zero.name] = numbers[count]
        return trusted(self.cls, fields)


# The messages decode takes the short way when it can (``_RangeAnswer``).
_RANGE_ANSWERS: Final = {
    TYPE_CODES[model]: _RangeAnswer.of(model) for model in (EvalResult, EvalSliceResult)
}


def encode(msg: DataMessage) -> bytes:
    """Encode a data-plane message to its binary form (header included).

    Args:
        msg: any data-plane message model.

    Returns:
        The bytes; the same on serial (inside a frame) and on MQTT.

    Raises:
        ProtocolError: kind ``oversized`` when the encoding exceeds MAX_PAYLOAD.
    """
    cls = type(msg)
    code = TYPE_CODES[cls]
    out = bytearray(_HEADERS[cls])
    for item in _WIRE[cls]:
        item.encode(msg, out)
    if len(out) > MAX_PAYLOAD:
        raise ProtocolError(
            "oversized", f"{len(out)} bytes > MAX_PAYLOAD {MAX_PAYLOAD}", msg_type=code
        )
    return bytes(out)


def peek_header(data: bytes) -> tuple[int, int]:
    """Read (version, type code) from a message header, whatever the version.

    The header layout never changes between versions, so a daemon can answer any
    board's message with ``Error(code="unsupported_version")``.

    Raises:
        ProtocolError: ``truncated`` or ``bad_magic``.
    """
    if len(data) < HEADER_SIZE:
        raise ProtocolError("truncated", f"{len(data)} bytes, a header needs {HEADER_SIZE}")
    if not data.startswith(MAGIC):
        raise ProtocolError("bad_magic", f"header starts with {bytes(data[:2]).hex()}, not 5153")
    return data[2], data[3]


def decode(data: bytes) -> DataMessage:
    """Decode one binary data-plane message.

    Args:
        data: exactly one encoded message.

    Returns:
        The message model.

    Raises:
        ProtocolError: on any malformed input (never another exception).
    """
    data = bytes(data)
    if len(data) > MAX_PAYLOAD:
        raise ProtocolError("oversized", f"{len(data)} bytes > MAX_PAYLOAD {MAX_PAYLOAD}")
    version, code = peek_header(data)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            "unsupported_version",
            f"version {version}, this side speaks {PROTOCOL_VERSION}",
            msg_type=code,
            version=version,
        )
    cls = _BY_CODE.get(code)
    if cls is None:
        raise ProtocolError("unknown_type", f"type code 0x{code:02x} is not defined", msg_type=code)
    answer = _RANGE_ANSWERS.get(code)
    if answer is not None:
        msg = answer.decode(data)
        if msg is not None:
            return cast(DataMessage, msg)
    reader = _Reader(data, code)
    fields: dict[str, Any] = {}
    for item in _WIRE[cls]:
        item.decode(reader, fields)
    if reader.pos != len(data):
        raise ProtocolError(
            "trailing_bytes", f"{len(data) - reader.pos} bytes after the message", msg_type=code
        )
    try:
        # TYPE_CODES, hence _BY_CODE, holds exactly the DataMessage classes.
        return cast(DataMessage, validated(cls, fields))
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ProtocolError("invalid_field", detail, msg_type=code) from exc


# What decode_shared and encode_shared keep: the latest distinct bytes and their message,
# oldest first; changed under the lock (a process may decode on more than one thread).
# Enough for a step's requests to a host's members (one each) beside its update and acks.
_SHARED: Final[dict[bytes, DataMessage]] = {}
_SHARED_KEPT: Final = 512
_SHARED_LOCK: Final = threading.Lock()

# The step's messages a receiver may find decoded with ``decode_shared``: an update that
# every board of a process gets as the same bytes, and an eval request made in the
# process (a board's from a step order, a host's share for an in-process member).
STEP_SHARED_CODES: Final = (
    TYPE_CODES[ApplyUpdate],
    TYPE_CODES[EvalRequest],
    TYPE_CODES[EvalSliceRequest],
)


def decode_shared(data: bytes, *codes: int) -> DataMessage:
    """``decode``, once per process for equal bytes of the types ``codes``; other
    messages are decoded as usual. For what many receivers in one process get as the
    same bytes (an update fanned out to the boards of a process, their equal acks to an
    aggregator), and for what was made in the process (``encode_shared``): messages are
    frozen, so they may share one decoded object. Errors are not kept.

    Raises:
        ProtocolError: as ``decode``.
    """
    if len(data) > HEADER_SIZE and data[3] in codes:
        key = bytes(data)
        msg = _SHARED.get(key)
        if msg is None:
            msg = decode(key)
            _keep(key, msg)
        return msg
    return decode(data)


def encode_shared(msg: DataMessage) -> bytes:
    """``encode``, and ``msg`` is what ``decode_shared`` gives for these bytes from now on
    (a model equals its own decode): for a message made in this process and read again
    in it, such as the update a fleet topic's ``StepOrder`` carries, the eval request a
    board of the process takes from it, or a host's share for an in-process member.

    Raises:
        ProtocolError: as ``encode``.
    """
    data = encode(msg)
    _keep(data, msg)
    return data


def _keep(data: bytes, msg: DataMessage) -> None:
    with _SHARED_LOCK:
        _SHARED.pop(data, None)
        _SHARED[data] = msg
        while len(_SHARED) > _SHARED_KEPT:
            del _SHARED[next(iter(_SHARED))]


@dataclass
class _Table:
    rows: list[str] = field(default_factory=list)
    offset: int | None = HEADER_SIZE


def layout_tables() -> str:
    """Markdown byte tables of every message, in type-code order (SPEC section 6)."""
    parts: list[str] = []
    for cls, code in sorted(TYPE_CODES.items(), key=lambda item: item[1]):
        table = _Table()
        for item in _LAYOUTS[cls]:
            kind, size, note = item.describe()
            where = "" if table.offset is None else str(table.offset)
            table.rows.append(f"| {where} | `{item.name}` | {kind} | {note} |")
            table.offset = None if size is None or table.offset is None else table.offset + size
        type_name = cls.model_fields["type"].default
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        parts.append(
            f"#### 0x{code:02X} `{type_name}` ({cls.__name__})\n\n{doc}\n\n"
            "| offset | field | type | notes |\n| --- | --- | --- | --- |\n"
            "| 0 | header | 4 bytes | `51 53`, version, "
            f"type 0x{code:02X} |\n" + "\n".join(table.rows) + "\n"
        )
    return "\n".join(parts)
