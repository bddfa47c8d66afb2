"""The fleet benchmark's yardstick (``qsched.lab.host_speed``): it times a board's and a
host's message handling of one step, through the codec they use."""

from __future__ import annotations

import math
from typing import Any

import pytest

from qsched.lab import host_speed
from qsched.protocol import codec
from qsched.protocol.messages import EvalSliceRequest, EvalSliceResult


def test_the_yardstick_times_a_request_in_and_a_result_out_per_cycle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each cycle decodes the request and the result it answers: two decodes, one encode."""
    decoded: list[type[Any]] = []
    encoded: list[type[Any]] = []

    def counting_decode(data: bytes) -> Any:
        msg = codec.decode(data)
        decoded.append(type(msg))
        return msg

    def counting_encode(msg: Any) -> bytes:
        encoded.append(type(msg))
        return codec.encode(msg)

    monkeypatch.setattr(host_speed, "decode", counting_decode)
    monkeypatch.setattr(host_speed, "encode", counting_encode)
    figure = host_speed.board_message_us(cycles=3)

    assert math.isfinite(figure) and figure > 0
    cycles = 3 * host_speed._REPEATS
    assert decoded == [EvalSliceRequest, EvalSliceResult] * cycles
    assert encoded == [EvalSliceResult] * cycles


def test_the_yardstick_answers_the_request_it_decodes() -> None:
    """The result built in a cycle is the one a board would send for that request."""
    answer = host_speed._cycle()
    request = codec.decode(host_speed._REQUEST)
    assert isinstance(request, EvalSliceRequest)
    assert (answer.job_id, answer.step, answer.ks) == (request.job_id, request.step, request.ks)
    assert (answer.slice_start, answer.slice_count) == (request.slice_start, request.slice_count)


def test_the_yardstick_refuses_no_cycles() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        host_speed.board_message_us(cycles=0)
