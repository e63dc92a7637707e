"""Behind routers: every request under the ``prefix`` balance carries its
prompt's leading ids as ``X-SMG-Routing-Tokens`` (<= 512 ids, <= 4096 bytes, comma-separated
decimal) besides ``X-SMG-Routing-Key``; the worker a gateway names in
``x-smg-routed-worker-id`` is counted per worker in ``stats()``; a 429/503's ``Retry-After``
is waited for before the retry (never past the request's deadline). Through the real smg
1.13.0: the worker it names is counted.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest
from support.config import FAST_BACKOFF, stream_config

from opd_stream import MockTransport, OPDStream, Response, Sample, SampleFailure, ScoredSample
from opd_stream.fetch._retry import RetryPolicy, retry_after_s
from opd_stream.fleet._balance import ROUTING_TOKENS_HEADER, routing_tokens
from opd_stream.testing.inprocess import InProcessSGLang

T = "http://teacher:1"
P, R = 20, 4


# --- the routing tokens ------------------------------------------------------------------
def test_routing_tokens_are_the_prompts_leading_ids_as_decimal() -> None:
    assert routing_tokens(np.array([5, 70, 123456], dtype=np.int64)) == "5,70,123456"
    assert routing_tokens(np.array([], dtype=np.int64)) == ""
    long = np.arange(1000, 2000, dtype=np.int64)
    assert routing_tokens(long).split(",") == [str(i) for i in range(1000, 1512)]  # 512 ids


def test_routing_tokens_stop_at_4096_bytes_on_an_id_boundary() -> None:
    ids = np.full(512, 1234567, dtype=np.int64)  # 8 bytes each with its comma
    text = routing_tokens(ids)
    assert len(text) == 512 * 8 - 1 and text.split(",") == ["1234567"] * 512
    big = np.full(512, 123456789, dtype=np.int64)  # 10 bytes each: 409 fit
    cut = routing_tokens(big)
    assert len(cut) <= 4096 and cut.split(",") == ["123456789"] * 409


class _Recorder:
    """An in-process teacher that records each POST's headers, and may answer with
    headers of its own (``extra``) or fail first (``fail``: statuses, one per request)."""

    def __init__(self, extra: dict[str, str] | None = None, fail: list[int] | None = None):
        self.server = InProcessSGLang("teacher", 1)
        self.extra = extra
        self.fail = list(fail or [])
        self.times: list[float] = []
        self.headers: list[dict[str, str]] = []
        self.transport = MockTransport(self.handle)

    def handle(self, method: str, url: str, body: bytes) -> Response:
        if method == "POST":
            self.times.append(anyio.current_time())
            self.headers.append(dict(self.transport.last_headers or {}))
            if self.fail:
                status = self.fail.pop(0)
                return Response(status, b'{"error": {"message": "busy"}}', self.extra)
        resp = self.server.handle(method, url[len(T) :], body)
        return Response(resp.status, resp.body, self.extra)


async def _score(
    cfg: Any, transport: MockTransport, samples: list[Sample]
) -> tuple[list[Any], Any]:
    async with OPDStream(cfg, transport=transport) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
        return out, stream.stats()


def _sample(seed: int, teacher_prompt: list[int] | None = None) -> Sample:
    tokens = np.random.default_rng(seed).integers(0, 3000, P + R).tolist()
    return Sample(tokens, R, teacher_prompt_ids=teacher_prompt)


_cfg = partial(stream_config, T, **FAST_BACKOFF, max_inflight=1)


async def test_each_request_carries_its_prompts_leading_ids() -> None:
    rec = _Recorder()
    sample = _sample(1)
    privileged = list(range(100, 140))
    out, _ = await _score(_cfg(), rec.transport, [sample, _sample(2, privileged)])
    assert all(isinstance(r, ScoredSample) for r in out), out
    sent = [h[ROUTING_TOKENS_HEADER] for h in rec.headers]
    assert sent == [",".join(map(str, sample.tokens[:P])), ",".join(map(str, privileged))]


async def test_other_balances_send_no_routing_tokens() -> None:
    rec = _Recorder()
    out, _ = await _score(_cfg(balance="least-outstanding"), rec.transport, [_sample(3)])
    assert isinstance(out[0], ScoredSample)
    assert rec.headers == [{}]


async def test_the_worker_a_gateway_names_is_counted_per_worker() -> None:
    rec = _Recorder(extra={"x-smg-routed-worker-id": "http://10.0.0.7:30000"})
    out, stats = await _score(_cfg(), rec.transport, [_sample(i) for i in range(3)])
    assert all(isinstance(r, ScoredSample) for r in out)
    assert stats.endpoints[T].routed_workers == (("http://10.0.0.7:30000", 3),)


# --- Retry-After -------------------------------------------------------------------------
def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert retry_after_s("3") == 3.0
    assert retry_after_s(" 0.5 ") == 0.5
    assert retry_after_s(None) is None
    assert retry_after_s("soon") is None
    assert retry_after_s("-4") == 0.0
    later = email.utils.formatdate(time.time() + 120, usegmt=True)
    got = retry_after_s(later)
    assert got is not None and 100 < got <= 120
    assert retry_after_s(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0


def test_the_policy_waits_at_least_retry_after_within_the_deadline() -> None:
    policy = RetryPolicy(max_attempts=5, initial_s=0.01, max_s=0.02, rng=random.Random(0))
    assert policy.delay(1, now=0.0, deadline=10.0, retry_after=2.0) == 2.0
    assert policy.delay(1, now=0.0, deadline=10.0, retry_after=0.001) <= 0.02  # type: ignore[operator]
    assert policy.delay(1, now=0.0, deadline=10.0, retry_after=30.0) is None  # past it


@pytest.mark.parametrize("status", [429, 503])
async def test_a_busy_answers_retry_after_is_waited_for(status: int) -> None:
    rec = _Recorder(extra={"retry-after": "0.3"}, fail=[status])
    out, _ = await _score(_cfg(), rec.transport, [_sample(4)])
    assert isinstance(out[0], ScoredSample), out
    assert len(rec.times) == 2
    assert rec.times[1] - rec.times[0] >= 0.3  # FAST_BACKOFF alone waits a few ms


async def test_a_retry_after_beyond_the_deadline_fails_the_request_at_once() -> None:
    rec = _Recorder(extra={"retry-after": "3600"}, fail=[429] * 10)
    out, _ = await _score(_cfg(request_deadline_s=30), rec.transport, [_sample(5)])
    (res,) = out
    assert isinstance(res, SampleFailure)
    assert res.reason == "teacher_http_429"
    assert len(rec.times) == 1  # no retry could start before the deadline


# --- the aiohttp transport passes the two headers on -------------------------------------
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"debug": True})])
async def test_the_aiohttp_transport_keeps_retry_after_and_the_routed_worker() -> None:
    from aiohttp import web

    from opd_stream import AiohttpTransport

    async def handle(request: web.Request) -> web.Response:
        return web.Response(
            status=503,
            body=b"{}",
            headers={"Retry-After": "7", "X-SMG-Routed-Worker-Id": "w-3", "X-Other": "1"},
        )

    app = web.Application()
    app.router.add_post("/generate", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with AiohttpTransport() as transport:
            resp = await transport.post(
                f"http://127.0.0.1:{port}/generate", b"{}", max_bytes=1 << 20
            )
    finally:
        await runner.cleanup()
    assert resp.status == 503
    assert resp.headers == {"retry-after": "7", "x-smg-routed-worker-id": "w-3"}


# --- through the real smg ----------------------------------------------------------------
@pytest.fixture(scope="module")
def smg_cache_aware() -> Iterator[tuple[str, list[str]]]:
    from support.routers import gateway_fleet, launch_smg

    launch = partial(launch_smg, policy="cache_aware")
    with gateway_fleet(launch, 4, prefix_cache_tokens=1 << 16) as fleet:
        yield fleet


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"debug": True})])
async def test_through_smg_the_routed_worker_is_counted_and_a_group_stays_on_one(
    smg_cache_aware: tuple[str, list[str]],
) -> None:
    """One sample at a time (no burst: smg's overload protection stays out of it): the
    workers smg names add up to every request, and each group's later samples find its
    prompt cached (cache_aware does that with or without our tokens when requests come one
    by one; bench scenario 9 measures it under load)."""
    url, workers = smg_cache_aware
    rng = np.random.default_rng(6)
    samples = []
    for _ in range(6):
        head = rng.integers(1, 3000, 48).tolist()
        samples += [Sample(head + rng.integers(1, 3000, 6).tolist(), 6) for _ in range(4)]
    cfg = stream_config(url, gateway_discovery="off", max_inflight=1)
    async with OPDStream(cfg) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
        st = stream.stats().endpoints[url]
        routed, cached = dict(st.routed_workers), st.cached_tokens
    assert all(isinstance(r, ScoredSample) for r in out), out
    assert sum(routed.values()) == len(samples)
    assert set(routed) <= set(workers) and len(routed) > 1
    # every group's later samples found its prompt cached (one worker per group)
    assert cached >= 6 * 3 * (48 - 2), cached
