"""sglang-router 0.3.2 (SGLang's Rust load balancer, PyPI ``sglang-router``) in front of mock
replicas: scoring through it in sampled-token and top-k modes, and detection of the fields
it drops (``token_ids_logprob_positions``) or rejects (a batch with per-item
``logprob_start_len``, HTTP 422) with the ``auto`` fallback.

The router runs as ``python -m sglang_router.launch_router`` on 127.0.0.1 with
``--policy round_robin``; the workers are mock SGLang subprocesses. Their info endpoints are
off (404), so the router registers them as model "unknown" and never looks for a tokenizer
on a model hub: nothing leaves 127.0.0.1. The set-up step installs the router
(``scripts/dev.sh setup``, or the test extra on Linux); a missing install fails these tests
in CI and skips them, with the reason, on a machine without the tool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
from support.config import stream_config
from support.routers import (
    check_scored,
    gateway_api,
    gateway_fleet,
    gateway_samples,
    generate_counts,
    launch_sglang_router,
    mock_workers,
    samples_until_routed,
    score_all,
)

from opd_stream import OPDStream, Sample, SampleFailure
from opd_stream.testing.mock_sglang import MockProcess

K = 3


@pytest.fixture(autouse=True)
def _patient_health_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker counts as reachable when its ``/health`` answers within 2 s; a busy machine
    can keep a live worker subprocess from answering that fast, and the fleet would then
    list only the others (seen: the one a test then kills, so a sample's every attempt went
    to it). A dead worker refuses at once, so a long limit costs nothing here."""
    from opd_stream.fleet import _discovery

    monkeypatch.setattr(_discovery, "_PROBE_TIMEOUT_S", 30.0)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[str, list[str]]]:
    """A router on 127.0.0.1 in front of two mock teacher replicas: (router URL, workers)."""
    with gateway_fleet(launch_sglang_router, 2, info_endpoints=False) as fleet:
        yield fleet


async def test_sampled_token_scoring_through_the_router_reaches_both_replicas(
    router: tuple[str, list[str]],
) -> None:
    url, workers = router
    before = await generate_counts(workers)
    cfg = stream_config(url, gateway_discovery="off")
    out, _ = await score_all(cfg, gateway_samples(10, top_k=0))
    check_scored(out, top_k=0)
    after = await generate_counts(workers)
    assert [a - b for a, b in zip(after, before, strict=True)] == [5, 5]  # round robin


async def test_per_position_dropped_by_the_router_is_detected_and_falls_back_under_auto(
    router: tuple[str, list[str]],
) -> None:
    url, _ = router
    cfg = stream_config(url, top_k=K, id_scoring="auto", gateway_discovery="off")
    samples = gateway_samples(8, top_k=K, seed=1)
    out, stats = await score_all(cfg, samples)
    check_scored(out, top_k=K)
    ep = stats.endpoints[url]
    assert ep.per_position is False
    # The router also rejects the blocked form's batch (per-item logprob_start_len): 422,
    # after which the same blocks go as independent single requests (never the flat union).
    assert ep.blocked_batch is False
    assert stats.failed == 0
    # later samples: one request per block (auto block size >= 1 row each)
    assert stats.requests > len(samples) + 2


async def test_top_k_intersection_through_the_router_matches_the_reference(
    router: tuple[str, list[str]],
) -> None:
    url, _ = router
    cfg = stream_config(
        url,
        top_k=K,
        strategy="intersection",
        gateway_discovery="off",
    )
    out, stats = await score_all(cfg, gateway_samples(8, top_k=K, seed=2))
    check_scored(out, top_k=K, strategy="intersection")
    assert stats.endpoints[url].b64_topk is not None


async def test_strict_per_position_through_the_router_fails_loudly(
    router: tuple[str, list[str]],
) -> None:
    url, _ = router
    cfg = stream_config(
        url,
        top_k=K,
        id_scoring="per-position",
        gateway_discovery="off",
    )
    out, _ = await score_all(cfg, gateway_samples(2, top_k=K, seed=3))
    assert all(isinstance(r, SampleFailure) and r.reason == "capability" for r in out)


# --- router discovery: the workers, addressed directly --------------------------------


def _listed(url: str) -> set[str]:
    return {w["url"] for w in msgspec.json.decode(gateway_api(url, "GET", "/workers"))["workers"]}


async def _slowly(samples: list[Sample], every: float) -> AsyncIterator[Sample]:
    import anyio

    for s in samples:
        yield s
        await anyio.sleep(every)


async def test_discovery_scores_per_position_on_the_workers_directly(
    router: tuple[str, list[str]],
) -> None:
    url, workers = router
    before = await generate_counts(workers)
    cfg = stream_config(url, top_k=K, topk_wire="auto")
    samples = gateway_samples(12, top_k=K, seed=4)
    out, stats = await score_all(cfg, samples)
    check_scored(out, top_k=K)
    fleet = stats.fleets[url]
    assert fleet.kind == "router" and fleet.direct
    assert set(fleet.workers) == set(workers)
    assert url not in stats.endpoints  # nothing went through the router
    for w in workers:
        assert stats.endpoints[w].per_position is True  # the field reached the workers
    after = await generate_counts(workers)
    assert all(a > b for a, b in zip(after, before, strict=True))  # both used
    assert stats.requests == len(samples)  # one per-position request per sample


async def test_discovery_off_sends_blocks_through_the_router_with_the_same_values(
    router: tuple[str, list[str]],
) -> None:
    url, _ = router
    samples = gateway_samples(10, top_k=K, seed=5)
    direct = stream_config(url, top_k=K)
    through = stream_config(url, top_k=K, gateway_discovery="off")
    out_direct, _ = await score_all(direct, samples)
    out_router, stats = await score_all(through, samples)
    check_scored(out_router, top_k=K)
    for a, b in zip(out_direct, out_router, strict=True):
        assert np.array_equal(a.teacher_logprobs, b.teacher_logprobs)
        assert np.array_equal(a.reverse_kl, b.reverse_kl)
    assert stats.fleets == {}  # never asked
    assert stats.endpoints[url].blocked_batch is False


async def test_a_worker_added_through_the_router_gets_requests_during_a_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opd_stream.fleet import _discovery

    monkeypatch.setattr(_discovery, "REFRESH_S", 0.3)
    procs = mock_workers(3, info_endpoints=False)
    try:
        urls = [p.start() for p in procs]
        with launch_sglang_router(urls[:2]) as url:
            cfg = stream_config(url, top_k=K)
            pool = gateway_samples(200, top_k=K, seed=6)
            async with OPDStream(cfg) as stream:
                async with stream.run(
                    samples_until_routed(
                        stream,
                        pool,
                        url,
                        urls[2],
                        lambda: msgspec.json.decode(
                            gateway_api(url, "POST", "/workers", {"url": urls[2]})
                        ),
                    )
                ) as results:
                    out = [item async for item in results]
                stats = stream.stats()
            out.sort(key=lambda r: r.index)
            check_scored(out, top_k=K)
            assert urls[2] in stats.fleets[url].workers
            assert (await generate_counts(urls[2:]))[0] > 0
    finally:
        for p in procs:
            p.kill()


def _take_away(how: str, proc: MockProcess, url: str) -> None:
    """Kill the worker, or remove it from the router at ``url``."""
    if how == "killed":
        proc.kill()
        return
    listing = msgspec.json.decode(gateway_api(url, "GET", "/workers"))["workers"]
    wid = next(w["id"] for w in listing if w["url"] == proc.url)
    msgspec.json.decode(gateway_api(url, "DELETE", f"/workers/{wid}"))


@pytest.mark.parametrize("how", ["removed", "killed"])
async def test_a_worker_removed_or_killed_during_a_run_loses_no_sample(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    from opd_stream.fleet import _discovery

    monkeypatch.setattr(_discovery, "REFRESH_S", 0.3)
    procs = mock_workers(2, info_endpoints=False)
    try:
        urls = [p.start() for p in procs]
        with launch_sglang_router(urls) as url:
            cfg = stream_config(url, top_k=K, backoff_initial_s=0.01)
            samples = gateway_samples(30, top_k=K, seed=7)
            async with OPDStream(cfg) as stream:
                async with stream.run(_slowly(samples, 0.05)) as results:
                    out = []
                    async for item in results:
                        out.append(item)
                        if len(out) == 5:  # off the loop: killing reaps, the API blocks
                            await anyio.to_thread.run_sync(_take_away, how, procs[1], url)
                stats = stream.stats()
            out.sort(key=lambda r: r.index)
            assert [r.index for r in out] == list(range(len(samples)))
            check_scored(out, top_k=K)
            if how == "removed":
                assert stats.fleets[url].workers == (urls[0],)
    finally:
        for p in procs:
            p.kill()
