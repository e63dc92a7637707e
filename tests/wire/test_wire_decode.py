"""Decoding and validation of SGLang answers by ``opd_stream.wire._request``.

Well-formed answers come from the independent fake scorer in ``support.fake_generate``;
malformed ones are that fake's answer with one thing broken, or hand-written JSON.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import fake_generate as wf

from opd_stream._errors import (
    CapabilityError,
    InvalidSampleError,
    MalformedResponseError,
    MisalignedResponseError,
    ServerAbortError,
)
from opd_stream.wire._answers import ScoreRows
from opd_stream.wire._codec import decode_score_response
from opd_stream.wire._decode_generate import decode_generate_response
from opd_stream.wire._error_body import parse_error_message
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest
from opd_stream.wire._student_topk import parse_student_topk

# P = 3, R = 5, L = 8; with start="prompt" s = 2 and every input_* list has 6 entries.
TOK = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.int64)
R = 5
IDS = np.array([[5, 2], [2, 9], [4, 1], [8, 7], [3, 5]], dtype=np.int64)


def make(**kw: Any) -> ScoreRequest:
    return ScoreRequest(tokens=TOK, response_length=R, **kw)


def fake(req: ScoreRequest, **kw: Any) -> Any:
    return wf.answer(build_score_payload(req), **kw)


def decode(req: ScoreRequest, obj: Any) -> ScoreRows:
    return decode_score_response(wf.encode(obj), req)


# --- the worked example (docs/protocol.md, "A worked example") ------------------------

WORKED_EXAMPLE = b"""{"text": "", "output_ids": [],
 "meta_info": {
  "id": "6f1c0d2e9a6b4c0f8e1d2a3b4c5d6e7f",
  "finish_reason": {"type": "length", "length": 0},
  "prompt_tokens": 6, "weight_version": "default", "num_retractions": 0,
  "input_token_logprobs": [[null,151644,null],[-2.0,872,null],[-3.0,198,null],[-4.0,14958,null],[-5.0,13,null],[-6.0,151645,null]],
  "output_token_logprobs": [], "output_token_logprobs_length": 0,
  "input_top_logprobs": [null,
     [[-0.5,1001,null],[-1.2,2001,null]], [[-0.5,1002,null],[-1.2,2002,null]],
     [[-0.5,1003,null],[-1.2,2003,null]], [[-0.5,1004,null],[-1.2,2004,null]],
     [[-0.5,1005,null],[-1.2,2005,null]]],
  "output_top_logprobs": [[[-0.3,3000,null],[-2.0,3001,null]]],
  "input_token_ids_logprobs": [null,
     [[-10.1,5,null],[-9.7,7,null]], [[-11.1,5,null],[-10.7,7,null]],
     [[-12.1,5,null],[-11.7,7,null]], [[-13.1,5,null],[-12.7,7,null]],
     [[-14.1,5,null],[-13.7,7,null]]],
  "output_token_ids_logprobs": [[[-9.9,5,null],[-8.8,7,null]]],
  "reasoning_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
  "e2e_latency": 0.0123, "response_sent_to_client_ts": 1790000000.123}}"""  # noqa: E501

EXAMPLE_TOKENS = np.array([151644, 872, 198, 14958, 13, 151645], dtype=np.int64)


def example_request(r: int, ids_row: list[int]) -> ScoreRequest:
    return ScoreRequest(
        tokens=EXAMPLE_TOKENS,
        response_length=r,
        top_k=2,
        ids=np.array([ids_row] * r, dtype=np.int64),
        id_form="flat",
        start="zero",
    )


def test_worked_example_request_matches_the_canonical_scoring_request() -> None:
    got = json.loads(build_score_payload(example_request(3, [5, 7])))
    assert got == {
        "input_ids": EXAMPLE_TOKENS.tolist(),
        "sampling_params": {"temperature": 0, "max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "token_ids_logprob": [5, 7],
        "return_text_in_logprobs": False,
        "stream": False,
    }


def test_worked_example_decodes_the_response_rows() -> None:
    rows = decode_score_response(WORKED_EXAMPLE, example_request(3, [5, 7]))
    f32 = np.float32
    np.testing.assert_array_equal(rows.token_ids, [14958, 13, 151645])
    np.testing.assert_array_equal(rows.token_logprobs, np.array([-4, -5, -6], dtype=f32))
    assert rows.top_ids is not None
    assert rows.top_logprobs is not None
    np.testing.assert_array_equal(rows.top_ids, [[1003, 2003], [1004, 2004], [1005, 2005]])
    np.testing.assert_array_equal(rows.top_logprobs, np.array([[-0.5, -1.2]] * 3, dtype=f32))
    expected_ids = np.array([[-12.1, -11.7], [-13.1, -12.7], [-14.1, -13.7]], dtype=f32)
    np.testing.assert_array_equal(rows.id_logprobs, expected_ids)
    assert rows.used_b64 is False
    assert rows.weight_version == "default"


def test_worked_example_maps_id_columns_in_the_callers_order() -> None:
    rows = decode_score_response(WORKED_EXAMPLE, example_request(3, [7, 5]))
    expected = np.array([[-11.7, -12.1], [-12.7, -13.1], [-13.7, -14.1]], dtype=np.float32)
    np.testing.assert_array_equal(rows.id_logprobs, expected)


def test_worked_example_with_a_one_token_prompt_keeps_every_row_after_entry_zero() -> None:
    rows = decode_score_response(WORKED_EXAMPLE, example_request(5, [5, 7]))
    np.testing.assert_array_equal(rows.token_logprobs, np.array([-2, -3, -4, -5, -6], np.float32))
    assert rows.top_ids is not None
    np.testing.assert_array_equal(rows.top_ids[:, 0], [1001, 1002, 1003, 1004, 1005])


def test_decoded_arrays_have_the_contract_dtypes_and_shapes() -> None:
    rows = decode_score_response(WORKED_EXAMPLE, example_request(3, [5, 7]))
    i64, f32 = np.dtype(np.int64), np.dtype(np.float32)
    assert (rows.token_ids.dtype, rows.token_ids.shape) == (i64, (3,))
    assert (rows.token_logprobs.dtype, rows.token_logprobs.shape) == (f32, (3,))
    assert rows.top_ids is not None
    assert rows.top_logprobs is not None
    assert rows.id_logprobs is not None
    assert (rows.top_ids.dtype, rows.top_ids.shape) == (i64, (3, 2))
    assert (rows.top_logprobs.dtype, rows.top_logprobs.shape) == (f32, (3, 2))
    assert (rows.id_logprobs.dtype, rows.id_logprobs.shape) == (f32, (3, 2))


def test_request_without_topk_or_ids_returns_none_for_them() -> None:
    rows = decode(make(), fake(make()))
    assert rows.top_ids is None
    assert rows.top_logprobs is None
    assert rows.id_logprobs is None
    assert rows.used_b64 is False


# --- agreement with an independent reference ------------------------------------------


def reference(
    tokens: npt.NDArray[np.int64], r: int, top_k: int, ids: npt.NDArray[np.int64] | None
) -> dict[str, Any]:
    """Per-position Python loops over the fake model (float64 math, float32-exact values)."""
    p = len(tokens) - r
    seq = tokens.tolist()
    tok, top_i, top_l, idl = [], [], [], []
    for t in range(r):
        ctx = seq[: p + t]
        tok.append(wf.fake_logprob(ctx, seq[p + t]))
        best = wf.fake_topk(ctx, top_k)
        top_i.append([i for _, i in best])
        top_l.append([lp for lp, _ in best])
        if ids is not None:
            idl.append([wf.fake_logprob(ctx, int(i)) for i in ids[t]])
    return {
        "token_logprobs": np.array(tok, dtype=np.float32),
        "top_ids": np.array(top_i, dtype=np.int64).reshape(r, top_k),
        "top_logprobs": np.array(top_l, dtype=np.float32).reshape(r, top_k),
        "id_logprobs": None if ids is None else np.array(idl, dtype=np.float32),
    }


@st.composite
def samples(draw: st.DrawFn) -> dict[str, Any]:
    p = draw(st.integers(1, 5))
    r = draw(st.integers(1, 10))
    k = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, wf.VOCAB, p + r).astype(np.int64)
    ids = np.stack([rng.choice(wf.VOCAB, k, replace=False) for _ in range(r)]).astype(np.int64)
    return {
        "tokens": tokens,
        "response_length": r,
        "ids": ids,
        "top_k": draw(st.integers(0, 3)),
        "block_size": draw(st.integers(0, 6)),  # 0 = auto
        "start": draw(st.sampled_from(["prompt", "zero"])),
        "topk_wire": draw(st.sampled_from(["json", "b64"])),
    }


FIELDS = ("token_ids", "token_logprobs", "top_ids", "top_logprobs", "id_logprobs")


def score(sample: dict[str, Any], form: str) -> ScoreRows:
    req = ScoreRequest(id_form=form, **sample)  # type: ignore[arg-type]
    return decode_score_response(wf.respond(build_score_payload(req)), req)


def assert_rows_equal(a: ScoreRows, b: ScoreRows) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype, name
            assert x.shape == y.shape, name
            np.testing.assert_array_equal(x, y, err_msg=name)


@settings(max_examples=40, deadline=None)
@given(samples())
def test_blocked_answers_stitch_to_exactly_the_per_position_answer(sample: dict[str, Any]) -> None:
    assert_rows_equal(score(sample, "blocked"), score(sample, "per-position"))


@settings(max_examples=40, deadline=None)
@given(samples())
def test_flat_answer_equals_the_per_position_answer_exactly(sample: dict[str, Any]) -> None:
    assert_rows_equal(score(sample, "flat"), score(sample, "per-position"))


@settings(max_examples=40, deadline=None)
@given(samples())
def test_per_position_answer_matches_the_reference_loop(sample: dict[str, Any]) -> None:
    rows = score(sample, "per-position")
    ref = reference(sample["tokens"], sample["response_length"], sample["top_k"], sample["ids"])
    p = len(sample["tokens"]) - sample["response_length"]
    np.testing.assert_array_equal(rows.token_ids, sample["tokens"][p:])
    np.testing.assert_array_equal(rows.token_logprobs, ref["token_logprobs"])
    np.testing.assert_array_equal(rows.id_logprobs, ref["id_logprobs"])
    if sample["top_k"]:
        np.testing.assert_array_equal(rows.top_ids, ref["top_ids"])
        np.testing.assert_array_equal(rows.top_logprobs, ref["top_logprobs"])


@settings(max_examples=40, deadline=None)
@given(samples(), st.sampled_from(["per-position", "flat", "blocked"]))
def test_decoded_logprobs_are_finite_or_minus_inf(sample: dict[str, Any], form: str) -> None:
    rows = score(sample, form)
    for name in ("token_logprobs", "top_logprobs", "id_logprobs"):
        values = getattr(rows, name)
        if values is not None:
            assert np.all(np.isfinite(values) | (values == -np.inf)), name


def test_blocked_answer_holds_at_most_r_k_b_requested_entries() -> None:
    rng = np.random.default_rng(7)
    r, k, b = 40, 3, 4
    tokens = rng.integers(0, wf.VOCAB, 2 + r).astype(np.int64)
    ids = np.stack([rng.choice(wf.VOCAB, k, replace=False) for _ in range(r)]).astype(np.int64)
    req = ScoreRequest(tokens=tokens, response_length=r, ids=ids, id_form="blocked", block_size=b)
    items: Any = wf.answer(build_score_payload(req))
    entries = sum(
        len(row) for it in items for row in it["meta_info"]["input_token_ids_logprobs"][1:]
    )
    assert entries <= r * k * b
    assert len(items) == r // b


# --- malformed bodies ------------------------------------------------------------------


def test_body_that_is_not_json_is_malformed() -> None:
    with pytest.raises(MalformedResponseError, match="malformed"):
        decode_score_response(b"<html>502 Bad Gateway</html>", make())


def test_truncated_body_is_malformed() -> None:
    body = wf.encode(fake(make(top_k=2)))
    with pytest.raises(MalformedResponseError, match="truncated"):
        decode_score_response(body[:-7], make(top_k=2))


def test_per_position_answer_from_an_unpatched_server_is_a_capability_error() -> None:
    req = make(ids=IDS, top_k=2)
    body = wf.respond(build_score_payload(req), per_position=False)
    with pytest.raises(CapabilityError) as info:
        decode_score_response(body, req)
    assert info.value.capability == "per_position"


def test_token_id_mismatch_names_the_absolute_position_not_the_ids() -> None:
    obj = fake(make())
    obj["meta_info"]["input_token_logprobs"][3][1] = 987654  # entry 3 <-> position 2 + 3
    with pytest.raises(MisalignedResponseError, match="absolute position 5") as info:
        decode(make(), obj)
    assert "987654" not in str(info.value)


def test_blocked_item_errors_name_the_item_path() -> None:
    req = make(ids=IDS, id_form="blocked", block_size=2)
    items = fake(req)
    items[1]["meta_info"]["input_token_logprobs"][1][1] = 39
    with pytest.raises(MisalignedResponseError, match=r"`\$\[1\]\.meta_info") as info:
        decode(req, items)
    assert "absolute position 5" in str(info.value)


def test_blocked_id_only_item_asks_its_last_row_from_the_output_row() -> None:
    # block [2, 4): input_ids stop before position P + 3, whose row is the output row
    req = make(ids=IDS, id_form="blocked", block_size=2)
    body = json.loads(build_score_payload(req))
    p = len(TOK) - R
    assert [len(x) for x in body["input_ids"]] == [p + 1, p + 3, p + 4]
    assert body["logprob_start_len"] == [p - 1, p + 1, p + 3]
    for union, end in zip(body["token_ids_logprob"], (2, 4, 5), strict=True):
        assert int(TOK[p + end - 1]) in union  # the tail row's target token


@pytest.mark.parametrize("item", [0, 1])
def test_blocked_row_with_its_ids_swapped_is_misaligned_at_its_own_item(item: int) -> None:
    req = make(ids=IDS, id_form="blocked", block_size=2)
    items = fake(req)
    row = items[item]["meta_info"]["input_token_ids_logprobs"][-1]
    row[0], row[1] = row[1], row[0]
    with pytest.raises(MisalignedResponseError, match="request order") as info:
        decode(req, items)
    assert f"$[{item}]" in str(info.value)
    assert f"response position {2 * item}" in str(info.value)


# --- values ----------------------------------------------------------------------------


def test_null_logprobs_decode_to_minus_inf() -> None:
    req = make(ids=IDS, top_k=2)
    obj = fake(req)
    meta = obj["meta_info"]
    meta["input_token_logprobs"][1][0] = None
    meta["input_top_logprobs"][2][1][0] = None
    meta["input_token_ids_logprobs"][3][0][0] = None
    rows = decode(req, obj)
    assert rows.token_logprobs[0] == -np.inf
    assert rows.top_logprobs is not None
    assert rows.top_logprobs[1, 1] == -np.inf
    assert rows.id_logprobs is not None
    assert rows.id_logprobs[2, 0] == -np.inf


def test_value_below_the_float32_range_becomes_minus_inf() -> None:
    obj = fake(make())
    obj["meta_info"]["input_token_logprobs"][2][0] = -1e39
    assert decode(make(), obj).token_logprobs[1] == -np.inf


def test_decoded_token_ids_are_the_response_tokens() -> None:
    np.testing.assert_array_equal(decode(make(), fake(make())).token_ids, TOK[3:])


# --- b64 top-k -------------------------------------------------------------------------

B64 = {"top_k": 2, "topk_wire": "b64"}


def test_b64_answer_equals_the_json_answer_on_the_same_values() -> None:
    req = make(ids=IDS, **B64)
    with_b64 = decode_score_response(wf.respond(build_score_payload(req)), req)
    nested = decode_score_response(wf.respond(build_score_payload(req), b64=False), req)
    assert with_b64.used_b64 is True
    assert nested.used_b64 is False
    assert_rows_equal(with_b64, nested)


def test_b64_request_answered_with_nested_topk_decodes_with_used_b64_false() -> None:
    req = make(**B64)
    rows = decode_score_response(wf.respond(build_score_payload(req), b64=False), req)
    assert rows.used_b64 is False
    ref = reference(TOK, R, 2, None)
    np.testing.assert_array_equal(rows.top_ids, ref["top_ids"])


def b64_floats(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def test_b64_keeps_minus_inf_and_maps_nan_to_minus_inf() -> None:
    obj = fake(make(**B64))
    meta = obj["meta_info"]
    vals = [-0.5, -1.0] * 5
    vals[0], vals[3] = -math.inf, math.nan
    meta["input_top_logprobs_val_flat_b64"] = b64_floats(vals)
    rows = decode(make(**B64), obj)
    assert rows.top_logprobs is not None
    assert rows.top_logprobs[0, 0] == -np.inf
    assert rows.top_logprobs[1, 1] == -np.inf
    assert not np.isnan(rows.top_logprobs).any()


# --- an answer with one thing broken: the error and its message --------------------------

Edit = Callable[[Any], Any]
BLOCKED = {"ids": IDS, "id_form": "blocked", "block_size": 2}


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def drop(*path: Any) -> Edit:
    """Delete the field or entry at ``path``."""

    def edit(obj: Any) -> Any:
        del _at(obj, path[:-1])[path[-1]]
        return obj

    return edit


def put(*path: Any, value: Any) -> Edit:
    """Set the field or entry at ``path`` to ``value``."""

    def edit(obj: Any) -> Any:
        _at(obj, path[:-1])[path[-1]] = value
        return obj

    return edit


def call(*path: Any, method: str, args: tuple[Any, ...] = ()) -> Edit:
    """Call a list method (``pop``, ``reverse``) on the list at ``path``."""

    def edit(obj: Any) -> Any:
        getattr(_at(obj, path), method)(*args)
        return obj

    return edit


def repeat_row(*path: Any, row: int) -> Edit:
    """Append a copy of row ``row`` to the list at ``path``."""

    def edit(obj: Any) -> Any:
        rows = _at(obj, path)
        rows.append(rows[row])
        return obj

    return edit


def pop_each_row_after_entry_zero(*path: Any) -> Edit:
    def edit(obj: Any) -> Any:
        for row in _at(obj, path)[1:]:
            row.pop()
        return obj

    return edit


ABORT_ANSWER = {
    "text": "",
    "output_ids": [],
    "meta_info": {
        "id": "x",
        "finish_reason": {
            "type": "abort",
            "message": "Abort before prefill",
            "status_code": None,
            "err_type": None,
        },
        "prompt_tokens": 8,
    },
}
M = "meta_info"


# (request fields, the change to its answer, the error, its message)
BROKEN_ANSWERS = [
    # shape and types
    pytest.param(
        {},
        lambda obj: {"text": "", "output_ids": []},
        MalformedResponseError,
        r"`\$\.meta_info`",
        id="missing-meta-info",
    ),
    pytest.param(
        {},
        drop(M, "input_token_logprobs"),
        MalformedResponseError,
        r"`\$\.meta_info\.input_token_logprobs`",
        id="missing-input-token-logprobs",
    ),
    pytest.param(
        {"top_k": 2},
        drop(M, "input_top_logprobs"),
        MalformedResponseError,
        r"`\$\.meta_info\.input_top_logprobs`",
        id="missing-input-top-logprobs",
    ),
    pytest.param(
        {"ids": IDS, "id_form": "flat"},
        drop(M, "input_token_ids_logprobs"),
        MalformedResponseError,
        r"input_token_ids_logprobs`",
        id="flat-without-requested-ids",
    ),
    pytest.param(
        {},
        put(M, "input_token_logprobs", 2, 1, value="4"),
        MalformedResponseError,
        r"`\$\.meta_info\.input_token_logprobs\[2\]\[1\]`",
        id="wrong-value-type-names-the-msgspec-path",
    ),
    pytest.param(
        {"top_k": 2},
        put(M, "input_top_logprobs", 1, 0, value=[-0.5]),
        MalformedResponseError,
        r"input_top_logprobs\[1\]\[0\]",
        id="entry-without-a-token-id",
    ),
    # rows and token ids
    pytest.param(
        {},
        drop(M, "input_token_logprobs", -1),
        MisalignedResponseError,
        "has 5 entries, expected 6",
        id="token-entry-count-mismatch",
    ),
    pytest.param(
        {"start": "zero"},
        put(M, "input_token_logprobs", 1, 1, value=39),
        MisalignedResponseError,
        "absolute position 1",
        id="prompt-token-mismatch-with-start-zero",
    ),
    pytest.param(
        {"top_k": 2},
        repeat_row(M, "input_top_logprobs", row=1),
        MisalignedResponseError,
        "has 7 entries, expected 6",
        id="topk-row-count-mismatch",
    ),
    pytest.param(
        {"top_k": 2},
        call(M, "input_top_logprobs", 2, method="pop"),
        MisalignedResponseError,
        r"absolute position 4 \(response position 1\) has 1",
        id="topk-row-with-wrong-width-names-its-position",
    ),
    pytest.param(
        {"top_k": 2},
        put(M, "input_top_logprobs", 5, value=None),
        MisalignedResponseError,
        r"absolute position 7 .* null",
        id="null-topk-row-in-the-response-range",
    ),
    # requested ids
    pytest.param(
        {"ids": IDS},
        call(M, "input_token_ids_logprobs", 4, method="reverse"),
        MisalignedResponseError,
        r"response position 3.* request order",
        id="per-position-row-in-another-order",
    ),
    pytest.param(
        {"ids": IDS},
        put(M, "input_token_ids_logprobs", 1, 0, 1, value=33),
        MisalignedResponseError,
        "response position 0",
        id="per-position-row-with-another-id",
    ),
    pytest.param(
        {"ids": IDS, "id_form": "flat"},
        call(M, "input_token_ids_logprobs", 3, method="pop", args=(0,)),
        MisalignedResponseError,
        "response position 2",
        id="flat-row-missing-a-union-id",
    ),
    pytest.param(
        {"ids": IDS, "id_form": "flat"},
        call(M, "input_token_ids_logprobs", 1, method="reverse"),
        MisalignedResponseError,
        "request order",
        id="flat-union-in-another-order",
    ),
    pytest.param(
        {"ids": IDS},
        put(M, "input_token_ids_logprobs", 2, value=None),
        MisalignedResponseError,
        "response position 1",
        id="null-requested-id-row",
    ),
    pytest.param(
        {"ids": IDS, "top_k": 2},
        lambda obj: ABORT_ANSWER,
        ServerAbortError,
        "Abort before prefill",
        id="abort-on-http-200-with-the-servers-message",
    ),
    # blocked (batch) answers
    pytest.param(
        BLOCKED,
        lambda items: items[:2],
        MisalignedResponseError,
        "2 items, expected 3",
        id="batch-answer-with-a-missing-item",
    ),
    pytest.param(
        BLOCKED,
        lambda items: items[0],
        MalformedResponseError,
        "array",
        id="blocked-request-answered-with-a-single-object",
    ),
    pytest.param(
        BLOCKED,
        drop(1, M, "output_token_ids_logprobs"),
        MalformedResponseError,
        r"\$\[1\]\.meta_info\.output_token_ids",
        id="blocked-id-only-item-without-its-output-row",
    ),
    pytest.param(
        BLOCKED,
        call(0, M, "output_token_ids_logprobs", 0, method="pop"),
        MisalignedResponseError,
        r"output_token_ids.*response position 1",
        id="blocked-id-only-output-row-with-a-missing-id",
    ),
    pytest.param(
        BLOCKED,
        pop_each_row_after_entry_zero(1, M, "input_token_ids_logprobs"),
        MisalignedResponseError,
        r"\$\[1\].*response position 2",
        id="blocked-item-with-a-wrong-union",
    ),
    pytest.param(
        BLOCKED,
        put(2, M, "finish_reason", value={"type": "abort", "message": "shutdown"}),
        ServerAbortError,
        "shutdown",
        id="abort-in-one-batch-item",
    ),
    # values
    pytest.param(
        {},
        put(M, "input_token_logprobs", 2, 0, value=1e39),
        MalformedResponseError,
        "float32 range",
        id="value-above-the-float32-range",
    ),
    # b64 top-k
    pytest.param(
        B64,
        put(M, "input_top_logprobs_val_flat_b64", value=b64_floats([-0.5, math.inf] * 5)),
        MalformedResponseError,
        "float32 range",
        id="b64-plus-inf",
    ),
    pytest.param(
        B64,
        put(M, "input_top_logprobs_idx_flat_b64", value="AAA$AAAA"),
        MalformedResponseError,
        "idx_flat_b64` is not valid base64",
        id="b64-corrupt-base64",
    ),
    pytest.param(
        B64,
        put(M, "input_top_logprobs_val_flat_b64", value=b64_floats([-0.5] * 9)),
        MalformedResponseError,
        "36 bytes, expected 40",
        id="b64-buffer-of-the-wrong-byte-length",
    ),
    pytest.param(
        B64,
        put(M, "input_top_logprobs_shape", value=[2, 5]),
        MisalignedResponseError,
        "_shape",
        id="b64-shape-with-another-k",
    ),
    pytest.param(
        B64,
        put(M, "input_top_logprobs_null_prefix", value=2),
        MisalignedResponseError,
        "null_prefix 2 \\+ 5 rows",
        id="b64-rows-must-cover-the-entries-after-the-null-prefix",
    ),
    pytest.param(
        B64,
        put(M, "input_top_logprobs_val_flat_b64_dtype", value="float16"),
        MalformedResponseError,
        "float16",
        id="b64-wrong-dtype-marker",
    ),
    pytest.param(
        B64,
        drop(M, "input_top_logprobs_shape"),
        MalformedResponseError,
        r"`\$\.meta_info\.input_top_logprobs_shape`",
        id="b64-answer-without-shape",
    ),
    pytest.param(
        B64,
        put(
            M,
            "input_top_logprobs_idx_flat_b64",
            value=base64.b64encode(struct.pack("<10i", *([3, -1] * 5))).decode(),
        ),
        MalformedResponseError,
        "negative token id",
        id="b64-negative-top-id",
    ),
]


@pytest.mark.parametrize(("fields", "edit", "error", "match"), BROKEN_ANSWERS)
def test_a_broken_answer_raises_its_error_naming_what_is_wrong(
    fields: dict[str, Any], edit: Edit, error: type[Exception], match: str
) -> None:
    req = make(**fields)
    with pytest.raises(error, match=match):
        decode(req, edit(fake(req)))


# --- error bodies ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": {"message": "Input is too long."}}', "Input is too long."),
        (b'{"error": "unknown field `top_logprobs_num`"}', "unknown field `top_logprobs_num`"),
        (
            b'{"object":"error","message":"The request queue is full.","type":"503",'
            b'"param":null,"code":503}',
            "The request queue is full.",
        ),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b'{"error": {"message": "first"}, "message": "second"}', "first"),
        (b'{"error": "Unauthorized", "message": "second"}', "Unauthorized"),
    ],
    ids=["error-object", "error-string", "error-response", "detail", "order-1", "order-2"],
)  # fmt: skip
def test_error_message_is_read_from_the_sglang_error_shapes(body: bytes, message: str) -> None:
    assert parse_error_message(body) == message


def test_error_message_re_encodes_a_structured_detail() -> None:
    got = parse_error_message(b'{"detail": [{"loc": ["body"], "msg": "bad"}]}')
    assert got == '[{"loc":["body"],"msg":"bad"}]'


def test_error_message_of_an_empty_body() -> None:
    assert parse_error_message(b"") == "<empty body>"


def test_error_message_of_a_non_json_body_is_a_short_printable_prefix() -> None:
    got = parse_error_message(b"\x00bad gateway\n" + b"x" * 500)
    assert got.startswith("\\x00bad gateway\\n")
    assert got.endswith("…")
    assert len(got) <= 200 + 8 * 2 + 1


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_error_message_never_raises(body: bytes) -> None:
    assert isinstance(parse_error_message(body), str)


# --- generation ------------------------------------------------------------------------


def gen_item(ids: list[int], lps: list[float | None], top: list[Any] | None = None) -> Any:
    meta: dict[str, Any] = {
        "id": "g",
        "finish_reason": {"type": "length", "length": len(ids)},
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
    }
    if top is not None:
        meta["output_top_logprobs"] = top
    return {"text": "ab", "output_ids": ids, "meta_info": meta}


def test_generate_single_answer_decodes_tokens_logprobs_and_topk() -> None:
    top = [[[-0.1, 7, None], [-2.0, 3, None]], [[-0.2, 4, None], [None, 1, None]]]
    (gen,) = decode_generate_response(wf.encode(gen_item([7, 4], [-0.1, -0.2], top)))
    np.testing.assert_array_equal(gen.output_ids, np.array([7, 4], dtype=np.int64))
    np.testing.assert_array_equal(gen.output_logprobs, np.array([-0.1, -0.2], dtype=np.float32))
    np.testing.assert_array_equal(gen.output_top_ids, [[7, 3], [4, 1]])
    expected_top = np.array([[-0.1, -2.0], [-0.2, -np.inf]], dtype=np.float32)
    np.testing.assert_array_equal(gen.output_top_logprobs, expected_top)


def test_generate_batch_answer_gives_one_generation_per_item() -> None:
    body = wf.encode([gen_item([1], [-1.0]), gen_item([2, 3, 4], [None, -0.5, -0.25])])
    gens = decode_generate_response(body)
    assert [g.output_ids.tolist() for g in gens] == [[1], [2, 3, 4]]
    assert gens[1].output_logprobs[0] == -np.inf
    assert gens[0].output_top_ids is None
    assert gens[0].output_top_logprobs is None


def test_generate_abort_raises_server_abort_on_the_student_side() -> None:
    item = gen_item([1], [-1.0])
    item["meta_info"]["finish_reason"] = {"type": "abort", "message": "queue full"}
    with pytest.raises(ServerAbortError, match="queue full") as info:
        decode_generate_response(wf.encode(item))
    assert info.value.side == "student"


def test_generate_output_ids_that_differ_from_the_logprob_ids_are_misaligned() -> None:
    item = gen_item([1, 2], [-1.0, -1.0])
    item["output_ids"] = [1, 3]
    with pytest.raises(MisalignedResponseError, match="output_ids"):
        decode_generate_response(wf.encode(item))


def test_generate_ragged_topk_rows_are_misaligned() -> None:
    top = [[[-0.1, 7, None], [-2.0, 3, None]], [[-0.2, 4, None]]]
    with pytest.raises(MisalignedResponseError, match="has 1 entries, expected 2"):
        decode_generate_response(wf.encode(gen_item([7, 4], [-0.1, -0.2], top)))


def test_generate_answer_without_output_logprobs_is_malformed() -> None:
    item = gen_item([1], [-1.0])
    del item["meta_info"]["output_token_logprobs"]
    with pytest.raises(MalformedResponseError, match="output_token_logprobs"):
        decode_generate_response(wf.encode(item))


# --- student top-k rows ----------------------------------------------------------------


def test_student_topk_takes_the_first_k_of_triples_or_pairs() -> None:
    rows: Any = [
        [[-0.1, 5, "a"], [-1.5, 9, "b"], [-3.0, 2, "c"]],
        [(-0.2, 4), (None, 8)],
    ]
    ids, lps = parse_student_topk(rows, 2, 2)
    np.testing.assert_array_equal(ids, np.array([[5, 9], [4, 8]], dtype=np.int64))
    np.testing.assert_array_equal(lps, np.array([[-0.1, -1.5], [-0.2, -np.inf]], np.float32))
    assert ids.dtype == np.int64
    assert lps.dtype == np.float32


def test_student_topk_accepts_integer_logprobs() -> None:
    _, lps = parse_student_topk([[[0, 1], [-3, 2]]], 1, 2)
    np.testing.assert_array_equal(lps, np.array([[0.0, -3.0]], dtype=np.float32))


GOOD_ROW = [[-0.1, 5, None], [-1.0, 6, None]]


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([GOOD_ROW], "has 1 rows, expected response_length = 2"),
        ([GOOD_ROW, [[-0.1, True], [-1.0, 6]]], "row 1: .*`int`, got `bool`"),
        ([GOOD_ROW, [[-0.1, 5], [-1.0, 6.0]]], "row 1: .*`int`, got `float`"),
        ([GOOD_ROW, [[-0.1, 5], ["x", 6]]], "row 1: .*got `str`"),
        ([[[-0.1, -5], [-1.0, 6]], GOOD_ROW], "row 0 holds a negative token id"),
        ([GOOD_ROW, [[-0.1, 6], [-1.0, 6]]], "row 1 holds a duplicate token id"),
        ([GOOD_ROW, [[math.nan, 5], [-1.0, 6]]], "row 1 holds a NaN logprob"),
        ([GOOD_ROW, [[math.inf, 5], [-1.0, 6]]], "row 1 holds a \\+inf logprob"),
        ([GOOD_ROW, [[0.5, 5], [-1.0, 6]]], "row 1 holds a value > 0"),
        ([GOOD_ROW, "ab"], "row 1"),
    ],
    ids=[
        "row-count",
        "bool-id",
        "float-id",
        "str-logprob",
        "negative-id",
        "duplicate-id",
        "nan",
        "plus-inf",
        "positive",
        "row-not-a-list",
    ],
)
def test_student_topk_rejects_bad_rows_naming_the_row(rows: Any, match: str) -> None:
    with pytest.raises(InvalidSampleError, match=match) as info:
        parse_student_topk(rows, 2, 2)
    assert info.value.field == "student_top_logprobs"


def test_student_topk_pads_short_and_empty_rows_at_their_end() -> None:
    rows = [[[-0.5, 5, None]], [], [None, [-0.25, 9], None, [-2.0, 3], [-3.0, 4]]]
    ids, lps = parse_student_topk(rows, 3, 2)
    assert ids.tolist() == [[5, -1], [-1, -1], [9, 3]]
    assert lps.dtype == np.float32
    assert lps.tolist() == [[-0.5, -math.inf], [-math.inf, -math.inf], [-0.25, -2.0]]


def test_student_topk_padding_id_is_minus_one() -> None:
    from opd_stream.wire._student_topk import PAD_ID

    assert PAD_ID == -1


def test_student_topk_a_real_negative_id_in_a_short_row_is_still_an_error() -> None:
    with pytest.raises(InvalidSampleError, match="row 1 holds a negative token id"):
        parse_student_topk([GOOD_ROW, [[-0.1, -1]]], 2, 2)


def test_student_topk_tolerates_a_tiny_positive_rounding_error() -> None:
    _, lps = parse_student_topk([[[5e-5, 1], [-1.0, 2]]], 1, 2)
    assert lps[0, 0] == np.float32(5e-5)
