"""The fleet's records: what ``OPDStream.stats()`` reports of each server URL
(:class:`EndpointStats`, its counters :class:`EndpointTraffic`) and of each configured URL
behind which a gateway may stand (:class:`FleetState`). Plain msgspec structs."""

from __future__ import annotations

from typing import Literal

import msgspec

from ..wire._request import Engine

__all__ = ("EndpointStats", "EndpointTraffic", "FleetState", "Kind")

#: What a configured server URL turned out to be (see :class:`FleetState`).
Kind = Literal["unknown", "server", "router"]


class EndpointTraffic(msgspec.Struct, kw_only=True):
    """The traffic counters of one server URL, declared once: an
    :class:`~opd_stream.fleet._endpoints.Endpoint` counts in one, and :class:`EndpointStats`
    (which has the same fields) carries a copy.

    Attributes:
        requests: HTTP requests sent, hedges included.
        errors: attempts that failed (any error).
        hedges: duplicate requests sent to this URL because another replica was slow.
        hedge_wins: those duplicates that answered first.
        cancelled: attempts to this URL cancelled because a hedged twin answered first.
        prompt_tokens: input tokens of the scoring requests this URL answered (every item
            of a batch; a prefix sent again counts again).
        cached_tokens: of those, what the server reported it served from its prefix cache
            (``meta_info.cached_tokens``; SGLang reuses a prefix only on the replica that
            computed it, and a logprob request at most up to its ``logprob_start_len``).
            ``prompt_tokens - cached_tokens`` is what the server computed.
    """

    requests: int = 0
    errors: int = 0
    hedges: int = 0
    hedge_wins: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


# msgspec makes the inherited fields read-only too; mypy applies the dataclass rule instead.
class EndpointStats(EndpointTraffic, frozen=True, kw_only=True):  # type: ignore[misc]
    """One server URL: requests in flight now, totals, detected capabilities, and the
    replica bookkeeping of client-side balancing.

    The totals (``requests``, ``errors``, ``hedges``, ``hedge_wins``, ``cancelled``,
    ``prompt_tokens``, ``cached_tokens``) are the fields of :class:`EndpointTraffic`.

    Attributes:
        in_flight: HTTP requests to this URL in flight now (its load).
        per_position, b64_topk: detected capabilities (``None``: not yet known).
        blocked_batch: the blocked id form's batch (per-item ``logprob_start_len``) is
            accepted; ``False`` behind sglang-router 0.3.2, which answers 422.
        engine: the dialect it is spoken to in (``"sglang"``, ``"vllm"``,
            ``"vllm-completions"``: configured, or detected under ``engine="auto"``);
            ``None`` while not known (spoken to as SGLang until its ``/generate`` says no).
        ejected: out of the rotation now (passive health).
        ejections: times it was ejected (a failed re-admission probe counts again).
        readmissions: times a ``/health`` probe re-admitted it.
        routed_workers: behind a gateway that names the worker it routed to (smg's
            ``x-smg-routed-worker-id``): ``(worker id, answers)`` pairs, most answers
            first (``dict(...)`` reads them by worker).
    """

    in_flight: int
    per_position: bool | None
    b64_topk: bool | None
    blocked_batch: bool | None = None
    engine: Engine | None = None
    ejected: bool = False
    ejections: int = 0
    readmissions: int = 0
    routed_workers: tuple[tuple[str, int], ...] = ()


class FleetState(msgspec.Struct, frozen=True, kw_only=True):
    """What one configured URL turned out to be (``stats().fleets``).

    Attributes:
        kind: ``router`` (an sglang-router), ``server`` (anything else: a server, or a
            proxy without a worker list), or ``unknown`` (not asked yet, or unreachable).
        direct: requests go straight to ``workers`` (False: through the URL itself).
        workers: the router's healthy workers reachable from here, in use when ``direct``.
        listed: the router's healthy workers as it listed them (reachable or not).
        refreshes: how many times the list was read.
    """

    kind: Kind
    direct: bool
    workers: tuple[str, ...]
    listed: tuple[str, ...]
    refreshes: int
