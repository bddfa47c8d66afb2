"""Fleet membership and board sessions, with a scripted board on an in-process link."""

from __future__ import annotations

import asyncio
import gc

import pytest

from qsched.daemon.fleet import BoardErrorReply, BoardFaultError, BoardSession, Fleet
from qsched.protocol.codec import decode, encode
from qsched.protocol.links.inproc import InProcLink, InProcTransport
from qsched.protocol.messages import Error, EvalRequest, EvalResult, Hello, Reset

HELLO = Hello(
    board_id="scripted", firmware_version="test-1", npu="virtual", ram_kib=1, max_batch=64
)
REQUEST = EvalRequest(job_id=7, step=3, batch_size=8, eps=1.0, estimator="two_sided", ks=(0, 1))


async def _session(fleet: Fleet) -> BoardSession:
    for _ in range(100):
        if fleet.sessions:
            return next(iter(fleet.sessions.values()))
        await fleet.wait_changed(0.05)
    raise AssertionError("no session appeared")


async def _next(board: InProcLink) -> object:
    return decode(await asyncio.wait_for(anext(board.incoming()), 5))


async def _asked(
    transport: InProcTransport, fleet: Fleet, timeout: float
) -> tuple[InProcLink, BoardSession, asyncio.Task[object]]:
    """A scripted board that said Hello, its session, and REQUEST pending on it."""
    board = transport.attach("scripted")
    await board.send(encode(HELLO))
    session = await _session(fleet)
    pending = asyncio.create_task(session.request(REQUEST, timeout=timeout))
    assert await _next(board) == REQUEST
    return board, session, pending


async def test_fleet_unsupported_version_is_refused() -> None:
    """A board speaking another protocol version gets a typed Error and is marked faulty."""
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        board = transport.attach("scripted")
        raw = bytearray(encode(HELLO))
        raw[2] = 9  # the header's version byte
        await board.send(bytes(raw))
        reply = await _next(board)
        session = await _session(fleet)
        assert isinstance(reply, Error) and reply.code == "unsupported_version"
        assert session.state == "faulty"


async def test_fleet_error_reply_and_result_resolve_requests() -> None:
    """A typed Error fails the request it refers to; the matching result resolves the next one."""
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        board, session, pending = await _asked(transport, fleet, timeout=5)
        await board.send(
            encode(Error(code="stale_step", ref_type=0x45, job_id=7, step=3, detail="board at 2"))
        )
        with pytest.raises(BoardErrorReply) as refused:
            await pending
        assert refused.value.reason == "stale_step"
        pending = asyncio.create_task(session.request(REQUEST, timeout=5))
        await _next(board)
        result = EvalResult(
            job_id=7,
            step=3,
            compute_us=1,
            estimator="two_sided",
            ks=(0, 1),
            loss_plus=(1.0, 2.0),
            loss_minus=(3.0, 4.0),
        )
        await board.send(encode(result.model_copy(update={"step": 4})))  # nobody waits for step 4
        await board.send(encode(result))
        assert await pending == result


async def test_fleet_request_timeout_and_lost_board() -> None:
    """No answer is a timeout; a board that goes away fails its waiters at once."""
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        board = transport.attach("scripted")
        await board.send(encode(HELLO))
        session = await _session(fleet)
        with pytest.raises(BoardFaultError) as late:
            await session.request(REQUEST, timeout=0.1)
        assert late.value.reason == "timeout"
        pending = asyncio.create_task(session.request(REQUEST, timeout=5))
        await asyncio.sleep(0.05)
        transport.detach("scripted", "unplugged")
        with pytest.raises(BoardFaultError):
            await pending
        await fleet.wait_changed(0.5)
        assert "scripted" not in fleet.sessions


async def test_fleet_void_requests_of_a_board_that_says_hello_again() -> None:
    """A board that says Hello again (rebooted, or reconnected to a restarted broker that
    lost messages) starts a fresh session: its pending requests fail at once, so their
    work is reassigned instead of waiting out the timeout."""
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        board, session, pending = await _asked(transport, fleet, timeout=30)
        epoch = session.epoch
        await board.send(encode(HELLO))
        with pytest.raises(BoardFaultError) as voided:
            await asyncio.wait_for(pending, 5)
        assert voided.value.reason == "gone" and "Hello again" in voided.value.detail
        assert session.epoch == epoch + 1 and session.state == "hello"


async def test_fleet_asks_a_silent_board_for_hello() -> None:
    """A board whose Hello was missed (daemon restart) is asked for one with a soft Reset."""
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        board = transport.attach("scripted")
        session = await _session(fleet)
        assert session.state == "unknown"
        message = await _next(board)
        assert isinstance(message, Reset) and message.scope == "soft"
        await board.send(encode(HELLO))
        await fleet.wait_changed(1)
        assert session.state == "hello" and session.board_id == "scripted"


async def test_fleet_takes_the_answer_to_its_reset_as_the_same_session() -> None:
    """A board that comes up after the daemon asked it for a Hello says its own Hello and
    then answers the soft Reset with a second one. That second Hello voids nothing: all
    the daemon sent since went out after the Reset. A Hello after it is a fresh session
    again (a reboot), and its pending request fails at once."""
    async with InProcTransport() as transport, Fleet(transport) as fleet:
        board = transport.attach("scripted")
        session = await _session(fleet)
        assert isinstance(await _next(board), Reset)  # asked before the board was up
        await board.send(encode(HELLO))  # the board's own Hello, crossing the Reset
        while session.state != "hello":
            await fleet.wait_changed(1)
        pending = asyncio.create_task(session.request(REQUEST, timeout=30))
        assert await _next(board) == REQUEST
        epoch = session.epoch
        await board.send(encode(HELLO))  # the Reset's answer
        await asyncio.sleep(0.2)
        assert not pending.done() and session.epoch == epoch
        await board.send(encode(HELLO))  # a reboot
        with pytest.raises(BoardFaultError, match="Hello again"):
            await asyncio.wait_for(pending, 5)
        assert session.epoch == epoch + 1


async def test_fleet_lost_board_unawaited_waiter_is_quiet() -> None:
    """A waiter nobody awaits any more fails silently when its board is given up
    (no 'never retrieved')."""
    reported: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        async with InProcTransport() as transport, Fleet(transport) as fleet:
            board = transport.attach("scripted")
            await board.send(encode(HELLO))
            session = await _session(fleet)
            future = session.expect(REQUEST)
            transport.detach("scripted", "unplugged")
            await fleet.wait_changed(0.5)
            assert future.done() and not future.cancelled()
            del future, session
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert not [c for c in reported if "never retrieved" in str(c.get("message", ""))]
