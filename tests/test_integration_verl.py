"""verl drop-in: SGLang answers in verl's vLLM prompt_logprobs contract (position 0 skipped,
best first, one pad row), nested and b64, with errors instead of asserts."""

from __future__ import annotations

import base64
import math
from typing import Any

import aiohttp
import numpy as np
import pytest
from mock_helpers import post_json

from opd_stream import ConfigError, MalformedResponseError, MisalignedResponseError
from opd_stream.integrations.verl import (
    extract_prompt_logprobs,
    fill_prompt_logprobs,
    sglang_prompt_logprobs_params,
)
from opd_stream.testing.mock_sglang import serve_mock


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


def _t(lp: float | None, i: int) -> list[Any]:
    return [lp, i, None]


# The spec §3 teacher top-k for tokens [10, 11, 12]: {2: .5, 3: .5}, then {4: .8, 6: .2}.
SPEC_META = {
    "input_token_logprobs": [_t(None, 10), _t(math.log(0.1), 11), _t(math.log(0.2), 12)],
    "input_top_logprobs": [
        None,
        [_t(math.log(0.5), 2), _t(math.log(0.5), 3)],
        [_t(math.log(0.8), 4), _t(math.log(0.2), 6)],
    ],
}


def test_spec_teacher_top_k_becomes_best_first_rows_and_one_pad_row() -> None:
    ids, lps = extract_prompt_logprobs(SPEC_META, 2, 3)
    assert ids == [[2, 3], [4, 6], [0, 0]]
    want = [[math.log(0.5)] * 2, [math.log(0.8), math.log(0.2)], [0.0, 0.0]]
    assert lps == want


def test_sampled_token_rows_hold_the_scored_token_and_position_zero_is_skipped() -> None:
    result: dict[str, Any] = {}
    fill_prompt_logprobs(SPEC_META, 0, 3, result)
    assert result["prompt_ids"] == [[11], [12], [0]]
    assert result["prompt_logprobs"] == [[math.log(0.1)], [math.log(0.2)], [0.0]]


def test_fewer_top_entries_than_asked_is_a_validation_error_naming_the_position() -> None:
    meta = {**SPEC_META, "input_top_logprobs": [None, SPEC_META["input_top_logprobs"][1], None]}
    with pytest.raises(MisalignedResponseError, match=r"0 top logprobs at position 2, expected 2"):
        extract_prompt_logprobs(meta, 2, 3)
    short = {**SPEC_META, "input_top_logprobs": SPEC_META["input_top_logprobs"][:2]}
    with pytest.raises(MisalignedResponseError, match=r"2 entries, expected 3"):
        extract_prompt_logprobs(short, 2, 3)


def test_length_mismatch_missing_field_and_bad_arguments_are_errors() -> None:
    with pytest.raises(MisalignedResponseError, match=r"length \(3\) does not match .* \(4\)"):
        extract_prompt_logprobs(SPEC_META, 0, 4)
    with pytest.raises(MalformedResponseError, match="input_top_logprobs is missing"):
        extract_prompt_logprobs({"input_token_logprobs": SPEC_META["input_token_logprobs"]}, 2, 3)
    with pytest.raises(ConfigError, match="num_prompt_logprobs"):
        extract_prompt_logprobs(SPEC_META, -1, 3)
    with pytest.raises(ConfigError, match="num_prompt_logprobs"):
        sglang_prompt_logprobs_params(-2)
    with pytest.raises(MisalignedResponseError, match=r"input_token_logprobs\[2\] echoes"):
        extract_prompt_logprobs(SPEC_META, 0, 3, input_ids=[10, 11, 99])


def test_null_logprob_is_minus_infinity() -> None:
    meta = {"input_token_logprobs": [_t(None, 1), _t(None, 2)]}
    assert extract_prompt_logprobs(meta, 0, 2)[1] == [[-math.inf], [0.0]]


def test_b64_top_k_gives_the_same_lists_as_nested() -> None:
    vals = np.log(np.array([[0.5, 0.5], [0.8, 0.2]], dtype=np.float32)).astype("<f4")
    idx = np.array([[2, 3], [4, 6]], dtype="<i4")
    meta = {
        "input_token_logprobs": SPEC_META["input_token_logprobs"],
        "input_top_logprobs_shape": [2, 2],
        "input_top_logprobs_null_prefix": 1,
        "input_top_logprobs_val_flat_b64": base64.b64encode(vals.tobytes()).decode(),
        "input_top_logprobs_idx_flat_b64": base64.b64encode(idx.tobytes()).decode(),
    }
    ids, lps = extract_prompt_logprobs(meta, 2, 3)
    assert ids == [[2, 3], [4, 6], [0, 0]]
    for got, want in zip(lps[:2], vals.tolist(), strict=True):
        assert got == [float(np.float32(v)) for v in want]
    with pytest.raises(MisalignedResponseError, match="2 top logprobs per position, expected 3"):
        extract_prompt_logprobs(meta, 3, 3)


@pytest.mark.parametrize(("k", "b64"), [(0, False), (4, False), (4, True)])
async def test_mock_server_answers_match_the_closed_form_model(k: int, b64: bool) -> None:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 5000, 9).tolist()
    body: dict[str, Any] = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        **sglang_prompt_logprobs_params(k),
    }
    if b64:
        body["return_flat_raw_top_logprobs"] = True
        body["return_flat_raw_top_logprobs_b64"] = True
    async with serve_mock("teacher", 2) as server, aiohttp.ClientSession() as session:
        status, answer = await post_json(session, server.url, body)
        model = server.model
    assert status == 200
    assert b64 == ("input_top_logprobs_val_flat_b64" in answer["meta_info"])
    ids, lps = extract_prompt_logprobs(answer["meta_info"], k, len(tokens), input_ids=tokens)
    width = max(k, 1)
    assert len(ids) == len(lps) == len(tokens)
    assert all(len(r) == width for r in ids) and all(len(r) == width for r in lps)
    assert ids[-1] == [0] * width and lps[-1] == [0.0] * width
    tok = np.asarray(tokens)
    for j in range(1, len(tokens)):
        pos = np.array([j])
        if k == 0:
            want_ids = [tokens[j]]
            want_lps = [float(np.float32(model.token_logprobs(tok, pos)[0]))]
        else:
            top_ids, top_lps = model.topk(tok, pos, k)
            want_ids = [int(x) for x in top_ids[0]]
            want_lps = [float(np.float32(x)) for x in top_lps[0]]
        assert ids[j - 1] == want_ids, j
        for g, e in zip(lps[j - 1], want_lps, strict=True):
            assert g == e or (math.isinf(g) and math.isinf(e)), (j, g, e)
