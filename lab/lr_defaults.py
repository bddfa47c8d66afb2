"""``qsched lr-defaults``: one INT8 learning rate across weight scales, measured.

An INT8 job's learning rate was once in int8 steps per unit gradient: the step a weight
takes in real units then grows with its scale squared, so no one value suits a file's
head (scales ~1e-2) and a fresh head (~1e-3) alike. In weight units (``lr_unit:
weight``, SPEC 4.2) each channel's step is converted with its own scale. This command
trains a few settings with each unit's default and the rate that once had to be tuned
by hand, and FP32 with its default for comparison, and prints the final validation
accuracies (mean over seeds) with the median channel gain ``1 / s^2`` of the trained
layers, so the spread of scales is visible.

Each run is ``train_zo`` in this process (the fleet gives the same bits).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qsched.protocol.jobspec import JobSpec
from qsched.zo.data import RESNET8_CIFAR10
from qsched.zo.trainer import train_zo
from qsched.zo.workload import Workload

__all__ = ["SETTINGS", "UNITS", "main"]

_SCHEDULER = {"name": "qscheduler", "config": {"q0": 1, "qmax": 32}}
_EUROSAT = "eurosat:size=32,scale=255"


@dataclass(frozen=True)
class Setting:
    """A job to train with each unit's learning rate."""

    name: str
    spec: dict[str, Any]


SETTINGS: tuple[Setting, ...] = (
    Setting("zoo mlp on digits (the demo's job)", {}),
    Setting("zoo cnn on digits, every layer", {"model": "cnn"}),
    Setting(
        "ResNet-8 file, its own head, EuroSAT 32x32",
        {"backbone": str(RESNET8_CIFAR10), "dataset": _EUROSAT, "trainable": "last:1",
         "steps": 600, "policy": _SCHEDULER},
    ),
    Setting(
        "ResNet-8 file, a fresh 10-class head",
        {"backbone": str(RESNET8_CIFAR10), "dataset": _EUROSAT, "trainable": "last:1",
         "model_options": {"head": "new"}, "steps": 600, "policy": _SCHEDULER},
    ),
)  # fmt: skip
# Column label -> the spec fields it sets (no lr: the unit's default).
UNITS: dict[str, dict[str, Any]] = {
    "int8 steps, default 3000": {"lr_unit": "int8_step"},
    "int8 steps, lr 100": {"lr_unit": "int8_step", "lr": 100.0},
    "weight units, default 0.05": {},
    "FP32, default 0.02": {"numerics": "fp32"},
}


def _median_gain(setting: Setting) -> float:
    spec = JobSpec.model_validate({"numerics": "int8", **setting.spec})
    gain = Workload.from_spec(spec).update_gain
    return float(np.median(gain)) if gain is not None else float("nan")


def run(seeds: Sequence[int], steps: int | None) -> list[dict[str, Any]]:
    """Final validation accuracy of every setting and unit, mean over ``seeds``."""
    rows = []
    for setting in SETTINGS:
        row: dict[str, Any] = {"setting": setting.name}
        for label, fields in UNITS.items():
            accuracies = []
            for seed in seeds:
                data = {"name": "lr", "numerics": "int8", "eval_every": 50, **setting.spec}
                data.update(fields, seed=seed, **({"steps": steps} if steps else {}))
                spec = JobSpec.model_validate(data)
                accuracies.append(train_zo(spec).final_accuracy)
            row[label] = float(np.mean(accuracies))
        row["median 1/s^2"] = _median_gain(setting)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    columns = ["setting", "median 1/s^2", *UNITS]
    lines = ["| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]
    for row in rows:
        cells = [row["setting"], f"{row['median 1/s^2']:.0f}"]
        cells += [f"{row[label]:.3f}" for label in UNITS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``qsched lr-defaults [--seeds 0 1 2] [--steps N]``."""
    p = argparse.ArgumentParser(prog="qsched lr-defaults", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="override every setting's steps")
    args = p.parse_args(argv)
    start = time.monotonic()
    rows = run(args.seeds, args.steps)
    print(table(rows))
    print(f"\n{len(args.seeds)} seeds, {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
