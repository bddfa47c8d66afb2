"""Pilot: ResNet-8's last residual block plus a fresh head in FP32, with the block's share
of every update scaled by FACTOR (what a per-layer learning rate would do), against the
head alone. qsched has no per-layer learning rate; this script scales the block's part of
each FP32 update in this process only (FACTOR 0 freezes the block, which is still
perturbed). Seed 0, fixed q, validation every 100 steps.

    python docs/results/resnet8-eurosat32-block-pilot/block_pilot.py STEPS TRAINABLE LR FACTOR Q
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from qsched.protocol.jobspec import JobSpec
from qsched.zo import update
from qsched.zo.errors import LossError
from qsched.zo.trainer import train_zo

HEAD_PARAMS = 650  # the fresh 10-class head on 64 features: weights, then biases, last


def spec_for(steps: int, trainable: str, lr: float, q: int) -> JobSpec:
    example = Path(__file__).parents[2] / "examples" / "resnet8-eurosat.json"
    fields = json.loads(example.read_text())
    fields.update(
        numerics="fp32",
        trainable=trainable,
        lr=lr,
        steps=steps,
        eval_every=100,
        seed=0,
        model_options={"head": "new"},
        policy={"name": "fixed", "config": {"q": q}},
    )
    return JobSpec.model_validate(fields)


def scale_block_updates(factor: float) -> None:
    plain = update.apply_fp32

    def scaled(params, seed, step, pairs):  # type: ignore[no-untyped-def]
        new = plain(params, seed, step, pairs)
        if params.size > HEAD_PARAMS:
            block = slice(0, params.size - HEAD_PARAMS)
            new = new.copy()
            new[block] = params[block] + np.float32(factor) * (new[block] - params[block])
        return new

    update.apply_fp32 = scaled


def main() -> None:
    steps, trainable, lr, factor, q = sys.argv[1:6]
    scale_block_updates(float(factor))
    seen: list[tuple[int, float, float | None]] = []
    started = time.time()
    label = f"{trainable} lr {lr} block factor {factor} q {q}:"
    try:
        train_zo(
            spec_for(int(steps), trainable, float(lr), int(q)),
            on_step=lambda r, e: seen.append((r.step, r.train_loss, e and e.val_accuracy)),
        )
    except LossError as exc:
        print(label, f"stopped at step {seen[-1][0] + 1 if seen else 0}: {exc}")
        return
    accuracies = [round(100 * a, 1) for _, _, a in seen if a is not None]
    loss = float(np.mean([loss for _, loss, _ in seen[-50:]]))
    took = time.time() - started
    print(label, f"validation {accuracies} %, training loss {loss:.3g}, {took:.0f} s")


if __name__ == "__main__":
    main()
