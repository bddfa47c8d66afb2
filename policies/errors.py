"""The one error type of the policies package."""

from __future__ import annotations

__all__ = ["PolicyError"]


class PolicyError(ValueError):
    """An unknown policy name, a bad policy configuration or an unusable saved state."""
