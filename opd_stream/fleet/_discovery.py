"""Teacher (and student) fleets behind a gateway (smg, or sglang-router 0.3.2): its
workers, addressed directly.

A configured URL that is a gateway is *expanded*: its healthy regular workers
(``GET /workers``, else ``GET /v1/rl/workers``) that answer ``/health`` from here become
replicas of that URL, refreshed every :data:`REFRESH_S` seconds; otherwise requests go
through the gateway. Discovery is lazy and runs in the requesting task (no task outlives
a request); ``gateway_discovery="off"`` sends everything to the configured URLs. Sans-IO:
:func:`parse_gateway_workers`, :func:`parse_rl_workers`; the rest is a small async shell
around the transport. Why gateways are bypassed: ``docs/design-notes.md``,
"opd_stream/fleet/_discovery.py".
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import msgspec

from .._errors import ConfigError, OPDStreamError
from .._logging import get_logger
from ..transport._transports import Request, Transport
from ..wire._answers import Body
from ._records import FleetState, Kind
from ._routing import endpoint_url, normalize_server_url

__all__ = ("REFRESH_S", "FleetDirectory", "parse_rl_workers", "parse_gateway_workers")

log = get_logger()

#: How often a router's worker list is read again; a worker added to or removed from the
#: router shows up in our routing at the first request after this many seconds.
REFRESH_S = 5.0
_PROBE_TIMEOUT_S = 2.0
_MAX_BYTES = 1 << 20
_UNREACHABLE = object()


class _Worker(msgspec.Struct):
    url: str
    is_healthy: bool = True
    worker_type: str = "regular"


class _Workers(msgspec.Struct):
    workers: list[_Worker]


class _RLWorker(msgspec.Struct):
    url: str
    health: str | None = None
    worker_type: str | None = "regular"


class _RLWorkers(msgspec.Struct):
    workers: list[_RLWorker]


#: ``health`` values of smg's ``/v1/rl/workers`` that mean the worker takes requests.
_RL_HEALTHY = frozenset({"ready", "healthy"})


def parse_gateway_workers(body: Body) -> list[str] | None:
    """The worker URLs an sglang-router lists (``GET /workers``), or ``None`` when the answer
    is not a router's worker list, or the fleet cannot be addressed worker by worker.

    Only healthy workers are listed; a fleet with a non-``regular`` worker (prefill /
    decode disaggregation) gives ``None``: such workers cannot score a request alone.
    URLs are normalised; one that is not a valid server URL gives ``None``.
    """
    try:
        listing = msgspec.json.decode(body, type=_Workers)
    except (msgspec.DecodeError, RecursionError):
        return None
    if any(w.worker_type != "regular" for w in listing.workers):
        return None
    try:
        urls = [normalize_server_url(w.url) for w in listing.workers if w.is_healthy]
    except ConfigError:
        return None
    return list(dict.fromkeys(urls))


def parse_rl_workers(body: Body) -> list[str] | None:
    """The worker URLs smg's RL control plane lists (``GET /v1/rl/workers``, smg
    ``--enable-rl``), under the rules of :func:`parse_gateway_workers`: a worker is healthy
    when its ``health`` is ``ready`` (or ``healthy``); a missing ``worker_type`` is regular."""
    try:
        listing = msgspec.json.decode(body, type=_RLWorkers)
    except (msgspec.DecodeError, RecursionError):
        return None
    if any(w.worker_type not in (None, "regular") for w in listing.workers):
        return None
    try:
        urls = [normalize_server_url(w.url) for w in listing.workers if w.health in _RL_HEALTHY]
    except ConfigError:
        return None
    return list(dict.fromkeys(urls))


class _Fleet:
    __slots__ = ("checked_at", "kind", "listed", "lock", "refreshes", "workers")

    def __init__(self) -> None:
        self.kind: Kind = "unknown"
        self.workers: tuple[str, ...] = ()
        self.listed: tuple[str, ...] = ()
        self.checked_at = -float("inf")
        self.refreshes = 0
        self.lock = anyio.Lock()


class FleetDirectory:
    """The configured URLs of one stream and what each expands to."""

    def __init__(self, transport: Transport, *, enabled: bool) -> None:
        self._transport = transport
        self._enabled = enabled
        self._refresh_s = REFRESH_S
        self._fleets: dict[str, _Fleet] = {}

    async def expand(self, urls: Sequence[str]) -> tuple[str, ...]:
        """The URLs to send to for the configured ``urls``: each router replaced by its
        reachable workers (discovering or refreshing it first when due)."""
        if not self._enabled:
            return tuple(urls)
        out: list[str] = []
        for url in urls:
            fleet = self._fleets.get(url)
            if fleet is None:
                fleet = self._fleets[url] = _Fleet()
            due = anyio.current_time() - fleet.checked_at >= self._refresh_s
            if fleet.kind != "server" and due:
                await self._refresh(url, fleet)
            out.extend(fleet.workers or (url,))
        return tuple(dict.fromkeys(out))

    async def _refresh(self, url: str, fleet: _Fleet) -> None:
        if fleet.lock.locked() and fleet.kind == "router":
            return  # another request is refreshing: keep using the current list
        async with fleet.lock:
            if anyio.current_time() - fleet.checked_at < self._refresh_s:
                return  # refreshed while this request waited
            try:
                await self._read(url, fleet)
            finally:
                # set last: a request arriving meanwhile must not take the old state as fresh
                fleet.checked_at = anyio.current_time()
                fleet.refreshes += 1

    async def _read(self, url: str, fleet: _Fleet) -> None:
        listed = await self._list(url)
        if listed is _UNREACHABLE:
            return  # asked again after REFRESH_S; a router's last list stays in use
        if listed is None:  # answered, and not with a worker list
            fleet.kind, fleet.workers, fleet.listed = "server", (), ()
            return
        assert isinstance(listed, list)
        reachable = tuple(await self._reachable(listed))
        if fleet.kind != "router" or reachable != fleet.workers:
            log.info(
                "gateway_workers",
                url=url,
                listed=len(listed),
                reachable=len(reachable),
                direct=bool(reachable),
            )
        fleet.kind = "router"
        fleet.listed = tuple(listed)
        fleet.workers = reachable

    async def _list(self, url: str) -> list[str] | object | None:
        """The gateway's worker list (``/workers``, else ``/v1/rl/workers``); ``None`` when
        the URL answered something else (not a gateway); ``_UNREACHABLE`` when it did not
        answer."""
        for path, parse in (
            ("workers", parse_gateway_workers),
            ("v1/rl/workers", parse_rl_workers),
        ):
            try:
                with anyio.fail_after(_PROBE_TIMEOUT_S):
                    resp = await self._transport.send(
                        Request(url=endpoint_url(url, path), max_bytes=_MAX_BYTES, method="GET")
                    )
            except (OPDStreamError, TimeoutError):
                return _UNREACHABLE
            listed = parse(resp.body) if resp.status == 200 else None
            if listed is not None:
                return listed
        return None

    async def _reachable(self, workers: list[str]) -> list[str]:
        """The workers whose ``/health`` answers 200 from here, in the router's order."""
        ok = [False] * len(workers)

        async def probe(n: int) -> None:
            try:
                with anyio.fail_after(_PROBE_TIMEOUT_S):
                    resp = await self._transport.send(
                        Request(
                            url=endpoint_url(workers[n], "health"),
                            max_bytes=_MAX_BYTES,
                            method="GET",
                        )
                    )
            except (OPDStreamError, TimeoutError):
                return
            ok[n] = resp.status == 200

        async with anyio.create_task_group() as tg:
            for n in range(len(workers)):
                tg.start_soon(probe, n)
        return [w for w, good in zip(workers, ok, strict=True) if good]

    def gateway_of(self, url: str) -> str | None:
        """The configured gateway URL whose workers include ``url`` (a discovered worker),
        else ``None``."""
        for gateway, fleet in self._fleets.items():
            if url in fleet.workers and url != gateway:
                return gateway
        return None

    def snapshot(self) -> dict[str, FleetState]:
        return {
            url: FleetState(
                kind=f.kind,
                direct=bool(f.workers),
                workers=f.workers,
                listed=f.listed,
                refreshes=f.refreshes,
            )
            for url, f in self._fleets.items()
        }
