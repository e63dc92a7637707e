"""Router discovery (``gateway_discovery``): reading sglang-router's worker list, and what a
configured URL expands to (the real router is in test_sglang_router.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from support.config import stream_config
from trio.testing import MockClock

from opd_stream import ConnectionFailed, MockTransport, OPDStream, Response, Sample
from opd_stream.fleet._discovery import FleetDirectory, parse_gateway_workers, parse_rl_workers
from opd_stream.testing import capture_events
from opd_stream.testing.inprocess import InProcessSGLang

R = "http://router:1"
W1, W2 = "http://w1:2", "http://w2:3"


def _listing(*workers: dict[str, Any]) -> bytes:
    return msgspec.json.encode({"workers": list(workers), "total": len(workers)})


def _w(url: str, **kw: Any) -> dict[str, Any]:
    return {"id": url, "url": url, "is_healthy": True, "worker_type": "regular", **kw}


def test_the_healthy_regular_workers_are_listed_normalised() -> None:
    body = _listing(_w("http://W1:2/"), _w(W2, is_healthy=False), _w("http://w3:4/generate"))
    assert parse_gateway_workers(body) == ["http://w1:2", "http://w3:4"]


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'{"detail": "Not Found"}',
        b"[1, 2]",
        _listing(_w(W1), _w(W2, worker_type="prefill")),
        _listing(_w("ftp://w1:2")),
        _listing(_w("http://user:pw@w1:2")),
    ],
    ids=["not-json", "no-workers", "array", "disaggregated", "bad-scheme", "credentials"],
)
def test_anything_else_is_not_a_worker_list(body: bytes) -> None:
    assert parse_gateway_workers(body) is None


class _Net:
    """A router at ``R`` with workers W1 and W2; ``reachable`` says which answer from here."""

    def __init__(self) -> None:
        self.workers = [W1, W2]
        self.reachable = {W1, W2}
        self.router = InProcessSGLang("teacher", 1)
        self.servers = {W1: InProcessSGLang("teacher", 1), W2: InProcessSGLang("teacher", 1)}
        self.gets = 0

    def handle(self, method: str, url: str, body: bytes) -> Response:
        base = next(b for b in (R, W1, W2) if url.startswith(b))
        path = url[len(base) :]
        if base == R and path == "/workers":
            self.gets += 1
            return Response(200, _listing(*(_w(w) for w in self.workers)))
        if base == R:
            return self.router.handle(method, path, body)
        if base not in self.reachable:
            raise ConnectionFailed("connection refused", url=url)
        return self.servers[base].handle(method, path, body)


async def test_a_router_expands_to_its_reachable_workers_and_a_server_to_itself() -> None:
    net = _Net()
    net.reachable = {W2}
    fleets = FleetDirectory(MockTransport(net.handle, gateways=True), enabled=True)
    assert await fleets.expand([R, W2, W1]) == (W2, W1)  # W2 once
    state = fleets.snapshot()
    assert state[R].kind == "router" and state[R].direct and state[R].workers == (W2,)
    assert state[R].listed == (W1, W2)
    assert state[W2].kind == "server" and not state[W2].direct  # answered, not a router
    assert state[W1].kind == "unknown"  # did not answer: asked again after REFRESH_S


async def test_a_gateways_workers_are_logged_once_as_gateway_workers() -> None:
    net = _Net()
    net.reachable = {W2}
    fleets = FleetDirectory(MockTransport(net.handle, gateways=True), enabled=True)
    with capture_events() as events:
        await fleets.expand([R])
    said = [e for e in events if "listed" in e]
    assert said == [
        {
            "event": "gateway_workers",
            "url": R,
            "listed": 2,
            "reachable": 1,
            "direct": True,
            "log_level": "info",
        }
    ]


async def test_unreachable_workers_mean_through_the_router() -> None:
    net = _Net()
    net.reachable = set()
    fleets = FleetDirectory(MockTransport(net.handle, gateways=True), enabled=True)
    assert await fleets.expand([R]) == (R,)
    assert fleets.snapshot()[R].direct is False


# on a virtual clock: "still fresh" cannot be outrun by a busy machine, and the wait is free
@pytest.mark.parametrize(
    "anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})], ids=["trio-mockclock"]
)
async def test_the_list_is_read_again_after_the_refresh_period() -> None:
    import anyio

    from opd_stream.fleet._discovery import REFRESH_S

    net = _Net()
    fleets = FleetDirectory(MockTransport(net.handle, gateways=True), enabled=True)
    assert await fleets.expand([R]) == (W1, W2)
    net.workers = [W2]
    await anyio.sleep(REFRESH_S * 0.99)
    assert await fleets.expand([R]) == (W1, W2)  # still fresh: not asked again
    assert net.gets == 1
    await anyio.sleep(REFRESH_S * 0.02)
    assert await fleets.expand([R]) == (W2,)
    assert net.gets == 2


async def test_off_never_asks() -> None:
    net = _Net()
    fleets = FleetDirectory(MockTransport(net.handle, gateways=True), enabled=False)
    assert await fleets.expand([R]) == (R,)
    assert net.gets == 0 and fleets.snapshot() == {}


async def test_a_stream_scores_on_the_workers_and_says_so_in_its_stats() -> None:
    net = _Net()
    cfg = stream_config(R)
    samples = [Sample([1, 2, 3, 4 + i], 2, rollout_logprobs=[-1.0, -1.0]) for i in range(8)]
    async with OPDStream(cfg, transport=MockTransport(net.handle, gateways=True)) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
        stats = stream.stats()
    assert len(out) == 8 and all(not hasattr(r, "reason") for r in out)
    assert net.router.requests == 0
    assert net.servers[W1].requests + net.servers[W2].requests == 8
    assert stats.fleets[R].kind == "router" and stats.fleets[R].workers == (W1, W2)


# --- smg's RL control plane (GET /v1/rl/workers, smg --enable-rl) --------------------------
def _rl(*workers: dict[str, Any]) -> bytes:
    return msgspec.json.encode({"protocol_version": 1, "workers": list(workers)})


def _rw(url: str, **kw: Any) -> dict[str, Any]:
    return {"id": url, "url": url, "health": "ready", "weight_version": None, **kw}


def test_smg_rl_listing_gives_its_ready_regular_workers() -> None:
    body = _rl(_rw("http://W1:2/"), _rw(W2, health="unhealthy"), _rw("http://w3:4", role=None))
    assert parse_rl_workers(body) == ["http://w1:2", "http://w3:4"]
    assert parse_rl_workers(_rl(_rw(W1, worker_type="regular"))) == [W1]


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"detail": "Not Found"}', _rl(_rw(W1), _rw(W2, worker_type="decode"))],
    ids=["not-json", "no-workers", "disaggregated"],
)
def test_anything_else_is_not_an_rl_worker_list(body: bytes) -> None:
    assert parse_rl_workers(body) is None


async def test_a_gateway_without_workers_listing_is_read_from_its_rl_control_plane() -> None:
    net = _Net()

    def handle(method: str, url: str, body: bytes) -> Response:
        if url == R + "/workers":
            net.gets += 1
            return Response(401, b"")  # e.g. an admin key on the management API
        if url == R + "/v1/rl/workers":
            return Response(200, _rl(*(_rw(w) for w in net.workers)))
        return net.handle(method, url, body)

    fleets = FleetDirectory(MockTransport(handle, gateways=True), enabled=True)
    assert await fleets.expand([R]) == (W1, W2)
    assert net.gets == 1 and fleets.snapshot()[R].kind == "router"
