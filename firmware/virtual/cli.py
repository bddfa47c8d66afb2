"""``qsched board``: virtual STM32N6 boards on serial ports or on an MQTT broker.

    qsched board --serial /dev/pts/7                          # one board behind a pty
    qsched board --mqtt 127.0.0.1:1883 --count 32             # 32 boards, board-00..31
    qsched board --mqtt broker:8883 --tls --fleet lab --count 4 --speed 1,0.5 \\
                 --model-latency mobilenetv2-0.35-128 --fault drop:0.05 --fault crash-at-step:40

Each board is a ``BoardAgent`` served on its own link: one MQTT client per board (its
own birth and Last Will), or one serial port per board. The process runs until it is
interrupted (SIGINT, SIGTERM) or, with serial ports only, until every port is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from qsched.firmware.virtual.board import (
    HEARTBEAT_INTERVAL_S,
    MODEL_LATENCIES,
    BoardAgent,
    DatasetCatalog,
    LatencyProfile,
    serve_link,
)
from qsched.firmware.virtual.clock import run_precise
from qsched.firmware.virtual.faults import CorruptingStream, FaultError, FaultPlan
from qsched.firmware.virtual.latency import DK_BAUD
from qsched.protocol.links.base import cancel_until_done
from qsched.protocol.messages import PROTOCOL_VERSION

__all__ = ["board_ids", "build_parser", "main", "parse_speeds"]

EXIT_USAGE = 2
SHUTDOWN_TIMEOUT_S = 10.0
_log = structlog.get_logger("qsched.firmware.board")


def parse_speeds(text: str) -> list[float]:
    """``"1,0.5,2"`` -> ``[1.0, 0.5, 2.0]``; boards take them in turn.

    Raises:
        ValueError: a value that is not a positive number.
    """
    speeds = [float(part) for part in text.split(",")]
    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"speeds must be positive numbers, got {text!r}")
    return speeds


def board_ids(count: int, prefix: str = "board", explicit: str | None = None) -> list[str]:
    """Board ids: ``explicit`` for one board, else ``<prefix>-00`` ... (width >= 2).

    Raises:
        ValueError: an explicit id with more than one board.
    """
    if explicit is not None:
        if count != 1:
            raise ValueError("--id names one board; use --id-prefix with --count")
        return [explicit]
    width = max(2, len(str(count - 1)))
    return [f"{prefix}-{i:0{width}d}" for i in range(count)]


def build_parser() -> argparse.ArgumentParser:
    """The ``qsched board`` argument parser."""
    p = argparse.ArgumentParser(prog="qsched board", description="Run virtual STM32N6 boards.")
    where = p.add_argument_group("link (one of)")
    where.add_argument(
        "--serial",
        action="append",
        default=[],
        metavar="DEVICE",
        help="serve one board on this serial device (repeatable)",
    )
    where.add_argument(
        "--mqtt", metavar="HOST:PORT", help="serve --count boards on this MQTT broker"
    )
    mqtt = p.add_argument_group("MQTT")
    mqtt.add_argument("--fleet", default="default", help="fleet name (topic level)")
    mqtt.add_argument("--prefix", default="qsched/v1", help="topic prefix")
    mqtt.add_argument("--username")
    mqtt.add_argument("--password", help="also $QSCHED_MQTT_PASSWORD")
    mqtt.add_argument("--mqtt-protocol", choices=["3.1.1", "5"], default="5")
    mqtt.add_argument(
        "--host-uplink",
        action="store_true",
        help="send what this process's boards send as one batch per moment on one host "
        "topic (the daemon's work grows with hosts, not boards)",
    )
    mqtt.add_argument(
        "--no-fleet-topic",
        action="store_true",
        help="take every message on the board's own topic, as a board from before "
        "step orders (SPEC 6.9)",
    )
    mqtt.add_argument("--tls", action="store_true", help="connect with TLS")
    mqtt.add_argument("--tls-ca", type=Path, help="CA bundle (default: system CAs)")
    mqtt.add_argument("--tls-cert", type=Path, help="client certificate (mutual TLS)")
    mqtt.add_argument("--tls-key", type=Path, help="client key (mutual TLS)")
    mqtt.add_argument(
        "--tls-insecure", action="store_true", help="skip host name checks (testing only)"
    )
    ids = p.add_argument_group("boards")
    ids.add_argument("--count", type=int, default=1, help="boards in this process (MQTT)")
    ids.add_argument("--id", help="the board id (one board)")
    ids.add_argument("--id-prefix", default="board", help="ids are PREFIX-00, PREFIX-01, ...")
    ids.add_argument(
        "--dataset",
        action="append",
        default=[],
        metavar="NAME=SOURCE",
        help="hold an extra data set (a built-in name, .npz or folder); built-ins are held anyway",
    )
    timing = p.add_argument_group("timing")
    timing.add_argument(
        "--model-latency",
        default="computed",
        choices=["computed", "off", *MODEL_LATENCIES],
        help="whose NPU time to sleep: the computed model's, none, or a named model's",
    )
    timing.add_argument(
        "--macs", type=int, help="MACs per inference to model (overrides --model-latency)"
    )
    timing.add_argument(
        "--speed",
        default="1",
        help="throughput multiplier; a comma list is dealt to boards in turn",
    )
    timing.add_argument(
        "--baud", type=int, default=DK_BAUD, help="serial line rate to model on serial links"
    )
    timing.add_argument(
        "--heartbeat", type=float, default=HEARTBEAT_INTERVAL_S, help="seconds between heartbeats"
    )
    faults = p.add_argument_group("faults")
    faults.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:ARGS",
        help="drop:P, delay:P:S, crash-at-step:N, corrupt:P, lie:P, bad-checksum:P "
        "(P a probability or step=N); repeatable",
    )
    faults.add_argument("--fault-seed", type=int, default=0, help="seed of the fault generators")
    return p


def _check(args: argparse.Namespace) -> str | None:
    if bool(args.serial) == bool(args.mqtt):
        return "give either --serial DEVICE (repeatable) or --mqtt HOST:PORT"
    if args.count < 1:
        return "--count must be at least 1"
    if args.serial and args.count != 1:
        return "--count applies to MQTT; give one --serial per board"
    if args.macs is not None and args.macs < 0:
        return "--macs must be non-negative"
    if args.heartbeat <= 0 or args.baud <= 0:
        return "--heartbeat and --baud must be positive"
    return None


def _latency(args: argparse.Namespace, speed: float, serial: bool) -> LatencyProfile:
    baud = args.baud if serial else None
    if args.macs is not None:
        return LatencyProfile(macs_per_forward=args.macs, speed=speed, baud=baud)
    return LatencyProfile.named(args.model_latency, speed=speed, baud=baud)


def _catalog(specs: Sequence[str]) -> DatasetCatalog:
    sources = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        sources[name] = source if sep else name
    return DatasetCatalog(sources)


def _agents(args: argparse.Namespace, count: int, serial: bool) -> list[BoardAgent]:
    speeds = parse_speeds(args.speed)
    plan = FaultPlan.parse(args.fault, args.fault_seed)
    catalog = _catalog(args.dataset)
    return [
        BoardAgent(
            board_id,
            datasets=catalog,
            latency=_latency(args, speeds[i % len(speeds)], serial),
            faults=plan.for_board(board_id),
        )
        for i, board_id in enumerate(board_ids(count, args.id_prefix, args.id))
    ]


def _mqtt_config(args: argparse.Namespace) -> Any:
    from pydantic import SecretStr

    from qsched.protocol.links.config import MqttConfig, TlsConfig, parse_host_port

    host, port = parse_host_port(args.mqtt)
    tls = TlsConfig(
        enabled=args.tls,
        ca_file=args.tls_ca,
        cert_file=args.tls_cert,
        key_file=args.tls_key,
        insecure=args.tls_insecure,
    )
    password = (
        args.password if args.password is not None else os.environ.get("QSCHED_MQTT_PASSWORD")
    )
    secret = SecretStr(password) if password is not None else None
    return MqttConfig(
        host=host,
        port=port,
        username=args.username,
        password=secret,
        tls=tls,
        protocol=args.mqtt_protocol,
        prefix=args.prefix,
    )


async def _serve_mqtt(
    agent: BoardAgent, cfg: Any, fleet: str, heartbeat: float, fleet_in: bool, uplink: Any
) -> str:
    from qsched.protocol.links.mqtt import MqttEndpoint
    from qsched.protocol.topics import TopicMap

    topics = TopicMap(prefix=cfg.prefix, fleet=fleet)
    async with MqttEndpoint(
        cfg,
        topics,
        agent.board_id,
        protocol_version=PROTOCOL_VERSION,
        fleet_in=fleet_in,
        uplink=uplink,
    ) as link:
        await link.wait_connected()
        reason: str = await serve_link(
            agent,
            link,
            heartbeat_interval=heartbeat,
            exit_on_crash=True,
            corrupt_payloads=True,
            connects=lambda: link.connection.connects,
        )
        return reason


async def _serve_serial(agent: BoardAgent, device: str, baud: int, heartbeat: float) -> str:
    from qsched.protocol.links.serial import SerialLink, SerialPortStream

    try:
        stream = await SerialPortStream.open(device, baud)
    except (OSError, ValueError) as exc:  # absent, busy, or not a tty
        _log.error("cannot open serial port", board=agent.board_id, device=device, error=str(exc))
        return "unavailable"
    wire = CorruptingStream(stream, agent.faults) if agent.faults.active else stream
    async with SerialLink(agent.board_id, wire) as link:
        reason: str = await serve_link(
            agent, link, heartbeat_interval=heartbeat, exit_on_crash=True
        )
        return reason


@contextlib.asynccontextmanager
async def _host_uplink(args: argparse.Namespace, cfg: Any, first: str) -> Any:
    """This process's ``HostUplink`` with ``--host-uplink`` (named after its first board)."""
    if cfg is None or not args.host_uplink:
        yield None
        return
    from qsched.protocol.links.mqtt import HostUplink
    from qsched.protocol.topics import TopicMap

    topics = TopicMap(prefix=cfg.prefix, fleet=args.fleet)
    async with HostUplink(cfg, topics, f"{first}-host") as uplink:
        yield uplink


async def _run(args: argparse.Namespace) -> int:
    serial = bool(args.serial)
    agents = _agents(args, len(args.serial) if serial else args.count, serial)
    cfg = None if serial else _mqtt_config(args)
    async with _host_uplink(args, cfg, agents[0].board_id) as uplink:
        return await _serve_all(args, agents, cfg, uplink)


async def _serve_all(
    args: argparse.Namespace, agents: list[BoardAgent], cfg: Any, uplink: Any
) -> int:
    serial = bool(args.serial)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runs: list[asyncio.Task[str]] = []
    for i, agent in enumerate(agents):
        if serial:
            coro = _serve_serial(agent, args.serial[i], args.baud, args.heartbeat)
        else:
            fleet_in = not args.no_fleet_topic
            coro = _serve_mqtt(agent, cfg, args.fleet, args.heartbeat, fleet_in, uplink)
        runs.append(asyncio.create_task(coro, name=f"board[{agent.board_id}]"))
    _log.info(
        "virtual boards running",
        boards=[a.board_id for a in agents],
        link="serial" if serial else f"mqtt {args.mqtt}",
    )
    stopping = asyncio.create_task(stop.wait(), name="board.signals")
    try:
        await asyncio.wait([*runs, stopping], return_when=asyncio.FIRST_COMPLETED)
        while not stop.is_set() and not all(t.done() for t in runs):
            await asyncio.wait([*runs, stopping], return_when=asyncio.FIRST_COMPLETED)
        _log.info("virtual boards stopping")
        await _cancel_all(runs)
    finally:
        stopping.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return _status(runs)


async def _cancel_all(tasks: list[asyncio.Task[str]]) -> None:
    """Cancel the boards until they are done (bounded: ``cancel_until_done``)."""
    pending = await cancel_until_done(tasks, SHUTDOWN_TIMEOUT_S)
    if pending:
        _log.error("boards did not stop", boards=sorted(t.get_name() for t in pending))


def _status(runs: list[asyncio.Task[str]]) -> int:
    status = 0
    for task in runs:
        if not task.done() or task.cancelled():
            continue
        exc = task.exception()
        if exc is not None:
            _log.error("board failed", board=task.get_name(), error=repr(exc))
            status = 1
        elif task.result() == "unavailable":
            status = 1
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qsched board``.

    Args:
        argv: the arguments after ``qsched board``.

    Returns:
        0 when stopped by a signal or when every serial port is gone; 1 when a serial
        port could not be opened; 2 on bad usage.
    """
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    problem = _check(args)
    if problem is None:
        try:
            parse_speeds(args.speed)
            FaultPlan.parse(args.fault, args.fault_seed)
            board_ids(len(args.serial) or args.count, args.id_prefix, args.id)
            if args.mqtt:
                _mqtt_config(args)
            if args.macs is None:
                LatencyProfile.named(args.model_latency)
        except (FaultError, ValueError) as exc:
            problem = str(exc)
    if problem is not None:
        parser.print_usage()
        print(f"qsched board: {problem}", file=sys.stderr)
        return EXIT_USAGE
    with contextlib.suppress(KeyboardInterrupt):
        # One MQTT connection or serial port a board, and a few more descriptors.
        return run_precise(_run(args), descriptors=len(args.serial) or args.count)
    return 0
