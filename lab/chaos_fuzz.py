"""The fuzz of ``qsched chaos``: documents thrown at a live daemon on a real broker.

- ``control``: control documents on ``control/request`` — valid commands, each mutated
  (cut, a byte flipped, a field retyped), random JSON, random bytes, deep nesting,
  oversized documents, lone surrogates, huge numbers, some published retained, some with
  MQTT 5 response topics that are wildcards or lie outside ``control/reply/``. Every
  document must get exactly one reply.
- ``data``: data-plane messages on the boards' ``out`` topics, for real and made-up
  board ids (random bytes, mutated valid messages), and bad presence documents for
  made-up ids (a real board's presence is its own to clear: the broker's ACL keeps
  others from it, see docs/CONTROL.md).

Afterwards the daemon trains a short job that must end with the single-process
trainer's checksum: documents that cost nothing leave the bits as they were.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from typing import Any, Final

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from qsched.lab.chaos_fleet import BOARD_IDS, ChaosFleet, rss_mib
from qsched.lab.chaos_report import ChaosRow
from qsched.lab.procs import wait_for
from qsched.protocol.codec import encode
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.messages import Heartbeat, Hello
from qsched.protocol.topics import TopicMap
from qsched.zo.trainer import train_zo

__all__ = ["control_documents", "data_messages", "run_fuzz"]

# The job trained after the fuzz: short, and checked against the single-process trainer.
CHECK_SPEC: Final = JobSpec(
    name="after-fuzz",
    steps=30,
    eval_every=10,
    batch_size=16,
    policy=PolicySpec(name="fixed", config={"q": 4}),
)
_QUIET_S: Final = 5.0  # no reply for this long: every reply that will come has come


# --------------------------------------------------------------------------- documents


def _valid_commands(rng: random.Random) -> list[dict[str, Any]]:
    q = rng.choice([1, 4, 1024, 1025, 10**12])
    return [
        {"type": "status"},
        {"type": "status", "job": "nosuch"},
        {"type": "list_boards"},
        {"type": "pause"},
        {"type": "resume", "job": "x"},
        {"type": "checkpoint"},
        {"type": "drain_board", "board_id": "b-00", "drain": rng.choice([True, False, "yes"])},
        {"type": "change_policy", "policy": {"name": "fixed", "config": {"q": q}}},
        {"type": "export", "format": rng.choice(["npz", "tflite", "onnx"])},
        {"type": "start_job", "spec": {"name": "fz", "steps": "200"}},
        {"type": "start_job", "spec": {"name": "fz", "lr": 1e400}},
        {"type": "start_job", "spec": {"name": "fz", "backbone": "/nonexistent.tflite"}},
        {"type": "start_job", "spec": {"name": "fz", "model_options": {"hidden": -3}}},
    ]


def _mutate(data: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0 and data:
        return data[: rng.randrange(len(data))]
    if kind == 1 and data:
        i = rng.randrange(len(data))
        return data[:i] + bytes([rng.randrange(256)]) + data[i + 1 :]
    if kind == 2:
        return data + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))


def control_documents(count: int, seed: int) -> Iterator[bytes]:
    """``count`` control documents, valid and not, reproducible from ``seed``."""
    rng = random.Random(seed)
    for i in range(count):
        roll = rng.random()
        command = dict(rng.choice(_valid_commands(rng)), request_id=f"fz-{i}")
        text = json.dumps(command).encode()
        if roll < 0.3:
            yield text
        elif roll < 0.6:
            yield _mutate(text, rng)
        elif roll < 0.7:
            yield json.dumps(rng.choice([[], 7, "status", None, {"type": 5}])).encode()
        elif roll < 0.75:
            yield b"[" * 5000 + b"]" * 5000
        elif roll < 0.78:
            yield b'{"type":"status","request_id":"\\ud800"}'
        elif roll < 0.8:
            yield b'{"type":"status","request_id":"' + b"x" * (1 << 20) + b'"}'
        else:
            yield bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))


def data_messages(count: int, seed: int, board_ids: list[str]) -> Iterator[tuple[str, str, bytes]]:
    """``count`` data-plane publishes: (board id, ``out`` or ``presence``, payload)."""
    rng = random.Random(seed)
    ids = [*board_ids, *(f"fz-{i}" for i in range(8))]
    valid = [
        encode(Heartbeat(uptime_ms=1, state="idle")),
        encode(Hello(board_id="fz-1", firmware_version="fuzz", npu="none", ram_kib=1, max_batch=1)),
    ]
    made_up = ids[len(board_ids) :]
    for _ in range(count):
        if rng.random() < 0.2:
            # Only made-up boards: an empty presence of a real board is its (cleared)
            # departure, which the broker's ACL keeps others from saying for it.
            presence = rng.choice([b"{}", b"not json", b'{"type":"board_presence"}', b""])
            yield rng.choice(made_up), "presence", presence
        else:
            yield rng.choice(ids), "out", _mutate(rng.choice(valid), rng)


# --------------------------------------------------------------------------- the fuzz


async def _fuzz_control(
    cfg: MqttConfig, topics: TopicMap, count: int, seed: int
) -> tuple[int, int]:
    """Publish the documents; return (replies expected, replies seen)."""
    rng = random.Random(seed + 1)
    replies = 0
    expected = 0
    last = time.monotonic()
    async with aiomqtt.Client(
        cfg.host, cfg.port, identifier="qsched-chaos", protocol=aiomqtt.ProtocolVersion.V5
    ) as client:
        await client.subscribe(f"{topics.control_reply()}/#", qos=1)

        async def count_replies() -> None:
            nonlocal replies, last
            async for _ in client.messages:
                replies += 1
                last = time.monotonic()

        counter = asyncio.create_task(count_replies())
        for document in control_documents(count, seed):
            properties = None
            if rng.random() < 0.3:
                properties = Properties(PacketTypes.PUBLISH)
                properties.ResponseTopic = rng.choice(
                    [f"{topics.control_reply()}/fz", "replies/#", "a/+/b", f"{topics.base}/events"]
                )
                properties.CorrelationData = b"fz"
            retained = rng.random() < 0.01
            await client.publish(
                topics.control_request(), document, qos=1, retain=retained, properties=properties
            )
            expected += 1
            if retained:  # clearing it is one more (empty, retained) document
                await client.publish(topics.control_request(), b"", qos=1, retain=True)
                expected += 1
        while replies < expected and time.monotonic() - last < _QUIET_S:
            await asyncio.sleep(0.2)
        counter.cancel()
    return expected, replies


async def _fuzz_data(cfg: MqttConfig, topics: TopicMap, count: int, seed: int) -> None:
    async with aiomqtt.Client(cfg.host, cfg.port, identifier="qsched-chaos-data") as client:
        for board, kind, payload in data_messages(count, seed, list(BOARD_IDS)):
            topic = topics.board_out(board) if kind == "out" else topics.board_presence(board)
            await client.publish(topic, payload, qos=1)


def _train_and_check(fleet: ChaosFleet) -> bool:
    """Train ``CHECK_SPEC`` on the fleet; whether it ends with the reference checksum."""
    fleet.wait_ready()
    fleet.start_job(CHECK_SPEC.model_dump(mode="json"))
    name = CHECK_SPEC.name
    wait_for(lambda: fleet.job_status(name) != "running", 300, f"{name} to end")
    final = fleet.final(name)
    return final is not None and final[0] == train_zo(CHECK_SPEC).state.checksum()


def run_fuzz(fleet: ChaosFleet, control: int, data: int, seed: int) -> list[ChaosRow]:
    """The fuzz rows: documents at the live daemon, then a job that must train exactly.

    Args:
        fleet: the daemon and boards to fuzz.
        control: control documents to send.
        data: data-plane messages to send.
        seed: makes the documents reproducible.

    Returns:
        One row for the control documents, one for the data-plane messages.
    """
    fleet.wait_ready()
    pid = fleet.daemon.pid
    before = rss_mib(pid)
    expected, replies = asyncio.run(_fuzz_control(fleet.cfg, fleet.topics, control, seed))
    after_control = rss_mib(pid)
    control_crash = int(fleet.daemon.poll() is not None)
    asyncio.run(_fuzz_data(fleet.cfg, fleet.topics, data, seed))
    after_data = rss_mib(pid)
    data_crash = int(fleet.daemon.poll() is not None)
    exact = int(not (control_crash or data_crash) and _train_and_check(fleet))
    return [
        ChaosRow("fuzz: control documents", control, exact, 1, replies=(replies, expected),
                 crashes=control_crash, memory=f"{before:.0f} -> {after_control:.0f} MiB",
                 notes="then one job, checked"),
        ChaosRow("fuzz: data-plane messages", data, exact, 1, crashes=data_crash,
                 memory=f"{after_control:.0f} -> {after_data:.0f} MiB",
                 notes="then one job, checked"),
    ]  # fmt: skip
