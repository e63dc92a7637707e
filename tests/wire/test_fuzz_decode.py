"""Fuzzing the response decoders: random and mutated SGLang JSON (b64 fields included).

Whatever the body, only the library's own error types come out (never IndexError,
KeyError, AssertionError, OverflowError, ...), and an answer that is accepted has the
request's shapes, echoes the request's tokens and holds no NaN.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import fake_generate as wf
from support.fuzz_corpus import FUZZ, REQUESTS, VALID, field_values, json_values, mutate, paths_of

from opd_stream import InvalidSampleError, OPDStreamError
from opd_stream.wire._answers import ScoreRows
from opd_stream.wire._codec import decode_score_response
from opd_stream.wire._decode_generate import decode_generate_response
from opd_stream.wire._request import ScoreRequest
from opd_stream.wire._student_topk import parse_student_topk


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
        paths = paths_of(obj)
        path = data.draw(st.sampled_from(paths))
        op = data.draw(
            st.sampled_from(["replace", "delete", "duplicate", "truncate", "bump", "b64-flip"])
        )
        value = data.draw(field_values) if op == "replace" else None
        obj = mutate(obj, path, op, value)
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
        for path in paths_of(VALID[name]):
            used = len(path) > 1 and str(path[1]).startswith("input_")  # decoded fields
            if used and path[-1] == 1 and isinstance(path[-2], int):
                obj = mutate(copy.deepcopy(VALID[name]), path, "replace", 2**64 - 1)
                with pytest.raises(OPDStreamError):
                    decode_score_response(json.dumps(obj).encode(), req)


def test_a_student_topk_id_beyond_int64_is_an_invalid_sample() -> None:
    with pytest.raises(InvalidSampleError, match=r"^student_top_logprobs: row 0"):
        parse_student_topk([[[-1.0, 2**63]]], 1, 1)


def test_empty_student_topk_of_a_zero_length_response_parses_to_empty_arrays() -> None:
    ids, lps = parse_student_topk([], 0, 2)
    assert ids.shape == lps.shape == (0, 2)
