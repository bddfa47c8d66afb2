"""``qsched ctl``: send one control command to a running daemon and print its reply.

    qsched ctl --mqtt 127.0.0.1:1883 status
    qsched ctl start job.toml --set steps=200
    qsched ctl pause | resume | stop [JOB]
    qsched ctl checkpoint [JOB]
    qsched ctl policy qscheduler --config '{"qmax": 64}'
    qsched ctl boards
    qsched ctl drain board-07 [--undo]
    qsched ctl export [JOB] --format npz
    qsched ctl raw '{"type": "status"}'
    qsched ctl events            # follow the event feed

With MQTT 5 (the default) the command carries a response topic private to this client
and correlation data; with ``--protocol 3.1.1`` it carries a ``request_id`` and the
reply is read from ``<prefix>/<fleet>/control/reply``. Exit status: 0 ok, 1 an error
reply, 2 usage, 3 no reply in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Final

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from qsched.daemon.config import load_config
from qsched.daemon.errors import CtlError
from qsched.daemon.specfile import load_spec_data
from qsched.protocol.control import ErrorReply, Reply, parse_command, parse_control
from qsched.protocol.errors import ProtocolError
from qsched.protocol.links.config import MqttConfig, parse_host_port
from qsched.protocol.links.mqtt import build_client
from qsched.protocol.topics import TopicMap

__all__ = ["EXIT_NO_REPLY", "CtlError", "build_command", "main", "send_command"]

EXIT_NO_REPLY: Final = 3
DEFAULT_TIMEOUT_S: Final = 30.0


async def send_command(
    cfg: MqttConfig, topics: TopicMap, command: dict[str, Any], timeout: float = DEFAULT_TIMEOUT_S
) -> Reply | ErrorReply:
    """Publish one command and wait for its one reply.

    Args:
        cfg: the broker (its ``protocol`` picks MQTT 5 properties or ``request_id``).
        topics: the fleet's topic map.
        command: the command document (validated here first).
        timeout: seconds to wait for the reply.

    Returns:
        The reply.

    Raises:
        CtlError: the document is not a valid command, or no reply came in time.
    """
    token = uuid.uuid4().hex
    document = dict(command)
    v5 = cfg.protocol == "5"
    if not v5:
        document.setdefault("request_id", token)
    payload = json.dumps(document)
    try:
        parse_command(payload)
    except ProtocolError as exc:
        raise CtlError(f"not a valid command: {exc}") from exc
    reply_topic = f"{topics.control_reply()}/{token}" if v5 else topics.control_reply()
    try:
        async with build_client(cfg, f"qsched-ctl-{token[:12]}") as client:
            await client.subscribe(reply_topic, qos=1)
            properties = None
            if v5:
                properties = Properties(PacketTypes.PUBLISH)
                properties.ResponseTopic = reply_topic
                properties.CorrelationData = token.encode()
            await client.publish(topics.control_request(), payload, qos=1, properties=properties)
            return await asyncio.wait_for(
                _await_reply(client, token, document.get("request_id"), v5), timeout
            )
    except TimeoutError as exc:
        raise CtlError(
            f"no reply within {timeout:.0f} s (is the daemon running on this fleet?)"
        ) from exc
    except aiomqtt.MqttError as exc:
        raise CtlError(f"broker {cfg.host}:{cfg.port}: {exc}") from exc


async def _await_reply(
    client: aiomqtt.Client, token: str, request_id: str | None, v5: bool
) -> Reply | ErrorReply:
    async for message in client.messages:
        try:
            reply = parse_control(message.payload)
        except ProtocolError:
            continue
        if not isinstance(reply, Reply | ErrorReply):
            continue
        if v5:
            correlation = getattr(message.properties, "CorrelationData", None)
            if correlation == token.encode():
                return reply
        elif reply.request_id == request_id:
            return reply
    raise CtlError("the broker closed the connection")


def _policy_config(text: str) -> dict[str, Any]:
    config = json.loads(text)
    if not isinstance(config, dict):
        raise ValueError("a policy configuration is a JSON object")
    return config


def build_command(args: argparse.Namespace) -> dict[str, Any]:
    """The command document for parsed ``qsched ctl`` arguments."""
    name = args.action
    job = {"job": args.job} if getattr(args, "job", None) else {}
    if name == "start":
        return {"type": "start_job", "spec": load_spec_data(args.spec, args.set)}
    if name in ("pause", "resume", "stop", "checkpoint"):
        return {"type": name, **job}
    if name == "status":
        return {"type": "status", **job}
    if name == "boards":
        return {"type": "list_boards"}
    if name == "drain":
        return {"type": "drain_board", "board_id": args.board, "drain": not args.undo}
    if name == "policy":
        return {
            "type": "change_policy",
            "policy": {"name": args.name, "config": _policy_config(args.policy_config)},
            **job,
        }
    if name == "export":
        return {"type": "export", "format": args.format, **job}
    if name == "raw":
        document = json.loads(args.document)
        if not isinstance(document, dict):
            raise ValueError("a command is a JSON object")
        return document
    raise ValueError(f"unknown action {name!r}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qsched ctl", description="Send a command to a running daemon."
    )
    parser.add_argument("--config", type=Path, help="daemon configuration (broker, fleet)")
    parser.add_argument("--mqtt", metavar="HOST:PORT", help="broker address")
    parser.add_argument("--fleet", help="fleet name")
    parser.add_argument(
        "--protocol", choices=["3.1.1", "5"], help="MQTT version (default: the configuration's)"
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    sub = parser.add_subparsers(dest="action", required=True)
    start = sub.add_parser("start", help="start a job from a spec (JSON or TOML)")
    start.add_argument(
        "spec", type=Path, nargs="?", help="job spec file (.json or .toml); default: all defaults"
    )
    start.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field (dotted keys nest)",
    )
    for name in ("pause", "resume", "stop", "checkpoint"):
        sub.add_parser(name, help=f"{name} the job").add_argument("job", nargs="?")
    status = sub.add_parser("status", help="the daemon's status (with JOB: that job's)")
    status.add_argument("job", nargs="?", help="any job the daemon keeps (default: the loaded one)")
    sub.add_parser("boards", help="list the fleet")
    drain = sub.add_parser("drain", help="stop giving a board work")
    drain.add_argument("board")
    drain.add_argument("--undo", action="store_true", help="give it work again")
    policy = sub.add_parser("policy", help="change the job's q policy")
    policy.add_argument(
        "name", help="a registered policy (fixed, qscheduler, linear, power, variance, ...)"
    )
    # Its own dest: the top-level --config names the daemon's configuration file.
    policy.add_argument(
        "--config", dest="policy_config", default="{}", help="the policy's configuration (JSON)"
    )
    policy.add_argument("--job", help="the job (default: the current one)")
    export = sub.add_parser("export", help="export the job's model")
    export.add_argument("job", nargs="?")
    export.add_argument("--format", choices=["tflite", "npz"], default="tflite")
    raw = sub.add_parser("raw", help="send a JSON command as it is")
    raw.add_argument("document")
    sub.add_parser("events", help="print the event feed until interrupted")
    return parser


def _settings(args: argparse.Namespace) -> tuple[MqttConfig, TopicMap]:
    cfg = load_config(args.config)
    mqtt = cfg.mqtt.model_dump()
    if args.mqtt:
        mqtt["host"], mqtt["port"] = parse_host_port(args.mqtt)
    if args.protocol:
        mqtt["protocol"] = args.protocol
    mqtt["password"] = cfg.mqtt.password
    fleet = args.fleet or cfg.fleet
    return MqttConfig.model_validate(mqtt), TopicMap(prefix=cfg.mqtt.prefix, fleet=fleet)


async def _follow_events(cfg: MqttConfig, topics: TopicMap) -> int:
    async with build_client(cfg, f"qsched-ctl-{uuid.uuid4().hex[:12]}") as client:
        await client.subscribe(topics.events(), qos=0)
        async for message in client.messages:
            payload = message.payload
            print(
                payload.decode() if isinstance(payload, bytes | bytearray) else payload, flush=True
            )
    return 0


def _events(cfg: MqttConfig, topics: TopicMap) -> int:
    try:
        return asyncio.run(_follow_events(cfg, topics))
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `qsched ctl events | head`: the reader is done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except aiomqtt.MqttError as exc:
        print(f"qsched ctl: broker {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        return EXIT_NO_REPLY


def main(argv: list[str]) -> int:
    """``qsched ctl``: one command, one reply on standard output (JSON).

    Args:
        argv: the options (see ``--help``).

    Returns:
        0 for an ok reply, 1 for an error reply, 2 for bad usage, 3 without a reply.
    """
    args = _parser().parse_args(argv)
    try:
        cfg, topics = _settings(args)
    except ValueError as exc:
        print(f"qsched ctl: {exc}", file=sys.stderr)
        return 2
    if args.action == "events":
        return _events(cfg, topics)
    try:
        command = build_command(args)
    except (ValueError, OSError) as exc:
        print(f"qsched ctl: {exc}", file=sys.stderr)
        return 2
    try:
        reply = asyncio.run(send_command(cfg, topics, command, args.timeout))
    except CtlError as exc:
        print(f"qsched ctl: {exc}", file=sys.stderr)
        return 2 if "not a valid command" in str(exc) else EXIT_NO_REPLY
    print(reply.model_dump_json(indent=2, exclude_none=True))
    return 0 if reply.ok else 1
