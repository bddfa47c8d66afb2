"""``qsched bench fleet``: how step throughput scales with the number of boards.

    qsched bench fleet               # 1, 2, 4, 8 boards; MQTT and serial; batch 4, then 1
    qsched bench fleet --batch 1     # only the worst case: one sample per forward pass
    qsched bench fleet --boards 1,8 --links mqtt --q 64 --check

For each link (a private Mosquitto on loopback, started here; serial pseudo-terminals)
and each fleet size, one ``qsched board`` process hosts the boards and the daemon's step
engine runs a fixed-q job on them for a few seconds. The boards sleep for the time an
STM32N6 NPU takes (``firmware/virtual/latency.py``, MobileNetV2-0.35 at 128x128 by default)
while computing a much smaller model (the default job's MLP), so the host's CPU is not
what is measured. Printed per configuration:

- forward passes per second (2q per step, each over a minibatch of ``--batch`` samples:
  4 by default, a realistic minibatch; 1, the worst case, where every pass pays the
  fixed costs alone, follows in the default run);
- scaling efficiency: that rate over N times the one-board rate of the same link;
- coordination overhead per step: measured step time minus the modelled NPU time of the
  largest shard (planning, messages, the update broadcast and its acks);
- data-plane payload bytes per step (all boards, both directions), next to what shipping
  gradients would cost (every board sends a gradient and receives the update).

The daemon's log goes to ``--log FILE`` (default: warnings only), not into the table.
The shard audit (one key of every shard evaluated twice) is off unless ``--audit``: it
is a correctness check that costs one extra key per board and step by design.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import statistics
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import structlog

from qsched.daemon.host_timeline import MARKS as HOST_MARKS
from qsched.daemon.host_timeline import read_marks
from qsched.lab.demo import board_processes, stop_processes, wait_for_boards
from qsched.lab.host_speed import board_message_us
from qsched.lab.procs import sigterm_as_interrupt
from qsched.protocol.links.base import BoardAppeared, LinkEvent

__all__ = [
    "BenchConfig",
    "BenchRow",
    "ByteCounter",
    "CountingChannel",
    "CountingLink",
    "CountingTransport",
    "bench_one",
    "format_notes",
    "format_report",
    "main",
    "model_facts",
    "run_bench",
]

_log = structlog.get_logger("qsched.bench.fleet")

LINKS: Final = ("mqtt", "serial")
# Also on request: serial boards behind ``qsched bridge`` processes, the daemon on MQTT.
ALL_LINKS: Final = (*LINKS, "bridge")
DEFAULT_BATCH: Final = (
    4  # samples per perturbed forward pass: a realistic minibatch (1: the worst case)
)
DEFAULT_BATCHES: Final = (DEFAULT_BATCH, 1)
MAX_BOARDS: Final = 512
EFFICIENCY_FLOOR: Final = 0.9
FLOOR_BOARDS: Final = 8  # the floor ``--check`` enforces
# The fleet's targets over MQTT: boards -> least efficiency, and the daemon's CPU per
# step at the larger fleet at most this many times that at the smaller.
FLEET_FLOORS: Final = {FLOOR_BOARDS: EFFICIENCY_FLOOR, 32: 0.9, 128: 0.8}
DAEMON_CPU_FLOOR: Final = (8, 128, 2.0)
# Type codes of the step's own messages (protocol/messages.py TYPE_CODES).
STEP_TYPES: Final = {
    0x45: "eval_request",
    0x03: "eval_result",
    0x46: "apply_update",
    0x04: "update_ack",
    0x4A: "step_order",
    0x4B: "eval_slice_request",
    0x07: "eval_slice_result",
}


@dataclass(frozen=True)
class BenchConfig:
    """What the benchmark runs.

    Args:
        boards: fleet sizes.
        links: ``mqtt`` and/or ``serial``.
        q: perturbations per step (a fixed-q policy).
        batch: samples per forward pass.
        window_s: measured seconds per configuration (steps derived from the model).
        warmup_steps: steps run before measuring (loading, first throughput estimates).
        min_steps: fewest measured steps.
        max_steps: most measured steps.
        model_latency: the boards' latency model (``qsched board --model-latency``).
        audit: keep the engine's shard audit on.
        mqtt: an existing broker ``HOST:PORT`` instead of a private one.
        processes: ``qsched board`` processes hosting the boards (more spreads their
            message handling over cores, on hosts that have them).
        pipeline: the engine's pipelining (next step's requests sent with the update).
        fleet_topic: MQTT boards take each step as one StepOrder on the fleet topic;
            off, every board gets its own update and request (the design before).
        host_uplink: each board process sends its boards' messages in batches on one
            host topic (``qsched board --host-uplink``).
        bridges: ``qsched bridge`` processes of the ``bridge`` link; the boards are dealt
            to them in contiguous groups.
        aggregate: each bridge presents its boards as one board (``--aggregate``); over
            MQTT, each board process does (``qsched.lab.host_boards``).
    """

    boards: tuple[int, ...] = (1, 2, 4, 8)
    links: tuple[str, ...] = LINKS
    q: int = 64
    batch: int = 4
    # 5 s: the broker's $SYS counters came 1.3-2 s apart on a busy broker (sys_interval
    # 1), and its rate needs two readings inside the measured steps.
    window_s: float = 5.0
    warmup_steps: int = 2
    min_steps: int = 3
    max_steps: int = 200
    model_latency: str = "mobilenetv2-0.35-128"
    audit: bool = False
    mqtt: str | None = None
    processes: int = 1
    pipeline: bool = True
    fleet_topic: bool = True
    host_uplink: bool = False
    bridges: int = 4
    aggregate: bool = False


@dataclass
class BenchRow:
    """One configuration's figures."""

    link: str
    boards: int
    steps: int
    step_s: float
    ideal_step_s: float
    forward_passes_per_s: float
    payload_bytes_per_step: float
    bytes_by_type: dict[str, float] = field(default_factory=dict)
    work: dict[str, int] = field(default_factory=dict)
    efficiency: float | None = None
    daemon_cpu_s_per_step: float = 0.0
    others_cpu_s_per_step: float = 0.0  # boards, bridges and broker (child processes)
    timeline_ms: dict[str, float] = field(default_factory=dict)  # StepTimeline medians
    host_timeline_ms: dict[str, float] = field(default_factory=dict)  # the hosts' own marks
    messages_per_step: float = 0.0
    broker_publishes_per_s: float | None = None
    board_message_us: float | None = None  # this machine's yardstick, taken before the row

    @property
    def overhead_s(self) -> float:
        """Step time beyond the modelled NPU time of the largest shard."""
        return self.step_s - self.ideal_step_s


# --------------------------------------------------------------------------- byte counting


class StepTimeline:
    """When each measured step's messages passed the daemon, relative to the moment its
    update went out (the step order, or the first ApplyUpdate of the previous step): the
    first and last ack, the first and last result, and the next step's update."""

    MARKS: Final = ("first ack", "last ack", "first result", "last result", "next step")

    def __init__(self) -> None:
        self.opened: dict[int, float] = {}
        self.acks: dict[int, list[float]] = {}
        self.results: dict[int, list[float]] = {}

    def note(self, kind: str, step: int, now: float) -> None:
        """One step message of type ``kind`` for ``step`` passed at ``now``."""
        if kind in ("step_order", "apply_update"):
            self.opened.setdefault(step + 1, now)  # the update of step t opens step t + 1
        elif kind == "update_ack":
            self.acks.setdefault(step + 1, []).append(now)
        elif kind in ("eval_result", "eval_slice_result"):
            self.results.setdefault(step, []).append(now)

    def medians_ms(self, steps: range | None = None) -> dict[str, float]:
        """Each mark's median, in ms after the step opened, over the steps (of ``steps``)
        that have all of them (so the medians keep the marks' order)."""
        marks: dict[str, list[float]] = {m: [] for m in self.MARKS}
        for step, start in self.opened.items():
            if steps is not None and step not in steps:
                continue
            acks, results = self.acks.get(step), self.results.get(step)
            if not acks or not results or step + 1 not in self.opened:
                continue
            for name, value in zip(
                self.MARKS,
                (min(acks), max(acks), min(results), max(results), self.opened[step + 1]),
                strict=True,
            ):
                marks[name].append(value - start)
        return _medians_ms(marks)

    def host_medians_ms(
        self, hosts: Sequence[dict[int, dict[str, float]]], steps: range | None = None
    ) -> dict[str, float]:
        """The hosts' own marks (``HostTimeline``, one dict per host), each one's median
        in ms after the step opened, over the steps and hosts that have all of them."""
        marks: dict[str, list[float]] = {m: [] for m in HOST_MARKS}
        for host in hosts:
            for step, noted in host.items():
                start = self.opened.get(step)
                if start is None or (steps is not None and step not in steps):
                    continue
                if all(m in noted for m in HOST_MARKS):
                    for m in HOST_MARKS:
                        marks[m].append(noted[m] - start)
        return _medians_ms(marks)


def _medians_ms(marks: dict[str, list[float]]) -> dict[str, float]:
    """Each mark's median seconds, in ms (marks without a value left out)."""
    return {m: statistics.median(v) * 1e3 for m, v in marks.items() if v}


class ByteCounter:
    """Data-plane bytes by message type, counted only while ``active``.

    With ``steps`` set, a step's own messages (requests, results, updates, acks) count
    when their step is in it instead, whenever they pass: the engine sends a step's
    requests together with the previous step's update, before that step's window opens.
    """

    def __init__(self) -> None:
        self.active = False
        self.steps: range | None = None
        self.bytes: Counter[str] = Counter()
        self.messages = 0  # every message counted, both ways (a fleet publish once)
        self.timeline = StepTimeline()
        self._channels: dict[int, CountingChannel] = {}

    def channel(self, inner: Any) -> CountingChannel:
        """The one counting view of a fleet channel (the engine groups boards by it)."""
        view = self._channels.get(id(inner))
        if view is None:
            view = self._channels[id(inner)] = CountingChannel(inner, self)
        return view

    def add(self, payload: bytes) -> None:
        """Count one message (its type from the header's fourth byte)."""
        code = payload[3] if len(payload) >= 4 else -1
        kind = STEP_TYPES.get(code, "other")
        if self.steps is not None and kind != "other":
            step = raw = _step_of(payload)
            if raw is not None:
                self.timeline.note(kind, raw, time.perf_counter())
            if kind == "step_order" and step is not None:
                step += 1  # it opens the next step (its update ends this one)
            if step in self.steps:
                self.bytes[kind] += len(payload)
                self.messages += 1
        elif self.active:
            self.bytes[kind] += len(payload)
            self.messages += 1


def _step_of(payload: bytes) -> int | None:
    # Every step message starts with job_id (u32) and step (u32) after the header: read
    # the step from its bytes, so counting costs the daemon no decode.
    return struct.unpack_from("<I", payload, 8)[0] if len(payload) >= 12 else None


class CountingChannel:
    """A fleet channel (one publish for many boards) that counts what it publishes once."""

    def __init__(self, inner: Any, counter: ByteCounter) -> None:
        self._inner = inner
        self._counter = counter

    async def publish_fleet(self, payload: bytes) -> None:
        """Count, then publish."""
        self._counter.add(payload)
        await self._inner.publish_fleet(payload)


class CountingLink:
    """A link that counts what passes through it; everything else is the wrapped link's."""

    def __init__(self, link: Any, counter: ByteCounter) -> None:
        self._link = link
        self._counter = counter
        self.board_id = link.board_id

    @property
    def closed(self) -> bool:
        """Whether the wrapped link is gone."""
        return bool(self._link.closed)

    @property
    def fleet_channel(self) -> CountingChannel | None:
        """The wrapped link's fleet channel, counted (None when it has none)."""
        inner = getattr(self._link, "fleet_channel", None)
        return None if inner is None else self._counter.channel(inner)

    async def send(self, payload: bytes) -> None:
        """Count, then send."""
        self._counter.add(payload)
        await self._link.send(payload)

    async def incoming(self) -> AsyncIterator[bytes]:
        """The wrapped link's messages, counted."""
        async for data in self._link.incoming():
            self._counter.add(data)
            yield data

    async def close(self) -> None:
        """Close the wrapped link."""
        await self._link.close()


class CountingTransport:
    """A view of an entered transport whose board links count their bytes.

    Entering and leaving it does nothing: the wrapped transport's owner does that.

    Args:
        transport: the wrapped transport, already entered.
        counter: where the bytes go.
    """

    def __init__(self, transport: Any, counter: ByteCounter) -> None:
        self.transport = transport
        self.counter = counter
        self.name = transport.name

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    async def events(self) -> AsyncIterator[LinkEvent]:
        """The wrapped transport's events, with counting links."""
        async for event in self.transport.events():
            if isinstance(event, BoardAppeared):
                event = BoardAppeared(
                    event.board_id, CountingLink(event.link, self.counter), event.transport
                )
            yield event


# --------------------------------------------------------------------------- one configuration


def _spec(config: BenchConfig, steps: int) -> Any:
    from qsched.protocol.jobspec import JobSpec, PolicySpec

    # eval_every beyond the run and one step more than measured: no validation runs.
    return JobSpec(
        name="bench",
        steps=steps + 1,
        batch_size=config.batch,
        eval_every=10**6,
        checkpoint_every=10**6,
        policy=PolicySpec(name="fixed", config={"q": config.q}),
    )


def _ideal_samples(config: BenchConfig, boards: int) -> int:
    """Samples per sign the busiest board evaluates in an ideal step: the fleet's even
    share (with batch slices, INT8, a board can take less than a whole key, so boards
    beyond q still shorten the step), plus the audit's extra key."""
    audit = config.batch if config.audit and boards > 1 else 0
    return math.ceil(config.q * config.batch / boards) + audit


def _ideal_step_s(config: BenchConfig, boards: int, computed_macs: int) -> float:
    from qsched.firmware.virtual.board import LatencyProfile

    return LatencyProfile.named(config.model_latency).forward_seconds(
        computed_macs, 2 * _ideal_samples(config, boards)
    )


class _Clock:
    """Step completion times; stops the engine after the last measured step."""

    def __init__(self, warmup: int, measured: int, counter: ByteCounter) -> None:
        self.warmup, self.measured, self.counter = warmup, measured, counter
        self.times: dict[int, float] = {}
        self.cpu: dict[int, float] = {}  # this process's CPU seconds: the daemon's
        self.others: dict[int, float] = {}  # its child processes': boards, bridges, broker
        self.engine: Any = None

    def on_event(self, event: Any) -> None:
        if event.kind != "step" or event.step is None:
            return
        done = event.step + 1
        self.times[done] = time.perf_counter()
        self.cpu[done] = time.process_time()
        if done in (self.warmup, self.warmup + self.measured):
            self.others[done] = children_cpu_s()
        if done == self.warmup:
            self.counter.active = True
        elif done == self.warmup + self.measured:
            self.counter.active = False
            self.engine.stop()


def children_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process's live child processes
    (Linux ``/proc``; 0 elsewhere): the board processes, bridges, relays and broker."""
    import os

    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        if int(fields[1]) == me:  # ppid; utime and stime are fields 14 and 15 of stat
            total += int(fields[11]) + int(fields[12])
    return total / tick


def _daemon_boards(config: BenchConfig, link: str, boards: int) -> int:
    """How many boards the daemon sees: an aggregating bridge or host is one."""
    if config.aggregate and link == "bridge":
        return min(config.bridges, boards)
    if config.aggregate and link == "mqtt":
        return min(config.processes, boards)
    return boards


@contextlib.asynccontextmanager
async def _hosted_boards(
    config: BenchConfig, boards: int, broker: str | None, fleet: str, timelines: Path
) -> AsyncIterator[list[Any]]:
    """``boards`` virtual boards in ``config.processes`` processes, each process one
    aggregated board on MQTT (``qsched.lab.host_boards``) that writes its step timeline
    into the folder ``timelines`` when it stops."""

    assert broker is not None
    procs = []
    for i, (_, size) in enumerate(_groups(boards, config.processes)):
        argv = [sys.executable, "-m", "qsched.lab.host_boards", "--mqtt", broker]
        argv += ["--fleet", fleet, "--name", f"bench-host-{i}", "--count", str(size)]
        argv += ["--model-latency", config.model_latency, "--id-prefix", f"bench{i}"]
        argv += ["--timeline", str(timelines / f"host-{i}.json")]
        procs.append(_quiet_process(argv))
    try:
        yield []
    finally:
        await asyncio.to_thread(stop_processes, procs)


@contextlib.asynccontextmanager
async def _bridged_boards(
    config: BenchConfig, boards: int, broker: str | None, fleet: str, extra: Sequence[str]
) -> AsyncIterator[list[Any]]:
    """``boards`` serial boards behind ``config.bridges`` bridge processes: each board's
    line is a relayed pty pair (``qsched.lab.noisy_line``, in a process of its own), the
    board process opens one end and a bridge the other."""
    import subprocess

    from qsched.lab.procs import qsched_argv

    assert broker is not None
    relay = subprocess.Popen(
        [sys.executable, "-m", "qsched.lab.noisy_line", "--lines", str(boards)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        assert relay.stdout is not None
        lines = [relay.stdout.readline().decode().split() for _ in range(boards)]
        if relay.stdout.readline().strip() != b"ready":
            raise RuntimeError("the serial line relay did not start")
        width = max(2, len(str(boards - 1)))
        groups = _groups(boards, config.processes)
        for start, size in groups:
            ports = [a for d, b in lines[start : start + size] for a in ("--serial", b)]
            board_args = ["--id-prefix", f"bench{start:0{width}d}", *ports, *extra]
            procs.append(_quiet_process(qsched_argv("board", *board_args, log_level="warning")))
        for i, (start, size) in enumerate(_groups(boards, config.bridges)):
            ports = [a for d, _ in lines[start : start + size] for a in ("--serial", d)]
            mode = ["--aggregate", f"bench-host-{i}"] if config.aggregate else []
            args = ["bridge", *ports, "--mqtt", broker, "--fleet", fleet, *mode]
            procs.append(_quiet_process(qsched_argv(*args, log_level="warning")))
        yield []
    finally:
        await asyncio.to_thread(stop_processes, procs)
        assert relay.stdin is not None and relay.stdout is not None
        relay.stdin.close()
        try:
            relay.wait(10)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait(10)
        relay.stdout.close()


def _groups(count: int, parts: int) -> list[tuple[int, int]]:
    """(start, size) of ``parts`` contiguous groups of ``count`` items (the first larger)."""
    n = max(1, min(count, parts))
    sizes = [count // n + (1 if i < count % n else 0) for i in range(n)]
    return [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]


def _quiet_process(argv: list[str]) -> Any:
    import subprocess

    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@contextlib.asynccontextmanager
async def _daemon_transport(
    link: str, ports: list[Any], broker: str | None, fleet: str
) -> AsyncIterator[Any]:
    if link == "serial":
        from qsched.lab.demo import PtyTransport

        async with PtyTransport(ports) as transport:
            yield transport
        return
    from qsched.protocol.links.config import MqttConfig, parse_host_port
    from qsched.protocol.links.mqtt import MqttTransport
    from qsched.protocol.topics import TopicMap

    assert broker is not None
    host, port = parse_host_port(broker)
    async with MqttTransport(MqttConfig(host=host, port=port), TopicMap(fleet=fleet)) as transport:
        await transport.wait_connected(10.0)
        yield transport


async def bench_one(
    config: BenchConfig, link: str, boards: int, broker: str | None = None
) -> BenchRow:
    """Time one fleet size on one link.

    Args:
        config: the benchmark's settings.
        link: ``mqtt`` or ``serial``.
        boards: how many boards.
        broker: ``HOST:PORT`` of the broker (MQTT only).

    Returns:
        The configuration's figures (``efficiency`` is filled in by ``run_bench``).
    """
    from qsched.daemon.engine import EngineConfig, StepEngine
    from qsched.daemon.fleet import Fleet
    from qsched.zo.workload import Workload
    from qsched.zo.zoo import model_summary

    yardstick = board_message_us()  # before any of this row's processes run
    computed_macs = model_summary(Workload.from_spec(_spec(config, 1)).model)[1]
    ideal = _ideal_step_s(config, boards, computed_macs)
    measured = min(
        config.max_steps, max(config.min_steps, math.ceil(config.window_s / max(ideal, 1e-3)))
    )
    spec = _spec(config, config.warmup_steps + measured)
    counter = ByteCounter()
    counter.steps = range(config.warmup_steps, config.warmup_steps + measured)  # the timed steps
    clock = _Clock(config.warmup_steps, measured, counter)
    fleet_name = f"bench-{link}-{boards}-{int(time.time() * 1000) % 10**9}"
    extra = ["--model-latency", config.model_latency]
    if not config.fleet_topic:
        extra.append("--no-fleet-topic")
    if config.host_uplink and link == "mqtt":
        extra.append("--host-uplink")
    meter = BrokerMeter(broker) if link != "serial" and broker is not None else None
    folder = tempfile.TemporaryDirectory(prefix="qsched-bench-hosts-")
    timelines = Path(folder.name)
    boards_process = (
        _bridged_boards(config, boards, broker, fleet_name, extra)
        if link == "bridge"
        else _hosted_boards(config, boards, broker, fleet_name, timelines)
        if link == "mqtt" and config.aggregate
        else board_processes(
            boards,
            mqtt=broker if link == "mqtt" else None,
            fleet=fleet_name,
            processes=config.processes,
            extra=extra,
            id_prefix="bench",
        )
    )
    with folder:
        async with (
            _metering(meter),
            boards_process as ports,
            _daemon_transport(link, ports, broker, fleet_name) as inner,
            CountingTransport(inner, counter) as transport,
            Fleet(transport) as fleet,
        ):
            await wait_for_boards(fleet, _daemon_boards(config, link, boards))
            knobs = EngineConfig(
                audit_every=1 if config.audit else 0,
                validate_on="daemon",
                pipeline=config.pipeline,
            )
            engine = StepEngine(spec, fleet, config=knobs, on_event=clock.on_event)
            clock.engine = engine
            result = await engine.run()
        hosts = [read_marks(path) for path in sorted(timelines.glob("host-*.json"))]
    first, last = config.warmup_steps, config.warmup_steps + measured
    start, end = clock.times[first], clock.times[last]
    step_s = (end - start) / measured
    per_type = {kind: count / measured for kind, count in sorted(counter.bytes.items())}
    return BenchRow(
        link=link,
        boards=boards,
        steps=measured,
        step_s=step_s,
        ideal_step_s=ideal,
        forward_passes_per_s=2 * config.q / step_s,
        payload_bytes_per_step=sum(v for k, v in per_type.items() if k != "other"),
        bytes_by_type=per_type,
        work=dict(sorted(result.work.items())),
        daemon_cpu_s_per_step=(clock.cpu[last] - clock.cpu[first]) / measured,
        others_cpu_s_per_step=(clock.others[last] - clock.others[first]) / measured,
        timeline_ms=counter.timeline.medians_ms(counter.steps),
        host_timeline_ms=counter.timeline.host_medians_ms(hosts, counter.steps),
        messages_per_step=counter.messages / measured,
        broker_publishes_per_s=None if meter is None else meter.rate(start, end),
        board_message_us=yardstick,
    )


class BrokerMeter:
    """The broker's own count of PUBLISH packets, read from its ``$SYS`` topics.

    Mosquitto publishes ``$SYS/broker/publish/messages/received`` and ``.../sent``
    every ``sys_interval`` seconds (1 on the private broker of this benchmark); the
    rate over a window is the counters' growth between the first and last reading in it.

    Args:
        broker: ``HOST:PORT``.
    """

    TOPIC: Final = "$SYS/broker/publish/messages/+"

    def __init__(self, broker: str) -> None:
        self.broker = broker
        self.readings: dict[str, list[tuple[float, int]]] = {"received": [], "sent": []}

    async def run(self) -> None:
        """Collect readings until cancelled (a broker without ``$SYS`` gives none)."""
        from qsched.protocol.links.config import MqttConfig, parse_host_port
        from qsched.protocol.links.mqtt import build_client

        host, port = parse_host_port(self.broker)
        client = build_client(MqttConfig(host=host, port=port), f"qsched-bench-meter-{port}")
        async with client:
            await client.subscribe(self.TOPIC, qos=0)
            async for message in client.messages:
                kind = message.topic.value.rsplit("/", 1)[-1]
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    value = int(bytes(message.payload).decode())
                    self.readings[kind].append((time.perf_counter(), value))

    def rate(self, start: float, end: float) -> float | None:
        """PUBLISH packets in and out per second between ``start`` and ``end``
        (``time.perf_counter``), None with fewer than two readings of each inside."""
        total = 0.0
        for readings in self.readings.values():
            inside = [r for r in readings if start <= r[0] <= end]
            if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
                return None
            total += (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
        return total


@contextlib.asynccontextmanager
async def _metering(meter: BrokerMeter | None) -> AsyncIterator[None]:
    if meter is None:
        yield
        return
    task = asyncio.create_task(meter.run(), name="bench.broker-meter")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


@contextlib.asynccontextmanager
async def _broker(config: BenchConfig) -> AsyncIterator[str | None]:
    if "mqtt" not in config.links and "bridge" not in config.links:
        yield None
    elif config.mqtt is not None:
        yield config.mqtt
    else:
        from qsched.lab.broker import MosquittoBroker

        # $SYS counters every second: the broker's message rate per configuration.
        async with MosquittoBroker(conf=["sys_interval 1"]) as broker:
            yield f"{broker.host}:{broker.port}"


async def run_bench(config: BenchConfig, on_row: Any = None) -> list[BenchRow]:
    """Run every (link, fleet size) of ``config`` in turn.

    Args:
        config: the benchmark's settings.
        on_row: called with each row as it is measured (progress output).

    Returns:
        The rows, with scaling efficiency against N times the one-board rate of the same
        link (or, without a one-board row, against the modelled one-board rate).
    """
    rows: list[BenchRow] = []
    async with _broker(config) as broker:
        for link in config.links:
            for boards in config.boards:
                row = await bench_one(config, link, boards, broker)
                rows.append(row)
                _fill_efficiency(rows, config)
                if on_row is not None:
                    on_row(row)
    return rows


def _fill_efficiency(rows: list[BenchRow], config: BenchConfig) -> None:
    for row in rows:
        single = next((r for r in rows if r.link == row.link and r.boards == 1), None)
        one_rate = (
            single.forward_passes_per_s
            if single is not None
            else 2 * config.q / _one_board_ideal(config, rows)
        )
        row.efficiency = row.forward_passes_per_s / (row.boards * one_rate)


def _one_board_ideal(config: BenchConfig, rows: list[BenchRow]) -> float:
    row = rows[0]
    # Ideal times are linear in the samples: scale this row's up to one board's.
    return row.ideal_step_s * _ideal_samples(config, 1) / _ideal_samples(config, row.boards)


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class ModelFacts:
    """The modelled and the computed model, for the report."""

    modelled: str
    modelled_macs: int
    modelled_params: int
    modelled_seconds: float
    computed: str
    computed_macs: int


def model_facts(config: BenchConfig) -> ModelFacts:
    """What the boards model and what they compute.

    Args:
        config: the benchmark's settings.

    Returns:
        Names, MACs, parameters and the modelled time per inference.
    """
    from qsched.firmware.virtual.board import LatencyProfile
    from qsched.zo.workload import Workload
    from qsched.zo.zoo import build_model, model_summary

    spec = _spec(config, 1)
    computed_params, computed_macs = model_summary(Workload.from_spec(spec).model)
    profile = LatencyProfile.named(config.model_latency)
    if profile.macs_per_forward is None:  # the boards model the model they compute
        return ModelFacts(
            f"{spec.model} (computed)",
            computed_macs,
            computed_params,
            profile.forward_seconds(computed_macs, 1),
            f"{spec.model} on {spec.dataset}",
            computed_macs,
        )
    params = computed_params
    if config.model_latency == "mobilenetv2-0.35-128":
        params = model_summary(build_model("mobilenetv2", (128, 128, 3), 1000, 0, width=0.35))[0]
    return ModelFacts(
        config.model_latency,
        profile.macs_per_forward,
        params,
        profile.forward_seconds(0, 1),
        f"{spec.model} on {spec.dataset}",
        computed_macs,
    )


def _si(value: float, unit: str) -> str:
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {prefix} {unit}"
    return f"{value:.0f} {unit}"


def _header(config: BenchConfig, facts: ModelFacts) -> list[str]:
    return [
        f"qsched bench fleet: q = {config.q} perturbations per step, two-sided, "
        f"batch {config.batch}, shard audit {'on' if config.audit else 'off'}",
        f"boards model the STM32N6 NPU running {facts.modelled} "
        f"({_si(facts.modelled_macs, 'MACs')}, "
        f"{facts.modelled_seconds * 1e3:.2f} ms per inference, "
        f"{_si(facts.modelled_params, 'parameters')}); "
        f"batch {config.batch}: {facts.modelled_seconds * config.batch * 1e3:.2f} ms "
        "of NPU time per forward pass",
        f"and compute {facts.computed} ({_si(facts.computed_macs, 'MACs')}) instead, "
        "sleeping the rest, so the host CPU is not the bottleneck",
    ]


def format_row(row: BenchRow, facts: ModelFacts) -> str:
    """One table line (see ``format_report`` for the columns)."""
    gradient = 2 * row.boards * facts.modelled_params
    efficiency = "" if row.efficiency is None else f"{row.efficiency:.3f}"
    rate = row.broker_publishes_per_s
    broker = "" if rate is None else f"{rate:,.0f}"
    yardstick = "" if row.board_message_us is None else f"{row.board_message_us:.1f}"
    return (
        f"{row.link:<7}{row.boards:>6}{row.steps:>6}"
        f"{row.step_s * 1e3:>9.1f}{row.ideal_step_s * 1e3:>9.1f}"
        f"{row.overhead_s * 1e3:>10.1f}{row.forward_passes_per_s:>10.1f}{efficiency:>8}"
        f"{row.daemon_cpu_s_per_step * 1e3:>8.1f}{row.others_cpu_s_per_step * 1e3:>8.1f}"
        f"{row.messages_per_step:>7.0f}{broker:>10}"
        f"{row.payload_bytes_per_step:>12,.0f}{gradient * 4:>15,}{yardstick:>8}"
    )


_COLUMNS: Final = (
    f"{'link':<7}{'boards':>6}{'steps':>6}{'step ms':>9}{'ideal':>9}"
    f"{'overhead':>10}{'fwd/s':>10}{'eff.':>8}{'cpu ms':>8}{'rest ms':>8}{'msgs':>7}"
    f"{'broker/s':>10}"
    f"{'payload B':>12}{'grad fp32 B':>15}{'ref us':>8}"
)


def format_notes(rows: Sequence[BenchRow], facts: ModelFacts) -> list[str]:
    """The lines under the table: what the columns mean and the fleet's floors."""
    lines = [
        "step ms: mean measured step; ideal: modelled NPU time of the largest shard; "
        "overhead: the difference",
        "eff.: forward passes per second over N x the one-board rate of the same link "
        "(without a one-board row: the modelled one-board rate)",
        "batch: samples per forward pass "
        "(--batch; 1 is the worst case, every pass pays its fixed costs alone)",
        "cpu ms: the daemon's CPU time per step (this process); rest ms: that of the "
        "other processes (boards, bridges, relays, broker) per step, on the same cores",
        "msgs: step messages the daemon sends and receives per step (a step order once)",
        "broker/s: PUBLISH packets the broker received and sent per second ($SYS; "
        "a step order counts once in, once per board out; blank where fewer than two of "
        "the broker's readings, 1-2 s apart, fell inside the measured steps)",
        "payload B: codec bytes of eval requests and results, updates (or step orders) and "
        "acks per step that the daemon sends and receives",
        f"grad B: shipping fp32 gradients instead, 2 x boards x {facts.modelled_params:,} "
        "parameters x 4",
        "ref us: this machine's time for one board's messages of a step (a request decoded, "
        "a result built, encoded and decoded), taken before the row; at large fleets the "
        "overhead grows with it, so compare rows of different machines or hours by it",
    ]
    for row in rows:
        if row.timeline_ms:
            marks = ", ".join(f"{k} {v:.1f}" for k, v in row.timeline_ms.items())
            lines.append(f"timeline, {row.link} {row.boards} boards, ms after the update: {marks}")
        if row.host_timeline_ms:
            marks = ", ".join(f"{k} {v:.1f}" for k, v in row.host_timeline_ms.items())
            lines.append(
                f"hosts' timeline, {row.link} {row.boards} boards, ms after the update: {marks}"
            )
    return lines + floor_verdicts(rows)


def floor_verdicts(rows: Sequence[BenchRow]) -> list[str]:
    """One line per fleet target the rows measure (``FLEET_FLOORS``, ``DAEMON_CPU_FLOOR``)."""
    mqtt = {r.boards: r for r in rows if r.link == "mqtt"}
    lines = []
    for boards, least in FLEET_FLOORS.items():
        row = mqtt.get(boards)
        if row is not None and row.efficiency is not None:
            verdict = "met" if row.efficiency >= least else "NOT met"
            lines.append(
                f"floor: efficiency >= {least} at {boards} boards over MQTT: "
                f"{verdict} ({row.efficiency:.3f})"
            )
    small, large, most = DAEMON_CPU_FLOOR
    if small in mqtt and large in mqtt and mqtt[small].daemon_cpu_s_per_step > 0:
        ratio = mqtt[large].daemon_cpu_s_per_step / mqtt[small].daemon_cpu_s_per_step
        verdict = "met" if ratio <= most else "NOT met"
        lines.append(
            f"floor: daemon CPU per step at {large} boards <= {most:g} x that at {small}: "
            f"{verdict} ({ratio:.2f} x)"
        )
    return lines


def format_report(rows: Sequence[BenchRow], config: BenchConfig, facts: ModelFacts) -> str:
    """The whole report: header, table, notes and the efficiency floor."""
    table = [_COLUMNS, *(format_row(r, facts) for r in rows)]
    return "\n".join([*_header(config, facts), "", *table, "", *format_notes(rows, facts)])


def _floor(rows: Sequence[BenchRow]) -> float | None:
    row = next((r for r in rows if r.link == "mqtt" and r.boards == FLOOR_BOARDS), None)
    return row.efficiency if row is not None else None


# --------------------------------------------------------------------------- command line


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(","))
    if not values or any(v < 1 or v > MAX_BOARDS for v in values):
        raise argparse.ArgumentTypeError(
            f"want a comma list of board counts in 1..{MAX_BOARDS}, got {text!r}"
        )
    return values


def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"want a comma list of batch sizes >= 1, got {text!r}")
    return values


def _links(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(","))
    if not values or any(v not in ALL_LINKS for v in values):
        raise argparse.ArgumentTypeError(
            f"want a comma list of {', '.join(ALL_LINKS)}, got {text!r}"
        )
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qsched bench fleet", description="Time ZO steps on fleets of virtual boards."
    )
    p.add_argument(
        "--boards", type=_int_list, default=(1, 2, 4, 8), help="fleet sizes (default 1,2,4,8)"
    )
    p.add_argument(
        "--links",
        type=_links,
        default=LINKS,
        help="mqtt, serial (default: both) and/or bridge (serial boards behind --bridges "
        "qsched bridge processes, the daemon on MQTT)",
    )
    p.add_argument(
        "--bridges", type=int, default=4, help="bridge processes of the bridge link (default 4)"
    )
    p.add_argument(
        "--aggregate",
        action="store_true",
        help="each bridge (qsched bridge --aggregate) or, over MQTT, each board process "
        "presents its boards as one board",
    )
    p.add_argument("--q", type=int, default=64, help="perturbations per step (default 64)")
    p.add_argument(
        "--batch",
        type=_batches,
        default=DEFAULT_BATCHES,
        help="samples per forward pass, a comma list run one after the other (default 4,1: "
        "a small minibatch, then the worst case of one sample per pass)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=BenchConfig.window_s,
        help=f"measured seconds per configuration (default {BenchConfig.window_s:g})",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=BenchConfig.warmup_steps,
        help=f"unmeasured steps first (default {BenchConfig.warmup_steps})",
    )
    p.add_argument(
        "--min-steps",
        type=int,
        default=BenchConfig.min_steps,
        help=f"fewest measured steps (default {BenchConfig.min_steps})",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=BenchConfig.max_steps,
        help=f"most measured steps (default {BenchConfig.max_steps}; with a longer --seconds, "
        "more give steadier figures for large fleets, whose steps are short)",
    )
    p.add_argument(
        "--model-latency", default="mobilenetv2-0.35-128", help="the boards' latency model"
    )
    p.add_argument("--audit", action="store_true", help="keep the shard audit on")
    p.add_argument(
        "--no-pipeline",
        action="store_true",
        help="wait for every update ack before the next step's requests (the engine's old way)",
    )
    p.add_argument(
        "--host-uplink",
        action="store_true",
        help="each board process sends its boards' messages in one batch per moment",
    )
    p.add_argument(
        "--no-fleet-topic",
        action="store_true",
        help="send every board its own update and request instead of one step order",
    )
    p.add_argument(
        "--mqtt", metavar="HOST:PORT", help="use this broker instead of a private Mosquitto"
    )
    p.add_argument(
        "--board-processes", type=int, default=1, help="processes hosting the boards (default 1)"
    )
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    p.add_argument(
        "--log",
        type=Path,
        help="write the daemon's log (info and up) here (default: warnings to stderr)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when the 8-board MQTT efficiency floor is missed (first --batch)",
    )
    return p


def _config(args: argparse.Namespace) -> BenchConfig:
    if (
        min(args.q, args.warmup, args.min_steps, args.board_processes, args.bridges) < 1
        or args.seconds <= 0
        or args.max_steps < args.min_steps
    ):
        raise ValueError(
            "--q, --batch, --warmup, --min-steps, --board-processes and --bridges must be "
            "at least 1, --seconds positive, --max-steps at least --min-steps"
        )
    return BenchConfig(
        boards=args.boards,
        links=args.links,
        q=args.q,
        batch=args.batch[0],
        window_s=args.seconds,
        warmup_steps=args.warmup,
        min_steps=args.min_steps,
        max_steps=args.max_steps,
        model_latency=args.model_latency,
        audit=args.audit,
        mqtt=args.mqtt,
        processes=args.board_processes,
        pipeline=not args.no_pipeline,
        fleet_topic=not args.no_fleet_topic,
        host_uplink=args.host_uplink,
        bridges=args.bridges,
        aggregate=args.aggregate,
    )


@contextlib.contextmanager
def _quiet_logs(path: Path | None) -> Iterator[None]:
    """Keep the daemon's log out of the table: into ``path`` (info and up), or warnings
    only; the logging set-up before is restored afterwards."""
    import aiomqtt  # noqa: F401 (sets its logger's level on import: before ours)

    from qsched.daemon.logging import configure_logging

    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with contextlib.ExitStack() as stack:
        if path is None:
            configure_logging("warning")
            # The MQTT client's backpressure notes ("pending publish calls") are not news here.
            stack.callback(logging.getLogger("mqtt").setLevel, logging.getLogger("mqtt").level)
            logging.getLogger("mqtt").setLevel(logging.ERROR)
        else:
            configure_logging(
                "info", json=True, stream=stack.enter_context(path.open("a", encoding="utf-8"))
            )
        try:
            yield
        finally:
            structlog.configure(**saved)
            root.handlers[:] = handlers
            root.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qsched bench fleet``.

    Args:
        argv: the arguments after ``qsched bench fleet``.

    Returns:
        0; 1 with ``--check`` when the floor is missed; 2 on bad options.
    """
    args = _parser().parse_args(list(argv) if argv is not None else None)
    try:
        configs = [replace(_config(args), batch=b) for b in args.batch]
        facts = model_facts(configs[0])
    except ValueError as exc:
        print(f"qsched bench fleet: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    floors: list[float] = []
    dumped: list[dict[str, Any]] = []
    for i, config in enumerate(configs):
        print("\n".join([*([""] if i else []), *_header(config, facts), "", _COLUMNS]), flush=True)
        with sigterm_as_interrupt(), _quiet_logs(args.log):
            rows = asyncio.run(
                run_bench(config, on_row=lambda row: print(format_row(row, facts), flush=True))
            )
        print("\n".join(["", *format_notes(rows, facts)]), flush=True)
        dumped += [{**asdict(r), "overhead_s": r.overhead_s, "batch": config.batch} for r in rows]
        floor = _floor(rows)
        if floor is not None:
            floors.append(floor)
    print(f"({time.perf_counter() - started:.0f} s in all)")
    if args.json is not None:
        args.json.write_text(json.dumps(dumped, indent=2) + "\n")
    # The floor is a promise for the first (default: the realistic minibatch) batch size.
    return 1 if args.check and floors and floors[0] < EFFICIENCY_FLOOR else 0
