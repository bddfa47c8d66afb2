"""``qsched experiment``: compare q policies on a grid of policies x numerics x seeds.

Every run is the fleet's training step computed in one process (``qsched.zo.trainer``),
which the in-process fleet reproduces bit for bit (the determinism contract, tested
with the step engine), so a grid run measures the method, not the transport;
``--fleet BOARDS`` runs each job on an in-process fleet of virtual boards instead (same
results, slower). Runs are spread over worker processes; each run is a pure function of
its job spec, so the results do not depend on the number of workers.

Two settings:

* scratch (default): the job spec's model trained from its seeded initialisation on
  ``--dataset``;
* transfer (``--transfer``): a backbone pretrained with first-order training on the
  source classes, a fresh classifier for the disjoint target classes, and ZO training
  of the last ``--trainable`` layers on the target task (the on-device setting).

Outputs in ``--out``: ``results.json``, ``results.csv``, ``results.md`` and PNG plots
(``qsched.lab.plots``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from qsched.daemon.specfile import parse_value
from qsched.lab.errors import ExperimentError
from qsched.lab.procs import sigterm_as_interrupt
from qsched.lab.progress import ProgressLine
from qsched.lab.results import SCHEMA, write_results_json
from qsched.lab.run_store import RUNS_FOLDER, RunStore, fingerprint
from qsched.policies import create_policy
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.recalibrate import doubling_counts

__all__ = [
    "GRIDS",
    "NUMERICS",
    "ConfigSummary",
    "ExperimentError",
    "ExperimentResult",
    "GridEntry",
    "RunRecord",
    "Setting",
    "TransferSetting",
    "build_grid",
    "main",
    "run_experiment",
    "write_results",
]

PAPER_FIXED_Q: Final = (1, 2, 4, 8, 16, 32)
PAPER_QMAX: Final = 32
# Numerics tokens of the command line: (JobSpec.numerics, JobSpec.accumulator).
NUMERICS: Final[dict[str, tuple[str, str]]] = {
    "fp32": ("fp32", "fp16"),
    "int8": ("int8", "fp16"),
    "int8-acc8": ("int8", "int8"),
}
# "baseline": no ZO run, only the first-order baseline (and --policies, if any).
GRIDS: Final = ("paper", "all-policies", "custom", "baseline")
_EXTRA_POLICIES: Final = ("linear", "power", "variance")
_FLOOR_PP: Final = 1.0  # QScheduler within this many points of the best fixed q ...
_FLOOR_PASSES: Final = 0.60  # ... with at most this share of its forward passes


# --------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class GridEntry:
    """One configuration of the grid: a policy under one numerics."""

    label: str
    policy: PolicySpec
    numerics: str  # a key of NUMERICS

    @property
    def key(self) -> str:
        """Unique name of the configuration: ``label@numerics``."""
        return f"{self.label}@{self.numerics}"


def _policy_entry(token: str) -> tuple[str, PolicySpec]:
    """``fixed:8`` / ``qscheduler`` / ``name:{json config}`` -> (label, policy spec)."""
    name, _, arg = token.partition(":")
    if name == "fixed" and arg.isdigit():
        return f"fixed q={int(arg)}", PolicySpec(name="fixed", config={"q": int(arg)})
    config: dict[str, Any] = {}
    if arg:
        try:
            config = json.loads(arg)
        except ValueError as exc:
            raise ExperimentError(
                f"policy {token!r}: the part after ':' must be a JSON object"
            ) from exc
        if not isinstance(config, dict):
            raise ExperimentError(f"policy {token!r}: the part after ':' must be a JSON object")
    if name in ("qscheduler", "variance", "linear", "power") and not config:
        config = (
            {"qmax": PAPER_QMAX} if name in ("linear", "power") else {"q0": 1, "qmax": PAPER_QMAX}
        )
    label = (
        name if not arg else f"{name} {json.dumps(config, sort_keys=True, separators=(',', '='))}"
    )
    return label, PolicySpec(name=name, config=config)


def build_grid(
    grid: str, policies: Sequence[str] = (), numerics: Sequence[str] = ("fp32", "int8")
) -> list[GridEntry]:
    """The configurations of a named grid, or of custom policy tokens.

    Args:
        grid: ``paper`` (fixed q in {1,...,32} and QScheduler q0=1, Qmax=32),
            ``all-policies`` (paper plus linear, power, variance), ``custom`` or
            ``baseline`` (none: the first-order baseline alone).
        policies: tokens added to the grid (all of it for ``custom`` and
            ``baseline``): ``fixed:Q``, a policy name, or ``name:{json config}``.
        numerics: keys of :data:`NUMERICS`.

    Returns:
        The entries, numerics-major (none for an empty ``baseline`` grid).

    Raises:
        ExperimentError: unknown grid, numerics or an empty ``custom`` grid.
    """
    if grid not in GRIDS:
        raise ExperimentError(f"unknown grid {grid!r}; choose one of {', '.join(GRIDS)}")
    named = grid in ("paper", "all-policies")
    tokens = [f"fixed:{q}" for q in PAPER_FIXED_Q] + ["qscheduler"] if named else []
    if grid == "all-policies":
        tokens += list(_EXTRA_POLICIES)
    tokens += [t for t in policies if t not in tokens]
    unknown = [n for n in numerics if n not in NUMERICS]
    if unknown or not numerics:
        raise ExperimentError(f"unknown numerics {unknown}; choose from {', '.join(NUMERICS)}")
    if not tokens and grid != "baseline":
        raise ExperimentError("the grid is empty: name policies with --policies")
    parsed = [_policy_entry(t) for t in tokens]
    return [GridEntry(label, spec, num) for num in numerics for label, spec in parsed]


# --------------------------------------------------------------------------- the setting


@dataclass(frozen=True)
class TransferSetting:
    """Pretrain on source classes with backprop, ZO-train the last layers on target classes."""

    source_classes: tuple[int, ...]
    target_classes: tuple[int, ...]
    pretrain_steps: int = 1500
    pretrain_lr: float = 3e-3
    pretrain_seed: int = 0


@dataclass(frozen=True)
class Setting:
    """What every run of the grid trains: the base job spec fields and the transfer option.

    ``overrides`` apply to every run; ``numerics_overrides[numerics]`` to runs of that
    numerics token only (e.g. an FP32 learning rate).
    """

    overrides: dict[str, Any] = field(default_factory=dict)
    numerics_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    transfer: TransferSetting | None = None
    baseline_lr: float = 3e-3
    fleet_boards: int = 0  # > 0: train on an in-process fleet of this many virtual boards

    def spec(self, entry: GridEntry, seed: int) -> JobSpec:
        """The job spec of one run.

        Args:
            entry: the configuration.
            seed: the run's seed.

        Returns:
            The validated spec.
        """
        numerics, accumulator = NUMERICS[entry.numerics]
        data: dict[str, Any] = {**self.overrides, **self.numerics_overrides.get(entry.numerics, {})}
        data.update(
            name=_job_name(entry, seed),
            numerics=numerics,
            accumulator=accumulator,
            seed=seed,
            policy=entry.policy.model_dump(),
        )
        return JobSpec.model_validate(data)


def _job_name(entry: GridEntry, seed: int) -> str:
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in entry.key)
    return f"{safe}_s{seed}"[:64]


# --------------------------------------------------------------------------- one run


@dataclass
class RunRecord:
    """One run's outcome: validation history, q change points, cost."""

    key: str
    seed: int
    steps: int
    forward_passes: int
    wall_s: float
    eval_steps: list[int]
    eval_forward_passes: list[int]
    val_accuracy: list[float]
    val_loss: list[float]
    q_changes: list[tuple[int, int]]  # (first step, q) whenever q changed
    scale_doublings: list[int] | None = None  # INT8 with recalibration: channels per exponent

    @property
    def final_accuracy(self) -> float:
        """Validation accuracy after the last step."""
        return self.val_accuracy[-1]

    @property
    def best_accuracy(self) -> float:
        """Best validation accuracy seen."""
        return max(self.val_accuracy)


def _q_changes(qs: Iterable[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for step, q in enumerate(qs):
        if not out or out[-1][1] != q:
            out.append((step, int(q)))
    return out


_WORKER: dict[str, Any] = {}  # per-process context: setting, prepared transfer data, progress queue


def _init_worker(setting: Setting, prepared: Any, progress: Any) -> None:
    _WORKER.update(setting=setting, prepared=prepared, progress=progress)


def _workload(spec: JobSpec, prepared: Any) -> Any:
    from qsched.zo.workload import Workload

    if prepared is None:
        return Workload.from_spec(spec)
    return _transfer_workload(spec, prepared)


def _run(task: tuple[GridEntry, int]) -> RunRecord:
    """Run one (entry, seed) in this process, reporting progress every validation."""
    from qsched.zo.step import EvalRecord, StepRecord
    from qsched.zo.trainer import policy_context, train_zo

    entry, seed = task
    setting: Setting = _WORKER["setting"]
    spec = setting.spec(entry, seed)
    wl = _workload(spec, _WORKER.get("prepared")) if setting.fleet_boards == 0 else None
    progress: Callable[[int, int], None] | None = _WORKER.get("progress")
    done = 0

    def on_step(record: StepRecord, evaluation: EvalRecord | None) -> None:
        nonlocal done
        if evaluation is not None and progress is not None:
            progress(record.step + 1 - done, 0)
            done = record.step + 1

    if setting.fleet_boards > 0:
        result = _train_fleet(spec, setting.fleet_boards)
    else:
        assert wl is not None  # built above for in-process runs
        result = train_zo(
            spec, create_policy(spec.policy, policy_context(spec, wl)), on_step, workload=wl
        )
    if progress is not None:
        progress(len(result.steps) - done, 1)
    exps = result.state.scale_exps
    return RunRecord(
        key=entry.key,
        seed=seed,
        steps=len(result.steps),
        forward_passes=result.forward_passes,
        wall_s=round(result.wall_s, 3),
        eval_steps=[e.step + 1 for e in result.evals],
        eval_forward_passes=[e.forward_passes for e in result.evals],
        val_accuracy=[e.val_accuracy for e in result.evals],
        val_loss=[e.val_loss for e in result.evals],
        q_changes=_q_changes(r.q for r in result.steps),
        scale_doublings=None if exps is None else doubling_counts(exps),
    )


def _train_fleet(spec: JobSpec, boards: int) -> Any:
    """Train on an in-process fleet of virtual boards (the daemon's step engine); same bits."""
    import asyncio

    from qsched.lab.harness import run_job_inprocess

    job = asyncio.run(run_job_inprocess(spec, boards=boards))
    if job.status != "completed":
        raise ExperimentError(f"run {spec.name}: the fleet ended the job as {job.status}")
    return job.train


# --------------------------------------------------------------------------- transfer


@dataclass
class _Prepared:
    """The transfer setting's data and pretrained backbone (built once, shipped to workers)."""

    target: Any  # Dataset
    backbone: Any  # Model, with the source task's classifier
    pretrain: dict[str, Any]


def _prepare_transfer(setting: Setting, base: JobSpec) -> _Prepared:
    """Split the data set, pretrain the backbone on the source classes with backprop."""
    from qsched.zo.backprop import train_backprop
    from qsched.zo.datasets import load_dataset, split_classes
    from qsched.zo.zoo import build_model

    transfer = setting.transfer
    assert transfer is not None
    full = load_dataset(base.dataset)
    source, target = split_classes(full, transfer.source_classes, transfer.target_classes)
    model = build_model(
        base.model,
        source.input_shape,
        source.num_classes,
        seed=transfer.pretrain_seed,
        **base.model_options,
    )
    started = time.perf_counter()
    trained, history = train_backprop(
        model,
        source,
        transfer.pretrain_steps,
        lr=transfer.pretrain_lr,
        batch_size=base.batch_size,
        seed=transfer.pretrain_seed,
    )
    pretrain = {
        "steps": transfer.pretrain_steps,
        "lr": transfer.pretrain_lr,
        "optimizer": "adam",
        "source_val_accuracy": history.val_accuracy[-1],
        "wall_s": round(time.perf_counter() - started, 3),
        "source": source.name,
        "target": target.name,
        "target_train": len(target.x_train),
        "target_val": len(target.x_val),
    }
    return _Prepared(target, trained, pretrain)


def _transfer_model(prepared: _Prepared, seed: int) -> Any:
    from qsched.zo.zoo import replace_classifier

    return replace_classifier(prepared.backbone, prepared.target.num_classes, seed=seed)


def _transfer_workload(spec: JobSpec, prepared: _Prepared) -> Any:
    """The target task's workload: the backbone with a seeded new head, quantised as
    from_spec does."""
    from qsched.zo.quantize import quantize_model
    from qsched.zo.workload import Workload, calibration_indices, resolve_trainable, widen_logits

    model = _transfer_model(prepared, spec.seed)
    data = prepared.target
    qmodel = None
    if spec.numerics == "int8":
        calibration = data.x_train[calibration_indices(spec.seed, len(data.x_train))]
        qmodel = widen_logits(quantize_model(model, calibration))
    return Workload(spec, model, qmodel, data, resolve_trainable(model, spec.trainable))


# --------------------------------------------------------------------------- first-order baseline


def _baseline(
    setting: Setting, base: JobSpec, seeds: Sequence[int], prepared: _Prepared | None
) -> dict[str, Any]:
    """FP32 backprop (Adam) with the grid's steps, batch size and trainable layers, per seed,
    from the model an FP32 ZO run of that seed starts from (zoo, backbone file, new head)."""
    from qsched.zo.backprop import train_backprop
    from qsched.zo.datasets import load_dataset
    from qsched.zo.workload import Workload

    finals, bests, walls = [], [], []
    data = prepared.target if prepared is not None else load_dataset(base.dataset)
    for seed in seeds:
        if prepared is not None:
            model = _transfer_model(prepared, seed)
        else:
            # The model an FP32 run starts from: INT8-only fields (an INT8 buffer,
            # recalibration) of a grid that starts with INT8 runs do not apply.
            fp32 = {"numerics": "fp32", "accumulator": "fp16", "recalibrate_every": 0}
            fields = {**base.model_dump(), **fp32, "seed": seed, "lr_unit": "weight"}
            model = Workload.from_spec(JobSpec.model_validate(fields)).model
        started = time.perf_counter()
        _, history = train_backprop(
            model,
            data,
            base.steps,
            lr=setting.baseline_lr,
            batch_size=base.batch_size,
            seed=seed,
            trainable=base.trainable,
            eval_every=base.eval_every,
        )
        walls.append(time.perf_counter() - started)
        finals.append(history.val_accuracy[-1])
        bests.append(max(history.val_accuracy))
    return {
        "method": "backprop",
        "optimizer": "adam",
        "lr": setting.baseline_lr,
        "numerics": "fp32",
        "steps": base.steps,
        "trainable": base.trainable,
        "final_accuracy": _stats(finals),
        "best_accuracy": _stats(bests),
        "wall_s": _stats(walls),
    }


# --------------------------------------------------------------------------- aggregation


def _stats(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (0 for one value) and the values."""
    arr = np.asarray(values, dtype=np.float64)
    std = float(arr.std(ddof=1)) if len(arr) > 1 else 0.0
    return {"mean": float(arr.mean()), "std": std, "values": [float(v) for v in arr]}


def _q_per_step(changes: Sequence[tuple[int, int]], steps: int) -> list[int]:
    out = np.zeros(steps, dtype=np.int64)
    for i, (start, q) in enumerate(changes):
        stop = changes[i + 1][0] if i + 1 < len(changes) else steps
        out[start:stop] = q
    return [int(v) for v in out]


@dataclass
class ConfigSummary:
    """One configuration's runs over all seeds, aggregated."""

    entry: GridEntry
    runs: list[RunRecord]

    def to_json(self) -> dict[str, Any]:
        """The configuration's block of ``results.json``."""
        runs = sorted(self.runs, key=lambda r: r.seed)
        first = runs[0]
        acc = np.asarray([r.val_accuracy for r in runs], dtype=np.float64)
        fps = np.asarray([r.eval_forward_passes for r in runs], dtype=np.float64)
        mean_q = np.mean([_q_per_step(r.q_changes, r.steps) for r in runs], axis=0)
        numerics, accumulator = NUMERICS[self.entry.numerics]
        return {
            "key": self.entry.key,
            "label": self.entry.label,
            "policy": self.entry.policy.model_dump(),
            "numerics": numerics,
            "accumulator": accumulator,
            "numerics_token": self.entry.numerics,
            "seeds": [r.seed for r in runs],
            "steps": first.steps,
            "final_accuracy": _stats([r.final_accuracy for r in runs]),
            "best_accuracy": _stats([r.best_accuracy for r in runs]),
            "forward_passes": _stats([r.forward_passes for r in runs]),
            "wall_s": _stats([r.wall_s for r in runs]),
            "mean_q": float(mean_q.mean()),
            "curve": {
                "step": first.eval_steps,
                "val_accuracy_mean": [float(v) for v in acc.mean(axis=0)],
                "val_accuracy_std": [
                    float(v) for v in (acc.std(axis=0, ddof=1) if len(runs) > 1 else acc[0] * 0)
                ],
                "forward_passes_mean": [float(v) for v in fps.mean(axis=0)],
            },
            "q_trajectory": [
                {"seed": r.seed, "changes": [list(c) for c in r.q_changes]} for r in runs
            ],
            "runs": [
                {
                    "seed": r.seed,
                    "final_accuracy": r.final_accuracy,
                    "best_accuracy": r.best_accuracy,
                    "forward_passes": r.forward_passes,
                    "wall_s": r.wall_s,
                    "val_accuracy": r.val_accuracy,
                    "val_loss": r.val_loss,
                    "scale_doublings": r.scale_doublings,
                }
                for r in runs
            ],
        }


@dataclass
class ExperimentResult:
    """Everything ``results.json`` holds."""

    setting: dict[str, Any]
    configs: list[dict[str, Any]]
    baseline: dict[str, Any] | None
    environment: dict[str, Any]
    command: str

    @property
    def comparisons(self) -> list[dict[str, Any]]:
        """QScheduler against the best fixed q, per numerics (the floors of the issue)."""
        out = []
        for token in dict.fromkeys(c["numerics_token"] for c in self.configs):
            group = [c for c in self.configs if c["numerics_token"] == token]
            fixed = [c for c in group if c["policy"]["name"] == "fixed"]
            for sched in (c for c in group if c["policy"]["name"] != "fixed"):
                if fixed:
                    out.append(_compare(sched, fixed))
        return out

    def to_json(self) -> dict[str, Any]:
        """The document written to ``results.json``."""
        return {
            "schema": SCHEMA,
            "command": self.command,
            "setting": self.setting,
            "environment": self.environment,
            "configs": self.configs,
            "baseline": self.baseline,
            "comparisons": self.comparisons,
            "floors": {"within_pp": _FLOOR_PP, "max_forward_pass_share": _FLOOR_PASSES},
        }


def _paired(policy: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any] | None:
    """Per-seed accuracy differences (same seed: same initial weights and minibatches), in
    points."""
    mine = {r["seed"]: r["final_accuracy"] for r in policy.get("runs", [])}
    theirs = {r["seed"]: r["final_accuracy"] for r in fixed.get("runs", [])}
    seeds = sorted(set(mine) & set(theirs))
    if not seeds:
        return None
    stats = _stats([100.0 * (mine[s] - theirs[s]) for s in seeds])
    stats["standard_error"] = stats["std"] / math.sqrt(len(seeds))
    return stats


def _compare(policy: dict[str, Any], fixed: list[dict[str, Any]]) -> dict[str, Any]:
    best = max(fixed, key=lambda c: c["final_accuracy"]["mean"])
    diff_pp = 100.0 * (policy["final_accuracy"]["mean"] - best["final_accuracy"]["mean"])
    share = policy["forward_passes"]["mean"] / best["forward_passes"]["mean"]
    return {
        "paired_difference_pp": _paired(policy, best),
        "numerics_token": policy["numerics_token"],
        "policy": policy["key"],
        "best_fixed": best["key"],
        "best_fixed_q": best["policy"]["config"].get("q"),
        "policy_final_accuracy": policy["final_accuracy"]["mean"],
        "best_fixed_final_accuracy": best["final_accuracy"]["mean"],
        "difference_pp": diff_pp,
        "forward_pass_share": share,
        "floor_met": bool(diff_pp >= -_FLOOR_PP and share <= _FLOOR_PASSES),
    }


# --------------------------------------------------------------------------- running the grid


class _GridProgress:
    """The grid's steps and finished runs on one ``ProgressLine`` (or nowhere)."""

    def __init__(self, steps: int, runs: int, stream: Any, enabled: bool) -> None:
        self.line = ProgressLine(steps, label="grid", stream=stream) if enabled else None
        self.steps, self.runs, self.runs_total = 0, 0, runs

    def advance(self, steps: int = 0, runs: int = 0) -> None:
        self.steps += steps
        self.runs += runs
        if self.line is not None:
            self.line.update(self.steps, runs=f"{self.runs}/{self.runs_total}")

    def close(self) -> None:
        if self.line is not None:
            self.line.close()


def _cost(entry: GridEntry, steps: int) -> float:
    """A rough cost estimate, to start the longest runs first (better load balance)."""
    q = entry.policy.config.get("q", entry.policy.config.get("qmax", 8) / 2)
    return float(q) * steps * (3.0 if entry.numerics.startswith("int8") else 1.0)


def _run_tasks(
    tasks: list[tuple[GridEntry, int]],
    setting: Setting,
    prepared: _Prepared | None,
    workers: int,
    bar: _GridProgress,
    finished: Callable[[RunRecord], None],
) -> None:
    """Run ``tasks``, handing each run's record to ``finished`` as soon as it ends."""
    if not tasks:
        return
    if workers <= 1:
        _init_worker(setting, prepared, lambda steps, runs: bar.advance(steps, runs))
        try:
            for task in tasks:
                finished(_run(task))
        finally:
            _WORKER.clear()
        return
    _run_pool(tasks, setting, prepared, workers, bar, finished)


def _run_pool(
    tasks: list[tuple[GridEntry, int]],
    setting: Setting,
    prepared: _Prepared | None,
    workers: int,
    bar: _GridProgress,
    finished: Callable[[RunRecord], None],
) -> None:
    # spawn: fresh interpreters (no fork of a threaded parent); one BLAS thread per worker
    # so that `workers` processes use `workers` cores.
    ctx = multiprocessing.get_context("spawn")
    saved = {k: os.environ.get(k) for k in _THREAD_VARS}
    os.environ.update(dict.fromkeys(_THREAD_VARS, "1"))
    try:
        queue = ctx.Queue()
        with ctx.Pool(workers, _init_pool_worker, (setting, prepared, queue)) as pool:
            records = pool.imap_unordered(_run, tasks, chunksize=1)
            for _ in tasks:
                finished(_next_record(records, queue, bar))
            _drain(queue, bar, timeout=0.0)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


EXIT_INTERRUPTED: Final = 130  # as a shell reports Ctrl-C
EXIT_PARENT_GONE: Final = 70  # a pool worker whose parent ended (EX_SOFTWARE)


def _next_record(records: Any, queue: Any, bar: _GridProgress) -> RunRecord:
    """The next run to finish (a worker's exception is raised here), the bar kept moving."""
    while True:
        try:
            record: RunRecord = records.next(timeout=0.5)
        except multiprocessing.TimeoutError:
            _drain(queue, bar, timeout=0.0)
            continue
        return record


_THREAD_VARS: Final = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _init_pool_worker(setting: Setting, prepared: Any, queue: Any) -> None:
    def report(steps: int, runs: int) -> None:
        queue.put((steps, runs))

    _follow_parent()
    _init_worker(setting, prepared, report)


def _follow_parent() -> None:
    """Leave Ctrl-C to the parent and end with it.

    The parent stops the pool on Ctrl-C or SIGTERM; a worker that took the interrupt
    itself would print a traceback of its own. And a worker whose parent is gone however
    it ended (SIGKILL included) exits at once, where it would otherwise compute its run,
    for nobody, for as long as a run takes.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        watch = threading.Thread(
            target=_exit_when_gone, args=(parent.sentinel,), name="parent-watch", daemon=True
        )
        watch.start()


def _exit_when_gone(parent_sentinel: int) -> None:
    multiprocessing.connection.wait([parent_sentinel])  # readable once the parent is gone
    os._exit(EXIT_PARENT_GONE)


def _drain(queue: Any, bar: _GridProgress, timeout: float) -> None:
    """Fold every progress message waiting in the queue into the bar (wait up to ``timeout``)."""
    import queue as queue_module

    steps = runs = 0
    wait = timeout
    while True:
        try:
            s, r = queue.get(timeout=wait) if wait else queue.get_nowait()
        except queue_module.Empty:
            break
        steps, runs, wait = steps + s, runs + r, 0.0
    if steps or runs:
        bar.advance(steps, runs)


def run_experiment(
    entries: Sequence[GridEntry],
    seeds: Sequence[int],
    setting: Setting,
    *,
    workers: int = 1,
    baseline: bool = True,
    progress: bool = True,
    stream: Any = None,
    command: str = "",
    store: RunStore | None = None,
) -> ExperimentResult:
    """Run every (entry, seed) and aggregate per entry.

    Args:
        entries: the grid (none: the baseline alone).
        seeds: job seeds; each seed fixes the model's initial weights (or the new head),
            the minibatches and the perturbations.
        setting: the base job spec fields and the transfer option.
        workers: processes (1: run in this process).
        baseline: also train the first-order FP32 baseline per seed.
        progress: draw a progress bar on ``stream``.
        stream: where the bar goes (default: stderr).
        command: the command line, recorded in the results.
        store: where each run's record is kept as it finishes; the runs it already holds
            for the same spec are taken from it instead of run again (a resumed grid).

    Returns:
        The aggregated result.

    Raises:
        ExperimentError: no seeds, neither a configuration nor the baseline, or a spec
            that does not validate.
    """
    if not (entries or baseline) or not seeds:
        raise ExperimentError("need a configuration or the baseline, and one seed")
    if setting.fleet_boards > 0 and setting.transfer is not None:
        raise ExperimentError(
            "--fleet runs job specs as the daemon does; the transfer setting needs --fleet 0"
        )
    base = _validate(entries, seeds, setting)
    prepared = _prepare_transfer(setting, base) if setting.transfer is not None else None
    tasks = sorted(((e, s) for e in entries for s in seeds), key=lambda t: -_cost(t[0], base.steps))
    kept = _Kept(store, setting, tasks)
    if kept.records:
        print(f"resuming: {len(kept.records)} of {len(tasks)} runs kept", file=stream or sys.stderr)
    bar = _GridProgress(len(tasks) * base.steps, len(tasks), stream or sys.stderr, progress)
    bar.advance(sum(r.steps for r in kept.records.values()), len(kept.records))
    started = time.perf_counter()
    try:
        _run_tasks(kept.missing(), setting, prepared, workers, bar, kept.add)
    finally:
        bar.close()
    grid_wall = time.perf_counter() - started
    records = [kept.records[(e.key, s)] for e, s in tasks]  # the grid's order, however run
    configs = [ConfigSummary(e, [r for r in records if r.key == e.key]).to_json() for e in entries]
    first_order = _baseline(setting, base, seeds, prepared) if baseline else None
    environment = _environment(workers, grid_wall, setting.fleet_boards)
    if kept.resumed:
        environment["resumed_runs"] = kept.resumed
    return ExperimentResult(
        setting=_setting_json(setting, base, seeds, prepared),
        configs=configs,
        baseline=first_order,
        environment=environment,
        command=command,
    )


class _Kept:
    """The grid's finished runs: those a store held at the start, then each as it ends."""

    def __init__(
        self, store: RunStore | None, setting: Setting, tasks: list[tuple[GridEntry, int]]
    ) -> None:
        self.store, self.tasks = store, tasks
        self.fingerprints = _run_fingerprints(setting, tasks)
        self.records: dict[tuple[str, int], RunRecord] = {}
        for (key, seed), spec_fingerprint in self.fingerprints.items():
            doc = store.load(key, seed, spec_fingerprint) if store is not None else None
            record = _record_from_json(doc) if doc is not None else None
            if record is not None:
                self.records[(key, seed)] = record
        self.resumed = len(self.records)

    def missing(self) -> list[tuple[GridEntry, int]]:
        return [(e, s) for e, s in self.tasks if (e.key, s) not in self.records]

    def add(self, record: RunRecord) -> None:
        key = (record.key, record.seed)
        self.records[key] = record
        if self.store is not None:
            self.store.save(record.key, record.seed, self.fingerprints[key], asdict(record))


def _run_fingerprints(
    setting: Setting, tasks: list[tuple[GridEntry, int]]
) -> dict[tuple[str, int], str]:
    """What each run's outcome depends on: its spec, the backbone file's bytes, the transfer
    setting, the trainer (a fleet gives the same bits, not the same wall time), the code.
    The parts every run shares are read once for the grid, each backbone file hashed once."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        code = version("qsched")
    except PackageNotFoundError:  # run from a source tree that was never installed
        code = "unknown"
    shared = {
        "transfer": asdict(setting.transfer) if setting.transfer is not None else None,
        "fleet_boards": setting.fleet_boards,
        "qsched": code,
    }
    digests: dict[str, str | None] = {}
    out: dict[tuple[str, int], str] = {}
    for entry, seed in tasks:
        spec = setting.spec(entry, seed)
        if spec.backbone and spec.backbone not in digests:
            digests[spec.backbone] = _file_digest(Path(spec.backbone))
        backbone = digests[spec.backbone] if spec.backbone else None
        document = {**shared, "spec": spec.model_dump(mode="json"), "backbone_sha256": backbone}
        out[(entry.key, seed)] = fingerprint(document)
    return out


def _file_digest(path: Path) -> str | None:
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None  # the run reports the missing file


def _record_from_json(doc: dict[str, Any]) -> RunRecord | None:
    """A kept record back as a ``RunRecord``; None when its fields do not fit (run again)."""
    try:
        fields = {**doc, "q_changes": [(int(step), int(q)) for step, q in doc["q_changes"]]}
        record = RunRecord(**fields)
    except (KeyError, TypeError, ValueError):
        return None
    return record if record.val_accuracy else None


def _validate(entries: Sequence[GridEntry], seeds: Sequence[int], setting: Setting) -> JobSpec:
    from pydantic import ValidationError

    from qsched.policies import PolicyError, validate_policy_config

    # With no configuration, the baseline's spec: the setting with the grid's defaults.
    probe = [GridEntry("baseline", PolicySpec(), "fp32")]
    try:
        specs = [setting.spec(e, s) for e in entries or probe for s in seeds]
        for e in entries:
            validate_policy_config(e.policy.name, e.policy.config)
    except (ValidationError, PolicyError) as exc:
        raise ExperimentError(f"invalid experiment: {exc}") from exc
    return specs[0]


def _setting_json(
    setting: Setting, base: JobSpec, seeds: Sequence[int], prepared: _Prepared | None
) -> dict[str, Any]:
    spec = base.model_dump(exclude={"name", "seed", "policy", "numerics", "accumulator"})
    out: dict[str, Any] = {
        "mode": "transfer" if prepared is not None else "scratch",
        "seeds": list(seeds),
        "spec": spec,
        "numerics_overrides": setting.numerics_overrides,
        "numerics_defaults": {
            token: {
                k: getattr(setting.spec(GridEntry("x", PolicySpec(), token), 0), k)
                for k in ("lr", "eps")
            }
            for token in NUMERICS
        },
    }
    if prepared is not None and setting.transfer is not None:
        out["transfer"] = {**asdict(setting.transfer), "pretrain": prepared.pretrain}
    return out


def _environment(workers: int, wall: float, boards: int) -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    trainer = (
        f"qsched.daemon.engine.run_job_inprocess ({boards} virtual boards)"
        if boards
        else "qsched.zo.trainer.train_zo (single-process, bit-identical to the in-process fleet)"
    )
    return {
        "workers": workers,
        "cpus": os.cpu_count(),
        "grid_wall_s": round(wall, 1),
        "load_average_at_end": [round(v, 2) for v in load],
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "trainer": trainer,
    }


# --------------------------------------------------------------------------- writing


def write_results(result: ExperimentResult, out: Path, plots: bool = True) -> list[Path]:
    """Write ``results.json``, ``results.csv``, ``results.md`` and the PNG plots.

    Args:
        result: what :func:`run_experiment` returned.
        out: the folder (created).
        plots: also draw the plots (of the ZO runs: none for a baseline alone).

    Returns:
        The files written.
    """
    out.mkdir(parents=True, exist_ok=True)
    doc = result.to_json()
    files = [out / "results.json", out / "results.csv", out / "results.md"]
    write_results_json(doc, files[0])
    _write_csv(doc, files[1])
    files[2].write_text(results_markdown(doc))
    if plots and doc["configs"]:  # a baseline alone has no curve of q or passes
        from qsched.lab.plots import plot_results

        files += plot_results(doc, out)
    return files


CSV_COLUMNS: Final = (
    "key",
    "label",
    "policy",
    "numerics",
    "accumulator",
    "steps",
    "seeds",
    "final_accuracy_mean",
    "final_accuracy_std",
    "best_accuracy_mean",
    "best_accuracy_std",
    "forward_passes_mean",
    "mean_q",
    "wall_s_mean",
)


def _write_csv(doc: dict[str, Any], path: Path) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_COLUMNS)
        for c in doc["configs"]:
            writer.writerow(
                [
                    c["key"],
                    c["label"],
                    c["policy"]["name"],
                    c["numerics"],
                    c["accumulator"],
                    c["steps"],
                    len(c["seeds"]),
                    f"{c['final_accuracy']['mean']:.6f}",
                    f"{c['final_accuracy']['std']:.6f}",
                    f"{c['best_accuracy']['mean']:.6f}",
                    f"{c['best_accuracy']['std']:.6f}",
                    f"{c['forward_passes']['mean']:.1f}",
                    f"{c['mean_q']:.4f}",
                    f"{c['wall_s']['mean']:.3f}",
                ]
            )


def _pct(stats: dict[str, Any]) -> str:
    return f"{100 * stats['mean']:.2f} ± {100 * stats['std']:.2f}"


def results_markdown(doc: dict[str, Any]) -> str:
    """The results as Markdown: one table like the paper's, the comparison, the baseline.

    Args:
        doc: the ``results.json`` document.

    Returns:
        Markdown text.
    """
    setting, spec = doc["setting"], doc["setting"]["spec"]
    backbone = spec.get("backbone")
    model, mode = (
        (Path(backbone).name, "pretrained backbone")
        if backbone
        else (spec["model"], setting["mode"])
    )
    lines = [
        f"# Experiment: {spec['dataset']} / {model} ({mode})",
        "",
        f"`{doc['command']}`",
        "",
        f"{spec['steps']} steps, batch {spec['batch_size']}, "
        f"validation every {spec['eval_every']} steps, "
        f"trainable `{spec['trainable']}`, seeds {setting['seeds']}. "
        "Accuracy in % (mean ± sample std over seeds).",
    ]
    if doc["configs"]:
        lines += [
            "",
            "| policy | numerics | final acc | best acc | forward passes | mean q "
            "| wall s (per run) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
    for c in doc["configs"]:
        lines.append(
            f"| {c['label']} | {c['numerics_token']} | "
            f"{_pct(c['final_accuracy'])} | {_pct(c['best_accuracy'])} | "
            f"{c['forward_passes']['mean']:,.0f} | {c['mean_q']:.2f} | {c['wall_s']['mean']:.1f} |"
        )
    if doc["comparisons"]:
        lines += [
            "",
            "## Against the best fixed q (equal steps)",
            "",
            f"Floor: within {doc['floors']['within_pp']} points with at most "
            f"{100 * doc['floors']['max_forward_pass_share']:.0f}% of its forward passes.",
            "",
            "| policy | best fixed | policy acc | fixed acc | difference (points) | paired std err "
            "| forward-pass share | floor |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for m in doc["comparisons"]:
            paired = m.get("paired_difference_pp")
            sem = f"{paired['standard_error']:.2f}" if paired else "-"
            lines.append(
                f"| {m['policy']} | {m['best_fixed']} | {100 * m['policy_final_accuracy']:.2f} | "
                f"{100 * m['best_fixed_final_accuracy']:.2f} | {m['difference_pp']:+.2f} | {sem} | "
                f"{100 * m['forward_pass_share']:.1f}% | {'met' if m['floor_met'] else 'NOT met'} |"
            )
    lines += _equal_budget_lines(doc["configs"])
    if doc.get("baseline"):
        b = doc["baseline"]
        lines += [
            "",
            f"First-order baseline (FP32 backprop, Adam lr {b['lr']}, {b['steps']} steps, "
            f"trainable `{b['trainable']}`): "
            f"final {_pct(b['final_accuracy'])}, best {_pct(b['best_accuracy'])}.",
        ]
    if setting.get("transfer"):
        p = setting["transfer"]["pretrain"]
        lines += [
            "",
            f"Backbone: {p['steps']} Adam steps on {p['source']} "
            f"(source validation accuracy {100 * p['source_val_accuracy']:.2f}%); "
            f"target {p['target']} "
            f"({p['target_train']} train / {p['target_val']} val).",
        ]
    lines += ["", *_environment_lines(doc["environment"], doc.get("baseline"), doc["configs"])]
    return "\n".join(lines) + "\n"


def accuracy_within_budget(config: dict[str, Any], budget: float) -> float | None:
    """Mean validation accuracy of a configuration at its last validation that used at
    most ``budget`` forward passes (mean over seeds); None if its first one used more."""
    curve = config["curve"]
    within = [
        acc
        for acc, passes in zip(
            curve["val_accuracy_mean"], curve["forward_passes_mean"], strict=True
        )
        if passes <= budget * (1 + 1e-9)
    ]
    return float(within[-1]) if within else None


def _equal_budget_lines(configs: list[dict[str, Any]]) -> list[str]:
    """Each adaptive policy's final accuracy against every fixed q stopped at the same
    number of forward passes (the policy's mean), per numerics."""
    fixed = [c for c in configs if c["policy"]["name"] == "fixed"]
    adaptive = [c for c in configs if c["policy"]["name"] != "fixed"]
    qs = sorted({int(c["policy"]["config"]["q"]) for c in fixed})
    if not fixed or not adaptive:
        return []
    lines = [
        "",
        "## At an equal budget of forward passes",
        "",
        "Each fixed q at its last validation within the policy's mean forward passes B "
        "(mean accuracy over seeds, %; - when its first validation already used more; "
        "* when its whole run used fewer than B, so the value is its final one).",
        "",
        "| policy | numerics | B | policy acc | " + " | ".join(f"q={q}" for q in qs) + " |",
        "| --- | --- | ---: | ---: |" + " ---: |" * len(qs),
    ]
    for c in adaptive:
        budget = float(c["forward_passes"]["mean"])
        same = {
            int(f["policy"]["config"]["q"]): f
            for f in fixed
            if f["numerics_token"] == c["numerics_token"]
        }
        cells = []
        for q in qs:
            acc = accuracy_within_budget(same[q], budget) if q in same else None
            short = q in same and same[q]["forward_passes"]["mean"] < budget
            cells.append("-" if acc is None else f"{100 * acc:.2f}" + ("*" if short else ""))
        lines.append(
            f"| {c['label']} | {c['numerics_token']} | {budget:,.0f} | "
            f"{100 * c['final_accuracy']['mean']:.2f} | " + " | ".join(cells) + " |"
        )
    return lines


def _environment_lines(
    env: dict[str, Any], baseline: dict[str, Any] | None, configs: list[dict[str, Any]]
) -> list[str]:
    merged = "merged_from" in env
    if not configs and baseline is not None and not merged:  # its own time is the news
        return [
            f"No ZO run; the baseline took {baseline['wall_s']['mean']:.0f} s a seed "
            f"on {env['cpus']} CPUs (load average at the end {env['load_average_at_end']})."
        ]
    if not merged:
        resumed = env.get("resumed_runs", 0)
        note = (
            f" It resumed an interrupted grid: {resumed} run(s) came from the earlier "
            "invocation, whose time the grid's wall time does not count."
            if resumed
            else ""
        )
        return [
            f"Grid wall time {env['grid_wall_s']} s with {env['workers']} worker(s) "
            f"on {env['cpus']} CPUs "
            f"(load average at the end {env['load_average_at_end']}).{note}"
        ]
    lines = [
        f"Merged from {len(env['merged_from'])} result folders "
        f"(grid wall time {env['grid_wall_s']} s in all):",
        "",
    ]
    lines += [f"- `{part['folder']}`: `{part['command']}`" for part in env["merged_from"]]
    if env["dropped_configs"]:
        left_out = ", ".join(env["dropped_configs"])
        lines += ["", f"Left out, not run on every seed set: {left_out}."]
    return lines


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qsched experiment",
        description="Compare q policies on a grid of "
        "policies x numerics x seeds and write results, tables and plots. Finished runs "
        "are kept in OUT/.runs until the results are written: after an interruption the "
        "same command resumes the grid.",
    )
    p.add_argument(
        "--grid",
        choices=GRIDS,
        default="paper",
        help="paper: fixed q 1..32 and QScheduler; "
        "all-policies: plus linear, power, variance; custom: only --policies; "
        "baseline: only the first-order baseline (and --policies, if any)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=[],
        metavar="P",
        help="extra policies: fixed:Q, a name, or name:{json config}",
    )
    p.add_argument("--numerics", nargs="+", default=["fp32", "int8"], choices=list(NUMERICS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, help="steps per run (default: the job spec's)")
    p.add_argument("--dataset", help="data set (default: the job spec's)")
    p.add_argument("--model", help="model zoo name (default: the job spec's)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="[NUMERICS:]KEY=VALUE",
        help="override a job spec field (JSON value), for all runs or one numerics token",
    )
    p.add_argument(
        "--transfer",
        metavar="SOURCE/TARGET",
        help="transfer setting: source and target classes, e.g. 0,1,2,3,4/5,6,7,8,9",
    )
    p.add_argument("--pretrain-steps", type=int, default=1500)
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument(
        "--baseline-lr", type=float, default=3e-3, help="Adam lr of the first-order baseline"
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the first-order baseline")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument(
        "--fleet",
        type=int,
        default=0,
        metavar="BOARDS",
        help="train on an in-process fleet of BOARDS virtual boards (same results, slower; "
        "default 0: the single-process trainer)",
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    common: dict[str, Any] = {}
    per: dict[str, dict[str, Any]] = {}
    for item in args.set:
        head, sep, value = item.partition("=")
        if not sep:
            raise ExperimentError(f"--set wants [NUMERICS:]KEY=VALUE, got {item!r}")
        token, colon, key = head.rpartition(":")
        if colon and token not in NUMERICS:
            raise ExperimentError(f"--set {item!r}: {token!r} is not one of {', '.join(NUMERICS)}")
        (per.setdefault(token, {}) if colon else common)[key] = parse_value(value)
    for name in ("steps", "dataset", "model"):
        if getattr(args, name) is not None:
            common[name] = getattr(args, name)
    return common, per


def _transfer(args: argparse.Namespace) -> TransferSetting | None:
    if args.transfer is None:
        return None
    source, slash, target = args.transfer.partition("/")
    try:
        src = tuple(int(c) for c in source.split(","))
        tgt = tuple(int(c) for c in target.split(","))
    except ValueError:
        src = tgt = ()
    if not slash or not src or not tgt:
        raise ExperimentError(
            f"--transfer wants SOURCE/TARGET class lists such as 0,1,2/3,4,5, got {args.transfer!r}"
        )
    return TransferSetting(src, tgt, args.pretrain_steps, args.pretrain_lr)


def main(argv: list[str], *, stream: Any = None) -> int:
    """``qsched experiment``: run a grid and write the results.

    Args:
        argv: the command line after ``experiment``.
        stream: where the progress bar and the summary go (default: stderr).

    Returns:
        0, 2 for an invalid grid or setting, or 130 when stopped by Ctrl-C or SIGTERM.
    """
    args = _parser().parse_args(argv)
    out = stream or sys.stderr
    store = RunStore(args.out / RUNS_FOLDER)
    try:
        common, per = _overrides(args)
        entries = build_grid(args.grid, args.policies, args.numerics)
        setting = Setting(common, per, _transfer(args), args.baseline_lr, max(0, args.fleet))
        with sigterm_as_interrupt():  # SIGTERM stops the worker pool, as Ctrl-C does
            result = run_experiment(
                entries,
                args.seeds,
                setting,
                workers=args.workers,
                baseline=not args.no_baseline,
                progress=not args.quiet,
                stream=out,
                command=_command(argv),
                store=store,
            )
    except (ExperimentError, OSError, ValueError) as exc:
        # ValueError: the zo errors (a model, data set or backbone that does not resolve).
        print(f"qsched experiment: {exc}", file=out)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; the workers are stopped by now
        print(f"\nqsched experiment: stopped; {_kept_note(store)}", file=out)
        return EXIT_INTERRUPTED
    files = write_results(result, args.out, plots=not args.no_plots)
    store.clear()  # results.json holds every run now
    print(results_markdown(result.to_json()), file=out)
    print("wrote " + ", ".join(str(f) for f in files), file=out)
    return 0


def _kept_note(store: RunStore) -> str:
    kept = store.count()
    if not kept:
        return "no run had finished"
    return f"{kept} finished run(s) kept in {store.folder}: the same command resumes the grid"


def _command(argv: Sequence[str]) -> str:
    return shlex.join(["qsched", "experiment", *argv])
