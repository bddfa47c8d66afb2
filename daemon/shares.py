"""An eval request shared among a host's member boards (``HostAggregator``).

The keys go to the members by their measured throughput (``qsched.daemon.planner``); in
INT8, an ``EvalRequest``'s batch is cut into slices (SPEC 6.10) when that is faster,
and an ``EvalSliceRequest`` is shared by keys. Each member's share is a request of its
own, encoded once (``encode_shared``: an in-process member finds it decoded).

Shares can be prepared a step ahead: ``PreparedShares`` keeps them with what they were
planned for, and ``fits`` says whether they are what planning the request that came
would send, bar the rates (a step older then). Which member computes a key changes no
bit, so a plan on older rates only costs time if the rates moved. So a plan also carries
over from one step to the next (``carried``) while the members' rates stay within
``RATE_NOISE`` of those it was made on, the tolerance within which the planner itself
prefers even shares: a host of 64 members then spends its time between steps on the
shares' step numbers, not on choosing the split again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qsched.daemon.planner import (
    RATE_NOISE,
    StepSplit,
    choose_split,
    plan_units,
    slice_counts,
)
from qsched.protocol.codec import encode_shared
from qsched.protocol.messages import DataMessage, EvalRequest, EvalSliceRequest

if TYPE_CHECKING:
    from qsched.daemon.aggregate import Member

__all__ = ["PreparedShares", "Share", "carried", "plan_shares", "planned"]

Request = EvalRequest | EvalSliceRequest


@dataclass(frozen=True)
class Share:
    """One member's share of an eval request, encoded, before it is sent."""

    member: Member
    request: Request
    data: bytes
    parts: int  # slices per key of the split it belongs to
    cost: float  # whole-batch keys


@dataclass(frozen=True)
class PreparedShares:
    """The shares of the eval request expected next, and what they were planned for."""

    request: Request
    members: tuple[Member, ...]
    int8: bool
    shares: tuple[Share, ...]
    rates: tuple[float, ...]  # the members' rates the plan was made on (``_rates``)

    def fits(self, msg: DataMessage, members: Sequence[Member], int8: bool) -> bool:
        """Whether these shares are what planning ``msg`` for ``members`` now would send
        (bar the rates)."""
        same_members = len(members) == len(self.members) and all(
            a is b for a, b in zip(members, self.members, strict=True)
        )
        return same_members and int8 == self.int8 and msg == self.request


def planned(msg: Request, members: Sequence[Member], int8: bool) -> PreparedShares:
    """``plan_shares`` of ``msg``, kept with what it was planned for."""
    rates = _rates(msg, members, int8)
    return PreparedShares(msg, tuple(members), int8, plan_shares(msg, members, int8), rates)


def carried(
    last: PreparedShares | None, msg: Request, members: Sequence[Member], int8: bool
) -> PreparedShares | None:
    """The shares of ``last`` for ``msg``, which must be ``last``'s request at another
    step, on the same members, each of whose rates is within ``RATE_NOISE`` of the one
    ``last`` was planned on; None where it must be planned again."""
    if last is None or not last.fits(_at_step(msg, last.request.step), members, int8):
        return None
    now = _rates(msg, members, int8)
    if any(abs(r - was) > RATE_NOISE * was for r, was in zip(now, last.rates, strict=True)):
        return None
    shares = []
    for share in last.shares:
        request = _at_step(share.request, msg.step)
        shares.append(Share(share.member, request, encode_shared(request), share.parts, share.cost))
    return PreparedShares(msg, last.members, int8, tuple(shares), last.rates)


def _at_step(request: Request, step: int) -> Request:
    return request if request.step == step else request.model_copy(update={"step": step})


def _rates(msg: Request, members: Sequence[Member], int8: bool) -> tuple[float, ...]:
    """Every rate a plan of ``msg`` consults (``_plan``): the members' whole-batch rates
    and, where the batch may be cut, their rates on each number of slices."""
    parts = [1]
    if isinstance(msg, EvalRequest) and int8:
        parts += slice_counts(msg.batch_size)
    return tuple(m.rate(p) for m in members for p in parts)


def plan_shares(msg: Request, members: Sequence[Member], int8: bool) -> tuple[Share, ...]:
    """The members' shares of ``msg`` on their rates now, encoded; ``int8``: the job's
    numerics allow batch slices."""
    split, plan = _plan(msg, members, int8)
    slices = _slice_requests(msg, split)
    shares = []
    for address, units in plan.items():
        request = _part_request(slices, split, units)
        member = members[int(address)]
        # An in-process member then takes the request without decoding it (a member's
        # decoding is a board's own work, done on its own CPU on a real fleet).
        data = encode_shared(request)
        shares.append(Share(member, request, data, split.parts, split.cost(units)))
    return tuple(shares)


def _plan(
    msg: Request, members: Sequence[Member], int8: bool
) -> tuple[StepSplit, dict[str, list[int]]]:
    """The split (whole keys, or, for an INT8 EvalRequest, slices when that is faster)
    and its units by member (addressed by their index in ``members``)."""

    def rates(parts: int) -> dict[str, float]:
        return {str(i): m.rate(parts) for i, m in enumerate(members)}

    if isinstance(msg, EvalRequest) and int8:
        return choose_split(len(msg.ks), msg.batch_size, rates)
    split = StepSplit(len(msg.ks), msg.batch_size)
    return split, plan_units(split, split.units, rates(1))


def _part_request(slices: list[Request], split: StepSplit, units: list[int]) -> Request:
    """A member's share: the keys of its units, on the request's batch or a slice
    (``slices``: the request on each slice of ``split``, from ``_slice_requests``). The
    keys are a sorted subset of a validated request's: no validation again."""
    ks = tuple(sorted(slices[0].ks[split.key(u)] for u in units))
    return slices[split.part(units[0])].model_copy(update={"ks": ks})


def _slice_requests(msg: Request, split: StepSplit) -> list[Request]:
    """``msg`` on each slice of ``split`` (itself when it is not split)."""
    if split.parts == 1 or isinstance(msg, EvalSliceRequest):
        return [msg]
    return [EvalSliceRequest.of(msg, start, count) for start, count in split.slices]
