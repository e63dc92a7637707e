"""Giving freed heap memory back to the operating system (glibc only).

glibc's malloc keeps large freed blocks: after a big block is freed its mmap threshold
rises (up to 32 MiB), so later answer-sized allocations (MBs: bodies, decoded rows, KL
arrays) come from heap arenas, and freeing them does not shrink the process. Measured
with 64 long samples (3 MB answers) in flight at once: ~110 MB of RSS stayed after every
result was dropped, all of it free (``malloc_trim`` gave it back). The stream calls
:func:`release_freed_memory` when a run ends and, at most every ``_IDLE_INTERVAL_S``, when
it has nothing in flight. ``malloc_trim`` only returns free pages; no allocator setting is
changed. Elsewhere (musl, macOS, Windows) it does nothing.
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
