"""Opt-in logging set-up for applications (the CLI and bench call it; the library never does).

The library only *emits* structlog events through ``structlog.get_logger("opd_stream")``:
stage milestones and failures, with shapes and counts, never payloads or secrets.
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ("configure_logging",)


def configure_logging(level: str = "warning", *, json: bool | None = None) -> None:
    """Configure structlog for a command-line program.

    Args:
        level: minimum level to print (``debug``, ``info``, ``warning``, ``error``).
        json: JSON lines when True; a console renderer when False; by default JSON unless
            stderr is a terminal.
    """
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
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
