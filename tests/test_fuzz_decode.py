"""Fuzzing the response decoders: random and mutated SGLang JSON (b64 fields included).

Whatever the body, only the library's own error types come out (never IndexError,
KeyError, AssertionError, OverflowError, ...), and an answer that is accepted has the
request's shapes, echoes the request's tokens and holds no NaN.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import numpy as np
import pytest
import wire_fakes as wf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opd_stream import InvalidSampleError, OPDStreamError
from opd_stream._answers import ScoreRows
from opd_stream.wire._codec import decode_score_response
from opd_stream.wire._decode_generate import decode_generate_response
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest
from opd_stream.wire._student_topk import parse_student_topk

TOKENS = np.array([3, 17, 5, 29, 11, 2, 8], dtype=np.int64)
R = 4
IDS = np.array([[1, 2], [3, 4], [5, 6], [7, 8]], dtype=np.int64)

REQUESTS = {
    "plain": ScoreRequest(tokens=TOKENS, response_length=R),
    "plain-zero": ScoreRequest(tokens=TOKENS, response_length=R, start="zero"),
    "topk-json": ScoreRequest(tokens=TOKENS, response_length=R, top_k=3),
    "topk-b64": ScoreRequest(tokens=TOKENS, response_length=R, top_k=3, topk_wire="b64"),
    "ids-per-position": ScoreRequest(tokens=TOKENS, response_length=R, ids=IDS),
    "ids-flat": ScoreRequest(tokens=TOKENS, response_length=R, ids=IDS, id_form="flat"),
    "ids-blocked": ScoreRequest(
        tokens=TOKENS, response_length=R, ids=IDS, id_form="blocked", block_size=2, top_k=2
    ),
    "all-b64": ScoreRequest(tokens=TOKENS, response_length=R, top_k=2, ids=IDS, topk_wire="b64"),
}
VALID = {name: wf.answer(build_score_payload(req)) for name, req in REQUESTS.items()}

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)
# values SGLang fields plausibly take, including hostile ones
field_values = st.one_of(
    json_values,
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([1e39, -1e39, 1e308, -0.0, 3.5, float(2**63)]),
    st.text(
        alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=", max_size=40
    ),
    st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
    st.lists(st.lists(st.integers(-(2**65), 2**65), max_size=3), max_size=6),
)


def _check(body: bytes, req: ScoreRequest) -> None:
    """Decode; an error must be ours; an accepted answer must be sound."""
    try:
        rows = decode_score_response(body, req)
    except OPDStreamError:
        return
    _assert_sound(rows, req)


def _assert_sound(rows: ScoreRows, req: ScoreRequest) -> None:
    r = req.response_length
    assert rows.token_ids.tolist() == req.tokens[-r:].tolist()
    arrays = [rows.token_logprobs]
    assert rows.token_logprobs.shape == (r,)
    if req.top_k:
        assert rows.top_ids is not None and rows.top_logprobs is not None
        assert rows.top_ids.shape == rows.top_logprobs.shape == (r, req.top_k)
        assert (rows.top_ids >= 0).all()
        arrays.append(rows.top_logprobs)
    if req.ids is not None:
        assert rows.id_logprobs is not None and rows.id_logprobs.shape == req.ids.shape
        arrays.append(rows.id_logprobs)
    for arr in arrays:
        assert arr.dtype == np.float32
        assert not np.isnan(arr).any()
        assert not np.isposinf(arr).any()


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(obj: Any, path: tuple[Any, ...], op: str, value: Any) -> Any:
    if not path:
        return value if op == "replace" else obj
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if op == "replace":
        parent[key] = value
    elif op == "delete":
        del parent[key]
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif op == "truncate" and isinstance(parent[key], (list, str)):
        parent[key] = parent[key][: len(parent[key]) // 2]
    elif (
        op == "bump" and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool)
    ):
        parent[key] = parent[key] + 1
    elif op == "b64-flip" and isinstance(parent[key], str) and parent[key]:
        text = parent[key]
        parent[key] = ("B" if text[0] != "B" else "C") + text[1:]
    return obj


@FUZZ
@given(
    name=st.sampled_from(sorted(REQUESTS)),
    data=st.data(),
    n_mutations=st.integers(min_value=1, max_value=3),
)
def test_mutated_sglang_answers_raise_only_library_errors(
    name: str, data: st.DataObject, n_mutations: int
) -> None:
    obj = copy.deepcopy(VALID[name])
    for _ in range(n_mutations):
        paths = _paths(obj)
        path = data.draw(st.sampled_from(paths))
        op = data.draw(
            st.sampled_from(["replace", "delete", "duplicate", "truncate", "bump", "b64-flip"])
        )
        value = data.draw(field_values) if op == "replace" else None
        obj = _mutate(obj, path, op, value)
    _check(json.dumps(obj).encode(), REQUESTS[name])


@FUZZ
@given(name=st.sampled_from(sorted(REQUESTS)), value=json_values)
def test_random_json_raises_only_library_errors(name: str, value: Any) -> None:
    _check(json.dumps(value).encode(), REQUESTS[name])


@FUZZ
@given(name=st.sampled_from(sorted(REQUESTS)), data=st.data())
def test_truncated_and_corrupted_bodies_raise_only_library_errors(
    name: str, data: st.DataObject
) -> None:
    body = wf.encode(VALID[name])
    cut = data.draw(st.integers(min_value=0, max_value=len(body)))
    junk = data.draw(st.binary(max_size=8))
    _check(body[:cut] + junk, REQUESTS[name])


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from(sorted(REQUESTS)))
def test_unmutated_answers_decode_soundly(name: str) -> None:
    req = REQUESTS[name]
    _assert_sound(decode_score_response(wf.encode(VALID[name]), req), req)


@FUZZ
@given(value=json_values)
def test_generation_decoder_raises_only_library_errors(value: Any) -> None:
    body = json.dumps(
        value if not isinstance(value, dict) else {"output_ids": [1, 2], "meta_info": value}
    ).encode()
    try:
        gens = decode_generate_response(body)
    except OPDStreamError:
        return
    for g in gens:
        assert not np.isnan(g.output_logprobs).any()


student_rows = st.lists(
    st.lists(
        st.one_of(
            st.lists(field_values, max_size=4),
            st.tuples(
                st.one_of(st.none(), st.floats(), st.integers(-5, 5)),
                st.integers(min_value=-(2**64), max_value=2**64),
            ).map(list),
        ),
        max_size=4,
    ),
    max_size=4,
)


@FUZZ
@given(rows=st.one_of(student_rows, field_values), r=st.integers(0, 4), k=st.integers(1, 3))
def test_student_topk_parser_raises_only_invalid_sample(rows: Any, r: int, k: int) -> None:
    try:
        ids, lps = parse_student_topk(rows, r, k)
    except OPDStreamError as exc:
        reason = exc.reason
        assert reason == "invalid_sample"
        return
    assert ids.shape == lps.shape == (r, k)
    assert not np.isnan(lps).any() and not np.isposinf(lps).any()


# found by the fuzzers above -------------------------------------------------------------


def test_a_token_id_beyond_int64_is_a_malformed_answer_not_an_overflow() -> None:
    for name in ("plain", "topk-json", "ids-per-position"):
        req = REQUESTS[name]
        for path in _paths(VALID[name]):
            used = len(path) > 1 and str(path[1]).startswith("input_")  # decoded fields
            if used and path[-1] == 1 and isinstance(path[-2], int):
                obj = _mutate(copy.deepcopy(VALID[name]), path, "replace", 2**64 - 1)
                with pytest.raises(OPDStreamError):
                    decode_score_response(json.dumps(obj).encode(), req)


def test_a_student_topk_id_beyond_int64_is_an_invalid_sample() -> None:
    with pytest.raises(InvalidSampleError, match=r"^student_top_logprobs: row 0"):
        parse_student_topk([[[-1.0, 2**63]]], 1, 1)


def test_empty_student_topk_of_a_zero_length_response_parses_to_empty_arrays() -> None:
    ids, lps = parse_student_topk([], 0, 2)
    assert ids.shape == lps.shape == (0, 2)
