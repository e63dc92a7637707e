"""SGLang 0.5.23's flat (and b64) OUTPUT top-k: the mock, the scoring path, the generation path.

The flags: ``return_flat_raw_top_logprobs`` (input side), ``return_flat_raw_output_top_logprobs``
(output side, finished response only) and ``return_flat_raw_top_logprobs_b64`` (base64
float32 / int32 instead of JSON lists; needs one of the other two). Every value is checked
against ``MockModel`` evaluated one position at a time (float64, rounded to float32 as SGLang
emits it).
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.sglang_api import post_json

from opd_stream._errors import MalformedResponseError, MisalignedResponseError, OPDStreamError
from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.testing.mock_sglang import MockCluster, MockModel, serve_mock
from opd_stream.wire._answers import ScoreRows
from opd_stream.wire._codec import decode_score_response
from opd_stream.wire._decode_generate import decode_generate_response
from opd_stream.wire._payloads import build_generate_payload, build_score_payload
from opd_stream.wire._request import ScoreRequest

V = 151936
SEED = 11
K = 4
MODEL = MockModel("teacher", seed=SEED, vocab_size=V)
PROMPT = np.random.default_rng(5).integers(0, V - 2, size=12).tolist()
L = len(PROMPT)
FLAGS = (
    "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64",
)
B64_REQUIRES = (
    "return_flat_raw_top_logprobs_b64 requires return_flat_raw_top_logprobs "
    "or return_flat_raw_output_top_logprobs."
)
STREAM_REJECTED = (
    "return_flat_raw_output_top_logprobs is only set on the finished response and does not "
    "support stream=True."
)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # the aiohttp mock server needs asyncio


@pytest.fixture
async def server() -> AsyncIterator[MockCluster]:
    async with serve_mock("teacher", SEED) as srv:
        yield srv


# ---------------------------------------------------------------- helpers


def ask(body: dict[str, Any] | bytes) -> tuple[int, bytes]:
    """The sans-IO mock's answer; a fresh server each time, so sampling is repeatable."""
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    resp = InProcessSGLang("teacher", SEED, vocab_size=V).handle("POST", "/generate", raw)
    return resp.status, resp.body


def answer(body: dict[str, Any] | bytes) -> Any:
    status, raw = ask(body)
    assert status == 200, raw[:300]
    return msgspec.json.decode(raw)


def body_of(max_new: int = 0, start: int = 0, **extra: Any) -> dict[str, Any]:
    sp: dict[str, Any] = {"temperature": 0 if max_new == 0 else 1.0, "max_new_tokens": max_new}
    out: dict[str, Any] = {
        "input_ids": PROMPT,
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": K,
        "return_text_in_logprobs": False,
        "stream": False,
    }
    out.update(extra)
    return out


def f32(x: float) -> float | None:
    """A logprob as SGLang's JSON carries it: float32-rounded, -inf as null."""
    return None if x == -math.inf else float(np.float32(x))


def ref_rows(tokens: list[int], positions: list[int]) -> tuple[list[list[int]], list[list[Any]]]:
    """Top-K ids and JSON logprobs at each absolute position, one position at a time."""
    ids, lps = [], []
    for p in positions:
        i, lp = MODEL.topk(np.array(tokens[:p], dtype=np.int64), [p], K)
        ids.append([int(t) for t in i[0]])
        lps.append([f32(float(x)) for x in lp[0]])
    return ids, lps


def unpack(meta: dict[str, Any], side: str) -> tuple[list[list[int]], list[list[Any]], int]:
    """(ids, JSON-style logprobs, null_prefix) of a side's flat fields, b64 or plain."""
    rows, k = meta[f"{side}_top_logprobs_shape"]
    prefix = meta[f"{side}_top_logprobs_null_prefix"]
    if f"{side}_top_logprobs_val_flat_b64" in meta:
        raw_v = base64.b64decode(meta[f"{side}_top_logprobs_val_flat_b64"])
        raw_i = base64.b64decode(meta[f"{side}_top_logprobs_idx_flat_b64"])
        vals: list[Any] = [f32(v) for v in struct.unpack(f"<{rows * k}f", raw_v)]
        idx = list(struct.unpack(f"<{rows * k}i", raw_i))
    else:
        vals, idx = meta[f"{side}_top_logprobs_val_flat"], meta[f"{side}_top_logprobs_idx_flat"]
    assert len(vals) == len(idx) == rows * k
    return (
        [idx[r * k : (r + 1) * k] for r in range(rows)],
        [vals[r * k : (r + 1) * k] for r in range(rows)],
        prefix,
    )


def nested(rows: list[Any]) -> tuple[list[list[int]], list[list[Any]]]:
    return [[e[1] for e in row] for row in rows], [[e[0] for e in row] for row in rows]


COMBOS = [
    {"return_flat_raw_top_logprobs": fi, "return_flat_raw_output_top_logprobs": fo, **b}
    for fi in (False, True)
    for fo in (False, True)
    for b in ({"return_flat_raw_top_logprobs_b64": True}, {})
    if (fi or fo or not b)
]
COMBO_IDS = ["".join("1" if c.get(f) else "0" for f in FLAGS) for c in COMBOS]


# ---------------------------------------------------------------- mock: answers


@pytest.mark.parametrize("flags", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("start", [0, 4, L - 1, L])
def test_mock_scoring_answer_carries_each_side_in_the_asked_form_with_the_model_values(
    flags: dict[str, bool], start: int
) -> None:
    meta = answer(body_of(start=start, **flags))["meta_info"]
    in_ids, in_lps = ref_rows(PROMPT, list(range(start + 1, L)))  # entries 1.. of L - s
    out_ids, out_lps = ref_rows(PROMPT, [L])
    b64 = bool(flags.get("return_flat_raw_top_logprobs_b64"))
    for side, flat, want_ids, want_lps, want_prefix in (
        ("input", flags["return_flat_raw_top_logprobs"], in_ids, in_lps, int(start < L)),
        ("output", flags["return_flat_raw_output_top_logprobs"], out_ids, out_lps, 0),
    ):
        if flat:
            assert f"{side}_top_logprobs" not in meta
            assert (f"{side}_top_logprobs_val_flat_b64" in meta) is b64
            assert (f"{side}_top_logprobs_val_flat" in meta) is not b64
            assert meta[f"{side}_top_logprobs_shape"] == [len(want_ids), K]
            assert unpack(meta, side) == (want_ids, want_lps, want_prefix)
        else:
            assert not [key for key in meta if key.startswith(f"{side}_top_logprobs_")]
            assert nested(meta[f"{side}_top_logprobs"][want_prefix:]) == (want_ids, want_lps)
            assert meta[f"{side}_top_logprobs"][:want_prefix] == [None] * want_prefix


@pytest.mark.parametrize("b64", [True, False])
def test_mock_generation_answers_the_flat_output_rows_of_the_generated_tokens(b64: bool) -> None:
    flags = {"return_flat_raw_output_top_logprobs": True}
    if b64:
        flags["return_flat_raw_top_logprobs_b64"] = True
    gen = {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 3}
    plain = answer(body_of(sampling_params=gen, logprob_start_len=-1))
    flat = answer(body_of(sampling_params=gen, logprob_start_len=-1, **flags))
    assert flat["output_ids"] == plain["output_ids"]
    out = plain["output_ids"]
    full = PROMPT + out
    want_ids, want_lps = ref_rows(full, list(range(L, L + len(out))))
    assert nested(plain["meta_info"]["output_top_logprobs"]) == (want_ids, want_lps)
    assert unpack(flat["meta_info"], "output") == (want_ids, want_lps, 0)
    assert flat["meta_info"]["input_top_logprobs"] == []  # input side: nested, no rows


def test_mock_b64_fields_follow_sglang_key_order_and_dtype_markers() -> None:
    meta = answer(body_of(**dict.fromkeys(FLAGS, True)))["meta_info"]
    keys = [k for k in meta if "_top_logprobs" in k]
    assert keys == [
        f"{side}_top_logprobs_{suffix}"
        for side in ("input", "output")
        for suffix in (
            "val_flat_b64",
            "idx_flat_b64",
            "val_flat_b64_dtype",
            "idx_flat_b64_dtype",
            "shape",
            "null_prefix",
        )
    ]
    assert meta["output_top_logprobs_val_flat_b64_dtype"] == "float32"
    assert meta["output_top_logprobs_idx_flat_b64_dtype"] == "int32"


def test_mock_json_flat_fields_follow_sglang_key_order() -> None:
    meta = answer(body_of(return_flat_raw_output_top_logprobs=True))["meta_info"]
    keys = [k for k in meta if k.startswith("output_top_logprobs")]
    assert keys == [
        "output_top_logprobs_val_flat",
        "output_top_logprobs_idx_flat",
        "output_top_logprobs_shape",
        "output_top_logprobs_null_prefix",
    ]


def test_mock_batch_applies_the_flags_to_every_item() -> None:
    b = body_of(
        input_ids=[PROMPT, PROMPT[:7]],
        return_flat_raw_output_top_logprobs=True,
        return_flat_raw_top_logprobs_b64=True,
    )
    items = answer(b)
    for item, prompt in zip(items, [PROMPT, PROMPT[:7]], strict=True):
        assert unpack(item["meta_info"], "output") == (*ref_rows(prompt, [len(prompt)]), 0)


@pytest.mark.parametrize(
    "extra",
    [{"top_logprobs_num": 0}, {"return_logprob": False}],
    ids=["no top-k", "no logprobs"],
)
def test_mock_flags_without_top_k_add_no_field(extra: dict[str, Any]) -> None:
    meta = answer(body_of(**dict.fromkeys(FLAGS, True), **extra))["meta_info"]
    assert not [k for k in meta if "top_logprobs" in k]


# ---------------------------------------------------------------- mock: validation


async def test_b64_without_a_flat_flag_is_a_400_value_error(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    status, body = await post_json(
        session, server.url, body_of(return_flat_raw_top_logprobs_b64=True)
    )
    assert status == 400
    assert body == {"error": {"message": B64_REQUIRES}}


async def stream_error(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, str, bytes]:
    async with session.post(url + "/generate", data=msgspec.json.encode(body)) as resp:
        return resp.status, resp.content_type, await resp.read()


def sse_error(message: str) -> bytes:
    err = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
    return b"data: " + msgspec.json.encode({"error": err}) + b"\n\ndata: [DONE]\n\n"


@pytest.mark.parametrize(
    "flags",
    [
        {"return_flat_raw_output_top_logprobs": True},
        {"return_flat_raw_output_top_logprobs": True, "return_flat_raw_top_logprobs_b64": True},
        dict.fromkeys(FLAGS, True),
    ],
    ids=["flat", "b64", "all"],
)
async def test_flat_output_with_stream_is_an_in_stream_error_on_http_200(
    server: MockCluster, session: aiohttp.ClientSession, flags: dict[str, bool]
) -> None:
    got = await stream_error(session, server.url, body_of(stream=True, **flags))
    assert got == (200, "text/event-stream", sse_error(STREAM_REJECTED))


async def test_b64_alone_with_stream_is_an_in_stream_error(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    got = await stream_error(
        session, server.url, body_of(stream=True, return_flat_raw_top_logprobs_b64=True)
    )
    assert got == (200, "text/event-stream", sse_error(B64_REQUIRES))


async def test_other_value_errors_of_a_stream_request_are_in_stream_too(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    got = await stream_error(session, server.url, body_of(stream=True, input_ids=[]))
    assert got == (200, "text/event-stream", sse_error("input_ids cannot be empty."))


async def test_flat_input_with_stream_is_allowed(
    server: MockCluster, session: aiohttp.ClientSession
) -> None:
    status, ctype, raw = await stream_error(
        session,
        server.url,
        body_of(
            stream=True, return_flat_raw_top_logprobs=True, return_flat_raw_top_logprobs_b64=True
        ),
    )
    assert (status, ctype) == (200, "text/event-stream")
    chunk = msgspec.json.decode(raw.split(b"\n\n")[0].removeprefix(b"data: "))
    assert unpack(chunk["meta_info"], "input")[0] == ref_rows(PROMPT, list(range(1, L)))[0]


@pytest.mark.parametrize(
    ("value", "on"),
    [("yes", True), ("Off", False), (1, True), (0.0, False)],
)
def test_flags_are_parsed_as_pydantic_lax_booleans(value: Any, on: bool) -> None:
    meta = answer(body_of(return_flat_raw_output_top_logprobs=value))["meta_info"]
    assert ("output_top_logprobs_shape" in meta) is on
    assert ("output_top_logprobs" in meta) is not on


@pytest.mark.parametrize(
    ("value", "kind"),
    [(None, "bool_type"), ("maybe", "bool_parsing"), (2, "bool_parsing"), ([True], "bool_type")],
)
def test_a_flag_that_is_not_a_boolean_is_a_validation_error(value: Any, kind: str) -> None:
    status, raw = ask(body_of(return_flat_raw_top_logprobs_b64=value))
    body = msgspec.json.decode(raw)
    assert status == 400
    assert body["object"] == "error"
    assert body["type"] == "Bad Request"
    assert kind in body["message"]
    assert "return_flat_raw_top_logprobs_b64" in body["message"]


async def test_flag_requests_and_answers_pass_sglang_api_contract(
    server: MockCluster, session: aiohttp.ClientSession, api_types: ModuleType
) -> None:
    gen = {"temperature": 1.0, "max_new_tokens": 3, "sampling_seed": 1}
    for b in [body_of(**c) for c in COMBOS] + [
        body_of(sampling_params=gen, **dict.fromkeys(FLAGS[1:], True)),
        body_of(input_ids=[PROMPT, PROMPT[:5]], **dict.fromkeys(FLAGS, True)),
    ]:
        api_types.GenerateRequest.from_json_value(b)
        status, got = await post_json(session, server.url, b)
        assert status == 200
        for item in got if isinstance(got, list) else [got]:
            api_types.GenerateResponse.from_json_value(item)


# ---------------------------------------------------------------- request bytes

SCORE_B64 = (
    b'{"input_ids":[5,6,7],"sampling_params":{"temperature":0,"max_new_tokens":0},'
    b'"return_logprob":true,"logprob_start_len":1,"top_logprobs_num":2,'
    b'"return_flat_raw_top_logprobs":true,"return_flat_raw_output_top_logprobs":true,'
    b'"return_flat_raw_top_logprobs_b64":true,"return_text_in_logprobs":false,"stream":false}'
)


def test_b64_scoring_request_asks_both_sides_flat_in_b64() -> None:
    req = ScoreRequest(tokens=np.array([5, 6, 7]), response_length=1, top_k=2, topk_wire="b64")
    assert build_score_payload(req) == SCORE_B64


def test_json_scoring_request_sends_no_flat_flag() -> None:
    req = ScoreRequest(tokens=np.array([5, 6, 7]), response_length=1, top_k=2)
    assert b"flat_raw" not in build_score_payload(req)


def test_b64_generation_request_asks_the_output_side_flat_in_b64() -> None:
    got = build_generate_payload([1, 2], 3, top_logprobs_num=2, seed=9, topk_wire="b64")
    assert got == (
        b'{"input_ids":[1,2],"sampling_params":{"temperature":1.0,"max_new_tokens":3,'
        b'"sampling_seed":9},"return_logprob":true,"top_logprobs_num":2,'
        b'"return_flat_raw_output_top_logprobs":true,"return_flat_raw_top_logprobs_b64":true,'
        b'"return_text_in_logprobs":false,"stream":false}'
    )


def test_generation_request_defaults_to_nested_top_k() -> None:
    assert build_generate_payload([1, 2], 3, top_logprobs_num=2) == (
        b'{"input_ids":[1,2],"sampling_params":{"temperature":1.0,"max_new_tokens":3},'
        b'"return_logprob":true,"top_logprobs_num":2,"return_text_in_logprobs":false,'
        b'"stream":false}'
    )


def test_b64_generation_request_without_top_k_sends_no_flag() -> None:
    assert build_generate_payload([1, 2], 3, topk_wire="b64") == build_generate_payload([1, 2], 3)


def test_generation_request_rejects_an_unknown_topk_wire() -> None:
    with pytest.raises(ValueError, match="topk_wire"):
        build_generate_payload([1, 2], 3, top_logprobs_num=2, topk_wire="xml")  # type: ignore[arg-type]


def test_b64_requests_pass_sglang_api_contract_and_the_mock(api_types: ModuleType) -> None:
    bodies = [
        SCORE_B64,
        build_generate_payload([[1, 2], [3]], 3, top_logprobs_num=2, topk_wire="b64"),
    ]
    for raw in bodies:
        api_types.GenerateRequest.from_json_value(msgspec.json.decode(raw))
        assert ask(raw)[0] == 200


# ---------------------------------------------------------------- scoring decoder

TOKENS = np.array(PROMPT + np.random.default_rng(6).integers(0, V - 2, size=7).tolist())
R = 7
P = TOKENS.size - R
IDS = np.random.default_rng(8).integers(0, V - 2, size=(R, 3))


def score_request(id_form: str | None) -> ScoreRequest:
    extra: dict[str, Any] = {} if id_form is None else {"ids": IDS, "id_form": id_form}
    if id_form == "blocked":
        extra["block_size"] = 3
    return ScoreRequest(tokens=TOKENS, response_length=R, top_k=K, topk_wire="b64", **extra)


def to_json_flat(meta: dict[str, Any], side: str) -> None:
    """Rewrite a side's b64 fields as the JSON flat form (SGLang's non-b64 output)."""
    ids, lps, _ = unpack(meta, side)
    for key in [k for k in meta if k.startswith(f"{side}_top_logprobs_") and "b64" in k]:
        del meta[key]
    meta[f"{side}_top_logprobs_val_flat"] = [v for row in lps for v in row]
    meta[f"{side}_top_logprobs_idx_flat"] = [i for row in ids for i in row]


def score_variants(req: ScoreRequest) -> dict[str, bytes]:
    """One request answered with the output top-k row in each form SGLang may use."""
    payload = build_score_payload(req)
    b64 = answer(payload)
    sent = msgspec.json.decode(payload)
    del sent["return_flat_raw_output_top_logprobs"]  # a server that ignores the flag
    ignored = answer(sent)
    json_flat = answer(payload)
    none = answer(payload)
    for item in json_flat if isinstance(json_flat, list) else [json_flat]:
        to_json_flat(item["meta_info"], "output")
    for item in none if isinstance(none, list) else [none]:
        for key in [k for k in item["meta_info"] if k.startswith("output_top_logprobs")]:
            del item["meta_info"][key]
    return {
        name: msgspec.json.encode(obj)
        for name, obj in (("b64", b64), ("nested", ignored), ("json", json_flat), ("none", none))
    }


def as_float(v: float | None) -> float:
    return -math.inf if v is None else v


def ref_logprob(p: int, token: int) -> float:
    """``log p(token | TOKENS[:p])`` as the decoder returns it (float32, -inf for null)."""
    return as_float(f32(float(MODEL.logprobs(TOKENS[:p], [p], [[token]])[0, 0])))


def assert_score_rows_match_the_model(rows: ScoreRows, with_ids: bool) -> None:
    ids, lps = ref_rows(TOKENS.tolist(), list(range(P, P + R)))
    assert rows.top_ids is not None
    assert rows.top_logprobs is not None
    assert rows.top_ids.tolist() == ids
    assert rows.top_logprobs.tolist() == [[as_float(v) for v in row] for row in lps]
    want = [ref_logprob(P + t, int(TOKENS[P + t])) for t in range(R)]
    assert rows.token_logprobs.tolist() == want
    if with_ids:
        assert rows.id_logprobs is not None
        got = rows.id_logprobs.tolist()
        for t in range(R):
            assert got[t] == [ref_logprob(P + t, int(i)) for i in IDS[t]]


@pytest.mark.parametrize("id_form", [None, "per-position", "flat", "blocked"])
def test_scoring_decodes_alike_whatever_form_the_output_row_takes(id_form: str | None) -> None:
    req = score_request(id_form)
    decoded = {name: decode_score_response(b, req) for name, b in score_variants(req).items()}
    assert_score_rows_match_the_model(decoded["b64"], with_ids=id_form is not None)
    for name, rows in decoded.items():
        assert rows.used_b64 is True, name
        for field in ("token_ids", "token_logprobs", "top_ids", "top_logprobs", "id_logprobs"):
            got, want = getattr(rows, field), getattr(decoded["b64"], field)
            if want is None:
                assert got is None
            else:
                np.testing.assert_array_equal(got, want, err_msg=f"{name}.{field}")


def test_scoring_answer_with_every_side_nested_still_decodes() -> None:
    req = score_request("per-position")
    sent = msgspec.json.decode(build_score_payload(req))
    for flag in FLAGS:
        del sent[flag]
    rows = decode_score_response(msgspec.json.encode(answer(sent)), req)
    assert rows.used_b64 is False
    assert_score_rows_match_the_model(rows, with_ids=True)


# ---------------------------------------------------------------- generation decoder

GEN = {"temperature": 1.0, "max_new_tokens": 5, "sampling_seed": 4}


def generation_answer(topk_wire: str, json_flat: bool = False) -> Any:
    raw = build_generate_payload(
        [PROMPT, PROMPT[:6]],
        5,
        top_logprobs_num=K,
        seed=4,
        topk_wire=topk_wire,  # type: ignore[arg-type]
    )
    got = answer(raw)
    if json_flat:
        for item in got:
            to_json_flat(item["meta_info"], "output")
    return got


@pytest.mark.parametrize(
    ("topk_wire", "json_flat"), [("b64", False), ("b64", True), ("json", False)]
)
def test_generation_top_k_matches_the_model_in_every_form(topk_wire: str, json_flat: bool) -> None:
    items = generation_answer(topk_wire, json_flat)
    assert ("output_top_logprobs" in items[0]["meta_info"]) is (topk_wire == "json")
    gens = decode_generate_response(msgspec.json.encode(items))
    for gen, prompt in zip(gens, [PROMPT, PROMPT[:6]], strict=True):
        out = gen.output_ids.tolist()
        ids, lps = ref_rows(prompt + out, list(range(len(prompt), len(prompt) + len(out))))
        assert gen.output_top_ids is not None
        assert gen.output_top_logprobs is not None
        assert gen.output_top_ids.dtype == np.int64
        assert gen.output_top_logprobs.dtype == np.float32
        assert gen.output_top_ids.tolist() == ids
        assert gen.output_top_logprobs.tolist() == [[as_float(v) for v in row] for row in lps]


def test_generation_flat_and_nested_decode_to_equal_arrays() -> None:
    runs = [
        decode_generate_response(msgspec.json.encode(generation_answer(w, j)))
        for w, j in (("json", False), ("b64", False), ("b64", True))
    ]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            np.testing.assert_array_equal(a.output_ids, b.output_ids)
            np.testing.assert_array_equal(a.output_logprobs, b.output_logprobs)
            np.testing.assert_array_equal(a.output_top_ids, b.output_top_ids)
            np.testing.assert_array_equal(a.output_top_logprobs, b.output_top_logprobs)


# Hand-made answers: 2 output tokens, k = 2.
VALS = [-0.5, -1.25, -0.75, -2.0]
IDX = [7, 3, 4, 9]


def b64_of(fmt: str, values: list[Any]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}{fmt}", *values)).decode()


def gen_item(form: str = "b64", vals: list[Any] = VALS, idx: list[int] = IDX) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": "g",
        "finish_reason": {"type": "length", "length": 2},
        "output_token_logprobs": [[-0.5, 7, None], [-0.75, 4, None]],
    }
    if form == "b64":
        meta["output_top_logprobs_val_flat_b64"] = b64_of("f", vals)
        meta["output_top_logprobs_idx_flat_b64"] = b64_of("i", idx)
        meta["output_top_logprobs_val_flat_b64_dtype"] = "float32"
        meta["output_top_logprobs_idx_flat_b64_dtype"] = "int32"
    else:
        meta["output_top_logprobs_val_flat"] = vals
        meta["output_top_logprobs_idx_flat"] = idx
    meta["output_top_logprobs_shape"] = [2, 2]
    meta["output_top_logprobs_null_prefix"] = 0
    return {"text": "", "output_ids": [7, 4], "meta_info": meta}


def decode_one(item: dict[str, Any]) -> Any:
    (gen,) = decode_generate_response(msgspec.json.encode(item))
    return gen


@pytest.mark.parametrize("form", ["b64", "json"])
def test_generation_flat_top_k_decodes_row_major(form: str) -> None:
    gen = decode_one(gen_item(form))
    assert gen.output_top_ids.tolist() == [[7, 3], [4, 9]]
    assert gen.output_top_logprobs.tolist() == [[-0.5, -1.25], [-0.75, -2.0]]


def test_generation_json_flat_null_is_minus_inf() -> None:
    gen = decode_one(gen_item("json", vals=[-0.5, None, -0.75, -2.0]))
    assert gen.output_top_logprobs[0, 1] == -np.inf


def test_generation_b64_keeps_minus_inf_and_maps_nan_to_minus_inf() -> None:
    gen = decode_one(gen_item("b64", vals=[-0.5, -math.inf, math.nan, -2.0]))
    assert gen.output_top_logprobs.tolist() == [[-0.5, -np.inf], [-np.inf, -2.0]]


@pytest.mark.parametrize(
    ("form", "vals"), [("b64", [-0.5, math.inf, -1.0, -2.0]), ("json", [-0.5, 1e39, -1.0, -2.0])]
)
def test_generation_value_above_float32_range_is_malformed(form: str, vals: list[Any]) -> None:
    with pytest.raises(MalformedResponseError, match="float32 range"):
        decode_one(gen_item(form, vals=vals))


def test_generation_b64_fields_win_over_nested_rows() -> None:
    item = gen_item("b64")
    item["meta_info"]["output_top_logprobs"] = [[[-9.0, 1, None]], [[-9.0, 2, None]]]
    assert decode_one(item).output_top_ids.tolist() == [[7, 3], [4, 9]]


def test_generation_without_any_top_k_form_has_none() -> None:
    item = gen_item("b64")
    for key in [k for k in item["meta_info"] if k.startswith("output_top_logprobs_")]:
        del item["meta_info"][key]
    gen = decode_one(item)
    assert gen.output_top_ids is None
    assert gen.output_top_logprobs is None


def _drop(key: str) -> Any:
    def edit(meta: dict[str, Any]) -> None:
        del meta[key]

    return edit


def _set(key: str, value: Any) -> Any:
    def edit(meta: dict[str, Any]) -> None:
        meta[key] = value

    return edit


BASE = "output_top_logprobs"
BAD_ANSWERS: list[tuple[str, str, Any, type[Exception], str]] = [
    ("no b64 idx", "b64", _drop(f"{BASE}_idx_flat_b64"), MalformedResponseError, "_idx_flat_b64`"),
    ("no b64 val", "b64", _drop(f"{BASE}_val_flat_b64"), MalformedResponseError, "_val_flat_b64`"),
    ("no json idx", "json", _drop(f"{BASE}_idx_flat"), MalformedResponseError, "_idx_flat`"),
    ("no json val", "json", _drop(f"{BASE}_val_flat"), MalformedResponseError, "_val_flat`"),
    ("no shape", "b64", _drop(f"{BASE}_shape"), MalformedResponseError, "_shape`"),
    ("no prefix", "json", _drop(f"{BASE}_null_prefix"), MalformedResponseError, "_null_prefix`"),
    ("3-d shape", "b64", _set(f"{BASE}_shape", [1, 2, 2]), MalformedResponseError, "3 elements"),
    ("negative dim", "b64", _set(f"{BASE}_shape", [-2, -2]), MalformedResponseError, "outside"),
    ("huge dim", "json", _set(f"{BASE}_shape", [2**40, 0]), MalformedResponseError, "outside"),
    ("shape type", "b64", _set(f"{BASE}_shape", "2x2"), MalformedResponseError, "_shape`"),
    ("negative prefix", "b64", _set(f"{BASE}_null_prefix", -1), MalformedResponseError, ">= 0"),
    (
        "val dtype",
        "b64",
        _set(f"{BASE}_val_flat_b64_dtype", "float16"),
        MalformedResponseError,
        "'float16', expected 'float32'",
    ),
    (
        "idx dtype",
        "b64",
        _set(f"{BASE}_idx_flat_b64_dtype", "int64"),
        MalformedResponseError,
        "'int64', expected 'int32'",
    ),
    (
        "bad base64",
        "b64",
        _set(f"{BASE}_val_flat_b64", "AAA$AAAA"),
        MalformedResponseError,
        "not valid base64",
    ),
    (
        "short buffer",
        "b64",
        _set(f"{BASE}_idx_flat_b64", b64_of("i", [1, 2, 3])),
        MalformedResponseError,
        "12 bytes, expected 16",
    ),
    (
        "json val count",
        "json",
        _set(f"{BASE}_val_flat", [-1.0] * 5),
        MalformedResponseError,
        "has 5 values, expected 4",
    ),
    (
        "json idx count",
        "json",
        _set(f"{BASE}_idx_flat", [1, 2, 3]),
        MalformedResponseError,
        "has 3 values, expected 4",
    ),
    (
        "rows != tokens",
        "json",
        lambda m: m.update(
            {f"{BASE}_shape": [1, 4], f"{BASE}_val_flat": VALS, f"{BASE}_idx_flat": IDX}
        ),
        MisalignedResponseError,
        "null_prefix 0 \\+ 1 rows, expected 2",
    ),
    (
        "null row",
        "json",
        lambda m: m.update(
            {
                f"{BASE}_shape": [1, 2],
                f"{BASE}_null_prefix": 1,
                f"{BASE}_val_flat": VALS[2:],
                f"{BASE}_idx_flat": IDX[2:],
            }
        ),
        MisalignedResponseError,
        "output positions 0..0 are null",
    ),
]


@pytest.mark.parametrize(
    ("form", "edit", "error", "message"),
    [c[1:] for c in BAD_ANSWERS],
    ids=[c[0] for c in BAD_ANSWERS],
)
def test_generation_rejects_inconsistent_flat_fields_on_the_student_side(
    form: str, edit: Any, error: type[Exception], message: str
) -> None:
    item = gen_item(form)
    edit(item["meta_info"])
    with pytest.raises(error, match=message) as info:
        decode_one(item)
    assert getattr(info.value, "side", None) == "student"
    text = str(info.value)
    assert item["meta_info"].get(f"{BASE}_val_flat_b64", "@@") not in text
    assert "-1.25" not in text  # no payload value in the message


# ---------------------------------------------------------------- generation decoder fuzz

_b64_text = st.one_of(
    st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
    st.text(max_size=12),
)
_flat_meta = st.fixed_dictionaries(
    {},
    optional={
        f"{BASE}_shape": st.lists(st.integers(-3, 2**64 - 1), max_size=3),
        f"{BASE}_null_prefix": st.integers(-2, 2**63 - 1),
        f"{BASE}_val_flat_b64": _b64_text,
        f"{BASE}_idx_flat_b64": _b64_text,
        f"{BASE}_val_flat_b64_dtype": st.sampled_from(["float32", "float64", ""]),
        f"{BASE}_idx_flat_b64_dtype": st.sampled_from(["int32", "int8"]),
        f"{BASE}_val_flat": st.lists(st.one_of(st.none(), st.floats(), st.integers(-9, 9))),
        f"{BASE}_idx_flat": st.lists(st.integers(-(2**63), 2**63 - 1), max_size=8),
        f"{BASE}": st.lists(st.none(), max_size=3),
    },
)


@settings(max_examples=300, deadline=None)
@given(flat=_flat_meta)
def test_generation_decoder_raises_only_library_errors_on_any_flat_fields(
    flat: dict[str, Any],
) -> None:
    item = gen_item("b64")
    for key in [k for k in item["meta_info"] if k.startswith(BASE)]:
        del item["meta_info"][key]
    item["meta_info"].update(flat)
    error: OPDStreamError | None = None
    try:
        (gen,) = decode_generate_response(msgspec.json.encode(item))  # NaN / inf -> null
    except OPDStreamError as exc:
        error = exc
    if error is not None:
        assert getattr(error, "side", None) == "student"
        return
    if gen.output_top_ids is not None:
        assert gen.output_top_ids.shape == gen.output_top_logprobs.shape
        assert gen.output_top_ids.shape[0] == 2
        assert not np.isnan(gen.output_top_logprobs).any()
        assert not np.isposinf(gen.output_top_logprobs).any()
