"""Documents that used to stop or wedge the daemon: each gets one typed reply, and the
daemon keeps serving (real Mosquitto, MQTT 5 and 3.1.1 clients)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from test_daemon_control import SPEC, _daemon, _exchange

from qsched.daemon.ctl import send_command
from qsched.lab.broker import MosquittoBroker
from qsched.policies import MAX_Q
from qsched.protocol.codec import decode, encode
from qsched.protocol.control import BoardPresence
from qsched.protocol.messages import Error, Hello

REQUEST = "qsched/v1/ctl/control/request"
REPLY = "qsched/v1/ctl/control/reply"


async def _alive(daemon: object, broker: MosquittoBroker) -> None:
    """The daemon still answers a status command."""
    status = await send_command(daemon.config.mqtt, daemon.topics, {"type": "status"}, 10)  # type: ignore[attr-defined]
    assert status.ok


async def test_hardening_lone_surrogate_request_id(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """A request_id that JSON allows but UTF-8 cannot carry: one reply, daemon alive."""
    async with _daemon(mqtt_broker, tmp_path) as daemon:
        replies = await _exchange(mqtt_broker, ['{"type": "status", "request_id": "\\ud800"}'])
        assert len(replies) == 1 and replies[0]["code"] == "invalid_command"
        assert replies[0].get("request_id") is None
        await _alive(daemon, mqtt_broker)


async def test_hardening_wildcard_response_topic(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """A response topic with + or #, or outside control/reply/: refused on the default topic."""
    async with _daemon(mqtt_broker, tmp_path) as daemon:
        async with aiomqtt.Client(
            mqtt_broker.host, mqtt_broker.port, protocol=aiomqtt.ProtocolVersion.V5
        ) as client:
            await client.subscribe(REPLY, qos=1)
            cases = {
                "replies/#": "wildcard",
                "a/+/b": "wildcard",
                "qsched/v1/ctl/boards/b0/in": "must lie under",  # a board's input
            }
            for topic, phrase in cases.items():
                props = Properties(PacketTypes.PUBLISH)
                props.ResponseTopic = topic
                props.CorrelationData = b"c1"
                document = json.dumps({"type": "status", "request_id": topic})
                await client.publish(REQUEST, document, qos=1, properties=props)
                message = await asyncio.wait_for(anext(aiter(client.messages)), 10)
                reply = json.loads(message.payload)  # type: ignore[arg-type]
                assert reply["code"] == "invalid_command" and phrase in reply["message"]
                assert reply["request_id"] == topic
        await _alive(daemon, mqtt_broker)


async def test_hardening_retained_command_is_refused(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """A retained stop is refused with the reason, and not run."""
    async with _daemon(mqtt_broker, tmp_path) as daemon:
        cfg = daemon.config.mqtt
        started = await send_command(
            cfg, daemon.topics, {"type": "start_job", "spec": {**SPEC, "steps": 100_000}}, 10
        )
        assert started.ok
        async with aiomqtt.Client(
            mqtt_broker.host, mqtt_broker.port, protocol=aiomqtt.ProtocolVersion.V311
        ) as client:
            await client.subscribe(REPLY, qos=1)
            await client.publish(
                REQUEST, '{"type": "stop", "request_id": "r1"}', qos=1, retain=True
            )
            message = await asyncio.wait_for(anext(aiter(client.messages)), 10)
            reply = json.loads(message.payload)  # type: ignore[arg-type]
            await client.publish(REQUEST, b"", qos=1, retain=True)  # clear it
        assert reply["request_id"] == "r1" and reply["code"] == "invalid_command"
        assert "retained" in reply["message"]
        assert daemon.job is not None and daemon.job.engine.job_state == "running"
        stopped = await send_command(cfg, daemon.topics, {"type": "stop"}, 10)
        assert stopped.ok


async def test_hardening_lax_types_and_unbounded_q_are_refused(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """steps "200", lr 1e400 and Infinity, drain "yes", q above MAX_Q: typed refusals."""
    documents = [
        json.dumps({"type": "start_job", "request_id": "s", "spec": {**SPEC, "steps": "200"}}),
        '{"type": "start_job", "request_id": "l", "spec": {"name": "x", "lr": 1e400}}',
        '{"type": "start_job", "request_id": "i", "spec": {"name": "y", "lr": Infinity}}',
        '{"type": "drain", "request_id": "d", "board_id": "b0", "drain": "yes"}',
        json.dumps(
            {
                "type": "start_job",
                "request_id": "q",
                "spec": {"name": "z", "policy": {"name": "fixed", "config": {"q": MAX_Q + 1}}},
            }
        ),
    ]
    async with _daemon(mqtt_broker, tmp_path) as daemon:
        replies = await _exchange(mqtt_broker, documents)
        by_id = {r["request_id"]: r for r in replies}
        assert sorted(by_id) == ["d", "i", "l", "q", "s"] and len(replies) == 5
        assert all(r["code"] == "invalid_command" for r in replies), replies
        assert daemon.job is None and not any((tmp_path / "jobs").iterdir())
        await _alive(daemon, mqtt_broker)


async def test_hardening_failed_start_leaves_nothing_and_frees_its_name(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """A missing backbone: invalid_command, no job folder, and the name can be used again."""
    async with _daemon(mqtt_broker, tmp_path) as daemon:
        cfg = daemon.config.mqtt
        broken = {**SPEC, "steps": 5, "backbone": str(tmp_path / "missing.tflite")}
        refused = await send_command(cfg, daemon.topics, {"type": "start_job", "spec": broken}, 10)
        assert not refused.ok and refused.code == "invalid_command"  # type: ignore[union-attr]
        assert "missing.tflite" in refused.message  # type: ignore[union-attr]
        assert not (tmp_path / "jobs" / SPEC["name"]).exists()
        again = await send_command(
            cfg, daemon.topics, {"type": "start_job", "spec": {**SPEC, "steps": 5}}, 10
        )
        assert again.ok


async def test_hardening_daemon_state_names_the_current_job(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """The retained daemon/state says which job is loaded, once one is."""
    async with _daemon(mqtt_broker, tmp_path) as daemon:
        started = await send_command(
            daemon.config.mqtt, daemon.topics, {"type": "start_job", "spec": SPEC}, 10
        )
        assert started.ok
        await asyncio.sleep(1.5)  # the status loop runs at least once a second
        async with aiomqtt.Client(mqtt_broker.host, mqtt_broker.port) as client:
            await client.subscribe(daemon.topics.daemon_state(), qos=1)
            message = await asyncio.wait_for(anext(aiter(client.messages)), 10)
        state = json.loads(message.payload)  # type: ignore[arg-type]
        assert message.retain and state["online"] and state["job"] == SPEC["name"]


async def test_hardening_finished_jobs_are_reachable_by_name(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """After another job is loaded, an earlier one still answers status and export by name."""
    async with _daemon(mqtt_broker, tmp_path) as daemon:
        cfg, topics = daemon.config.mqtt, daemon.topics
        first = {**SPEC, "name": "first", "steps": 20, "eval_every": 10}
        assert (await send_command(cfg, topics, {"type": "start_job", "spec": first}, 10)).ok
        while daemon.job is None or daemon.job.engine.job_state != "completed":
            await asyncio.sleep(0.05)
        second = {**SPEC, "name": "second", "steps": 100_000}  # still running at the stop
        assert (await send_command(cfg, topics, {"type": "start_job", "spec": second}, 10)).ok
        status = await send_command(cfg, topics, {"type": "status", "job": "first"}, 10)
        assert status.ok and status.status is not None and status.status.job is not None  # type: ignore[union-attr]
        job = status.status.job  # type: ignore[union-attr]
        assert (job.name, job.state, job.step, job.steps) == ("first", "completed", 20, 20)
        assert job.val_accuracy is not None
        exported = await send_command(
            cfg, topics, {"type": "export", "job": "first", "format": "npz"}, 30
        )
        assert exported.ok and exported.path.endswith("first.npz")  # type: ignore[union-attr]
        assert Path(exported.path).stat().st_size > 0  # type: ignore[union-attr]
        missing = await send_command(cfg, topics, {"type": "status", "job": "nosuch"}, 10)
        assert not missing.ok and missing.code == "unknown_job"  # type: ignore[union-attr]
        assert (await send_command(cfg, topics, {"type": "stop"}, 10)).ok


async def test_hardening_hello_claiming_another_id_is_refused(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """On MQTT the topic names the board: a Hello there with another board_id gets
    Error(malformed) and neither renames nor adds a board."""
    hello = Hello(board_id="b9", firmware_version="t", npu="none", ram_kib=1, max_batch=1)
    forged = hello.model_copy(update={"board_id": "impostor"})
    async with _daemon(mqtt_broker, tmp_path) as daemon:
        async with aiomqtt.Client(mqtt_broker.host, mqtt_broker.port) as client:
            await client.subscribe("qsched/v1/ctl/boards/b9/in", qos=1)
            presence = BoardPresence(board_id="b9", online=True).model_dump_json()
            await client.publish("qsched/v1/ctl/boards/b9/presence", presence, qos=1, retain=True)
            await asyncio.sleep(0.5)  # the daemon opens the session on the presence
            await client.publish("qsched/v1/ctl/boards/b9/out", encode(hello), qos=1)
            await client.publish("qsched/v1/ctl/boards/b9/out", encode(forged), qos=1)
            async with asyncio.timeout(10):
                async for message in client.messages:
                    reply = decode(message.payload)  # type: ignore[arg-type]
                    if isinstance(reply, Error):
                        break
        assert reply.code == "malformed" and "board id of its topic" in reply.detail
        listed = await send_command(daemon.config.mqtt, daemon.topics, {"type": "list_boards"}, 10)
        ids = {board.board_id for board in listed.boards or ()}  # type: ignore[union-attr]
        assert "b9" in ids and "impostor" not in ids


async def test_hardening_unsupported_model_is_one_typed_reply(
    mqtt_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """A backbone with operators qsched lacks: invalid_command naming the file and every
    one of them; no job folder, and the daemon goes on."""
    from test_zo_tflite_import_real import _with_opcodes

    from qsched.zo._tflite_common import schema
    from qsched.zo.data import RESNET8_CIFAR10

    op = schema.BuiltinOperator
    model = tmp_path / "odd.tflite"
    model.write_bytes(_with_opcodes(RESNET8_CIFAR10.read_bytes(), {op.ADD: op.TANH}))
    spec = {"name": "odd", "backbone": str(model), "numerics": "int8", "dataset": "eurosat:size=32"}
    document = json.dumps({"type": "start_job", "request_id": "u", "spec": spec})
    async with _daemon(mqtt_broker, tmp_path / "state") as daemon:
        (reply,) = await _exchange(mqtt_broker, [document])
        assert reply["code"] == "invalid_command"
        assert f"{model}: unsupported operators: TANH (operators #3, #7, #11)" in reply["message"]
        assert daemon.job is None
        await _alive(daemon, mqtt_broker)
