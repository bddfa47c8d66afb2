"""Fleet membership: one ``BoardSession`` per reachable board, kept by ``Fleet``.

``Fleet`` consumes a transport's ``BoardAppeared`` / ``BoardGone`` events, runs one
reader task per board (``fleet[<board>].reader``) that decodes what the board sends and
hands it to its session, and a liveness task that pings quiet boards and gives up on
silent ones. The step engine talks to boards only through sessions:

    reply = await session.request(msg, key=("eval", step, ks), timeout=deadline)

A request registers a future under its key before sending and deletes it in
``finally``; the reader resolves it when the matching answer (or a typed ``Error``)
arrives, and every waiter fails with ``BoardLostError`` when the link goes. Session
states follow ``protocol/SPEC.md`` section 9.1 (``qsched.protocol.states``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Self

import structlog

from qsched.daemon.errors import BoardErrorReply, BoardFaultError, BoardLostError
from qsched.daemon.logging import debug_enabled
from qsched.daemon.planner import ThroughputEstimate
from qsched.protocol.codec import decode, encode
from qsched.protocol.control import BoardInfo
from qsched.protocol.errors import ProtocolError
from qsched.protocol.links.base import Link, LinkError, MessageTooLargeError, Transport
from qsched.protocol.messages import (
    HEARTBEAT_INTERVAL_S,
    PROTOCOL_VERSION,
    TYPE_CODES,
    ApplyUpdate,
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
    Reset,
    SelectDataset,
    SetWeights,
    UpdateAck,
    ValidateRequest,
    ValidateResult,
)
from qsched.protocol.states import BoardState, check_board_transition

__all__ = [
    "MAX_IN_FLIGHT",
    "BoardErrorReply",
    "BoardFaultError",
    "BoardLostError",
    "BoardSession",
    "Fleet",
    "FleetEvent",
    "error_matches",
    "reply_key",
    "request_key",
]

_log = structlog.get_logger("qsched.fleet")

# Requests one board may have outstanding at once; more is a bug in the engine.
MAX_IN_FLIGHT: Final = 64
# A board that has not said Hello this long after appearing is asked for one, and again
# after HELLO_RETRY_S.
HELLO_GRACE_S: Final = 1.0
HELLO_RETRY_S: Final = 5.0
# Requests whose reply is keyed by resource (chunked loads) or by step.
_LOADED_RESOURCE: Final[dict[type, str]] = {
    LoadModel: "model",
    SetWeights: "weights",
    SelectDataset: "dataset",
    JobConfig: "job_config",
}
_CODE_TYPES: Final[dict[int, type]] = {code: cls for cls, code in TYPE_CODES.items()}


@dataclass(frozen=True)
class FleetEvent:
    """Membership news for the daemon's event stream: joined, left, faulty, resynced."""

    kind: str  # "board_joined" | "board_left" | "board_faulty" | "board_resynced"
    board_id: str
    message: str = ""


def reply_key(msg: DataMessage) -> Hashable | None:
    """The waiter key an answer from a board resolves (None: nobody waits for it).

    Args:
        msg: a board-to-daemon message (not ``Error``: errors match by ``ref_type``).

    Returns:
        ``("eval", step, ks)``, ``("eval_slice", step, start, count, ks)``,
        ``("update", step)``, ``("validate", step, start)``, ``("loaded", resource)`` or
        ``("ping", nonce)``.
    """
    if isinstance(msg, EvalResult):
        return ("eval", msg.step, tuple(msg.ks))
    if isinstance(msg, EvalSliceResult):
        return ("eval_slice", msg.step, msg.slice_start, msg.slice_count, tuple(msg.ks))
    if isinstance(msg, UpdateAck):
        return ("update", msg.step)
    if isinstance(msg, ValidateResult):
        return ("validate", msg.step, msg.start)
    if isinstance(msg, Loaded):
        return ("loaded", msg.resource)
    if isinstance(msg, Heartbeat) and msg.nonce:
        return ("ping", msg.nonce)
    return None


def request_key(msg: DataMessage) -> Hashable:
    """The waiter key of the answer to a daemon-to-board request."""
    if isinstance(msg, EvalRequest):
        return ("eval", msg.step, tuple(msg.ks))
    if isinstance(msg, EvalSliceRequest):
        return ("eval_slice", msg.step, msg.slice_start, msg.slice_count, tuple(msg.ks))
    if isinstance(msg, ApplyUpdate):
        return ("update", msg.step)
    if isinstance(msg, ValidateRequest):
        return ("validate", msg.step, msg.start)
    if isinstance(msg, Ping):
        return ("ping", msg.nonce)
    resource = _LOADED_RESOURCE.get(type(msg))
    if resource is not None:
        return ("loaded", resource)
    raise ValueError(f"{msg.type} expects no answer")


def error_matches(error: Error, key: Hashable) -> bool:
    """Whether a typed Error refuses the request waiting under ``key``."""
    if not isinstance(key, tuple) or not error.ref_type:
        return False
    cls = _CODE_TYPES.get(error.ref_type)
    if cls is None:
        return False
    if cls in _LOADED_RESOURCE:
        return key == ("loaded", _LOADED_RESOURCE[cls])
    kinds: dict[type, str] = {
        EvalRequest: "eval",
        EvalSliceRequest: "eval_slice",
        ApplyUpdate: "update",
        ValidateRequest: "validate",
        Ping: "ping",
    }
    kind = kinds.get(cls)
    # Errors carry the step but not the ks or the slice: they refuse every such request.
    return kind is not None and key[0] == kind and (kind == "ping" or key[1] == error.step)


@dataclass
class BoardSession:
    """The daemon's side of one board: its link, its state and its pending requests.

    Args:
        address: the transport's name for the board (``serial:/dev/...`` for ports).
        link: the daemon's end of the link.
        transport: ``inproc``, ``mqtt`` or ``serial``.
    """

    address: str
    link: Link
    transport: str
    state: BoardState = "unknown"
    hello: Hello | None = None
    throughput: ThroughputEstimate = field(default_factory=ThroughputEstimate)
    # The same measured on batch slices, per slices per key (SPEC 6.10): a slice costs
    # more than its share of the samples where per-request costs dominate.
    slice_throughput: dict[int, ThroughputEstimate] = field(default_factory=dict)
    draining: bool = False
    job_id: int = 0  # the job whose config, data set and model it holds (0: none)
    model_hash: int = 0
    step: int | None = None  # the step its weights are at, as far as the daemon knows
    faults: int = 0
    retry_at: float = 0.0  # monotonic time before which a failed resync is not retried
    sync_failures: int = 0  # resyncs failed in a row (the retry delay doubles with each)
    appeared: float = field(default_factory=time.monotonic)
    epoch: int = 0  # counts Hellos: work begun before the latest one is void
    hello_asked: float = 0.0  # when the daemon last asked for a Hello (soft Reset)
    hellos_owed: int = 0  # soft Resets sent whose Hello may still come
    # The last send failed although the link looks open (e.g. the broker went away with
    # its socket half closed): no work until a send (a liveness ping) goes through again.
    link_down: bool = False
    last_error: Error | None = None  # the board's latest typed Error (answered or not)
    last_seen: float = field(default_factory=time.monotonic)
    last_seen_wall: float | None = None
    _waiters: dict[Hashable, asyncio.Future[DataMessage]] = field(default_factory=dict, repr=False)
    _nonces: Iterable[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    @property
    def board_id(self) -> str:
        """The board's own id (from its Hello), else its transport address."""
        return self.hello.board_id if self.hello is not None else self.address

    @property
    def alive(self) -> bool:
        """Whether the link is up (its last send went through) and the session not gone."""
        return self.state != "gone" and not self.link.closed and not self.link_down

    def set_state(self, new: BoardState, reason: str = "") -> bool:
        """Move to ``new`` (SPEC 9.1); returns whether the move was legal and made.

        An illegal move (a board that went away meanwhile, or a bug) is logged and
        refused: one board's session must not stop the job.
        """
        if new == self.state:
            return True
        try:
            check_board_transition(self.state, new)
        except ValueError as exc:
            _log.error(
                "board state change refused", board=self.board_id, error=str(exc), reason=reason
            )
            return False
        if debug_enabled():
            _log.debug("board state", board=self.board_id, old=self.state, new=new, reason=reason)
        self.state = new
        return True

    def info(self) -> BoardInfo:
        """The board as the control API shows it."""
        link = self.transport if self.transport in ("mqtt", "serial", "inproc") else "inproc"
        hello = self.hello
        return BoardInfo(
            board_id=_safe_id(self.board_id),
            state=self.state,
            link=link,  # type: ignore[arg-type]
            draining=self.draining,
            protocol_version=hello.protocol_version if hello else None,
            firmware_version=hello.firmware_version if hello else None,
            npu=hello.npu if hello else None,
            throughput=round(max(0.0, self.throughput.rate), 3)
            if self.throughput.observations
            else 0.0,
            last_seen=self.last_seen_wall,
        )

    async def send(self, msg: DataMessage) -> None:
        """Encode and send one message.

        Raises:
            BoardLostError: the link is gone or the send failed.
        """
        try:
            await self.link.send(encode(msg))
        except MessageTooLargeError as exc:
            raise BoardFaultError(self.board_id, "too_large", str(exc)) from exc
        except LinkError as exc:
            if not self.link_down:
                _log.warning("board link down", board=self.board_id, error=str(exc))
            self.link_down = True
            raise BoardLostError(self.board_id, "link", str(exc)) from exc
        if self.link_down:
            _log.info("board link up again", board=self.board_id)
        self.link_down = False

    async def request(
        self, msg: DataMessage, timeout: float, key: Hashable | None = None
    ) -> DataMessage:
        """Send ``msg`` and wait for its answer.

        Args:
            msg: the request.
            timeout: seconds to wait for the answer.
            key: the waiter key (default: ``request_key(msg)``).

        Returns:
            The answer (never an ``Error``: that raises).

        Raises:
            BoardErrorReply: the board refused with a typed Error.
            BoardLostError: the link went away.
            BoardFaultError: reason ``timeout``, or too many requests in flight.
        """
        key = request_key(msg) if key is None else key
        future = await self.send_expecting(msg, key)
        try:
            return await self.reply(msg, future, timeout)
        finally:
            self.forget(key, future)

    async def send_expecting(
        self, msg: DataMessage, key: Hashable | None = None
    ) -> asyncio.Future[DataMessage]:
        """Send a request without waiting for its answer (pipelining: several in order).

        Args:
            msg: the request.
            key: the waiter key (default: ``request_key(msg)``).

        Returns:
            The future of the answer, registered before sending; wait for it with
            ``reply`` and release it with ``forget``.

        Raises:
            BoardLostError: the send failed (nothing stays registered).
            BoardFaultError: too many requests in flight, or this one already is.
        """
        key = request_key(msg) if key is None else key
        future = self.expect(msg, key)
        try:
            await self.send(msg)
        except BaseException:
            self.forget(key, future)
            raise
        return future

    def expect(self, msg: DataMessage, key: Hashable | None = None) -> asyncio.Future[DataMessage]:
        """Register the waiter of ``msg``'s answer without sending it (the caller sends).

        Raises:
            BoardFaultError: too many requests in flight, or this one already is.
        """
        key = request_key(msg) if key is None else key
        if len(self._waiters) >= MAX_IN_FLIGHT:
            raise BoardFaultError(
                self.board_id, "overloaded", f"{len(self._waiters)} requests in flight"
            )
        if key in self._waiters:
            raise BoardFaultError(self.board_id, "duplicate_request", repr(key))
        future: asyncio.Future[DataMessage] = asyncio.get_running_loop().create_future()
        self._waiters[key] = future  # registered before sending: a fast answer finds it
        return future

    async def reply(
        self, msg: DataMessage, future: asyncio.Future[DataMessage], timeout: float
    ) -> DataMessage:
        """Wait for the answer ``send_expecting`` registered (``BoardFaultError`` as
        ``request``)."""
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError as exc:
            raise BoardFaultError(
                self.board_id, "timeout", f"no answer to {msg.type} in {timeout:.1f} s"
            ) from exc

    def forget(self, key: Hashable, future: asyncio.Future[DataMessage]) -> None:
        """Release a waiter (only if it is still this one); an answer after this is dropped."""
        if self._waiters.get(key) is future:
            del self._waiters[key]
        if not future.done():
            future.cancel()

    async def ping(self, timeout: float) -> Heartbeat:
        """Ping the board and wait for the echoing Heartbeat."""
        nonce = next(self._nonces) & 0xFFFFFFFF or 1  # type: ignore[call-overload]
        reply = await self.request(Ping(nonce=nonce), timeout)
        assert isinstance(reply, Heartbeat)
        return reply

    def deliver(self, msg: DataMessage) -> bool:
        """Resolve the waiter an answer belongs to; returns whether one was waiting."""
        self.last_seen = time.monotonic()
        self.last_seen_wall = time.time()
        if isinstance(msg, Error):
            self.last_error = msg
            matched = [k for k in self._waiters if error_matches(msg, k)]
            for k in matched:
                _settle(self._waiters[k], exc=BoardErrorReply(self.board_id, msg))
            return bool(matched)
        key = reply_key(msg)
        future = self._waiters.get(key) if key is not None else None
        if future is None:
            return False
        _settle(future, result=msg)
        return True

    def fail_all(self, reason: str) -> None:
        """Fail every pending request (the link went away)."""
        for future in list(self._waiters.values()):
            _settle(future, exc=BoardLostError(self.board_id, "gone", reason))


def _settle(
    future: asyncio.Future[DataMessage],
    result: DataMessage | None = None,
    exc: BaseException | None = None,
) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
        # Marked retrieved: a waiter registered with ``expect`` may never be awaited (its
        # caller stopped first); whoever awaits it still gets the exception.
        future.exception()
    else:
        future.set_result(result)  # type: ignore[arg-type]


def _safe_id(name: str) -> str:
    """A board id that fits the control plane's pattern (serial addresses have '/' and ':')."""
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "_" for c in name).strip("_") or "board"
    return cleaned[-64:]


def _answers_our_reset(session: BoardSession) -> bool:
    """Whether a Hello after the session's first can be the answer to a soft Reset the
    daemon sent while the board had not said Hello (a board answers within seconds)."""
    return session.hellos_owed > 0 and time.monotonic() - session.hello_asked < HELLO_RETRY_S


class Fleet:
    """The boards reachable through a transport, as sessions.

    Args:
        transport: an entered transport (``InProcTransport``, ``MqttTransport``, ...).
        heartbeat_interval: seconds of silence before the daemon pings a board.
        heartbeat_misses: silent intervals (beyond the board's own heartbeat period)
            before the board is declared gone.
        on_event: called with membership news (joined, left, faulty, resynced).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        heartbeat_interval: float = 2.0,
        heartbeat_misses: int = 3,
        on_event: Callable[[FleetEvent], None] | None = None,
    ) -> None:
        self.transport = transport
        self.sessions: dict[str, BoardSession] = {}
        self._interval = heartbeat_interval
        # A busy board still sends its own heartbeat every HEARTBEAT_INTERVAL_S, so the
        # silence limit is never shorter than two of those.
        self._silence_limit = max(heartbeat_interval * heartbeat_misses, 2.5 * HEARTBEAT_INTERVAL_S)
        self._on_event = on_event
        self._changed = asyncio.Condition()
        self._tasks: asyncio.TaskGroup | None = None
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._main: list[asyncio.Task[None]] = []
        self._helpers: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Self:
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        self._main.append(self._tasks.create_task(self._events(), name="fleet.events"))
        self._main.append(self._tasks.create_task(self._liveness(), name="fleet.liveness"))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for task in [*self._main, *self._readers.values(), *self._helpers]:
            task.cancel()
        for session in self.sessions.values():
            session.fail_all("daemon shutting down")
        if self._tasks is not None:
            await self._tasks.__aexit__(None, None, None)

    # ------------------------------------------------------------------ queries

    def boards(self) -> list[BoardSession]:
        """All sessions, sorted by board id."""
        return sorted(self.sessions.values(), key=lambda s: s.board_id)

    def find(self, board_id: str) -> BoardSession | None:
        """The session of a board by its id, its address or its control-plane id."""
        for session in self.sessions.values():
            if board_id in (session.board_id, session.address, _safe_id(session.board_id)):
                return session
        return None

    def infos(self) -> tuple[BoardInfo, ...]:
        """Every board as the control API shows it."""
        return tuple(s.info() for s in self.boards())

    async def wait_changed(self, timeout: float | None = None) -> None:
        """Wait until membership or a board's state changes (or ``timeout`` passes)."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                # wait_for, not asyncio.timeout: with the latter the engine woke before every
                # board that joined with the first had said Hello, and ran its first steps on
                # fewer boards (measured in the throughput and reassignment tests).
                await asyncio.wait_for(self._changed.wait(), timeout)

    async def notify_changed(self) -> None:
        """Wake everyone in ``wait_changed``."""
        async with self._changed:
            self._changed.notify_all()

    def emit(self, kind: str, session: BoardSession, message: str = "") -> None:
        """Pass a membership event to the daemon (logged either way)."""
        _log.info(kind.replace("_", " "), board=session.board_id, detail=message)
        if self._on_event is not None:
            try:
                self._on_event(FleetEvent(kind, _safe_id(session.board_id), message))
            except Exception:  # an event consumer's bug must not stop membership
                _log.exception("fleet event handler failed")

    def mark_faulty(self, session: BoardSession, reason: str) -> None:
        """Take a board out of work until it is resynchronised."""
        if session.state in ("gone", "faulty", "unknown"):
            return
        session.set_state("faulty", reason)
        session.faults += 1
        session.step = None
        self.emit("board_faulty", session, reason)

    # ------------------------------------------------------------------ loops

    async def _events(self) -> None:
        async for event in self.transport.events():
            if hasattr(event, "link"):
                await self._appeared(event.board_id, event.link, event.transport)
            else:
                await self._gone(event.board_id, event.reason)

    async def _appeared(self, address: str, link: Link, transport: str) -> None:
        old = self.sessions.get(address)
        if old is not None:
            await self._gone(address, "replaced")
        session = BoardSession(address, link, transport)
        self.sessions[address] = session
        assert self._tasks is not None
        task = self._tasks.create_task(self._reader(session), name=f"fleet[{address}].reader")
        self._readers[address] = task
        self._spawn(self._hello_watch(session), f"fleet[{address}].hello")
        await self.notify_changed()

    async def _gone(self, address: str, reason: str) -> None:
        session = self.sessions.get(address)
        if session is None:
            return
        if session.state != "gone":
            session.set_state("gone", reason)
            self.emit("board_left", session, reason)
        session.step = None
        session.fail_all(reason)
        del self.sessions[address]
        task = self._readers.pop(address, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        await self.notify_changed()

    async def _reader(self, session: BoardSession) -> None:
        try:
            async for data in session.link.incoming():
                await self._on_bytes(session, data)
        except LinkError as exc:
            _log.info("board link failed", board=session.board_id, error=str(exc))
        finally:
            if self.sessions.get(session.address) is session:
                await self._gone(session.address, "link closed")

    async def _on_bytes(self, session: BoardSession, data: bytes) -> None:
        try:
            msg = decode(data)
        except ProtocolError as exc:
            await self._bad_message(session, exc)
            return
        try:
            await self._on_message(session, msg)
        except Exception:  # a misbehaving board must not stop its reader
            _log.exception("board message handling failed", board=session.board_id, type=msg.type)

    async def _bad_message(self, session: BoardSession, exc: ProtocolError) -> None:
        _log.warning(
            "undecodable message from board",
            board=session.board_id,
            kind=exc.kind,
            detail=exc.detail,
        )
        if exc.kind == "unsupported_version":
            error = Error(
                code="unsupported_version",
                ref_type=exc.msg_type or 0,
                detail=f"daemon speaks {PROTOCOL_VERSION}",
            )
            with contextlib.suppress(BoardFaultError):
                await session.send(error)
            if session.state == "unknown":
                session.set_state("hello", "unsupported version")
            self.mark_faulty(session, "unsupported protocol version")
            await self.notify_changed()

    async def _on_message(self, session: BoardSession, msg: DataMessage) -> None:
        if isinstance(msg, Hello):
            await self._on_hello(session, msg)
            return
        if not session.deliver(msg) and not isinstance(msg, Heartbeat):
            if isinstance(msg, Error):
                _log.warning(
                    "board error",
                    board=session.board_id,
                    code=msg.code,
                    detail=msg.detail,
                    step=msg.step,
                )
            else:
                _log.debug("unexpected answer dropped", board=session.board_id, type=msg.type)

    async def _on_hello(self, session: BoardSession, hello: Hello) -> None:
        if session.transport == "mqtt" and hello.board_id != session.address:
            # On MQTT the topic names the board: a Hello that claims another id is forged
            # or misconfigured, and must not rename (or take over) a session.
            await self._refuse_hello(session, hello)
            return
        session.deliver(hello)
        if session.hello is not None and _answers_our_reset(session):
            # The board's own Hello crossed our soft Reset, and this is the Reset's answer:
            # whatever was sent since went out after the Reset, so nothing is void and
            # the session goes on (voiding it failed a starting job's first load).
            session.hellos_owed -= 1
            return
        first = session.hello is None
        if not first:
            # A fresh session (a reboot, or a reconnect that may have lost messages both
            # ways): what the board was asked before is void, so its pending requests
            # fail now and their work is reassigned, instead of waiting out a timeout.
            session.fail_all("said Hello again")
            session.hellos_owed = 0
        session.epoch += 1
        session.hello = hello
        session.model_hash = hello.model_hash
        session.job_id = 0  # a Hello is a fresh session: resend the job
        session.last_error = None
        session.step = None
        if hello.protocol_version < PROTOCOL_VERSION:
            session.state = "hello"
            self.mark_faulty(session, f"protocol version {hello.protocol_version} unsupported")
        else:
            session.state = "hello"  # any state -> hello (SPEC 9.1)
            session.retry_at, session.sync_failures = 0.0, 0
        if first:
            self.emit("board_joined", session, f"{session.transport} {session.address}")
        await self.notify_changed()

    async def _refuse_hello(self, session: BoardSession, hello: Hello) -> None:
        _log.warning("hello refused: its board_id is not its topic's", board=session.address,
                     claimed=hello.board_id)  # fmt: skip
        detail = "Hello.board_id differs from the board id of its topic"
        error = Error(code="malformed", ref_type=TYPE_CODES[Hello], detail=detail)
        with contextlib.suppress(BoardFaultError):
            await session.send(error)

    async def _liveness(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # a cancel swallowed by wait_for (3.11)
                raise asyncio.CancelledError
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if session.state == "unknown" and now - session.appeared > HELLO_GRACE_S:
                    await self._ask_hello(session, now)
                silent = now - session.last_seen
                if silent > self._silence_limit:
                    _log.warning(
                        "board silent; giving up", board=session.board_id, silent_s=round(silent, 1)
                    )
                    with contextlib.suppress(Exception):
                        await session.link.close()
                    await self._gone(session.address, "silent")
                elif (silent > self._interval or session.link_down) and session.state not in (
                    "gone",
                    "unknown",
                ):
                    self._spawn_ping(session)

    async def _hello_watch(self, session: BoardSession) -> None:
        await asyncio.sleep(HELLO_GRACE_S)
        if session.state == "unknown" and self.sessions.get(session.address) is session:
            await self._ask_hello(session, time.monotonic())

    async def _ask_hello(self, session: BoardSession, now: float) -> None:
        """A board that never said Hello (its Hello went out before the daemon listened,
        e.g. after a daemon restart) is asked for one with a soft Reset."""
        if now - session.hello_asked < HELLO_RETRY_S:
            return
        session.hello_asked = now
        session.hellos_owed += 1
        _log.info("board without hello; asking for one", board=session.address)
        with contextlib.suppress(BoardFaultError):
            await session.send(Reset(scope="soft"))

    def _spawn_ping(self, session: BoardSession) -> None:
        self._spawn(self._ping(session), f"fleet[{session.address}].ping")

    def _spawn(self, coro: Any, name: str) -> None:
        """A short-lived helper task, cancelled when the fleet closes."""
        assert self._tasks is not None
        task = self._tasks.create_task(coro, name=name)
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)

    async def _ping(self, session: BoardSession) -> None:
        was_down = session.link_down
        with contextlib.suppress(BoardFaultError):
            await session.ping(self._interval)
        if was_down and not session.link_down:  # the engine may be waiting for this board
            await self.notify_changed()

    async def iterate(self) -> AsyncIterator[BoardSession]:
        """Yield the sessions present now (a snapshot)."""
        for session in self.boards():
            yield session
