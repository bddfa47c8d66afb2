"""Mixed fleets: C boards (host build and the emulated Cortex-M55) train with the daemon
exactly as Python virtual boards do, to the same weights."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tty
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from qsched.daemon.bridge import run_aggregate
from qsched.daemon.engine import JobResult, StepEngine
from qsched.daemon.fleet import Fleet
from qsched.firmware.native import HostBoard, m55_unavailable_reason, start_host_board
from qsched.firmware.qemu import QemuBoard, start_qemu_board
from qsched.firmware.virtual.board import BoardAgent, DatasetCatalog, LatencyProfile, serve_link
from qsched.lab.broker import MosquittoBroker
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.protocol.links.config import MqttConfig
from qsched.protocol.links.mqtt import MqttEndpoint, MqttTransport
from qsched.protocol.links.serial import SerialEndpoint, SerialTransport
from qsched.protocol.topics import TopicMap
from qsched.zo.blob import encode_dataset_blob
from qsched.zo.trainer import TrainResult, train_zo
from qsched.zo.workload import Workload

BOARDS_HOST = ["c-0", "py-0"]
BOARDS_M55 = ["qemu-an547", "c-1", "py-0"]
SPEC = JobSpec(
    name="mixed",
    steps=6,
    eval_every=3,
    batch_size=16,
    policy=PolicySpec(name="fixed", config={"q": 6}),
)


@pytest.fixture(scope="module")
def reference() -> TrainResult:
    """The job trained in one Python process."""
    return train_zo(SPEC)


@pytest.fixture(scope="module")
def dataset_blob(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job's data set, quantised for its model, as a C board holds it."""
    workload = Workload.from_spec(SPEC)
    assert workload.qmodel is not None
    path = tmp_path_factory.mktemp("fleet") / "digits.qzds"
    path.write_bytes(encode_dataset_blob(workload.dataset, workload.qmodel))
    return path


@contextlib.asynccontextmanager
async def _python_board(
    master: int, board_id: str, datasets: DatasetCatalog | None = None
) -> AsyncIterator[None]:
    """A Python virtual board serving the master side of a pty."""
    agent = BoardAgent(board_id, latency=LatencyProfile.off(), datasets=datasets)
    async with SerialEndpoint.from_fd(master, board_id) as link, asyncio.TaskGroup() as tasks:
        task = tasks.create_task(serve_link(agent, link))
        try:
            yield
        finally:
            task.cancel()


async def _all_joined(fleet: Fleet, board_ids: list[str], timeout: float = 30.0) -> None:
    """Wait until every board has said Hello, so that the job is shared among all of them."""
    async with asyncio.timeout(timeout):
        while not all((s := fleet.find(b)) is not None and s.hello is not None for b in board_ids):
            await fleet.wait_changed(0.2)


async def _train(
    paths: list[str],
    python_masters: list[int],
    board_ids: list[str],
    spec: JobSpec = SPEC,
    datasets: DatasetCatalog | None = None,
) -> JobResult:
    async with contextlib.AsyncExitStack() as stack:
        for i, master in enumerate(python_masters):
            await stack.enter_async_context(_python_board(master, f"py-{i}", datasets))
        transport = SerialTransport(paths, reopen_interval=0.05)
        await stack.enter_async_context(transport)
        fleet = await stack.enter_async_context(Fleet(transport))
        await _all_joined(fleet, board_ids)
        return await asyncio.wait_for(StepEngine(spec, fleet).run(), timeout=300)


def _assert_same_training(result: JobResult, reference: TrainResult, board_ids: list[str]) -> None:
    """Same weights and per-step losses as Python alone, no board faulted, all worked."""
    assert result.state.checksum() == reference.state.checksum()
    assert [s.train_loss for s in result.steps] == [s.train_loss for s in reference.steps]
    assert result.faults == 0
    for board_id in board_ids:
        assert result.work.get(board_id, 0) > 0, f"{board_id} did no work: {result.work}"


@pytest.fixture
def python_pty() -> Iterator[tuple[int, str]]:
    """A raw pty pair: the virtual board serves the master, the daemon opens the slave."""
    master, slave = os.openpty()
    tty.setraw(slave)
    yield master, os.ttyname(slave)
    os.close(slave)


def _closed_cleanly(board: HostBoard) -> None:
    err = board.close()
    assert "AddressSanitizer" not in err and "runtime error" not in err, err


async def test_fleet_host_c_board_with_python_board_matches_reference(
    tmp_path: Path, dataset_blob: Path, python_pty: tuple[int, str], reference: TrainResult
) -> None:
    """A C board (sanitizer build) and a Python board train to the single-process weights."""
    board = start_host_board(tmp_path / "c-0", dataset=dataset_blob, board_id="c-0", sanitized=True)
    try:
        result = await _train([str(board.link_path), python_pty[1]], [python_pty[0]], BOARDS_HOST)
    finally:
        _closed_cleanly(board)
    _assert_same_training(result, reference, BOARDS_HOST)


@pytest.mark.qemu
@pytest.mark.skipif(m55_unavailable_reason() is not None, reason=str(m55_unavailable_reason()))
@pytest.mark.parametrize("recalibrate_every", [0, 2])
async def test_fleet_with_emulated_m55_board_matches_reference(
    tmp_path: Path, dataset_blob: Path, python_pty: tuple[int, str], recalibrate_every: int
) -> None:
    """An emulated Cortex-M55, a host C board and a Python board: same weights as Python
    alone, with fixed scales and with scale recalibration every 2 steps."""
    spec = SPEC.model_copy(update={"recalibrate_every": recalibrate_every})
    m55: QemuBoard = start_qemu_board(tmp_path / "m55-0", dataset=dataset_blob)
    host = start_host_board(tmp_path / "c-1", dataset=dataset_blob, board_id="c-1")
    try:
        paths = [str(m55.link_path), str(host.link_path), python_pty[1]]
        result = await _train(paths, [python_pty[0]], BOARDS_M55, spec=spec)
    finally:
        m55.close()
        _closed_cleanly(host)
    _assert_same_training(result, train_zo(spec), BOARDS_M55)


async def test_fleet_of_c_boards_splits_batches_and_matches_reference(
    tmp_path: Path, dataset_blob: Path, python_pty: tuple[int, str]
) -> None:
    """One key a step over two C boards and a Python board: the key's batch is cut into
    slices (EvalSliceRequest, SPEC 6.10) and the weights are the single-process run's."""
    spec = SPEC.model_copy(update={"policy": PolicySpec(name="fixed", config={"q": 1})})
    boards = [
        start_host_board(tmp_path / name, dataset=dataset_blob, board_id=name)
        for name in ("c-0", "c-1")
    ]
    try:
        paths = [*(str(b.link_path) for b in boards), python_pty[1]]
        result = await _train(paths, [python_pty[0]], ["c-0", "c-1", "py-0"], spec=spec)
    finally:
        for board in boards:
            _closed_cleanly(board)
    reference = train_zo(spec)
    assert result.split_steps >= spec.steps - 2  # the first steps may start with fewer boards
    assert result.state.checksum() == reference.state.checksum()
    assert [s.train_loss for s in result.steps] == [s.train_loss for s in reference.steps]
    assert result.faults == 0
    assert result.work.get("c-0", 0) > 0 and result.work.get("c-1", 0) > 0


async def test_aggregating_bridge_of_c_boards_trains_as_one_board(
    tmp_path: Path,
    dataset_blob: Path,
    python_pty: tuple[int, str],
    mqtt_broker: MosquittoBroker,
) -> None:
    """`qsched bridge --aggregate`: two C boards and a Python board on serial ports are
    one MQTT board to the daemon (beside an ordinary MQTT board); INT8 keys and batch
    slices are shared inside the host, and the weights are the single-process run's."""
    spec = SPEC.model_copy(update={"policy": PolicySpec(name="fixed", config={"q": 2})})
    cfg = MqttConfig(host=mqtt_broker.host, port=mqtt_broker.port, reconnect_min_s=0.1)
    topics = TopicMap(fleet="aggregate")
    boards = [
        start_host_board(tmp_path / name, dataset=dataset_blob, board_id=name)
        for name in ("c-0", "c-1")
    ]
    paths = [*(str(b.link_path) for b in boards), python_pty[1]]
    datasets = DatasetCatalog()
    try:
        async with (
            _python_board(python_pty[0], "py-0", datasets),
            MqttTransport(cfg, topics) as transport,
            Fleet(transport) as fleet,
            MqttEndpoint(cfg, topics, "mqtt-0") as endpoint,
        ):
            plain = asyncio.create_task(
                serve_link(BoardAgent("mqtt-0", latency=LatencyProfile.off()), endpoint)
            )
            host = asyncio.create_task(
                run_aggregate(paths, cfg, topics, "host-0", reopen_interval=0.05, gather_s=10)
            )
            try:
                await _all_joined(fleet, ["host-0", "mqtt-0"])
                result = await asyncio.wait_for(StepEngine(spec, fleet).run(), timeout=300)
            finally:
                for task in (host, plain):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
    finally:
        for board in boards:
            _closed_cleanly(board)
    reference = train_zo(spec)
    assert result.state.checksum() == reference.state.checksum()
    assert [s.train_loss for s in result.steps] == [s.train_loss for s in reference.steps]
    assert result.faults == 0
    assert set(result.work) <= {"host-0", "mqtt-0"} and result.work.get("host-0")


async def test_recalibrating_job_on_c_and_python_boards_matches_reference(
    tmp_path: Path, dataset_blob: Path, python_pty: tuple[int, str]
) -> None:
    """Scale recalibration every 2 steps: a C board (sanitizer build) and a Python board
    grow the same channels and train to the single-process weights and exponents."""
    spec = SPEC.model_copy(update={"recalibrate_every": 2})
    reference = train_zo(spec)
    assert reference.state.scale_exps is not None and reference.state.scale_exps.max() > 0
    board = start_host_board(tmp_path / "c-0", dataset=dataset_blob, board_id="c-0", sanitized=True)
    try:
        result = await _train(
            [str(board.link_path), python_pty[1]], [python_pty[0]], BOARDS_HOST, spec=spec
        )
    finally:
        _closed_cleanly(board)
    _assert_same_training(result, reference, BOARDS_HOST)
