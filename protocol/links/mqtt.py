"""MQTT links: per-board topics, presence by birth message and Last Will.

Topics, QoS and retain flags come from ``qsched.protocol.topics.TopicMap``. A board
publishes a retained ``BoardPresence(online=True)`` on connect (its birth) and leaves a
Last Will that sets it ``online=False``; the daemon does the same with
``DaemonPresence`` on the daemon state topic. Data-plane messages are the binary codec
bytes on ``boards/<id>/in`` (daemon -> board) and ``boards/<id>/out`` (board -> daemon).

``MqttConnection`` keeps one aiomqtt client connected with aiomqtt's documented
reconnect pattern (re-enter ``async with client`` after ``MqttError``), waiting a capped,
jittered, exponentially growing delay between attempts and logging each. One attempt
(CONNECT, birth message, SUBSCRIBEs) gives up after ``connect_timeout_s``: a broker that
goes away mid-attempt can leave it waiting on a dead socket. Sends wait for a reconnect
up to ``send_timeout_s``, so a broker restart delays messages but loses no link. MQTT
delivers to the subscribers present when a message is published: what the daemon sends
while a board is still reconnecting is lost (the step engine re-asks after its
deadline), which is why a repeated birth message keeps the link but the fleet should
treat the board's next Hello as a fresh session. Other daemon parts (the control API)
subscribe through ``MqttTransport.connection``.

    async with MqttTransport(cfg.mqtt, TopicMap(fleet=cfg.fleet)) as transport:   # daemon
        async for event in transport.events(): ...
    async with MqttEndpoint(cfg.mqtt, TopicMap(fleet="f"), "board-07") as link:   # board
        await link.send(hello_bytes)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Self

import aiomqtt
import structlog
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions
from pydantic import ValidationError

from qsched.protocol.batch import (
    MAX_BATCH_BYTES,
    batch_size,
    pack_batch,
    record_size,
    unpack_batch,
)
from qsched.protocol.codec import decode, encode_shared
from qsched.protocol.control import BoardPresence, DaemonPresence
from qsched.protocol.errors import ProtocolError
from qsched.protocol.links.base import (
    EVENT_QUEUE_SIZE,
    INCOMING_QUEUE_SIZE,
    BoardAppeared,
    BoardGone,
    LinkClosedError,
    LinkEvent,
    MessageTooLargeError,
    SendTimeoutError,
    cancel_until_done,
    close_queue,
    iterate_queue,
    stamped,
    stamped_messages,
)
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.messages import MAX_PAYLOAD, StepOrder
from qsched.protocol.topics import TopicKind, TopicMap

__all__ = [
    "HostUplink",
    "MessageHandler",
    "MqttBoardLink",
    "MqttConnection",
    "MqttEndpoint",
    "MqttTransport",
    "backoff_delays",
    "build_client",
    "step_order_messages",
    "tls_context",
]

NAME = "mqtt"
_log = structlog.get_logger("qsched.links.mqtt")

MessageHandler = Callable[[aiomqtt.Message], Awaitable[None]]


def backoff_delays(minimum: float, maximum: float) -> Callable[[int], float]:
    """The reconnect delay for attempt ``n`` (0-based): capped exponential, jittered.

    Jitter (a factor in [0.5, 1]) keeps a fleet of boards that lost the same broker from
    reconnecting in lock-step.

    Args:
        minimum: the first delay's upper bound in seconds.
        maximum: the cap.

    Returns:
        A function from attempt number to delay.
    """

    def delay(attempt: int) -> float:
        cap: float = min(maximum, minimum * 2.0 ** min(attempt, 32))
        return cap * random.uniform(0.5, 1.0)

    return delay


def tls_context(cfg: MqttConfig) -> ssl.SSLContext | None:
    """The TLS context ``cfg.tls`` asks for, or None when TLS is off."""
    tls = cfg.tls
    if not tls.enabled:
        return None
    context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
    if tls.cert_file is not None:
        context.load_cert_chain(str(tls.cert_file), str(tls.key_file) if tls.key_file else None)
    if tls.insecure:
        context.check_hostname = False
    return context


def build_client(
    cfg: MqttConfig,
    identifier: str,
    *,
    will: aiomqtt.Will | None = None,
    tls: ssl.SSLContext | None = None,
) -> aiomqtt.Client:
    """The one way qsched builds an aiomqtt client: daemon, boards, bridge and ctl.

    Args:
        cfg: broker address, credentials, protocol version, TLS and timeouts.
        identifier: the MQTT client id (unique per broker).
        will: the Last Will, if any.
        tls: a TLS context built beforehand (default: built here from ``cfg.tls``).

    Returns:
        A client to enter with ``async with``.
    """
    version = aiomqtt.ProtocolVersion.V5 if cfg.protocol == "5" else aiomqtt.ProtocolVersion.V311
    client = aiomqtt.Client(
        cfg.host,
        cfg.port,
        username=cfg.username,
        password=cfg.password.get_secret_value() if cfg.password else None,
        identifier=identifier,
        protocol=version,
        will=will,
        keepalive=cfg.keepalive_s,
        tls_context=tls if tls is not None else tls_context(cfg),
        tls_insecure=cfg.tls.insecure if cfg.tls.enabled else None,
        max_queued_incoming_messages=INCOMING_QUEUE_SIZE * 16,
        # Small QoS 1 packets and their acks otherwise meet Nagle's algorithm and
        # delayed ACKs: about 40 ms per hop instead of well under 1 ms.
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        # The client's default timeout bounds CONNECT, SUBSCRIBE and the birth message.
        # A broker that dies or stalls mid-attempt leaves it waiting on a socket that
        # never answers; it must be retried within the backoff, not after a whole send
        # timeout. Sends pass their own deadline (send_timeout_s).
        timeout=cfg.connect_timeout_s,
    )
    _write_at_once(client)
    return client


def _write_at_once(client: aiomqtt.Client) -> None:
    """Have the client write a publish to its socket when it is queued, if that happens
    on the event loop's thread.

    aiomqtt answers paho's "a packet is queued" callback by scheduling a writer for the
    socket from any thread (``call_soon_threadsafe``, then ``add_writer``), so a publish
    reaches the socket two loop iterations later, behind whatever else is ready: on the
    2-core development machine 0.2 ms from the call to the write, on the path of every
    step's order and result. On the loop's thread the socket can be written at once, as
    paho itself does without an external loop; what the socket does not take (it is
    full) is left to aiomqtt's writer. The acknowledgement paho queues while it reads
    (a received QoS 1 message's PUBACK) is written one loop turn later, once the
    message's handler has run (``MqttConnection._messages``): written first it delayed
    every message by a send (60-70 us of kernel time on the development machine).
    Connecting runs in an executor thread, and goes the usual way.
    """
    paho: Any = getattr(client, "_client", None)  # aiomqtt 2.x keeps its paho client here
    schedule_writer = getattr(paho, "on_socket_register_write", None)
    if schedule_writer is None:  # another aiomqtt: its own way, slower but correct
        return
    read = paho.loop_read
    reading = False

    def loop_read(*args: Any, **kwargs: Any) -> Any:
        nonlocal reading
        reading = True
        try:
            return read(*args, **kwargs)
        finally:
            reading = False

    def write(mqtt: Any, userdata: Any, sock: Any) -> None:
        mqtt.loop_write()  # unregisters itself when everything went out
        if mqtt.want_write():
            schedule_writer(mqtt, userdata, sock)

    def on_register_write(mqtt: Any, userdata: Any, sock: Any) -> None:
        try:
            loop = asyncio.get_running_loop()  # only the loop's thread has one
        except RuntimeError:
            schedule_writer(mqtt, userdata, sock)
            return
        if reading:
            loop.call_soon(write, mqtt, userdata, sock)
        else:
            write(mqtt, userdata, sock)

    paho.loop_read = loop_read  # aiomqtt's reader calls it through the instance
    paho.on_socket_register_write = on_register_write


_WAKE: Final = object()  # put on a client's message queue when its connection ends


def _wake_reader(queue: asyncio.Queue[Any], _ended: object) -> None:
    with contextlib.suppress(asyncio.QueueFull):  # a full queue's reader is not waiting
        queue.put_nowait(_WAKE)


@dataclass(frozen=True)
class _Subscription:
    topic_filter: str
    qos: int
    handler: MessageHandler
    retain_as_published: bool = False


class MqttConnection:
    """One MQTT client kept connected; runs subscriptions' handlers in order.

    Args:
        cfg: broker address, credentials, TLS and reconnect timing.
        identifier: the MQTT client id (unique per broker).
        will: the Last Will, published by the broker if this client drops.
        on_connect: awaited after each (re)connect, before subscribing (birth messages).
    """

    def __init__(
        self,
        cfg: MqttConfig,
        identifier: str,
        *,
        will: aiomqtt.Will | None = None,
        on_connect: Callable[[aiomqtt.Client], Awaitable[None]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.identifier = identifier
        self._will = will
        self._on_connect = on_connect
        self._subscriptions: list[_Subscription] = []
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._delay = backoff_delays(cfg.reconnect_min_s, cfg.reconnect_max_s)
        # Built now so a missing or bad certificate fails here, not in a background task.
        self._tls = tls_context(cfg)
        self.connects = 0  # successful connections so far (a reconnect makes it > 1)

    def subscribe(
        self,
        topic_filter: str,
        qos: int,
        handler: MessageHandler,
        *,
        retain_as_published: bool = False,
    ) -> None:
        """Register a subscription, (re)made on every connect; call before ``run``.

        Args:
            topic_filter: an MQTT topic filter (wildcards allowed).
            qos: the subscription QoS.
            handler: awaited for each matching message, in arrival order; its
                exceptions are logged and the loop goes on.
            retain_as_published: MQTT 5 only: a message keeps the retain flag its
                publisher set even when it is delivered live (so a handler can tell a
                retained publish); on 3.1.1 the flag is seen only on (re)subscribing.
        """
        self._subscriptions.append(_Subscription(topic_filter, qos, handler, retain_as_published))

    def _make_client(self) -> aiomqtt.Client:
        return build_client(self.cfg, self.identifier, will=self._will, tls=self._tls)

    @property
    def connected(self) -> bool:
        """Whether the client is connected right now."""
        return self._connected.is_set()

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait for a connection (raises ``TimeoutError`` after ``timeout``)."""
        await asyncio.wait_for(self._connected.wait(), timeout)

    async def run(self) -> None:
        """Connect, subscribe, dispatch messages; reconnect on loss. Runs until cancelled."""
        client = self._make_client()
        attempt = 0
        while True:
            try:
                async with client:
                    attempt = 0
                    await self._session(client)
            except aiomqtt.MqttError as exc:
                self._lost()
                delay = self._delay(attempt)
                attempt += 1
                _log.warning(
                    "mqtt connection failed; reconnecting",
                    client=self.identifier,
                    broker=f"{self.cfg.host}:{self.cfg.port}",
                    attempt=attempt,
                    delay_s=round(delay, 3),
                    error=str(exc),
                )
                await asyncio.sleep(delay)
            finally:
                self._lost()

    async def _session(self, client: aiomqtt.Client) -> None:
        if self._on_connect is not None:
            await self._on_connect(client)
        for sub in self._subscriptions:
            if sub.retain_as_published and self.cfg.protocol == "5":
                options = SubscribeOptions(qos=sub.qos, retainAsPublished=True)
                await client.subscribe(sub.topic_filter, options=options)
            else:
                await client.subscribe(sub.topic_filter, qos=sub.qos)
        self._client = client
        self.connects += 1
        self._connected.set()
        _log.info(
            "mqtt connected", client=self.identifier, broker=f"{self.cfg.host}:{self.cfg.port}"
        )
        await self._messages(client)

    async def _messages(self, client: aiomqtt.Client) -> None:
        """Hand the client's messages to the handlers in arrival order until it
        disconnects; then ``aiomqtt.MqttError``, as aiomqtt's message iterator raises.

        Reads aiomqtt's queue itself (2.x keeps it in ``_queue``, and the connection's
        end in ``_disconnected``): the iterator made a task and an ``asyncio.wait`` for
        every message, two loop turns between a message's arrival and its handler.
        """
        queue = getattr(client, "_queue", None)
        disconnected = getattr(client, "_disconnected", None)
        if not isinstance(queue, asyncio.Queue) or not isinstance(disconnected, asyncio.Future):
            async for message in client.messages:  # another aiomqtt: its public iterator
                await self._dispatch(message)
            return
        wake = functools.partial(_wake_reader, queue)
        disconnected.add_done_callback(wake)  # a reader waiting on an empty queue
        try:
            while True:
                if queue.empty() and disconnected.done():
                    cause = None if disconnected.cancelled() else disconnected.exception()
                    raise aiomqtt.MqttError("Disconnected during message iteration") from cause
                message = await queue.get()
                if message is not _WAKE:
                    await self._dispatch(message)
        finally:
            disconnected.remove_done_callback(wake)

    def _lost(self) -> None:
        self._connected.clear()
        self._client = None

    async def _dispatch(self, message: aiomqtt.Message) -> None:
        for sub in self._subscriptions:
            if message.topic.matches(sub.topic_filter):
                try:
                    await sub.handler(message)
                except Exception:  # a misbehaving peer must not stop the loop
                    _log.exception("mqtt handler failed", topic=message.topic.value)

    async def publish(
        self,
        topic: str,
        payload: bytes | str,
        *,
        qos: int,
        retain: bool = False,
        properties: Properties | None = None,
        timeout: float | None = None,
    ) -> None:
        """Publish, waiting for a (re)connection if the broker is away.

        Args:
            topic: the topic.
            payload: the bytes (or text).
            qos: MQTT QoS; at QoS 1 and 2 this waits for the broker's acknowledgement.
            retain: whether the broker keeps the message for new subscribers.
            properties: MQTT 5 properties (response topic, correlation data).
            timeout: overall seconds; ``cfg.send_timeout_s`` by default.

        Raises:
            TimeoutError: not published within the timeout.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.cfg.send_timeout_s if timeout is None else timeout)
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"publish to {topic} timed out")
            if not self._connected.is_set():  # wait_for costs three loop turns: not when up
                await asyncio.wait_for(self._connected.wait(), remaining)
            client = self._client
            if client is None:
                continue
            try:
                await client.publish(
                    topic, payload, qos=qos, retain=retain, properties=properties, timeout=remaining
                )
                return
            except aiomqtt.MqttError as exc:
                _log.debug("publish failed; waiting for reconnect", topic=topic, error=str(exc))
                await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))


class MqttBoardLink:
    """The daemon's link to one MQTT board (created by ``MqttTransport``)."""

    def __init__(self, board_id: str, transport: MqttTransport, queue_size: int) -> None:
        self.board_id = board_id
        self.reason = ""
        self.dropped = 0  # messages dropped because the incoming queue was full
        self.fleet_in = False  # its presence says it takes StepOrders from the fleet topic
        self._transport = transport
        self._inbox: asyncio.Queue[object] = asyncio.Queue(queue_size)
        self._closed = False
        self.last_arrival: float | None = None  # when the message incoming yields arrived

    @property
    def closed(self) -> bool:
        """Whether the board is gone or the link was closed."""
        return self._closed

    async def send(self, payload: bytes) -> None:
        """Publish one message to the board's in topic (QoS 1).

        Raises:
            LinkClosedError: the board is gone.
            SendTimeoutError: the broker stayed unreachable for ``send_timeout_s``.
            MessageTooLargeError: the payload exceeds ``MAX_PAYLOAD``.
        """
        if self._closed:
            raise LinkClosedError(self.board_id, self.reason or "closed")
        if len(payload) > MAX_PAYLOAD:
            raise MessageTooLargeError(
                self.board_id, "too_large", f"{len(payload)} > {MAX_PAYLOAD} bytes"
            )
        await self._transport.send_to_board(self.board_id, bytes(payload))

    @property
    def fleet_channel(self) -> MqttTransport | None:
        """Where one publish reaches this board and the others of its transport
        (``publish_fleet``), when the board takes StepOrders; else None."""
        return self._transport if self.fleet_in else None

    def _deliver(self, payload: bytes) -> None:
        try:
            self._inbox.put_nowait(stamped(payload))
        except asyncio.QueueFull:
            # One message loop serves every board: a board that floods its queue loses
            # messages rather than stalling the others (the step engine re-asks).
            self.dropped += 1
            _log.warning("board queue full; message dropped", board=self.board_id)

    async def incoming(self) -> AsyncIterator[bytes]:
        """Messages from the board's out topic until the board is gone."""
        async for payload in stamped_messages(self._inbox, self):
            yield payload

    def _mark_closed(self, reason: str) -> bool:
        if self._closed:
            return False
        self._closed = True
        self.reason = reason
        close_queue(self._inbox)
        return True

    async def close(self, reason: str = "closed") -> None:
        """Forget the board (e.g. missed heartbeats); it comes back with its next message."""
        self._transport._forget(self, reason)


class MqttTransport:
    """The daemon's side: presence, per-board links, the daemon's own retained state.

    Args:
        cfg: the broker settings.
        topics: the fleet's topic map.
        identifier: the daemon's MQTT client id.
        version: reported in the daemon's presence message.
        queue_size: the bound of each board's incoming queue.
    """

    name = NAME

    def __init__(
        self,
        cfg: MqttConfig,
        topics: TopicMap,
        *,
        identifier: str | None = None,
        version: str | None = None,
        queue_size: int = INCOMING_QUEUE_SIZE,
        instance: str | None = None,
    ) -> None:
        self.topics = topics
        self._version = version
        self._instance = instance
        self._job: str | None = None
        self._queue_size = queue_size
        self._events: asyncio.Queue[object] = asyncio.Queue(EVENT_QUEUE_SIZE)
        self._links: dict[str, MqttBoardLink] = {}
        self._online: set[str] = set()
        rule = topics.rule("daemon_state")
        will = aiomqtt.Will(topics.daemon_state(), self._presence(False), rule.qos, rule.retain)
        self.connection = MqttConnection(
            cfg, identifier or f"qsched-daemon-{topics.fleet}", will=will, on_connect=self._birth
        )
        self.connection.subscribe(
            topics.all_board_presence(), topics.rule("board_presence").qos, self._on_presence
        )
        self.connection.subscribe(
            topics.all_board_out(), topics.rule("board_out").qos, self._on_out
        )
        self.connection.subscribe(
            topics.all_host_out(), topics.rule("host_out").qos, self._on_host_out
        )
        self._task: asyncio.Task[None] | None = None
        self._tasks: asyncio.TaskGroup | None = None

    def _presence(self, online: bool) -> bytes:
        presence = DaemonPresence(
            online=online, version=self._version, job=self._job, instance=self._instance
        )
        text: str = presence.model_dump_json()
        return text.encode()

    async def _birth(self, client: aiomqtt.Client) -> None:
        rule = self.topics.rule("daemon_state")
        await client.publish(
            self.topics.daemon_state(), self._presence(True), qos=rule.qos, retain=rule.retain
        )

    async def publish_state(self, job: str | None) -> None:
        """Update the daemon's retained state (``DaemonPresence``) with the current job.

        Args:
            job: the running job's name, or None when idle. Kept for the birth
                message after a reconnect.
        """
        self._job = job
        rule = self.topics.rule("daemon_state")
        await self.connection.publish(
            self.topics.daemon_state(), self._presence(True), qos=rule.qos, retain=rule.retain
        )

    async def send_to_board(self, board_id: str, payload: bytes) -> None:
        """Publish a data-plane message on the board's in topic, by the topic rule.

        Raises:
            SendTimeoutError: the broker stayed unreachable for ``send_timeout_s``.
        """
        rule = self.topics.rule("board_in")
        try:
            await self.connection.publish(
                self.topics.board_in(board_id), payload, qos=rule.qos, retain=rule.retain
            )
        except TimeoutError as exc:
            raise SendTimeoutError(board_id, "broker_unreachable", str(exc)) from exc

    async def publish_fleet(self, payload: bytes) -> None:
        """Publish one ``StepOrder`` on the fleet topic, for every board it names.

        Raises:
            SendTimeoutError: the broker stayed unreachable for ``send_timeout_s``.
            MessageTooLargeError: the payload exceeds ``MAX_PAYLOAD``.
        """
        if len(payload) > MAX_PAYLOAD:
            raise MessageTooLargeError("fleet", "too_large", f"{len(payload)} > {MAX_PAYLOAD}")
        rule = self.topics.rule("fleet_in")
        try:
            await self.connection.publish(
                self.topics.fleet_in(), payload, qos=rule.qos, retain=rule.retain
            )
        except TimeoutError as exc:
            raise SendTimeoutError("fleet", "broker_unreachable", str(exc)) from exc

    async def __aenter__(self) -> Self:
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        self._task = self._tasks.create_task(self.connection.run(), name="mqtt[daemon].connection")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await _leave(
            self.connection,
            self.topics.daemon_state(),
            self._presence(False),
            "daemon_state",
            self.topics,
        )
        if self._task is not None:
            await cancel_until_done([self._task])
        if self._tasks is not None:
            await self._tasks.__aexit__(None, None, None)
        for link in self._links.values():
            link._mark_closed("shutdown")
        close_queue(self._events)

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until the broker connection is up."""
        await self.connection.wait_connected(timeout)

    async def events(self) -> AsyncIterator[LinkEvent]:
        """``BoardAppeared`` on birth (or first message), ``BoardGone`` on Will or close."""
        async for event in iterate_queue(self._events):
            yield event

    async def _on_presence(self, message: aiomqtt.Message) -> None:
        parsed = self.topics.parse_board_topic(message.topic.value)
        if parsed is None:
            return
        board_id = parsed[0]
        presence = _presence_of(message.payload, board_id)
        if presence is None:
            return
        if presence.online:
            self._online.add(board_id)
            joined = await self._appear(board_id)
            joined.fleet_in = presence.fleet_in
        else:
            self._online.discard(board_id)
            link = self._links.get(board_id)
            if link is not None:
                self._forget(link, "offline")

    async def _on_out(self, message: aiomqtt.Message) -> None:
        parsed = self.topics.parse_board_topic(message.topic.value)
        if parsed is None or not isinstance(message.payload, bytes | bytearray):
            return
        await self._from_board(parsed[0], bytes(message.payload))

    async def _on_host_out(self, message: aiomqtt.Message) -> None:
        if not isinstance(message.payload, bytes | bytearray):
            return
        try:
            records = unpack_batch(bytes(message.payload))
        except ProtocolError as exc:
            _log.warning("bad host batch dropped", topic=message.topic.value, error=str(exc))
            return
        for board_id, payload in records:
            await self._from_board(board_id, payload)

    async def _from_board(self, board_id: str, payload: bytes) -> None:
        link = self._links.get(board_id)
        if link is None and board_id in self._online:
            # A board forgotten by the fleet (missed heartbeats) but still alive comes back.
            link = await self._appear(board_id)
        if link is None:
            _log.debug("message from a board without presence dropped", board=board_id)
            return
        link._deliver(payload)

    async def _appear(self, board_id: str) -> MqttBoardLink:
        link = self._links.get(board_id)
        if link is None:  # a repeated birth (reconnect) keeps the existing link
            link = MqttBoardLink(board_id, self, self._queue_size)
            self._links[board_id] = link
            await self._events.put(BoardAppeared(board_id, link, NAME))
        return link

    def _forget(self, link: MqttBoardLink, reason: str) -> None:
        if self._links.get(link.board_id) is link:
            del self._links[link.board_id]
        if link._mark_closed(reason):
            try:
                self._events.put_nowait(BoardGone(link.board_id, reason, NAME))
            except asyncio.QueueFull:
                _log.error("event queue full; BoardGone lost", board=link.board_id)


def _presence_of(payload: Any, board_id: str) -> BoardPresence | None:
    if not payload:  # a cleared retained presence: the board is gone
        return BoardPresence(board_id=board_id, online=False)
    try:
        presence = BoardPresence.model_validate_json(payload)
    except ValidationError as exc:
        _log.warning("invalid board presence ignored", board=board_id, error=str(exc))
        return None
    if presence.board_id != board_id:
        _log.warning("presence board id does not match its topic", board=board_id)
        return None
    return presence


@functools.lru_cache(maxsize=4)
def _step_order(payload: bytes) -> tuple[StepOrder, bytes] | None:
    """A fleet-topic payload decoded once per process (every board of a process gets the
    same bytes): the order and its update's encoding; None when it is not a StepOrder."""
    try:
        order = decode(payload)
    except ProtocolError as exc:
        _log.warning("undecodable message on the fleet topic dropped", error=str(exc))
        return None
    if not isinstance(order, StepOrder):
        _log.warning("a message other than a step order on the fleet topic dropped")
        return None
    # The update is read again in this process (by its boards, or a host's aggregator):
    # shared, it is decoded there from what was made here.
    return order, encode_shared(order.update())


def step_order_messages(payload: bytes, board_id: str) -> list[bytes]:
    """The encoded messages ``board_id`` takes from a fleet-topic payload, in order
    (SPEC 6.9): none when it is not named or the payload is not a StepOrder."""
    decoded = _step_order(bytes(payload))
    if decoded is None:
        return []
    order, update = decoded
    if not order.names(board_id):
        return []
    request = order.request_for(board_id)
    # Made here and read again here by the board: shared, it is not decoded there.
    return [update] if request is None else [update, encode_shared(request)]


async def _leave(
    conn: MqttConnection, topic: str, payload: bytes, kind: TopicKind, topics: TopicMap
) -> None:
    # A clean disconnect does not fire the Will, so say "offline" ourselves.
    if not conn.connected:
        return
    rule = topics.rule(kind)
    with contextlib.suppress(TimeoutError, aiomqtt.MqttError):
        await conn.publish(topic, payload, qos=rule.qos, retain=rule.retain, timeout=2.0)


class MqttEndpoint:
    """A board's link to the daemon over MQTT (the virtual board, the serial bridge).

    Args:
        cfg: the broker settings.
        topics: the fleet's topic map.
        board_id: this board's id (one topic level).
        protocol_version: reported in the birth message.
        queue_size: the bound of the incoming queue.
        fleet_in: take StepOrders from the fleet topic (said in the birth message); off,
            the daemon sends this board its own messages, as to a board from before.
        uplink: publish what the board sends in its host's batches (``HostUplink``)
            instead of on its own out topic.
    """

    def __init__(
        self,
        cfg: MqttConfig,
        topics: TopicMap,
        board_id: str,
        *,
        protocol_version: int | None = None,
        queue_size: int = INCOMING_QUEUE_SIZE,
        fleet_in: bool = True,
        uplink: HostUplink | None = None,
    ) -> None:
        self.board_id = board_id
        self.uplink = uplink
        self.topics = topics
        self.dropped = 0
        self.fleet_in = fleet_in
        self._protocol_version = protocol_version
        self._inbox: asyncio.Queue[object] = asyncio.Queue(queue_size)
        self._closed = False
        self.last_arrival: float | None = None  # when the message incoming yields arrived
        rule = topics.rule("board_presence")
        will = aiomqtt.Will(
            topics.board_presence(board_id), self._presence(False), rule.qos, rule.retain
        )
        self.connection = MqttConnection(
            cfg, f"qsched-{topics.fleet}-{board_id}", will=will, on_connect=self._birth
        )
        self.connection.subscribe(
            topics.board_in(board_id), topics.rule("board_in").qos, self._on_in
        )
        if fleet_in:
            self.connection.subscribe(
                topics.fleet_in(), topics.rule("fleet_in").qos, self._on_fleet
            )
        self._task: asyncio.Task[None] | None = None

    @property
    def closed(self) -> bool:
        """Whether the endpoint was closed."""
        return self._closed

    def _presence(self, online: bool) -> bytes:
        presence = BoardPresence(
            board_id=self.board_id,
            online=online,
            protocol_version=self._protocol_version,
            fleet_in=self.fleet_in and online,
        )
        text: str = presence.model_dump_json()
        return text.encode()

    async def _birth(self, client: aiomqtt.Client) -> None:
        rule = self.topics.rule("board_presence")
        await client.publish(
            self.topics.board_presence(self.board_id),
            self._presence(True),
            qos=rule.qos,
            retain=rule.retain,
        )

    async def _on_in(self, message: aiomqtt.Message) -> None:
        if isinstance(message.payload, bytes | bytearray):
            self._put(stamped(bytes(message.payload)))

    async def _on_fleet(self, message: aiomqtt.Message) -> None:
        if isinstance(message.payload, bytes | bytearray):
            arrived = time.perf_counter()  # reading the order is this board's own work
            for payload in step_order_messages(message.payload, self.board_id):
                self._put((payload, arrived))

    def _put(self, item: tuple[bytes, float]) -> None:
        try:
            self._inbox.put_nowait(item)
        except asyncio.QueueFull:
            self.dropped += 1
            _log.warning("board inbox full; message dropped", board=self.board_id)

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(
            self.connection.run(), name=f"mqtt[{self.board_id}].connection"
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until the broker connection is up (the birth message is out)."""
        await self.connection.wait_connected(timeout)

    async def send(self, payload: bytes) -> None:
        """Publish one message on the board's out topic (QoS 1).

        Raises:
            LinkClosedError: the endpoint was closed.
            SendTimeoutError: the broker stayed unreachable for ``send_timeout_s``.
        """
        if self._closed:
            raise LinkClosedError(self.board_id, "closed")
        if self.uplink is not None:
            await self.uplink.send(self.board_id, bytes(payload))
            return
        rule = self.topics.rule("board_out")
        try:
            await self.connection.publish(
                self.topics.board_out(self.board_id),
                bytes(payload),
                qos=rule.qos,
                retain=rule.retain,
            )
        except TimeoutError as exc:
            raise SendTimeoutError(self.board_id, "broker_unreachable", str(exc)) from exc

    async def incoming(self) -> AsyncIterator[bytes]:
        """Messages from the daemon until the endpoint is closed."""
        async for payload in stamped_messages(self._inbox, self):
            yield payload

    async def close(self) -> None:
        """Say offline (retained), disconnect, end ``incoming`` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await _leave(
            self.connection,
            self.topics.board_presence(self.board_id),
            self._presence(False),
            "board_presence",
            self.topics,
        )
        if self._task is not None:
            await cancel_until_done([self._task])
        close_queue(self._inbox)


class HostUplink:
    """One publisher for the messages of every board of a process (``protocol/batch.py``).

    What the boards send within one turn of the event loop goes out as one batch on
    ``hosts/<host>/out``; each ``send`` returns once its batch was published (QoS 1),
    as a board's own publish would. Births, Wills and what the daemon sends stay on
    each board's own topics.

    Args:
        cfg: the broker settings.
        topics: the fleet's topic map.
        host: this host's name (one topic level).
    """

    def __init__(self, cfg: MqttConfig, topics: TopicMap, host: str) -> None:
        self.topic = topics.host_out(host)
        self.rule = topics.rule("host_out")
        self.connection = MqttConnection(cfg, f"qsched-{topics.fleet}-host-{host}")
        self.batches = 0  # published so far
        self.records = 0  # messages in them
        self._pending: list[tuple[str, bytes, asyncio.Future[None]]] = []
        self._flush: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self.connection.run(), name="mqtt[host].connection")
        await self.connection.wait_connected(self.connection.cfg.send_timeout_s)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await cancel_until_done([t for t in (self._flush, self._task) if t is not None])

    async def send(self, board_id: str, payload: bytes) -> None:
        """Queue one board's message for the next batch and wait until it is published.

        Raises:
            SendTimeoutError: the broker stayed unreachable for ``send_timeout_s``.
        """
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((board_id, payload, sent))
        if self._flush is None or self._flush.done():
            self._flush = asyncio.create_task(self._publish_pending(), name="mqtt[host].flush")
        await sent

    async def _publish_pending(self) -> None:
        await asyncio.sleep(0)  # one loop turn: the other boards' sends of this moment join
        while self._pending:
            batch = self._take_batch()
            records = [(b, p) for b, p, _ in batch]
            try:
                await self.connection.publish(
                    self.topic, pack_batch(records), qos=self.rule.qos, retain=self.rule.retain
                )
            except TimeoutError as exc:
                for board_id, _, sent in batch:
                    if not sent.done():
                        sent.set_exception(
                            SendTimeoutError(board_id, "broker_unreachable", str(exc))
                        )
                continue
            self.batches += 1
            self.records += len(batch)
            for _, _, sent in batch:
                if not sent.done():
                    sent.set_result(None)

    def _take_batch(self) -> list[tuple[str, bytes, asyncio.Future[None]]]:
        """The longest prefix of the pending messages that fits one batch."""
        taken: list[tuple[str, bytes, asyncio.Future[None]]] = []
        size = batch_size([])
        while self._pending:
            board_id, payload, _ = self._pending[0]
            record = record_size(board_id, payload)
            if taken and size + record > MAX_BATCH_BYTES:
                break
            size += record
            taken.append(self._pending.pop(0))
        return taken
