"""SPSA: from perturbed losses to one update coefficient per perturbation.

Two-sided (2q forward passes) and one-sided (q + 1) estimators:

    two-sided:  g_k = (L+_k - L-_k) / (2 eps)      c_k = -lr * g_k / q
    one-sided:  g_k = (L+_k - L0)   / eps          c_k = -lr * g_k / q

``g_k`` is the projected gradient along ``z_k``. Both are computed in float64 and each
``c_k`` is rounded once to float32: the daemon is the only party that computes them, the
boards only apply the float32 values (``update.py``), so the float64 step needs no
cross-platform care. In INT8 mode eps is in int8 steps and lr in int8 steps per unit
gradient, so the same formulas hold in weight-step units.
"""

from __future__ import annotations

import array
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

from qsched.zo.errors import LossError

__all__ = [
    "Estimator",
    "LossError",
    "LossPairs",
    "LossSums",
    "coefficients",
    "forward_passes",
    "projected_gradients",
]

Estimator: TypeAlias = Literal["two_sided", "one_sided"]


@dataclass(frozen=True)
class LossSums:
    """INT8 loss sums of one batch slice for some perturbation indices (SPEC 6.10).

    Like ``LossPairs`` with the Q16 sums over the slice's samples in place of means:
    ``plus[k]``, two-sided ``minus[k]``, one-sided ``base``.
    """

    plus: Mapping[int, int]
    minus: Mapping[int, int]
    base: int | None = None


@dataclass(frozen=True)
class LossPairs:
    """The losses of one step for some perturbation indices.

    ``plus[k]`` is L(theta + eps z_k); ``minus[k]`` is L(theta - eps z_k) for the
    two-sided estimator (empty for one-sided); ``base`` is L(theta) (one-sided only).
    """

    plus: Mapping[int, float]
    minus: Mapping[int, float]
    base: float | None = None

    @property
    def ks(self) -> list[int]:
        """The perturbation indices, ascending."""
        return sorted(self.plus)

    def merged(self, other: LossPairs) -> LossPairs:
        """Union of two shards' losses (a repeated k must carry the same values)."""
        plus = dict(self.plus)
        minus = dict(self.minus)
        for k, value in other.plus.items():
            if k in plus and plus[k] != value:
                raise LossError(f"perturbation {k} reported two different losses", k)
            plus[k] = value
        for k, value in other.minus.items():
            if k in minus and minus[k] != value:
                raise LossError(f"perturbation {k} reported two different losses", k)
            minus[k] = value
        base = self.base if self.base is not None else other.base
        return LossPairs(plus=plus, minus=minus, base=base)


def _finite(value: float, what: str, k: int | None) -> float:
    result = float(value)
    if not math.isfinite(result):
        raise LossError(f"{what} is not finite ({result})", k)
    return result


def _differences(
    losses: LossPairs, eps: float, estimator: Estimator
) -> tuple[dict[int, float], float]:
    """Loss differences per k and the eps factor they are divided by (2 eps or eps)."""
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    diffs: dict[int, float] = {}
    if estimator == "two_sided":
        ks = losses.ks
        if len(losses.minus) == len(ks) and all(k in losses.minus for k in ks):
            pluses = [float(losses.plus[k]) for k in ks]
            minuses = [float(losses.minus[k]) for k in ks]
            if all(map(math.isfinite, pluses)) and all(map(math.isfinite, minuses)):
                # The common case in one pass; anything wrong is found by the loop below,
                # which names the first fault in key order.
                pairs = zip(ks, pluses, minuses, strict=True)
                return {k: p - m for k, p, m in pairs}, 2.0 * float(eps)
        for k in ks:
            if k not in losses.minus:
                raise LossError(f"perturbation {k} has no minus loss", k)
            plus = _finite(losses.plus[k], f"L+ of perturbation {k}", k)
            diffs[k] = plus - _finite(losses.minus[k], f"L- of perturbation {k}", k)
        return diffs, 2.0 * float(eps)
    if estimator == "one_sided":
        if losses.base is None:
            raise LossError("one-sided estimator needs the unperturbed loss L0")
        base = _finite(losses.base, "L0", None)
        for k in losses.ks:
            diffs[k] = _finite(losses.plus[k], f"L+ of perturbation {k}", k) - base
        return diffs, float(eps)
    raise ValueError(f"unknown estimator {estimator!r}")


def projected_gradients(
    losses: LossPairs, eps: float, estimator: Estimator = "two_sided"
) -> dict[int, float]:
    """g_k = (L+ - L-) / (2 eps), or (L+ - L0) / eps, for every k, in float64.

    Args:
        losses: the step's losses.
        eps: the perturbation size (int8 steps in INT8 mode).
        estimator: "two_sided" or "one_sided".

    Returns:
        {k: g_k}.

    Raises:
        LossError: a loss is NaN/inf or a needed loss is missing.
    """
    diffs, denominator = _differences(losses, eps, estimator)
    return {k: d / denominator for k, d in diffs.items()}


def coefficients(
    losses: LossPairs, lr: float, eps: float, q: int, estimator: Estimator = "two_sided"
) -> list[tuple[int, float]]:
    """The update pairs (k, c_k), ascending k, c_k rounded once to float32.

    c_k = (-lr * (L+ - L-)) / (2 eps q) two-sided, (-lr * (L+ - L0)) / (eps q) one-sided,
    evaluated in float64 in that order.

    Args:
        losses: the step's losses, for all q perturbations.
        lr: learning rate.
        eps: perturbation size.
        q: the number of perturbations the estimate averages over.
        estimator: "two_sided" or "one_sided".

    Returns:
        [(k, c_k)] with c_k a Python float holding a float32 value.

    Raises:
        LossError: a loss is NaN/inf, missing, or the ks do not number q.
    """
    if q <= 0:
        raise ValueError(f"q must be positive, got {q}")
    diffs, denominator = _differences(losses, eps, estimator)
    if len(diffs) != q:
        raise LossError(f"expected losses for {q} perturbations, got {len(diffs)}")
    scale = denominator * q
    ks = sorted(diffs)
    # array("f") rounds each float64 to float32 as np.float32 does (to nearest even); an
    # overflow becomes inf there too.
    rounded = array.array("f", [(-float(lr) * diffs[k]) / scale for k in ks])
    return list(zip(ks, rounded, strict=True))


def forward_passes(q: int, estimator: Estimator = "two_sided") -> int:
    """Forward passes one step costs: 2q two-sided, q + 1 one-sided."""
    return 2 * q if estimator == "two_sided" else q + 1
