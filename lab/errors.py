"""The lab's errors: each ends its command with one line and exit status 2."""

from __future__ import annotations

__all__ = ["BrokerError", "DemoError", "ExperimentError", "ResultsError"]


class DemoError(RuntimeError):
    """The demo cannot run (boards did not start, broker unreachable, bad options)."""


class ExperimentError(ValueError):
    """A grid or setting that cannot be run (unknown policy, bad option)."""


class ResultsError(ValueError):
    """A ``results.json`` that cannot be read: missing, not JSON, or not of this schema."""


class BrokerError(RuntimeError):
    """The private broker could not be started (missing binary, port not accepting)."""
