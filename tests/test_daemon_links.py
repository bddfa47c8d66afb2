"""Links with real peers: in-process queues, serial over a pty pair, MQTT on a private Mosquitto."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tty
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import SecretStr

from qsched.lab.broker import MosquittoBroker, free_port
from qsched.protocol.framing import decode_frame, encode_frame
from qsched.protocol.links import (
    BoardAppeared,
    BoardGone,
    LinkClosedError,
    MultiTransport,
    SendTimeoutError,
)
from qsched.protocol.links.base import LinkEvent, MessageTooLargeError
from qsched.protocol.links.config import MqttConfig, TlsConfig
from qsched.protocol.links.inproc import InProcTransport
from qsched.protocol.links.mqtt import MqttConnection, MqttEndpoint, MqttTransport
from qsched.protocol.links.serial import ByteStream, FdStream, SerialLink, SerialTransport
from qsched.protocol.messages import MAX_PAYLOAD
from qsched.protocol.topics import TopicMap

if TYPE_CHECKING:
    from conftest import PtyPair

FAST = {"ack_timeout": 0.05, "max_retries": 4}


async def _next_event(events: AsyncIterator[LinkEvent], timeout: float = 5.0) -> LinkEvent:
    return await asyncio.wait_for(anext(events), timeout)


async def _take(link: SerialLink | object, count: int, timeout: float = 5.0) -> list[bytes]:
    out: list[bytes] = []

    async def collect() -> None:
        async for message in link.incoming():  # type: ignore[attr-defined]
            out.append(message)
            if len(out) == count:
                return

    await asyncio.wait_for(collect(), timeout)
    return out


# --- in-process --------------------------------------------------------------------


async def test_inproc_messages_both_ways_and_detach() -> None:
    """Attach reports the daemon's end; messages flow both ways in order; detach ends both."""
    async with InProcTransport() as transport:
        events = transport.events()
        board = transport.attach("vb-0")
        appeared = await _next_event(events)
        assert isinstance(appeared, BoardAppeared) and appeared.board_id == "vb-0"
        daemon = appeared.link
        for i in range(5):
            await daemon.send(bytes([i]))
            await board.send(bytes([100 + i]))
        assert await _take(board, 5) == [bytes([i]) for i in range(5)]
        assert await _take(daemon, 5) == [bytes([100 + i]) for i in range(5)]
        transport.detach("vb-0", reason="unplugged")
        gone = await _next_event(events)
        assert gone == BoardGone("vb-0", "unplugged", "inproc")
        assert daemon.closed and board.closed
        with pytest.raises(LinkClosedError):
            await daemon.send(b"x")
        assert [m async for m in board.incoming()] == []


async def test_inproc_receiver_takes_messages_as_they_are_sent() -> None:
    """An end given a receiver gets what was queued before, in order, then every message
    in the sender's own call (send and send_nowait); its incoming only ends, when the
    link closes."""
    async with InProcTransport() as transport:
        board = transport.attach("vb-0")
        daemon = (await _next_event(transport.events())).link
        await board.send(b"a")
        assert board.send_nowait(b"b")
        got: list[bytes] = []
        daemon.receive_with(got.append)
        assert got == [b"a", b"b"]
        await board.send(b"c")
        assert got == [b"a", b"b", b"c"]  # no turn of the loop in between
        assert board.send_nowait(b"d") and got[-1] == b"d"
        await daemon.send(b"down")  # the other way is unchanged: queued
        assert await _take(board, 1) == [b"down"]
        await board.close()
        assert [m async for m in daemon.incoming()] == []
        with pytest.raises(LinkClosedError):
            await board.send(b"late")
        assert got == [b"a", b"b", b"c", b"d"]


async def test_inproc_duplicate_id_refused_and_reattach() -> None:
    """A second live board with the same id is refused; after it is gone it can return."""
    async with InProcTransport() as transport:
        board = transport.attach("vb-1")
        with pytest.raises(Exception, match="duplicate"):
            transport.attach("vb-1")
        await board.close()
        transport.attach("vb-1")


async def test_multi_transport_merges_events() -> None:
    """Events of several transports arrive on one stream."""
    first, second = InProcTransport(), InProcTransport()
    async with MultiTransport([first, second]) as fleet:
        events = fleet.events()
        first.attach("a")
        second.attach("b")
        seen = {(await _next_event(events)).board_id for _ in range(2)}
        assert seen == {"a", "b"}


# --- serial over a pseudo-terminal -------------------------------------------------


class FaultyStream:
    """Wraps a ByteStream and drops chosen writes: the fault sits where bytes leave."""

    def __init__(self, inner: ByteStream, drop: Callable[[bytes], bool]) -> None:
        self.inner = inner
        self.drop = drop
        self.dropped = 0

    async def read(self) -> bytes:
        return await self.inner.read()

    async def write(self, data: bytes) -> None:
        if self.drop(data):
            self.dropped += 1
            return
        await self.inner.write(data)

    async def close(self) -> None:
        await self.inner.close()


def _is_ack(wire: bytes) -> bool:
    return decode_frame(wire.strip(b"\x00")).is_ack


def _drop_first(kind_is_ack: bool, count: int = 1) -> Callable[[bytes], bool]:
    left = [count]

    def drop(wire: bytes) -> bool:
        if _is_ack(wire) == kind_is_ack and left[0] > 0:
            left[0] -= 1
            return True
        return False

    return drop


class Pty:
    """A pty pair: the daemon opens ``path``; the board owns the master fd."""

    def __init__(self, link_dir: Path | None = None) -> None:
        self.master, self.slave = os.openpty()
        tty.setraw(self.slave)  # raw before anyone writes: no echo, no line editing
        self.path = os.ttyname(self.slave)

    def close(self) -> None:
        os.close(self.slave)  # held open so the master does not see a hang-up early


@asynccontextmanager
async def serial_pair(
    pty: PtyPair,
    drop: Callable[[bytes], bool] | None = None,
) -> AsyncIterator[tuple[SerialLink, SerialLink, SerialTransport, AsyncIterator[LinkEvent]]]:
    """A SerialTransport on the pty's port and the board's SerialLink on its master."""
    stream: ByteStream = FdStream(pty.take_master())
    if drop is not None:
        stream = FaultyStream(stream, drop)
    async with SerialTransport([pty.path], reopen_interval=0.05, **FAST) as transport:
        events = transport.events()
        async with SerialLink("board-0", stream, **FAST) as board:
            appeared = await _next_event(events)
            assert isinstance(appeared, BoardAppeared)
            assert appeared.board_id == f"serial:{pty.path}"
            yield appeared.link, board, transport, events  # type: ignore[misc]


async def test_serial_round_trip_in_order(pty_pair: PtyPair) -> None:
    """Messages of every size up to MAX_PAYLOAD cross a pty both ways, in order, once."""
    sizes = [0, 1, 253, 254, 255, 1000] + [MAX_PAYLOAD] * 8  # big ones overflow the pty buffer
    payloads = [os.urandom(n) for n in sizes] + [bytes(300)]  # zeros: worst case for COBS
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda _loop, context: loop_errors.append(context)
    )
    async with serial_pair(pty_pair) as (daemon, board, _, _):
        receiving = asyncio.create_task(_take(board, len(payloads)))
        for payload in payloads:
            await daemon.send(payload)
        assert await receiving == payloads
        for payload in payloads:
            await board.send(payload)
        assert await _take(daemon, len(payloads)) == payloads
        assert daemon.stats.retransmits == 0 and board.stats.duplicates == 0
    assert loop_errors == []  # nothing failed out of sight in a transport callback


async def test_serial_survives_garbage_and_cut_frames(pty_pair: PtyPair) -> None:
    """Garbage and a frame cut off midway are skipped; the next frames still arrive."""
    async with serial_pair(pty_pair) as (daemon, board, _, _):
        cut = encode_frame(7, b"never complete")[:-6]
        os.write(pty_pair.master, b"\xff\x13garbage\x00\x01\x02" + cut)  # injected on the wire
        await board.send(b"after garbage")
        os.write(pty_pair.master, bytes(range(1, 256)) * 3)
        await board.send(b"after noise")
        assert await _take(daemon, 2) == [b"after garbage", b"after noise"]
        assert daemon.stats.bad_frames >= 2


async def test_serial_retransmits_dropped_frame(pty_pair: PtyPair) -> None:
    """A data frame lost on the wire is sent again after the ACK timeout and arrives once."""
    async with serial_pair(pty_pair, drop=_drop_first(kind_is_ack=False, count=2)) as (
        daemon,
        board,
        _,
        _,
    ):
        await board.send(b"lost twice")
        assert await _take(daemon, 1) == [b"lost twice"]
        assert board.stats.retransmits == 2
        assert daemon.stats.duplicates == 0


async def test_serial_lost_ack_gives_duplicate_that_is_dropped(pty_pair: PtyPair) -> None:
    """When an ACK is lost the sender repeats the frame; the receiver delivers it once."""
    async with serial_pair(pty_pair, drop=_drop_first(kind_is_ack=True)) as (daemon, board, _, _):
        await daemon.send(b"one")
        await daemon.send(b"two")
        assert await _take(board, 2) == [b"one", b"two"]
        assert daemon.stats.retransmits == 1
        assert board.stats.duplicates == 1


async def test_serial_send_times_out_without_acks(pty_pair: PtyPair) -> None:
    """With every ACK lost, send raises SendTimeoutError after max_retries; the link lives on."""
    async with serial_pair(pty_pair, drop=_is_ack) as (daemon, board, _, _):
        with pytest.raises(SendTimeoutError):
            await daemon.send(b"unheard")
        assert daemon.stats.retransmits == FAST["max_retries"]
        assert not daemon.closed
        await board.send(b"still up")  # the other direction still works
        assert (await _take(daemon, 1)) == [b"still up"]


async def test_serial_rejects_oversized(pty_pair: PtyPair) -> None:
    """A payload larger than one frame is refused before anything is written."""
    async with serial_pair(pty_pair) as (daemon, _, _, _):
        with pytest.raises(MessageTooLargeError):
            await daemon.send(bytes(MAX_PAYLOAD + 1))


async def test_serial_unplug_reports_gone(pty_pair: PtyPair) -> None:
    """Closing the board's side (an unplugged cable) ends the daemon's link with BoardGone."""
    async with serial_pair(pty_pair) as (daemon, board, _, events):
        await board.close()
        gone = await _next_event(events)
        assert isinstance(gone, BoardGone) and gone.reason == "unplugged"
        assert daemon.closed
        assert [m async for m in daemon.incoming()] == []
        with pytest.raises(LinkClosedError):
            await daemon.send(b"x")


async def test_serial_closed_link_reopens(pty_pair: PtyPair) -> None:
    """A link the daemon closes is reported gone, then the port is reopened as a fresh board."""
    async with serial_pair(pty_pair) as (daemon, board, _, events):
        await daemon.close()
        assert await _next_event(events) == BoardGone(daemon.board_id, "closed", "serial")
        again = await _next_event(events)
        assert isinstance(again, BoardAppeared) and again.link is not daemon
        await board.send(b"after reopen")
        assert await _take(again.link, 1) == [b"after reopen"]


async def test_serial_replug_reappears(tmp_path: Path) -> None:
    """A port path (a udev symlink) that comes back after an unplug yields a new board link."""
    first, second = Pty(), Pty()
    device = tmp_path / "stlink-0"
    device.symlink_to(first.path)
    try:
        async with SerialTransport([device], reopen_interval=0.05, **FAST) as transport:
            events = transport.events()
            async with SerialLink("b", FdStream(first.master), **FAST):
                assert isinstance(await _next_event(events), BoardAppeared)
            assert isinstance(await _next_event(events), BoardGone)
            device.unlink()
            device.symlink_to(second.path)
            async with SerialLink("b", FdStream(second.master), **FAST) as board:
                again = await _next_event(events)
                assert isinstance(again, BoardAppeared)
                await board.send(b"hello again")
                assert await _take(again.link, 1) == [b"hello again"]
    finally:
        first.close()
        second.close()


# --- MQTT on a private Mosquitto ---------------------------------------------------

_BOARD_SCRIPT = """
import asyncio, sys
from qsched.protocol.links.config import MqttConfig, TlsConfig
from qsched.protocol.links.mqtt import MqttEndpoint
from qsched.protocol.topics import TopicMap

async def main():
    cfg = MqttConfig(port=int(sys.argv[1]), keepalive_s=5)
    async with MqttEndpoint(cfg, TopicMap(fleet="t"), sys.argv[2]) as link:
        await link.wait_connected(10)
        await link.send(b"hello from " + sys.argv[2].encode())
        print("ready", flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


def _mqtt_cfg(port: int) -> MqttConfig:
    return MqttConfig(
        port=port,
        reconnect_min_s=0.05,
        reconnect_max_s=0.3,
        send_timeout_s=10.0,
        connect_timeout_s=2.0,
        keepalive_s=5,
    )


async def _reconnected(*connections: MqttConnection) -> None:
    while not all(c.connected and c.connects >= 2 for c in connections):
        await asyncio.sleep(0.02)


async def test_mqtt_birth_messages_and_clean_leave(mqtt_broker: MosquittoBroker) -> None:
    """A board appears by its birth message, talks both ways, and leaves as offline."""
    cfg, topics = _mqtt_cfg(mqtt_broker.port), TopicMap(fleet="t")
    async with MqttTransport(cfg, topics) as transport:
        events = transport.events()
        await transport.wait_connected(5)
        async with MqttEndpoint(cfg, topics, "board-1") as board:
            appeared = await _next_event(events)
            assert isinstance(appeared, BoardAppeared) and appeared.board_id == "board-1"
            daemon = appeared.link
            # The birth comes before the board subscribes (SPEC: birth, subscribe, Hello);
            # a daemon speaks after the Hello, so this one waits for the subscription.
            await board.wait_connected(5)
            payloads = [os.urandom(n) for n in (0, 1, 500, MAX_PAYLOAD)]
            for payload in payloads:
                await daemon.send(payload)
                await board.send(payload[::-1])
            assert await _take(board, len(payloads)) == payloads
            assert await _take(daemon, len(payloads)) == [p[::-1] for p in payloads]
        gone = await _next_event(events)
        assert gone == BoardGone("board-1", "offline", "mqtt")
        assert daemon.closed
        with pytest.raises(LinkClosedError):
            await daemon.send(b"x")


async def test_mqtt_will_reports_killed_board(mqtt_broker: MosquittoBroker) -> None:
    """A board process killed mid-run is reported gone by its Last Will."""
    cfg, topics = _mqtt_cfg(mqtt_broker.port), TopicMap(fleet="t")
    async with MqttTransport(cfg, topics) as transport:
        events = transport.events()
        await transport.wait_connected(5)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _BOARD_SCRIPT,
            str(mqtt_broker.port),
            "board-k",
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            while (await asyncio.wait_for(proc.stdout.readline(), 20)).strip() != b"ready":
                pass  # log lines before it
            appeared = await _next_event(events)
            assert isinstance(appeared, BoardAppeared) and appeared.board_id == "board-k"
            assert await _take(appeared.link, 1) == [b"hello from board-k"]
        finally:
            proc.kill()
            await proc.wait()
        gone = await _next_event(events, timeout=10)
        assert gone == BoardGone("board-k", "offline", "mqtt")


async def test_mqtt_reconnects_after_broker_restart(mqtt_broker: MosquittoBroker) -> None:
    """After the broker restarts, both sides reconnect, the board re-announces, messages flow."""
    cfg, topics = _mqtt_cfg(mqtt_broker.port), TopicMap(fleet="t")
    async with MqttTransport(cfg, topics) as transport:
        events = transport.events()
        async with MqttEndpoint(cfg, topics, "board-r") as board:
            appeared = await _next_event(events)
            assert isinstance(appeared, BoardAppeared)
            # The birth message goes out before the board subscribes: restart only once
            # its first session is whole, so that a reconnect is what the test counts.
            await board.connection.wait_connected(10)
            await mqtt_broker.arestart(down_s=0.2)
            sending = asyncio.create_task(board.send(b"sent during the outage"))
            await asyncio.wait_for(_reconnected(transport.connection, board.connection), 10)
            await sending  # the publish waited for the reconnect instead of failing
            await appeared.link.send(b"after the restart")
            assert await _take(board, 1) == [b"after the restart"]
            assert not appeared.link.closed


async def test_mqtt_forgotten_board_returns_on_message(mqtt_broker: MosquittoBroker) -> None:
    """A link the fleet closed (missed heartbeats) comes back when the live board speaks."""
    cfg, topics = _mqtt_cfg(mqtt_broker.port), TopicMap(fleet="t")
    async with MqttTransport(cfg, topics) as transport:
        events = transport.events()
        async with MqttEndpoint(cfg, topics, "board-f") as board:
            first = await _next_event(events)
            assert isinstance(first, BoardAppeared)
            await first.link.close("heartbeat")
            assert await _next_event(events) == BoardGone("board-f", "heartbeat", "mqtt")
            await board.send(b"still here")
            again = await _next_event(events)
            assert isinstance(again, BoardAppeared) and again.link is not first.link
            assert await _take(again.link, 1) == [b"still here"]


async def test_mqtt_retries_a_connect_the_broker_never_answers() -> None:
    """A broker that accepts the socket and never sends CONNACK (one that is restarting)
    costs one attempt of connect_timeout_s, then the connection tries again."""
    attempts = 0
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal attempts
        attempts += 1
        held.append(writer)  # keep the socket open and say nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = MqttConfig(
        port=port,
        reconnect_min_s=0.05,
        reconnect_max_s=0.1,
        connect_timeout_s=0.3,
        send_timeout_s=30.0,
    )
    connection = MqttConnection(cfg, "patient")
    runner = asyncio.create_task(connection.run())
    try:
        async with asyncio.timeout(5):
            while attempts < 3:
                await asyncio.sleep(0.05)
        assert not connection.connected
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_mqtt_send_times_out_without_broker() -> None:
    """With no broker at all, a send fails with SendTimeoutError after send_timeout_s."""
    cfg = MqttConfig(
        port=free_port(), reconnect_min_s=0.05, reconnect_max_s=0.1, send_timeout_s=0.3
    )
    async with MqttEndpoint(cfg, TopicMap(fleet="t"), "lonely") as board:
        with pytest.raises(SendTimeoutError):
            await board.send(b"nobody listens")


async def test_serial_glob_finds_new_ports(tmp_path: Path) -> None:
    """A glob pattern picks up ports present at start and ports plugged in later."""
    ptys = [Pty(), Pty()]
    (tmp_path / "stlink-a").symlink_to(ptys[0].path)
    try:
        async with SerialTransport(
            [str(tmp_path / "stlink-*")], reopen_interval=0.05, **FAST
        ) as transport:
            events = transport.events()
            async with SerialLink("a", FdStream(ptys[0].master), **FAST):
                first = await _next_event(events)
                assert first.board_id == f"serial:{tmp_path / 'stlink-a'}"
                (tmp_path / "stlink-b").symlink_to(ptys[1].path)
                async with SerialLink("b", FdStream(ptys[1].master), **FAST) as board_b:
                    second = await _next_event(events)
                    assert isinstance(second, BoardAppeared)
                    assert second.board_id == f"serial:{tmp_path / 'stlink-b'}"
                    await board_b.send(b"b here")
                    assert await _take(second.link, 1) == [b"b here"]
    finally:
        for pty in ptys:
            pty.close()


async def test_mqtt_daemon_state_retained(mqtt_broker: MosquittoBroker) -> None:
    """The daemon's retained state says online (with its job) while up and offline after."""
    import aiomqtt

    from qsched.protocol.control import DaemonPresence

    cfg, topics = _mqtt_cfg(mqtt_broker.port), TopicMap(fleet="t")

    async def retained_state() -> DaemonPresence:
        async with aiomqtt.Client("127.0.0.1", mqtt_broker.port) as client:
            await client.subscribe(topics.daemon_state(), qos=1)
            message = await asyncio.wait_for(anext(aiter(client.messages)), 5)
            assert message.retain
            return DaemonPresence.model_validate_json(message.payload)  # type: ignore[arg-type]

    async with MqttTransport(cfg, topics, version="0.1.0") as transport:
        await transport.wait_connected(5)
        await transport.publish_state("job-7")
        state = await retained_state()
        assert state.online and state.job == "job-7" and state.version == "0.1.0"
    assert not (await retained_state()).online


def _self_signed(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "broker.pem", folder / "broker.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_mqtt_tls_and_password(tmp_path: Path) -> None:
    """Over TLS with a password the board connects; a wrong password keeps it out."""
    cert, key = await asyncio.to_thread(_self_signed, tmp_path)
    topics = TopicMap(fleet="t")
    async with MosquittoBroker(users={"qsched": "right"}, tls=(cert, key)) as broker:
        tls = TlsConfig(enabled=True, ca_file=cert)
        good = _mqtt_cfg(broker.port).model_copy(
            update={"tls": tls, "username": "qsched", "password": SecretStr("right")}
        )
        async with (
            MqttTransport(good, topics) as transport,
            MqttEndpoint(good, topics, "secure-1") as board,
        ):
            events = transport.events()
            appeared = await _next_event(events)
            await board.send(b"encrypted")
            assert await _take(appeared.link, 1) == [b"encrypted"]
        bad = good.model_copy(update={"password": SecretStr("wrong")})
        async with MqttEndpoint(bad, topics, "intruder") as intruder:
            with pytest.raises(TimeoutError):
                await intruder.wait_connected(0.5)
        plain = good.model_copy(update={"tls": TlsConfig()})
        async with MqttEndpoint(plain, topics, "plaintext") as board:
            with pytest.raises(TimeoutError):
                await board.wait_connected(0.5)


def test_mqtt_missing_certificate_fails_at_construction(tmp_path: Path) -> None:
    """A TLS CA file that does not exist is an error when the link is built, not later."""
    cfg = MqttConfig(tls=TlsConfig(enabled=True, ca_file=tmp_path / "missing.pem"))
    with pytest.raises(FileNotFoundError):
        MqttEndpoint(cfg, TopicMap(fleet="t"), "b")


async def test_mqtt_publish_is_written_at_once_on_the_loops_thread(
    mqtt_broker: MosquittoBroker,
) -> None:
    """A packet queued on the event loop's thread goes to the socket before the call
    returns (nothing is left for a writer a loop turn later); queued from another
    thread it is left to aiomqtt's writer, which sends it."""
    cfg, topics = _mqtt_cfg(mqtt_broker.port), TopicMap(fleet="t")
    async with MqttTransport(cfg, topics) as transport, MqttEndpoint(cfg, topics, "b") as board:
        await transport.wait_connected(5)
        await board.wait_connected(5)
        client = board.connection._client
        assert client is not None
        # The aiomqtt in use keeps what the fast paths read (MqttConnection._messages too).
        assert isinstance(client._queue, asyncio.Queue)
        assert isinstance(client._disconnected, asyncio.Future)
        paho = client._client
        paho.publish(topics.board_out("b"), b"now", qos=1)
        assert not paho.want_write()
        await asyncio.to_thread(paho.publish, topics.board_out("b"), b"later", qos=1)
        async with asyncio.timeout(5):
            while paho.want_write():
                await asyncio.sleep(0.01)


async def test_mqtt_messages_reach_handlers_in_order_until_the_connection_ends() -> None:
    """The connection reads the client's queue itself: every message queued before the
    connection ended is handled, in order, and then the session ends with the error
    aiomqtt's iterator raised; a reader waiting on an empty queue wakes when it ends."""
    import aiomqtt

    class Client:  # the two things a session reads from aiomqtt's client
        def __init__(self) -> None:
            self._queue: asyncio.Queue[Any] = asyncio.Queue()
            self._disconnected: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    seen: list[bytes] = []

    async def handler(message: aiomqtt.Message) -> None:
        seen.append(message.payload)  # type: ignore[arg-type]

    connection = MqttConnection(_mqtt_cfg(1), "t")
    connection.subscribe("a/#", 1, handler)
    client = Client()
    for i in range(3):
        client._queue.put_nowait(aiomqtt.Message(f"a/{i}", bytes([i]), 1, False, i, None))
    client._disconnected.set_exception(aiomqtt.MqttError("lost"))
    with pytest.raises(aiomqtt.MqttError, match="Disconnected"):
        await connection._messages(client)  # type: ignore[arg-type]
    assert seen == [b"\x00", b"\x01", b"\x02"]

    client = Client()
    session = asyncio.create_task(connection._messages(client))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    client._queue.put_nowait(aiomqtt.Message("a/x", b"x", 1, False, 9, None))
    await asyncio.sleep(0.01)
    client._disconnected.set_result(None)
    with pytest.raises(aiomqtt.MqttError):
        await asyncio.wait_for(session, 2)
    assert seen[-1] == b"x"


async def test_mqtt_messages_of_a_client_without_the_known_queue_use_its_iterator() -> None:
    """An aiomqtt whose client keeps no ``_queue``/``_disconnected`` (another version) is
    read through its public message iterator, in order, until it ends."""
    import aiomqtt

    class Client:
        async def _iterate(self) -> AsyncIterator[aiomqtt.Message]:
            for i in range(3):
                yield aiomqtt.Message(f"a/{i}", bytes([i]), 1, False, i, None)

        @property
        def messages(self) -> AsyncIterator[aiomqtt.Message]:
            return self._iterate()

    seen: list[bytes] = []

    async def handler(message: aiomqtt.Message) -> None:
        seen.append(message.payload)  # type: ignore[arg-type]

    connection = MqttConnection(_mqtt_cfg(1), "t")
    connection.subscribe("a/#", 1, handler)
    await connection._messages(Client())  # type: ignore[arg-type]
    assert seen == [b"\x00", b"\x01", b"\x02"]
