"""The daemon's state directory: one folder per job, nothing ever half-written.

Layout (the root is systemd's ``StateDirectory``, ``$STATE_DIRECTORY``)::

    <root>/jobs/<job_id>/
        spec.json                 the job spec as submitted
        status.json               running | paused | stopped | completed | failed (+ reason)
        checkpoints/ckpt-<step>.qsckpt
        metrics.jsonl             one JSON object per line, appended
        export/<name>             the exported model

Every file but the metrics log is replaced atomically (temp file, fsync, rename, fsync
of the folder), so a crash leaves the old or the new version, never a mix. The metrics
log is append-only; a line torn by a crash is dropped on read and repaired before the
next append. A checkpoint carries a SHA-256 of its contents; a damaged one is skipped
and the previous one is used.

A checkpoint holds what a bit-identical resume needs and nothing random: the numeric
state (``TrainState.to_bytes()``, opaque here), the policy's state (JSON), the step and
the metric history (packed binary records, so that a checkpoint late in a long job costs
about what an early one does). Randomness is re-derived from ``(job seed, step, k)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from qsched.daemon.errors import StateDirError

__all__ = [
    "JOB_STATUSES",
    "Checkpoint",
    "JobDir",
    "JobStatus",
    "StateDirError",
    "StateStore",
    "atomic_write",
    "default_state_dir",
]

JobStatus = Literal["pending", "running", "paused", "stopped", "completed", "failed"]
JOB_STATUSES: tuple[str, ...] = get_args(JobStatus)

_JOB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_CKPT_MAGIC = b"QSCKPT1\n"
_CKPT_NAME = re.compile(r"^ckpt-(\d{10})\.qsckpt$")
KEEP_CHECKPOINTS = 3  # older ones are removed; more than one survives a damaged latest


def default_state_dir() -> Path:
    """The state root: ``$STATE_DIRECTORY`` (systemd) or ``~/.local/state/qsched``.

    Returns:
        The folder (not created).
    """
    env = os.environ.get("STATE_DIRECTORY")
    if env:
        return Path(env.split(":")[0])  # systemd lists several folders with ':'
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "qsched"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file only.

    Args:
        path: the destination; its folder must exist.
        data: the new contents.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _lines_backwards(fh: Any, chunk: int = 1 << 16) -> Iterator[tuple[bytes, bool]]:
    """The lines of a binary file, last first, each with whether a newline ends it (only
    the file's last line can lack one)."""
    stop = fh.seek(0, os.SEEK_END)
    rest = b""  # the end of a line whose start lies in an earlier chunk
    terminated = False  # whether the line being completed has its newline
    while stop > 0:
        start = max(0, stop - chunk)
        fh.seek(start)
        pieces = (fh.read(stop - start) + rest).split(b"\n")
        rest = pieces[0]
        for piece in reversed(pieces[1:]):
            if piece or terminated:
                yield piece, terminated
            terminated = True
        stop = start
    if rest:
        yield rest, terminated


@dataclass(frozen=True)
class Checkpoint:
    """A resumable snapshot of one job.

    Attributes:
        step: the number of completed steps.
        train_state: the numeric state (``TrainState.to_bytes()``), opaque here.
        policy_state: the q policy's state, JSON-serialisable.
        metrics: the metric history as JSON records (checkpoints written before
            ``history`` existed; new ones leave it empty).
        extra: anything else JSON-serialisable the engine wants back.
        history: the metric history packed by its writer (``qsched.daemon.checkpoints``),
            opaque here.
    """

    step: int
    train_state: bytes
    policy_state: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    history: bytes = b""

    def to_bytes(self) -> bytes:
        """Serialise: magic, u32 header length, JSON header, the train state, then the
        packed history (each of the two with its length and SHA-256 in the header)."""
        header = {
            "step": self.step,
            "policy_state": self.policy_state,
            "metrics": self.metrics,
            "extra": self.extra,
            "train_state_len": len(self.train_state),
            "train_state_sha256": hashlib.sha256(self.train_state).hexdigest(),
            "history_len": len(self.history),
            "history_sha256": hashlib.sha256(self.history).hexdigest(),
        }
        head = json.dumps(header, sort_keys=True).encode()
        return _CKPT_MAGIC + struct.pack("<I", len(head)) + head + self.train_state + self.history

    @classmethod
    def from_bytes(cls, data: bytes, origin: Path | str = "<bytes>") -> Checkpoint:
        """Parse and verify a checkpoint (also one written before the history section).

        Args:
            data: the file contents.
            origin: where they came from (for error messages).

        Returns:
            The checkpoint.

        Raises:
            StateDirError: bad magic, truncated, or a hash does not match.
        """
        if not data.startswith(_CKPT_MAGIC) or len(data) < len(_CKPT_MAGIC) + 4:
            raise StateDirError(origin, "not a qsched checkpoint")
        (head_len,) = struct.unpack_from("<I", data, len(_CKPT_MAGIC))
        start = len(_CKPT_MAGIC) + 4
        try:
            header = json.loads(data[start : start + head_len])
        except ValueError as exc:
            raise StateDirError(origin, "checkpoint header is not JSON") from exc
        blob = data[start + head_len :]
        state_len = header.get("train_state_len")
        history_len = header.get("history_len", 0)
        if not isinstance(state_len, int) or not isinstance(history_len, int):
            raise StateDirError(origin, "checkpoint header lacks its lengths")
        if len(blob) != state_len + history_len:
            raise StateDirError(origin, "checkpoint is truncated")
        train_state, history = blob[:state_len], blob[state_len:]
        if hashlib.sha256(train_state).hexdigest() != header.get("train_state_sha256"):
            raise StateDirError(origin, "checkpoint hash mismatch")
        if history and hashlib.sha256(history).hexdigest() != header.get("history_sha256"):
            raise StateDirError(origin, "checkpoint history hash mismatch")
        return cls(
            step=int(header["step"]),
            train_state=train_state,
            policy_state=header["policy_state"],
            metrics=header["metrics"],
            extra=header["extra"],
            history=history,
        )


class JobDir:
    """One job's folder. Create through ``StateStore.create_job`` or ``StateStore.job``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.job_id = path.name
        self._metrics_repaired = False

    @property
    def checkpoint_dir(self) -> Path:
        """The folder of checkpoint files."""
        return self.path / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        """The metrics log (JSON lines)."""
        return self.path / "metrics.jsonl"

    def spec(self) -> dict[str, Any]:
        """The stored job spec (validate it with ``qsched.protocol.jobspec.JobSpec``)."""
        return self._read_json(self.path / "spec.json")

    def status(self) -> dict[str, Any]:
        """``{"status": ..., "reason": ..., "updated": unix time}``."""
        return self._read_json(self.path / "status.json")

    def set_status(self, status: JobStatus, reason: str = "") -> None:
        """Record the job's lifecycle state atomically.

        Args:
            status: one of ``JOB_STATUSES``.
            reason: a human sentence (why it stopped or failed).
        """
        if status not in JOB_STATUSES:
            raise StateDirError(self.path, f"unknown job status {status!r}")
        record = {"status": status, "reason": reason, "updated": time.time()}
        atomic_write(self.path / "status.json", _json_bytes(record))

    def _read_json(self, path: Path) -> dict[str, Any]:
        try:
            return dict(json.loads(path.read_text()))
        except FileNotFoundError as exc:
            raise StateDirError(path, "missing") from exc
        except ValueError as exc:
            raise StateDirError(path, "not valid JSON") from exc

    def save_checkpoint(self, checkpoint: Checkpoint, keep: int = KEEP_CHECKPOINTS) -> Path:
        """Write a checkpoint atomically and prune old ones.

        Args:
            checkpoint: the snapshot.
            keep: how many of the newest checkpoints to keep (>= 1).

        Returns:
            The checkpoint file.
        """
        self.checkpoint_dir.mkdir(exist_ok=True)
        path = self.checkpoint_dir / f"ckpt-{checkpoint.step:010d}.qsckpt"
        atomic_write(path, checkpoint.to_bytes())
        for old in self._checkpoint_files()[max(1, keep) :]:
            old.unlink(missing_ok=True)
        return path

    def _checkpoint_files(self) -> list[Path]:
        if not self.checkpoint_dir.is_dir():
            return []
        files = [p for p in self.checkpoint_dir.iterdir() if _CKPT_NAME.match(p.name)]
        return sorted(files, key=lambda p: p.name, reverse=True)

    def load_checkpoint(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, or ``None`` when there is none.

        Damaged files (which atomic writes should prevent, but disks fail) are skipped.
        """
        for path in self._checkpoint_files():
            try:
                return Checkpoint.from_bytes(path.read_bytes(), path)
            except (StateDirError, OSError, KeyError, TypeError, ValueError):
                continue
        return None

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Append one JSON line to the metrics log and flush it.

        Args:
            record: a JSON-serialisable mapping (step, loss, q, ...).
        """
        line = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
        if not self._metrics_repaired:
            self._repair_metrics()
        with open(self.metrics_path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()

    def _repair_metrics(self) -> None:
        # A crash mid-append leaves a line without its newline; appending after it
        # would glue two records together, so cut the log back to the last full line.
        # Only the end of the log is read: a long job's log runs to many megabytes.
        self._metrics_repaired = True
        if not self.metrics_path.exists():
            return
        with open(self.metrics_path, "r+b") as fh:
            end = fh.seek(0, os.SEEK_END)
            last, terminated = next(_lines_backwards(fh), (b"", True))
            cut = end if terminated else end - len(last)
            if cut != end:
                fh.truncate(cut)
                fh.flush()
                os.fsync(fh.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        """All records of the metrics log; a torn last line is ignored.

        Raises:
            StateDirError: a line other than the last is not valid JSON.
        """
        if not self.metrics_path.exists():
            return []
        lines = self.metrics_path.read_bytes().split(b"\n")
        records: list[dict[str, Any]] = []
        for index, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as exc:
                if index == len(lines) - 1:  # no newline after it: torn by a crash
                    break
                raise StateDirError(
                    self.metrics_path, f"line {index + 1} is not valid JSON"
                ) from exc
        return records

    def last_records(self, kinds: Collection[str]) -> dict[str, dict[str, Any]]:
        """The last record of each of ``kinds`` in the metrics log (a kind without one is
        left out), read from the end, so a status does not parse a long job's whole log;
        a torn last line is ignored.

        Raises:
            StateDirError: a full line it needs to read is not valid JSON.
        """
        found: dict[str, dict[str, Any]] = {}
        if not self.metrics_path.exists():
            return found
        with open(self.metrics_path, "rb") as fh:
            for line, terminated in _lines_backwards(fh):
                wanted = [k for k in kinds if k not in found and k.encode() in line]
                if not wanted:
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    if not terminated:  # no newline after it: torn by a crash
                        continue
                    raise StateDirError(self.metrics_path, "a line is not valid JSON") from exc
                kind = record.get("kind") if isinstance(record, dict) else None
                if kind in wanted:
                    found[kind] = record
                if len(found) == len(kinds):
                    break
        return found

    def write_export(self, data: bytes, name: str = "model.tflite") -> Path:
        """Store the exported model atomically.

        Args:
            data: the model file's bytes.
            name: the file name inside ``export/``.

        Returns:
            The path of the exported model.
        """
        if "/" in name or name in {"", ".", ".."}:
            raise StateDirError(self.path, f"bad export file name {name!r}")
        folder = self.path / "export"
        folder.mkdir(exist_ok=True)
        atomic_write(folder / name, data)
        return folder / name

    def export_path(self, name: str = "model.tflite") -> Path | None:
        """The exported model, when one was written."""
        path = self.path / "export" / name
        return path if path.exists() else None


class StateStore:
    """The state root with its job folders.

    Args:
        root: the state directory; created when missing.
    """

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else default_state_dir()
        (self.root / "jobs").mkdir(parents=True, exist_ok=True)

    def _job_path(self, job_id: str) -> Path:
        if not _JOB_ID.fullmatch(job_id):
            raise StateDirError(
                self.root, f"invalid job id {job_id!r} (letters, digits, '_', '.', '-')"
            )
        return self.root / "jobs" / job_id

    def create_job(
        self, job_id: str, spec: dict[str, Any], status: JobStatus = "pending"
    ) -> JobDir:
        """Create a job folder with its spec and initial status.

        Args:
            job_id: a file-name-safe id.
            spec: the job spec as JSON-serialisable data (``JobSpec.model_dump(mode="json")``).
            status: the initial status.

        Returns:
            The job folder.

        Raises:
            StateDirError: the id is invalid or a job with this id exists.
        """
        path = self._job_path(job_id)
        try:
            path.mkdir()
        except FileExistsError as exc:
            raise StateDirError(path, "a job with this id exists") from exc
        job = JobDir(path)
        atomic_write(path / "spec.json", _json_bytes(spec))
        job.set_status(status)
        _fsync_dir(path.parent)
        return job

    def job(self, job_id: str) -> JobDir:
        """An existing job folder.

        Raises:
            StateDirError: no such job.
        """
        path = self._job_path(job_id)
        if not (path / "spec.json").exists():
            raise StateDirError(path, "no such job")
        return JobDir(path)

    def jobs(self) -> list[JobDir]:
        """All complete job folders, sorted by id (a folder without a spec is skipped)."""
        return list(self._iter_jobs())

    def _iter_jobs(self) -> Iterator[JobDir]:
        for path in sorted((self.root / "jobs").iterdir()):
            if path.is_dir() and (path / "spec.json").exists() and (path / "status.json").exists():
                yield JobDir(path)

    def resumable(self) -> list[JobDir]:
        """Jobs that were running when the daemon stopped: resume them on start."""
        return [job for job in self._iter_jobs() if job.status().get("status") == "running"]
