"""Client-side balancing over a teacher's replicas: which replica gets the next request,
when a replica is taken out (passive health), and how long to wait before hedging.

Sans-IO: plain synchronous bookkeeping. The caller passes the clock (``now``, seconds on
any monotonic clock) and performs the I/O (requests, ``/health`` probes). Per replica URL:
the choice (``pick``: ``prefix`` by :func:`prefix_key` with bounded loads in tokens,
``least-outstanding`` or ``round-robin``; fail open when every replica is ejected), passive
health (``record_failure``, ``claim_probe``, ``probe_result``), the unreachable replica set
(``record_refused``, ``unreachable``, ``let_through``) and the hedging delay
(``hedge_delay``). The key and its replica order depend on the prompt and the URLs alone, so
several streams agree. The rules in full: ``docs/design-notes.md``,
"opd_stream/fleet/_balance.py".
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from typing import Final, Literal, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from ..wire._rows_json import ids_json
from ._endpoints import EndpointHealth, Endpoints

__all__ = (
    "HEDGE_MIN_SAMPLES",
    "ROUTING_KEY_HEADER",
    "ROUTING_TOKENS_HEADER",
    "Balance",
    "EndpointPool",
    "Route",
    "prefix_key",
    "routing_tokens",
)

Balance: TypeAlias = Literal["prefix", "least-outstanding", "round-robin"]

ROUTING_KEY_HEADER: Final = "X-SMG-Routing-Key"
"""The header that carries a request's prefix key (16 hex digits) to a gateway: smg routes
by it (under ``--policy manual``, or with ``--routing-key-override``)."""

ROUTING_TOKENS_HEADER: Final = "X-SMG-Routing-Tokens"
"""The header that carries a request's leading prompt ids to a gateway (comma-separated
decimal, at most :data:`ROUTING_IDS` ids and :data:`ROUTING_BYTES` bytes): smg's
``cache_aware`` and ``prefix_hash`` route by them without parsing the body."""

ROUTING_IDS: Final = 512
ROUTING_BYTES: Final = 4096

_CACHED_SLACK: Final = 3.0
"""Prompts' worth of work a replica known to hold a request's prompt may hold above the bound
and still take it (elsewhere the request would compute the whole prompt again). A prompt no
replica is known to hold has none at its first choice: moving it before any replica computed
it costs nothing."""

_FEW: Final = 2
"""Requests in flight per replica (this one counted) up to which a stream's view of the load
is chance: hashing so few requests onto the replicas puts 2 or 3 on one by luck alone."""

_SHARE_SLACK: Final = 2
"""While the stream has :data:`_FEW` requests per replica in flight or fewer: requests above
its share (``ceil((in flight + 1) / replicas)``) a replica holding a request's prompt may
hold and take it whatever its work. Such a view says nothing of the replica's load (other
clients' requests are not in it), and a prompt moved on it is computed again by every other
client, which sends it to its first choice."""

_MASK64: Final = (1 << 64) - 1

_HOMES: Final = 4096
"""Prompts whose last replica the pool remembers (least recently placed forgotten first)."""

HEDGE_MIN_SAMPLES: Final = 16
"""Successful latencies a replica set needs before hedging starts."""

_LATENCY_RING: Final = 512


def prefix_key(tokens: npt.NDArray[np.int64], response_length: int) -> int:
    """The routing key of a scoring request: a 64-bit hash of its prompt.

    The prompt is ``tokens[:len(tokens) - response_length]``, hashed as little-endian
    int64 with BLAKE2b (8 bytes): the same prompt gives the same key in every process and
    on every run, so several streams (one per rollout worker) send a group's requests to
    the same replica, and a gateway sees the same key from all of them.
    """
    prompt = np.ascontiguousarray(tokens[: len(tokens) - response_length], dtype="<i8")
    digest = hashlib.blake2b(prompt.data, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def routing_tokens(prompt: npt.NDArray[np.int64]) -> str:
    """The :data:`ROUTING_TOKENS_HEADER` value of a prompt: its first ids, as many as fit
    in :data:`ROUTING_IDS` ids and :data:`ROUTING_BYTES` bytes (``""`` for no prompt).
    Written by the request's ids writer (:func:`opd_stream.wire._rows_json.ids_json`, the
    same decimal text without its brackets: 3 us for 512 ids, against 69 us through a list
    of Python ints and their strings)."""
    text = bytes(ids_json(np.asarray(prompt[:ROUTING_IDS], dtype=np.int64)))[1:-1].decode("ascii")
    if len(text) > ROUTING_BYTES:
        text = text[: text.rindex(",", 0, ROUTING_BYTES + 1)]
    return text


class Route(NamedTuple):
    """What places a request under the ``prefix`` balance: its prompt's key and the work it
    brings (uncached tokens: its whole prompt on a replica without that prompt cached, its
    response alone on one with it)."""

    key: int
    """The prompt's :func:`prefix_key`."""
    prompt: int = 1
    """Prompt tokens (computed once per replica that caches them)."""
    response: int = 0
    """Tokens after the prompt (computed by every request)."""
    head: str = ""
    """Its prompt's :func:`routing_tokens` (sent as :data:`ROUTING_TOKENS_HEADER`)."""


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit hash of a 64-bit integer."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def _url_hash(url: str) -> int:
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "little")


class EndpointPool:
    """Replica choice and passive health for every server URL of one stream.

    The state it reads and writes (load, health) is each URL's
    :class:`~opd_stream.fleet._endpoints.Endpoint`; the pool keeps only the choice's own state
    (round-robin turns, recent latencies).

    Args:
        endpoints: the stream's per-URL state.
        balance: ``prefix`` (bounded-load rendezvous hashing of a request's key),
            ``least-outstanding`` (power of two choices) or ``round-robin``.
        load_factor: ``prefix`` only: no replica takes a request while its work is
            ``load_factor`` x the mean work or more (this request counted; a replica
            known to hold the prompt 3 prompts more; while the stream has at most 2
            requests per replica in flight, one holding the prompt within 2 requests of
            its share of them takes it anyway), >= 1.
        limit: ``prefix`` only: a replica with this many requests in flight takes no more
            while another has room (the per-endpoint concurrency limit).
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
        load_factor: float = 1.25,
        limit: int = 64,
        eject_after: int = 5,
        cooldown_s: float = 10.0,
        unreachable_after_s: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self._endpoints = endpoints
        self._balance = balance
        self._load_factor = load_factor
        self._limit = limit
        self._url_hashes: dict[str, int] = {}
        self._homes: OrderedDict[int, str] = OrderedDict()
        self._cached: OrderedDict[int, set[str]] = OrderedDict()  # key -> replicas with it
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
    def pick(
        self,
        urls: Sequence[str],
        exclude: Collection[str] = (),
        key: Route | int | None = None,
    ) -> str | None:
        """The replica of ``urls`` for the next request, or ``None`` when ``exclude``
        leaves none.

        Ejected replicas are skipped unless every candidate is ejected. ``key`` (a
        :class:`Route`, or a bare :func:`prefix_key`: a prompt of one token's work) places
        the request under the ``prefix`` balance.
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
            ring = tuple(urls)
            turn = self._rr.get(ring, 0)
            self._rr[ring] = turn + 1
            return pool[turn % len(pool)]
        if self._balance == "prefix" and key is not None:
            return self._bounded(pool, key if isinstance(key, Route) else Route(key))
        first, second = self._rng.sample(pool, 2)
        load = self._endpoints.load
        return second if load(second) < load(first) else first

    def preference(self, urls: Sequence[str], key: int) -> list[str]:
        """``urls`` in ``key``'s rendezvous order (its first choice first)."""
        hashes = self._url_hashes
        scores = []
        for url in urls:
            h = hashes.get(url)
            if h is None:
                h = hashes[url] = _url_hash(url)
            scores.append((_mix(key ^ h), url))
        scores.sort(reverse=True)
        return [url for _, url in scores]

    def _bounded(self, pool: Sequence[str], route: Route) -> str:
        eps, limit = self._endpoints, self._limit
        key, prompt, response = route.key, route.prompt, route.response
        order = self.preference(pool, key)
        known = self._holding(key, order)
        # none known: its first choice, where every client's first request of it goes
        cached = known or {order[0]}
        homes = self._homes
        home = homes.get(key)
        # where it was placed last, then the other replicas holding it, then the rest
        order = [u for u in order if u in cached] + [u for u in order if u not in cached]
        if home is not None and home in order:
            order.remove(home)
            order.insert(0, home)
        work = {url: eps.work(url) for url in pool}
        total = sum(work.values())
        # its share of the stream's requests in flight (this one counted) and the noise,
        # while the stream has too few in flight to tell load from chance
        inflight = sum(eps.load(u) for u in pool) + 1
        share = -(-inflight // len(pool)) + _SHARE_SLACK if inflight <= _FEW * len(pool) else 0
        url = None
        for candidate in order:
            held = eps.held(candidate, key)
            load = eps.load(candidate)
            if load >= limit and not (held and 2 * held < limit):
                continue  # at its limit, unless its own few requests wait for it there
            if held:
                url = candidate  # joins its prompt's requests in flight
                break
            if candidate in cached:
                if load < share:
                    url = candidate  # within what chance puts on a replica
                    break
                cost, slack = response, (_CACHED_SLACK * prompt if known else 0.0)
            else:
                cost, slack = prompt + response, 0.0
            # the bound: load_factor x the mean work, this request counted
            if work[candidate] < self._load_factor * (total + cost) / len(pool) + slack:
                url = candidate
                break
        if url is None:  # every replica at its limit or its bound
            url = min(order, key=lambda u: (eps.load(u) >= limit, work[u]))
        homes[key] = url
        homes.move_to_end(key)
        if len(homes) > _HOMES:
            homes.popitem(last=False)
        return url

    def _holding(self, key: int, order: Sequence[str]) -> set[str]:
        """The replicas of ``order`` known to hold ``key``'s prompt in their cache: those
        it was sent to or reported cached by (the last :data:`_HOMES` prompts), those it is
        in flight on."""
        known = self._cached.get(key, ())
        eps = self._endpoints
        return {url for url in order if url in known or eps.held(url, key)}

    def _note_cached(self, key: int, url: str) -> None:
        cached = self._cached
        where = cached.get(key)
        if where is None:
            where = cached[key] = set()
            if len(cached) > _HOMES:
                cached.popitem(last=False)
        else:
            cached.move_to_end(key)
        where.add(url)

    # load --------------------------------------------------------------------------
    def begin(self, url: str, route: Route | None) -> int:
        """A request placed by ``route`` (``None``: without a key) is in flight to ``url``
        from now; returns the work charged to ``url`` for it (give it back to :meth:`end`):
        its response when ``url`` is known to hold the prompt (or a request of it is in
        flight there), else its prompt and response."""
        if route is None:
            self._endpoints.begin(url, None)
            return 0
        key, prompt, response = route.key, route.prompt, route.response
        known = self._cached.get(key, ())
        cached = url in known or self._endpoints.held(url, key) > 0
        work = response if cached else prompt + response
        self._endpoints.begin(url, key, work)
        self._note_cached(key, url)
        return work

    def end(self, url: str, route: Route | None, work: int) -> None:
        """The request of :meth:`begin` is over (answered, failed or cancelled)."""
        self._endpoints.end(url, None if route is None else route.key, work)

    def record_cached(self, url: str, route: Route | None, cached_tokens: int) -> None:
        """``url`` answered a request of ``route`` with ``cached_tokens`` served from its
        cache: at least half the prompt says it holds that prompt (another client may have
        put it there)."""
        if route is not None and route.prompt > 0 and 2 * cached_tokens >= route.prompt:
            self._note_cached(route.key, url)

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
