"""The pyarrow parser (decode threads) against the msgspec decoder, on the same bytes.

The rule (``opd_stream._decode_arrow``): the arrow path accepts an answer only when the
msgspec decoder accepts it, and then gives exactly the same arrays; every other answer is
handed back (``None``) and ``decode_score_response(parser="arrow")`` raises the msgspec
decoder's error, type and message. The one documented leniency: an integral token id
written as a float (``5.0``) is read as ``5``.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import msgspec
import numpy as np
import pytest
import wire_fakes as wf
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_decode import FUZZ, REQUESTS, VALID, _mutate, _paths, field_values, json_values

from opd_stream import OPDStreamError
from opd_stream._answers import ScoreRows
from opd_stream._codec import decode_score_response
from opd_stream._decode_arrow import decode_segments_arrow
from opd_stream._decode_arrow_generate import decode_generate_arrow
from opd_stream._decode_generate import decode_generate_response
from opd_stream._payloads import build_score_payload
from opd_stream._wire import ScoreRequest
from opd_stream.testing.inprocess import InProcessSGLang

_LENIENT = "Expected `int`, got `float`"


def _fast(body: bytes | bytearray, req: ScoreRequest) -> ScoreRows | None:
    from opd_stream._wire import layout as _layout

    lay = _layout(req)
    return decode_segments_arrow(
        body, batch=lay.batch, segments=lay.segments, tokens=lay.tokens, top_k=req.top_k
    )


def _assert_same(a: ScoreRows, b: ScoreRows) -> None:
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray), name
            assert (x.dtype, x.shape) == (y.dtype, y.shape), name
            assert np.array_equal(x, y), name
        else:
            assert x == y, name


def _differential(body: bytes, req: ScoreRequest) -> None:
    fast = _fast(body, req)
    try:
        slow: ScoreRows | OPDStreamError = decode_score_response(body, req)
    except OPDStreamError as exc:
        slow = exc
    if fast is not None:
        if isinstance(slow, OPDStreamError):
            assert _LENIENT in str(slow), f"arrow accepted what msgspec rejects: {slow}"
        else:
            _assert_same(slow, fast)
    try:
        public: ScoreRows | OPDStreamError = decode_score_response(body, req, parser="arrow")
    except OPDStreamError as exc:
        public = exc
    if isinstance(slow, OPDStreamError) and fast is None:
        assert type(public) is type(slow) and str(public) == str(slow)


def _mock_requests() -> list[tuple[str, ScoreRequest]]:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 30000, 40 + 97, dtype=np.int64)
    ids = np.stack([rng.choice(150000, 5, replace=False) for _ in range(97)]).astype(np.int64)
    out = []
    for form in ("per-position", "flat", "blocked"):
        for top_k, wire in ((0, "json"), (3, "json"), (3, "b64")):
            for block in (0, 1, 7) if form == "blocked" else (0,):
                req = ScoreRequest(
                    tokens=tokens,
                    response_length=97,
                    top_k=top_k,
                    ids=ids,
                    id_form=form,  # type: ignore[arg-type]
                    topk_wire=wire,  # type: ignore[arg-type]
                    block_size=block,
                )
                out.append((f"{form}-k{top_k}-{wire}-B{block}", req))
    for top_k, wire in ((0, "json"), (4, "json"), (4, "b64")):
        for start in ("prompt", "zero"):
            req = ScoreRequest(
                tokens=tokens,
                response_length=97,
                top_k=top_k,
                topk_wire=wire,  # type: ignore[arg-type]
                start=start,  # type: ignore[arg-type]
            )
            out.append((f"noids-k{top_k}-{wire}-{start}", req))
    return out


MOCK = _mock_requests()


@pytest.mark.parametrize(("name", "req"), MOCK, ids=[n for n, _ in MOCK])
def test_mock_answers_decode_to_identical_arrays_with_both_parsers(
    name: str, req: ScoreRequest
) -> None:
    body = InProcessSGLang("teacher", 1).handle("POST", "/generate", build_score_payload(req)).body
    fast = _fast(body, req)
    assert fast is not None, "the arrow parser handed a valid answer back"
    _assert_same(decode_score_response(body, req), fast)
    _assert_same(decode_score_response(bytearray(body), req, parser="arrow"), fast)


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_fake_answers_decode_to_identical_arrays_with_both_parsers(name: str) -> None:
    body = wf.encode(VALID[name])
    fast = _fast(body, REQUESTS[name])
    assert fast is not None
    _assert_same(decode_score_response(body, REQUESTS[name]), fast)


@FUZZ
@given(
    name=st.sampled_from(sorted(REQUESTS)),
    data=st.data(),
    n_mutations=st.integers(min_value=1, max_value=3),
)
def test_mutated_answers_are_accepted_only_when_msgspec_accepts_them(
    name: str, data: st.DataObject, n_mutations: int
) -> None:
    obj = copy.deepcopy(VALID[name])
    for _ in range(n_mutations):
        path = data.draw(st.sampled_from(_paths(obj)))
        op = data.draw(
            st.sampled_from(["replace", "delete", "duplicate", "truncate", "bump", "b64-flip"])
        )
        obj = _mutate(obj, path, op, data.draw(field_values) if op == "replace" else None)
    _differential(json.dumps(obj).encode(), REQUESTS[name])


@FUZZ
@given(name=st.sampled_from(sorted(REQUESTS)), value=json_values)
def test_random_json_is_handed_back_with_msgspecs_error(name: str, value: Any) -> None:
    _differential(json.dumps(value).encode(), REQUESTS[name])


@FUZZ
@given(name=st.sampled_from(sorted(REQUESTS)), data=st.data())
def test_truncated_and_corrupted_bodies_are_handed_back(name: str, data: st.DataObject) -> None:
    body = wf.encode(VALID[name])
    cut = data.draw(st.integers(min_value=0, max_value=len(body)))
    junk = data.draw(st.binary(max_size=8))
    _differential(body[:cut] + junk, REQUESTS[name])


@pytest.mark.parametrize(
    ("label", "edit"),
    [
        ("NaN literal", lambda s: s.replace("-0.5", "NaN", 1)),
        ("Infinity literal", lambda s: s.replace("-0.5", "-Infinity", 1)),
        ("a second object after the answer", lambda s: s + "\n" + s),
        ("duplicate meta_info", lambda s: s[:-1] + ',"meta_info":{}}'),
        ("a boolean logprob", lambda s: s.replace("-0.5", "true", 1)),
        ("pretty-printed", lambda s: json.dumps(json.loads(s), indent=2)),
        ("a byte-order mark", lambda s: "\ufeff" + s),
    ],
)
def test_edge_answers_get_the_same_outcome_from_both_parsers(label: str, edit: Any) -> None:
    req = REQUESTS["ids-per-position"]
    obj = copy.deepcopy(VALID["ids-per-position"])
    obj["meta_info"]["input_token_ids_logprobs"][-1][0][0] = -0.5
    text = json.dumps(obj, separators=(",", ":"))
    _differential(edit(text).encode(), req)


def test_an_integral_float_id_is_the_one_documented_leniency() -> None:
    req = REQUESTS["ids-per-position"]
    obj = copy.deepcopy(VALID["ids-per-position"])
    row = obj["meta_info"]["input_token_ids_logprobs"][-1]
    text = json.dumps(obj, separators=(",", ":"))
    body = text.replace(f",{row[0][1]},", f",{row[0][1]}.0,", 1).encode()
    assert body != text.encode()
    with pytest.raises(OPDStreamError, match="Expected `int`, got `float`"):
        decode_score_response(body, req)
    fast = _fast(body, req)
    assert fast is not None
    _assert_same(decode_score_response(wf.encode(VALID["ids-per-position"]), req), fast)


def test_an_abort_is_reported_by_the_msgspec_decoder() -> None:
    req = REQUESTS["plain"]
    obj = copy.deepcopy(VALID["plain"])
    obj["meta_info"]["finish_reason"] = {"type": "abort", "message": "queue full"}
    body = wf.encode(obj)
    assert _fast(body, req) is None
    with pytest.raises(OPDStreamError, match="queue full") as info:
        decode_score_response(body, req, parser="arrow")
    assert info.value.reason == "aborted"


def _deep(body: bytes, levels: int) -> bytes:
    return b'{"deep":' + b"[" * levels + b"]" * levels + b"," + body[1:]


def test_an_unknown_field_nested_100k_deep_is_malformed_for_msgspec() -> None:
    req = REQUESTS["ids-per-position"]
    body = _deep(wf.encode(VALID["ids-per-position"]), 100_000)
    with pytest.raises(OPDStreamError, match="nested too deeply") as info:
        decode_score_response(body, req)
    assert info.value.reason == "malformed_response"


def test_the_arrow_parser_skips_a_deep_unknown_field_the_second_documented_leniency() -> None:
    req = REQUESTS["ids-per-position"]
    plain = wf.encode(VALID["ids-per-position"])
    fast = _fast(_deep(plain, 100_000), req)
    assert fast is not None
    _assert_same(decode_score_response(plain, req), fast)


@pytest.mark.parametrize(
    "name", ["plain", "topk-json", "topk-b64", "ids-per-position", "ids-blocked"]
)
def test_a_positive_logprob_is_malformed_for_both_parsers(name: str) -> None:
    req = REQUESTS[name]
    obj = copy.deepcopy(VALID[name])
    item = obj[-1] if isinstance(obj, list) else obj
    item["meta_info"]["input_token_logprobs"][-1][0] = 5.0
    body = wf.encode(obj)
    for parser in ("msgspec", "arrow"):
        with pytest.raises(OPDStreamError, match="logprob above 0") as info:
            decode_score_response(body, req, parser=parser)  # type: ignore[arg-type]
        assert info.value.reason == "malformed_response"


def test_a_tiny_positive_logprob_from_float_rounding_is_accepted() -> None:
    req = REQUESTS["plain"]
    obj = copy.deepcopy(VALID["plain"])
    obj["meta_info"]["input_token_logprobs"][-1][0] = 5e-5
    body = wf.encode(obj)
    rows = decode_score_response(body, req, parser="arrow")
    assert rows.token_logprobs[-1] == np.float32(5e-5)
    _assert_same(decode_score_response(body, req), rows)


# --- generation answers ------------------------------------------------------------------


def _gen_answers() -> dict[str, bytes]:
    from opd_stream._payloads import build_generate_payload

    server = InProcessSGLang("student", 0)
    out = {}
    for name, prompts, k, wire in (
        ("single-no-topk", [5, 6, 7], 0, "json"),
        ("single-nested", [5, 6, 7], 3, "json"),
        ("single-b64", [5, 6, 7], 3, "b64"),
        ("batch-nested", [[5, 6, 7], [8, 9]], 2, "json"),
        ("batch-b64", [[5, 6, 7], [8, 9]], 2, "b64"),
    ):
        payload = build_generate_payload(
            prompts,  # type: ignore[arg-type]
            6,
            top_logprobs_num=k,
            seed=1,
            topk_wire=wire,  # type: ignore[arg-type]
        )
        out[name] = server.handle("POST", "/generate", payload).body
    plain = msgspec.json.decode(out["single-b64"])
    meta = plain["meta_info"]
    vals = np.frombuffer(base64.b64decode(meta.pop("output_top_logprobs_val_flat_b64")), "<f4")
    idx = np.frombuffer(base64.b64decode(meta.pop("output_top_logprobs_idx_flat_b64")), "<i4")
    meta.pop("output_top_logprobs_val_flat_b64_dtype", None)
    meta.pop("output_top_logprobs_idx_flat_b64_dtype", None)
    meta["output_top_logprobs_val_flat"] = vals.tolist()
    meta["output_top_logprobs_idx_flat"] = idx.tolist()
    out["single-plain-flat"] = msgspec.json.encode(plain)
    return out


GEN = _gen_answers()


def _same_generations(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name in x.__struct_fields__:
            u, v = getattr(x, name), getattr(y, name)
            if u is None or v is None:
                assert u is v, name
            else:
                assert (u.dtype, u.shape) == (v.dtype, v.shape) and np.array_equal(u, v), name


@pytest.mark.parametrize("name", sorted(GEN))
def test_generation_answers_decode_identically_with_both_parsers(name: str) -> None:
    fast = decode_generate_arrow(GEN[name])
    assert fast is not None, "the arrow parser handed a valid generation answer back"
    _same_generations(decode_generate_response(GEN[name]), fast)


def _gen_differential(body: bytes) -> None:
    fast = decode_generate_arrow(body)
    try:
        slow: Any = decode_generate_response(body)
    except OPDStreamError as exc:
        slow = exc
    if fast is not None:
        if isinstance(slow, OPDStreamError):
            assert _LENIENT in str(slow), f"arrow accepted what msgspec rejects: {slow}"
        else:
            _same_generations(slow, fast)
    if isinstance(slow, OPDStreamError) and fast is None:
        with pytest.raises(type(slow)) as info:
            decode_generate_response(body, parser="arrow")
        assert str(info.value) == str(slow)


@FUZZ
@given(name=st.sampled_from(sorted(GEN)), data=st.data(), n=st.integers(1, 3))
def test_mutated_generation_answers_are_accepted_only_when_msgspec_accepts_them(
    name: str, data: st.DataObject, n: int
) -> None:
    obj = msgspec.json.decode(GEN[name])
    for _ in range(n):
        path = data.draw(st.sampled_from(_paths(obj)))
        op = data.draw(
            st.sampled_from(["replace", "delete", "duplicate", "truncate", "bump", "b64-flip"])
        )
        obj = _mutate(obj, path, op, data.draw(field_values) if op == "replace" else None)
    _gen_differential(json.dumps(obj).encode())


@FUZZ
@given(value=json_values)
def test_random_generation_json_is_handed_back(value: Any) -> None:
    wrapped = {"output_ids": [1, 2], "meta_info": value} if isinstance(value, dict) else value
    _gen_differential(json.dumps(wrapped).encode())


@pytest.mark.parametrize(
    "body", [b"null", b" \n null", b"[null]", b"[ null ]", b"[]", b"", b"   ", b"[{}]x"]
)
def test_bodies_the_reader_must_never_see_are_handed_back_without_crashing(body: bytes) -> None:
    # pyarrow 16-25 segfaults on a top-level null: such bodies never reach the reader
    for name in ("plain", "ids-blocked"):
        assert _fast(body, REQUESTS[name]) is None
    assert decode_generate_arrow(body) is None
