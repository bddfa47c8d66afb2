"""Pilot: ResNet-8's last residual block plus a fresh head in FP32, with the block's share
of every update scaled by FACTOR (what a per-layer learning rate would do), against the
head alone. qsched has no per-layer learning rate; this script scales the block's part of
each FP32 update in this process only (FACTOR 0 freezes the block, which is still
perturbed). Seed 0, fixed q, validation every 100 steps.

    python block_pilot.py STEPS TRAINABLE LR FACTOR Q [KEYS [NUMERICS]]   (from this folder)

KEYS ``joint`` (the default, what qsched does): every key perturbs block and head
together. ``grouped``: key k of step t perturbs only the block when k + t is even and
only the head when it is odd, and each group's update is the mean over its own keys
(qsched's keys always perturb every trainable element; this script masks the
perturbations and splits the update in this process only). NUMERICS ``fp32`` (the
default) or ``int8`` (grouped keys only; LR in weight units).
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
from qsched.zo.workload import Workload

# The fresh 10-class head on 64 features, last in the flat vector: weights then biases
# (FP32), int8 weights only (INT8).
HEAD_PARAMS = {"fp32": 650, "int8": 640}


def spec_for(steps: int, trainable: str, lr: float, q: int, numerics: str) -> JobSpec:
    example = Path(__file__).parents[2] / "examples" / "resnet8-eurosat.json"
    fields = json.loads(example.read_text())
    fields.update(
        numerics=numerics,
        trainable=trainable,
        lr=lr,
        steps=steps,
        eval_every=100,
        seed=0,
        model_options={"head": "new"},
        policy={"name": "fixed", "config": {"q": q}},
    )
    return JobSpec.model_validate(fields)


def scale_block_updates(factor: float, head_params: int) -> None:
    plain = update.apply_fp32

    def scaled(params, seed, step, pairs):  # type: ignore[no-untyped-def]
        new = plain(params, seed, step, pairs)
        if params.size > head_params:
            block = slice(0, params.size - head_params)
            new = new.copy()
            new[block] = params[block] + np.float32(factor) * (new[block] - params[block])
        return new

    update.apply_fp32 = scaled


def _in_block(size: int, head_params: int) -> np.ndarray:
    block = np.zeros(size, dtype=bool)
    block[: size - head_params] = True
    return block


def _block_keys(step: int, ks: list[int]) -> set[int]:
    return {k for k in ks if (k + step) % 2 == 0}


def group_keys(factor: float, head_params: int) -> None:
    """Each key perturbs one group; each group's update is its own keys' mean."""
    plain_sets = Workload._perturbed_sets

    def masked_sets(self, state, step, ks):  # type: ignore[no-untyped-def]
        keys, sets = plain_sets(self, state, step, ks)
        block = _in_block(state.params.size, head_params)
        per_key = len(sets) // len(keys)
        on_block = _block_keys(step, keys)
        for i, k in enumerate(keys):
            frozen = ~block if k in on_block else block
            for j in range(i * per_key, (i + 1) * per_key):
                sets[j] = sets[j].copy()
                sets[j][frozen] = state.params[frozen]
        return keys, sets

    plain_delta = update.accumulate_delta

    def grouped_delta(seed, step, pairs, size, gain=None):  # type: ignore[no-untyped-def]
        block = _in_block(size, head_params)
        on_block = _block_keys(step, [k for k, _ in pairs])
        delta = np.zeros(size, dtype=np.float32)
        for in_group, mask, share in ((True, block, factor), (False, ~block, 1.0)):
            mine = [(k, c) for k, c in pairs if (k in on_block) == in_group]
            if mine:  # the coefficients divide by q; a group's mean divides by its own keys
                part = plain_delta(seed, step, mine, size, gain)
                delta[mask] = np.float32(share * len(pairs) / len(mine)) * part[mask]
        return delta

    Workload._perturbed_sets = masked_sets
    update.accumulate_delta = grouped_delta


def main() -> None:
    steps, trainable, lr, factor, q = sys.argv[1:6]
    keys = sys.argv[6] if len(sys.argv) > 6 else "joint"
    numerics = sys.argv[7] if len(sys.argv) > 7 else "fp32"
    if keys == "grouped":
        group_keys(float(factor), HEAD_PARAMS[numerics])
    else:
        scale_block_updates(float(factor), HEAD_PARAMS[numerics])
    seen: list[tuple[int, float, float | None]] = []
    started = time.time()
    label = (
        f"{trainable} lr {lr} block factor {factor} q {q}"
        + (" grouped keys" if keys == "grouped" else "")
        + (f" {numerics}:" if numerics != "fp32" else ":")
    )
    try:
        train_zo(
            spec_for(int(steps), trainable, float(lr), int(q), numerics),
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
