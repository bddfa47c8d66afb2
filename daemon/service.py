"""``qsched daemon``: transports, the fleet, one job at a time, the control API, state.

    async with Daemon(load_config()) as daemon:     # or: await Daemon(cfg).run()
        await daemon.wait_stopped()

The daemon enters its transports (MQTT when enabled, serial ports when configured, any
extra ones given, e.g. in-process for tests) as one ``MultiTransport``, keeps the
``Fleet`` on them, answers control commands from ``<prefix>/<fleet>/control/request``
(``control.py``), publishes events, a retained ``StatusReport`` on
``<prefix>/<fleet>/status`` and its retained presence, and runs jobs with the
``StepEngine``. Jobs live in the state directory (``state.py``): on start the daemon
resumes the job that was running, from its newest checkpoint. SIGTERM and SIGINT
checkpoint the job and exit cleanly (the job stays ``running`` on disk and resumes
next time); systemd hears READY, STATUS, WATCHDOG and STOPPING (``notify.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import structlog
from aiomqtt import MqttError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from qsched.daemon.config import DaemonConfig, load_config
from qsched.daemon.control import ControlError, handle_payload
from qsched.daemon.engine import EngineConfig, JobError, StepEngine, fleet_event
from qsched.daemon.errors import FleetTakenError, InstanceError
from qsched.daemon.export import ExportError, default_format, export_model
from qsched.daemon.fleet import Fleet, FleetEvent
from qsched.daemon.heap import settle_heap
from qsched.daemon.instance import (
    EXIT_ANOTHER_INSTANCE,
    EXIT_FLEET_TAKEN,
    InstanceLock,
    check_fleet_free,
)
from qsched.daemon.notify import Notifier
from qsched.daemon.state import JobDir, StateDirError, StateStore
from qsched.policies import PolicyError, validate_policy_config
from qsched.protocol.control import (
    ChangePolicy,
    ControlErrorCode,
    ErrorReply,
    Event,
    JobStatus,
    Reply,
    StartJob,
    StatusReport,
    error_reply,
    parse_command,
)
from qsched.protocol.errors import ProtocolError
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.links.base import MultiTransport, Transport
from qsched.protocol.links.config import parse_host_port
from qsched.protocol.messages import job_id_of
from qsched.protocol.topics import TopicMap, publish_topic_problem
from qsched.zo.workload import TrainState, Workload

__all__ = ["EVENT_QUEUE_SIZE", "STATUS_INTERVAL_S", "ActiveJob", "Daemon", "main", "status_topic"]

_log = structlog.get_logger("qsched.daemon")

EVENT_QUEUE_SIZE: Final = 1024
STATUS_INTERVAL_S: Final = 1.0
STATUS_MIN_INTERVAL_S: Final = 0.25
_CONTROL_CONCURRENCY: Final = 8  # commands handled at once; more wait their turn
_CONTROL_BACKLOG: Final = 256  # commands waiting beyond this are answered "busy" at once


def status_topic(topics: TopicMap) -> str:
    """Where the daemon keeps its retained ``StatusReport``: ``<prefix>/<fleet>/status``."""
    return f"{topics.base}/status"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qsched")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class ActiveJob:
    """The job the daemon runs: its engine, its folder and its task."""

    spec: JobSpec
    engine: StepEngine
    folder: JobDir
    task: asyncio.Task[None] | None = None
    error: str = ""


class Daemon:
    """The fleet daemon (see the module docstring).

    Args:
        config: the daemon's configuration.
        transports: extra transports (in-process boards for tests and experiments).
        engine_config: step-engine knobs (default: from ``config``).
        notifier: sd_notify (default: from ``$NOTIFY_SOCKET``).
    """

    def __init__(
        self,
        config: DaemonConfig,
        *,
        transports: Sequence[Transport] = (),
        engine_config: EngineConfig | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.version = _version()
        self.store = StateStore(config.state_dir)
        self._lock = InstanceLock(self.store.root)
        self.instance = uuid.uuid4().hex  # this process, in the fleet's daemon state
        self.topics = TopicMap(prefix=config.mqtt.prefix, fleet=config.fleet)
        self.engine_config = engine_config or EngineConfig(
            step_deadline_s=config.step_deadline_s,
            checkpoint_every=None,
            split_batches=config.split_batches,
        )
        self.notifier = notifier or Notifier()
        self.job: ActiveJob | None = None
        self.fleet: Fleet | None = None
        self._extra = list(transports)
        self._mqtt: Any = None
        self._events: asyncio.Queue[Event] = asyncio.Queue(EVENT_QUEUE_SIZE)
        self._stopping = asyncio.Event()
        self._status_changed = asyncio.Event()
        self._control_slots = asyncio.Semaphore(_CONTROL_CONCURRENCY)
        self._control_backlog = 0
        self._stack: contextlib.AsyncExitStack | None = None
        self._tasks: asyncio.TaskGroup | None = None
        self._background: list[asyncio.Task[Any]] = []
        self._last_status = ""
        self._state_job: str | None = None  # the job daemon/state last named

    # ------------------------------------------------------------------ lifecycle

    def _transports(self) -> list[Transport]:
        transports: list[Transport] = list(self._extra)
        cfg = self.config
        if cfg.mqtt.enabled:
            from qsched.protocol.links.mqtt import MqttTransport

            self._mqtt = MqttTransport(
                cfg.mqtt, self.topics, version=self.version, instance=self.instance
            )
            conn = self._mqtt.connection
            conn.subscribe(
                self.topics.control_request(),
                self.topics.rule("control_request").qos,
                self._on_control,
                retain_as_published=True,  # a retained command is refused, live or not
            )
            transports.append(self._mqtt)
        if cfg.serial.devices:
            from qsched.protocol.links.serial import SerialTransport

            transports.append(
                SerialTransport(
                    cfg.serial.devices,
                    baudrate=cfg.serial.baudrate,
                    reopen_interval=cfg.serial.reopen_interval_s,
                )
            )
        return transports

    async def __aenter__(self) -> Self:
        self._lock.acquire()  # before anything of the state directory is read
        if self.config.mqtt.enabled:
            try:
                await check_fleet_free(self.config.mqtt, self.topics, self.instance)
            except BaseException:
                self._lock.release()
                raise
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        stack.callback(self._lock.release)
        self._stack = stack
        try:
            multi = MultiTransport(self._transports())
            await stack.enter_async_context(multi)
            self.fleet = await stack.enter_async_context(
                Fleet(
                    multi,
                    heartbeat_interval=self.config.heartbeat_interval_s,
                    heartbeat_misses=self.config.heartbeat_misses,
                    on_event=self._on_fleet_event,
                )
            )
            self._tasks = await stack.enter_async_context(asyncio.TaskGroup())
            self._spawn(self._publish_events(), "daemon.events")
            self._spawn(self._status_loop(), "daemon.status")
            self._spawn(self.notifier.watchdog_loop(), "daemon.watchdog")
            self._resume_jobs()
            broker_up = await self._wait_for_broker()
        except BaseException:
            await stack.__aexit__(None, None, None)
            raise
        if not broker_up:  # asked to stop before the broker answered: never ready
            return self
        self.notifier.ready(self._status_text())
        _log.info(
            "daemon ready",
            fleet=self.config.fleet,
            state_dir=str(self.store.root),
            mqtt=self.config.mqtt.enabled,
        )
        return self

    async def _wait_for_broker(self) -> bool:
        """Wait for the MQTT connection, so that READY=1 means commands can arrive.

        Returns:
            True once connected (or without MQTT); False when a stop came first.
        """
        if self._mqtt is None:
            return True
        mqtt = self.config.mqtt
        self.notifier.status(f"waiting for the MQTT broker {mqtt.host}:{mqtt.port}")
        connected = asyncio.ensure_future(self._mqtt.wait_connected())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({connected, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (connected, stopping):
                waiter.cancel()
        return connected.done() and not connected.cancelled()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.notifier.stopping("shutting down")
        await self._shutdown_job()
        await self._flush_status()
        for task in self._background:
            task.cancel()
        if self._stack is not None:
            await self._stack.__aexit__(exc_type, exc, tb)
        _log.info("daemon stopped")

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        assert self._tasks is not None
        task = self._tasks.create_task(coro, name=name)
        self._background.append(task)
        return task

    def request_stop(self) -> None:
        """Ask the daemon to shut down (signal handlers call this)."""
        self._stopping.set()

    async def wait_stopped(self) -> None:
        """Wait until ``request_stop``."""
        await self._stopping.wait()

    async def run(self) -> int:
        """Run until SIGTERM or SIGINT; the job is checkpointed on the way out.

        Returns:
            The exit status (0).
        """
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            async with self:
                await self.wait_stopped()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        return 0

    async def _shutdown_job(self) -> None:
        job = self.job
        if job is None or job.task is None or job.task.done():
            return
        job.engine.stop(shutdown=True)
        with contextlib.suppress(asyncio.CancelledError):
            await job.task

    # ------------------------------------------------------------------ jobs

    def _resume_jobs(self) -> None:
        candidates = [
            j for j in self.store.jobs() if j.status().get("status") in ("running", "paused")
        ]
        candidates.sort(key=lambda j: j.status().get("updated", 0.0))
        for stale in candidates[:-1]:  # one job at a time: older ones wait, stopped
            stale.set_status("stopped", "another job was running when the daemon restarted")
        if candidates:
            folder = candidates[-1]
            try:
                spec = JobSpec.from_stored(folder.spec())
                paused = folder.status().get("status") == "paused"
                self._launch(spec, folder, paused=paused)
                _log.info(
                    "job resumed", job=spec.name, step=self.job.engine.step if self.job else None
                )
            except Exception as exc:  # whatever it is, it must not keep the daemon from starting
                _log.error("job cannot be resumed", job=folder.job_id, error=str(exc))
                folder.set_status("failed", f"cannot resume: {type(exc).__name__}: {exc}")

    def _launch(
        self,
        spec: JobSpec,
        folder: JobDir,
        *,
        paused: bool = False,
        workload: Workload | None = None,
    ) -> ActiveJob:
        assert self.fleet is not None
        checkpoint = folder.load_checkpoint()
        engine = StepEngine(
            spec,
            self.fleet,
            config=self.engine_config,
            workload=workload,
            resume=checkpoint,
            job_dir=folder,
            on_event=self._on_event,
        )
        job = ActiveJob(spec, engine, folder)
        self.job = job
        if paused:
            engine.pause()
        job.task = self._spawn(self._run_job(job), f"job[{spec.name}]")
        self._status_changed.set()
        settle_heap()  # the job's model and engine live as long as the job
        return job

    async def _run_job(self, job: ActiveJob) -> None:
        if job.engine.job_state != "paused":
            job.folder.set_status("running")
        try:
            result = await job.engine.run()
        except JobError as exc:
            job.error = str(exc)
            job.folder.set_status("failed", str(exc))
            return
        finally:
            self._status_changed.set()
        if result.status == "completed":
            await self._export(job, default_format(job.engine.workload))
            job.folder.set_status("completed")
        elif result.status == "stopped":
            job.folder.set_status("stopped", "stopped by a control command")
        # A shutdown leaves the job "running" on disk: it resumes on the next start.

    def _current(self, name: str | None) -> ActiveJob:
        if self.job is None:
            raise ControlError("no_job", "no job is loaded; start one with start_job")
        if name is not None and name != self.job.spec.name:
            raise ControlError(
                "unknown_job", f"no job named {name!r}; the current job is {self.job.spec.name!r}"
            )
        return self.job

    def job_status(self, name: str | None = None) -> JobStatus:
        """A job's progress: the loaded one's, or that of any job in the state directory.

        Raises:
            ControlError: no job is loaded (and none named), or no job has that name.
        """
        if self._stored_name(name):
            return _stored_status(self._stored(name))
        job = self._current(name)
        engine = job.engine
        last = engine.result.steps[-1] if engine.result.steps else None
        evaluation = engine.result.evals[-1] if engine.result.evals else None
        return JobStatus(
            name=job.spec.name,
            job_id=engine.job_id,
            state=engine.job_state,
            step=engine.step,
            steps=job.spec.steps,
            q=engine.policy.q,
            policy=engine.policy_spec.name,
            train_loss=last.train_loss if last else None,
            val_loss=evaluation.val_loss if evaluation else None,
            val_accuracy=evaluation.val_accuracy if evaluation else None,
        )

    async def start_job(self, command: StartJob) -> JobStatus:
        """Start a job from its spec (one at a time).

        The workload is built before the job's folder is made, so a spec that cannot run
        (a missing backbone file, an unknown model) leaves nothing behind and its name
        stays free.
        """
        spec = command.spec
        self._refuse_if_busy()
        try:
            validate_policy_config(spec.policy.name, spec.policy.config)
            workload = await asyncio.to_thread(Workload.from_spec, spec)  # CPU-bound: off the loop
        except (ValueError, OSError, PolicyError) as exc:
            raise ControlError("invalid_command", f"job {spec.name!r} cannot run: {exc}") from exc
        self._refuse_if_busy()  # another start may have won while the workload was built
        try:
            folder = self.store.create_job(
                spec.name, spec.model_dump(mode="json"), status="running"
            )
        except StateDirError as exc:
            code: ControlErrorCode = "conflict" if "exists" in exc.detail else "invalid_command"
            raise ControlError(
                code, f"job {spec.name!r}: {exc.detail}; choose another name"
            ) from exc
        try:
            self._launch(spec, folder, workload=workload)
        except Exception as exc:
            folder.set_status("failed", f"{type(exc).__name__}: {exc}")
            raise
        return self.job_status()

    def _refuse_if_busy(self) -> None:
        if self.job is not None and self.job.engine.job_state in ("pending", "running", "paused"):
            raise ControlError(
                "conflict",
                f"job {self.job.spec.name!r} is {self.job.engine.job_state}; stop it first",
            )

    def pause_job(self, name: str | None) -> JobStatus:
        """Pause the current job after its step."""
        job = self._current(name)
        if job.engine.job_state != "running":
            raise ControlError(
                "conflict", f"job {job.spec.name!r} is {job.engine.job_state}, not running"
            )
        job.engine.pause()
        job.folder.set_status("paused")
        self._status_changed.set()
        return self.job_status()

    def resume_job(self, name: str | None) -> JobStatus:
        """Resume the paused job."""
        job = self._current(name)
        if job.engine.job_state != "paused":
            raise ControlError(
                "conflict", f"job {job.spec.name!r} is {job.engine.job_state}, not paused"
            )
        job.engine.resume()
        job.folder.set_status("running")
        self._status_changed.set()
        return self.job_status()

    def stop_job(self, name: str | None) -> JobStatus:
        """Stop the current job for good (with a final checkpoint)."""
        job = self._current(name)
        if job.engine.job_state not in ("running", "paused", "pending"):
            raise ControlError(
                "conflict", f"job {job.spec.name!r} is already {job.engine.job_state}"
            )
        job.engine.stop()
        self._status_changed.set()
        return self.job_status()

    async def checkpoint_job(self, name: str | None) -> str:
        """Write a checkpoint now (or after the step in progress); returns its path."""
        job = self._current(name)
        if job.task is None or job.task.done():
            path = job.engine.last_checkpoint
            if path is None:
                raise ControlError(
                    "conflict", f"job {job.spec.name!r} has ended without a checkpoint"
                )
            return path
        try:
            return await job.engine.request_checkpoint()
        except JobError as exc:
            raise ControlError("internal", str(exc)) from exc

    def change_policy(self, command: ChangePolicy) -> JobStatus:
        """Switch the current job's policy from the next step."""
        job = self._current(command.job)
        if job.engine.job_state not in ("running", "paused"):
            raise ControlError("conflict", f"job {job.spec.name!r} is {job.engine.job_state}")
        job.engine.change_policy(command.policy)
        return self.job_status()

    def drain_board(self, board_id: str, drain: bool) -> str:
        """Stop (or resume) giving a board work."""
        assert self.fleet is not None
        session = self.fleet.find(board_id)
        if session is None:
            raise ControlError("unknown_board", f"no board {board_id!r} in the fleet")
        session.draining = drain
        self._status_changed.set()
        return f"board {session.board_id} {'drained' if drain else 'back in work'}"

    async def export_job(self, name: str | None, fmt: str) -> str:
        """Export a job's model now (the loaded job's weights, or a finished job's newest
        checkpoint); returns the file's path."""
        if self._stored_name(name):
            return str(await asyncio.to_thread(_export_stored, self._stored(name), fmt))
        job = self._current(name)
        return str(await self._export(job, fmt))

    def _stored_name(self, name: str | None) -> bool:
        """Whether ``name`` names a job other than the loaded one."""
        return name is not None and (self.job is None or name != self.job.spec.name)

    def _stored(self, name: str | None) -> JobDir:
        try:
            return self.store.job(str(name))
        except StateDirError as exc:
            raise ControlError("unknown_job", f"no job named {name!r}") from exc

    async def _export(self, job: ActiveJob, fmt: str) -> Path:
        workload, state = job.engine.workload, job.engine.state.copy()
        try:
            data = await asyncio.to_thread(export_model, workload, state, fmt)
        except ExportError as exc:
            raise ControlError("unsupported", str(exc)) from exc
        return job.folder.write_export(data, f"{job.spec.name}.{fmt}")

    # ------------------------------------------------------------------ status and events

    def status(self, name: str | None = None) -> StatusReport:
        """The daemon's status: a job (the loaded one, or ``name``) and its boards."""
        job = None
        if self.job is not None or name is not None:
            job = self.job_status(name)
        boards = self.fleet.infos() if self.fleet is not None else ()
        return StatusReport(daemon_version=self.version, time=time.time(), job=job, boards=boards)

    def _status_text(self) -> str:
        fleet = self.fleet
        ready = sum(1 for s in fleet.boards() if s.state in ("ready", "busy")) if fleet else 0
        total = len(fleet.sessions) if fleet else 0
        if self.job is None:
            return f"idle; {ready}/{total} boards ready"
        engine = self.job.engine
        line = engine.status_line if engine.job_state == "running" else engine.job_state
        return f"job {self.job.spec.name}: {line}; {ready}/{total} boards ready"

    def _on_event(self, event: Event) -> None:
        self._status_changed.set()
        try:
            self._events.put_nowait(event)
        except asyncio.QueueFull:  # a live feed: the metrics log keeps the full record
            with contextlib.suppress(asyncio.QueueEmpty):
                self._events.get_nowait()
            self._events.put_nowait(event)

    def _on_fleet_event(self, event: FleetEvent) -> None:
        self._on_event(fleet_event(event, self.job.spec.name if self.job else None))

    async def _publish_events(self) -> None:
        while True:
            _raise_if_cancelling()
            event = await self._events.get()
            if self._mqtt is None:
                continue
            rule = self.topics.rule("events")
            try:
                await self._mqtt.connection.publish(
                    self.topics.events(),
                    event.model_dump_json(exclude_none=True),
                    qos=rule.qos,
                    timeout=2.0,
                )
            except TimeoutError:
                _log.debug("event not published (broker away)", kind=event.kind)

    async def _status_loop(self) -> None:
        while True:
            _raise_if_cancelling()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._status_changed.wait(), STATUS_INTERVAL_S)
            self._status_changed.clear()
            await self._flush_status()
            await asyncio.sleep(STATUS_MIN_INTERVAL_S)  # steps can be milliseconds apart

    async def _flush_status(self) -> None:
        text = self._status_text()
        if text != self._last_status:
            self.notifier.status(text)
            self._last_status = text
        if self._mqtt is None or not self._mqtt.connection.connected:
            return
        with contextlib.suppress(TimeoutError):
            await self._mqtt.connection.publish(
                status_topic(self.topics),
                self.status().model_dump_json(),
                qos=1,
                retain=True,
                timeout=2.0,
            )
        job = self.job.spec.name if self.job is not None else None
        if job != self._state_job:  # daemon/state names the loaded job (births keep it)
            with contextlib.suppress(TimeoutError):
                await self._mqtt.publish_state(job)
                self._state_job = job

    # ------------------------------------------------------------------ control over MQTT

    async def _on_control(self, message: Any) -> None:
        payload = (
            message.payload
            if isinstance(message.payload, bytes | bytearray)
            else str(message.payload or "")
        )
        props = getattr(message, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props is not None else None
        correlation = getattr(props, "CorrelationData", None) if props is not None else None
        payload = bytes(payload) if not isinstance(payload, str) else payload
        if getattr(message, "retain", False):
            # A retained command would run again on every reconnect and restart.
            reply = _refusal(payload, RETAINED_REFUSAL)
            assert self._tasks is not None
            self._tasks.create_task(
                self._send_reply(reply, response_topic, correlation), name="control.refusal"
            )
            return
        # Commands run as tasks: a slow one (checkpoint) must not hold up the others or
        # the data plane, which share this MQTT message loop.
        self._spawn_control(payload, response_topic, correlation)

    def _spawn_control(
        self, payload: bytes | str, response_topic: str | None, correlation: bytes | None
    ) -> None:
        assert self._tasks is not None
        self._tasks.create_task(
            self._answer(payload, response_topic, correlation), name="control.command"
        )

    async def _answer(
        self, payload: bytes | str, response_topic: str | None, correlation: bytes | None
    ) -> None:
        try:
            if self._control_backlog >= _CONTROL_BACKLOG:
                reply: Reply | ErrorReply = _busy_reply(payload)
            else:
                self._control_backlog += 1
                try:
                    async with self._control_slots:
                        reply = await handle_payload(self, payload)
                finally:
                    self._control_backlog -= 1
        except Exception as exc:  # the last resort: a document must never stop the daemon
            _log.exception("control document raised", error=f"{type(exc).__name__}: {exc}")
            reply = ErrorReply(code="internal", message=f"{type(exc).__name__} (see the log)")
        await self._send_reply(reply, response_topic, correlation)

    def _response_topic_problem(self, topic: str | None) -> str | None:
        """Why the daemon will not reply on ``topic`` (None: it will, or there is none).

        Replies go only under ``<prefix>/<fleet>/control/reply/``: the daemon may publish
        anywhere, so a client-chosen topic must not reach a board's input or the status.
        """
        if topic is None:
            return None
        problem = publish_topic_problem(topic)
        if problem is None and not topic.startswith(self.topics.control_reply() + "/"):
            problem = f"the response topic must lie under {self.topics.control_reply()}/"
        return problem

    async def _send_reply(
        self, reply: Reply | ErrorReply, response_topic: str | None, correlation: bytes | None
    ) -> None:
        problem = self._response_topic_problem(response_topic)
        if problem is not None:  # answered where every client can hear it, and logged
            _log.warning("control reply topic refused", problem=problem)
            reply = _refusal_of(reply, f"{problem}: the reply went to the default reply topic")
            response_topic = None
        topic = response_topic or self.topics.control_reply()
        properties = None
        if self.config.mqtt.protocol == "5" and correlation is not None:
            properties = Properties(PacketTypes.PUBLISH)
            properties.CorrelationData = correlation
        try:
            await self._mqtt.connection.publish(
                topic, reply.model_dump_json(exclude_none=True), qos=1, properties=properties
            )
        except TimeoutError:
            _log.warning("control reply not delivered (broker away)", request_id=reply.request_id)
        except (ValueError, MqttError) as exc:  # the client refused the topic or the packet
            _log.warning("control reply not delivered", error=str(exc), topic=topic)


def _stored_spec(folder: JobDir) -> JobSpec:
    try:
        return JobSpec.from_stored(folder.spec())
    except (StateDirError, ValueError) as exc:
        raise ControlError("internal", f"job {folder.job_id!r}: unreadable spec: {exc}") from exc


def _stored_status(folder: JobDir) -> JobStatus:
    """A job's progress as its folder records it (status, metrics log)."""
    spec = _stored_spec(folder)
    try:
        records = folder.last_records(("step", "validation"))
        state = folder.status().get("status", "failed")
    except StateDirError as exc:
        raise ControlError("internal", f"job {folder.job_id!r}: {exc}") from exc
    last = records.get("step", {})
    evaluation = records.get("validation", {})
    return JobStatus(
        name=spec.name,
        job_id=job_id_of(spec),
        state=state,
        step=int(last["step"]) + 1 if last else 0,
        steps=spec.steps,
        q=last.get("q"),
        policy=spec.policy.name,
        train_loss=last.get("train_loss"),
        val_loss=evaluation.get("val_loss"),
        val_accuracy=evaluation.get("val_accuracy"),
    )


def _export_stored(folder: JobDir, fmt: str) -> Path:
    """A job that is not loaded, exported from its newest checkpoint."""
    spec = _stored_spec(folder)
    checkpoint = folder.load_checkpoint()
    if checkpoint is None:
        raise ControlError("conflict", f"job {spec.name!r} has no checkpoint to export")
    try:
        workload = Workload.from_spec(spec)
        state = TrainState.from_bytes(checkpoint.train_state)
        data = export_model(workload, state, fmt)
    except ExportError as exc:
        raise ControlError("unsupported", str(exc)) from exc
    except (ValueError, OSError) as exc:
        raise ControlError("conflict", f"job {spec.name!r} cannot be rebuilt: {exc}") from exc
    return folder.write_export(data, f"{spec.name}.{fmt}")


RETAINED_REFUSAL: Final = (
    "retained commands are refused: the broker would deliver this one again on every "
    "reconnect and restart; publish it without the retain flag (and clear the retained "
    "message with an empty retained publish)"
)


def _refusal(payload: bytes | str, message: str) -> ErrorReply:
    """An ``invalid_command`` answer to ``payload``, echoing its request_id if it has one."""
    try:
        command = parse_command(payload)
    except ProtocolError as exc:
        return ErrorReply(code="invalid_command", message=message, request_id=exc.request_id)
    return ErrorReply(
        command=command.type, request_id=command.request_id, code="invalid_command", message=message
    )


def _refusal_of(reply: Reply | ErrorReply, message: str) -> ErrorReply:
    """The reply turned into a refusal (the command was not run or its answer is lost)."""
    return ErrorReply(
        command=reply.command, request_id=reply.request_id, code="invalid_command", message=message
    )


def _busy_reply(payload: bytes | str) -> ErrorReply:
    """The answer to a command the daemon has no room for (it still gets exactly one)."""
    try:
        command = parse_command(payload)
    except ProtocolError as exc:
        return error_reply(exc)
    return ErrorReply(
        command=command.type,
        request_id=command.request_id,
        code="busy",
        message=f"more than {_CONTROL_BACKLOG} commands are waiting; retry later",
    )


def _raise_if_cancelling() -> None:
    """End a loop whose cancellation an ``asyncio.wait_for`` swallowed (Python 3.11 race:
    the inner future finishing as the cancel arrives returns its result instead)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qsched daemon", description="Run the fleet daemon.")
    parser.add_argument("--config", type=Path, help="TOML file (default: $QSCHED_CONFIG)")
    parser.add_argument(
        "--state-dir", type=Path, help="state directory (default: $STATE_DIRECTORY)"
    )
    parser.add_argument(
        "--mqtt",
        metavar="HOST:PORT",
        type=_host_port,
        help="broker address (overrides the configuration)",
    )
    parser.add_argument(
        "--no-mqtt", action="store_true", help="run without a broker (serial boards only)"
    )
    parser.add_argument(
        "--serial", nargs="*", default=None, metavar="DEV", help="serial ports or globs"
    )
    parser.add_argument("--fleet", help="fleet name (one topic level)")
    parser.add_argument("--step-deadline", type=float, help="seconds before a shard is reassigned")
    return parser


def _host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` for ``--mqtt``; a usage error otherwise."""
    try:
        return parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _overrides(args: argparse.Namespace, cfg: DaemonConfig) -> DaemonConfig:
    data = cfg.model_dump()
    if args.state_dir is not None:
        data["state_dir"] = args.state_dir
    if args.fleet is not None:
        data["fleet"] = args.fleet
    if args.step_deadline is not None:
        data["step_deadline_s"] = args.step_deadline
    if args.mqtt is not None:
        data["mqtt"]["host"], data["mqtt"]["port"] = args.mqtt
    if args.no_mqtt:
        data["mqtt"]["enabled"] = False
    if args.serial is not None:
        data["serial"]["devices"] = list(args.serial)
    data["mqtt"]["password"] = cfg.mqtt.password  # keep the secret as it was
    return DaemonConfig.model_validate(data)


def main(argv: list[str]) -> int:
    """``qsched daemon``: run until SIGTERM.

    Args:
        argv: the options (see ``--help``).

    Returns:
        The exit status.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    cfg = _overrides(args, load_config(args.config))
    try:
        daemon = Daemon(cfg)
    except OSError as exc:  # the state directory cannot be created or written
        parser.error(f"state directory {cfg.state_dir}: {exc.strerror or exc}")
    try:
        return asyncio.run(daemon.run())
    except InstanceError as exc:
        print(f"qsched daemon: {exc}", file=sys.stderr)
        return EXIT_ANOTHER_INSTANCE
    except FleetTakenError as exc:
        print(f"qsched daemon: {exc}", file=sys.stderr)
        return EXIT_FLEET_TAKEN
