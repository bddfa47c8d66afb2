"""A live progress line for long commands (``qsched demo``, ``qsched experiment``).

On a terminal the line is redrawn in place with a carriage return, at most every
``redraw_s``; on a pipe or a log file (CI, ``systemd``) it becomes one plain line every
``line_every_s`` instead, so logs stay readable and short. Plain text only, no escape
sequences beyond ``\\r``, so any terminal and any log viewer shows it.

    with ProgressLine(total=1000, label="demo") as bar:
        bar.update(10, q=2, loss=2.21, acc=0.31, boards="4/4")
        bar.note("board vb-02 left")         # printed above the line, the line redrawn
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Final, Self, TextIO

__all__ = ["ProgressLine", "format_duration", "format_fields", "render_bar"]

BAR_WIDTH: Final = 24
REDRAW_S: Final = 0.1  # terminal: redraw at most ten times a second
LINE_EVERY_S: Final = 10.0  # pipe or file: one line every ten seconds


def format_duration(seconds: float) -> str:
    """``73.2`` -> ``"1:13"``; ``4000`` -> ``"1:06:40"``; NaN or negative -> ``"?"``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _format_value(value: object) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def format_fields(fields: dict[str, object]) -> str:
    """``{"q": 4, "loss": 1.5}`` -> ``"q 4  loss 1.5000"`` (None values left out)."""
    return "  ".join(
        f"{key} {_format_value(value)}" for key, value in fields.items() if value is not None
    )


def render_bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """``[#########---------------]  120/1000`` for ``done`` of ``total``.

    Args:
        done: units finished (clipped to ``0..total``).
        total: all units (at least 1 is assumed).
        width: characters between the brackets.

    Returns:
        The bar and the count.
    """
    total = max(1, total)
    frac = min(1.0, max(0.0, done / total))
    filled = int(width * frac)
    digits = len(str(total))
    return f"[{'#' * filled}{'-' * (width - filled)}] {min(done, total):>{digits}}/{total}"


class ProgressLine:
    """One progress line on ``stream``: a bar, named fields, elapsed time and ETA.

    Args:
        total: units of work (steps, runs).
        label: a word in front of the bar.
        stream: where to write (standard error by default).
        live: redraw in place; default: whether ``stream`` is a terminal.
        redraw_s: the shortest time between two redraws in place.
        line_every_s: the shortest time between two printed lines when not live.
        clock: the time source (tests pass a fake).
    """

    def __init__(
        self,
        total: int,
        *,
        label: str = "",
        stream: TextIO | None = None,
        live: bool | None = None,
        redraw_s: float = REDRAW_S,
        line_every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(1, int(total))
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.live = _is_tty(self.stream) if live is None else live
        self.done = 0
        self.fields: dict[str, object] = {}
        self._redraw_s = redraw_s
        self._line_every_s = line_every_s
        self._clock = clock
        self._started = clock()
        self._last_draw = -math.inf
        self._width = 0  # characters of the line on screen, to blank a shorter one
        self._closed = False
        self._dirty = True  # something changed since the last draw

    @property
    def elapsed(self) -> float:
        """Seconds since the line was created."""
        return self._clock() - self._started

    def text(self) -> str:
        """The line as it would be drawn now."""
        elapsed = self.elapsed
        eta = elapsed * (self.total - self.done) / self.done if self.done else math.nan
        parts = [
            self.label,
            render_bar(self.done, self.total),
            format_fields(self.fields),
            f"{format_duration(elapsed)} eta {format_duration(eta)}",
        ]
        return "  ".join(part for part in parts if part)

    def update(self, done: int | None = None, **fields: object) -> None:
        """Record progress and redraw when it is time to.

        Args:
            done: units finished so far (unchanged when None).
            fields: values to show (``q=4``, ``acc=0.81``); a field set to None is hidden.
        """
        if done is not None:
            self.done = int(done)
        self.fields.update(fields)
        self._dirty = True
        now = self._clock()
        gap = self._redraw_s if self.live else self._line_every_s
        if now - self._last_draw >= gap or self.done >= self.total:
            self._draw(now)

    def note(self, message: str) -> None:
        """Print ``message`` on its own line; a live progress line is redrawn below it."""
        if self.live and self._width:
            self._write("\r" + " " * self._width + "\r")
            self._width = 0
        self._write(message + "\n")
        if self.live and not self._closed:
            self._draw(self._clock())

    def close(self) -> None:
        """Draw the final state and end the line (idempotent)."""
        if self._closed:
            return
        if self.live or self._dirty:
            self._draw(self._clock())
        self._closed = True
        if self.live:
            self._write("\n")

    def _draw(self, now: float) -> None:
        self._last_draw = now
        self._dirty = False
        line = self.text()
        if self.live:
            pad = max(0, self._width - len(line))
            self._write("\r" + line + " " * pad)
            self._width = len(line)
        else:
            self._write(line + "\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (OSError, ValueError):  # a closed or detached stream
        return False
