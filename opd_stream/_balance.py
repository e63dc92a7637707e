"""Client-side balancing over a teacher's replicas: which replica gets the next request,
when a replica is taken out (passive health), and how long to wait before hedging.

Sans-IO: plain synchronous bookkeeping. The caller passes the clock (``now``, seconds on
any monotonic clock) and performs the I/O (requests, ``/health`` probes); see
``_scorer.py`` for the async side.

Rules, per replica URL:

* **Choice** (``pick``): among the replicas that are not ejected, ``least-outstanding``
  draws two distinct replicas at random and takes the one with fewer requests in flight
  ("power of two choices"; with two replicas that is plain least-outstanding), ties going
  to the first drawn; ``round-robin`` cycles through them. If every replica is ejected the
  choice is made among all of them (fail open: an ejection never fails a request by
  itself).
* **Passive health**: ``eject_after`` consecutive failures (``record_failure``) eject a
  replica for ``cooldown_s``. A success resets the count. After the cool-down the replica
  stays out until a ``/health`` probe answers 200: ``claim_probe`` hands out at most one
  probe per replica at a time, and ``probe_result`` re-admits it (200) or ejects it for
  another cool-down. ``eject_after = 0`` disables ejection. A pool of one replica never
  ejects (there is nothing to fail over to).
* **Unreachable replica set** (``unreachable``, ``let_through``): a replica whose
  connection attempt was refused (no connection made: refused, no route, a name that does
  not resolve, a connect timed out; ``record_refused``) is *refusing* from that moment
  until it answers anything (``record_success``, ``record_reached``). When every replica
  of a set has been refusing for ``unreachable_after_s`` (measured from the latest of their
  first refusals), the set is unreachable: its requests fail at once instead of being
  retried, except one request per ``unreachable_after_s`` that ``let_through`` lets go
  ahead (a single attempt) to see whether the set is back; any answer from any replica
  makes the set reachable again. ``unreachable_after_s = 0`` disables the rule.
* **Hedging delay** (``hedge_delay``): the ``percentile`` of the last ``_LATENCY_RING``
  successful attempt latencies of the same replica set, at least ``min_s``; ``None``
  (no hedging) while fewer than ``HEDGE_MIN_SAMPLES`` latencies are known.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Collection, Sequence
from typing import Final, Literal, TypeAlias

import numpy as np

from ._endpoints import EndpointHealth, Endpoints

__all__ = ("HEDGE_MIN_SAMPLES", "Balance", "EndpointPool")

Balance: TypeAlias = Literal["least-outstanding", "round-robin"]

HEDGE_MIN_SAMPLES: Final = 16
"""Successful latencies a replica set needs before hedging starts."""

_LATENCY_RING: Final = 512


class EndpointPool:
    """Replica choice and passive health for every server URL of one stream.

    The state it reads and writes (load, health) is each URL's
    :class:`~opd_stream._endpoints.Endpoint`; the pool keeps only the choice's own state
    (round-robin turns, recent latencies).

    Args:
        endpoints: the stream's per-URL state.
        balance: ``least-outstanding`` (power of two choices) or ``round-robin``.
        eject_after: consecutive failures that eject a replica (0: never eject).
        cooldown_s: how long an ejected replica stays out before it may be probed (> 0).
        unreachable_after_s: how long every replica of a set must have refused
            connections before the set is unreachable (0: never).
        rng: random source of the two-choice draw (seed it for reproducible choices).
    """

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        balance: Balance = "least-outstanding",
        eject_after: int = 5,
        cooldown_s: float = 10.0,
        unreachable_after_s: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self._endpoints = endpoints
        self._balance = balance
        self._eject_after = eject_after
        self._cooldown_s = cooldown_s
        self._unreachable_after_s = unreachable_after_s
        self._next_probe: dict[tuple[str, ...], float] = {}  # unreachable sets: next let-through
        self._rng = rng if rng is not None else random.Random()
        self._rr: dict[tuple[str, ...], int] = {}
        self._latency: dict[tuple[str, ...], deque[float]] = {}

    def health(self, url: str) -> EndpointHealth:
        """The health state of ``url`` (admitted on first use)."""
        return self._endpoints(url).health

    # choice ------------------------------------------------------------------------
    def pick(self, urls: Sequence[str], exclude: Collection[str] = ()) -> str | None:
        """The replica of ``urls`` for the next request, or ``None`` when ``exclude``
        leaves none.

        Ejected replicas are skipped unless every candidate is ejected.
        """
        candidates = [u for u in urls if u not in exclude]
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        admitted = [u for u in candidates if not self.health(u).ejected]
        pool = admitted or candidates
        if len(pool) == 1:
            return pool[0]
        if self._balance == "round-robin":
            key = tuple(urls)
            turn = self._rr.get(key, 0)
            self._rr[key] = turn + 1
            return pool[turn % len(pool)]
        first, second = self._rng.sample(pool, 2)
        load = self._endpoints.load
        return second if load(second) < load(first) else first

    # passive health ----------------------------------------------------------------
    def record_success(self, url: str, urls: Sequence[str], latency_s: float) -> None:
        """A request to ``url`` (one of the replica set ``urls``) succeeded."""
        state = self.health(url)
        state.consecutive_failures = 0
        state.refused_since = None
        ring = self._latency.get(tuple(urls))
        if ring is None:
            ring = self._latency[tuple(urls)] = deque(maxlen=_LATENCY_RING)
        ring.append(latency_s)

    def record_failure(self, url: str, urls: Sequence[str], now: float) -> bool:
        """A request to ``url`` failed in a way that says the replica is unwell.

        Returns:
            True when this failure ejected the replica.
        """
        state = self.health(url)
        state.consecutive_failures += 1
        if (
            self._eject_after == 0
            or len(urls) < 2
            or state.ejected
            or state.consecutive_failures < self._eject_after
        ):
            return False
        self._eject(state, now)
        return True

    def _eject(self, state: EndpointHealth, now: float) -> None:
        state.ejected_until = now + self._cooldown_s
        state.ejections += 1

    def claim_probe(self, urls: Sequence[str], now: float) -> str | None:
        """An ejected replica of ``urls`` whose cool-down is over and that nobody is
        probing; it is marked as being probed. ``None`` when there is none.

        The caller must report the outcome with :meth:`probe_result`, or give the claim
        back with :meth:`release_probe` when the probe was cancelled.
        """
        for url in urls:
            state = self.health(url)
            if state.ejected_until is not None and not state.probing and now >= state.ejected_until:
                state.probing = True
                return url
        return None

    def probe_result(self, url: str, healthy: bool, now: float) -> None:
        """Outcome of a claimed probe: re-admit ``url``, or eject it for another cool-down."""
        state = self.health(url)
        state.probing = False
        if healthy:
            state.ejected_until = None
            state.consecutive_failures = 0
            state.readmissions += 1
        else:
            self._eject(state, now)

    def release_probe(self, url: str) -> None:
        """Give back a claimed probe without a verdict (it was cancelled)."""
        self.health(url).probing = False

    # unreachable replica sets ------------------------------------------------------
    def record_refused(self, url: str, now: float) -> None:
        """No connection could be made to ``url`` (the server was not reached)."""
        state = self.health(url)
        if state.refused_since is None:
            state.refused_since = now

    def record_reached(self, url: str) -> None:
        """``url`` answered (an error status or a bad answer included): it is not refusing."""
        self.health(url).refused_since = None

    def unreachable(self, urls: Sequence[str], now: float) -> float | None:
        """For how long every replica of ``urls`` has been refusing connections, when that
        is at least ``unreachable_after_s``; else ``None`` (the set is reachable)."""
        if self._unreachable_after_s <= 0 or not urls:
            return None
        latest = -math.inf
        for url in urls:
            since = self.health(url).refused_since
            if since is None:
                self._next_probe.pop(tuple(urls), None)
                return None
            latest = max(latest, since)
        refusing = now - latest
        return refusing if refusing >= self._unreachable_after_s else None

    def known_unreachable(self, urls: Sequence[str]) -> bool:
        """Whether ``urls`` was found unreachable before (and has not answered since)."""
        return tuple(urls) in self._next_probe

    def let_through(self, urls: Sequence[str], now: float) -> bool:
        """While ``urls`` is unreachable: whether this request goes ahead (the first one,
        then one per ``unreachable_after_s``) to see whether the set is back."""
        key = tuple(urls)
        due = self._next_probe.get(key)
        if due is not None and now < due:
            return False
        self._next_probe[key] = now + self._unreachable_after_s
        return True

    # hedging -----------------------------------------------------------------------
    def hedge_delay(self, urls: Sequence[str], percentile: float, min_s: float) -> float | None:
        """How long to wait for an answer before sending a duplicate to another replica.

        Args:
            urls: the replica set.
            percentile: in ``(0, 100)``; ``0`` disables hedging.
            min_s: the smallest delay.

        Returns:
            ``max(min_s, percentile of recent successful latencies)``, or ``None`` when
            hedging is off, the set has one replica, or fewer than
            :data:`HEDGE_MIN_SAMPLES` latencies are known.
        """
        if percentile <= 0 or len(urls) < 2:
            return None
        ring = self._latency.get(tuple(urls))
        if ring is None or len(ring) < HEDGE_MIN_SAMPLES:
            return None
        value = float(np.percentile(np.fromiter(ring, dtype=np.float64), percentile))
        return max(min_s, value)
