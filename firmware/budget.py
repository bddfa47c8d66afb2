"""Memory budget of the C board agent for a model: what ``firmware/README.md`` tabulates.

The agent splits one model region (``core/agent.h``) as blob | weights P | FP16 buffer
2P | perturbed copy P | activation arena | SetWeights staging 3P + C | per-channel
scale exponents, shifts, biases and scales 13C, where P is the length of the flat
trainable vector and C the trainable layers' output channels (scale recalibration,
SPEC "Scale recalibration"); the arena holds one sample's tensors, one 4-byte aligned
slot each (``core/model.c``). Everything else is static: ``AGENT_STATIC_BYTES``.

    python -m qsched.firmware.budget mlp:digits cnn:digits resnet8:eurosat
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from qsched.protocol.jobspec import JobSpec
from qsched.zo.blob import encode_blob
from qsched.zo.engine import infer_shapes
from qsched.zo.graph import QuantModel
from qsched.zo.workload import Workload

__all__ = ["AGENT_STATIC_BYTES", "MemoryBudget", "main", "memory_budget", "model_budget"]

# Every static object of the Cortex-M55 image but the model region, from its symbol
# table (arm-none-eabi-nm -S): sizeof(qs_agent) (frame buffers, the receive queue of
# 4 x MAX_PAYLOAD, decoded messages, the prepared model records) and the codec's and
# framing's buffers, batch indices.
AGENT_STATIC_BYTES: Final = 198_278
STACK_BYTES: Final = 32 * 1024


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes one model needs on a board (INT8 mode, FP16 accumulation buffer)."""

    blob: int  # the model blob as received: all int8 weights, int32 biases, requant params
    params: int  # P: trainable int8 weights
    weights: int  # the master copy of the trainable weights (P)
    buffer: int  # FP16 accumulation buffer (2P)
    perturbed: int  # the perturbed copy a forward pass reads (P)
    staging: int  # SetWeights reassembly (3P + C)
    arena: int  # activations of one sample
    channels: int  # C: output channels of the trainable layers

    @property
    def region(self) -> int:
        """The model region in use (16-byte aligned pieces, as the agent lays them out)."""
        parts = (self.blob, self.weights, self.buffer, self.perturbed, self.arena, self.staging)
        return sum(_align(p, 16) for p in parts) + _align(self.channels, 16) + 12 * self.channels

    @property
    def total(self) -> int:
        """Region + the agent's static data + stack."""
        return self.region + AGENT_STATIC_BYTES + STACK_BYTES


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def memory_budget(workload: Workload) -> MemoryBudget:
    """The budget of an INT8 workload.

    Args:
        workload: an INT8 job's workload.

    Returns:
        The byte counts.
    """
    if workload.qmodel is None:
        raise ValueError("the C board runs INT8 jobs only")
    return model_budget(workload.qmodel, workload.trainable_layers)


def model_budget(qmodel: QuantModel, trainable: Sequence[str]) -> MemoryBudget:
    """The budget of training ``trainable`` layers of an INT8 model on a board.

    Args:
        qmodel: the INT8 model.
        trainable: the layers whose weights train (the others stay as loaded).

    Returns:
        The byte counts.
    """
    shapes = infer_shapes(qmodel.model)
    arena = sum(_align(math.prod(shape), 4) for shape in shapes.values())
    p = sum(int(qmodel.layers[name].weight.size) for name in trainable)
    c = sum(len(qmodel.layers[name].weight_scales) for name in trainable)
    blob = len(encode_blob(qmodel, trainable=list(trainable)))
    return MemoryBudget(blob, p, p, 2 * p, p, 3 * p + c, arena, c)


def main(argv: list[str] | None = None) -> int:
    """Print the budget table for ``model:dataset`` pairs."""
    parser = argparse.ArgumentParser(prog="python -m qsched.firmware.budget")
    parser.add_argument("pairs", nargs="+", help="model:dataset, e.g. mlp:digits")
    args = parser.parse_args(argv)
    print(
        "| model | data set | blob | P | weights+buffer+copy+staging (7P) | C | channels (14C) "
        "| arena | region | with agent |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for pair in args.pairs:
        model, _, dataset = pair.partition(":")
        b = memory_budget(Workload.from_spec(JobSpec(model=model, dataset=dataset or "digits")))
        kib = lambda n: f"{n / 1024:.1f} KiB"  # noqa: E731
        print(
            f"| {model} | {dataset} | {kib(b.blob)} | {b.params} | {kib(7 * b.params)} "
            f"| {b.channels} | {14 * b.channels} B "
            f"| {kib(b.arena)} | {kib(b.region)} | {kib(b.total)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
