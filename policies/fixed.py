"""``fixed``: the same q for every step (the baseline every schedule is compared with)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from .base import MAX_Q, PolicyConfig, QPolicy

__all__ = ["FixedConfig", "FixedPolicy"]


class FixedConfig(PolicyConfig):
    """Config of ``fixed``."""

    q: int = Field(default=8, ge=1, le=MAX_Q, description="q of every step")


class FixedPolicy(QPolicy):
    """Constant q."""

    name: ClassVar[str] = "fixed"
    Config: ClassVar[type[PolicyConfig]] = FixedConfig
    config: FixedConfig

    def initial_q(self) -> int:
        """Return the configured q."""
        return self.config.q
