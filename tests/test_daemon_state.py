"""The state store: atomic files, checkpoints, metrics log, resumable jobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qsched.daemon.state import (
    Checkpoint,
    StateDirError,
    StateStore,
    atomic_write,
    default_state_dir,
)


def _checkpoint(step: int) -> Checkpoint:
    return Checkpoint(
        step=step,
        train_state=os.urandom(64) + bytes([step % 256]),
        policy_state={"q": 4, "stall": step},
        metrics=[{"step": step, "loss": 1.0 / (step + 1)}],
    )


def test_atomic_write_replaces_without_temp_files(tmp_path: Path) -> None:
    """atomic_write replaces the file and leaves no temporary file behind."""
    target = tmp_path / "a.json"
    target.write_bytes(b"old")
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_atomic_write_keeps_old_file_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails before the rename leaves the old contents and no temp file."""
    target = tmp_path / "a.bin"
    target.write_bytes(b"old")

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space"):
        atomic_write(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


def test_state_create_and_reopen_job(tmp_path: Path) -> None:
    """A job's spec and status survive reopening the store."""
    store = StateStore(tmp_path)
    job = store.create_job("job-1", {"name": "job-1", "steps": 10}, status="running")
    reopened = StateStore(tmp_path).job("job-1")
    assert reopened.spec() == {"name": "job-1", "steps": 10}
    assert reopened.status()["status"] == "running"
    assert job.path == reopened.path


def test_state_rejects_bad_ids_and_duplicates(tmp_path: Path) -> None:
    """Path-like job ids and an existing id are refused with StateDirError."""
    store = StateStore(tmp_path)
    store.create_job("a", {})
    for bad in ["../x", "..", "a/b", "", ".hidden", "job\n"]:
        with pytest.raises(StateDirError):
            store.create_job(bad, {})
    with pytest.raises(StateDirError, match="exists"):
        store.create_job("a", {})
    with pytest.raises(StateDirError, match="no such job"):
        store.job("missing")


def test_state_resumable_lists_running_jobs_only(tmp_path: Path) -> None:
    """Only jobs whose status is running are resumed on start."""
    store = StateStore(tmp_path)
    store.create_job("r1", {}, status="running")
    store.create_job("p1", {}, status="paused")
    done = store.create_job("r2", {}, status="running")
    done.set_status("completed")
    (tmp_path / "jobs" / "half").mkdir()  # a crash before spec.json: ignored
    assert [job.job_id for job in store.resumable()] == ["r1"]
    assert [job.job_id for job in store.jobs()] == ["p1", "r1", "r2"]


def test_state_set_status_rejects_unknown(tmp_path: Path) -> None:
    """An unknown status is a StateDirError, not a silently stored string."""
    job = StateStore(tmp_path).create_job("j", {})
    with pytest.raises(StateDirError):
        job.set_status("exploded")  # type: ignore[arg-type]


def test_checkpoint_round_trip_and_prune(tmp_path: Path) -> None:
    """The newest checkpoint loads back equal; only the newest few are kept."""
    job = StateStore(tmp_path).create_job("j", {})
    saved = [_checkpoint(step) for step in (10, 20, 30, 40)]
    for ckpt in saved:
        job.save_checkpoint(ckpt, keep=2)
    assert job.load_checkpoint() == saved[-1]
    assert sorted(p.name for p in job.checkpoint_dir.iterdir()) == [
        "ckpt-0000000030.qsckpt",
        "ckpt-0000000040.qsckpt",
    ]


def test_checkpoint_damaged_latest_falls_back(tmp_path: Path) -> None:
    """A corrupted newest checkpoint is skipped in favour of the previous one."""
    job = StateStore(tmp_path).create_job("j", {})
    first, second = _checkpoint(1), _checkpoint(2)
    job.save_checkpoint(first)
    path = job.save_checkpoint(second)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert job.load_checkpoint() == first
    path.write_bytes(bytes(data[:20]))
    assert job.load_checkpoint() == first


def test_checkpoint_from_bytes_rejects_garbage() -> None:
    """Random bytes are a StateDirError, not another exception."""
    with pytest.raises(StateDirError):
        Checkpoint.from_bytes(b"nonsense")
    good = _checkpoint(3).to_bytes()
    with pytest.raises(StateDirError, match="truncated"):
        Checkpoint.from_bytes(good[:-1])


def test_checkpoint_none_when_empty(tmp_path: Path) -> None:
    """A fresh job has no checkpoint."""
    assert StateStore(tmp_path).create_job("j", {}).load_checkpoint() is None


def test_metrics_append_and_torn_last_line(tmp_path: Path) -> None:
    """A torn last line is ignored on read and cut off before the next append."""
    job = StateStore(tmp_path).create_job("j", {})
    job.append_metrics({"step": 1, "loss": 2.5})
    job.append_metrics({"step": 2, "loss": 2.0})
    with open(job.metrics_path, "ab") as fh:
        fh.write(b'{"step": 3, "lo')  # the crash
    assert [r["step"] for r in job.read_metrics()] == [1, 2]
    reopened = StateStore(tmp_path).job("j")
    reopened.append_metrics({"step": 3, "loss": 1.5})
    assert [r["step"] for r in reopened.read_metrics()] == [1, 2, 3]


def test_metrics_corrupt_middle_line_is_error(tmp_path: Path) -> None:
    """Damage before the last line is reported, not skipped."""
    job = StateStore(tmp_path).create_job("j", {})
    job.metrics_path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(StateDirError, match="line 2"):
        job.read_metrics()


def test_export_written_atomically(tmp_path: Path) -> None:
    """The exported model lands under export/ and is found again."""
    job = StateStore(tmp_path).create_job("j", {})
    assert job.export_path() is None
    path = job.write_export(b"TFL3model")
    assert job.export_path() == path
    assert path.read_bytes() == b"TFL3model"
    with pytest.raises(StateDirError):
        job.write_export(b"x", name="../evil")


def test_default_state_dir_honours_systemd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$STATE_DIRECTORY wins (first entry), else XDG_STATE_HOME/qsched."""
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/a:{tmp_path}/b")
    assert default_state_dir() == tmp_path / "a"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "qsched"


@pytest.mark.parametrize("tail", [b"", b'{"step": 3, "lo', b"x" * 70_000])
def test_metrics_repair_reads_back_to_the_last_full_line(tmp_path: Path, tail: bytes) -> None:
    """The repair before the next append cuts exactly the torn tail, also one longer than
    the chunk it reads backwards, and leaves a whole log alone."""
    job = StateStore(tmp_path).create_job("j", {})
    for step in range(3):
        job.append_metrics({"step": step, "pad": "y" * 40_000})
    whole = job.metrics_path.read_bytes()
    with open(job.metrics_path, "ab") as fh:
        fh.write(tail)
    StateStore(tmp_path).job("j").append_metrics({"step": 3})
    assert job.metrics_path.read_bytes() == whole + b'{"step":3}\n'


def test_metrics_repair_of_a_log_without_any_full_line(tmp_path: Path) -> None:
    """A log holding only a torn first record is emptied before the next append."""
    job = StateStore(tmp_path).create_job("j", {})
    job.metrics_path.write_bytes(b'{"step": 0, "lo')
    StateStore(tmp_path).job("j").append_metrics({"step": 0})
    assert job.metrics_path.read_bytes() == b'{"step":0}\n'


@pytest.mark.parametrize("chunk", [7, 1 << 16])
def test_last_records_read_from_the_end(
    tmp_path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last record of each kind, as the whole log says, read backwards in chunks
    smaller and larger than a line; a torn last line is ignored, a damaged full one is
    an error."""
    from qsched.daemon import state as state_module

    backwards = state_module._lines_backwards
    monkeypatch.setattr(state_module, "_lines_backwards", lambda fh: backwards(fh, chunk=chunk))
    job = StateStore(tmp_path).create_job("j", {})
    assert job.last_records(("step", "validation")) == {}
    for step in range(40):
        job.append_metrics({"kind": "step", "step": step, "q": 1 + step // 10})
        if step % 10 == 9:
            job.append_metrics({"kind": "validation", "step": step, "val_accuracy": step / 100})
    job.append_metrics({"kind": "resumed", "step": 35})
    job.append_metrics({"kind": "step", "step": 35, "q": 4})
    with open(job.metrics_path, "ab") as fh:
        fh.write(b'{"kind": "step", "step": 36, "q"')  # the crash
    by_kind: dict[str, dict[str, object]] = {}
    for record in job.read_metrics():
        by_kind[record["kind"]] = record
    got = job.last_records(("step", "validation"))
    assert got == {k: by_kind[k] for k in ("step", "validation")}
    assert got["step"]["step"] == 35 and got["validation"]["step"] == 39
    lines = job.metrics_path.read_bytes().split(b"\n")
    lines[-2] = b'{"kind": "step", "st'  # a full line damaged, the torn one after it
    job.metrics_path.write_bytes(b"\n".join(lines))
    with pytest.raises(StateDirError, match="not valid JSON"):
        job.last_records(("step", "validation"))
