"""Config fields shared by the policies that climb a ladder of allowed q values."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from ._math import default_allowed, validate_allowed
from .base import MAX_Q, PolicyConfig

__all__ = ["LadderConfig"]


class LadderConfig(PolicyConfig):
    """q starts at q0 and only climbs the allowed values, never above qmax."""

    q0: int = Field(default=1, ge=1, le=MAX_Q, description="q of the first step")
    qmax: int = Field(default=32, ge=1, le=MAX_Q, description="q is never raised above this")
    allowed: tuple[int, ...] | None = Field(
        default=None,
        description="allowed q values, sorted and unique, containing q0, all <= qmax; "
        "default: q0, the powers of two above it, and qmax",
    )

    @field_validator("qmax")
    @classmethod
    def _check_qmax(cls, qmax: int, info: ValidationInfo) -> int:
        q0 = info.data.get("q0")
        if q0 is not None and qmax < q0:
            raise ValueError(f"qmax={qmax} is below q0={q0}")
        return qmax

    @field_validator("allowed")
    @classmethod
    def _check_allowed(
        cls, allowed: tuple[int, ...] | None, info: ValidationInfo
    ) -> tuple[int, ...] | None:
        q0, qmax = info.data.get("q0"), info.data.get("qmax")
        # A bad q0 or qmax is reported on its own; the ladder is checked against valid ones.
        if allowed is None or q0 is None or qmax is None:
            return allowed
        return validate_allowed(allowed, q0, qmax)

    def ladder(self) -> tuple[int, ...]:
        """The allowed values in force (the explicit list, or the default ladder)."""
        if self.allowed is None:
            return default_allowed(self.q0, self.qmax)
        return self.allowed
