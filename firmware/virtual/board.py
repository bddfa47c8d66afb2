"""The Python virtual board: the board side of the protocol, computed with ``qsched.zo``.

A ``BoardAgent`` is transport-agnostic: ``await agent.handle(msg)`` takes one
daemon-to-board message and returns the board's answers. ``serve_link`` runs an agent on
any ``Link`` (in-process, serial, MQTT): it sends the Hello, heartbeats from a separate
task, decodes what arrives and encodes what goes back. Its losses and checksums are the
bits the daemon computes with ``Workload`` — it builds one from the model blob it was
sent, the data set it holds and the job config — and it answers after the time an
STM32N6 would take (``LatencyProfile``), counted from when the request reached its link,
so a fleet of virtual boards has a real fleet's timing even where many boards share one
process and its core.

Session, as the board sees it (SPEC section 9 has the daemon's side):

- ``LoadModel`` chunks are reassembled (a chunk at offset 0 starts over, duplicates are
  ignored, overlaps refused), CRC-checked and decoded; ``Loaded(model)`` answers the last
  one. ``SelectDataset`` is checked against the board's own copy (name, hash, sizes):
  ``Loaded(dataset)`` or ``dataset_missing``.
  ``JobConfig``: ``Loaded(job_config)``.
- Once model, data set and job config are all there the board is ``ready``, its weights
  those of the blob at step 0 with a zero buffer; ``SetWeights`` (reassembled, CRC-checked)
  replaces them and sets the step.
- Steps: the board's step is ``TrainState.step``, the next step to run (the number of
  updates applied). ``SetWeights.step`` sets it and ``Heartbeat.step`` reports it.
  ``EvalRequest``, ``ApplyUpdate`` and ``ValidateRequest`` must be for exactly that step
  (else ``stale_step``, whose detail says where the board is); an ``ApplyUpdate`` equal to
  the last one applied is a duplicate delivery and gets the same ``UpdateAck`` again.
- Bad input never stops the board: every refusal is a typed ``Error`` (a non-finite loss:
  ``numeric``; a request handed to ``handle`` while another computes: ``busy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import math
import os
import re
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt
import structlog

from qsched.firmware.errors import BoardCrash
from qsched.firmware.virtual.coalesce import EvalCoalescer
from qsched.firmware.virtual.faults import CRASH_EXIT_CODE, BoardFaults, FaultPlan
from qsched.firmware.virtual.latency import (
    MOBILENETV2_035_128_MACS,
    NpuLatencyModel,
    serial_seconds,
)
from qsched.protocol.codec import STEP_SHARED_CODES, decode_shared, encode
from qsched.protocol.errors import ProtocolError
from qsched.protocol.identity import dataset_hash64, model_hash64
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.links.base import LinkClosedError, LinkError
from qsched.protocol.messages import (
    MAX_PAYLOAD,
    TYPE_CODES,
    ApplyUpdate,
    BoardErrorCode,
    DataMessage,
    Error,
    EvalRequest,
    EvalResult,
    EvalSliceRequest,
    EvalSliceResult,
    Heartbeat,
    Hello,
    JobConfig,
    Loaded,
    LoadModel,
    Ping,
    ReportedState,
    Reset,
    SelectDataset,
    SetWeights,
    UpdateAck,
    ValidateRequest,
    ValidateResult,
    validated,
)
from qsched.zo import blob as blob_format
from qsched.zo.datasets import Dataset, DatasetError, dataset_names, load_dataset
from qsched.zo.graph import Model, QuantModel
from qsched.zo.workload import (
    StateError,
    TrainState,
    Workload,
    WorkloadError,
    float_warnings_silenced,
)
from qsched.zo.zoo import model_summary

__all__ = [
    "FIRMWARE_VERSION",
    "HEARTBEAT_INTERVAL_S",
    "MAX_BATCH",
    "MAX_MODEL_BYTES",
    "MODEL_LATENCIES",
    "VIRTUAL_RAM_KIB",
    "BoardAgent",
    "BoardCrash",
    "DatasetCatalog",
    "LatencyProfile",
    "serve_link",
]

FIRMWARE_VERSION: Final = "qsched-vb-0.1.0"
# What a virtual board says about itself: the STM32N6's 4.2 MB of internal SRAM.
VIRTUAL_RAM_KIB: Final = 4200
MAX_BATCH: Final = 4096  # JobSpec's limit
# Largest model blob a virtual board accepts (a real one is bounded by its flash).
MAX_MODEL_BYTES: Final = 64 << 20
HEARTBEAT_INTERVAL_S: Final = 5.0
# Workloads shared by the boards of one process (same blob, data set and job config):
# a data set's quantised copy is built once, not once per board.
_WORKLOAD_CACHE_SIZE: Final = 4
_UPDATE_CACHE_SIZE: Final = 4
# An update of at most this many key x weight terms (64 keys on a 4,096-weight head, a
# fraction of a millisecond) is applied on the event loop when the workload is free: in
# a worker thread it would first wait for the loop to hand over the interpreter, while
# every board of the process waits for it before it can evaluate.
_INLINE_UPDATE_WORK: Final = 1 << 18
# Bytes a serial frame adds around a payload: seq/flags/CRC header and COBS overhead.
_FRAME_OVERHEAD: Final = 12
_U32_MAX: Final = 0xFFFFFFFF

MODEL_LATENCIES: Final[dict[str, int]] = {"mobilenetv2-0.35-128": MOBILENETV2_035_128_MACS}

_log = structlog.get_logger("qsched.firmware.virtual.board")
_T = TypeVar("_T")


class _Refusal(Exception):
    def __init__(
        self, code: BoardErrorCode, detail: str, *, job_id: int = 0, step: int = 0
    ) -> None:
        super().__init__(detail)
        self.code: BoardErrorCode = code
        self.detail = detail
        self.job_id = job_id
        self.step = step


# --------------------------------------------------------------------------- latency


@dataclass(frozen=True)
class LatencyProfile:
    """How long the modelled board takes; the agent sleeps the part compute did not use.

    Args:
        macs_per_forward: MACs of the model it *models* per sample; None: the model it computes.
        speed: throughput multiplier (2.0: twice as fast), for heterogeneous fleets.
        baud: serial line rate, when the board sits behind a serial link.
        enabled: False: no sleeping at all (unit tests, fast experiments).
        npu: the NPU time model.
    """

    macs_per_forward: int | None = None
    speed: float = 1.0
    baud: int | None = None
    enabled: bool = True
    npu: NpuLatencyModel = field(default_factory=NpuLatencyModel)

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise ValueError(f"speed must be positive, got {self.speed}")
        if self.macs_per_forward is not None and self.macs_per_forward < 0:
            raise ValueError("macs_per_forward must be non-negative")

    @classmethod
    def off(cls) -> LatencyProfile:
        """No modelled latency."""
        return cls(enabled=False)

    @classmethod
    def named(cls, name: str, **options: Any) -> LatencyProfile:
        """A profile of a known model (``MODEL_LATENCIES``), ``"computed"`` or ``"off"``.

        Raises:
            ValueError: an unknown name.
        """
        if name == "off":
            return cls(enabled=False, **options)
        if name == "computed":
            return cls(**options)
        if name not in MODEL_LATENCIES:
            raise ValueError(
                f"unknown latency model {name!r}; "
                f"known: computed, off, {', '.join(MODEL_LATENCIES)}"
            )
        return cls(macs_per_forward=MODEL_LATENCIES[name], **options)

    def forward_seconds(self, computed_macs: int, samples: int) -> float:
        """Modelled seconds for ``samples`` forward passes.

        Args:
            computed_macs: MACs per sample of the model actually computed.
            samples: forward passes (sets x batch).

        Returns:
            Seconds (0 when disabled).
        """
        if not self.enabled or samples <= 0:
            return 0.0
        macs = computed_macs if self.macs_per_forward is None else self.macs_per_forward
        return float(self.npu.forward_seconds(macs, samples)) / self.speed

    def wire_seconds(self, payload_bytes: int) -> float:
        """Modelled seconds to move a message over the serial line (0 without a baud rate)."""
        if not self.enabled or self.baud is None or payload_bytes <= 0:
            return 0.0
        return float(serial_seconds(payload_bytes + _FRAME_OVERHEAD, self.baud))


# --------------------------------------------------------------------------- data sets

_DATASETS: dict[str, Dataset] = {}
_DATASETS_LOCK = threading.Lock()


def _load_shared(source: str) -> Dataset:
    """Load a data set once per process (boards of one process share it)."""
    with _DATASETS_LOCK:
        if source not in _DATASETS:
            _DATASETS[source] = load_dataset(source)
        return _DATASETS[source]


class DatasetCatalog:
    """The data sets a virtual board holds: name -> where to load it from.

    Args:
        sources: extra data sets, ``name -> built-in name or path`` (an ``.npz``, a folder).
        builtins: whether the built-in data sets (``digits`` ...) are held too.
        preloaded: data sets already in memory, by name (tests, the daemon's own copy).
    """

    def __init__(
        self,
        sources: Mapping[str, str] | None = None,
        *,
        builtins: bool = True,
        preloaded: Mapping[str, Dataset] | None = None,
    ) -> None:
        self._sources = {name: name for name in (dataset_names() if builtins else [])}
        self._sources.update(sources or {})
        self._preloaded = dict(preloaded or {})

    @property
    def names(self) -> list[str]:
        """The names the board can select."""
        return sorted({*self._sources, *self._preloaded})

    def get(self, name: str) -> Dataset | None:
        """The data set called ``name``, loaded on first use; None if not held or unreadable."""
        if name in self._preloaded:
            return self._preloaded[name]
        source = self._sources.get(name)
        if source is None:
            return None
        try:
            return _load_shared(source)
        except DatasetError as exc:
            _log.warning("data set unreadable", name=name, source=source, error=str(exc))
            return None


# --------------------------------------------------------------------------- shared workloads


def _decode(data: bytes) -> DataMessage:
    """``decode``, once per process for an ApplyUpdate (every board of a process gets the
    same update's bytes), and not at all for an eval request made in this process (a
    board's request from a step order, an aggregating host's share for its member):
    decoding is the board's own work, which a real board does on its own CPU, not on a
    core it shares with the other boards of its host."""
    return decode_shared(data, *STEP_SHARED_CODES)


@functools.lru_cache(maxsize=8)
def _encode_shared(msg: UpdateAck) -> bytes:
    return encode(msg)


@functools.lru_cache(maxsize=8)
def _ack(job_id: int, step: int, checksum: int) -> UpdateAck:
    """The ack of an update, one object per process for the boards that ack alike."""
    return UpdateAck(job_id=job_id, step=step, checksum=checksum)


def _encode(msg: DataMessage) -> bytes:
    """``encode``, once per process for an UpdateAck: the boards of a process ack an
    update with the same message, and the aggregator above them decodes equal bytes
    once (``qsched.daemon.aggregate``)."""
    return _encode_shared(msg) if isinstance(msg, UpdateAck) else encode(msg)


def _same_state(a: TrainState, b: TrainState) -> bool:
    if a is b:  # the boards of a process share their frozen states
        return True
    if a.step != b.step or not np.array_equal(a.params, b.params):
        return False
    return _same_part(a.buffer, b.buffer) and _same_part(a.scale_exps, b.scale_exps)


def _same_part(a: npt.NDArray[Any] | None, b: npt.NDArray[Any] | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


@dataclass
class _Shared:
    """A workload shared by the boards of one process, and their last updates.

    The boards of a fleet apply the same update to the same weights every step; the
    result is a pure function of both, so it is computed once and given to each board
    whose weights are equal (compared in full, not by checksum, unless the board holds
    the very state the update was computed from). The states are frozen
    (``TrainState.frozen``): the boards share one read-only state and its checksum
    instead of copying and checksumming the weights each. A board whose update is
    being computed by another board of the process waits for that one computation
    (``updating``) instead of queueing behind every board's evaluation for ``lock``: a
    real board never waits for another board's work.
    """

    workload: Workload
    lock: threading.Lock = field(default_factory=threading.Lock)
    _updates: OrderedDict[tuple[object, ...], tuple[TrainState, TrainState]] = field(
        default_factory=OrderedDict
    )
    _memo_lock: threading.Lock = field(default_factory=threading.Lock)  # the dict only
    # (event loop id, update key) -> done when that board's computation ended.
    updating: dict[tuple[object, ...], asyncio.Future[None]] = field(default_factory=dict)
    # (message, weights before, weights after) of the last update applied here: the
    # boards of a process share the decoded message (``_decode``) and their frozen
    # weights, so the next board finds its answer by identity, without hashing the pairs.
    last_applied: tuple[ApplyUpdate, TrainState, TrainState] | None = None
    evals: EvalCoalescer = field(init=False)  # the boards' evaluations, computed together

    def __post_init__(self) -> None:
        self.evals = EvalCoalescer(self.workload, self.lock)

    @staticmethod
    def update_key(
        state: TrainState, step: int, pairs: list[tuple[int, float]]
    ) -> tuple[object, ...]:
        """What identifies one update of one state (the checksum narrows, equality decides)."""
        return (step, tuple(pairs), state.checksum())

    def applied(self, msg: ApplyUpdate, state: TrainState) -> TrainState | None:
        """The weights after ``msg`` when it is the very message last applied here to
        this very state (``last_applied``)."""
        last = self.last_applied
        if last is not None and last[0] is msg and last[1] is state:
            return last[2]
        return None

    def cached_update(self, state: TrainState, key: tuple[object, ...]) -> TrainState | None:
        """The memoised result of the update ``key`` (``update_key``) on these weights."""
        with self._memo_lock:
            hit = self._updates.get(key)
        if hit is not None and _same_state(hit[0], state):
            return hit[1]
        return None

    def apply_inline(
        self,
        state: TrainState,
        step: int,
        pairs: list[tuple[int, float]],
        key: tuple[object, ...] | None = None,
    ) -> TrainState | None:
        """``apply_update`` right here when it is small and the workload is free, else None."""
        if self.workload.num_params * len(pairs) > _INLINE_UPDATE_WORK:
            return None
        if not self.lock.acquire(blocking=False):
            return None
        try:
            with float_warnings_silenced():
                return self.apply_update(state, step, pairs, key)
        finally:
            self.lock.release()

    def apply_update(
        self,
        state: TrainState,
        step: int,
        pairs: list[tuple[int, float]],
        key: tuple[object, ...] | None = None,
    ) -> TrainState:
        """``Workload.apply_update``, memoised across boards (call with ``lock`` held;
        ``key``: its ``update_key`` when the caller has it already)."""
        key = key if key is not None else self.update_key(state, step, pairs)
        cached = self.cached_update(state, key)
        if cached is not None:
            return cached
        new_state = self.workload.apply_update(state, step, pairs).frozen()
        with self._memo_lock:
            self._updates[key] = (state.frozen(), new_state)
            while len(self._updates) > _UPDATE_CACHE_SIZE:
                self._updates.popitem(last=False)
        return new_state


_WORKLOADS: OrderedDict[tuple[object, ...], _Shared] = OrderedDict()
_WORKLOADS_LOCK = threading.Lock()


def _shared_workload(key: tuple[object, ...], build: Callable[[], Workload]) -> _Shared:
    """The cached workload for ``key``, built once even when boards ask together."""
    with _WORKLOADS_LOCK:  # held while building: the other boards wait, then share it
        shared = _WORKLOADS.get(key)
        if shared is None:
            shared = _WORKLOADS[key] = _Shared(build())
            while len(_WORKLOADS) > _WORKLOAD_CACHE_SIZE:
                _WORKLOADS.popitem(last=False)
        _WORKLOADS.move_to_end(key)
        return shared


# --------------------------------------------------------------------------- transfers


class _Transfer:
    """Reassembles one chunked resource (LoadModel, SetWeights)."""

    def __init__(self, key: tuple[int, ...], total: int) -> None:
        self.key = key
        self.data = bytearray(total)
        self.spans: dict[int, int] = {}  # offset -> end
        self.received = 0

    def add(self, offset: int, chunk: bytes) -> bool:
        """Store a chunk; returns True when every byte has arrived.

        Raises:
            _Refusal: the chunk overlaps another one differently.
        """
        end = offset + len(chunk)
        if self.spans.get(offset) == end:
            return self.complete  # a duplicate delivery
        for start, stop in self.spans.items():
            if start < end and offset < stop:
                raise _Refusal("malformed", f"chunk [{offset},{end}) overlaps [{start},{stop})")
        self.spans[offset] = end
        self.data[offset:end] = chunk
        self.received += len(chunk)
        return self.complete

    @property
    def complete(self) -> bool:
        return self.received == len(self.data)


# --------------------------------------------------------------------------- the agent


def _detail(text: str) -> str:
    """An Error detail: printable ASCII, at most 64 characters."""
    return re.sub(r"[^\x20-\x7e]", "?", text)[:64]


def _error(
    code: BoardErrorCode,
    detail: str,
    ref: DataMessage | None = None,
    *,
    job_id: int = 0,
    step: int = 0,
) -> Error:
    ref_type = TYPE_CODES[type(ref)] if ref is not None else 0
    return Error(code=code, ref_type=ref_type, job_id=job_id, step=step, detail=_detail(detail))


# Messages that read or change the weights: refused while a computation runs.
_STATEFUL: Final = (
    LoadModel,
    SetWeights,
    SelectDataset,
    JobConfig,
    EvalRequest,
    EvalSliceRequest,
    ApplyUpdate,
    ValidateRequest,
    Reset,
)

_PROTOCOL_CODES: Final[dict[str, BoardErrorCode]] = {
    "unsupported_version": "unsupported_version",
    "unknown_type": "unknown_type",
    "oversized": "too_large",
}


class BoardAgent:
    """One virtual board's protocol state machine and compute (see the module docstring).

    Args:
        board_id: the board's id (a topic level: ``[A-Za-z0-9_.-]{1,32}``).
        datasets: the data sets it holds (default: the built-in ones).
        latency: the modelled timing (default: the NPU model of the computed model).
        faults: its faults (default: none).
        clock: monotonic seconds (tests may pass a fake).
    """

    def __init__(
        self,
        board_id: str,
        *,
        datasets: DatasetCatalog | None = None,
        latency: LatencyProfile | None = None,
        faults: BoardFaults | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.board_id = board_id
        self.datasets = datasets if datasets is not None else DatasetCatalog()
        self.latency = latency if latency is not None else LatencyProfile()
        self.faults = faults if faults is not None else FaultPlan().for_board(board_id)
        self._clock = clock
        self._booted = clock()
        # perf_counter moments: the message being handled arrived; the modelled NPU is free
        self._arrived = 0.0
        self._free_at = 0.0
        self._hold = True  # handle() waits until its answer is due (else: answers_due)
        self.answers_due = 0.0  # when the answers of the last handle() may leave; 0: now
        self._handlers: dict[type, Callable[[Any], Awaitable[list[DataMessage]]]] = {
            LoadModel: self._on_load_model,
            SetWeights: self._on_set_weights,
            SelectDataset: self._on_select_dataset,
            JobConfig: self._on_job_config,
            EvalRequest: self._on_eval,
            EvalSliceRequest: self._on_eval_slice,
            ApplyUpdate: self._on_apply_update,
            ValidateRequest: self._on_validate,
            Ping: self._on_ping,
            Reset: self._on_reset,
            Error: self._on_error,
        }
        self._clear(dataset=True)

    def _clear(self, *, dataset: bool) -> None:
        self._blob: bytes | None = None
        self._model: Model | QuantModel | None = None
        self._trainable: list[str] = []
        self._macs = 0
        self._config: JobConfig | None = None
        self._shared: _Shared | None = None
        self._state: TrainState | None = None
        self._model_rx: _Transfer | None = None
        self._weights_rx: _Transfer | None = None
        self._last_update: tuple[ApplyUpdate, UpdateAck] | None = None
        self._ahead: tuple[DataMessage, bytes] | None = None  # (answer, its bytes) held until due
        self._busy = False
        if dataset:
            self._dataset: Dataset | None = None
            self._dataset_hash = 0

    # ------------------------------------------------------------------ what it reports

    @property
    def state(self) -> ReportedState:
        """What the board would say its state is."""
        if self._busy:
            return "busy"
        if self._model_rx is not None or self._weights_rx is not None:
            return "loading"
        return "ready" if self._state is not None else "idle"

    @property
    def train_state(self) -> TrainState | None:
        """The board's weights and step (None before model, data set and job config)."""
        return self._state

    @property
    def workload(self) -> Workload | None:
        """The workload built from what the board was sent."""
        return self._shared.workload if self._shared is not None else None

    def hello(self) -> Hello:
        """The board's Hello: who it is and what it holds."""
        return Hello(
            board_id=self.board_id,
            firmware_version=FIRMWARE_VERSION,
            npu="virtual",
            ram_kib=VIRTUAL_RAM_KIB,
            max_batch=MAX_BATCH,
            max_payload=MAX_PAYLOAD,
            model_hash=model_hash64(self._blob) if self._blob is not None else 0,
            dataset_hash=self._dataset_hash,
        )

    def heartbeat(self, nonce: int = 0) -> Heartbeat:
        """A Heartbeat (``nonce``: the Ping's, 0 if unsolicited)."""
        uptime_ms = int((self._clock() - self._booted) * 1000) & _U32_MAX
        return Heartbeat(
            nonce=nonce,
            uptime_ms=uptime_ms,
            state=self.state,
            job_id=self._config.job_id if self._config is not None else 0,
            step=self._state.step if self._state is not None else 0,
        )

    # ------------------------------------------------------------------ entry points

    async def handle_bytes(
        self, data: bytes, arrived: float | None = None, *, hold: bool = True
    ) -> list[DataMessage]:
        """Decode one message and handle it; undecodable input gets a typed Error.

        Args:
            data: one encoded data-plane message.
            arrived: the ``perf_counter`` moment ``data`` reached the board's link
                (``last_arrival``); default now. The modelled board starts on it then,
                whenever this process gets round to it.
            hold: wait until the answers are due before returning them; False returns
                them at once with ``answers_due`` set, for a caller that sends them then.

        Returns:
            The answers (possibly none).

        Raises:
            BoardCrash: a crash fault fired.
        """
        self.answers_due = 0.0  # also for an override of handle() that answers itself
        if arrived is None:
            arrived = time.perf_counter()  # before the decode, which is the board's own work
        try:
            msg = _decode(data)
        except ProtocolError as exc:
            code = _PROTOCOL_CODES.get(exc.kind, "malformed")
            return [
                Error(
                    code=code,
                    ref_type=exc.msg_type or 0,
                    detail=_detail(f"{exc.kind}: {exc.detail}"),
                )
            ]
        return await self.handle(msg, arrived, hold=hold)

    async def handle(
        self, msg: DataMessage, arrived: float | None = None, *, hold: bool = True
    ) -> list[DataMessage]:
        """Handle one daemon-to-board message.

        Args:
            msg: the message.
            arrived: when it reached the board (``handle_bytes``); default now.
            hold: as in ``handle_bytes``; a fault plan holds the answers regardless.

        Returns:
            The answers: usually one; none for an incoming Error, intermediate chunks,
            or a dropped answer.

        Raises:
            BoardCrash: a crash fault fired (the caller stops serving, or exits).
        """
        self._arrived = time.perf_counter() if arrived is None else arrived
        self._hold = hold or self.faults.active  # a delay or a drop acts on the due answer
        self.answers_due = 0.0
        step = getattr(msg, "step", None)
        if isinstance(
            msg, EvalRequest | EvalSliceRequest | ApplyUpdate | ValidateRequest
        ) and self.faults.crash(msg.step):
            raise BoardCrash(self.board_id, msg.step)
        handler = self._handlers.get(type(msg))
        if self._busy and isinstance(msg, _STATEFUL):
            # Only when handle() is called concurrently: a link's messages come one by one.
            return [_error("busy", "still computing the previous request", msg, step=step or 0)]
        try:
            if handler is None:
                raise _Refusal("unknown_type", f"{msg.type} is not a daemon-to-board message")
            replies = await handler(msg)
        except _Refusal as refusal:
            replies = [
                _error(refusal.code, refusal.detail, msg, job_id=refusal.job_id, step=refusal.step)
            ]
        except Exception as exc:  # a bug or a numeric failure: report it, keep the board alive
            _log.exception("board failed to handle a message", board=self.board_id, type=msg.type)
            replies = [_error("internal", f"{type(exc).__name__}: {exc}", msg)]
        return await self._misbehave(replies, step)

    async def _misbehave(self, replies: list[DataMessage], step: int | None) -> list[DataMessage]:
        if not replies or not self.faults.active:
            return replies
        if self.faults.drop(step):
            _log.info("fault: answer dropped", board=self.board_id, step=step)
            return []
        delay = self.faults.delay(step)
        if delay > 0:
            _log.info("fault: answer delayed", board=self.board_id, step=step, seconds=delay)
            await asyncio.sleep(delay)
        return replies

    # ------------------------------------------------------------------ helpers

    def _ready(self, job_id: int) -> tuple[Workload, TrainState]:
        if self._config is None:
            raise _Refusal("not_ready", "no job config", job_id=job_id)
        if job_id != self._config.job_id:
            raise _Refusal(
                "unknown_job", f"job {job_id}, board has job {self._config.job_id}", job_id=job_id
            )
        if self._shared is None or self._state is None:
            missing = [
                n for n, v in (("model", self._model), ("dataset", self._dataset)) if v is None
            ]
            raise _Refusal(
                "not_ready", f"missing {', '.join(missing) or 'workload'}", job_id=job_id
            )
        return self._shared.workload, self._state

    def _check_step(self, job_id: int, step: int, state: TrainState) -> None:
        if step != state.step:
            raise _Refusal(
                "stale_step",
                f"request for step {step}, board is at step {state.step}",
                job_id=job_id,
                step=step,
            )

    async def _compute(self, fn: Callable[..., _T], *args: Any) -> tuple[_T, float]:
        """Run ``fn`` in a worker thread (heartbeats go on); returns (result, seconds)."""
        assert self._shared is not None
        lock = self._shared.lock

        # The board is busy from now: time spent waiting for the lock (another board of
        # this process computing) counts, so the modelled time absorbs the host's
        # serialisation instead of adding to it, as boards of a real fleet run in parallel.
        start = time.perf_counter()

        def run() -> tuple[_T, float]:
            # One computation per shared workload at a time; non-finite losses become
            # Error(numeric).
            with lock, float_warnings_silenced():
                result = fn(*args)
                return result, time.perf_counter() - start

        self._busy = True
        try:
            return await asyncio.to_thread(run)
        finally:
            self._busy = False

    @property
    def _evals(self) -> EvalCoalescer:
        assert self._shared is not None
        return self._shared.evals

    async def _coalesced(self, evaluation: Awaitable[_T]) -> tuple[_T, float]:
        """Await an evaluation computed with the other boards' (``EvalCoalescer``);
        returns (result, seconds), the seconds counted as in ``_compute``."""
        start = time.perf_counter()
        self._busy = True
        try:
            return await evaluation, time.perf_counter() - start
        finally:
            self._busy = False

    def _due(self, modelled: float, computed: float) -> tuple[float, int]:
        """For a request modelled to take ``modelled`` seconds and computed here for
        ``computed``: when its answer is due (a ``perf_counter`` time) and the compute
        time the board reports, in µs.

        The modelled board starts when the request reached its link, or when it finished
        its previous answer if that was later: the time this process took to get round
        to the request (the other boards of the process handling theirs, one after
        another on its core) is absorbed, as the boards of a real fleet each handle
        their own messages on their own CPU. A request whose computation here outlasts
        its modelled time is answered when the computation ends."""
        reported = min(_U32_MAX, int(max(modelled, computed) * 1e6))
        started = max(self._arrived, self._free_at)
        return started + modelled, reported

    async def _answer_when_due(self, reply: DataMessage, due: float) -> list[DataMessage]:
        """Encode ``reply`` now and hold it until ``due``. The modelled board sends its
        answer when its NPU time is up; building and encoding it here first, while the
        board waits anyway, keeps the host's core from doing that for every board of the
        process one after another at the end of the step (on a real fleet each board does
        it on its own CPU). The answer's bytes and its time are the modelled board's."""
        self._ahead = (reply, _encode(reply))
        self._free_at = due
        if not self._hold:
            self.answers_due = due
            return [reply]
        left = due - time.perf_counter()
        if left > 0:
            await asyncio.sleep(left)
        return [reply]

    def encoded(self, msg: DataMessage) -> bytes:
        """``msg``'s bytes: those made ahead when it is the answer held until due."""
        ahead = self._ahead
        if ahead is not None and ahead[0] is msg:
            return ahead[1]
        return _encode(msg)

    # ------------------------------------------------------------------ loading

    async def _on_load_model(self, msg: LoadModel) -> list[DataMessage]:
        if msg.total > MAX_MODEL_BYTES:
            raise _Refusal("too_large", f"model of {msg.total} bytes > {MAX_MODEL_BYTES}")
        rx = self._model_rx
        if (
            rx is None or rx.key != (msg.total, msg.crc32) or msg.offset == 0
        ):  # offset 0 restarts (SPEC 6.2)
            rx = self._model_rx = _Transfer((msg.total, msg.crc32), msg.total)
        if not rx.add(msg.offset, msg.chunk):
            return []
        self._model_rx = None
        blob = bytes(rx.data)
        if zlib.crc32(blob) != msg.crc32:
            raise _Refusal(
                "crc_mismatch", f"model CRC {zlib.crc32(blob):08x}, expected {msg.crc32:08x}"
            )
        if blob != self._blob:
            self._install_model(blob)
        return [Loaded(resource="model", crc32=msg.crc32, size=msg.total), *(await self._rebuild())]

    def _install_model(self, blob: bytes) -> None:
        try:
            model = blob_format.decode_blob(blob)
            trainable = blob_format.trainable_layers(blob)
            macs = model_summary(model.model if isinstance(model, QuantModel) else model)[1]
        except (blob_format.BlobError, ValueError, KeyError) as exc:
            raise _Refusal("model_invalid", str(exc)) from exc
        if not trainable:
            raise _Refusal("model_invalid", "the blob marks no layer trainable")
        self._blob, self._model, self._trainable, self._macs = blob, model, trainable, macs
        self._shared = self._state = None

    async def _on_select_dataset(self, msg: SelectDataset) -> list[DataMessage]:
        dataset = await asyncio.to_thread(self.datasets.get, msg.name)  # the first use loads it
        if dataset is None:
            raise _Refusal("dataset_missing", f"no data set {msg.name!r} here")
        if dataset_hash64(dataset.content_hash) != msg.dataset_hash:
            raise _Refusal(
                "dataset_missing",
                f"{msg.name}: hash {dataset_hash64(dataset.content_hash):016x} differs",
            )
        if (len(dataset.x_train), len(dataset.x_val)) != (msg.train_size, msg.val_size):
            raise _Refusal(
                "dataset_missing",
                f"{msg.name}: {len(dataset.x_train)}+{len(dataset.x_val)} samples",
            )
        if self._dataset is not dataset:
            self._dataset, self._dataset_hash = dataset, msg.dataset_hash
            self._shared = self._state = None
        size = msg.train_size + msg.val_size
        return [
            Loaded(resource="dataset", crc32=msg.dataset_hash & _U32_MAX, size=size & _U32_MAX),
            *(await self._rebuild()),
        ]

    async def _on_job_config(self, msg: JobConfig) -> list[DataMessage]:
        if msg.batch_size > MAX_BATCH or msg.batch_size == 0:
            raise _Refusal(
                "malformed",
                f"batch size {msg.batch_size} outside [1, {MAX_BATCH}]",
                job_id=msg.job_id,
            )
        if msg != self._config:
            self._config = msg
            self._shared = self._state = None
            self._last_update = None
        raw = encode(msg)
        return [
            Loaded(resource="job_config", job_id=msg.job_id, crc32=zlib.crc32(raw), size=len(raw)),
            *(await self._rebuild()),
        ]

    async def _rebuild(self) -> list[DataMessage]:
        """Build the workload once model, data set and job config are all there."""
        if (
            self._shared is not None
            or self._model is None
            or self._dataset is None
            or self._config is None
        ):
            return []
        cfg, model, dataset = self._config, self._model, self._dataset
        assert self._blob is not None
        key = (
            hashlib.sha256(self._blob).digest(),
            dataset.content_hash,
            cfg.numerics,
            cfg.accumulator,
            cfg.estimator,
            cfg.seed,
            cfg.batch_size,
            cfg.eps,
            cfg.lr_unit,
            cfg.recalibrate_every,
        )
        try:
            # In a worker thread: quantising a data set can take seconds, heartbeats go on.
            self._shared = await asyncio.to_thread(
                _shared_workload, key, lambda: self._build(cfg, model, dataset)
            )
        except (WorkloadError, ValueError) as exc:
            # pydantic's ValidationError is a ValueError: a config JobSpec refuses.
            return [_error("model_invalid", str(exc), cfg, job_id=cfg.job_id)]
        self._state = self._shared.workload.initial_state()
        self._last_update = None
        return []

    def _build(self, cfg: JobConfig, model: Model | QuantModel, dataset: Dataset) -> Workload:
        qmodel = model if isinstance(model, QuantModel) else None
        graph = model.model if isinstance(model, QuantModel) else model
        if (qmodel is not None) != (cfg.numerics == "int8"):
            raise WorkloadError(
                f"job is {cfg.numerics}, the model blob is {'int8' if qmodel else 'fp32'}"
            )
        if (
            tuple(graph.input_shape) != dataset.input_shape
            or graph.num_classes != dataset.num_classes
        ):
            raise WorkloadError(
                f"model {tuple(graph.input_shape)}->{graph.num_classes} "
                f"vs data {dataset.input_shape}"
            )
        spec = JobSpec(
            name="board",
            dataset=dataset.name,
            model="blob",
            numerics=cfg.numerics,
            accumulator=cfg.accumulator,
            estimator=cfg.estimator,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            eps=cfg.eps,
            lr_unit=cfg.lr_unit,
            recalibrate_every=cfg.recalibrate_every,
            trainable=self._trainable,
        )
        return Workload(spec, graph, qmodel, dataset, list(self._trainable))

    async def _on_set_weights(self, msg: SetWeights) -> list[DataMessage]:
        workload, _ = self._ready(msg.job_id)
        key = (msg.total, msg.checksum, msg.job_id, msg.step)
        rx = self._weights_rx
        if rx is None or rx.key != key or msg.offset == 0:
            rx = self._weights_rx = _Transfer(key, msg.total)
        if not rx.add(msg.offset, msg.chunk):
            return []
        self._weights_rx = None
        raw = bytes(rx.data)
        if zlib.crc32(raw) != msg.checksum:
            raise _Refusal(
                "crc_mismatch",
                f"weights CRC {zlib.crc32(raw):08x}, expected {msg.checksum:08x}",
                job_id=msg.job_id,
                step=msg.step,
            )
        self._state = self._parse_weights(workload, raw, msg)
        self._last_update = None
        return [Loaded(resource="weights", job_id=msg.job_id, crc32=msg.checksum, size=msg.total)]

    @staticmethod
    def _parse_weights(workload: Workload, raw: bytes, msg: SetWeights) -> TrainState:
        try:
            state = workload.initial_state().with_weight_bytes(raw, msg.step)
        except StateError as exc:
            raise _Refusal("malformed", str(exc), job_id=msg.job_id, step=msg.step) from exc
        try:
            workload.check_state(state)
        except StateError as exc:
            raise _Refusal("malformed", str(exc), job_id=msg.job_id, step=msg.step) from exc
        return state

    # ------------------------------------------------------------------ one step

    async def _on_eval(self, msg: EvalRequest) -> list[DataMessage]:
        _, state = self._eval_ready(msg)
        losses, computed = await self._coalesced(self._evals.losses(state, msg.step, msg.ks))
        due, compute_us = self._due(self._eval_seconds(msg, msg.batch_size), computed)
        values = [
            *losses.plus.values(),
            *losses.minus.values(),
            *([] if losses.base is None else [losses.base]),
        ]
        if not all(math.isfinite(v) for v in values):
            raise _Refusal("numeric", "a loss is not finite", job_id=msg.job_id, step=msg.step)
        two_sided = msg.estimator == "two_sided"
        result = validated(
            EvalResult,
            {
                "job_id": msg.job_id,
                "step": msg.step,
                "compute_us": compute_us,
                "estimator": msg.estimator,
                "ks": msg.ks,
                "loss_plus": tuple(losses.plus[k] for k in msg.ks),
                "loss_minus": tuple(losses.minus[k] for k in msg.ks) if two_sided else (),
                "loss_zero": None if two_sided else losses.base,
            },
        )
        return await self._answer_when_due(self.faults.lie(result), due)

    async def _on_eval_slice(self, msg: EvalSliceRequest) -> list[DataMessage]:
        workload, state = self._eval_ready(msg)
        if not workload.int8:
            raise _Refusal(
                "malformed", "batch slices need INT8 numerics", job_id=msg.job_id, step=msg.step
            )
        sums, computed = await self._coalesced(
            self._evals.loss_sums(state, msg.step, msg.ks, msg.slice_start, msg.slice_count)
        )
        due, compute_us = self._due(self._eval_seconds(msg, msg.slice_count), computed)
        two_sided = msg.estimator == "two_sided"
        result = validated(
            EvalSliceResult,
            {
                "job_id": msg.job_id,
                "step": msg.step,
                "compute_us": compute_us,
                "estimator": msg.estimator,
                "slice_start": msg.slice_start,
                "slice_count": msg.slice_count,
                "ks": msg.ks,
                "sum_plus": tuple(sums.plus[k] for k in msg.ks),
                "sum_minus": tuple(sums.minus[k] for k in msg.ks) if two_sided else (),
                "sum_zero": None if two_sided else sums.base,
            },
        )
        return await self._answer_when_due(self.faults.lie(result), due)

    def _eval_ready(self, msg: EvalRequest | EvalSliceRequest) -> tuple[Workload, TrainState]:
        """The workload and state an evaluation runs on, after the request's checks."""
        workload, state = self._ready(msg.job_id)
        self._check_step(msg.job_id, msg.step, state)
        cfg = self._config
        assert cfg is not None
        if (msg.batch_size, msg.eps, msg.estimator) != (cfg.batch_size, cfg.eps, cfg.estimator):
            raise _Refusal(
                "malformed",
                f"request's batch/eps/estimator differ from job {cfg.job_id}'s",
                job_id=msg.job_id,
                step=msg.step,
            )
        return workload, state

    def _eval_seconds(self, msg: EvalRequest | EvalSliceRequest, samples: int) -> float:
        """The modelled NPU time of the request's forward passes of ``samples`` samples each."""
        two_sided = msg.estimator == "two_sided"
        sets = len(msg.ks) * (2 if two_sided else 1) + (0 if two_sided else 1)
        return self.latency.forward_seconds(self._macs, sets * samples)

    async def _on_apply_update(self, msg: ApplyUpdate) -> list[DataMessage]:
        _, state = self._ready(msg.job_id)
        last = self._last_update
        if last is not None and last[0].step == msg.step and last[0] == msg:
            return [last[1]]  # a duplicate delivery: the same answer again
        self._check_step(msg.job_id, msg.step, state)
        new_state = await self._updated(state, msg)
        self._state = new_state
        ack = _ack(msg.job_id, msg.step, self.faults.checksum(msg.step, new_state.checksum()))
        self._last_update = (msg, ack)
        return [ack]

    async def _updated(self, state: TrainState, msg: ApplyUpdate) -> TrainState:
        """The weights after the update: the one another board of this process just
        applied to these very weights (``_Shared.applied``); memoised when a board of
        this process already computed it, awaited when one is computing it, else
        computed here (on the event loop when it is small, ``_Shared.apply_inline``;
        else in the worker)."""
        shared = self._shared
        assert shared is not None
        new_state = shared.applied(msg, state)
        if new_state is None:
            new_state = await self._computed_update(shared, state, msg.step, msg.pairs())
            shared.last_applied = (msg, state, new_state)
        return new_state

    async def _computed_update(
        self, shared: _Shared, state: TrainState, step: int, pairs: list[tuple[int, float]]
    ) -> TrainState:
        update = shared.update_key(state, step, pairs)
        key = (id(asyncio.get_running_loop()), *update)
        pending = shared.updating.get(key)
        if pending is not None:
            await asyncio.shield(pending)
        cached = shared.cached_update(state, update)
        if cached is not None:
            return cached
        inline = shared.apply_inline(state, step, pairs, update)
        if inline is not None:
            return inline
        done = shared.updating[key] = asyncio.get_running_loop().create_future()
        try:
            new_state, _ = await self._compute(shared.apply_update, state, step, pairs, update)
            return new_state
        finally:
            shared.updating.pop(key, None)
            done.set_result(None)

    async def _on_validate(self, msg: ValidateRequest) -> list[DataMessage]:
        workload, state = self._ready(msg.job_id)
        self._check_step(msg.job_id, msg.step, state)
        n_val = len(workload.dataset.x_val)
        if msg.start >= n_val:
            raise _Refusal(
                "malformed",
                f"validation start {msg.start} >= {n_val} samples",
                job_id=msg.job_id,
                step=msg.step,
            )
        (loss_sum, correct, count), computed = await self._compute(
            workload.validate, state, msg.start, msg.count
        )
        due, compute_us = self._due(self.latency.forward_seconds(self._macs, count), computed)
        result = ValidateResult(
            job_id=msg.job_id,
            step=msg.step,
            start=msg.start,
            count=count,
            loss_sum=loss_sum,
            correct=correct,
            compute_us=compute_us,
        )
        return await self._answer_when_due(result, due)

    # ------------------------------------------------------------------ housekeeping

    async def _on_ping(self, msg: Ping) -> list[DataMessage]:
        return [self.heartbeat(msg.nonce)]

    async def _on_reset(self, msg: Reset) -> list[DataMessage]:
        self._clear(dataset=msg.scope == "hard")
        if msg.scope == "hard":
            self._booted = self._clock()
        return [self.hello()]

    async def _on_error(self, msg: Error) -> list[DataMessage]:
        # Never answer an Error with an Error: two confused peers would loop forever.
        _log.warning(
            "daemon reported an error", board=self.board_id, code=msg.code, detail=msg.detail
        )
        return []


# --------------------------------------------------------------------------- serving a link


_Send = Callable[[DataMessage], Awaitable[None]]
# How often a board looks for a reconnection of its link (to say Hello again).
_RECONNECT_POLL_S: Final = 0.2


async def _send_or_skip(agent: BoardAgent, send: _Send, msg: DataMessage) -> None:
    """Send; a message the link could not deliver in time is lost (the daemon re-asks)."""
    try:
        await send(msg)
    except LinkClosedError:
        raise
    except LinkError as exc:  # e.g. the broker stayed away past the send timeout
        _log.warning(
            "message not delivered", board=agent.board_id, type=msg.type, reason=exc.reason
        )


async def _heartbeats(agent: BoardAgent, send: _Send, interval: float) -> None:
    with contextlib.suppress(LinkClosedError):
        while True:
            await asyncio.sleep(interval)
            await _send_or_skip(agent, send, agent.heartbeat())


async def _hello_on_reconnect(agent: BoardAgent, send: _Send, connects: Callable[[], int]) -> None:
    seen = connects()
    with contextlib.suppress(LinkClosedError):
        while True:
            await asyncio.sleep(_RECONNECT_POLL_S)
            if connects() != seen:
                seen = connects()
                _log.info("link reconnected; saying hello again", board=agent.board_id)
                await _send_or_skip(agent, send, agent.hello())


async def serve_link(
    agent: BoardAgent,
    link: Any,
    *,
    heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
    exit_on_crash: bool = False,
    corrupt_payloads: bool = False,
    connects: Callable[[], int] | None = None,
) -> str:
    """Run ``agent`` on ``link`` until the link ends or the board crashes.

    A send that times out (MQTT broker away) loses that one message and the board goes
    on; a link that closes ends the session.

    Args:
        agent: the board.
        link: its end of a link (``send``, ``incoming``, ``close``), already open.
        heartbeat_interval: seconds between unsolicited heartbeats.
        exit_on_crash: a crash fault ends the process (``os._exit``), as a real crash
            would; otherwise the link is closed and ``"crashed"`` returned.
        corrupt_payloads: apply the ``corrupt`` fault to whole message payloads (MQTT,
            in-process); serial links corrupt frames in their stream instead.
        connects: a count of the link's (re)connections (MQTT); when it changes, the
            board sends its Hello again, since the daemon may have missed messages.

    Returns:
        Why it stopped: ``"closed"`` or ``"crashed"``.
    """

    async def send(msg: DataMessage) -> None:
        payload = agent.encoded(msg)
        await link.send(agent.faults.corrupt(payload) if corrupt_payloads else payload)

    async with asyncio.TaskGroup() as tasks:
        name = f"board[{agent.board_id}]"
        helpers = [
            tasks.create_task(
                _heartbeats(agent, send, heartbeat_interval), name=f"{name}.heartbeat"
            )
        ]
        if connects is not None:
            helpers.append(
                tasks.create_task(
                    _hello_on_reconnect(agent, send, connects), name=f"{name}.reconnect"
                )
            )
        try:
            await _send_or_skip(agent, send, agent.hello())
            return await _serve(agent, link, send, exit_on_crash)
        except LinkClosedError as exc:  # the link went away under a send: the board is done
            _log.info("board link gone", board=agent.board_id, reason=exc.reason)
            return "closed"
        finally:
            for task in helpers:
                task.cancel()


async def _serve(agent: BoardAgent, link: Any, send: _Send, exit_on_crash: bool) -> str:
    # A link that takes a message without waiting (in-process) gets an answer from a
    # timer at its due moment; the board's handling of the request ends at once, while
    # its modelled NPU time runs, instead of resuming at that moment.
    hand_over = getattr(link, "send_nowait", None)
    pending: asyncio.Future[list[bytes]] | None = None
    async for data in link.incoming():
        if pending is not None:  # the previous answer leaves before this one is handled
            for payload in await pending:
                await link.send(payload)
            pending = None
        quick = hand_over is not None and agent.latency.wire_seconds(len(data)) == 0
        try:
            replies = await agent.handle_bytes(
                data, getattr(link, "last_arrival", None), hold=not quick
            )
        except BoardCrash as crash:
            _log.warning("fault: board crashes", board=agent.board_id, step=crash.step)
            if exit_on_crash:
                os._exit(CRASH_EXIT_CODE)
            with contextlib.suppress(Exception):
                await link.close()
            return "crashed"
        if replies and agent.answers_due > 0:
            assert hand_over is not None
            pending = _hand_over_at(
                hand_over, [agent.encoded(r) for r in replies], agent.answers_due
            )
            continue
        if replies and agent.latency.wire_seconds(len(data)) > 0:  # a modelled serial line
            encoded = sum(len(agent.encoded(r)) for r in replies)
            await asyncio.sleep(
                agent.latency.wire_seconds(len(data)) + agent.latency.wire_seconds(encoded)
            )
        for reply in replies:
            await _send_or_skip(agent, send, reply)
    if pending is not None and not pending.cancel():  # the link ended: nowhere to go
        pending.exception()  # retrieved: a closed link is how a board's session ends
    return "closed"


def _hand_over_at(
    hand_over: Callable[[bytes], bool], payloads: list[bytes], due: float
) -> asyncio.Future[list[bytes]]:
    """Give ``payloads`` to a link's ``send_nowait`` at the ``perf_counter`` moment
    ``due``, from a timer. The future ends with the payloads the link had no room for
    (to send with waiting), or the link's ``LinkClosedError``."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[list[bytes]] = loop.create_future()

    def fire() -> None:
        if done.cancelled():
            return
        try:
            for i, payload in enumerate(payloads):
                if not hand_over(payload):
                    done.set_result(payloads[i:])
                    return
        except LinkClosedError as exc:
            done.set_exception(exc)
            return
        done.set_result([])

    loop.call_at(loop.time() + max(0.0, due - time.perf_counter()), fire)
    return done
