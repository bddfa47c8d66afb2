"""Control API over a real Mosquitto: every command, valid or not, gets exactly one reply."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiomqtt
import pytest

from qsched.daemon.config import DaemonConfig
from qsched.daemon.ctl import send_command
from qsched.daemon.service import Daemon, status_topic
from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
from qsched.lab.broker import MosquittoBroker
from qsched.protocol.control import StatusReport
from qsched.protocol.links.inproc import InProcTransport

# Long enough that the job is still running when the last command (stop) arrives, on any
# machine: at 400 steps a fast machine finished it first.
SPEC = {"name": "ctl-job", "steps": 100_000, "eval_every": 50, "batch_size": 16}
REPLIES_TIMEOUT_S = 30.0  # how long _exchange waits for one reply per document


@contextlib.asynccontextmanager
async def _daemon(
    broker: MosquittoBroker, state: Path, boards: int = 2, protocol: str = "5"
) -> AsyncIterator[Daemon]:
    cfg = DaemonConfig.model_validate(
        {
            "state_dir": state,
            "fleet": "ctl",
            "mqtt": {"host": broker.host, "port": broker.port, "protocol": protocol},
        }
    )
    inproc = InProcTransport()
    async with Daemon(cfg, transports=[inproc]) as daemon:
        endpoints = [inproc.attach(f"b{i}") for i in range(boards)]
        served = [
            asyncio.create_task(serve_link(BoardAgent(f"b{i}", latency=LatencyProfile.off()), e))
            for i, e in enumerate(endpoints)
        ]
        await daemon._mqtt.wait_connected(10)
        try:
            yield daemon
        finally:
            for endpoint in endpoints:
                await endpoint.close()
            await asyncio.gather(*served, return_exceptions=True)


async def _exchange(
    broker: MosquittoBroker, documents: list[str], settle: float = 1.5
) -> list[dict[str, object]]:
    """Publish raw documents as a 3.1.1 client; return every reply seen on control/reply:
    once there are as many as documents (or after REPLIES_TIMEOUT_S), plus ``settle``
    seconds for any extra one."""
    replies: list[dict[str, object]] = []
    async with aiomqtt.Client(
        broker.host, broker.port, protocol=aiomqtt.ProtocolVersion.V311
    ) as client:
        await client.subscribe("qsched/v1/ctl/control/reply", qos=1)

        async def collect() -> None:
            async for message in client.messages:
                replies.append(json.loads(message.payload))  # type: ignore[arg-type]

        async def replies_reach(count: int) -> None:
            # Waits on the replies, not a fixed time: a busy machine answers late.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REPLIES_TIMEOUT_S):
                    while len(replies) < count:
                        await asyncio.sleep(0.02)

        reader = asyncio.create_task(collect())
        for sent, document in enumerate(documents, start=1):
            await client.publish("qsched/v1/ctl/control/request", document, qos=1)
            if "start_job" in document:  # a start builds the job's workload first
                await replies_reach(sent)
            else:
                await asyncio.sleep(0.05)
        await replies_reach(len(documents))
        await asyncio.sleep(settle)
        reader.cancel()
    return replies


async def test_control_every_command_one_reply(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """Valid and malformed commands each get exactly one reply, ok or a typed error."""
    documents = {
        "s1": {"type": "status"},
        "b1": {"type": "list_boards"},
        "p0": {"type": "pause"},
        "j1": {"type": "start_job", "spec": SPEC},
        "j2": {"type": "start_job", "spec": {**SPEC, "name": "other"}},
        "p1": {"type": "pause", "job": "ctl-job"},
        "p2": {"type": "pause"},
        "u0": {"type": "pause", "job": "nope"},
        "c1": {"type": "checkpoint"},
        "r1": {"type": "resume"},
        "cp": {"type": "change_policy", "policy": {"name": "fixed", "config": {"q": 4}}},
        "cx": {"type": "change_policy", "policy": {"name": "no-such-policy"}},
        "d1": {"type": "drain_board", "board_id": "b1"},
        "d2": {"type": "drain_board", "board_id": "ghost"},
        "e1": {"type": "export", "format": "npz"},
        "x1": {"type": "stop"},
    }
    expected = {
        "s1": True,
        "b1": True,
        "p0": "no_job",
        "j1": True,
        "j2": "conflict",
        "p1": True,
        "p2": "conflict",
        "u0": "unknown_job",
        "c1": True,
        "r1": True,
        "cp": True,
        "cx": "invalid_command",
        "d1": True,
        "d2": "unknown_board",
        "e1": True,
        "x1": True,
    }
    raw = [json.dumps({**doc, "request_id": rid}) for rid, doc in documents.items()]
    malformed = [
        "not json at all",
        json.dumps({"type": "launch_missiles", "request_id": "m1"}),
        json.dumps({"type": "status", "request_id": "m2", "extra": 1}),
        json.dumps({"type": "drain_board", "request_id": "m3"}),
        json.dumps([1, 2, 3]),
    ]
    async with _daemon(mqtt_broker, tmp_path):
        replies = await _exchange(mqtt_broker, raw + malformed)
    by_id: dict[object, list[dict[str, object]]] = {}
    for reply in replies:
        by_id.setdefault(reply.get("request_id"), []).append(reply)
    for rid, outcome in expected.items():
        assert len(by_id.get(rid, [])) == 1, f"{rid}: {by_id.get(rid)}"
        reply = by_id[rid][0]
        assert reply["ok"] is True if outcome is True else reply["code"] == outcome, (
            f"{rid}: {reply}"
        )
    for rid in ("m1", "m2", "m3"):
        assert [r["code"] for r in by_id[rid]] == ["invalid_command"]
    assert len(by_id.get(None, [])) == 2  # the two documents without a readable request_id
    assert len(replies) == len(raw) + len(malformed)


async def test_control_mqtt5_correlation_and_retained_status(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """MQTT 5 clients get the reply on their response topic; the status is retained."""
    async with _daemon(mqtt_broker, tmp_path) as daemon:
        cfg = daemon.config.mqtt
        reply = await send_command(
            cfg, daemon.topics, {"type": "start_job", "spec": {**SPEC, "steps": 20}}, 10
        )
        assert reply.ok and reply.job is not None and reply.job.name == "ctl-job"
        for _ in range(100):
            if daemon.job is not None and daemon.job.engine.job_state == "completed":
                break
            await asyncio.sleep(0.1)
        status = await send_command(cfg, daemon.topics, {"type": "status"}, 10)
        assert status.ok and status.status is not None and status.status.job is not None
        assert status.status.job.state == "completed" and status.status.job.step == 20
        await asyncio.sleep(1.2)  # the status loop publishes at least once a second
        async with aiomqtt.Client(mqtt_broker.host, mqtt_broker.port) as client:
            await client.subscribe(status_topic(daemon.topics), qos=1)
            message = await asyncio.wait_for(anext(aiomqtt_messages(client)), 5)
        retained = StatusReport.model_validate_json(message.payload)  # type: ignore[arg-type]
        assert message.retain and retained.job is not None and retained.job.state == "completed"
        assert (tmp_path / "jobs" / "ctl-job" / "export" / "ctl-job.tflite").exists()


async def aiomqtt_messages(client: aiomqtt.Client) -> AsyncIterator[aiomqtt.Message]:
    """The client's messages as an async iterator usable with ``anext``."""
    async for message in client.messages:
        yield message


@pytest.mark.parametrize("protocol", ["3.1.1"])
async def test_control_ctl_request_id_for_311(
    mqtt_broker: MosquittoBroker, tmp_path: Path, protocol: str
) -> None:
    """``send_command`` over MQTT 3.1.1 matches the reply by request_id on the default topic."""
    async with _daemon(mqtt_broker, tmp_path, protocol=protocol) as daemon:
        reply = await send_command(daemon.config.mqtt, daemon.topics, {"type": "list_boards"}, 10)
    assert reply.ok and reply.request_id and reply.boards is not None
    assert sorted(b.board_id for b in reply.boards) == ["b0", "b1"]
