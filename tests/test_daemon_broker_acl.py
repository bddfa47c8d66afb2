"""The shipped Mosquitto ACL on a real broker: boards speak only on their own topics,
only operators send commands, and only the daemon publishes state."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiomqtt
import pytest

from qsched.daemon.config import DaemonConfig
from qsched.daemon.ctl import send_command
from qsched.daemon.service import Daemon
from qsched.lab.broker import MosquittoBroker
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.topics import TopicMap

ACL = Path(__file__).resolve().parent.parent / "systemd" / "mosquitto" / "qsched.acl"
USERS = {"qsched-daemon": "d-secret", "alice": "a-secret", "board-07": "b-secret"}
TOPICS = TopicMap(fleet="acl")


@pytest.fixture
def broker() -> MosquittoBroker:
    with MosquittoBroker(users=USERS, acl_file=ACL) as started:
        yield started


def _mqtt(broker: MosquittoBroker, user: str) -> MqttConfig:
    return MqttConfig.model_validate(
        {"host": broker.host, "port": broker.port, "username": user, "password": USERS[user]}
    )


def _client(broker: MosquittoBroker, user: str, identifier: str) -> aiomqtt.Client:
    return aiomqtt.Client(
        broker.host, broker.port, username=user, password=USERS[user], identifier=identifier
    )


async def _seen(broker: MosquittoBroker, topic: str, publish: tuple[str, str, bytes]) -> bool:
    """Whether a message ``publish`` = (user, topic, payload) reaches a daemon subscriber."""
    async with _client(broker, "qsched-daemon", "watcher") as watcher:
        await watcher.subscribe(topic, qos=1)
        user, target, payload = publish
        async with _client(broker, user, f"sender-{user}") as sender:
            await sender.publish(target, payload, qos=1)
        try:
            async with asyncio.timeout(1.0):
                async for message in watcher.messages:
                    if message.payload == payload:
                        return True
        except TimeoutError:
            return False
    return False


async def test_acl_board_credentials_cannot_command_the_daemon(
    broker: MosquittoBroker, tmp_path: Path
) -> None:
    """A board's user cannot start or stop a job; an operator can; the daemon still runs."""
    user = "qsched-daemon"
    mqtt = {"host": broker.host, "port": broker.port, "username": user, "password": USERS[user]}
    cfg = DaemonConfig.model_validate({"state_dir": tmp_path, "fleet": "acl", "mqtt": mqtt})
    async with Daemon(cfg) as daemon:
        spec = {"name": "acl-job", "steps": 4000}
        async with _client(broker, "board-07", "board-07-as-operator") as board:
            await board.publish(
                TOPICS.control_request(), json.dumps({"type": "start_job", "spec": spec}), qos=1
            )
        await asyncio.sleep(1.0)
        assert daemon.job is None  # the broker dropped the board's command
        reply = await send_command(
            _mqtt(broker, "alice"), TOPICS, {"type": "start_job", "spec": spec}, 10
        )
        assert reply.ok and daemon.job is not None
        async with _client(broker, "board-07", "board-07-again") as board:
            await board.publish(TOPICS.control_request(), '{"type": "stop"}', qos=1)
        await asyncio.sleep(1.0)
        assert daemon.job.engine.job_state in ("pending", "running")
        assert (await send_command(_mqtt(broker, "alice"), TOPICS, {"type": "stop"}, 10)).ok


@pytest.mark.parametrize(
    ("user", "topic", "allowed"),
    [
        ("board-07", TOPICS.board_out("board-07"), True),  # its own output
        ("board-07", TOPICS.board_out("board-08"), False),  # another board's
        ("board-07", TOPICS.board_in("board-08"), False),  # a board's input
        ("board-07", TOPICS.daemon_state(), False),  # the daemon's state
        ("alice", f"{TOPICS.base}/status", False),  # only the daemon publishes status
        ("alice", TOPICS.board_in("board-07"), False),
    ],
)
async def test_acl_who_may_publish_where(
    broker: MosquittoBroker, user: str, topic: str, allowed: bool
) -> None:
    """Each client publishes only where the ACL lets it (checked by what arrives)."""
    payload = f"{user}->{topic}".encode()
    assert await _seen(broker, topic, (user, topic, payload)) is allowed
