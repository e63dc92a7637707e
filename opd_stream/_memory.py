"""Giving freed heap memory back to the operating system (glibc only), and when.

glibc's malloc keeps large freed blocks in its heap arenas, so freeing answer-sized
allocations does not shrink the process. :func:`release_freed_memory` (``malloc_trim``: it
returns free pages only and changes no allocator setting) gives them back; elsewhere (musl,
macOS, Windows) it does nothing. Pages given back cost a fault each when the next samples
touch them again (0.6-1 ms of CPU per sample of 512 + 2048 tokens at k = 16), so a stream
does it once it has had nothing in flight for ``release_memory_after_s``, and as it closes
(:class:`IdleRelease`), never between the samples of a busy stream. The measurements:
``docs/design-notes.md``, "opd_stream/_memory.py".
"""

from __future__ import annotations

import ctypes
import sys
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import NoReturn

import anyio

__all__ = ("IdleRelease", "release_freed_memory")


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
    if _TRIM is not None:
        _TRIM(0)


def _timed_release() -> float:
    start = time.thread_time()
    release_freed_memory()
    return time.thread_time() - start


_OPEN: weakref.WeakSet[IdleRelease] = weakref.WeakSet()
"""The open streams' keepers, in every thread of the process: ``malloc_trim`` gives back
the whole process's free pages, so no stream does it while another has samples in flight
(their next allocations would fault)."""


class IdleRelease:
    """A stream's freed heap memory, given back once it idles: :meth:`run` (a task of the
    stream's) calls :func:`release_freed_memory`, in a worker thread, when ``after_s``
    seconds have passed since :meth:`went_idle` with no sample admitted or finished
    meanwhile and nothing in flight (``in_flight()``); :meth:`close` does it once more as the
    stream closes, if anything ran since. Neither does it while another open stream of the
    process has samples in flight (that one does it once it idles in turn). Each call's
    CPU seconds go to ``spent``. ``drop`` runs on the loop just before each release: what
    the stream kept for reuse, freed first (the transport's body buffers).

    Created inside the stream's event loop (it holds an ``anyio.Event``). ``sleep``: how
    the interval is waited for (tests pass their own).
    """

    def __init__(
        self,
        after_s: float,
        in_flight: Callable[[], int],
        spent: Callable[[float], None],
        *,
        drop: Callable[[], None] = lambda: None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        self._after_s = after_s
        self._in_flight = in_flight
        self._spent = spent
        self._drop = drop
        self._sleep = sleep
        self.waiting_for_idle = False  # run() waits for the next went_idle
        self._idle = anyio.Event()
        self._marks = 0  # went_idle calls so far
        self._released_at = 0  # _marks when memory was last given back
        _OPEN.add(self)

    def went_idle(self) -> None:
        """A run had nothing left in flight, or ended."""
        self._marks += 1
        self._idle.set()

    async def run(self) -> NoReturn:
        while True:
            self.waiting_for_idle = True
            await self._idle.wait()
            self.waiting_for_idle = False
            self._idle = anyio.Event()
            marks = self._marks
            await self._sleep(self._after_s)
            if self._marks == marks and self._in_flight() == 0 and not self._others_busy():
                await self._release()

    async def close(self) -> None:
        """The stream closes: give back what it freed since the last release (shielded),
        unless another open stream has samples in flight."""
        _OPEN.discard(self)
        if self._marks != self._released_at and not self._others_busy():
            with anyio.CancelScope(shield=True):
                await self._release()

    def _others_busy(self) -> bool:
        try:
            keepers = list(_OPEN)
        except RuntimeError:  # another thread's stream opened or closed while it was read
            return True
        return any(k is not self and k._busy() for k in keepers)

    def _busy(self) -> bool:
        # read from another stream's thread too: a count that changes while it is read
        # (a run's set resized under the iteration) counts as busy
        try:
            return self._in_flight() > 0
        except RuntimeError:
            return True

    async def _release(self) -> None:
        self._released_at = self._marks
        self._drop()
        self._spent(await anyio.to_thread.run_sync(_timed_release))
