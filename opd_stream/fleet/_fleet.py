"""The :class:`Fleet`: the servers one stream talks to, and all it knows of them.

Built by the stream (``_stream``) from its settings and its transport, once per entry, and
handed to whoever asks the servers: the fetch stage (``fetch/``), the probe, ``stats()``.
It is the one place that knows which dialect (engine) each server speaks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Literal

from ..transport._transports import Transport
from ..wire._request import Engine, IdForm
from ._balance import Balance, EndpointPool
from ._capabilities import Capabilities
from ._discovery import FleetDirectory
from ._endpoints import Endpoints
from ._engines import EngineDirectory, EngineSetting
from ._records import EndpointStats, FleetState

__all__ = ("Fleet",)


class Fleet:
    """Every server URL of one stream: its state (load, health, capabilities, engine:
    :attr:`endpoints`), which replica gets the next request (:attr:`pool`), what each URL
    supports (:attr:`capabilities`), the workers behind each gateway (:attr:`gateways`),
    and which engine each speaks (:attr:`engines`: configured, or detected once).

    The keywords are the stream's settings of the same names (``StreamConfig``):
    ``balance``, ``balance_load_factor``, ``max_inflight_per_endpoint`` (``limit``),
    ``eject_after_failures``, ``eject_cooldown_s``, ``unreachable_after_s``,
    ``id_scoring``, ``topk_wire``, ``gateway_discovery == "auto"`` (``discovery``),
    ``engine``, ``server_engines``, ``vllm_max_logprobs`` and the ``api_key``'s value
    (``secret``: kept out of the messages quoted from a server).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        balance: Balance,
        load_factor: float,
        limit: int,
        eject_after: int,
        cooldown_s: float,
        unreachable_after_s: float,
        id_scoring: IdForm | Literal["auto"],
        topk_wire: Literal["b64", "json", "auto"],
        discovery: bool,
        engine: EngineSetting,
        server_engines: Mapping[str, Engine],
        max_logprobs: int,
        secret: str | None,
        rng: random.Random | None = None,
    ) -> None:
        self.endpoints = Endpoints()
        self.pool = EndpointPool(
            self.endpoints,
            balance=balance,
            load_factor=load_factor,
            limit=limit,
            eject_after=eject_after,
            cooldown_s=cooldown_s,
            unreachable_after_s=unreachable_after_s,
            rng=rng,
        )
        self.capabilities = Capabilities(self.endpoints, id_scoring=id_scoring, topk_wire=topk_wire)
        self.gateways = FleetDirectory(transport, enabled=discovery)
        self.engines = EngineDirectory(
            self.endpoints,
            transport,
            setting=engine,
            server_engines=server_engines,
            max_logprobs=max_logprobs,
            secret=secret,
            gateway_of=self.gateways.gateway_of,
        )

    async def expand(self, urls: Sequence[str]) -> tuple[str, ...]:
        """The replicas behind ``urls``: each gateway's workers, where they are reachable
        (:meth:`FleetDirectory.expand`), else the URLs themselves."""
        return await self.gateways.expand(urls)

    def engine(self, url: str) -> Engine:
        """The engine to speak to ``url`` now (:meth:`EngineDirectory.engine`)."""
        return self.engines.engine(url)

    def eject_for_good(self, url: str) -> None:
        """Take replica ``url`` out of the rotation for the stream's life (the probe found
        its numbers off, which a ``/health`` probe cannot re-admit: its cool-down never
        ends). If every replica of a teacher is out, the choice still fails open."""
        state = self.pool.health(url)
        if state.ejected_until != math.inf:
            state.ejections += 1
        state.ejected_until = math.inf

    def endpoint_stats(self) -> dict[str, EndpointStats]:
        """Each server URL asked so far (``stats().endpoints``)."""
        return self.endpoints.snapshot()

    def gateway_stats(self) -> dict[str, FleetState]:
        """Each configured URL asked so far: a gateway or a server (``stats().fleets``)."""
        return self.gateways.snapshot()
