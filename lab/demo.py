"""``qsched demo``: train the default job on four virtual boards, no set-up needed.

    qsched demo                                  # 4 boards on serial pseudo-terminals
    qsched demo --steps 200 --out runs/try1      # a shorter run, files in runs/try1
    qsched demo --mqtt 127.0.0.1:1883            # the same over an MQTT broker

The boards are real ``qsched board`` processes: on serial links each gets one end of a
pseudo-terminal (``os.openpty()``) and the daemon side speaks the serial framing on the
other end; with ``--mqtt`` they connect to the broker as a fleet of their own. The job is
``JobSpec()`` — the embedded defaults (digits, INT8, the QScheduler) — run by the
daemon's step engine. A live progress line shows step, q, loss, accuracy and boards; a
summary follows, and the run folder holds the metrics log, a plot of validation accuracy
and q against step, and the trained model as ``.tflite``.

The helpers for board processes (``board_processes``) and pty links (``PtyTransport``)
are shared with ``qsched bench fleet``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tty
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, Self, TextIO

import structlog

from qsched.lab.errors import DemoError
from qsched.lab.procs import qsched_argv, sigterm_as_interrupt
from qsched.lab.progress import ProgressLine, format_duration
from qsched.protocol.links.base import (
    EVENT_QUEUE_SIZE,
    BoardAppeared,
    BoardGone,
    LinkEvent,
    close_queue,
    iterate_queue,
)
from qsched.protocol.links.config import parse_host_port
from qsched.protocol.links.serial import FdStream, SerialLink

__all__ = [
    "BOARD_START_TIMEOUT_S",
    "DemoError",
    "DemoOptions",
    "DemoSummary",
    "PtyPort",
    "PtyTransport",
    "board_processes",
    "main",
    "open_ptys",
    "q_trajectory",
    "run_demo",
    "stop_processes",
    "wait_for_boards",
]

_log = structlog.get_logger("qsched.demo")

BOARD_START_TIMEOUT_S: Final = 60.0  # importing numpy & co. on a busy 2-core machine
BOARD_STOP_TIMEOUT_S: Final = 5.0
DEFAULT_BOARDS: Final = 4
PLOT_FILE: Final = "training.png"
SUMMARY_FILE: Final = "summary.json"
METRICS_FILE: Final = "metrics.jsonl"


# --------------------------------------------------------------------------- pseudo-terminals


@dataclass
class PtyPort:
    """One pseudo-terminal: ``path`` is the board's serial port, ``master`` the daemon's end.

    The slave descriptor stays open here while the port is in use, so the master does not
    read a hang-up before the board process opens the path.
    """

    master: int
    slave: int
    path: str
    taken: bool = False  # the master belongs to a link now, which closes it

    def take_master(self) -> int:
        """Hand the master descriptor to its new owner."""
        self.taken = True
        return self.master

    def close(self) -> None:
        """Close what this object still owns (idempotent)."""
        for fd in (self.slave,) if self.taken else (self.slave, self.master):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.taken = True
        self.slave = -1


def open_ptys(count: int) -> list[PtyPort]:
    """Open ``count`` raw pseudo-terminals (no echo, no line editing).

    Args:
        count: how many.

    Returns:
        The ports; close each with ``PtyPort.close``.
    """
    ports: list[PtyPort] = []
    try:
        for _ in range(count):
            master, slave = os.openpty()
            ports.append(PtyPort(master, slave, os.ttyname(slave)))
            tty.setraw(slave)
    except OSError:
        for port in ports:
            port.close()
        raise
    return ports


class PtyTransport:
    """Serial links on the daemon's ends of pseudo-terminals, as a link ``Transport``.

    Each port's master becomes a ``SerialLink`` (``serial:<path>``), reported as a board
    when the transport is entered and gone when its board closes the port.

    Args:
        ports: the pseudo-terminals (their masters are taken over).
        link_options: ``ack_timeout``, ``max_retries``, ``queue_size`` of each link.
    """

    name = "serial"

    def __init__(self, ports: Sequence[PtyPort], **link_options: float | int) -> None:
        self.ports = list(ports)
        self.links: list[SerialLink] = []
        self._options: dict[str, Any] = link_options  # SerialLink's keyword options
        self._events: asyncio.Queue[object] = asyncio.Queue(EVENT_QUEUE_SIZE)
        self._watchers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        for port in self.ports:
            address = f"serial:{port.path}"
            link = SerialLink(address, FdStream(port.take_master()), **self._options)
            await link.__aenter__()
            self.links.append(link)
            self._events.put_nowait(BoardAppeared(address, link, self.name))
            self._watchers.append(
                asyncio.create_task(self._watch(link), name=f"pty[{port.path}].watch")
            )
        return self

    async def _watch(self, link: SerialLink) -> None:
        reason = await link.wait_closed()
        await self._events.put(BoardGone(link.board_id, reason, self.name))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for watcher in self._watchers:
            watcher.cancel()
        for link in self.links:
            await link.close("shutdown")
        await asyncio.gather(*self._watchers, return_exceptions=True)
        close_queue(self._events)

    async def events(self) -> AsyncIterator[LinkEvent]:
        """``BoardAppeared`` for every port, ``BoardGone`` when its board hangs up."""
        async for event in iterate_queue(self._events):
            yield event


# --------------------------------------------------------------------------- board processes


def _board_command(args: Sequence[str]) -> list[str]:
    return qsched_argv("board", *args, log_level="warning")


@contextlib.asynccontextmanager
async def board_processes(
    count: int,
    *,
    mqtt: str | None = None,
    fleet: str = "default",
    processes: int | None = None,
    extra: Sequence[str] = (),
    log: IO[bytes] | None = None,
    id_prefix: str = "vb",
) -> AsyncIterator[list[PtyPort]]:
    """Start ``count`` virtual boards as ``qsched board`` processes; stop them on exit.

    Args:
        count: how many boards.
        mqtt: ``HOST:PORT`` of a broker: the boards join fleet ``fleet`` there (one
            process); None: each board gets a pseudo-terminal (yielded).
        fleet: the MQTT fleet name.
        processes: how many ``qsched board`` processes share the boards (default: one
            per serial board; one for MQTT).
        extra: more ``qsched board`` options (latency, speed, faults).
        log: where the processes' output goes (None: discarded).
        id_prefix: board ids are ``<prefix>-00``, ``<prefix>-01``, ...

    Returns:
        An async context manager yielding the pseudo-terminals (empty with MQTT).
    """
    out = log if log is not None else subprocess.DEVNULL
    ports = [] if mqtt is not None else open_ptys(count)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for args in _board_argv(count, ports, mqtt, fleet, processes, id_prefix):
            procs.append(
                subprocess.Popen(
                    _board_command([*args, *extra]),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    start_new_session=True,
                )
            )
        yield ports
    finally:
        await asyncio.to_thread(stop_processes, procs)
        for port in ports:
            port.close()


def _board_argv(
    count: int,
    ports: list[PtyPort],
    mqtt: str | None,
    fleet: str,
    processes: int | None,
    prefix: str,
) -> list[list[str]]:
    """One argument list per process; boards are dealt to processes in contiguous groups."""
    n = max(1, min(count, processes or (1 if mqtt is not None else count)))
    width = max(2, len(str(count - 1)))
    out: list[list[str]] = []
    start = 0
    for group in range(n):
        size = count // n + (1 if group < count % n else 0)
        # Ids stay unique across processes: a group's prefix carries its number.
        group_prefix = prefix if n == 1 else f"{prefix}{group}"
        if mqtt is not None:
            out.append(
                [
                    "--mqtt",
                    mqtt,
                    "--fleet",
                    fleet,
                    "--count",
                    str(size),
                    "--id-prefix",
                    group_prefix,
                ]
            )
        elif size == 1:
            out.append(["--serial", ports[start].path, "--id", f"{prefix}-{start:0{width}d}"])
        else:
            paths = [arg for port in ports[start : start + size] for arg in ("--serial", port.path)]
            out.append([*paths, "--id-prefix", group_prefix])
        start += size
    return out


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process still running, wait for them (bounded), kill the rest."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + BOARD_STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _log.warning("board process did not stop; killing it", pid=proc.pid)
            proc.kill()
            proc.wait(BOARD_STOP_TIMEOUT_S)


async def wait_for_boards(fleet: Any, count: int, timeout: float = BOARD_START_TIMEOUT_S) -> None:
    """Wait until ``count`` boards of ``fleet`` have said Hello.

    Raises:
        DemoError: fewer boards within ``timeout`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        hellos = sum(1 for s in fleet.sessions.values() if s.hello is not None)
        if hellos >= count:
            return
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise DemoError(f"only {hellos} of {count} boards said hello within {timeout:.0f} s")
        await fleet.wait_changed(min(0.5, remaining))


# --------------------------------------------------------------------------- the run


@dataclass
class DemoOptions:
    """What ``qsched demo`` runs (defaults: the embedded ones).

    Args:
        steps: override ``JobSpec.steps`` (None: the spec's default).
        boards: how many virtual boards.
        out: the run folder (None: ``runs/demo-<timestamp>``).
        mqtt: ``HOST:PORT`` of a broker to use instead of serial pseudo-terminals.
        one_process: serial boards in one process instead of one each.
        model_latency: the boards' ``--model-latency``.
        overrides: more spec fields (``{"seed": 3}``).
        progress: show the live progress line.
    """

    steps: int | None = None
    boards: int = DEFAULT_BOARDS
    out: Path | None = None
    mqtt: str | None = None
    one_process: bool = False
    model_latency: str = "computed"
    overrides: dict[str, Any] = field(default_factory=dict)
    progress: bool = True


@dataclass
class DemoSummary:
    """How the demo went, as printed and as written to ``summary.json``."""

    out: Path
    link: str
    boards: int
    steps: int
    forward_passes: int
    final_accuracy: float | None
    best_accuracy: float | None
    best_step: int | None
    final_train_loss: float | None
    q_trajectory: list[tuple[int, int]]
    wall_s: float
    train_wall_s: float
    work: dict[str, int]
    faults: int
    reassigned: int
    status: str
    files: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready mapping."""
        data = dict(self.__dict__)
        data["out"] = str(self.out)
        data["q_trajectory"] = [list(pair) for pair in self.q_trajectory]
        return data


def q_trajectory(qs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (step, q) points where q changed, starting with the first step.

    Args:
        qs: (step, q) of every step, in order.

    Returns:
        The change points.
    """
    out: list[tuple[int, int]] = []
    for step, q in qs:
        if not out or out[-1][1] != q:
            out.append((step, q))
    return out


def _default_out() -> Path:
    return Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")


def _make_spec(options: DemoOptions) -> Any:
    from qsched.protocol.jobspec import JobSpec

    data: dict[str, Any] = {"name": "demo", **options.overrides}
    if options.steps is not None:
        data["steps"] = options.steps
    return JobSpec.model_validate(data)


class _Live:
    """Turns engine and fleet events into the progress line and notes."""

    def __init__(self, bar: ProgressLine | None, fleet: Any, boards: int) -> None:
        self.bar = bar
        self.fleet = fleet
        self.boards = boards
        self.accuracy: float | None = None

    def ready(self) -> str:
        ready = sum(1 for s in self.fleet.sessions.values() if s.state in ("ready", "busy"))
        return f"{ready}/{self.boards}"

    def on_event(self, event: Any) -> None:
        if event.kind == "validation":
            self.accuracy = event.metrics.get("val_accuracy", self.accuracy)
        if self.bar is None:
            return
        if event.kind == "step" and event.step is not None:
            metrics = event.metrics
            self.bar.update(
                event.step + 1,
                q=int(metrics.get("q", 0)),
                loss=metrics.get("train_loss"),
                acc=self.accuracy,
                boards=self.ready(),
            )
        elif event.kind in ("board_left", "board_faulty", "board_resynced"):
            self.bar.note(
                f"  {event.kind.replace('_', ' ')}: {event.board_id} {event.message}".rstrip()
            )

    def on_fleet_event(self, event: Any) -> None:
        from qsched.daemon.engine import fleet_event

        self.on_event(fleet_event(event, "demo"))


@contextlib.asynccontextmanager
async def _transport(
    options: DemoOptions, ports: list[PtyPort], fleet_name: str
) -> AsyncIterator[Any]:
    if options.mqtt is None:
        async with PtyTransport(ports) as transport:
            yield transport
        return
    from qsched.protocol.links.config import MqttConfig
    from qsched.protocol.links.mqtt import MqttTransport
    from qsched.protocol.topics import TopicMap

    host, port = parse_host_port(options.mqtt)
    cfg = MqttConfig(host=host, port=port, reconnect_min_s=0.2)
    async with MqttTransport(
        cfg, TopicMap(fleet=fleet_name), identifier=f"qsched-demo-{fleet_name}"
    ) as mqtt:
        try:
            await mqtt.wait_connected(10.0)
        except TimeoutError as exc:
            raise DemoError(f"MQTT broker {options.mqtt} not reachable") from exc
        yield mqtt


async def run_demo(options: DemoOptions, stream: TextIO | None = None) -> DemoSummary:
    """Run the demo: boards, training, files.

    Args:
        options: what to run.
        stream: where the progress line goes (standard error by default).

    Returns:
        The summary (also written to ``summary.json`` in the run folder).

    Raises:
        DemoError: boards did not start or the broker is unreachable.
        JobError: training failed.
    """
    from qsched.daemon.engine import StepEngine
    from qsched.daemon.fleet import Fleet
    from qsched.daemon.state import JobDir, atomic_write

    started = time.perf_counter()
    spec = _make_spec(options)
    out = options.out or _default_out()
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "spec.json", (spec.model_dump_json(indent=2) + "\n").encode())
    fleet_name = f"demo-{os.getpid()}-{int(time.time())}"
    link = f"MQTT {options.mqtt}" if options.mqtt else "serial pseudo-terminals"
    bar = ProgressLine(spec.steps, label="demo", stream=stream) if options.progress else None
    # The boards hold the job's data set under the name the daemon selects it by
    # (``eurosat:size=32`` is selected as ``eurosat32``), not only the built-in ones.
    from qsched.zo.datasets import load_dataset

    held = f"{load_dataset(spec.dataset).name}={spec.dataset}"
    extra = ["--model-latency", options.model_latency, "--dataset", held]
    with open(out / "boards.log", "wb") as board_log:
        async with (
            board_processes(
                options.boards,
                mqtt=options.mqtt,
                fleet=fleet_name,
                processes=1 if options.one_process else None,
                extra=extra,
                log=board_log,
            ) as ports,
            _transport(options, ports, fleet_name) as transport,
        ):
            live = _Live(bar, None, options.boards)
            async with Fleet(transport, on_event=live.on_fleet_event) as fleet:
                live.fleet = fleet
                if bar is not None:
                    bar.note(f"qsched demo: starting {options.boards} virtual boards on {link} ...")
                await wait_for_boards(fleet, options.boards)
                engine = StepEngine(spec, fleet, job_dir=JobDir(out), on_event=live.on_event)
                try:
                    result = await engine.run()
                finally:
                    if bar is not None:
                        bar.close()
                    live.bar = None  # boards leaving at shutdown is no news
    files = await asyncio.to_thread(_write_files, out, engine, result)
    summary = _summary(out, link, options.boards, result, files, time.perf_counter() - started)
    atomic_write(out / SUMMARY_FILE, (json.dumps(summary.to_json(), indent=2) + "\n").encode())
    summary.files[SUMMARY_FILE] = "this summary"
    return summary


def _summary(
    out: Path, link: str, boards: int, result: Any, files: dict[str, str], wall_s: float
) -> DemoSummary:
    evals = result.evals
    best = max(evals, key=lambda e: e.val_accuracy) if evals else None
    steps = result.steps
    return DemoSummary(
        out=out,
        link=link,
        boards=boards,
        steps=len(steps),
        forward_passes=result.train.forward_passes,
        final_accuracy=evals[-1].val_accuracy if evals else None,
        best_accuracy=best.val_accuracy if best else None,
        best_step=best.step + 1 if best else None,
        final_train_loss=steps[-1].train_loss if steps else None,
        q_trajectory=q_trajectory([(s.step, s.q) for s in steps]),
        wall_s=round(wall_s, 3),
        train_wall_s=round(result.train.wall_s, 3),
        work=dict(sorted(result.work.items())),
        faults=result.faults,
        reassigned=result.reassigned,
        status=result.status,
        files=files,
    )


# --------------------------------------------------------------------------- files


def _write_files(out: Path, engine: Any, result: Any) -> dict[str, str]:
    files = {METRICS_FILE: "metrics log (JSON lines: one record per step and per validation)"}
    files[_export_model(out, engine.workload, result.state)] = "the trained model (INT8 .tflite)"
    plot_training(out / PLOT_FILE, result.steps, result.evals)
    files[PLOT_FILE] = "validation accuracy and q against step"
    files["checkpoints/"] = "checkpoints (resumable)"
    files["boards.log"] = "the board processes' output"
    if (out / "demo.log").exists():  # absent with --verbose (the log went to standard error)
        files["demo.log"] = "the daemon's log (JSON lines)"
    return files


def _export_model(out: Path, workload: Any, state: Any) -> str:
    from qsched.zo.tflite_io import write_tflite

    if workload.int8:
        qmodel = workload.to_quant_model(state)
    else:  # an FP32 job is quantised for the microcontroller file
        from qsched.zo.quantize import quantize_model

        qmodel = quantize_model(workload.to_model(state), workload.dataset.x_train[:256])
    name = "model.tflite"
    write_tflite(out / name, qmodel)
    return name


def plot_training(path: Path, steps: Sequence[Any], evals: Sequence[Any]) -> None:
    """A PNG of validation accuracy and q against step (two y axes).

    Args:
        path: the PNG to write.
        steps: step records (``step``, ``q``).
        evals: validation records (``step``, ``val_accuracy``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, acc_ax = plt.subplots(figsize=(7.0, 4.0))
    try:
        acc_ax.plot(
            [e.step + 1 for e in evals],
            [e.val_accuracy for e in evals],
            color="tab:blue",
            label="validation accuracy",
        )
        acc_ax.set_xlabel("step")
        acc_ax.set_ylabel("validation accuracy", color="tab:blue")
        acc_ax.set_ylim(0.0, 1.0)
        acc_ax.grid(alpha=0.3)
        q_ax = acc_ax.twinx()
        q_ax.step(
            [s.step for s in steps], [s.q for s in steps], where="post", color="tab:red", label="q"
        )
        q_ax.set_ylabel("q (perturbations per step)", color="tab:red")
        q_ax.set_ylim(bottom=0)
        acc_ax.set_title("qsched demo: zeroth-order training on virtual boards")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- command line


def _format_summary(s: DemoSummary) -> str:
    def acc(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    trajectory = " -> ".join(
        f"{q} (step {step})" if i else str(q) for i, (step, q) in enumerate(s.q_trajectory)
    )
    work = ", ".join(f"{board} {keys}" for board, keys in s.work.items()) or "none"
    lines = [
        f"qsched demo: {s.status}, {s.steps} steps on {s.boards} virtual boards over {s.link}",
        f"  final val accuracy  {acc(s.final_accuracy)}   best {acc(s.best_accuracy)}"
        + (f" after step {s.best_step}" if s.best_step else ""),
        f"  final train loss    {s.final_train_loss:.4f}" if s.final_train_loss is not None else "",
        f"  forward passes      {s.forward_passes} (perturbed passes over a minibatch)",
        f"  q trajectory        {trajectory or 'n/a'}",
        f"  keys per board      {work}",
        f"  faults, reassigned  {s.faults}, {s.reassigned}",
        f"  wall time           {format_duration(s.wall_s)} ({s.train_wall_s:.1f} s training)",
        f"  files in {s.out}/",
        *(f"    {name:<16}{what}" for name, what in s.files.items()),
    ]
    return "\n".join(line for line in lines if line)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qsched demo", description="Train the default job on virtual boards."
    )
    p.add_argument("--steps", type=int, help="training steps (default: the job spec's default)")
    p.add_argument("--boards", type=int, default=DEFAULT_BOARDS, help="virtual boards (default 4)")
    p.add_argument("--out", type=Path, help="run folder (default: runs/demo-<timestamp>)")
    p.add_argument(
        "--mqtt", metavar="HOST:PORT", help="run over this MQTT broker instead of serial ptys"
    )
    p.add_argument(
        "--one-process", action="store_true", help="serial boards in one process, not one each"
    )
    p.add_argument(
        "--model-latency",
        default="computed",
        help="boards' NPU time model: computed, off, or a model",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a job spec field"
    )
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.add_argument(
        "--verbose", action="store_true", help="daemon logs on standard error (default: demo.log)"
    )
    return p


def _options(args: argparse.Namespace) -> DemoOptions:
    if args.steps is not None and args.steps < 1:
        raise ValueError("--steps must be at least 1")
    if not 1 <= args.boards <= 64:
        raise ValueError("--boards must be in 1..64")
    if args.mqtt is not None:
        parse_host_port(args.mqtt)
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set wants KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except ValueError:
            overrides[key] = value  # a bare word such as fp32
    return DemoOptions(
        steps=args.steps,
        boards=args.boards,
        out=args.out,
        mqtt=args.mqtt,
        one_process=args.one_process,
        model_latency=args.model_latency,
        overrides=overrides,
        progress=not args.no_progress,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qsched demo``.

    Args:
        argv: the arguments after ``qsched demo``.

    Returns:
        0 on success, 1 when the run failed, 2 on bad options.
    """
    from pydantic import ValidationError

    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        options = _options(args)
        spec = _make_spec(options)  # a bad --set fails here, before any board starts
    except (ValueError, ValidationError) as exc:
        print(f"qsched demo: {exc}", file=sys.stderr)
        return 2
    problem = _unrunnable(spec)
    if problem is not None:
        print(f"qsched demo: the job cannot run: {problem}", file=sys.stderr)
        return 2
    options.out = options.out or _default_out()
    options.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if not args.verbose:
            stack.enter_context(_log_to_file(options.out / "demo.log"))
        try:
            with sigterm_as_interrupt():
                summary = asyncio.run(run_demo(options))
        except DemoError as exc:
            print(f"qsched demo: {exc} (see {options.out}/boards.log)", file=sys.stderr)
            return 1
        except Exception as exc:
            from qsched.daemon.engine import JobError

            if isinstance(exc, JobError):
                print(f"qsched demo: training failed: {exc}", file=sys.stderr)
                return 1
            raise
    print(_format_summary(summary))
    return 0 if summary.status == "completed" else 1


def _unrunnable(spec: Any) -> str | None:
    """Why the job's model, data or policy cannot be built (None: they can), before any
    board starts or any folder is made: a missing backbone file, an unknown option."""
    from qsched.policies import PolicyError, validate_policy_config
    from qsched.zo.workload import Workload

    try:
        validate_policy_config(spec.policy.name, spec.policy.config)
        Workload.from_spec(spec)
    except OSError as exc:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc)
    except (ValueError, PolicyError) as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def _log_to_file(path: Path) -> Iterator[None]:
    """Daemon logs go to the run folder while the demo runs, so the terminal shows the
    progress line only; standard error gets them back afterwards."""
    from qsched.daemon.logging import configure_logging

    level = os.environ.get("QSCHED_LOG_LEVEL", "info").lower()
    level = level if level in ("debug", "info", "warning", "error") else "info"
    with open(path, "a", encoding="utf-8") as stream:
        configure_logging(level, json=True, stream=stream)
        try:
            yield
        finally:
            configure_logging(level)
