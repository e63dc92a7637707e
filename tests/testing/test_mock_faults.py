"""Faults, latency, capacity and lifecycle of the mock, seen from a plain aiohttp client."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import msgspec
import pytest
from support.sglang_api import post_json

from opd_stream.testing.mock_sglang import (
    FAULT_KINDS,
    MockCluster,
    MockOptions,
    MockProcess,
    serve_mock,
)

TOKENS = list(range(100, 140))
L = len(TOKENS)
BODY: dict[str, Any] = {
    "input_ids": TOKENS,
    "sampling_params": {"temperature": 0, "max_new_tokens": 0},
    "return_logprob": True,
    "logprob_start_len": 0,
    "top_logprobs_num": 4,
    "token_ids_logprob": [1, 2],
}


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


async def _until(predicate: Any, limit_s: float = 30.0) -> None:
    """Poll ``predicate`` (the mock's counters have no events to wait on)."""
    with anyio.fail_after(limit_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


@pytest.fixture
async def server() -> AsyncIterator[MockCluster]:
    async with serve_mock("teacher", 1) as srv:
        yield srv


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_http_error_faults_answer_error_response_bodies(
    server: MockCluster, session: aiohttp.ClientSession, status: int
) -> None:
    server.set_options(**{f"fault_http_{status}": 1.0})
    got, body = await post_json(session, server.url, BODY)
    assert got == status
    assert body["code"] == status
    assert body["object"] == "error"
    assert server.stats[0].faults == {f"http_{status}": 1}


async def test_abort_fault_is_http_200_with_abort_finish_reason(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    server.set_options(fault_abort=1.0)
    status, body = await post_json(session, server.url, BODY)
    assert status == 200
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    assert body["meta_info"]["finish_reason"]["status_code"] is None


async def test_hang_never_answers_and_the_disconnect_is_counted(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    server.set_options(fault_hang=1.0)
    # the client gives up only once the server holds the request (a fixed client timeout
    # could expire before a busy machine delivered it, and then nothing would hang)
    task = asyncio.ensure_future(post_json(session, server.url, BODY))
    await _until(lambda: server.stats[0].in_flight == 1)
    await asyncio.sleep(0.3)
    assert not task.done()  # no answer
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: server.stats[0].disconnects == 1 and server.stats[0].in_flight == 0)
    assert server.stats[0].faults["hang"] == 1


@pytest.mark.parametrize("fault", ["reset", "truncated"])
async def test_reset_and_truncated_bodies_fail_the_client_read(
    server: MockCluster, session: aiohttp.ClientSession, fault: str
) -> None:
    server.set_options(**{f"fault_{fault}": 1.0})
    with pytest.raises(aiohttp.ClientError):
        await post_json(session, server.url, BODY)
    assert server.stats[0].faults == {fault: 1}
    assert server.stats[0].bytes_sent > 0


async def test_malformed_body_is_not_json(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    server.set_options(fault_malformed=1.0)
    async with session.post(server.url + "/generate", json=BODY) as resp:
        raw = await resp.read()
    assert resp.status == 200
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(raw)


async def test_misaligned_fault_returns_wrong_token_ids(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    server.set_options(fault_misaligned=1.0)
    _, body = await post_json(session, server.url, BODY)
    ids = [e[1] for e in body["meta_info"]["input_token_logprobs"]]
    assert len(ids) == L
    assert ids != TOKENS


async def test_missing_rows_fault_drops_one_row_of_every_input_list(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    server.set_options(fault_missing_rows=1.0)
    _, body = await post_json(session, server.url, BODY)
    meta = body["meta_info"]
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        assert len(meta[key]) == L - 1, key


async def test_oversized_fault_pads_the_body(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    server.set_options(fault_oversized=1.0, oversized_bytes=3_000_000)
    async with session.post(server.url + "/generate", json=BODY) as resp:
        raw = await resp.read()
    assert len(raw) > 3_000_000
    assert len(msgspec.json.decode(raw)["meta_info"]["input_token_logprobs"]) == L


async def test_slow_drip_sends_the_full_body_slowly(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    _, normal = await post_json(session, server.url, BODY)
    server.set_options(fault_slow_drip=1.0, drip_chunk_bytes=512, drip_delay_s=0.02)
    t0 = time.monotonic()
    async with session.post(server.url + "/generate", json=BODY) as resp:
        raw = await resp.read()
    elapsed = time.monotonic() - t0
    chunks = -(-len(raw) // 512)
    assert elapsed >= 0.02 * chunks * 0.9
    assert (
        msgspec.json.decode(raw)["meta_info"]["input_token_logprobs"]
        == normal["meta_info"]["input_token_logprobs"]
    )


async def test_fault_rates_are_seeded_and_one_fault_per_request(
    session: aiohttp.ClientSession,
) -> None:
    opts = MockOptions(fault_http_500=0.3, fault_http_503=0.3, fault_seed=5)
    seqs = []
    for _ in range(2):
        async with serve_mock("teacher", 1, options=opts) as srv:
            seqs.append([(await post_json(session, srv.url, BODY))[0] for _ in range(40)])
            stats = srv.stats[0]
    assert seqs[0] == seqs[1]
    assert sum(stats.faults.values()) == sum(s != 200 for s in seqs[0])
    assert 10 <= seqs[0].count(500) + seqs[0].count(503) <= 38


async def test_options_flip_faults_at_runtime(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    server.set_options(fault_http_503=1.0)
    assert (await post_json(session, server.url, BODY))[0] == 503
    server.set_options(fault_http_503=0.0)
    assert (await post_json(session, server.url, BODY))[0] == 200


async def test_options_and_stats_over_http(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    async with session.post(server.url + "/mock/options", json={"fault_http_429": 1.0}) as r:
        assert r.status == 200
    assert (await post_json(session, server.url, BODY))[0] == 429
    async with session.get(server.url + "/mock/stats") as r:
        stats = await r.json()
    assert stats["faults"] == {"http_429": 1}
    assert stats["generate_requests"] == 1
    assert stats["by_status"]["429"] == 1
    assert stats["bytes_received"] > 0
    async with session.post(server.url + "/mock/options", json={"fault_http_429": 2.0}) as r:
        assert r.status == 400


async def test_fixed_latency_delays_answers(session: aiohttp.ClientSession) -> None:
    async with serve_mock("teacher", 1, options=MockOptions(latency_fixed_s=0.25)) as srv:
        t0 = time.monotonic()
        await post_json(session, srv.url, BODY)
    assert time.monotonic() - t0 >= 0.25


async def test_capacity_serialises_requests(session: aiohttp.ClientSession) -> None:
    # long enough that all three requests are in the server before the first one is answered,
    # even on a busy machine
    async with serve_mock(
        "teacher", 1, options=MockOptions(latency_fixed_s=0.5, max_running=1)
    ) as srv:
        t0 = time.monotonic()
        results = await asyncio.gather(*(post_json(session, srv.url, BODY) for _ in range(3)))
        elapsed = time.monotonic() - t0
    assert [s for s, _ in results] == [200] * 3
    assert elapsed >= 1.5
    assert srv.stats[0].max_in_flight == 3


async def test_stopped_replica_refuses_and_restarts_on_the_same_port(
    session: aiohttp.ClientSession,
) -> None:
    async with serve_mock("teacher", 1, replicas=2) as srv:
        url = srv.urls[1]
        assert srv.urls[0] != url
        await srv.stop(1)
        with pytest.raises(aiohttp.ClientConnectionError):
            await post_json(session, url, BODY)
        assert await srv.start(1) == url
        _, a = await post_json(session, srv.urls[0], BODY)
        _, b = await post_json(session, url, BODY)
    assert a["meta_info"]["input_token_logprobs"] == b["meta_info"]["input_token_logprobs"]


async def test_abort_request_endpoint_aborts_an_in_flight_rid(
    session: aiohttp.ClientSession,
) -> None:
    # the abort must land while the request is being served: wait until it runs, and serve it
    # slowly enough that a busy machine still gets the abort in
    async with serve_mock("teacher", 1, options=MockOptions(latency_fixed_s=2.0)) as srv:
        task = asyncio.ensure_future(post_json(session, srv.url, {**BODY, "rid": "abc"}))
        await _until(lambda: srv.stats[0].running == 1)
        async with session.post(srv.url + "/abort_request", json={"rid": "abc"}) as r:
            assert r.status == 200
        status, body = await task
    assert status == 200
    assert body["meta_info"]["finish_reason"]["type"] == "abort"


def test_every_fault_kind_has_an_option_and_a_cli_flag() -> None:
    from opd_stream.testing.mock_sglang.__main__ import build_parser

    args = build_parser().parse_args([f"--fault-{k.replace('_', '-')}=0.5" for k in FAULT_KINDS])
    assert all(getattr(args, f"fault_{k}") == 0.5 for k in FAULT_KINDS)


def test_cli_subprocess_starts_is_killed_and_restarts_on_the_same_port() -> None:
    proc = MockProcess("student", 3, options=MockOptions(per_position="unpatched", api_key="k"))
    with proc:
        url = proc.url
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert r.status == 200
        proc.kill()
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url + "/health", timeout=5)
        assert proc.start() == url
        req = urllib.request.Request(
            url + "/generate", data=msgspec.json.encode(BODY), method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 401
        info.value.close()
