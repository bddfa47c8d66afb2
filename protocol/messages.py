"""Data-plane messages between the daemon and a board, as pydantic models.

Every message is a frozen model with ``type: Literal[...]``; the unions are
discriminated on ``type``. The binary layout of each message is in ``codec.py``
(``protocol/SPEC.md``, section 6); these models are what both ends of a link
work with. Floats that travel as float32 are rounded to float32 on validation, so
a model equals its own decode(encode()) exactly.
"""

from __future__ import annotations

import array
import functools
import math
import operator
import struct
import zlib
from typing import Annotated, Any, Final, Literal, TypeVar, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from qsched.protocol.jobspec import JobSpec

__all__ = [
    "BOARD_ERROR_CODES",
    "HEARTBEAT_INTERVAL_S",
    "K_LIMIT",
    "MAX_CHUNK",
    "MAX_KS",
    "MAX_PAYLOAD",
    "MAX_SHARDS",
    "MAX_SLICE_KS",
    "PROTOCOL_VERSION",
    "TYPE_CODES",
    "Accumulator",
    "ApplyUpdate",
    "BoardErrorCode",
    "BoardMessage",
    "DaemonMessage",
    "DataMessage",
    "DataMessageAdapter",
    "Error",
    "Estimator",
    "EvalRequest",
    "EvalResult",
    "EvalSliceRequest",
    "EvalSliceResult",
    "Heartbeat",
    "Hello",
    "JobConfig",
    "LoadModel",
    "Loaded",
    "LrUnit",
    "NpuKind",
    "Numerics",
    "Ping",
    "ReportedState",
    "Reset",
    "ResetScope",
    "Resource",
    "SelectDataset",
    "SetWeights",
    "Shard",
    "StepOrder",
    "UpdateAck",
    "ValidateRequest",
    "ValidateResult",
    "WireModel",
    "job_config",
    "job_id_of",
    "validated",
]

PROTOCOL_VERSION: Final = 2
# Largest encoded data-plane message (header included). Sized so that one message
# carries MAX_KS keys with two float32 losses each, as an explicit list; a board's
# receive buffer is this big (C: QS_MAX_PAYLOAD).
MAX_PAYLOAD: Final = 12288
# Largest chunk of a LoadModel / SetWeights message.
MAX_CHUNK: Final = 8192
# Most sample keys k in one EvalRequest / EvalResult / ApplyUpdate. k is a uint16.
MAX_KS: Final = 1024
K_LIMIT: Final = 0xFFFF
# Most keys in one EvalSliceRequest / EvalSliceResult: two u64 sums per key must fit
# in MAX_PAYLOAD (and in the C firmware's two float32 loss arrays of MAX_KS each).
MAX_SLICE_KS: Final = MAX_KS // 2
# Most shards in one StepOrder: one per board of the largest fleet a message must carry.
MAX_SHARDS: Final = 1024
# A board sends an unsolicited Heartbeat at least this often while idle.
HEARTBEAT_INTERVAL_S: Final = 5.0

BoardErrorCode = Literal[
    "internal",
    "unsupported_version",
    "malformed",
    "unknown_type",
    "unknown_job",
    "stale_step",
    "not_ready",
    "busy",
    "crc_mismatch",
    "too_large",
    "no_memory",
    "numeric",
    "dataset_missing",
    "model_invalid",
]
BOARD_ERROR_CODES: tuple[str, ...] = get_args(BoardErrorCode)

Estimator = Literal["two_sided", "one_sided"]
Numerics = Literal["fp32", "int8"]
Accumulator = Literal["fp16", "int8"]
LrUnit = Literal["int8_step", "weight"]
NpuKind = Literal["none", "neural_art", "virtual"]
ReportedState = Literal["idle", "loading", "ready", "busy", "fault"]
Resource = Literal["model", "weights", "dataset", "job_config"]
ResetScope = Literal["soft", "hard"]


def _float32s(values: tuple[float, ...]) -> tuple[float, ...]:
    """Round each value to float32; a NaN, an infinity or an overflow is refused.

    One pass over the sequence: an update carries up to 256 coefficients."""
    if not all(map(math.isfinite, values)):
        bad = next(v for v in values if not math.isfinite(v))
        raise ValueError(f"expected a finite float32, got {bad}")
    rounded = array.array("f", values)  # float32 rounding; an overflow becomes inf
    if not all(map(math.isfinite, rounded)):
        bad = next(v for v, r in zip(values, rounded, strict=True) if not math.isfinite(r))
        raise ValueError(f"{bad} is out of float32 range")
    return tuple(rounded)


_FLOAT32: Final = struct.Struct("<f")


def _float32(value: float) -> float:
    """``_float32s`` of one value: the same rounding (a C cast to float, which packing
    also does) without building a sequence for it."""
    if not math.isfinite(value):
        raise ValueError(f"expected a finite float32, got {value}")
    try:
        (rounded,) = _FLOAT32.unpack(_FLOAT32.pack(value))
    except OverflowError:
        raise ValueError(f"{value} is out of float32 range") from None
    return float(rounded)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"expected a finite float, got {value}")
    return value


def _ascending_ks(ks: tuple[int, ...]) -> tuple[int, ...]:
    # Each pair compared in C: a step order carries a few hundred keys.
    if not all(map(operator.lt, ks, ks[1:])):
        raise ValueError("sample keys k must be strictly ascending (no repeats)")
    return ks


U8 = Annotated[int, Field(ge=0, le=0xFF)]
U16 = Annotated[int, Field(ge=0, le=0xFFFF)]
U32 = Annotated[int, Field(ge=0, le=0xFFFFFFFF)]
U64 = Annotated[int, Field(ge=0, le=0xFFFFFFFFFFFFFFFF)]
F32 = Annotated[float, AfterValidator(_float32)]
F32s = Annotated[tuple[float, ...], AfterValidator(_float32s)]
F64 = Annotated[float, AfterValidator(_finite)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,32}$")]
Version = Annotated[str, Field(pattern=r"^[\x21-\x7e]{1,24}$")]
Detail = Annotated[str, Field(pattern=r"^[\x20-\x7e]{0,64}$")]
Ks = Annotated[
    tuple[Annotated[int, Field(ge=0, le=K_LIMIT)], ...],
    Field(min_length=1, max_length=MAX_KS),
    AfterValidator(_ascending_ks),
]
SliceKs = Annotated[
    tuple[Annotated[int, Field(ge=0, le=K_LIMIT)], ...],
    Field(min_length=1, max_length=MAX_SLICE_KS),
    AfterValidator(_ascending_ks),
]
# A shard's keys: as Ks, or none (the board takes the update alone).
ShardKs = Annotated[
    tuple[Annotated[int, Field(ge=0, le=K_LIMIT)], ...],
    Field(max_length=MAX_KS),
    AfterValidator(_ascending_ks),
]
Chunk = Annotated[bytes, Field(max_length=MAX_CHUNK)]


class WireModel(BaseModel):
    """Wire conventions shared by every message: no extra fields, immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# --- board -> daemon -------------------------------------------------------------


class Hello(WireModel):
    """First message of a board on every link: who it is and what it can do."""

    type: Literal["hello"] = "hello"
    protocol_version: U16 = PROTOCOL_VERSION
    board_id: Name
    firmware_version: Version
    npu: NpuKind
    ram_kib: U32
    max_batch: U16
    max_payload: U32 = MAX_PAYLOAD
    model_hash: U64 = 0  # first 8 bytes of SHA-256 of the model blob held, LE; 0 = none
    dataset_hash: U64 = 0  # the same for the dataset held; 0 = none


class Heartbeat(WireModel):
    """Periodic liveness, and the answer to a Ping (echoing its nonce; 0 if unsolicited)."""

    type: Literal["heartbeat"] = "heartbeat"
    nonce: U32 = 0
    uptime_ms: U32
    state: ReportedState
    job_id: U32 = 0
    step: U32 = 0  # the step its weights are at: the next step it can evaluate


def _check_values(
    kind: str,
    estimator: str,
    ks: tuple[int, ...],
    plus: tuple[Any, ...],
    minus: tuple[Any, ...],
    zero: object,
) -> None:
    """An eval answer's values (``kind``: loss or sum): one plus per k; two-sided also one
    minus per k and no zero, one-sided one zero and no minus."""
    if len(plus) != len(ks):
        raise ValueError(f"{kind}_plus needs one {kind} per k")
    if estimator == "two_sided":
        if len(minus) != len(ks) or zero is not None:
            raise ValueError(f"two-sided results carry {kind}_minus per k and no {kind}_zero")
    elif minus or zero is None:
        raise ValueError(f"one-sided results carry one {kind}_zero and no {kind}_minus")


class EvalResult(WireModel):
    """Losses for each requested k: L+ and L- (two-sided) or L+ and one L0 (one-sided)."""

    type: Literal["eval_result"] = "eval_result"
    job_id: U32
    step: U32
    compute_us: U32
    estimator: Estimator
    ks: Ks
    loss_plus: F32s
    loss_minus: F32s = ()
    loss_zero: F32 | None = None

    @model_validator(mode="after")
    def _check_losses(self) -> EvalResult:
        _check_values(
            "loss", self.estimator, self.ks, self.loss_plus, self.loss_minus, self.loss_zero
        )
        return self


class EvalSliceResult(WireModel):
    """INT8 loss sums of a slice of the batch for each requested k (section 6.10)."""

    type: Literal["eval_slice_result"] = "eval_slice_result"
    job_id: U32
    step: U32
    compute_us: U32
    estimator: Estimator
    slice_start: U16
    slice_count: Annotated[int, Field(ge=1, le=0xFFFF)]
    ks: SliceKs
    sum_plus: tuple[U64, ...]
    sum_minus: tuple[U64, ...] = ()
    sum_zero: U64 | None = None

    @model_validator(mode="after")
    def _check_sums(self) -> EvalSliceResult:
        _check_values("sum", self.estimator, self.ks, self.sum_plus, self.sum_minus, self.sum_zero)
        return self


class UpdateAck(WireModel):
    """An update was applied; the checksum is CRC-32 of the weights (SPEC section 5)."""

    type: Literal["update_ack"] = "update_ack"
    job_id: U32
    step: U32
    checksum: U32


class ValidateResult(WireModel):
    """Unperturbed evaluation of validation samples [start, start + count)."""

    type: Literal["validate_result"] = "validate_result"
    job_id: U32
    step: U32
    start: U32
    count: U32
    loss_sum: F64
    correct: U32
    compute_us: U32

    @model_validator(mode="after")
    def _check_counts(self) -> ValidateResult:
        if self.correct > self.count:
            raise ValueError("correct cannot exceed count")
        return self


class Loaded(WireModel):
    """A resource is complete and verified: the last chunk arrived and the CRC matched."""

    type: Literal["loaded"] = "loaded"
    resource: Resource
    job_id: U32 = 0
    crc32: U32
    size: U32


# --- both directions -------------------------------------------------------------


class Error(WireModel):
    """A typed refusal. ``ref_type`` is the type code of the offending message (0: none)."""

    type: Literal["error"] = "error"
    code: BoardErrorCode
    ref_type: U8 = 0
    job_id: U32 = 0
    step: U32 = 0
    detail: Detail = ""


# --- daemon -> board -------------------------------------------------------------


class _Chunked(WireModel):
    total: U32
    offset: U32
    chunk: Chunk

    @model_validator(mode="after")
    def _check_bounds(self) -> _Chunked:
        if self.offset + len(self.chunk) > self.total:
            raise ValueError("chunk runs past the total length")
        return self


class LoadModel(_Chunked):
    """One chunk of the model blob; ``crc32`` is over the whole blob."""

    type: Literal["load_model"] = "load_model"
    crc32: U32


class SetWeights(_Chunked):
    """One chunk of the flat trainable vector followed (INT8) by the accumulation buffer.

    The whole byte string is exactly what the weight checksum covers (SPEC section 5),
    so ``checksum`` is both the transfer CRC and the expected ``UpdateAck`` checksum.
    """

    type: Literal["set_weights"] = "set_weights"
    job_id: U32
    step: U32
    checksum: U32


class SelectDataset(WireModel):
    """The dataset the board must use, and the hash that identifies its contents."""

    type: Literal["select_dataset"] = "select_dataset"
    name: Name
    dataset_hash: U64
    train_size: U32
    val_size: U32


class JobConfig(WireModel):
    """What a board needs from the JobSpec (see ``job_config``)."""

    type: Literal["job_config"] = "job_config"
    job_id: U32
    seed: U64
    numerics: Numerics
    estimator: Estimator
    accumulator: Accumulator
    batch_size: U16
    eps: F32
    lr_unit: LrUnit
    recalibrate_every: U32


class EvalRequest(WireModel):
    """Evaluate the perturbed losses of sample keys ``ks`` at a step."""

    type: Literal["eval_request"] = "eval_request"
    job_id: U32
    step: U32
    batch_size: U16
    eps: F32
    estimator: Estimator
    ks: Ks


class EvalSliceRequest(WireModel):
    """INT8: sum the losses of samples [start, start + count) of the batch for keys ``ks``."""

    @classmethod
    def of(cls, request: EvalRequest, start: int, count: int) -> EvalSliceRequest:
        """``request``'s keys on the batch slice ``[start, start + count)``."""
        return cls.model_validate(
            {
                **request.model_dump(exclude={"type"}),
                "slice_start": start,
                "slice_count": count,
            }
        )

    type: Literal["eval_slice_request"] = "eval_slice_request"
    job_id: U32
    step: U32
    batch_size: U16
    eps: F32
    estimator: Estimator
    slice_start: U16
    slice_count: Annotated[int, Field(ge=1, le=0xFFFF)]
    ks: SliceKs

    @model_validator(mode="after")
    def _check_slice(self) -> EvalSliceRequest:
        if self.slice_start + self.slice_count > self.batch_size:
            raise ValueError("the slice ends after the batch")
        return self


class ApplyUpdate(WireModel):
    """The step's update: pairs (k, c_k), k ascending (SPEC section 4)."""

    type: Literal["apply_update"] = "apply_update"
    job_id: U32
    step: U32
    ks: Ks
    coefficients: F32s

    @model_validator(mode="after")
    def _check_pairs(self) -> ApplyUpdate:
        if len(self.coefficients) != len(self.ks):
            raise ValueError("one coefficient per k")
        return self

    def pairs(self) -> list[tuple[int, float]]:
        """The (k, c_k) pairs in ascending k, as ``qsched.zo.update`` takes them."""
        return list(zip(self.ks, self.coefficients, strict=True))


class Shard(WireModel):
    """One board of a ``StepOrder`` and its keys of the next step (none: update only).

    ``slice_count`` 0 asks for whole-batch losses (``EvalRequest``); otherwise the shard
    is the ``EvalSliceRequest`` of samples ``[slice_start, slice_start + slice_count)``.
    """

    board_id: Name
    ks: ShardKs = ()
    slice_start: U16 = 0
    slice_count: U16 = 0

    @model_validator(mode="after")
    def _check_slice(self) -> Shard:
        if self.slice_count == 0 and self.slice_start != 0:
            raise ValueError("a whole-batch shard has slice_start 0")
        if self.slice_count and len(self.ks) > MAX_SLICE_KS:
            raise ValueError(f"a slice shard holds at most {MAX_SLICE_KS} keys")
        return self


def _distinct_boards(shards: tuple[Shard, ...]) -> tuple[Shard, ...]:
    names = [s.board_id for s in shards]
    if len(set(names)) != len(names):
        raise ValueError("a board is named by more than one shard")
    return shards


class StepOrder(WireModel):
    """A step for the whole fleet: ``ApplyUpdate(step)`` and the next step's shards.

    Published once on the MQTT fleet topic (SPEC 6.9) instead of one ``ApplyUpdate`` and
    one ``EvalRequest`` per board; the endpoint of each board it names turns it into
    exactly the messages the daemon would have sent on the board's own topic
    (``qsched.protocol.links.mqtt.step_order_messages``). A board it does not name
    ignores it.
    """

    type: Literal["step_order"] = "step_order"
    job_id: U32
    step: U32
    ks: Ks
    coefficients: F32s
    batch_size: U16
    eps: F32
    estimator: Estimator
    shards: Annotated[
        tuple[Shard, ...], Field(max_length=MAX_SHARDS), AfterValidator(_distinct_boards)
    ] = ()

    @model_validator(mode="after")
    def _check_pairs(self) -> StepOrder:
        if len(self.coefficients) != len(self.ks):
            raise ValueError("one coefficient per k")
        return self

    def update(self) -> ApplyUpdate:
        """The ``ApplyUpdate`` every board at ``step`` takes from this order."""
        # Not validated again: these fields passed the order's own checks, which are the
        # update's (Ks, F32s, one coefficient per k), and 64 of each cost a host 0.1 M
        # instructions a step to check twice.
        return ApplyUpdate.model_construct(
            job_id=self.job_id, step=self.step, ks=self.ks, coefficients=self.coefficients
        )

    def request_for(self, board_id: str) -> EvalRequest | EvalSliceRequest | None:
        """The request of step ``step + 1`` this order gives ``board_id``, if any."""
        for shard in self.shards:
            if shard.board_id != board_id or not shard.ks:
                continue
            request = EvalRequest(
                job_id=self.job_id,
                step=self.step + 1,
                batch_size=self.batch_size,
                eps=self.eps,
                estimator=self.estimator,
                ks=shard.ks,
            )
            if shard.slice_count == 0:
                return request
            return EvalSliceRequest.of(request, shard.slice_start, shard.slice_count)
        return None

    def names(self, board_id: str) -> bool:
        """Whether the order is for ``board_id`` (its shard may hold no keys)."""
        return any(shard.board_id == board_id for shard in self.shards)


class ValidateRequest(WireModel):
    """Evaluate the unperturbed model on validation samples [start, start + count)."""

    type: Literal["validate_request"] = "validate_request"
    job_id: U32
    step: U32
    start: U32
    count: Annotated[int, Field(ge=1, le=0xFFFFFFFF)]


class Ping(WireModel):
    """Liveness probe; the board answers with a Heartbeat echoing ``nonce``."""

    type: Literal["ping"] = "ping"
    nonce: U32


class Reset(WireModel):
    """Soft: drop job, model and weights. Hard: reboot the board."""

    type: Literal["reset"] = "reset"
    scope: ResetScope = "soft"


BoardMessage = Annotated[
    Hello | Heartbeat | EvalResult | EvalSliceResult | UpdateAck | ValidateResult | Loaded | Error,
    Field(discriminator="type"),
]
DaemonMessage = Annotated[
    LoadModel
    | SetWeights
    | SelectDataset
    | JobConfig
    | EvalRequest
    | EvalSliceRequest
    | ApplyUpdate
    | ValidateRequest
    | Ping
    | Reset
    | StepOrder
    | Error,
    Field(discriminator="type"),
]
DataMessage = Annotated[
    Hello
    | Heartbeat
    | EvalResult
    | EvalSliceResult
    | UpdateAck
    | ValidateResult
    | Loaded
    | Error
    | LoadModel
    | SetWeights
    | SelectDataset
    | JobConfig
    | EvalRequest
    | EvalSliceRequest
    | ApplyUpdate
    | ValidateRequest
    | Ping
    | Reset
    | StepOrder,
    Field(discriminator="type"),
]
DataMessageAdapter: TypeAdapter[DataMessage] = TypeAdapter(DataMessage)

# Binary type codes: board -> daemon 0x01.., daemon -> board 0x41.., both ways 0x7F.
TYPE_CODES: Final[dict[type[WireModel], int]] = {
    Hello: 0x01,
    Heartbeat: 0x02,
    EvalResult: 0x03,
    UpdateAck: 0x04,
    ValidateResult: 0x05,
    Loaded: 0x06,
    EvalSliceResult: 0x07,
    LoadModel: 0x41,
    SetWeights: 0x42,
    SelectDataset: 0x43,
    JobConfig: 0x44,
    EvalRequest: 0x45,
    ApplyUpdate: 0x46,
    ValidateRequest: 0x47,
    Ping: 0x48,
    Reset: 0x49,
    StepOrder: 0x4A,
    EvalSliceRequest: 0x4B,
    Error: 0x7F,
}


_Model = TypeVar("_Model", bound=WireModel)


def validated(cls: type[_Model], fields: dict[str, Any]) -> _Model:
    """``cls(**fields)``: the same checks and errors (``ValidationError``), through the
    model's validator alone, without the constructor's wrapper around it. For the
    messages built or decoded once per board and step on a host of many boards."""
    return cls.__pydantic_validator__.validate_python(fields)  # type: ignore[no-any-return]


@functools.cache
def _field_template(cls: type[WireModel]) -> dict[str, Any]:
    """Every field of ``cls`` in order, at its default (None where it has none): updated
    with a message's fields it keeps the order a validated message's fields have."""
    return {name: None if f.is_required() else f.default for name, f in cls.model_fields.items()}


def trusted(cls: type[_Model], fields: dict[str, Any]) -> _Model:
    """What ``validated(cls, fields)`` returns, for ``fields`` already checked against
    every rule of ``cls`` by the caller: the codec's decoder of the eval answers a host
    takes from each of its boards every step, where a model's validation was most of a
    decode. The fields ``fields`` leaves out take their defaults, and the message counts
    the others as set, as a validated one does. ``model_construct`` does the same more
    slowly than the validation it would save."""
    state = _field_template(cls).copy()
    state.update(fields)
    msg = cls.__new__(cls)
    object.__setattr__(msg, "__dict__", state)
    object.__setattr__(msg, "__pydantic_fields_set__", set(fields))
    object.__setattr__(msg, "__pydantic_extra__", None)
    object.__setattr__(msg, "__pydantic_private__", None)
    return msg


def job_id_of(spec: JobSpec) -> int:
    """The uint32 job id boards use to reject stale requests: CRC-32 of the spec's JSON.

    0 means "no job" on the wire, so a CRC of 0 maps to 1.
    """
    return zlib.crc32(spec.model_dump_json().encode("utf-8")) or 1


def job_config(spec: JobSpec) -> JobConfig:
    """The binary JobConfig a board receives for a job spec."""
    return JobConfig(
        job_id=job_id_of(spec),
        seed=spec.seed,
        numerics=spec.numerics,
        estimator=spec.estimator,
        accumulator=spec.accumulator,
        batch_size=spec.batch_size,
        eps=spec.eps,
        lr_unit=spec.lr_unit,
        recalibrate_every=spec.recalibrate_every,
    )
