"""One publish for the whole fleet: a step's update and the next step's shards.

Boards whose link offers a fleet channel (MQTT boards whose birth message says they
take ``StepOrder``s, bridged serial boards included) get ``ApplyUpdate(t)`` and their
``EvalRequest(t + 1)`` inside one ``StepOrder`` published once per channel, instead of
two messages each (SPEC 6.9); every other board gets its own messages as before. Each
board still answers with its own ``UpdateAck`` and ``EvalResult``, so every checksum is
still compared and every result still audited.

The caller registers each board's waiters, then calls ``start``: the publish is a task
created after the boards' tasks, so none of them can miss an early answer.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from qsched.daemon.engine.context import JobContext, log
from qsched.daemon.fleet import BoardLostError, BoardSession
from qsched.protocol.codec import encode
from qsched.protocol.errors import ProtocolError
from qsched.protocol.links.base import LinkError
from qsched.protocol.messages import ApplyUpdate, EvalRequest, EvalSliceRequest, Shard, StepOrder

# The next step's request of a board with work: whole batch or a batch slice.
NextRequest = EvalRequest | EvalSliceRequest

__all__ = ["Fleetcast", "fleet_channel", "wait_sent"]


def fleet_channel(session: BoardSession) -> Any | None:
    """The channel one publish reaches this board on, or None (it gets its own messages)."""
    return getattr(session.link, "fleet_channel", None)


class Fleetcast:
    """The StepOrders of one update: which boards they reach, and when they went out.

    Args:
        ctx: the job's shared context.
        update: ``ApplyUpdate(t)``, for every board in ``sessions``.
        requests: address -> ``EvalRequest(t + 1)`` (or ``EvalSliceRequest``) of the
            boards with work.
        sessions: the boards at step ``t``.
    """

    def __init__(
        self,
        ctx: JobContext,
        update: ApplyUpdate,
        requests: Mapping[str, NextRequest],
        sessions: Iterable[BoardSession],
    ) -> None:
        self._ctx = ctx
        self._orders: list[tuple[Any, bytes, asyncio.Future[None]]] = []
        self._sent: dict[str, asyncio.Future[None]] = {}
        groups: dict[int, tuple[Any, list[BoardSession]]] = {}
        for session in sessions:
            channel = fleet_channel(session)
            if channel is not None and session.alive:
                groups.setdefault(id(channel), (channel, []))[1].append(session)
        for channel, members in groups.values():
            payload = _order_bytes(ctx, update, requests, members)
            if payload is None:
                continue  # too many boards for one message: they get their own
            sent = asyncio.get_running_loop().create_future()
            self._orders.append((channel, payload, sent))
            for session in members:
                self._sent[session.address] = sent

    def sent(self, session: BoardSession) -> asyncio.Future[None] | None:
        """Done when the order naming this board went out; None: send it its own messages."""
        return self._sent.get(session.address)

    def start(self) -> None:
        """Publish every order (in the background; ``wait_sent`` reports a failure)."""
        for channel, payload, sent in self._orders:
            self._ctx.tasks.spawn(_publish(channel, payload, sent), "fleet.step_order")


async def wait_sent(session: BoardSession, sent: asyncio.Future[None]) -> None:
    """Wait for the order naming ``session`` to be out, as ``BoardSession.send`` would.

    Raises:
        BoardLostError: the publish failed (the broker stayed away).
    """
    try:
        await asyncio.shield(sent)
    except LinkError as exc:
        session.link_down = True
        raise BoardLostError(session.board_id, "link", str(exc)) from exc


def _order_bytes(
    ctx: JobContext,
    update: ApplyUpdate,
    requests: Mapping[str, NextRequest],
    members: list[BoardSession],
) -> bytes | None:
    spec = ctx.spec
    try:
        shards = [
            _shard(session.link.board_id, requests.get(session.address)) for session in members
        ]
        order = StepOrder(
            job_id=update.job_id,
            step=update.step,
            ks=update.ks,
            coefficients=update.coefficients,
            batch_size=spec.batch_size,
            eps=spec.eps,
            estimator=spec.estimator,
            shards=tuple(shards),
        )
        return encode(order)
    except (ProtocolError, ValueError) as exc:
        log.info("step order not used", step=update.step, boards=len(members), reason=str(exc))
        return None


def _shard(board_id: str, request: NextRequest | None) -> Shard:
    """A board's shard of the order: its request's keys (and slice), or none."""
    if request is None:
        return _shard_of(board_id, (), 0, 0)
    if isinstance(request, EvalSliceRequest):
        return _shard_of(board_id, request.ks, request.slice_start, request.slice_count)
    return _shard_of(board_id, request.ks, 0, 0)


@functools.lru_cache(maxsize=4096)
def _shard_of(board_id: str, ks: tuple[int, ...], slice_start: int, slice_count: int) -> Shard:
    """A shard, validated once while its board keeps its keys step after step (shards
    are immutable; building 128 of them took 0.6 ms of every step's order)."""
    return Shard(board_id=board_id, ks=ks, slice_start=slice_start, slice_count=slice_count)


async def _publish(channel: Any, payload: bytes, sent: asyncio.Future[None]) -> None:
    try:
        await channel.publish_fleet(payload)
    except LinkError as exc:
        if not sent.done():
            sent.set_exception(exc)
            sent.exception()  # retrieved here too: a board that left never awaits it
        return
    except BaseException:
        if not sent.done():
            sent.cancel()  # cancelled with the job: nobody waits any more
        raise
    if not sent.done():
        sent.set_result(None)
