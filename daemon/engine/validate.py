"""Validation: data-parallel slices on the boards (``ValidateRequest``), or the daemon.

Every ``eval_every`` steps the validation set is split across ready boards by
throughput; a slice whose board fails or is late is computed by the daemon, so a hung
board costs the step ``step_deadline_s``, not a reply timeout.
"""

from __future__ import annotations

import asyncio

from qsched.daemon.engine.context import JobContext, planning_rates
from qsched.daemon.fleet import BoardFaultError, BoardSession
from qsched.daemon.planner import split_proportional
from qsched.protocol.messages import ValidateRequest, ValidateResult
from qsched.zo.step import EvalRecord, eval_record

__all__ = ["Validator"]

Slice = tuple[BoardSession | None, int, int]  # (board or the daemon, start, count)


class Validator:
    """Validates the daemon's weights after a step.

    Args:
        ctx: the job's shared context.
    """

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx

    async def validate(self, t: int) -> EvalRecord:
        """The validation after step ``t`` (of the weights at step ``t + 1``)."""
        ctx = self.ctx
        n_val = len(ctx.workload.dataset.x_val)
        workers = ctx.workers() if ctx.config.validate_on == "boards" else []
        slices = _slices(n_val, workers)
        results = await asyncio.gather(
            *(self._slice(t, s, start, count) for s, start, count in slices)
        )
        loss_sum = sum(r[0] for r in results)
        correct = sum(r[1] for r in results)
        return eval_record(t, loss_sum, correct, n_val, ctx.result.forward_passes)

    def _timeout(self, session: BoardSession, count: int) -> float:
        """A validation slice's deadline, as a shard's: a hung board costs the step
        ``step_deadline_s`` (then the daemon computes its slice), not a reply timeout."""
        spec, config = self.ctx.spec, self.ctx.config
        passes_per_key = 2 if spec.estimator == "two_sided" else 1
        keys = count / max(spec.batch_size * passes_per_key, 1)
        expected = keys / max(session.throughput.rate, 1e-6)
        return max(config.step_deadline_s, config.deadline_factor * expected)

    async def _slice(
        self, t: int, session: BoardSession | None, start: int, count: int
    ) -> tuple[float, int]:
        ctx = self.ctx
        if session is not None:
            request = ValidateRequest(job_id=ctx.job_id, step=t + 1, start=start, count=count)
            try:
                answer = await session.request(request, self._timeout(session, count))
                if isinstance(answer, ValidateResult) and answer.count == count:
                    return answer.loss_sum, answer.correct
                raise BoardFaultError(session.board_id, "wrong_answer", "validation slice mismatch")
            except BoardFaultError as exc:
                ctx.fault(session, f"validation: {exc.reason} {exc.detail}".strip())
        loss_sum, correct, _ = await asyncio.to_thread(
            ctx.workload.validate, ctx.state, start, count
        )
        return loss_sum, correct


def _slices(n_val: int, workers: list[BoardSession]) -> list[Slice]:
    if not workers:
        return [(None, 0, n_val)]
    rates = planning_rates(workers)
    shares = split_proportional(n_val, [rates[w.address] for w in workers])
    out: list[Slice] = []
    start = 0
    for worker, share in zip(workers, shares, strict=True):
        if share:
            out.append((worker, start, share))
        start += share
    return out
