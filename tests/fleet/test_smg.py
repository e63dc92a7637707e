"""smg 1.13 (SGLang's model gateway, PyPI ``smg``, sglang-router's successor) in front of mock
replicas: discovery of its workers (``GET /workers``, and ``GET /v1/rl/workers`` under
``--enable-rl``), scoring through it with discovery off (per-position ids pass; a batch with
per-item ``logprob_start_len`` is answered 422, so unpatched workers get the blocks as
independent requests), the routing key (``X-SMG-Routing-Key``) keeping a prompt on one
worker under ``--policy manual``, and workers added and removed during a run.

smg runs as ``python -m smg.launch_router`` on 127.0.0.1; the workers are mock SGLang
subprocesses with their info endpoints on (smg registers a worker only after reading its
``/server_info``; the mock's ``model_path`` is a local path, so no model hub is asked).
The set-up step installs smg (``scripts/dev.sh setup``, or the test extra on Linux); a
missing install fails these tests in CI and skips them, with the reason, elsewhere.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import msgspec
import numpy as np
import pytest
from support.config import stream_config
from support.routers import (
    check_scored,
    gateway_api,
    gateway_fleet,
    gateway_samples,
    launch_smg,
    mock_stats,
    mock_workers,
    samples_until_routed,
    score_all,
)
from support.samples import prefix_groups

from opd_stream import OPDStream, Sample, ScoredSample
from opd_stream.fleet._discovery import parse_gateway_workers, parse_rl_workers

K = 3


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, list[str]]]:
    """smg (round robin, RL control plane on) in front of two mock teacher replicas."""
    with gateway_fleet(partial(launch_smg, enable_rl=True), 2) as fleet:
        yield fleet


_cfg = partial(stream_config, top_k=K)


# --- discovery ------------------------------------------------------------------------
def test_both_listings_name_the_workers(gateway: tuple[str, list[str]]) -> None:
    url, workers = gateway
    listed = parse_gateway_workers(gateway_api(url, "GET", "/workers")) or []
    rl_listed = parse_rl_workers(gateway_api(url, "GET", "/v1/rl/workers")) or []
    assert sorted(listed) == sorted(workers)
    assert sorted(rl_listed) == sorted(workers)


async def test_discovery_scores_per_position_on_the_workers_directly(
    gateway: tuple[str, list[str]],
) -> None:
    url, workers = gateway
    before = [s["generate_requests"] for s in await mock_stats(workers)]
    samples = gateway_samples(12, top_k=K, seed=4)
    out, stats = await score_all(_cfg(url), samples)
    check_scored(out, top_k=K)
    fleet = stats.fleets[url]
    assert fleet.kind == "router" and fleet.direct and set(fleet.workers) == set(workers)
    assert url not in stats.endpoints  # nothing went through smg
    for w in workers:
        assert stats.endpoints[w].per_position is True
    assert stats.requests == len(samples)  # one per-position request per sample
    after = [s["generate_requests"] for s in await mock_stats(workers)]
    assert sum(after) - sum(before) == len(samples)


# --- through smg (discovery off) -------------------------------------------------------
async def test_per_position_ids_pass_through_smg_with_discovery_off(
    gateway: tuple[str, list[str]],
) -> None:
    url, _ = gateway
    samples = gateway_samples(10, top_k=K, seed=5)
    out_direct, _ = await score_all(_cfg(url), samples)
    out_smg, stats = await score_all(_cfg(url, gateway_discovery="off"), samples)
    check_scored(out_smg, top_k=K)
    for a, b in zip(out_direct, out_smg, strict=True):
        assert np.array_equal(a.teacher_logprobs, b.teacher_logprobs)
        assert np.array_equal(a.reverse_kl, b.reverse_kl)
    assert stats.fleets == {}
    ep = stats.endpoints[url]
    assert ep.per_position is True  # smg forwards the unknown field
    assert ep.requests == len(samples)


@pytest.mark.parametrize(("pad", "status"), [(0, 422), (1 << 20, 200)])
def test_smg_checks_a_batch_s_logprob_start_len_only_in_bodies_under_1_mib(
    gateway: tuple[str, list[str]], pad: int, status: int
) -> None:
    """A fact of smg 1.13 that docs/deployments.md states: the blocked batch's list-valued
    fields are refused (422) unless the body is over 1 MiB, which it forwards unchecked."""
    url, _ = gateway
    body = {
        "input_ids": [list(range(100, 120)), list(range(100, 115))],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": [10, 12],
        "token_ids_logprob": [[1, 2], [3]],
        "opd_padding": "x" * pad,
    }
    req = urllib.request.Request(
        url + "/generate",
        data=msgspec.json.encode(body),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            got = resp.status
    except urllib.error.HTTPError as exc:
        got = exc.code
    assert got == status


async def test_unpatched_workers_behind_smg_get_the_blocks_as_separate_requests() -> None:
    """smg answers 422 to the blocked batch (list logprob_start_len / list-of-lists
    token_ids_logprob); the blocks then go one by one, with the same values."""
    procs = mock_workers(2, per_position="unpatched")
    try:
        urls = [p.start() for p in procs]
        with launch_smg(urls) as url:
            samples = gateway_samples(8, top_k=K, seed=6)
            out, stats = await score_all(_cfg(url, gateway_discovery="off"), samples)
    finally:
        for p in procs:
            p.kill()
    check_scored(out, top_k=K)
    ep = stats.endpoints[url]
    assert (ep.per_position, ep.blocked_batch) == (False, False)


async def test_the_routing_key_keeps_each_prompt_on_one_worker_under_manual_policy() -> None:
    groups, per_group, prompt, response = 8, 8, 64, 8
    samples = prefix_groups(groups, per_group, prompt, response, seed=9)
    procs = mock_workers(4, prefix_cache_tokens=1 << 20)
    computed: dict[str, int] = {}
    try:
        urls = [p.start() for p in procs]
        with launch_smg(urls, policy="manual") as url:
            for balance in ("prefix", "least-outstanding"):  # with and without the key
                for w in urls:
                    gateway_api(w, "POST", "/flush_cache")
                before = sum(s["computed_tokens"] for s in await mock_stats(urls))
                out, stats = await score_all(
                    stream_config(
                        url,
                        gateway_discovery="off",
                        balance=balance,
                        max_inflight=32,
                    ),
                    samples,
                )
                assert all(isinstance(r, ScoredSample) for r in out)
                after = await mock_stats(urls)
                computed[balance] = sum(s["computed_tokens"] for s in after) - before
                assert stats.endpoints[url].prompt_tokens == len(samples) * (prompt + response)
    finally:
        for p in procs:
            p.kill()
    unique = groups * (prompt + per_group * response)
    # smg pins each key to one worker: each prompt is computed once (a response's first
    # token is recomputed: logprob_start_len = P - 1 caps the reuse)
    assert computed["prefix"] <= 1.1 * unique, computed
    assert computed["prefix"] <= 0.7 * computed["least-outstanding"], computed


# --- workers added and removed during a run ---------------------------------------------
async def _paced(samples: list[Sample], every: float) -> AsyncIterator[Sample]:
    import anyio

    for s in samples:
        yield s
        await anyio.sleep(every)


async def test_a_worker_added_through_smg_gets_requests_during_a_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    from opd_stream.fleet import _discovery

    monkeypatch.setattr(_discovery, "REFRESH_S", 0.3)
    procs = mock_workers(3)
    try:
        urls = [p.start() for p in procs]
        with launch_smg(urls[:2], enable_rl=True) as url:
            pool = gateway_samples(200, top_k=K, seed=7)
            async with OPDStream(_cfg(url)) as stream:
                async with stream.run(
                    samples_until_routed(
                        stream,
                        pool,
                        url,
                        urls[2],
                        lambda: gateway_api(url, "POST", "/workers", {"url": urls[2]}),
                    )
                ) as results:
                    out = sorted([item async for item in results], key=lambda r: r.index)
                stats = stream.stats()
            check_scored(out, top_k=K)
            assert [r.index for r in out] == list(range(len(out)))
            assert urls[2] in stats.fleets[url].workers
            assert (await mock_stats(urls[2:]))[0]["generate_requests"] > 0
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("how", ["removed", "killed"])
async def test_a_worker_removed_or_killed_during_a_run_loses_no_sample(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    from opd_stream.fleet import _discovery

    monkeypatch.setattr(_discovery, "REFRESH_S", 0.3)
    procs = mock_workers(2)
    try:
        urls = [p.start() for p in procs]
        with launch_smg(urls) as url:
            samples = gateway_samples(30, top_k=K, seed=8)
            async with OPDStream(_cfg(url, backoff_initial_s=0.01)) as stream:
                async with stream.run(_paced(samples, 0.05)) as results:
                    out = []
                    async for item in results:
                        out.append(item)
                        if len(out) == 5:
                            if how == "killed":
                                procs[1].kill()
                            else:
                                listing = msgspec.json.decode(gateway_api(url, "GET", "/workers"))
                                wid = next(
                                    w["id"] for w in listing["workers"] if w["url"] == urls[1]
                                )
                                gateway_api(url, "DELETE", f"/workers/{wid}")
                stats = stream.stats()
            out.sort(key=lambda r: r.index)
            assert [r.index for r in out] == list(range(len(samples)))
            check_scored(out, top_k=K)
            if how == "removed":
                assert stats.fleets[url].workers == (urls[0],)
    finally:
        for p in procs:
            p.kill()
