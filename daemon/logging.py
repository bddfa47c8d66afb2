"""Logging set-up: structlog, JSON lines for journald and files, colours on a terminal.

Modules log with ``structlog.get_logger("qsched.<area>")`` and key-value fields; this
module decides how records look. Standard-library loggers (aiomqtt, paho) go to the
same stream.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

__all__ = ["LEVELS", "configure_logging", "debug_enabled"]

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


# The filtering logger class of each level ``configure_logging`` set (structlog makes one
# class per level), and whether it emits debug records.
_EMITS_DEBUG: dict[object, bool] = {}


def debug_enabled() -> bool:
    """Whether debug records are emitted under structlog's configuration now (an unknown
    one, such as structlog's default, may emit them). A path taken per board and per
    step asks first: a filtered-out call through a module's lazy structlog logger still
    binds a logger, about 5 us, which at 128 boards and a few state changes each is a
    millisecond of the daemon's step."""
    return _EMITS_DEBUG.get(structlog.get_config()["wrapper_class"], True)


class _Stderr:
    """Writes to whatever ``sys.stderr`` is at the time (tests and tools swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure_logging(
    level: str = "info", *, json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Configure structlog and the standard ``logging`` module.

    Args:
        level: ``debug``, ``info``, ``warning`` or ``error``.
        json: JSON lines when True, a console renderer when False; by default JSON
            unless ``stream`` is a terminal (journald and log files get JSON).
        stream: where records go (standard error by default, so stdout stays free
            for command output).
    """
    out: Any = stream if stream is not None else _Stderr()
    if json is None:
        json = not (hasattr(out, "isatty") and out.isatty())
    numeric = LEVELS.get(level.lower())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}; choose one of {', '.join(LEVELS)}")
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if json:
        processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=False)]
    wrapper = structlog.make_filtering_bound_logger(numeric)
    _EMITS_DEBUG[wrapper] = numeric <= logging.DEBUG
    structlog.configure(
        processors=processors,
        wrapper_class=wrapper,
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    # Libraries (asyncio, aiomqtt) log through the standard module: same stream, same
    # rendering, so journald never gets a plain-text line between JSON ones; one level quieter.
    handler = logging.StreamHandler(out)
    handler.setFormatter(_stdlib_formatter(json))
    logging.basicConfig(level=max(numeric, logging.INFO), handlers=[handler], force=True)


def _stdlib_formatter(json: bool) -> logging.Formatter:
    """A formatter that renders standard-library records as structlog renders its own."""
    pre_chain: list[Any] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    render: list[Any] = (
        [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
        if json
        else [structlog.dev.ConsoleRenderer(colors=False)]
    )
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
    )
