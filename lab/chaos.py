"""``qsched chaos``: a fault campaign against a real daemon, real boards and a real broker.

The daemon and two virtual boards run as separate processes (``qsched daemon``,
``qsched board``) on a private Mosquitto. The campaign throws documents at them, then
trains a short job and checks it ends with the single-process trainer's checksum: a
fault that cost nothing leaves the bits as they were.

Built so far, the fuzz:

- ``control``: control documents on ``control/request`` — valid commands, each mutated
  (cut, a byte flipped, a field retyped), random JSON, random bytes, deep nesting,
  oversized documents, lone surrogates, huge numbers, some published retained, some with
  MQTT 5 response topics that are wildcards or lie outside ``control/reply/``. Every
  document must get exactly one reply.
- ``data``: data-plane messages on the boards' ``out`` topics, for real and made-up
  board ids (random bytes, mutated valid messages), and bad presence documents for
  made-up ids (a real board's presence is its own to clear: the broker's ACL keeps
  others from it, see docs/CONTROL.md).

Each row reports the documents sent, the replies, whether the daemon died, its memory
before and after, and whether the job trained afterwards ended bit-identical. Not built
yet: the process-kill trials (daemon and board SIGKILLs mid-step, broker restarts),
serial corruption and the lying and hung boards of a full campaign; asking for them is
an error that says so. Their single trials exist as tests (``tests/test_daemon_resume.py``,
``tests/test_daemon_engine_audit.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from qsched.daemon.ctl import CtlError, send_command
from qsched.daemon.state import StateStore
from qsched.lab.broker import MosquittoBroker
from qsched.protocol.codec import encode
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.messages import Heartbeat, Hello
from qsched.protocol.topics import TopicMap
from qsched.zo.trainer import train_zo
from qsched.zo.workload import TrainState

__all__ = ["FAULTS", "ChaosRow", "main", "run_fuzz"]

FAULTS: Final = ("fuzz",)
NOT_BUILT: Final = ("daemon-kill", "board-kill", "broker-restart", "serial", "liar", "hung")
FLEET: Final = "chaos"
BOARDS: Final = 2
# The job trained after the fuzz: short, and checked against the single-process trainer.
CHECK_SPEC: Final = JobSpec(
    name="after-fuzz",
    steps=30,
    eval_every=10,
    batch_size=16,
    policy=PolicySpec(name="fixed", config={"q": 4}),
)
_QUIET_S: Final = 5.0  # no reply for this long: every reply that will come has come


@dataclass
class ChaosRow:
    """One line of the campaign's table."""

    fault: str
    trials: int
    bit_identical: str
    replies: str
    crashes: int
    memory: str


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


# --------------------------------------------------------------------------- processes


class _Fleet:
    """The daemon and its boards as processes of their own, on a private broker."""

    def __init__(self, broker: MosquittoBroker, folder: Path) -> None:
        self.broker = broker
        self.folder = folder
        self.state = folder / "state"
        self.daemon = self._start("daemon", "daemon", "--state-dir", str(self.state))
        self.boards = self._start(
            "boards", "board", "--count", str(BOARDS), "--model-latency", "off", "--heartbeat", "1"
        )

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        address = f"{self.broker.host}:{self.broker.port}"
        command = [sys.executable, "-m", "qsched.daemon.cli", *args, "--mqtt", address]
        command += ["--fleet", FLEET]
        with open(self.folder / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def close(self) -> None:
        for child in (self.daemon, self.boards):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(10)


def _rss_mib(pid: int) -> float:
    """Resident memory of a process in MiB (Linux ``/proc``)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def _status(cfg: MqttConfig, topics: TopicMap, job: str | None = None) -> Any:
    command = {"type": "status", **({"job": job} if job else {})}
    reply = await send_command(cfg, topics, command, 10)
    return getattr(reply, "status", None) if reply.ok else None


async def _wait_ready(cfg: MqttConfig, topics: TopicMap, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(CtlError):
            status = await _status(cfg, topics)
            # Without a job a healthy board stays in "hello"; with one it is "ready" or "busy".
            boards = status.boards if status is not None else ()
            if sum(b.state in ("hello", "ready", "busy") for b in boards) >= BOARDS:
                return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"the daemon and its {BOARDS} boards were not ready in {timeout:.0f} s")


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
        board_ids = [f"board-{i:02d}" for i in range(BOARDS)]  # `qsched board`'s ids
        for board, kind, payload in data_messages(count, seed, board_ids):
            topic = topics.board_out(board) if kind == "out" else topics.board_presence(board)
            await client.publish(topic, payload, qos=1)


async def _train_and_check(cfg: MqttConfig, topics: TopicMap, state: Path) -> bool:
    """Train ``CHECK_SPEC`` on the fleet; whether it ends with the reference checksum."""
    await _wait_ready(cfg, topics)
    spec = CHECK_SPEC.model_dump(mode="json")
    reply = await send_command(cfg, topics, {"type": "start_job", "spec": spec}, 30)
    if not reply.ok:
        return False
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = await _status(cfg, topics, CHECK_SPEC.name)
        if status is not None and status.job is not None and status.job.state == "completed":
            break
        await asyncio.sleep(0.5)
    checkpoint = StateStore(state).job(CHECK_SPEC.name).load_checkpoint()
    if checkpoint is None:
        return False
    final = TrainState.from_bytes(checkpoint.train_state)
    return bool(final.checksum() == train_zo(CHECK_SPEC).state.checksum())


async def run_fuzz(control: int, data: int, seed: int, folder: Path) -> list[ChaosRow]:
    """The fuzz rows: documents at a live daemon, then a job that must train exactly.

    Args:
        control: control documents to send.
        data: data-plane messages to send.
        seed: makes the documents reproducible.
        folder: logs and the daemon's state directory.

    Returns:
        One row for the control documents, one for the data-plane messages.
    """
    async with MosquittoBroker() as broker:
        cfg = MqttConfig(host=broker.host, port=broker.port)
        topics = TopicMap(fleet=FLEET)
        fleet = _Fleet(broker, folder)
        try:
            await _wait_ready(cfg, topics)
            before = _rss_mib(fleet.daemon.pid)
            expected, replies = await _fuzz_control(cfg, topics, control, seed)
            after_control = _rss_mib(fleet.daemon.pid)
            control_crash = int(fleet.daemon.poll() is not None)
            await _fuzz_data(cfg, topics, data, seed)
            after_data = _rss_mib(fleet.daemon.pid)
            data_crash = int(fleet.daemon.poll() is not None)
            exact = (
                "yes"
                if not (control_crash or data_crash)
                and await _train_and_check(cfg, topics, fleet.state)
                else "no"
            )
        finally:
            fleet.close()
    return [
        ChaosRow("fuzz: control documents", control, exact, f"{replies}/{expected}",
                 control_crash, f"{before:.0f} -> {after_control:.0f} MiB"),
        ChaosRow("fuzz: data-plane messages", data, exact, "-", data_crash,
                 f"{after_control:.0f} -> {after_data:.0f} MiB"),
    ]  # fmt: skip


def format_table(rows: list[ChaosRow]) -> str:
    """The campaign's table (Markdown)."""
    head = "| fault | trials | bit-identical | replies | crashes | daemon memory |"
    lines = [head, "| --- | ---: | --- | ---: | ---: | --- |"]
    lines += [
        f"| {r.fault} | {r.trials} | {r.bit_identical} | {r.replies} | {r.crashes} | {r.memory} |"
        for r in rows
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qsched chaos",
        description="Throw faults at a real daemon, boards and broker; print what survived.",
    )
    parser.add_argument(
        "--faults", default="fuzz", help=f"comma-separated: {', '.join(FAULTS)} (built so far)"
    )
    parser.add_argument("--control", type=int, default=10_000, help="control documents")
    parser.add_argument("--data", type=int, default=10_000, help="data-plane messages")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for logs (default: a temporary one)")
    return parser


def main(argv: list[str]) -> int:
    """``qsched chaos``.

    Returns:
        0 when every row is bit-identical with no crash and every document answered,
        1 otherwise, 2 for a fault kind that is unknown or not built yet.
    """
    args = _parser().parse_args(argv)
    wanted = [f.strip() for f in args.faults.split(",") if f.strip()]
    for fault in wanted:
        if fault in NOT_BUILT:
            print(f"qsched chaos: the {fault!r} trials are not built yet", file=sys.stderr)
            return 2
        if fault not in FAULTS:
            print(
                f"qsched chaos: unknown fault {fault!r}; built: {', '.join(FAULTS)}",
                file=sys.stderr,
            )
            return 2
    with contextlib.ExitStack() as stack:
        folder = args.out or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="qsched-chaos-"))
        )
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        rows = asyncio.run(run_fuzz(args.control, args.data, args.seed, folder))
        print(format_table(rows))
        print(f"\n{time.perf_counter() - started:.0f} s; logs in {folder}" if args.out else "")
    good = all(
        r.bit_identical == "yes"
        and r.crashes == 0
        and (r.replies == "-" or _all_answered(r.replies))
        for r in rows
    )
    return 0 if good else 1


def _all_answered(replies: str) -> bool:
    seen, expected = replies.split("/")
    return seen == expected
