"""``qsched train``: one job in this process, no boards, written to a run folder.

The run folder has the layout of a daemon job's folder (``daemon/state.py``), so a
single-process run can be inspected, resumed and compared with a fleet run the same way:

    spec.json        the job spec
    status.json      running, completed or failed, with the reason
    metrics.jsonl    one record per step and per validation (after a resume, the steps
                     re-run since the checkpoint appear again; the later record holds)
    checkpoints/     every ``checkpoint_every`` steps and at the end (the newest 3 kept)
    export/          the trained model: ``<name>.tflite`` (INT8) or ``<name>.npz`` (FP32)
    summary.json     steps, final q, loss and accuracy, forward passes, wall time and,
                     with recalibration, how many channels doubled their scale 0, 1,
                     2, ... times (``scale_doublings``)

``qsched train --resume DIR`` continues the run in ``DIR`` from its newest checkpoint and
ends with the weights an uninterrupted run ends with, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qsched.daemon.checkpoints import checkpoint_of, restore_checkpoint
from qsched.daemon.export import default_format, export_model
from qsched.daemon.specfile import load_spec_data
from qsched.daemon.state import JobDir, StateDirError, atomic_write
from qsched.policies import create_policy
from qsched.protocol.jobspec import JobSpec
from qsched.zo.recalibrate import doubling_counts
from qsched.zo.step import EvalRecord, StepRecord, checkpoint_due
from qsched.zo.trainer import TrainResult, policy_context, train_zo
from qsched.zo.workload import Workload

__all__ = ["RunFolder", "main", "run_in_folder"]

EXIT_USAGE = 2
EXIT_FAILED = 1


class RunFolder(JobDir):
    """A single-process run's folder: a job folder made and read without a state store."""

    @classmethod
    def create(cls, path: Path, spec: JobSpec) -> RunFolder:
        """Make ``path`` (it must not hold a run) and write the spec and status.

        Raises:
            StateDirError: ``path`` already holds a run's spec.
        """
        if (path / "spec.json").exists():
            raise StateDirError(path, "holds a run already; continue it with --resume")
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / "spec.json", _json(spec.model_dump(mode="json")))
        folder = cls(path)
        folder.set_status("running")
        return folder

    def load(self) -> tuple[JobSpec, TrainResult | None]:
        """The run's spec and where it stands (None: no checkpoint yet).

        Raises:
            StateDirError: the spec or the checkpoint cannot be read.
        """
        try:
            spec = JobSpec.from_stored(self.spec())
        except ValidationError as exc:
            raise StateDirError(self.path / "spec.json", f"not a valid job spec: {exc}") from exc
        checkpoint = self.load_checkpoint()
        return spec, None if checkpoint is None else restore_checkpoint(spec, checkpoint)[0]


def run_in_folder(
    folder: RunFolder,
    workload: Workload,
    resume: TrainResult | None = None,
    stop_at: int | None = None,
) -> TrainResult:
    """Train ``workload``'s spec (from ``resume`` on), logging and checkpointing into ``folder``.

    Args:
        folder: the run folder.
        workload: the job's workload (``Workload.from_spec``).
        resume: where a previous run of this folder stood (its newest checkpoint).
        stop_at: stop before this step, as a kill would (default: run to the end).

    Returns:
        The result; when the run reached its last step, the model is exported too.
    """
    spec, result = workload.spec, resume
    end = spec.steps if stop_at is None else min(stop_at, spec.steps)

    def log(record: StepRecord, evaluation: EvalRecord | None) -> None:
        folder.append_metrics({"kind": "step", "time": time.time(), **asdict(record)})
        if evaluation is not None:
            folder.append_metrics({"kind": "validation", "time": time.time(), **asdict(evaluation)})
            _print_progress(record, evaluation)

    while result is None or result.state.step < end:
        start = 0 if result is None else result.state.step
        # Run to the next checkpoint: train_zo resumes a result to the same bits.
        chunk_end = min(end, _next_checkpoint(start, spec.checkpoint_every))
        result = train_zo(spec, on_step=log, workload=workload, resume=result, stop_at=chunk_end)
        folder.save_checkpoint(checkpoint_of(result, spec.policy))
    if result.done:
        fmt = default_format(workload)
        folder.write_export(export_model(workload, result.state, fmt), f"{spec.name}.{fmt}")
        folder.set_status("completed")
    atomic_write(folder.path / "summary.json", _json(_summary(result)))
    return result


def _next_checkpoint(step: int, every: int) -> int:
    step += 1
    while not checkpoint_due(step, every):
        step += 1
    return step


def _summary(result: TrainResult) -> dict[str, Any]:
    last = result.steps[-1] if result.steps else None
    return {
        "steps": len(result.steps),
        "final_q": last.q if last else None,
        "final_train_loss": last.train_loss if last else None,
        "final_val_accuracy": result.evals[-1].val_accuracy if result.evals else None,
        "forward_passes": result.forward_passes,
        "checksum": f"{result.state.checksum():08x}",
        "wall_s": round(result.wall_s, 3),
        "scale_doublings": (
            None if result.state.scale_exps is None else doubling_counts(result.state.scale_exps)
        ),
    }


def _json(data: Any) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def _print_progress(record: StepRecord, evaluation: EvalRecord) -> None:
    # One line per validation: quiet enough for long runs.
    print(
        f"step {evaluation.step:>6}  q {record.q:>3}  train loss {record.train_loss:.4f}  "
        f"val acc {evaluation.val_accuracy:.4f}  forward passes {evaluation.forward_passes}",
        file=sys.stderr,
    )


def _spec_errors() -> tuple[type[Exception], ...]:
    """The typed errors a job spec's names and paths raise (unknown model, data set, policy...)."""
    from qsched.daemon.export import ExportError
    from qsched.policies.errors import PolicyError
    from qsched.zo.datasets import DatasetError
    from qsched.zo.graph import GraphError
    from qsched.zo.tflite_io import TFLiteError
    from qsched.zo.workload import WorkloadError
    from qsched.zo.zoo import ZooError

    return (
        DatasetError,
        ExportError,
        GraphError,
        PolicyError,
        TFLiteError,
        WorkloadError,
        ZooError,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qsched train",
        description="Run a job spec in this process (the reference loop, no boards), writing a run "
        "folder like a daemon job's. Spec fields: "
        f"{', '.join(JobSpec.model_fields)} (policy.name, policy.config.KEY).",
        epilog="example: qsched train --set model=cnn --set steps=200 --set policy.name=fixed "
        "--set policy.config.q=4 --out runs/cnn-q4",
    )
    parser.add_argument(
        "--spec", type=Path, help="job spec, JSON or TOML (default: the built-in defaults)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field (JSON value)",
    )
    parser.add_argument(
        "--out", type=Path, help="the run folder (default: runs/train-<name>-<time>/)"
    )
    parser.add_argument(
        "--resume", type=Path, metavar="DIR", help="continue the run in DIR from its checkpoint"
    )
    parser.add_argument(
        "--stop-at", type=int, metavar="STEP", help=argparse.SUPPRESS
    )  # tests: a kill
    return parser


def _prepare(args: argparse.Namespace) -> tuple[RunFolder, Workload, TrainResult | None]:
    """The folder, the workload and the resume point the options name (errors: one line)."""
    if args.resume is not None:
        if args.spec is not None or args.set or args.out is not None:
            raise ValueError(
                "--resume takes the spec from the run folder: give no --spec, --set or --out"
            )
        folder = RunFolder(args.resume)
        spec, resume = folder.load()
        workload = Workload.from_spec(spec)
        folder.set_status("running")
        return folder, workload, resume
    try:
        spec = JobSpec.model_validate(load_spec_data(args.spec, args.set))
    except (OSError, ValueError, ValidationError) as exc:
        raise ValueError(f"invalid job spec: {exc}") from exc
    # Names and files resolve before a folder is made: model, data, backbone, policy.
    workload = Workload.from_spec(spec)
    create_policy(spec.policy, policy_context(spec, workload))
    out = args.out or Path("runs") / f"train-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return RunFolder.create(out, spec), workload, None


def main(argv: list[str]) -> int:
    """``qsched train``: run a job spec in this process (the reference loop, no boards).

    Args:
        argv: ``[--spec FILE] [--set KEY=VALUE ...] [--out DIR]`` or ``--resume DIR``.

    Returns:
        0; 2 when the spec is invalid, names a model, data set, policy or file that does
        not resolve, or the folder is unusable (one line on stderr, no traceback); 1 when
        training fails (a NaN loss), recorded in the folder's status.
    """
    args = _parser().parse_args(argv)
    unresolved: tuple[type[Exception], ...] = (OSError, ValueError, StateDirError, *_spec_errors())
    try:
        folder, workload, resume = _prepare(args)
    except unresolved as exc:
        print(f"qsched train: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from qsched.zo.spsa import LossError

    failures: tuple[type[Exception], ...] = (LossError, *_spec_errors())
    try:
        result = run_in_folder(folder, workload, resume, stop_at=args.stop_at)
    except failures as exc:
        folder.set_status("failed", str(exc))
        print(f"qsched train: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps({**_summary(result), "folder": str(folder.path)}, indent=2))
    return 0
