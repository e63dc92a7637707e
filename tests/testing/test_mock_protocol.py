"""Conformance of the mock SGLang server with ``docs/protocol.md`` (plain aiohttp client)."""

from __future__ import annotations

import base64
import math
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import aiohttp
import anyio
import numpy as np
import pytest
from support.sglang_api import post_json

from opd_stream.testing.mock_sglang import MockCluster, MockModel, MockOptions, serve_mock

V = 151936
SEED = 7
TOKENS = np.random.default_rng(3).integers(0, V - 2, size=24).tolist()
TOKENS[5] = V - 1  # a masked id inside the input: its logprob is -inf -> null
L = len(TOKENS)
MODEL = MockModel("teacher", seed=SEED)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


@pytest.fixture
async def server() -> AsyncIterator[MockCluster]:
    async with serve_mock("teacher", SEED) as srv:
        yield srv


def score_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": TOKENS,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_text_in_logprobs": False,
        "stream": False,
    }
    body.update(extra)
    return body


def f32(x: float) -> float | None:
    """A logprob as SGLang emits it: float32-rounded, -inf as null."""
    return None if x == -math.inf else float(np.float32(x))


def ref_lp(tokens: list[int], p: int, token: int) -> float | None:
    return f32(float(MODEL.logprobs(np.array(tokens), [p], [[token]])[0, 0]))


def ref_topk(tokens: list[int], p: int, k: int) -> list[list[Any]]:
    ids, lps = MODEL.topk(np.array(tokens), [p], k)
    return [
        [f32(float(x)), int(i), None] for i, x in zip(ids[0].tolist(), lps[0].tolist(), strict=True)
    ]


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("start", [0, 1, 5, L - 1, L])
async def test_input_lists_have_l_minus_s_entries_entry_j_is_position_s_plus_j(
    server: MockCluster, session: aiohttp.ClientSession, start: int
) -> None:
    status, body = await post_json(
        session,
        server.url,
        score_body(logprob_start_len=start, top_logprobs_num=3, token_ids_logprob=[9, 2]),
    )
    assert status == 200
    meta = body["meta_info"]
    n = L - start
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        assert len(meta[key]) == n, key
    if n == 0:
        return
    assert meta["input_token_logprobs"][0] == [None, TOKENS[start], None]
    assert meta["input_top_logprobs"][0] is None
    assert meta["input_token_ids_logprobs"][0] is None
    for j in range(1, n):
        p = start + j
        assert meta["input_token_logprobs"][j] == [ref_lp(TOKENS, p, TOKENS[p]), TOKENS[p], None]
        assert meta["input_top_logprobs"][j] == ref_topk(TOKENS, p, 3)
        assert meta["input_token_ids_logprobs"][j] == [
            [ref_lp(TOKENS, p, 9), 9, None],
            [ref_lp(TOKENS, p, 2), 2, None],
        ]


async def test_masked_token_logprob_is_null(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    _, body = await post_json(session, server.url, score_body())
    assert body["meta_info"]["input_token_logprobs"][5] == [None, V - 1, None]


async def test_default_logprob_start_len_gives_no_input_rows_for_scoring(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    b = score_body(top_logprobs_num=2)
    del b["logprob_start_len"]
    status, body = await post_json(session, server.url, b)
    assert status == 200
    assert body["meta_info"]["input_token_logprobs"] == []
    assert body["meta_info"]["input_top_logprobs"] == []


async def test_start_beyond_input_is_a_400_with_the_scheduler_message(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    status, body = await post_json(session, server.url, score_body(logprob_start_len=L + 1))
    assert status == 400
    assert body["error"]["message"].startswith(f"req.logprob_start_len={L + 1} is higher than")


async def test_max_new_tokens_zero_response_shape(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    _, body = await post_json(
        session, server.url, score_body(top_logprobs_num=4, token_ids_logprob=[3])
    )
    meta = body["meta_info"]
    assert body["text"] == ""
    assert body["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0
    assert meta["prompt_tokens"] == L
    assert meta["output_token_logprobs"] == []
    assert meta["output_token_logprobs_length"] == 0
    assert meta["output_top_logprobs"] == [ref_topk(TOKENS, L, 4)]
    assert meta["output_token_ids_logprobs"] == [[[ref_lp(TOKENS, L, 3), 3, None]]]
    for key in ("id", "weight_version", "cached_tokens", "e2e_latency", "num_retractions"):
        assert key in meta


async def test_optional_logprob_keys_are_absent_when_not_requested(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    _, body = await post_json(
        session, server.url, score_body(top_logprobs_num=0, token_ids_logprob=[])
    )
    meta = body["meta_info"]
    for key in (
        "input_top_logprobs",
        "output_top_logprobs",
        "input_token_ids_logprobs",
        "output_token_ids_logprobs",
    ):
        assert key not in meta
    _, body = await post_json(
        session, server.url, score_body(return_logprob=False, top_logprobs_num=2)
    )
    assert not [k for k in body["meta_info"] if "logprob" in k]


async def test_top_k_is_best_first_and_requested_ids_keep_request_order(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    ids = [50, 3, V - 2, 17, 0]
    _, body = await post_json(
        session, server.url, score_body(top_logprobs_num=8, token_ids_logprob=ids)
    )
    meta = body["meta_info"]
    for row in meta["input_top_logprobs"][1:]:
        vals = [e[0] for e in row]
        assert vals == sorted(vals, reverse=True)
    for j, row in enumerate(meta["input_token_ids_logprobs"][1:], start=1):
        assert [e[1] for e in row] == ids
        assert row[2][0] is None  # masked id -> null
        assert row[0][0] == ref_lp(TOKENS, j, 50)


async def test_text_in_logprobs_fills_the_third_element(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    _, body = await post_json(session, server.url, score_body(return_text_in_logprobs=True))
    assert all(isinstance(e[2], str) for e in body["meta_info"]["input_token_logprobs"])


async def test_generation_samples_tokens_with_model_logprobs(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    b = score_body(top_logprobs_num=2, logprob_start_len=L - 1)
    b["sampling_params"] = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 11}
    status, body = await post_json(session, server.url, b)
    assert status == 200
    gen = body["output_ids"]
    meta = body["meta_info"]
    assert len(gen) == 6
    assert meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    full = TOKENS + gen
    assert meta["output_token_logprobs"] == [
        [ref_lp(full, L + i, g), g, None] for i, g in enumerate(gen)
    ]
    assert meta["output_top_logprobs"] == [ref_topk(full, L + i, 2) for i in range(6)]
    assert len(meta["input_token_logprobs"]) == 1
    _, again = await post_json(session, server.url, b)
    assert again["output_ids"] == gen  # same sampling_seed, same rollout


async def test_put_is_accepted_and_unknown_top_level_keys_are_ignored(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    extra = {
        "model": None,
        "background": False,
        "log_metrics": True,
        "cache_salt": "x",
        "whatever": 1,
    }
    status, body = await post_json(session, server.url, score_body(**extra), method="PUT")
    assert status == 200
    assert len(body["meta_info"]["input_token_logprobs"]) == L


async def test_batch_answers_an_array_in_input_order(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    seqs = [TOKENS[:6], TOKENS[3:12], TOKENS[:2]]
    b = score_body(
        input_ids=seqs,
        logprob_start_len=[0, 2, 1],
        top_logprobs_num=2,
        token_ids_logprob=[[4], [5, 6], [7]],
        rid="r",
    )
    status, body = await post_json(session, server.url, b)
    assert status == 200
    assert isinstance(body, list)
    assert len(body) == 3
    for i, (seq, s, ids) in enumerate(zip(seqs, [0, 2, 1], [[4], [5, 6], [7]], strict=True)):
        meta = body[i]["meta_info"]
        assert meta["id"] == f"r_{i}"
        assert [e[1] for e in meta["input_token_logprobs"]] == seq[s:]
        assert [[e[1] for e in row] for row in meta["input_token_ids_logprobs"][1:]] == [ids] * (
            len(seq) - s - 1
        )
        if len(seq) - s > 1:
            assert meta["input_token_logprobs"][1][0] == ref_lp(seq, s + 1, seq[s + 1])


async def test_batch_list_of_wrong_length_is_a_400(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    status, body = await post_json(
        session, server.url, score_body(input_ids=[TOKENS, TOKENS], logprob_start_len=[0])
    )
    assert status == 400
    assert "batch size" in body["error"]["message"]


# ---------------------------------------------------------------- errors


async def test_unknown_sampling_param_is_rejected_with_the_contract_shape(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    b = score_body()
    b["sampling_params"] = {"max_new_tokens": 0, "top_logprobs_num": 2}
    status, body = await post_json(session, server.url, b)
    assert status == 400
    assert isinstance(body["error"], str)
    assert body["error"].startswith(
        "unknown field `top_logprobs_num`, expected one of `max_new_tokens`"
    )


async def test_non_integer_input_id_is_rejected_with_the_error_response_shape(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    status, body = await post_json(session, server.url, score_body(input_ids=[1, 2.5, 3]))
    assert status == 400
    assert body["object"] == "error"
    assert body["code"] == 400
    assert body["type"] == "Bad Request"
    assert body["param"] is None
    assert isinstance(body["message"], str)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({"token_ids_logprob": [V]}, f"token_ids_logprob contains out-of-vocabulary token id {V}"),
        ({"return_flat_raw_top_logprobs_b64": True}, "return_flat_raw_top_logprobs_b64 requires"),
    ],
)
async def test_value_errors_use_the_nested_error_message_shape(
    server: MockCluster, session: aiohttp.ClientSession, extra: dict[str, Any], message: str
) -> None:
    status, body = await post_json(session, server.url, score_body(**extra))
    assert status == 400
    assert body["error"]["message"].startswith(message)


async def test_queue_full_is_a_503_error_response(session: aiohttp.ClientSession) -> None:
    # the first request holds the one slot long enough for a busy machine to send the second
    opts = MockOptions(max_running=1, max_queued=0, latency_fixed_s=2.0)
    async with serve_mock("teacher", SEED, options=opts) as srv:
        import asyncio

        first = asyncio.ensure_future(post_json(session, srv.url, score_body()))
        with anyio.fail_after(30):
            while srv.stats[0].running < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        status, body = await post_json(session, srv.url, score_body())
        assert (await first)[0] == 200
    assert status == 503
    assert body == {
        "object": "error",
        "message": "The request queue is full.",
        "type": "503",
        "param": None,
        "code": 503,
    }
    assert srv.stats[0].rejected_queue_full == 1


# ---------------------------------------------------------------- auth and other endpoints


async def test_api_key_requires_bearer_but_health_stays_open(
    session: aiohttp.ClientSession,
) -> None:
    async with serve_mock("teacher", SEED, options=MockOptions(api_key="k3y")) as srv:
        status, body = await post_json(session, srv.url, score_body())
        assert (status, body) == (401, {"error": "Unauthorized"})
        status, _ = await post_json(
            session, srv.url, score_body(), headers={"Authorization": "Bearer nope"}
        )
        assert status == 401
        status, _ = await post_json(
            session, srv.url, score_body(), headers={"Authorization": "Bearer k3y"}
        )
        assert status == 200
        async with session.get(srv.url + "/health") as r:
            assert r.status == 200
            assert await r.read() == b""
        async with session.get(srv.url + "/model_info") as r:
            assert r.status == 401


async def test_health_is_503_while_starting(session: aiohttp.ClientSession) -> None:
    async with serve_mock("teacher", SEED, options=MockOptions(startup_delay_s=30)) as srv:
        async with session.get(srv.url + "/health") as r:
            assert r.status == 503
        srv.set_options(startup_delay_s=0.0)
        async with session.get(srv.url + "/health") as r:
            assert r.status == 200


async def test_info_and_flush_endpoints(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    async with session.get(server.url + "/model_info") as r:
        info = await r.json()
    assert info["model_path"].count("/") != 1  # never an HF-style repo id
    async with session.get(server.url + "/server_info") as r:
        assert (await r.json())["context_length"] > 0
    async with session.post(server.url + "/flush_cache") as r:
        assert r.status == 200
        assert (await r.text()).startswith("Cache flushed.")


# ---------------------------------------------------------------- per-position


def positions_rows(start: int) -> list[list[int]]:
    rows: list[list[int]] = [[] for _ in range(L)]
    for p in range(start, L):
        if p % 3 != 0:
            rows[p] = [(p * 7919) % V, 1, V - 1][: 1 + p % 3]
    return rows


@pytest.mark.parametrize("start", [0, 9])
async def test_per_position_rows_align_to_target_positions(
    server: MockCluster, session: aiohttp.ClientSession, start: int
) -> None:
    rows = positions_rows(1)
    status, body = await post_json(
        session, server.url, score_body(logprob_start_len=start, token_ids_logprob_positions=rows)
    )
    assert status == 200
    got = body["meta_info"]["input_token_ids_logprobs"]
    assert len(got) == L - start
    assert got[0] is None
    for j in range(1, L - start):
        p = start + j
        if not rows[p]:
            assert got[j] is None
        else:
            assert got[j] == [[ref_lp(TOKENS, p, t), t, None] for t in rows[p]]


async def test_unpatched_server_ignores_per_position_silently(
    session: aiohttp.ClientSession,
) -> None:
    async with serve_mock("teacher", SEED, options=MockOptions(per_position="unpatched")) as srv:
        status, body = await post_json(
            session, srv.url, score_body(token_ids_logprob_positions=positions_rows(1))
        )
    assert status == 200
    assert "input_token_ids_logprobs" not in body["meta_info"]


def _bad_positions() -> list[tuple[str, dict[str, Any]]]:
    ok = positions_rows(1)
    dup = [list(r) for r in ok]
    dup[4] = [8, 8]
    boolean = [list(r) for r in ok]
    boolean[4] = [True]
    not_list = [list(r) for r in ok]
    not_list[4] = 5  # type: ignore[call-overload]
    oob = [list(r) for r in ok]
    oob[4] = [V]
    neg = [list(r) for r in ok]
    neg[4] = [-1]
    return [
        ("batch", {"input_ids": [TOKENS, TOKENS]}),
        ("with flat ids", {"token_ids_logprob": [3]}),
        ("row count", {"token_ids_logprob_positions": ok[:-1]}),
        ("duplicate", {"token_ids_logprob_positions": dup}),
        ("bool id", {"token_ids_logprob_positions": boolean}),
        ("row not a list", {"token_ids_logprob_positions": not_list}),
        ("id >= vocab", {"token_ids_logprob_positions": oob}),
        ("negative id", {"token_ids_logprob_positions": neg}),
        ("no return_logprob", {"return_logprob": False}),
        ("generation", {"sampling_params": {"max_new_tokens": 3}}),
        ("start -1", {"logprob_start_len": -1}),
        ("start missing", {"logprob_start_len": None}),
        ("stream", {"stream": True}),
    ]


@pytest.mark.parametrize(("case", "extra"), _bad_positions(), ids=[c for c, _ in _bad_positions()])
async def test_patched_server_rejects_invalid_per_position_requests(
    server: MockCluster, session: aiohttp.ClientSession, case: str, extra: dict[str, Any]
) -> None:
    b = score_body(token_ids_logprob_positions=positions_rows(1))
    b.update(extra)
    if b["logprob_start_len"] is None:
        del b["logprob_start_len"]
    status, body = await post_json(session, server.url, b)
    assert status == 400, case
    assert "message" in body["error"]


# ---------------------------------------------------------------- flat / b64 top-k


@pytest.mark.parametrize("start", [0, 10, L - 1])
async def test_b64_and_json_flat_top_k_decode_to_the_nested_values(
    server: MockCluster, session: aiohttp.ClientSession, start: int
) -> None:
    base = score_body(logprob_start_len=start, top_logprobs_num=5)
    _, nested = await post_json(session, server.url, base)
    flags = {"return_flat_raw_top_logprobs": True, "return_flat_raw_output_top_logprobs": True}
    _, flat = await post_json(session, server.url, {**base, **flags})
    _, b64 = await post_json(
        session, server.url, {**base, **flags, "return_flat_raw_top_logprobs_b64": True}
    )
    rows = nested["meta_info"]["input_top_logprobs"][1:]
    want_val = [e[0] for row in rows for e in row]
    want_idx = [e[1] for row in rows for e in row]
    for side_rows, side in (
        (rows, "input"),
        (nested["meta_info"]["output_top_logprobs"], "output"),
    ):
        want_val = [e[0] for row in side_rows for e in row]
        want_idx = [e[1] for row in side_rows for e in row]
        prefix = 1 if side == "input" else 0
        for m in (flat["meta_info"], b64["meta_info"]):
            assert f"{side}_top_logprobs" not in m
            assert m[f"{side}_top_logprobs_shape"] == [len(side_rows), 5]
            assert m[f"{side}_top_logprobs_null_prefix"] == prefix
        assert flat["meta_info"][f"{side}_top_logprobs_val_flat"] == want_val
        assert flat["meta_info"][f"{side}_top_logprobs_idx_flat"] == want_idx
        mb = b64["meta_info"]
        assert mb[f"{side}_top_logprobs_val_flat_b64_dtype"] == "float32"
        assert mb[f"{side}_top_logprobs_idx_flat_b64_dtype"] == "int32"
        vals = np.frombuffer(base64.b64decode(mb[f"{side}_top_logprobs_val_flat_b64"]), dtype="<f4")
        idx = np.frombuffer(base64.b64decode(mb[f"{side}_top_logprobs_idx_flat_b64"]), dtype="<i4")
        assert [float(v) for v in vals] == want_val
        assert idx.tolist() == want_idx


# ---------------------------------------------------------------- SGLang's own contract


def _all_option_bodies() -> list[dict[str, Any]]:
    gen = {"max_new_tokens": 3, "temperature": 0.7, "sampling_seed": 1}
    return [
        score_body(),
        score_body(top_logprobs_num=3, token_ids_logprob=[1, V - 1], return_text_in_logprobs=True),
        score_body(logprob_start_len=L - 1, top_logprobs_num=2, sampling_params=gen),
        score_body(token_ids_logprob_positions=positions_rows(1)),
        score_body(input_ids=[TOKENS[:5], TOKENS[:9]], top_logprobs_num=2, token_ids_logprob=[3]),
        score_body(
            top_logprobs_num=2,
            return_flat_raw_top_logprobs=True,
            return_flat_raw_top_logprobs_b64=True,
        ),
        score_body(top_logprobs_num=2, return_flat_raw_output_top_logprobs=True),
        score_body(return_logprob=False, sampling_params=gen),
    ]


async def test_answers_pass_sglang_generate_response_contract(
    server: MockCluster, session: aiohttp.ClientSession, api_types: ModuleType
) -> None:
    for b in _all_option_bodies():
        api_types.GenerateRequest.from_json_value(b)  # our requests are valid SGLang requests
        status, body = await post_json(session, server.url, b)
        assert status == 200
        for item in body if isinstance(body, list) else [body]:
            api_types.GenerateResponse.from_json_value(item)


@pytest.mark.parametrize(
    "sampling_params",
    [
        {"temperature": 0, "max_new_tokens": 0},
        {"temperature": 0.5, "top_k": 5, "stop": ["x"], "logit_bias": {"3": 1}},
        {"max_new_tokens": 0, "top_logprobs_num": 2},
        {"temperature": "hot"},
        {"max_new_tokens": 1.5},
        {"skip_special_tokens": 1},
        {"stop": [1]},
        {"watermark": {"enabled": True, "colour": 1}},
        [{"max_new_tokens": 0}, {"n": 2, "bogus": 1}],
        5,
    ],
)
async def test_request_validation_agrees_with_sglang_generate_request(
    server: MockCluster, session: aiohttp.ClientSession, api_types: ModuleType, sampling_params: Any
) -> None:
    body = score_body(sampling_params=sampling_params)
    if isinstance(sampling_params, list):
        body["input_ids"] = [TOKENS, TOKENS]
    try:
        api_types.GenerateRequest.from_json_value(body)
        expected = None
    except api_types.JsonContractError as exc:
        expected = str(exc)
    status, answer = await post_json(session, server.url, body)
    if expected is None:
        assert not (
            status == 400
            and isinstance(answer.get("error") if isinstance(answer, dict) else None, str)
        )
    else:
        assert (status, answer) == (400, {"error": expected})
