"""Which answer parser runs, in words: for ``opd-stream config`` (:func:`parser_line`) and
the one-line notice of the commands when the compiled scanner is unavailable
(:func:`scanner_notice`). Cheap: numba is looked up, not imported (``_jit``)."""

from __future__ import annotations

import importlib.metadata

from ..scanner._loader import unavailable_reason

__all__ = ("parser_line", "scanner_notice")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def parser_line() -> str:
    """One line: the parser of teacher answers in this environment, and why."""
    why = unavailable_reason()
    if why is None:
        return (
            f"answer parser: the compiled scanner (numba {_version('numba')}); msgspec "
            f"{_version('msgspec')} for an answer it refuses and until it is compiled"
        )
    return (
        f"answer parser: msgspec {_version('msgspec')} (the compiled scanner is unavailable: {why})"
    )


def scanner_notice() -> str | None:
    """The notice a command prints when the compiled scanner cannot run, else ``None``."""
    why = unavailable_reason()
    if why is None:
        return None
    return (
        f"note: the compiled answer scanner is unavailable ({why}); answers are parsed "
        "with msgspec, several times slower"
    )
