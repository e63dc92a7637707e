"""The mock SGLang server's prefix cache (``meta_info.cached_tokens``, as SGLang's radix cache
reports it) and its compute-time model (a GPU-bound replica simulated on CPU)."""

from __future__ import annotations

from typing import Any

import aiohttp
import anyio
import numpy as np
import pytest
from support.sglang_api import post_json

from opd_stream.testing.mock_sglang import MockOptions, serve_mock
from opd_stream.testing.mock_sglang._prefix_cache import PrefixCache, reusable_limit


def _seq(*parts: range) -> np.ndarray:
    return np.concatenate([np.arange(p.start, p.stop, dtype=np.int64) for p in parts])


# --- the cache as plain rules ------------------------------------------------------------
def test_a_cached_prefix_is_matched_in_whole_pages_up_to_the_limit() -> None:
    cache = PrefixCache(1000, page_size=4)
    cache.insert(_seq(range(18)))  # pages 0-3, 4-7, 8-11, 12-15 (16-17: not a page)
    assert cache.cached_tokens == 16
    assert cache.match(_seq(range(30)), limit=29) == 16
    assert cache.match(_seq(range(30)), limit=11) == 8  # the limit cuts a page
    assert cache.match(_seq(range(6), range(100, 120)), limit=25) == 4  # differs at 6
    assert cache.match(_seq(range(1, 20)), limit=18) == 0


def test_different_salts_share_nothing() -> None:
    cache = PrefixCache(1000, page_size=2)
    cache.insert(_seq(range(10)), salt="a")
    assert cache.match(_seq(range(10)), limit=9, salt="a") == 8
    assert cache.match(_seq(range(10)), limit=9, salt="b") == 0
    assert cache.match(_seq(range(10)), limit=9) == 0


def test_the_least_recently_used_leaves_go_first_and_a_shared_head_stays() -> None:
    cache = PrefixCache(12, page_size=2)  # 6 pages
    head = range(4)
    cache.insert(_seq(head, range(100, 104)))  # 4 pages
    cache.insert(_seq(head, range(200, 204)))  # 2 new pages: 6
    assert cache.match(_seq(head, range(100, 104)), limit=8) == 8  # A is now the most recent
    cache.insert(_seq(head, range(300, 304)))  # 2 new pages: B's 2 leaves go
    assert cache.cached_tokens == 12 and cache.evicted_tokens == 4
    assert cache.match(_seq(head, range(200, 204)), limit=8) == 4  # only the shared head
    assert cache.match(_seq(head, range(100, 104)), limit=8) == 8
    assert cache.match(_seq(head, range(300, 304)), limit=8) == 8


def test_a_logprob_request_reuses_at_most_its_logprob_start_len() -> None:
    assert reusable_limit(100, return_logprob=False, logprob_start_len=0) == 99
    assert reusable_limit(100, return_logprob=True, logprob_start_len=0) == 0
    assert reusable_limit(100, return_logprob=True, logprob_start_len=60) == 60
    assert reusable_limit(100, return_logprob=True, logprob_start_len=100) == 99


# --- the mock server -------------------------------------------------------------------
@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


def _body(tokens: list[int], start: int) -> dict[str, Any]:
    return {
        "input_ids": tokens,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": start,
    }


PROMPT = list(range(1000, 1040))  # 40 tokens


async def test_cached_tokens_report_the_reused_prompt_of_a_prompt_end_request(
    session: aiohttp.ClientSession,
) -> None:
    opts = MockOptions(prefix_cache_tokens=10_000, prefix_cache_page=8)
    async with serve_mock("teacher", 1, options=opts) as srv:
        metas = []
        for response in ([5, 6, 7], [8, 9], [5, 6, 7]):
            tokens = PROMPT + response
            status, answer = await post_json(session, srv.url, _body(tokens, len(PROMPT) - 1))
            assert status == 200
            metas.append(answer["meta_info"])
        st = srv.stats[0]
    # first: cold; second: the prompt's whole pages up to logprob_start_len 39 -> 32;
    # third: its own earlier input, capped the same way
    assert [m["cached_tokens"] for m in metas] == [0, 32, 32]
    assert st.prompt_tokens == 43 + 42 + 43
    assert st.cached_tokens == 64
    assert st.computed_tokens == st.prompt_tokens - 64


async def test_a_request_from_position_zero_reuses_nothing(
    session: aiohttp.ClientSession,
) -> None:
    opts = MockOptions(prefix_cache_tokens=10_000, prefix_cache_page=1)
    async with serve_mock("teacher", 1, options=opts) as srv:
        for _ in range(2):
            status, answer = await post_json(session, srv.url, _body([*PROMPT, 1, 2], 0))
            assert status == 200 and answer["meta_info"]["cached_tokens"] == 0
        # the flush empties the cache
        status, answer = await post_json(session, srv.url, _body([*PROMPT, 1, 2], 41))
        assert answer["meta_info"]["cached_tokens"] == 41
        async with session.post(srv.url + "/flush_cache") as resp:
            assert resp.status == 200
        status, answer = await post_json(session, srv.url, _body([*PROMPT, 1, 2], 41))
        assert answer["meta_info"]["cached_tokens"] == 0


async def test_the_compute_model_charges_the_uncached_tokens(
    session: aiohttp.ClientSession,
) -> None:
    opts = MockOptions(
        prefix_cache_tokens=10_000,
        prefix_cache_page=1,
        compute_fixed_s=0.001,
        compute_per_token_s=0.0005,
    )
    async with serve_mock("teacher", 1, options=opts) as srv:
        await post_json(session, srv.url, _body([*PROMPT, 1], 40))  # 41 computed

        async def one(tail: int) -> None:
            await post_json(session, srv.url, _body([*PROMPT, tail, tail], 40))

        async with anyio.create_task_group() as tg:
            for tail in (7, 8, 9):
                tg.start_soon(one, tail)
        st = srv.stats[0]
    # 41 + 3 x (42 - 40 cached) tokens computed
    assert st.computed_tokens == 41 + 3 * 2
    assert st.compute_s == pytest.approx(4 * 0.001 + 0.0005 * 47)
