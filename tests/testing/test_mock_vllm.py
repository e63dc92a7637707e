"""The mock vLLM server (``opd_stream.testing.mock_vllm``) against vLLM 0.34.0's wire, as read
from its source, and against the SGLang mock: the same tokens give the same values.

Values are checked against the float64 closed-form model (``MockModel``) computed by hand
here, rounded to float32 as the engine sends them; ranks against a brute-force count over the
whole (small) vocabulary.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from opd_stream.testing.mock_sglang import (
    ByteModel,
    MockCluster,
    MockModel,
    MockOptions,
    serve_mock,
)
from opd_stream.testing.mock_vllm import (
    SCALE_OUT_DISABLED,
    VllmMockOptions,
    VllmMockProcess,
    serve_vllm_mock,
)

V = 1000
H = 16
SEED = 5
OPTS = VllmMockOptions(vocab_size=V, head_size=H)
MODEL = MockModel("teacher", SEED, V, head_size=H)
TOKENS = np.random.default_rng(11).integers(0, V - 2, size=12).tolist()
TOKENS[7] = V - 1  # a masked id: its logprob is -inf (-9999.0 in the dicts)
L = len(TOKENS)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


@pytest.fixture
async def vllm() -> AsyncIterator[MockCluster]:
    async with serve_vllm_mock("teacher", SEED, options=OPTS) as srv:
        yield srv


async def post(session: aiohttp.ClientSession, url: str, path: str, body: Any) -> tuple[int, Any]:
    async with session.post(url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def gen_body(tokens: list[int] = TOKENS, **sp: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": 1, "temperature": 0, "detokenize": False}
    params.update(sp)
    return {"token_ids": tokens, "sampling_params": params, "output_mode": "tokens"}


def npy(answer: dict[str, Any]) -> np.ndarray[Any, Any]:
    raw = base64.b64decode(answer["prompt_token_id_logprobs"])
    arr: np.ndarray[Any, Any] = np.load(io.BytesIO(raw), allow_pickle=False)
    return arr


def ref(tokens: list[int], p: int, token: int, model: MockModel = MODEL) -> float:
    """float64 model logprob of ``token`` at position ``p``, rounded to float32."""
    return float(np.float32(model.logprobs(np.array(tokens), [p], [[token]])[0, 0]))


def ref_rank(tokens: list[int], p: int, token: int) -> int:
    """The number of vocabulary ids whose float32 logprob is >= the token's (ties count)."""
    every = MODEL.logprobs(np.array(tokens), [p], [list(range(V))])[0].astype(np.float32)
    return int((every >= np.float32(ref(tokens, p, token))).sum())


# ---------------------------------------------------------------- scale-out: fixed ids


@pytest.mark.parametrize("start", [0, 3, L - 2])
async def test_id_rows_start_at_prompt_logprob_start_one_row_per_scored_position(
    vllm: MockCluster, session: aiohttp.ClientSession, start: int
) -> None:
    rows = [[TOKENS[start + i + 1], 3, -1] for i in range(L - 1 - start)]
    status, ans = await post(
        session,
        vllm.url,
        "/inference/v1/generate",
        gen_body(prompt_logprob_start=start, prompt_logprob_token_ids=rows),
    )
    assert status == 200
    arr = npy(ans)
    assert arr.dtype == np.dtype("<f4") and arr.shape == (L - 1 - start, 3)
    for i in range(L - 1 - start):
        p = start + i + 1
        assert arr[i, 0] == np.float32(ref(TOKENS, p, TOKENS[p]))
        assert arr[i, 1] == np.float32(ref(TOKENS, p, 3))
        assert arr[i, 2] == -np.inf  # a -1 pad scores -inf
    assert ans["prompt_logprobs"] is None  # not asked


async def test_npy_is_a_plain_npy_file_without_pickle(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    rows = [[1] for _ in range(L - 1)]
    _, ans = await post(
        session, vllm.url, "/inference/v1/generate", gen_body(prompt_logprob_token_ids=rows)
    )
    raw = base64.b64decode(ans["prompt_token_id_logprobs"])
    assert raw[:6] == b"\x93NUMPY"
    np.load(io.BytesIO(raw), allow_pickle=False)  # no object arrays


async def test_ragged_id_rows_are_padded_with_minus_one(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    rows = [[5, 6] if i % 2 else [5] for i in range(L - 1)]
    _, ans = await post(
        session, vllm.url, "/inference/v1/generate", gen_body(prompt_logprob_token_ids=rows)
    )
    arr = npy(ans)
    assert arr.shape == (L - 1, 2)
    assert np.isneginf(arr[0::2, 1]).all() and np.isfinite(arr[1::2, 1]).all()


# ---------------------------------------------------------------- scale-out: prompt_logprobs


@pytest.mark.parametrize(("start", "top"), [(0, 3), (4, 0), (2, H + 3)])
async def test_prompt_logprobs_dicts_follow_the_engine(
    vllm: MockCluster, session: aiohttp.ClientSession, start: int, top: int
) -> None:
    status, ans = await post(
        session,
        vllm.url,
        "/inference/v1/generate",
        gen_body(prompt_logprob_start=start, prompt_logprobs=top),
    )
    assert status == 200
    plp = ans["prompt_logprobs"]
    assert len(plp) == L and plp[: 1 + start] == [None] * (1 + start)
    top_ids, top_lps = MODEL.topk(np.array(TOKENS), list(range(1, L)), top)
    for p in range(start + 1, L):
        d = plp[p]
        keys = list(d)
        actual = TOKENS[p]
        assert keys[0] == str(actual)  # the actual token first, keyed by its id as a string
        want_top = [str(t) for t in top_ids[p - 1].tolist()]
        # The actual token first (its place kept when it is also in the top-N), then the
        # top-N in rank order.
        assert keys == [str(actual)] + [k for k in want_top if k != str(actual)]
        lp = ref(TOKENS, p, actual)
        want_lp = -9999.0 if lp == -math.inf else lp
        assert d[str(actual)]["logprob"] == want_lp
        if str(actual) in want_top:  # overwritten by its top-k entry: rank = its position
            assert d[str(actual)]["rank"] == want_top.index(str(actual)) + 1
        else:  # the engine's rank: ids at least as likely, ties counted
            assert d[str(actual)]["rank"] == ref_rank(TOKENS, p, actual)
        for j, tid in enumerate(want_top):
            assert d[tid]["rank"] == j + 1
            assert d[tid]["logprob"] == float(np.float32(top_lps[p - 1, j]))
            assert d[tid]["decoded_token"] is None


async def test_a_masked_token_reads_minus_9999_in_the_dicts(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    _, ans = await post(session, vllm.url, "/inference/v1/generate", gen_body(prompt_logprobs=1))
    entry = ans["prompt_logprobs"][7][str(V - 1)]
    assert entry == {"logprob": -9999.0, "rank": V, "decoded_token": None}


# ---------------------------------------------------------------- same values as SGLang


async def test_same_tokens_same_values_as_the_sglang_mock(session: aiohttp.ClientSession) -> None:
    rng = np.random.default_rng(2)
    sg_opts = MockOptions(vocab_size=V, head_size=H)
    async with (
        serve_vllm_mock("student", 3, options=OPTS) as v,
        serve_mock("student", 3, options=sg_opts) as s,
    ):
        for _ in range(6):
            n = int(rng.integers(3, 40))
            toks = rng.integers(0, V, size=n).tolist()
            start = int(rng.integers(0, n - 1))
            ids = rng.integers(0, V, size=(n - 1 - start, 4)).tolist()
            rows = [[toks[start + i + 1], *r] for i, r in enumerate(ids)]
            _, va = await post(
                session,
                v.url,
                "/inference/v1/generate",
                gen_body(
                    toks,
                    prompt_logprob_start=start,
                    prompt_logprob_token_ids=rows,
                    prompt_logprobs=5,
                ),
            )
            _, sa = await post(
                session,
                s.url,
                "/generate",
                {
                    "input_ids": toks,
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                    "logprob_start_len": start,
                    "top_logprobs_num": 5,
                    "token_ids_logprob_positions": [[]] * (start + 1)
                    + [r[1:] for r in rows][: n - start - 1],
                },
            )
            meta = sa["meta_info"]
            arr = npy(va)
            sampled = [row[0] for row in meta["input_token_logprobs"][1:]]
            assert [float(x) for x in arr[:, 0]] == [-math.inf if x is None else x for x in sampled]
            per_pos = meta["input_token_ids_logprobs"][1:]
            assert [[float(x) for x in r] for r in arr[:, 1:]] == [
                [-math.inf if t[0] is None else t[0] for t in r] for r in per_pos
            ]
            for p, row in zip(range(start + 1, n), meta["input_top_logprobs"][1:], strict=True):
                got = va["prompt_logprobs"][p]
                assert [(got[str(t[1])]["logprob"], t[1]) for t in row] == [
                    (t[0], t[1]) for t in row
                ]


# ---------------------------------------------------------------- validation (vLLM's 400s)


async def test_scale_out_off_answers_vllms_403(session: aiohttp.ClientSession) -> None:
    async with serve_vllm_mock(options=OPTS, scale_out=False) as srv:
        status, ans = await post(session, srv.url, "/inference/v1/generate", gen_body())
        assert status == 403
        assert ans == {
            "error": {
                "message": SCALE_OUT_DISABLED,
                "type": "PermissionDeniedError",
                "param": None,
                "code": 403,
            }
        }
        status, _ = await post(
            session, srv.url, "/v1/completions", {"prompt": TOKENS, "max_tokens": 1}
        )
        assert status == 200


async def test_more_ids_per_row_than_max_logprobs_is_vllms_400(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    rows = [list(range(21)) for _ in range(L - 1)]
    status, ans = await post(
        session, vllm.url, "/inference/v1/generate", gen_body(prompt_logprob_token_ids=rows)
    )
    assert status == 400
    assert ans["error"]["message"] == (
        "Requested 21 token ids per row in prompt_logprob_token_ids, which is greater than "
        "max allowed: 20. Set max_logprobs (--max-logprobs) to at least 21."
    )
    assert ans["error"]["param"] == "prompt_logprob_token_ids"
    vllm.set_options(max_logprobs=21)
    status, _ = await post(
        session, vllm.url, "/inference/v1/generate", gen_body(prompt_logprob_token_ids=rows)
    )
    assert status == 200
    vllm.set_options(max_logprobs=-1)  # the vocabulary
    status, _ = await post(session, vllm.url, "/inference/v1/generate", gen_body(prompt_logprobs=V))
    assert status == 200


@pytest.mark.parametrize(
    ("sp", "message"),
    [
        (
            {"prompt_logprobs": 21},
            "Requested prompt logprobs of 21, which is greater than max allowed: 20",
        ),
        (
            {"prompt_logprob_token_ids": [[1]] * (L - 2)},
            f"prompt_logprob_token_ids has {L - 2} rows, but the prompt has {L - 1} scored rows "
            "(prompt_len - 1 - prompt_logprob_start).",
        ),
        (
            {"prompt_logprob_token_ids": [[V]] * (L - 1)},
            f"prompt_logprob_token_ids contain out-of-vocab token ids (-1 pads a row). "
            f"Vocabulary size: {V}",
        ),
        (
            {"prompt_logprob_start": 2},
            "prompt_logprob_start requires prompt_logprobs or prompt_logprob_token_ids.",
        ),
        (
            {"prompt_logprob_start": L - 1, "prompt_logprobs": 1},
            f"prompt_logprob_start must be less than prompt_len - 1 ({L - 1}) so at least one "
            "prompt row is scored.",
        ),
        (
            {"prompt_logprob_token_ids": [[]]},
            "prompt_logprob_token_ids must be a non-empty integer array of shape "
            "[num_rows, num_ids].",
        ),
    ],
)
async def test_engine_checks_answer_vllms_400(
    vllm: MockCluster, session: aiohttp.ClientSession, sp: dict[str, Any], message: str
) -> None:
    status, ans = await post(session, vllm.url, "/inference/v1/generate", gen_body(**sp))
    assert status == 400
    assert ans["error"]["message"] == message and ans["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (gen_body(max_tokens=0), "max_tokens must be at least 1, got 0."),
        (gen_body(prompt_logprobs=-2), "prompt_logprobs must be non-negative or -1, got -2."),
        (gen_body([1, -3]), "token_ids must not contain negative values"),
        (gen_body([]), "List should have at least 1 item"),
        (gen_body([1, V]), f"Token id {V} is out of vocabulary"),
        (
            {**gen_body(prompt_logprob_token_ids=[[1]] * (L - 1)), "stream": True},
            "prompt_logprob_token_ids are not available when stream=true.",
        ),
    ],
)
async def test_bad_requests_answer_400_saying_why(
    vllm: MockCluster, session: aiohttp.ClientSession, body: dict[str, Any], fragment: str
) -> None:
    status, ans = await post(session, vllm.url, "/inference/v1/generate", body)
    assert status == 400 and fragment in ans["error"]["message"]


async def test_prompt_longer_than_max_model_len_is_400(session: aiohttp.ClientSession) -> None:
    opts = VllmMockOptions(vocab_size=V, head_size=H, context_length=L)
    async with serve_vllm_mock(options=opts) as srv:
        status, ans = await post(session, srv.url, "/inference/v1/generate", gen_body())
        assert status == 400
        assert ans["error"]["message"].startswith(
            f"The decoder prompt (length {L}) plus the number of requested output tokens"
        )
        status, _ = await post(session, srv.url, "/inference/v1/generate", gen_body(TOKENS[:-1]))
        assert status == 200


# ---------------------------------------------------------------- prefix cache, usage, ids


async def test_prefix_cache_is_read_only_when_asked_and_salt_isolates(
    session: aiohttp.ClientSession,
) -> None:
    opts = VllmMockOptions(vocab_size=V, head_size=H, prefix_cache_tokens=10_000)
    start = 6
    rows = [[TOKENS[start + i + 1]] for i in range(L - 1 - start)]

    def body(**extra: Any) -> dict[str, Any]:
        return {**gen_body(prompt_logprob_start=start, prompt_logprob_token_ids=rows), **extra}

    def cached(ans: dict[str, Any]) -> int:
        return int(ans["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with serve_vllm_mock(options=opts) as srv:
        url = srv.url + ""
        _, first = await post(session, url, "/inference/v1/generate", body())
        _, default = await post(session, url, "/inference/v1/generate", body())
        assert cached(first) == 0
        assert cached(default) == 0  # skip_reading_prefix_cache defaults to true with scores
        reuse = body()
        reuse["sampling_params"]["skip_reading_prefix_cache"] = False
        _, warm = await post(session, url, "/inference/v1/generate", reuse)
        assert cached(warm) == start  # the rows before prompt_logprob_start
        assert npy(warm).tolist() == npy(first).tolist()
        _, salted = await post(
            session, url, "/inference/v1/generate", {**reuse, "cache_salt": "s1"}
        )
        assert cached(salted) == 0
        assert srv.stats[0].computed_tokens == 4 * (L + 1) - start
        srv.set_options(prompt_tokens_details=False)
        _, plain = await post(session, url, "/inference/v1/generate", reuse)
        assert "prompt_tokens_details" not in plain["usage"]


async def test_answer_fields_request_id_usage_weight_versions_and_prompt_ids(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    vllm.set_options(weight_version="w7")
    body = {**gen_body(prompt_logprobs=0), "request_id": "r1", "return_token_ids": True}
    _, ans = await post(session, vllm.url, "/inference/v1/generate", body)
    assert ans["request_id"] == "generate-tokens-r1"
    assert ans["prompt_token_ids"] == TOKENS
    assert ans["usage"]["prompt_tokens"] == L and ans["usage"]["completion_tokens"] == 1
    choice = ans["choices"][0]
    assert choice["weight_versions"] == [{"version": "w7", "start": 0, "end": 1}]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 1
    _, plain = await post(session, vllm.url, "/inference/v1/generate", gen_body())
    assert plain["prompt_token_ids"] is None


async def test_generation_matches_the_sglang_mock(session: aiohttp.ClientSession) -> None:
    async with (
        serve_vllm_mock(options=OPTS) as v,
        serve_mock(options=MockOptions(vocab_size=V, head_size=H)) as s,
    ):
        _, va = await post(session, v.url, "/inference/v1/generate", gen_body(max_tokens=6))
        _, sa = await post(
            session,
            s.url,
            "/generate",
            {"input_ids": TOKENS, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        )
        assert va["choices"][0]["token_ids"] == sa["output_ids"]
        assert va["usage"]["completion_tokens"] == 6
        # Sampled with a seed: the same draw as the SGLang mock's sampling_seed.
        _, va = await post(
            session,
            v.url,
            "/inference/v1/generate",
            gen_body(max_tokens=8, temperature=1.5, seed=7),
        )
        _, sa = await post(
            session,
            s.url,
            "/generate",
            {
                "input_ids": TOKENS,
                "sampling_params": {"max_new_tokens": 8, "temperature": 1.5, "sampling_seed": 7},
            },
        )
        assert va["choices"][0]["token_ids"] == sa["output_ids"]


# ---------------------------------------------------------------- completions


async def test_completions_rows_cover_every_position_keyed_by_string_ids(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    other = TOKENS[:5]
    status, ans = await post(
        session,
        vllm.url,
        "/v1/completions",
        {"prompt": [TOKENS, other], "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0},
    )
    assert status == 200 and ans["object"] == "text_completion"
    assert [c["index"] for c in ans["choices"]] == [0, 1]
    for choice, toks in zip(ans["choices"], [TOKENS, other], strict=True):
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(toks) and plp[0] is None
        for p in range(1, len(toks)):
            lp = ref(toks, p, toks[p])
            assert plp[p][str(toks[p])]["logprob"] == (-9999.0 if lp == -math.inf else lp)
            assert len(plp[p]) in (2, 3)
    assert ans["usage"]["prompt_tokens"] == L + 5
    assert ans["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (
            {"prompt": TOKENS, "max_tokens": 1, "prompt_logprobs": 21},
            400,
            "greater than max allowed: 20",
        ),
        (
            {"prompt": TOKENS, "max_tokens": 1, "prompt_logprobs": -3},
            400,
            "must be a positive value or -1",
        ),
        ({"prompt": TOKENS, "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0."),
        (
            {"prompt": TOKENS, "max_tokens": 1, "stream": True, "prompt_logprobs": 1},
            400,
            "stream=True",
        ),
    ],
)
async def test_completions_rejections(
    vllm: MockCluster, session: aiohttp.ClientSession, body: Any, status: int, fragment: str
) -> None:
    got, ans = await post(session, vllm.url, "/v1/completions", body)
    assert got == status and fragment in ans["error"]["message"]


# ---------------------------------------------------------------- faults, endpoints, CLI


async def test_injected_faults_use_vllms_error_shape_and_abort_is_a_200(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    vllm.set_options(fault_http_503=1.0)
    status, ans = await post(session, vllm.url, "/inference/v1/generate", gen_body())
    assert status == 503 and ans["error"]["code"] == 503
    vllm.set_options(fault_http_503=0.0, fault_abort=1.0)
    rows = [[1]] * (L - 1)
    status, ans = await post(
        session, vllm.url, "/inference/v1/generate", gen_body(prompt_logprob_token_ids=rows)
    )
    assert status == 200 and ans["choices"][0]["finish_reason"] == "abort"
    assert ans["prompt_token_id_logprobs"] is None
    vllm.set_options(fault_abort=0.0, fault_missing_rows=1.0)
    _, ans = await post(
        session, vllm.url, "/inference/v1/generate", gen_body(prompt_logprob_token_ids=rows)
    )
    assert npy(ans).shape == (L - 2, 1)
    assert vllm.stats[0].faults == {"http_503": 1, "abort": 1, "missing_rows": 1}


async def test_info_endpoints_and_sglang_paths_are_404(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    async with session.get(vllm.url + "/version") as r:
        assert (await r.json())["version"] == "0.34.0"
    async with session.get(vllm.url + "/v1/models") as r:
        card = (await r.json())["data"][0]
        assert card["id"] == "mock-teacher" and card["max_model_len"] == OPTS.context_length
    async with session.get(vllm.url + "/health") as r:
        assert r.status == 200
    status, ans = await post(session, vllm.url, "/generate", {"input_ids": TOKENS})
    assert status == 404 and ans == {"detail": "Not Found"}


async def test_api_key_guards_the_v1_and_inference_paths(session: aiohttp.ClientSession) -> None:
    opts = VllmMockOptions(vocab_size=V, head_size=H, api_key="k")
    async with serve_vllm_mock(options=opts) as srv:
        status, ans = await post(session, srv.url, "/inference/v1/generate", gen_body())
        assert status == 401 and ans == {"error": "Unauthorized"}
        async with session.post(
            srv.url + "/inference/v1/generate",
            json=gen_body(),
            headers={"Authorization": "Bearer k"},
        ) as r:
            assert r.status == 200
        async with session.get(srv.url + "/health") as r:
            assert r.status == 200


def test_cli_serves_and_no_scale_out_answers_403() -> None:
    import urllib.error
    import urllib.request

    import msgspec

    body = msgspec.json.encode(gen_body([1, 2, 3], prompt_logprob_token_ids=[[2], [3]]))
    opts = VllmMockOptions(vocab_size=V, head_size=H, max_logprobs=3)
    with VllmMockProcess(options=opts) as proc:
        req = urllib.request.Request(proc.url + "/inference/v1/generate", data=body)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=30) as r:
            ans = msgspec.json.decode(r.read())
        assert npy(ans).shape == (2, 1)
        assert "--max-logprobs" in proc.argv()
    with VllmMockProcess(options=opts, scale_out=False) as proc:
        req = urllib.request.Request(proc.url + "/inference/v1/generate", data=body)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 403
        err.value.close()


async def test_an_actual_token_inside_the_top_n_keeps_first_place_with_its_top_rank(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    prefix = TOKENS[:5]
    second = int(MODEL.topk(np.array([*prefix, 0]), [5], 2)[0][0, 1])
    toks = [*prefix, second]
    _, ans = await post(
        session, vllm.url, "/inference/v1/generate", gen_body(toks, prompt_logprobs=3)
    )
    d = ans["prompt_logprobs"][5]
    best, _, third = MODEL.topk(np.array(toks), [5], 3)[0][0].tolist()
    assert list(d) == [str(second), str(best), str(third)]
    assert [e["rank"] for e in d.values()] == [2, 1, 3]


async def test_what_the_mock_does_not_serve_is_refused_not_ignored(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    for body in (gen_body(logprobs=2), {**gen_body(), "stream": True}):
        status, ans = await post(session, vllm.url, "/inference/v1/generate", body)
        assert status == 400 and "mock vLLM server" in ans["error"]["message"]
    status, ans = await post(
        session, vllm.url, "/v1/completions", {"prompt": "text", "max_tokens": 1}
    )
    assert status == 400 and "no tokenizer" in ans["error"]["message"]


async def test_another_model_name_is_vllms_404(
    vllm: MockCluster, session: aiohttp.ClientSession
) -> None:
    for path, body in (
        ("/inference/v1/generate", {**gen_body(), "model": "other"}),
        ("/v1/completions", {"prompt": TOKENS, "max_tokens": 1, "model": "other"}),
    ):
        status, ans = await post(session, vllm.url, path, body)
        assert status == 404
        assert ans["error"] == {
            "message": "The model `other` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    status, _ = await post(
        session,
        vllm.url,
        "/v1/completions",
        {"prompt": TOKENS, "max_tokens": 1, "model": "mock-teacher"},
    )
    assert status == 200


async def test_byte_model_and_offset_move_vllm_values_as_sglang_ones(
    session: aiohttp.ClientSession,
) -> None:
    bm = ByteModel([bytes([i % 251 + 1]) * (1 + i % 3) for i in range(V)], q=0.6)
    sg = MockOptions(vocab_size=V, head_size=H, logprob_offset=-0.25)
    vo = VllmMockOptions(vocab_size=V, head_size=H, logprob_offset=-0.25)
    start = 4
    rows = [[TOKENS[start + i + 1], 2] for i in range(L - 1 - start)]
    async with (
        serve_vllm_mock(options=vo, byte_model=bm) as v,
        serve_mock(options=sg, byte_model=bm) as s,
    ):
        _, va = await post(
            session,
            v.url,
            "/inference/v1/generate",
            gen_body(prompt_logprob_start=start, prompt_logprob_token_ids=rows, prompt_logprobs=2),
        )
        _, sa = await post(
            session,
            s.url,
            "/generate",
            {
                "input_ids": TOKENS,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": start,
                "top_logprobs_num": 2,
                "token_ids_logprob": [2],
            },
        )
    meta = sa["meta_info"]
    arr = npy(va)
    want = [row[0] for row in meta["input_token_logprobs"][1:]]
    assert arr[:, 0].tolist() == want  # the byte model's values, offset
    assert want[0] == float(np.float32(bm.token_logprobs(np.array(TOKENS), [start + 1])[0] - 0.25))
    assert arr[:, 1].tolist() == [r[0][0] for r in meta["input_token_ids_logprobs"][1:]]
    for p, top in zip(range(start + 1, L), meta["input_top_logprobs"][1:], strict=True):
        d = va["prompt_logprobs"][p]
        assert [d[str(t[1])]["logprob"] for t in top] == [t[0] for t in top]
