"""The STM32N6 latency model the virtual boards sleep by."""

import pytest

from qsched.firmware.virtual.latency import (
    MOBILENETV2_035_128_MACS,
    MOBILENETV2_035_128_SECONDS,
    NpuLatencyModel,
    serial_seconds,
)


def test_latency_reproduces_reference_measurement():
    """MobileNetV2-0.35 at 128x128 takes the measured 6.35 ms."""
    model = NpuLatencyModel()
    assert model.forward_seconds(MOBILENETV2_035_128_MACS) == pytest.approx(
        MOBILENETV2_035_128_SECONDS
    )


def test_latency_scales_with_macs_and_batch():
    """Time grows linearly with batch and with MACs, above a fixed overhead."""
    model = NpuLatencyModel()
    assert model.forward_seconds(1000, batch=8) == pytest.approx(8 * model.forward_seconds(1000))
    assert model.forward_seconds(0) == pytest.approx(model.overhead_seconds)
    assert model.forward_seconds(2_000_000) < model.forward_seconds(4_000_000)


def test_latency_utilisation_below_peak():
    """The measured anchor is far below the NPU's 600 GOPS peak, as on the board."""
    assert 0 < NpuLatencyModel().utilisation(MOBILENETV2_035_128_MACS) < 0.1


def test_serial_seconds_at_dk_baud():
    """92,160 bytes at 921600 baud 8N1 take one second."""
    assert serial_seconds(92_160) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        serial_seconds(1, baud=0)


def test_latency_anchor_matches_zoo_count():
    """The anchor's MAC count is what the zoo counts for MobileNetV2-0.35 at 128x128."""
    from qsched.zo.zoo import build_model, model_summary

    model = build_model("mobilenetv2", (128, 128, 3), 1000, 0, width=0.35)
    assert model_summary(model)[1] == MOBILENETV2_035_128_MACS


def test_board_processes_wait_to_the_microsecond():
    """Where the default loop waits in epoll or poll (whole milliseconds), processes
    hosting virtual boards wait in select instead, unless they hold too many descriptors
    for it; run_precise runs a coroutine to its value on that loop."""
    import asyncio
    import selectors

    from qsched.firmware.virtual.clock import (
        SELECT_DESCRIPTORS,
        precise_loop_factory,
        run_precise,
    )

    factory = precise_loop_factory(32)
    if selectors.DefaultSelector is getattr(selectors, "EpollSelector", None):
        assert factory is not None
        loop = factory()
        try:
            assert isinstance(loop._selector, selectors.SelectSelector)  # type: ignore[attr-defined]
        finally:
            loop.close()
    assert precise_loop_factory(SELECT_DESCRIPTORS + 1) is None

    async def sleep_and_say() -> tuple[str, str]:
        await asyncio.sleep(0.001)
        loop = asyncio.get_running_loop()
        return "done", type(getattr(loop, "_selector", None)).__name__

    said, selector = run_precise(sleep_and_say(), descriptors=4)
    assert said == "done"
    if factory is not None:
        assert selector == "_PunctualSelector"


def test_a_timed_wait_ends_at_its_timeout_or_when_a_descriptor_is_ready() -> None:
    """The board processes' selector never returns before a wait's timeout when nothing
    is ready (it polls through the last stretch instead of sleeping through it), and a
    descriptor that becomes ready ends the wait at once."""
    import selectors
    import socket
    import time

    from qsched.firmware.virtual.clock import PUNCTUAL_S, _PunctualSelector

    selector = _PunctualSelector()
    ours, theirs = socket.socketpair()
    try:
        selector.register(ours, selectors.EVENT_READ)
        for timeout in (PUNCTUAL_S / 2, 3 * PUNCTUAL_S, 0.02):
            start = time.monotonic()
            assert selector.select(timeout) == []
            assert time.monotonic() - start >= timeout
        theirs.send(b"x")
        start = time.monotonic()
        ready = selector.select(5.0)
        assert [key.fileobj for key, _ in ready] == [ours]
        assert time.monotonic() - start < 2.5
    finally:
        selector.close()
        ours.close()
        theirs.close()
