"""When a host's aggregator passed the points of each step: the host side of the fleet
benchmark's step timeline.

The daemon's side (``qsched bench fleet``'s ``StepTimeline``) sees when a step's update
went out and when the hosts' acks and results came back. What a host did in between,
and so where a slow step's time went, is only seen on the host: when the step's eval
request reached its aggregator, when the last member's share was posted, when the last
member's answer came and when the folded result went up. ``HostTimeline`` notes those
moments on ``time.perf_counter``, the monotonic clock the daemon's side uses too (one
clock for every process of a machine on Linux), and writes them to a file for the
benchmark to align with the daemon's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Final

__all__ = ["MARKS", "HostTimeline", "read_marks"]

# The points of a step, in the order a step passes them.
MARKS: Final = ("order in", "shares out", "answers in", "result out")


class HostTimeline:
    """The moments each eval request's step passed each mark (the first time only: a
    request sent again does not move them)."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}

    def mark(self, step: int, name: str) -> None:
        """Note that ``step`` passed mark ``name`` (one of ``MARKS``) now."""
        self.steps.setdefault(step, {}).setdefault(name, time.perf_counter())

    def write(self, path: Path) -> None:
        """Write the marks as JSON (step -> mark -> seconds)."""
        path.write_text(json.dumps({str(step): marks for step, marks in self.steps.items()}))


def read_marks(path: Path) -> dict[int, dict[str, float]]:
    """The marks ``HostTimeline.write`` wrote (empty if the file is missing or cut
    short: the host did not get to write it, or was killed while it did)."""
    try:
        raw = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {int(step): {str(k): float(v) for k, v in marks.items()} for step, marks in raw.items()}
