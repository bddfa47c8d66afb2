"""How fast this machine does a board's share of a step's messages: the fleet
benchmark's yardstick for comparing runs on different machines.

At 128 boards behind two hosts, what a step costs beyond the boards' modelled NPU time
is mostly Python handling each board's messages one after another on the host's cores:
a board decodes its request, builds and encodes its result, and the host decodes it.
How long that takes differs between machines, and on a shared virtual machine from one
hour to the next, by 1.5 times or more; the benchmark's efficiency at large fleets moves
with it. ``board_message_us`` times exactly that cycle, with the codec a board and a host
use, so that a figure measured on one machine can be read against one measured on
another: a run whose efficiency is lower because its machine is slower shows a larger
yardstick too.
"""

from __future__ import annotations

import statistics
import time
from typing import Final

from qsched.protocol.codec import decode, encode
from qsched.protocol.messages import EvalSliceRequest, EvalSliceResult, validated

__all__ = ["BOARD_MESSAGE_CYCLES", "board_message_us"]

# Cycles per timing and timings per figure: about 50 ms in all on the development
# machine, short enough to take before every configuration of the benchmark.
BOARD_MESSAGE_CYCLES: Final = 500
_REPEATS: Final = 5

# What a host of a 128-board fleet sends a board: one key on half of a 4-sample batch.
_REQUEST: Final = encode(
    EvalSliceRequest(
        job_id=7,
        step=7,
        batch_size=4,
        eps=0.01,
        estimator="two_sided",
        slice_start=2,
        slice_count=2,
        ks=(17,),
    )
)


def board_message_us(cycles: int = BOARD_MESSAGE_CYCLES) -> float:
    """Microseconds per board and step of message handling on this machine: the median
    over a few timings of ``cycles`` cycles, each decoding a request, building and
    encoding its result (through the same checks as a board), and decoding that.

    Raises:
        ValueError: ``cycles`` is below 1.
    """
    if cycles < 1:
        raise ValueError(f"cycles must be at least 1, got {cycles}")
    timings = []
    for _ in range(_REPEATS):
        start = time.perf_counter()
        for _ in range(cycles):
            _cycle()
        timings.append((time.perf_counter() - start) / cycles)
    return statistics.median(timings) * 1e6


def _cycle() -> EvalSliceResult:
    """One board's messages of one step, as bytes in and bytes out."""
    request = decode(_REQUEST)
    assert isinstance(request, EvalSliceRequest)
    result = validated(
        EvalSliceResult,
        {
            "job_id": request.job_id,
            "step": request.step,
            "compute_us": 25_400,
            "estimator": request.estimator,
            "slice_start": request.slice_start,
            "slice_count": request.slice_count,
            "ks": request.ks,
            "sum_plus": (1_234_567,),
            "sum_minus": (1_234_999,),
        },
    )
    answer = decode(encode(result))
    assert isinstance(answer, EvalSliceResult)
    return answer
