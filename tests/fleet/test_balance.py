"""Teacher fleets: replica choice, passive health (ejection, probe re-admission) and hedging.

The sans-IO rules of ``EndpointPool`` first, then the pipeline against replicas with injected
slowness and failures: in-process replicas (asyncio, and trio on a virtual clock) and real
aiohttp mock servers.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest
from support.config import FAST_BACKOFF, one_pool, stream_config
from support.pipeline_reference import assert_all_scored
from trio.testing import MockClock

from opd_stream import (
    MockTransport,
    OPDStream,
    Response,
    Sample,
    SampleFailure,
    ScoredSample,
)
from opd_stream.fleet._balance import HEDGE_MIN_SAMPLES, EndpointPool
from opd_stream.fleet._endpoints import Endpoints
from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.testing.mock_sglang import MockOptions, serve_mock

A, B, C, D = (f"http://replica-{i}:1" for i in range(4))


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """asyncio on the real clock; trio on a virtual one (latencies, cool-downs and hedge
    delays cost no wall time and are exact)."""
    return request.param


def _slack(backend: str) -> float:
    """Scheduling slack past a deadline: exact on trio's virtual clock, generous on asyncio's
    real one (a busy machine), and still far below the latency of the replicas it cuts."""
    return 0.05 if backend == "trio" else 10.0


# --- sans-IO rules ---------------------------------------------------------------------
class _Loads(Endpoints):
    """Endpoints whose load is read from a dict the test controls."""

    def __init__(self, loads: dict[str, int]) -> None:
        super().__init__()
        self._loads = loads

    def load(self, url: str) -> int:
        return self._loads.get(url, 0)


def _pool(load: dict[str, int] | None = None, **kw: Any) -> EndpointPool:
    loads = load if load is not None else {}
    return EndpointPool(_Loads(loads), rng=random.Random(0), **kw)


def test_least_outstanding_of_two_replicas_always_takes_the_less_loaded() -> None:
    loads = {A: 3, B: 1}
    pool = _pool(loads)
    assert {pool.pick((A, B)) for _ in range(50)} == {B}


def test_power_of_two_choices_never_takes_the_most_loaded_of_four() -> None:
    loads = {A: 0, B: 1, C: 2, D: 9}
    pool = _pool(loads)
    picks = [pool.pick((A, B, C, D)) for _ in range(400)]
    assert D not in picks
    # A wins every draw it is in: 3 of the 6 pairs.
    assert picks.count(A) > 400 * 0.35


def test_round_robin_cycles_through_the_replicas() -> None:
    pool = _pool({A: 5}, balance="round-robin")
    assert [pool.pick((A, B, C)) for _ in range(6)] == [A, B, C, A, B, C]


def test_pick_with_every_replica_excluded_is_none() -> None:
    assert _pool().pick((A, B), exclude=(A, B)) is None
    assert _pool().pick((A, B), exclude=(A,)) == B


def test_consecutive_failures_eject_a_replica_and_a_success_resets_the_count() -> None:
    pool = _pool(eject_after=3, cooldown_s=10)
    urls = (A, B)
    assert not pool.record_failure(A, urls, now=0)
    assert not pool.record_failure(A, urls, now=0)
    pool.record_success(A, urls, 0.01)
    assert not pool.record_failure(A, urls, now=0)
    assert not pool.record_failure(A, urls, now=0)
    assert pool.record_failure(A, urls, now=0)
    assert pool.health(A).ejected and pool.health(A).ejections == 1
    assert {pool.pick(urls) for _ in range(20)} == {B}


def test_a_single_replica_or_eject_after_zero_never_ejects() -> None:
    single = _pool(eject_after=1)
    assert not any(single.record_failure(A, (A,), now=0) for _ in range(5))
    off = _pool(eject_after=0)
    assert not any(off.record_failure(A, (A, B), now=0) for _ in range(5))


def test_when_every_replica_is_ejected_the_choice_fails_open() -> None:
    pool = _pool({A: 2, B: 0}, eject_after=1)
    pool.record_failure(A, (A, B), now=0)
    pool.record_failure(B, (A, B), now=0)
    assert pool.pick((A, B)) == B


def test_probe_is_claimed_once_after_the_cool_down_and_readmits_on_success() -> None:
    pool = _pool(eject_after=1, cooldown_s=5)
    pool.record_failure(A, (A, B), now=100)
    assert pool.claim_probe((A, B), now=104.9) is None
    assert pool.claim_probe((A, B), now=105) == A
    assert pool.claim_probe((A, B), now=106) is None  # already being probed
    assert pool.health(A).ejected
    pool.probe_result(A, healthy=True, now=106)
    assert not pool.health(A).ejected and pool.health(A).readmissions == 1


def test_failed_probe_ejects_for_another_cool_down_and_a_released_claim_can_be_retaken() -> None:
    pool = _pool(eject_after=1, cooldown_s=5)
    pool.record_failure(A, (A, B), now=0)
    assert pool.claim_probe((A, B), now=5) == A
    pool.probe_result(A, healthy=False, now=6)
    assert pool.health(A).ejections == 2
    assert pool.claim_probe((A, B), now=10.9) is None
    assert pool.claim_probe((A, B), now=11) == A
    pool.release_probe(A)
    assert pool.claim_probe((A, B), now=11) == A


def _linear_percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def test_hedge_delay_is_the_latency_percentile_floored_at_the_minimum() -> None:
    pool = _pool()
    urls = (A, B)
    lat = [0.01 * (i + 1) for i in range(HEDGE_MIN_SAMPLES + 4)]
    for x in lat[: HEDGE_MIN_SAMPLES - 1]:
        pool.record_success(A, urls, x)
    assert pool.hedge_delay(urls, 90, 0.0) is None  # not enough latencies yet
    for x in lat[HEDGE_MIN_SAMPLES - 1 :]:
        pool.record_success(B, urls, x)
    got = pool.hedge_delay(urls, 90, 0.0)
    assert got is not None and abs(got - _linear_percentile(lat, 90)) < 1e-12
    assert pool.hedge_delay(urls, 90, 5.0) == 5.0
    assert pool.hedge_delay(urls, 0, 0.0) is None
    assert pool.hedge_delay((A,), 90, 0.0) is None


# --- pipeline, in-process replicas (asyncio and trio) -------------------------------------
def _samples(n: int, *, seed: int = 0, p: int = 5, r: int = 4) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(0, 3000, p + r).tolist(), r, sample_id=i) for i in range(n)]


class _Fleet:
    """In-process teacher replicas (same model) with per-replica latency and 503 faults."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.servers = {u: InProcessSGLang("teacher", 1) for u in urls}
        self.latency = dict.fromkeys(urls, 0.0)
        self.fail = dict.fromkeys(urls, False)
        self.healthy = dict.fromkeys(urls, True)
        self.generate = dict.fromkeys(urls, 0)
        self.health_probes = dict.fromkeys(urls, 0)
        self.cancelled = dict.fromkeys(urls, 0)
        self.transport = MockTransport(self.handle)

    async def handle(self, method: str, url: str, body: bytes) -> Response:
        base = next(b for b in self.servers if url.startswith(b))
        path = url[len(base) :]
        if path == "/health":
            self.health_probes[base] += 1
            return Response(200 if self.healthy[base] else 503, b"")
        if path != "/generate":  # e.g. router discovery's GET /workers
            return self.servers[base].handle(method, path, body)
        self.generate[base] += 1
        try:
            await anyio.sleep(self.latency[base])
        except anyio.get_cancelled_exc_class():
            self.cancelled[base] += 1
            raise
        if self.fail[base]:
            return Response(503, b'{"error": {"message": "overloaded"}}')
        return self.servers[base].handle(method, path, body)


_cfg = partial(stream_config, **FAST_BACKOFF)  # teachers: one_pool(urls)


async def _run(stream: OPDStream, samples: list[Sample]) -> list[ScoredSample | SampleFailure]:
    async with stream.run(samples) as results:
        out = [r async for r in results]
    assert sorted(r.index for r in out) == list(range(len(samples)))
    return out


# on the real clock: a virtual clock's autojump would end the 60 s cool-down (and shape the
# latency race) as soon as the loop idles
@pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {"debug": True}), ("trio", {})], ids=["asyncio", "trio"]
)
async def test_failing_replica_is_ejected_and_every_sample_is_still_scored() -> None:
    urls = (A, B, C, D)
    fleet = _Fleet(urls)
    fleet.fail[A] = True
    cfg = _cfg(one_pool(urls), eject_after_failures=2, eject_cooldown_s=60, max_inflight=4)
    async with OPDStream(cfg, transport=fleet.transport) as stream:
        out = await _run(stream, _samples(40))
        st = stream.stats().endpoints
    assert_all_scored(out, fleet.servers[B].model)
    assert st[A].ejected and st[A].ejections == 1
    assert st[A].errors == fleet.generate[A] == st[A].requests
    # Two failures eject it; requests already on their way when it was ejected may add a few.
    assert fleet.generate[A] <= 2 + cfg.max_inflight
    assert sum(st[u].requests for u in urls) == sum(fleet.generate.values())
    assert all(not st[u].ejected for u in (B, C, D))


async def test_ejected_replica_is_readmitted_only_after_health_answers_200() -> None:
    urls = (A, B)
    fleet = _Fleet(urls)
    fleet.fail[A] = True
    fleet.healthy[A] = False
    cfg = _cfg(one_pool(urls), eject_after_failures=1, eject_cooldown_s=0.05, max_inflight=2)
    async with OPDStream(cfg, transport=fleet.transport) as stream:
        await _run(stream, _samples(6))
        assert stream.stats().endpoints[A].ejected
        fleet.fail[A] = False
        await anyio.sleep(0.06)
        before = fleet.generate[A]
        await _run(stream, _samples(6, seed=1))
        st = stream.stats().endpoints[A]
        probes = fleet.health_probes[A]
        assert probes >= 1  # at most one per cool-down, each answered 503
        assert st.ejected and st.ejections == 1 + probes and st.readmissions == 0
        assert fleet.generate[A] == before  # never used while ejected
        fleet.healthy[A] = True
        await anyio.sleep(0.06)
        out = await _run(stream, _samples(20, seed=2))
        st = stream.stats().endpoints[A]
    assert fleet.health_probes[A] == probes + 1
    assert not st.ejected and st.readmissions == 1
    assert fleet.generate[A] > before  # back in the rotation
    assert_all_scored(out, fleet.servers[B].model)


async def _warm_up(stream: OPDStream) -> None:
    out = await _run(stream, _samples(HEDGE_MIN_SAMPLES + 4, seed=9))
    assert all(isinstance(r, ScoredSample) for r in out)


# on the real clock: a virtual clock's autojump would end the 60 s cool-down (and shape the
# latency race) as soon as the loop idles. The slow replica never answers within the test's
# limit (a run that waited for it would fail), and the fast ones may be hedged too when a busy
# machine delays them past the hedge delay: what is asserted holds either way.
@pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {"debug": True}), ("trio", {})], ids=["asyncio", "trio"]
)
async def test_slow_replica_is_hedged_and_the_losing_request_is_cancelled() -> None:
    urls = (A, B, C, D)
    fleet = _Fleet(urls)
    for u in urls:
        fleet.latency[u] = 0.002
    cfg = _cfg(one_pool(urls), hedge_after_percentile=50, hedge_min_s=0.02, max_inflight=4)
    async with OPDStream(cfg, transport=fleet.transport) as stream:
        await _warm_up(stream)
        fleet.latency[D] = 3600.0
        warm = stream.stats().endpoints
        sent_to_d, cancelled_on_d = fleet.generate[D], fleet.cancelled[D]
        with anyio.fail_after(60):  # not one request waits for the slow replica
            out = await _run(stream, _samples(30))
        st = stream.stats().endpoints
    assert_all_scored(out, fleet.servers[A].model)
    hedged = [r for r in out if isinstance(r, ScoredSample) and r.attempts == 2]
    assert all(isinstance(r, ScoredSample) and r.attempts in (1, 2) for r in out)
    hedges = sum(st[u].hedges - warm[u].hedges for u in urls)
    wins = sum(st[u].hedge_wins - warm[u].hedge_wins for u in urls)
    assert hedges == len(hedged)  # a hedge is one more attempt of its sample
    # every request the slow replica got lost its race and was cancelled; each one it got
    # first (not as a hedge) was won by its hedge
    to_d = fleet.generate[D] - sent_to_d
    first_to_d = to_d - (st[D].hedges - warm[D].hedges)
    assert fleet.cancelled[D] - cancelled_on_d == st[D].cancelled - warm[D].cancelled == to_d
    assert first_to_d > 0
    assert first_to_d <= wins <= hedges


async def test_hedging_never_runs_past_the_deadline(anyio_backend_name: str) -> None:
    urls = (A, B)
    fleet = _Fleet(urls)
    for u in urls:
        fleet.latency[u] = 0.001
    cfg = _cfg(
        one_pool(urls),
        hedge_after_percentile=50,
        hedge_min_s=0.01,
        request_deadline_s=0.3,
        max_inflight=2,
    )
    async with OPDStream(cfg, transport=fleet.transport) as stream:
        await _warm_up(stream)
        fleet.latency[A] = fleet.latency[B] = 60.0
        cancelled_before = fleet.cancelled[A] + fleet.cancelled[B]
        start = anyio.current_time()
        out = await _run(stream, _samples(2))
        elapsed = anyio.current_time() - start
    assert all(isinstance(r, SampleFailure) and r.reason == "deadline_exceeded" for r in out)
    assert all(r.attempts == 2 for r in out)  # the hedge counts as an attempt
    # exact on the virtual clock; on the real one, far from the 60 s a request would take
    assert 0.3 - 1e-9 <= elapsed <= 0.3 + _slack(anyio_backend_name)
    assert fleet.cancelled[A] + fleet.cancelled[B] - cancelled_before == 4


async def test_no_hedge_is_sent_when_max_attempts_leaves_no_room() -> None:
    urls = (A, B)
    fleet = _Fleet(urls)
    cfg = _cfg(one_pool(urls), hedge_after_percentile=50, hedge_min_s=0.01, max_attempts=1)
    async with OPDStream(cfg, transport=fleet.transport) as stream:
        await _warm_up(stream)
        fleet.latency[A] = fleet.latency[B] = 0.05
        out = await _run(stream, _samples(4))
        st = stream.stats().endpoints
    assert all(isinstance(r, ScoredSample) and r.attempts == 1 for r in out)
    assert st[A].hedges == st[B].hedges == 0


@pytest.mark.parametrize(
    "anyio_backend",
    [("trio", {"clock": MockClock(autojump_threshold=0)})],
    ids=["trio-mockclock"],
)
async def test_least_outstanding_sends_less_work_to_a_slow_replica_than_round_robin() -> None:
    counts: dict[str, int] = {}
    n = 64
    urls = (A, B, C, D)
    for balance in ("round-robin", "least-outstanding"):
        fleet = _Fleet(urls)
        for u in urls:
            fleet.latency[u] = 0.01
        fleet.latency[D] = 1.0  # 100 times slower: free on the virtual clock
        cfg = _cfg(one_pool(urls), balance=balance, max_inflight=12)
        async with OPDStream(cfg, transport=fleet.transport) as stream:
            out = await _run(stream, _samples(n))
            st = stream.stats().endpoints
        assert_all_scored(out, fleet.servers[A].model)
        counts[balance] = fleet.generate[D]
        assert st[D].requests == counts[balance]
    assert counts["round-robin"] == n // 4
    # 4 to 6 of 64 on a quiet machine (first picks among idle replicas included); a choice
    # blind to load gives it 16, a quarter. The virtual clock jumps whenever every task
    # waits, for a decode or KL thread too, and each such jump can end one of the slow
    # replica's requests early (it then looks less loaded): a busy machine, whose threads
    # take longer, saw 10. So the claim asserted is the one that holds whatever the
    # threads take: fewer than round-robin, by a clear margin.
    assert counts["least-outstanding"] <= 0.75 * counts["round-robin"]


# --- pipeline over real HTTP: aiohttp mock replicas ---------------------------------------
async def _until(predicate: Any, limit_s: float = 30.0) -> None:
    """Poll ``predicate`` (the mock's counters have no events to wait on)."""
    with anyio.fail_after(limit_s):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.01)


# The slow replica is 100 times slower than the others: a busy machine that delays every
# request by a few tenths of a second still leaves it far the slowest.
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"debug": True})])
async def test_balancing_sends_less_work_to_a_slow_replica_than_round_robin() -> None:
    counts: dict[str, int] = {}
    n = 64
    async with serve_mock(
        "teacher", 3, replicas=4, options=MockOptions(latency_fixed_s=0.01)
    ) as fleet:
        fleet.set_options(3, latency_fixed_s=1.0)
        for balance in ("round-robin", "least-outstanding"):
            before = fleet.stats[3].generate_requests
            cfg = _cfg(one_pool(fleet.urls), balance=balance, max_inflight=12)
            async with OPDStream(cfg) as stream:
                out = await _run(stream, _samples(n))
                st = stream.stats().endpoints
            assert_all_scored(out, fleet.model)
            counts[balance] = fleet.stats[3].generate_requests - before
            assert st[fleet.urls[3]].requests == counts[balance]
    assert counts["round-robin"] == n // 4
    assert counts["least-outstanding"] < 0.75 * counts["round-robin"]


# The slow replica takes a minute: a run that waited for it fails its 30 s limit.
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"debug": True})])
async def test_hedged_loser_over_http_is_disconnected_and_a_stopped_replica_is_ejected() -> None:
    async with serve_mock("teacher", 4, replicas=3) as fleet:
        urls = tuple(fleet.urls)
        cfg = _cfg(
            one_pool(urls),
            hedge_after_percentile=50,
            hedge_min_s=0.03,
            eject_after_failures=1,
            eject_cooldown_s=600,
            max_inflight=3,
        )
        async with OPDStream(cfg) as stream:
            await _warm_up(stream)
            warm = stream.stats().endpoints
            disconnects, received = fleet.stats[1].disconnects, fleet.stats[1].generate_requests
            fleet.set_options(1, latency_fixed_s=60.0)
            await fleet.stop(2)
            with anyio.fail_after(30):
                out = await _run(stream, _samples(12))
            st = stream.stats().endpoints
        assert_all_scored(out, fleet.model)
        assert st[urls[2]].ejected and st[urls[2]].ejections == 1
        assert st[urls[1]].cancelled > warm[urls[1]].cancelled

        # every request the slow server got went away unanswered (the hedge won, the loser
        # was cancelled): the server sees each one disconnect, and none is left in it
        def slow_replica_let_go() -> bool:
            slow = fleet.stats[1]
            gone = slow.disconnects - disconnects
            return gone == slow.generate_requests - received > 0 and slow.in_flight == 0

        await _until(slow_replica_let_go)
