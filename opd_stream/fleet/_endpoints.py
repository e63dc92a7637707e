"""The state of every server URL a stream talks to, in one place.

One :class:`Endpoint` per URL holds all that is known about it: its load (requests in
flight), its health (passive ejection, re-admission probes), the capabilities detected
from its answers (per-position ids, base64 top-k, the blocked batch), the engine it speaks
(configured or detected: :mod:`opd_stream.fleet._engines`) and its traffic
counters. The balancer (:mod:`opd_stream.fleet._balance`) and the capability rules
(:mod:`opd_stream.fleet._capabilities`) read and write it; the attempt sender counts traffic in
it; ``OPDStream.stats()`` only reads a snapshot (:meth:`Endpoints.snapshot`). Sans-IO.
"""

from __future__ import annotations

import msgspec

from ..wire._request import Engine
from ._records import EndpointStats, EndpointTraffic

__all__ = ("Endpoint", "EndpointHealth", "Endpoints")

_WORKERS = 1024  # distinct routed worker ids counted per URL (more: not counted)
_WORKER_CHARS = 256


class EndpointHealth:
    """Health state of one replica URL (the rules:
    :class:`~opd_stream.fleet._balance.EndpointPool`).

    Attributes:
        consecutive_failures: failures since the last success or re-admission.
        ejected_until: ``now`` from which a re-admission probe may run; ``None`` when the
            replica is admitted.
        probing: a ``/health`` probe of this replica is in flight.
        ejections: times the replica was ejected (a failed probe counts again).
        readmissions: times a probe re-admitted it.
        refused_since: ``now`` of the first refused connection since it last answered;
            ``None`` when it is not refusing.
    """

    __slots__ = (
        "consecutive_failures",
        "ejected_until",
        "ejections",
        "probing",
        "readmissions",
        "refused_since",
    )

    def __init__(self) -> None:
        self.refused_since: float | None = None
        self.consecutive_failures = 0
        self.ejected_until: float | None = None
        self.probing = False
        self.ejections = 0
        self.readmissions = 0

    @property
    def ejected(self) -> bool:
        """True while the replica is out of the rotation (cool-down or awaiting a probe)."""
        return self.ejected_until is not None


class Endpoint:
    """Everything known about one server URL (see the module docstring)."""

    __slots__ = (
        "b64_topk",
        "blocked_batch",
        "engine",
        "engine_problem",
        "health",
        "in_flight",
        "keys",
        "per_position",
        "routed",
        "traffic",
        "weight_version",
        "work",
    )

    def __init__(self) -> None:
        self.in_flight = 0
        self.work = 0  # uncached tokens its requests in flight are expected to compute
        self.weight_version: str | None = None  # the last answer's meta_info.weight_version
        self.keys: dict[int, int] = {}  # routing key -> its requests in flight here
        self.traffic = EndpointTraffic()  # its counters (EndpointStats carries a copy)
        self.health = EndpointHealth()
        self.per_position: bool | None = None
        self.b64_topk: bool | None = None
        self.blocked_batch: bool | None = None
        # the dialect it speaks (None: not known yet; fleet._engines), and why none was
        # found when detection found no scoring API there
        self.engine: Engine | None = None
        self.engine_problem: str | None = None
        self.routed: dict[str, int] = {}  # a gateway's x-smg-routed-worker-id -> answers

    def note_worker(self, worker: str) -> None:
        """A gateway at this URL said ``worker`` answered (``x-smg-routed-worker-id``)."""
        routed = self.routed
        worker = worker[:_WORKER_CHARS]
        if worker in routed:
            routed[worker] += 1
        elif len(routed) < _WORKERS:
            routed[worker] = 1

    def stats(self) -> EndpointStats:
        health = self.health
        return EndpointStats(
            **msgspec.structs.asdict(self.traffic),
            in_flight=self.in_flight,
            per_position=self.per_position,
            b64_topk=self.b64_topk,
            blocked_batch=self.blocked_batch,
            engine=self.engine,
            ejected=health.ejected,
            ejections=health.ejections,
            readmissions=health.readmissions,
            routed_workers=tuple(sorted(self.routed.items(), key=lambda kv: (-kv[1], kv[0]))),
        )


class Endpoints:
    """The :class:`Endpoint` of every URL of one stream (created on first use)."""

    def __init__(self) -> None:
        self._by_url: dict[str, Endpoint] = {}

    def __call__(self, url: str) -> Endpoint:
        ep = self._by_url.get(url)
        if ep is None:
            ep = self._by_url[url] = Endpoint()
        return ep

    def load(self, url: str) -> int:
        """Requests in flight to ``url`` now."""
        ep = self._by_url.get(url)
        return 0 if ep is None else ep.in_flight

    def work(self, url: str) -> int:
        """Uncached tokens the requests in flight to ``url`` are expected to compute (the
        balancer's estimate, charged by :meth:`begin`)."""
        ep = self._by_url.get(url)
        return 0 if ep is None else ep.work

    def prompts(self, url: str) -> int:
        """Distinct routing keys (prompts) with requests in flight to ``url`` now."""
        ep = self._by_url.get(url)
        return 0 if ep is None else len(ep.keys)

    def holds(self, url: str, key: int) -> bool:
        """``key`` has requests in flight to ``url`` now."""
        ep = self._by_url.get(url)
        return ep is not None and key in ep.keys

    def held(self, url: str, key: int) -> int:
        """Requests with routing ``key`` in flight to ``url`` now."""
        ep = self._by_url.get(url)
        return 0 if ep is None else ep.keys.get(key, 0)

    def begin(self, url: str, key: int | None, work: int = 0) -> Endpoint:
        """A request (with routing ``key``, if any; expected to compute ``work`` uncached
        tokens) to ``url`` is in flight from now."""
        ep = self(url)
        ep.in_flight += 1
        ep.work += work
        if key is not None:
            ep.keys[key] = ep.keys.get(key, 0) + 1
        return ep

    def end(self, url: str, key: int | None, work: int = 0) -> None:
        """The request of :meth:`begin` is over (answered, failed or cancelled)."""
        ep = self(url)
        ep.in_flight -= 1
        ep.work -= work
        if key is not None:
            left = ep.keys[key] - 1
            if left:
                ep.keys[key] = left
            else:
                del ep.keys[key]  # nothing kept once a prompt's last request is over

    def snapshot(self) -> dict[str, EndpointStats]:
        return {url: ep.stats() for url, ep in self._by_url.items()}
