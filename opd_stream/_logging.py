"""Opt-in logging set-up for applications (the CLI and bench call it; the library never does).

The library only *emits* structlog events through ``structlog.get_logger("opd_stream")``:
stage milestones and failures, with shapes and counts, never payloads or secrets.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection, MutableMapping
from typing import Any

import structlog

__all__ = ("LOG_LEVELS", "configure_logging")

LOG_LEVELS = ("debug", "info", "warning", "error")
"""The levels :func:`configure_logging` (and the CLI's ``--log-level``) accept."""


def configure_logging(
    level: str = "warning", *, json: bool | None = None, drop_events: Collection[str] = ()
) -> None:
    """Configure structlog for a command-line program.

    Args:
        level: minimum level to print: one of :data:`LOG_LEVELS`.
        json: JSON lines when True; a console renderer when False; by default JSON unless
            stderr is a terminal.
        drop_events: event names never printed (a command that reports them its own way).

    Raises:
        ValueError: an unknown ``level``.
    """
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LOG_LEVELS)}")
    dropped = frozenset(drop_events)

    def drop(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
        if event.get("event") in dropped:
            raise structlog.DropEvent
        return event

    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            drop,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
