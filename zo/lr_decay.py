"""The learning rate's decay over a job: a factor on ``lr`` set by the step alone.

ZO estimates are noisy, so a constant learning rate leaves the weights wandering around
the optimum at a distance the noise sets; a rate that falls toward the end lets them
settle. The factor depends on the step index and the spec only (never on the losses or
the policy's state), so a resumed job computes it again to the bit. It is linear rather
than a cosine: SPEC 4.1 pins every operation to IEEE binary64, which a libm ``cos``
would not be. A decay that starts late (``lr_decay_start``) leaves the job's first
part at the full rate, which a schedule that raises q late (QScheduler with
``lr_full_q``) needs: its steps below ``lr_full_q`` already run at a reduced rate.
"""

from __future__ import annotations

from qsched.protocol.jobspec import JobSpec

__all__ = ["lr_decay_factor"]


def lr_decay_factor(spec: JobSpec, step: int) -> float:
    """The factor on ``spec.lr`` at step ``step`` (0-based) of ``spec.steps``.

    ``lr_decay`` "none": 1.0. "linear", with ``p = step / steps`` and ``s =
    lr_decay_start``: 1.0 while ``p <= s``, then
    ``1.0 - (1.0 - lr_end) * ((p - s) / (1.0 - s))``, in binary64 in that order: 1.0
    until the decay starts, ``lr_end`` after the last step.
    """
    if spec.lr_decay == "none":
        return 1.0
    progress, start = step / spec.steps, spec.lr_decay_start
    if progress <= start:
        return 1.0
    return 1.0 - (1.0 - spec.lr_end) * ((progress - start) / (1.0 - start))
