"""Buffers for big answer bodies, used again once nothing refers to them.

glibc maps an allocation above 32 MiB afresh and unmaps it on free, so each long answer's
pages were faulted in and zeroed again as the socket read into them. :class:`BodyPool`
keeps the buffers of bodies of ``MIN_POOLED`` bytes or more and hands one out again for a
body that fits. Who owns a buffer is read from its reference count: a body handed to a
decode thread, to a decode its caller abandoned, or viewed by an array holds its buffer
(through the memoryview's export) until the last of them lets go; until then the next body
gets another one. Sans-IO; called from the event loop's thread only. The measurements and
the rules: ``docs/design-notes.md``, "opd_stream/transport/_bodies.py".
"""

from __future__ import annotations

import sys

import numpy as np
import numpy.typing as npt

__all__ = ("MIN_POOLED", "BodyPool")

_MIB = 1 << 20

MIN_POOLED = 4 * _MIB
"""Bodies below this come from the allocator's heap, which reuses its pages on its own."""

_KEEP = 8
"""The most buffers a pool holds (busy and free together)..."""

_KEEP_BYTES = 512 * _MIB
"""... and the most bytes: what a stream keeps after a burst of big answers (a buffer that
would take the pool past either bound is not kept, once no free one can make room)."""

_SLACK = 2
"""A buffer serves a body of at least ``1 / _SLACK`` of its size (a big buffer is not
spent on a small body)."""


def _idle_refs() -> int:
    """The reference count of a buffer nothing but the pool refers to, as
    :meth:`BodyPool._counts` reads it (measured, not assumed: it is the interpreter's)."""
    pool = BodyPool()
    pool._buffers.append(np.empty(1, dtype=np.uint8))
    return pool._counts()[0]


class BodyPool:
    """Buffers for answer bodies of ``MIN_POOLED`` bytes or more (see the module docstring).

    :meth:`take` gives a writable memoryview of exactly the body's length over a buffer
    nothing else refers to (the smallest that fits, and at most ``_SLACK`` times the
    body), or over a new one, kept if the pool has room for it within ``_KEEP`` buffers
    and ``_KEEP_BYTES``, or free buffers to drop for it; a smaller body gets a buffer of
    its own, as before. :meth:`clear` drops every buffer (the stream does so as it idles
    and as it closes). ``reused``: bodies read into a buffer again (for tests and the
    benchmarks).
    """

    def __init__(self) -> None:
        self._buffers: list[npt.NDArray[np.uint8]] = []
        self.reused = 0

    def take(self, length: int) -> memoryview:
        """A memoryview of ``length`` writable bytes for one body."""
        if length < MIN_POOLED:
            return np.empty(length, dtype=np.uint8).data
        fits = [
            (size, i)
            for i in self._free()
            if length <= (size := self._buffers[i].size) <= length * _SLACK
        ]
        if fits:
            self.reused += 1
            return self._buffers[min(fits)[1]].data[:length]
        # an eighth more, in whole MiB: the next body of about this size fits as well
        size = (length + length // 8 + _MIB - 1) // _MIB * _MIB
        buf = np.empty(size, dtype=np.uint8)
        if self._make_room(size):
            self._buffers.append(buf)
        return buf.data[:length]

    def _make_room(self, size: int) -> bool:
        """Whether a new buffer of ``size`` bytes can be kept, dropping free buffers (the
        smallest first) until it fits within ``_KEEP`` and ``_KEEP_BYTES``."""
        if size > _KEEP_BYTES:
            return False
        free = sorted((self._buffers[i].size, i) for i in self._free())
        held, count, drop = self.held_bytes, len(self._buffers), set()
        for freed, i in free:
            if count < _KEEP and held + size <= _KEEP_BYTES:
                break
            drop.add(i)
            held, count = held - freed, count - 1
        if count >= _KEEP or held + size > _KEEP_BYTES:
            return False  # the busy ones fill it: not kept, nothing dropped
        self._buffers = [buf for i, buf in enumerate(self._buffers) if i not in drop]
        return True

    def clear(self) -> None:
        """Drop every buffer: a free one is freed now, a busy one by its last user."""
        self._buffers.clear()

    @property
    def held_bytes(self) -> int:
        """The bytes of the buffers the pool holds, busy or free."""
        return sum(buf.size for buf in self._buffers)

    def _free(self) -> list[int]:
        """The indices of the buffers nothing but the pool refers to."""
        return [i for i, refs in enumerate(self._counts()) if refs <= _IDLE_REFS]

    def _counts(self) -> list[int]:
        return [sys.getrefcount(buf) for buf in self._buffers]


_IDLE_REFS = _idle_refs()
