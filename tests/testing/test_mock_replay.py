"""The mock's replay cache (a benchmark aid): repeated scoring requests are answered from
memory with the same body; anything else is built as usual."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from opd_stream.testing.mock_sglang import MockCluster, MockOptions, serve_mock

BODY: dict[str, Any] = {
    "input_ids": list(range(100, 140)),
    "sampling_params": {"temperature": 0, "max_new_tokens": 0},
    "return_logprob": True,
    "logprob_start_len": 0,
    "top_logprobs_num": 4,
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def server() -> AsyncIterator[MockCluster]:
    async with serve_mock("teacher", 1, options=MockOptions(replay_cache_bytes=1 << 20)) as srv:
        yield srv


async def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/generate", data=msgspec.json.encode(body)) as r,
    ):
        return r.status, await r.read()


async def test_a_repeated_scoring_request_is_answered_with_the_cached_body(
    server: MockCluster,
) -> None:
    first = await _post(server.url, BODY)
    second = await _post(server.url, BODY)
    assert first[0] == second[0] == 200
    assert second[1] == first[1]
    assert server.stats[0].generate_items == 2


async def test_a_different_request_is_built_afresh(server: MockCluster) -> None:
    first = await _post(server.url, BODY)
    other = await _post(server.url, {**BODY, "logprob_start_len": 1})
    a = msgspec.json.decode(first[1])["meta_info"]["input_token_logprobs"]
    b = msgspec.json.decode(other[1])["meta_info"]["input_token_logprobs"]
    assert len(a) == len(b) + 1


async def test_generation_requests_are_never_replayed(server: MockCluster) -> None:
    gen = {**BODY, "sampling_params": {"temperature": 1.0, "max_new_tokens": 4}}
    await _post(server.url, gen)
    await _post(server.url, gen)
    first = msgspec.json.decode((await _post(server.url, gen))[1])
    second = msgspec.json.decode((await _post(server.url, gen))[1])
    assert first["meta_info"]["id"] != second["meta_info"]["id"]


async def test_with_faults_enabled_nothing_is_replayed(server: MockCluster) -> None:
    server.set_options(fault_http_503=1.0)
    status, _ = await _post(server.url, BODY)
    server.set_options(fault_http_503=0.0)
    assert status == 503
    first = msgspec.json.decode((await _post(server.url, BODY))[1])
    server.set_options(fault_malformed=1.0)
    status, body = await _post(server.url, BODY)
    assert status == 200
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(body)
    assert first["meta_info"]["input_token_logprobs"]


def test_a_negative_cache_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="replay_cache_bytes"):
        MockOptions(replay_cache_bytes=-1)
