"""A per-stream memory budget for answer bodies: an async byte semaphore.

It bounds the bytes of *all* answers a stream holds at once (``max_response_bytes`` caps
one). Each attempt takes a :class:`BudgetLease` (:meth:`ByteBudget.lease`) and hands it to
the transport in its request, which charges the body chunk by chunk
(:meth:`BudgetLease.grow`): a reader over the budget waits, unread, until others release.
Deadlock-free and never refusing an answer: a charge is granted when it fits or nothing is
held, waiters first come first served, and when every holder waits the one holding the most
reads on, so the bytes held stay below ``limit`` plus one answer. A legacy ``post`` gets
no lease (charged after, :meth:`BudgetLease.settle`). Any anyio backend. The rules in full:
``docs/design-notes.md``, "opd_stream/transport/_budget.py".
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

    def try_grow(self, size: int) -> bool:
        """Charge ``size`` more bytes if the budget grants them without waiting (as
        :meth:`grow` would at once); False, charging nothing, if :meth:`grow` would wait."""
        return self._budget._try_acquire(self, size)

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

    def _try_acquire(self, lease: BudgetLease, size: int) -> bool:
        if size <= 0:
            return True
        if lease._released:
            raise RuntimeError("BudgetLease used after release")
        if lease is self._privileged or (not self._waiters and self._fits(size)):
            self._grant(lease, size)
            return True
        return False

    async def _acquire(self, lease: BudgetLease, size: int) -> None:
        if self._try_acquire(lease, size):
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
