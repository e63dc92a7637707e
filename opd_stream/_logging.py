"""Logging: a library's manners, and an opt-in set-up for applications.

The library emits structured events (``stream_started``, ``sample_failed``, ...: shapes,
counts and reasons, never token ids, logprobs or keys) through **stdlib logging**, on the
logger named ``"opd_stream"``, which carries only a :class:`logging.NullHandler`: a host that
configured nothing sees nothing, a host that configured logging sees the events in its own
handlers and levels, and structlog's global configuration never matters (structlog only
builds the event dict on the stdlib logger). :func:`configure_logging` is the opt-in for
applications (the CLI and bench call it; the library never does): one stderr handler on the
``"opd_stream"`` logger. In full: ``docs/design-notes.md``, "opd_stream/_logging.py".
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, TextIO

import structlog

__all__ = ("LOGGER_NAME", "LOG_LEVELS", "capture_events", "configure_logging", "get_logger")

LOG_LEVELS = ("debug", "info", "warning", "error")
"""The levels :func:`configure_logging` (and the CLI's ``--log-level``) accept."""

LOGGER_NAME = "opd_stream"
"""The stdlib logger every event goes to."""

_STDLIB = logging.getLogger(LOGGER_NAME)
if not any(isinstance(h, logging.NullHandler) for h in _STDLIB.handlers):
    _STDLIB.addHandler(logging.NullHandler())


class _Event(dict[str, Any]):
    """An event dict as a log record's ``msg``: ``str()`` gives ``event key=value ...`` for
    plain formatters; :class:`structlog.stdlib.ProcessorFormatter` reads the fields."""

    def __str__(self) -> str:
        parts = [str(self.get("event", ""))]
        parts.extend(f"{k}={v!r}" for k, v in self.items() if k != "event")
        return " ".join(parts)


def _to_record(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The last processor: the stdlib call's ``(args, kwargs)``."""
    exc_info = event_dict.pop("exc_info", None)
    kwargs: dict[str, Any] = {"extra": {"_logger": logger, "_name": method_name}}
    if exc_info is not None:
        kwargs["exc_info"] = exc_info
    return (_Event(event_dict),), kwargs


def get_logger() -> structlog.stdlib.BoundLogger:
    """The library's logger: structlog's bound-logger API over the ``"opd_stream"`` stdlib
    logger, independent of structlog's global configuration. A disabled level costs one
    ``isEnabledFor`` check."""
    return structlog.stdlib.BoundLogger(
        _STDLIB,
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            _to_record,
        ],
        context={},
    )


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time (as :data:`logging.lastResort`)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream: TextIO = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


class _DropEvents(logging.Filter):
    def __init__(self, dropped: frozenset[str]) -> None:
        super().__init__()
        self._dropped = dropped

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        return not (isinstance(msg, dict) and msg.get("event") in self._dropped)


def configure_logging(
    level: str = "warning", *, json: bool | None = None, drop_events: Collection[str] = ()
) -> None:
    """Print the library's events on stderr (for a command-line program).

    Sets the ``"opd_stream"`` logger's level, gives it one stderr handler (replacing the
    one an earlier call installed) and stops propagation to the root logger, so that events
    are not printed twice. Nothing else (no other logger, no structlog configuration) is
    touched.

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
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    handler = _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                renderer,
            ],
            foreign_pre_chain=[structlog.processors.add_log_level],
        )
    )
    handler.addFilter(_DropEvents(frozenset(drop_events)))
    for old in [h for h in _STDLIB.handlers if isinstance(h, _StderrHandler)]:
        _STDLIB.removeHandler(old)
    _STDLIB.addHandler(handler)
    _STDLIB.setLevel(logging.getLevelNamesMapping()[level.upper()])
    _STDLIB.propagate = False


@contextmanager
def capture_events(level: int = logging.DEBUG) -> Iterator[list[dict[str, Any]]]:
    """Collect the library's events while the block runs (for tests).

    Yields a list that fills with one dict per event (``event``, ``log_level`` and the
    event's fields). The ``"opd_stream"`` logger's level is lowered to ``level`` for the
    block and restored after it.
    """
    events: list[dict[str, Any]] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.msg
            event = dict(msg) if isinstance(msg, dict) else {"event": record.getMessage()}
            event["log_level"] = record.levelname.lower()
            events.append(event)

    handler = _Collect(level)
    saved = _STDLIB.level
    _STDLIB.addHandler(handler)
    _STDLIB.setLevel(level)
    try:
        yield events
    finally:
        _STDLIB.removeHandler(handler)
        _STDLIB.setLevel(saved)
