"""A per-stream memory budget for answer bodies: an async byte semaphore.

``max_response_bytes`` caps one answer; this bounds the bytes of *all* answers a stream
holds at once (being read, or read and waiting for their decode). Each attempt takes a
:class:`BudgetLease` from the stream's :class:`ByteBudget` for as long as it holds its body
(:meth:`ByteBudget.lease`, around the request and the decode) and hands it to the
transport (``Transport.send(Request(..., lease=lease))``), which charges the body to it
chunk by chunk as it reads it (:meth:`BudgetLease.grow`), so a reader that would go over the budget
waits, and stops reading its socket, until bodies held by others are released.

Rules (they make the budget deadlock-free and never refuse an answer):

* a charge is granted when it fits (``used + n <= limit``) or when nothing is held at all,
  so one answer larger than the whole budget still goes through, alone;
* waiters are served first come, first served (a large charge is not starved by small ones);
* when every lease that holds bytes is itself waiting for more (each partly read, none able
  to finish), the waiter holding the most becomes *privileged*: its charges are granted
  at once until it has read its whole body (:meth:`BudgetLease.done_reading`) or released.
  So the bytes held stay below ``limit`` plus one answer (at most ``max_response_bytes``).

The lease travels in the request, nothing is read from the running task's context: a
transport with the old ``post`` that takes no ``lease`` (one written before it existed) is
never passed one, and its wrapper (``_legacy``) charges the answer after the fact
(:meth:`BudgetLease.settle`). Works on any anyio backend.
"""

from __future__ import annotations

import types
from collections import deque
from typing import Self

import anyio

__all__ = ("BudgetLease", "ByteBudget")


class _Waiter:
    __slots__ = ("counted", "event", "granted", "lease", "size")

    def __init__(self, lease: BudgetLease, size: int, counted: bool) -> None:
        self.lease = lease
        self.size = size
        self.counted = counted  # the lease held bytes when it started waiting
        self.granted = False
        self.event = anyio.Event()


class BudgetLease:
    """The bytes one attempt holds: made by :meth:`ByteBudget.lease`, released on exit
    from its ``with`` block (or by :meth:`release`).

    A transport gets one in :attr:`Request.lease <opd_stream.Request>` and charges the
    answer's body to it as it reads: :meth:`grow` for each chunk (it waits while the stream
    holds too many answer bytes: stop reading meanwhile), :meth:`done_reading` once the
    body is whole; or :meth:`settle` once, for a body read in one piece. ``held``: the
    bytes charged so far.
    """

    __slots__ = ("_budget", "_released", "held")

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self._released = False
        self.held = 0

    async def grow(self, size: int) -> None:
        """Charge ``size`` more bytes, waiting until the budget grants them."""
        await self._budget._acquire(self, size)

    async def settle(self, total: int) -> None:
        """Make the lease hold at least ``total`` bytes (charges what a transport did not)."""
        if total > self.held:
            await self.grow(total - self.held)
        self.done_reading()

    def done_reading(self) -> None:
        """The body is complete: the lease holds its bytes but will ask for no more."""
        self._budget._end_privilege(self)

    def release(self) -> None:
        """Give every held byte back (idempotent)."""
        if not self._released:
            self._released = True
            self._budget._release(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.release()


class ByteBudget:
    """At most ``limit`` bytes of answer bodies held at once (see the module docstring).

    Args:
        limit: the budget, in bytes (>= 1).

    Raises:
        ValueError: ``limit < 1``.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._holders = 0  # leases holding bytes
        self._blocked = 0  # of those, the ones waiting for more
        self._privileged: BudgetLease | None = None
        self._waiters: deque[_Waiter] = deque()

    def __repr__(self) -> str:
        return f"ByteBudget(limit={self.limit}, used={self.used}, waiting={len(self._waiters)})"

    @property
    def waiting(self) -> int:
        """Charges waiting to be granted."""
        return len(self._waiters)

    def lease(self) -> BudgetLease:
        """A new, empty lease (release it, or use it as a ``with`` block)."""
        return BudgetLease(self)

    # --- the state machine --------------------------------------------------------------

    def _fits(self, size: int) -> bool:
        return self.used == 0 or self.used + size <= self.limit

    def _grant(self, lease: BudgetLease, size: int) -> None:
        if lease.held == 0:
            self._holders += 1
        lease.held += size
        self.used += size
        self.peak = max(self.peak, self.used)

    async def _acquire(self, lease: BudgetLease, size: int) -> None:
        if size <= 0:
            return
        if lease._released:
            raise RuntimeError("BudgetLease used after release")
        if lease is self._privileged or (not self._waiters and self._fits(size)):
            self._grant(lease, size)
            return
        waiter = _Waiter(lease, size, counted=lease.held > 0)
        self._waiters.append(waiter)
        if waiter.counted:
            self._blocked += 1
        self._pump()
        try:
            await waiter.event.wait()
        except BaseException:
            if not waiter.granted:
                self._waiters.remove(waiter)
                if waiter.counted:
                    self._blocked -= 1
                self._pump()
            raise

    def _pump(self) -> None:
        """Grant what can be granted, in order; break a standstill with a privileged lease."""
        while self._waiters:
            head = self._waiters[0]
            if self._fits(head.size):
                self._serve(head)
                continue
            if self._privileged is None and self._holders > 0 and self._blocked == self._holders:
                # Every holder waits for more: nobody would ever release. Let the one that
                # has read the most finish alone.
                chosen = max(self._waiters, key=lambda w: w.lease.held)
                self._privileged = chosen.lease
                self._serve(chosen)
                continue
            return

    def _serve(self, waiter: _Waiter) -> None:
        self._waiters.remove(waiter)
        if waiter.counted:
            self._blocked -= 1
        waiter.granted = True
        self._grant(waiter.lease, waiter.size)
        waiter.event.set()

    def _end_privilege(self, lease: BudgetLease) -> None:
        if self._privileged is lease:
            self._privileged = None
            self._pump()

    def _release(self, lease: BudgetLease) -> None:
        if lease.held:
            self.used -= lease.held
            self._holders -= 1
            lease.held = 0
        self._end_privilege(lease)
        self._pump()
