"""Giving freed heap memory back to the operating system (glibc only).

glibc's malloc keeps large freed blocks in its heap arenas, so freeing answer-sized
allocations does not shrink the process. The stream calls :func:`release_freed_memory`
(``malloc_trim``: it returns free pages only and changes no allocator setting) when a run
ends and, at most every ``_IDLE_INTERVAL_S``, when it has nothing in flight. Elsewhere
(musl, macOS, Windows) it does nothing. The measurement: ``docs/design-notes.md``,
"opd_stream/_memory.py".
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable

__all__ = ("maybe_release_freed_memory", "release_freed_memory")

_IDLE_INTERVAL_S = 10.0
_last = 0.0


def _load() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    return trim


_TRIM = _load()


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS now (glibc ``malloc_trim(0)``)."""
    global _last
    _last = time.monotonic()
    if _TRIM is not None:
        _TRIM(0)


def maybe_release_freed_memory() -> None:
    """:func:`release_freed_memory`, unless it ran in the last ``_IDLE_INTERVAL_S``."""
    if time.monotonic() - _last >= _IDLE_INTERVAL_S:
        release_freed_memory()
