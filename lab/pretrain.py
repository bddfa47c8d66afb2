"""``qsched pretrain``: a zoo backbone trained with backprop, written as an int8 ``.tflite``.

The real-backbone experiments start from a pretrained model deployed on the board, as a
user's would be. This command makes one: it builds a zoo model, trains it in FP32 with
the first-order trainer (Adam, optional cosine decay and the square's symmetries as
augmentation) on a data set's source classes, quantises it after training from a
calibration subset, and writes the microcontroller file (qsched's own int8 form, which
``backbone=`` imports like any other file). Next to it goes ``<file>.json``: the command,
the source task's validation accuracy in FP32 and INT8, the wall time and the sha256,
so a committed backbone says how it was made.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qsched.lab.errors import ExperimentError

__all__ = ["main", "pretrain"]


def _int8_accuracy(qmodel: Any, x: Any, y: Any) -> float:
    from qsched.zo.engine import prepare_int8, run_int8
    from qsched.zo.quantize import quantize_input

    prepared = prepare_int8(qmodel)
    logits = run_int8(prepared, quantize_input(qmodel, x))
    return float((logits.argmax(axis=1) == y).mean())


def pretrain(args: argparse.Namespace) -> dict[str, Any]:
    """Train, quantise and write the backbone; returns the record written beside it."""
    from qsched.zo.backprop import evaluate, train_backprop
    from qsched.zo.datasets import load_dataset
    from qsched.zo.quantize import quantize_model
    from qsched.zo.tflite_io import write_tflite
    from qsched.zo.workload import calibration_indices
    from qsched.zo.zoo import build_model

    data = load_dataset(args.dataset)
    try:
        options = json.loads(args.model_options)
    except json.JSONDecodeError as exc:
        raise ExperimentError(f"--model-options is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ExperimentError(f"--model-options must be a JSON object, got {args.model_options}")
    model = build_model(args.model, data.input_shape, data.num_classes, args.seed, **options)
    started = time.perf_counter()
    trained, history = train_backprop(
        model,
        data,
        args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        weight_decay=args.weight_decay,
        schedule=args.schedule,
        augment=args.augment,
    )
    train_s = time.perf_counter() - started
    calibration = data.x_train[calibration_indices(args.seed, len(data.x_train))]
    qmodel = quantize_model(trained, calibration)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_tflite(args.out, qmodel)
    blob = args.out.read_bytes()
    record = {
        "command": args.command,
        "model": args.model,
        "model_options": options,
        "dataset": data.name,
        "classes": list(data.class_names),
        "train_samples": len(data.x_train),
        "val_samples": len(data.x_val),
        "steps": args.steps,
        "train_loss_last_100": float(np.mean(history.train_loss[-100:])),
        "val_accuracy_fp32": evaluate(trained, data.x_val, data.y_val)[1],
        "val_accuracy_int8": _int8_accuracy(qmodel, data.x_val, data.y_val),
        "train_wall_s": round(train_s, 1),
        "bytes": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    sidecar = args.out.with_name(args.out.name + ".json")
    sidecar.write_text(json.dumps(record, indent=2) + "\n")
    return record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qsched pretrain", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="zoo model (qsched zoo lists them)")
    p.add_argument("--model-options", default="{}", help='JSON object, e.g. {"width": 0.25}')
    p.add_argument(
        "--dataset", required=True, help="data set string, e.g. eurosat:size=32,classes=0-4"
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's (peak) learning rate")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--schedule", choices=("constant", "cosine"), default="cosine")
    p.add_argument("--augment", choices=("none", "dihedral"), default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="the .tflite to write")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``qsched pretrain``: prints the record; 2 for options or data that do not resolve."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.command = shlex.join(["qsched", "pretrain", *argv])
    try:
        record = pretrain(args)
    except (ExperimentError, OSError, ValueError) as exc:
        # ValueError: the zo errors (unknown model or option, a data set that does not load).
        print(f"qsched pretrain: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
