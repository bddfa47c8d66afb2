"""``qsched bridge``: this host's serial boards, exposed on an MQTT broker.

    qsched bridge --serial /dev/ttyACM0 --serial /dev/ttyACM1 --mqtt broker:1883
    qsched bridge --serial '/dev/qsched/stlink-*' --mqtt broker:1883 --fleet lab
    qsched bridge --serial '/dev/qsched/stlink-*' --aggregate lab-host-1

A fleet can span many hosts behind one broker: each host with USB boards runs a bridge,
one daemon somewhere trains on all of them. For every serial port the bridge opens the
link (COBS frames, acks, retransmission: ``SerialTransport``, which also reopens a port
after an unplug and watches glob patterns for new ones), learns the board's id from its
``Hello`` (asking with a soft ``Reset`` when the board said it before the port was
opened), and then acts as that board on MQTT: a birth message and a Last Will on the
board's presence topic, its data-plane messages relayed unchanged between the serial link
and ``boards/<id>/out`` / ``boards/<id>/in``. To the daemon a bridged board is an MQTT
board like any other; the bridge never decodes more than a Hello.

With ``--aggregate NAME`` the bridge presents all its boards as the one board ``NAME``
instead (``qsched.daemon.aggregate``): it fans each request out and folds the answers
into one, so the daemon's work grows with hosts rather than boards.

Settings (broker, TLS, credentials, prefix, fleet, ports) come from the daemon
configuration (``--config`` / ``$QSCHED_CONFIG``); the options override them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from typing import Any, Final

import structlog

from qsched.protocol.codec import decode, encode, peek_header
from qsched.protocol.errors import ProtocolError
from qsched.protocol.links.base import (
    INCOMING_QUEUE_SIZE,
    BoardAppeared,
    LinkClosedError,
    LinkError,
    cancel_until_done,
)
from qsched.protocol.messages import TYPE_CODES, Hello, Reset

__all__ = [
    "HELLO_ASK_AFTER_S",
    "HELLO_RETRY_S",
    "bridge_board",
    "main",
    "run_aggregate",
    "run_bridge",
]

_log = structlog.get_logger("qsched.bridge")

# A board that said nothing resembling a Hello this long after its port opened is asked
# for one (soft Reset), and again every HELLO_RETRY_S.
HELLO_ASK_AFTER_S: Final = 1.0
HELLO_RETRY_S: Final = 5.0
_HELLO_CODE: Final = TYPE_CODES[Hello]
_END: Final = b""  # the serial link ended (a real message is never empty)
SHUTDOWN_TIMEOUT_S: Final = 10.0


def _hello_of(data: bytes) -> Hello | None:
    """The Hello in ``data``, or None for any other (or undecodable) message."""
    try:
        if peek_header(data)[1] != _HELLO_CODE:
            return None
        msg = decode(data)
    except ProtocolError:
        return None
    return msg if isinstance(msg, Hello) else None


async def _pump(link: Any, queue: asyncio.Queue[bytes]) -> None:
    """Serial -> queue, ending with ``_END`` (the queue applies the link's back-pressure)."""
    try:
        async for data in link.incoming():
            await queue.put(data)
    finally:
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(_END)


async def _await_hello(
    link: Any, queue: asyncio.Queue[bytes], ask_after: float
) -> tuple[Hello, bytes] | None:
    """The board's next Hello (other messages dropped: no session exists yet); None: link gone."""
    wait = ask_after
    while True:
        try:
            data = await asyncio.wait_for(queue.get(), wait)
        except TimeoutError:
            _log.info("no hello from the board; asking for one", port=link.board_id)
            with contextlib.suppress(LinkError):
                await link.send(encode(Reset(scope="soft")))
            wait = HELLO_RETRY_S
            continue
        if data == _END:
            return None
        hello = _hello_of(data)
        if hello is not None:
            return hello, data


async def _downlink(endpoint: Any, link: Any) -> None:
    """MQTT -> serial, until either side ends."""
    async for data in endpoint.incoming():
        try:
            await link.send(data)
        except LinkClosedError:
            return
        except LinkError as exc:  # not acknowledged: the daemon re-asks after its deadline
            _log.warning("message to the board not delivered", port=link.board_id, error=str(exc))


async def _serve_as(
    hello: Hello,
    raw: bytes,
    link: Any,
    queue: asyncio.Queue[bytes],
    cfg: Any,
    topics: Any,
    uplink: Any,
) -> tuple[Hello, bytes] | None:
    """Act as ``hello.board_id`` on MQTT until the link ends (None) or a Hello names
    another board (returned, to serve that one instead)."""
    from qsched.protocol.links.mqtt import MqttEndpoint

    board = hello.board_id
    async with MqttEndpoint(
        cfg, topics, board, protocol_version=hello.protocol_version, uplink=uplink
    ) as endpoint:
        await endpoint.wait_connected()
        _log.info("board bridged", board=board, port=link.board_id, fleet=topics.fleet)
        down = asyncio.create_task(_downlink(endpoint, link), name=f"bridge[{board}].downlink")
        try:
            data = raw
            while data != _END:
                other = _hello_of(data) if data is not raw else None
                if other is not None and other.board_id != board:
                    _log.info("board renamed itself", old=board, new=other.board_id)
                    return other, data
                try:
                    await endpoint.send(data)
                except LinkError as exc:  # broker away longer than send_timeout_s
                    _log.warning(
                        "message from the board not delivered", board=board, error=str(exc)
                    )
                data = await queue.get()
            return None
        finally:
            down.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await down
            _log.info("board unbridged", board=board, port=link.board_id)


async def bridge_board(
    link: Any,
    cfg: Any,
    topics: Any,
    *,
    ask_after: float = HELLO_ASK_AFTER_S,
    uplink: Any = None,
) -> str:
    """Expose the board on one serial link as an MQTT board until the link ends.

    Args:
        link: an open serial link (``SerialLink``) to the board.
        cfg: the broker settings (``MqttConfig``).
        topics: the fleet's ``TopicMap``.
        ask_after: seconds to wait for a Hello before asking for one.
        uplink: the host's ``HostUplink``: the board's messages go up in its batches.

    Returns:
        ``"closed"`` once the serial link is gone (the board's presence is then offline).
    """
    queue: asyncio.Queue[bytes] = asyncio.Queue(INCOMING_QUEUE_SIZE)
    reader = asyncio.create_task(_pump(link, queue), name=f"bridge[{link.board_id}].uplink")
    try:
        got = await _await_hello(link, queue, ask_after)
        while got is not None:
            got = await _serve_as(*got, link, queue, cfg, topics, uplink)
        return "closed"
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def run_bridge(
    devices: Sequence[str],
    cfg: Any,
    topics: Any,
    *,
    baudrate: int = 921600,
    reopen_interval: float = 1.0,
    uplink: Any = None,
) -> None:
    """Bridge every port in ``devices`` (paths or glob patterns) until cancelled.

    Args:
        devices: serial ports; patterns are rescanned for new ports.
        cfg: the broker settings.
        topics: the fleet's topic map.
        baudrate: the ports' line speed.
        reopen_interval: seconds between attempts to (re)open a port.
        uplink: a ``HostUplink``: every board's messages go up in this host's batches.
    """
    from qsched.protocol.links.serial import SerialTransport

    bridges: set[asyncio.Task[str]] = set()
    async with SerialTransport(
        devices, baudrate=baudrate, reopen_interval=reopen_interval
    ) as transport:
        try:
            async for event in transport.events():
                if isinstance(event, BoardAppeared):
                    task = asyncio.create_task(
                        bridge_board(event.link, cfg, topics, uplink=uplink),
                        name=f"bridge[{event.board_id}]",
                    )
                    bridges.add(task)
                    task.add_done_callback(_finished)
                    task.add_done_callback(bridges.discard)
        finally:
            await _cancel_until_done(bridges)


class _QueuedLink:
    """A serial link whose incoming messages were already being pumped into a queue."""

    def __init__(self, link: Any, queue: asyncio.Queue[bytes], pump: asyncio.Task[None]) -> None:
        self.link, self.queue, self.pump = link, queue, pump
        self.board_id = link.board_id

    async def send(self, payload: bytes) -> None:
        await self.link.send(payload)

    async def incoming(self) -> Any:
        while (data := await self.queue.get()) != _END:
            yield data


async def _member(link: Any, ask_after: float) -> Any:
    """The board on ``link`` as a member of an aggregate, once it said Hello."""
    from qsched.daemon.aggregate import Member

    queue: asyncio.Queue[bytes] = asyncio.Queue(INCOMING_QUEUE_SIZE)
    pump = asyncio.create_task(_pump(link, queue), name=f"aggregate[{link.board_id}].pump")
    got = await _await_hello(link, queue, ask_after)
    if got is None:
        pump.cancel()
        raise LinkClosedError(link.board_id, "closed", "the port closed before a Hello")
    return Member(_QueuedLink(link, queue, pump), got[0])


async def run_aggregate(
    devices: Sequence[str],
    cfg: Any,
    topics: Any,
    name: str,
    *,
    baudrate: int = 921600,
    reopen_interval: float = 1.0,
    gather_s: float = 5.0,
    ask_after: float = HELLO_ASK_AFTER_S,
) -> str:
    """Serve the boards on ``devices`` as the one MQTT board ``name`` (``HostAggregator``).

    The members are the boards whose ports open within ``gather_s`` seconds (or, with
    no glob pattern, as soon as every port did) and say Hello.

    Returns:
        Why it stopped: ``"closed"`` or ``"members gone"``.
    """
    from qsched.daemon.aggregate import HostAggregator
    from qsched.protocol.links.mqtt import MqttEndpoint
    from qsched.protocol.links.serial import SerialTransport

    patterns = any(ch in d for d in devices for ch in "*?[")
    async with SerialTransport(
        devices, baudrate=baudrate, reopen_interval=reopen_interval
    ) as transport:
        links: list[Any] = []
        events = transport.events()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(gather_s):
                async for event in events:
                    if isinstance(event, BoardAppeared):
                        links.append(event.link)
                    if not patterns and len(links) == len(devices):
                        break
        if not links:
            raise LinkError(name, "no_boards", f"no serial board opened in {gather_s:.0f} s")
        members = await asyncio.gather(*(_member(link, ask_after) for link in links))
        aggregator = HostAggregator(name, members)
        async with MqttEndpoint(cfg, topics, name) as endpoint:
            await endpoint.wait_connected()
            _log.info("boards aggregated", host=name, members=[m.board_id for m in members])
            return await aggregator.serve(endpoint, lambda: endpoint.connection.connects)


def _finished(task: asyncio.Task[str]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.error("bridge task failed", task=task.get_name(), error=repr(task.exception()))


async def _cancel_until_done(tasks: set[asyncio.Task[str]]) -> None:
    """Cancel the bridges until they end (bounded: ``cancel_until_done``)."""
    pending = await cancel_until_done(tasks, SHUTDOWN_TIMEOUT_S)
    if pending:
        _log.error("bridges did not stop", tasks=sorted(t.get_name() for t in pending))


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qsched bridge", description="Expose this host's serial boards on MQTT."
    )
    p.add_argument(
        "--serial",
        action="append",
        default=[],
        metavar="DEVICE",
        help=(
            "a serial port or glob pattern "
            "(repeatable; default: the configuration's serial.devices)"
        ),
    )
    p.add_argument(
        "--mqtt",
        metavar="HOST:PORT",
        help="the broker (default: the configuration's mqtt.host/port)",
    )
    p.add_argument("--fleet", help="fleet name (default: the configuration's)")
    p.add_argument(
        "--baud", type=int, help="line speed (default: the configuration's serial.baudrate)"
    )
    p.add_argument(
        "--aggregate",
        metavar="NAME",
        help="present every board as the one board NAME: fan requests out, fold answers in",
    )
    p.add_argument(
        "--host-uplink",
        metavar="NAME",
        help="send the boards' messages up in batches on hosts/NAME/out (SPEC 8.1)",
    )
    return p


def _settings(args: argparse.Namespace) -> tuple[list[str], Any, Any, int, float]:
    from qsched.daemon.config import load_config
    from qsched.protocol.links.config import parse_host_port
    from qsched.protocol.topics import TopicMap

    config = load_config()
    mqtt = config.mqtt
    if args.mqtt is not None:
        host, port = parse_host_port(args.mqtt)
        mqtt = mqtt.model_copy(update={"host": host, "port": port})
    devices = args.serial or list(config.serial.devices)
    if not devices:
        raise ValueError(
            "no serial ports: give --serial DEVICE or set serial.devices in the configuration"
        )
    topics = TopicMap(prefix=mqtt.prefix, fleet=args.fleet or config.fleet)
    baud = args.baud if args.baud is not None else config.serial.baudrate
    if baud <= 0:
        raise ValueError("--baud must be positive")
    return devices, mqtt, topics, baud, config.serial.reopen_interval_s


async def _run(
    devices: list[str],
    mqtt: Any,
    topics: Any,
    baud: int,
    reopen: float,
    host: str | None,
    aggregate: str | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    _log.info(
        "bridge starting", ports=devices, broker=f"{mqtt.host}:{mqtt.port}", fleet=topics.fleet
    )
    try:
        if aggregate is not None:
            why = await run_aggregate(
                devices, mqtt, topics, aggregate, baudrate=baud, reopen_interval=reopen
            )
            _log.info("aggregate ended", host=aggregate, reason=why)
            return
        async with _uplink(mqtt, topics, host) as uplink:
            await run_bridge(
                devices, mqtt, topics, baudrate=baud, reopen_interval=reopen, uplink=uplink
            )
    except LinkError as exc:
        _log.error("bridge failed", reason=exc.reason, detail=exc.detail)
    except asyncio.CancelledError:
        _log.info("bridge stopping")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


@contextlib.asynccontextmanager
async def _uplink(mqtt: Any, topics: Any, host: str | None) -> Any:
    if host is None:
        yield None
        return
    from qsched.protocol.links.mqtt import HostUplink

    async with HostUplink(mqtt, topics, host) as uplink:
        yield uplink


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qsched bridge`` until SIGINT or SIGTERM.

    Args:
        argv: the arguments after ``qsched bridge``.

    Returns:
        0 when stopped by a signal; 2 on bad options.
    """
    args = _parser().parse_args(list(argv) if argv is not None else None)
    try:
        devices, mqtt, topics, baud, reopen = _settings(args)
        if args.host_uplink is not None:
            topics.host_out(args.host_uplink)  # one topic level, or ValueError now
        if args.aggregate is not None:
            topics.board_in(args.aggregate)  # a board id: one topic level, or ValueError now
            if args.host_uplink is not None:
                raise ValueError("--aggregate sends one board's messages: no --host-uplink")
    except ValueError as exc:
        print(f"qsched bridge: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run(devices, mqtt, topics, baud, reopen, args.host_uplink, args.aggregate))
    return 0
