"""Golden tests for the SGLang request bodies built by ``opd_stream.wire._request``."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from support.fake_generate import SAMPLING_KEYS

from opd_stream._errors import InvalidSampleError
from opd_stream.wire._payloads import build_generate_payload, build_score_payload
from opd_stream.wire._request import ScoreRequest

# P = 3 prompt tokens, R = 5 response tokens.
TOKENS = np.array([101, 102, 103, 7, 8, 9, 10, 11], dtype=np.int64)
R = 5
IDS = np.array([[5, 2], [2, 9], [4, 1], [8, 7], [3, 5]], dtype=np.int64)
SCORING = {"temperature": 0, "max_new_tokens": 0}
TAIL = {"return_text_in_logprobs": False, "stream": False}


def payload(**kw: Any) -> dict[str, Any]:
    req = ScoreRequest(tokens=TOKENS, response_length=R, **kw)
    out = json.loads(build_score_payload(req))
    assert isinstance(out, dict)
    return out


def single(start: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": TOKENS.tolist(),
        "sampling_params": SCORING,
        "return_logprob": True,
        "logprob_start_len": start,
        **extra,
        **TAIL,
    }


POSITIONS = [[], [], [], [5, 2], [2, 9], [4, 1], [8, 7], [3, 5]]


def test_sampled_token_only_starts_at_prompt_minus_one() -> None:
    assert payload() == single(2)


def test_sampled_token_only_with_start_zero() -> None:
    assert payload(start="zero") == single(0)


def test_topk_only_sends_top_logprobs_num_at_top_level() -> None:
    assert payload(top_k=4) == single(2, top_logprobs_num=4)


def test_topk_b64_adds_the_input_output_and_b64_flat_raw_flags() -> None:
    assert payload(top_k=4, topk_wire="b64") == single(
        2,
        top_logprobs_num=4,
        return_flat_raw_top_logprobs=True,
        return_flat_raw_output_top_logprobs=True,
        return_flat_raw_top_logprobs_b64=True,
    )


def test_b64_without_topk_sends_no_flat_raw_flags() -> None:
    assert payload(topk_wire="b64") == single(2)


def test_per_position_ids_have_one_row_per_input_token_and_empty_prompt_rows() -> None:
    assert payload(ids=IDS) == single(2, token_ids_logprob_positions=POSITIONS)


def test_per_position_ids_with_start_zero() -> None:
    assert payload(ids=IDS, start="zero") == single(0, token_ids_logprob_positions=POSITIONS)


def test_per_position_keeps_request_order_within_a_row() -> None:
    body = payload(ids=IDS)
    assert body["token_ids_logprob_positions"][3] == [5, 2]


def test_per_position_never_sends_the_flat_field() -> None:
    assert "token_ids_logprob" not in payload(ids=IDS, top_k=2)


def test_flat_ids_send_the_sorted_unique_union() -> None:
    assert payload(ids=IDS, id_form="flat") == single(2, token_ids_logprob=[1, 2, 3, 4, 5, 7, 8, 9])


def test_flat_ids_with_start_zero() -> None:
    assert payload(ids=IDS, id_form="flat", start="zero") == single(
        0, token_ids_logprob=[1, 2, 3, 4, 5, 7, 8, 9]
    )


def test_union_style_request_carries_topk_and_per_position_ids() -> None:
    assert payload(ids=IDS, top_k=3) == single(
        2, top_logprobs_num=3, token_ids_logprob_positions=POSITIONS
    )


def test_union_style_flat_with_b64() -> None:
    assert payload(ids=IDS, top_k=3, id_form="flat", topk_wire="b64") == single(
        2,
        top_logprobs_num=3,
        token_ids_logprob=[1, 2, 3, 4, 5, 7, 8, 9],
        return_flat_raw_top_logprobs=True,
        return_flat_raw_output_top_logprobs=True,
        return_flat_raw_top_logprobs_b64=True,
    )


BLOCKED_B2 = {
    # blocks of B=2 over R=5: [0,2), [2,4), [4,5). Id-only, so each block's last row is the
    # output row: input ends P+1, P+3, P+4, and each union gains that row's target token
    # (response tokens 8, 10, 11).
    "input_ids": [TOKENS[:4].tolist(), TOKENS[:6].tolist(), TOKENS[:7].tolist()],
    "sampling_params": SCORING,
    "return_logprob": True,
    "logprob_start_len": [2, 4, 6],
    "token_ids_logprob": [[2, 5, 8, 9], [1, 4, 7, 8, 10], [3, 5, 11]],
    **TAIL,
}


def test_blocked_is_one_batch_body_with_r_not_a_multiple_of_b() -> None:
    assert payload(ids=IDS, id_form="blocked", block_size=2) == BLOCKED_B2


def test_blocked_ignores_start_zero_and_starts_each_block_before_its_first_row() -> None:
    assert payload(ids=IDS, id_form="blocked", block_size=2, start="zero") == BLOCKED_B2


def test_blocked_with_topk_and_b64_broadcasts_scalars() -> None:
    got = payload(ids=IDS, id_form="blocked", block_size=3, top_k=2, topk_wire="b64")
    assert got == {
        "input_ids": [TOKENS[:6].tolist(), TOKENS.tolist()],
        "sampling_params": SCORING,
        "return_logprob": True,
        "logprob_start_len": [2, 5],
        "top_logprobs_num": 2,
        "token_ids_logprob": [[1, 2, 4, 5, 9], [3, 5, 7, 8]],
        "return_flat_raw_top_logprobs": True,
        "return_flat_raw_output_top_logprobs": True,
        "return_flat_raw_top_logprobs_b64": True,
        **TAIL,
    }


def test_blocked_with_one_block_is_still_a_batch_of_one() -> None:
    got = payload(ids=IDS, id_form="blocked", block_size=8)
    assert got["input_ids"] == [TOKENS[:-1].tolist()]
    assert got["logprob_start_len"] == [2]
    assert got["token_ids_logprob"] == [[1, 2, 3, 4, 5, 7, 8, 9, 11]]


def test_blocked_without_ids_is_a_single_request() -> None:
    assert payload(id_form="blocked", top_k=2) == single(2, top_logprobs_num=2)


def test_keys_come_in_a_fixed_order() -> None:
    req = ScoreRequest(tokens=TOKENS, response_length=R, top_k=2, ids=IDS, topk_wire="b64")
    keys = list(json.loads(build_score_payload(req)))
    assert keys == [
        "input_ids",
        "sampling_params",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob_positions",
        "return_flat_raw_top_logprobs",
        "return_flat_raw_output_top_logprobs",
        "return_flat_raw_top_logprobs_b64",
        "return_text_in_logprobs",
        "stream",
    ]


@pytest.mark.parametrize("form", ["per-position", "flat", "blocked"])
def test_sampling_params_only_hold_keys_sglang_accepts(form: str) -> None:
    got = payload(ids=IDS, id_form=form, top_k=2)
    assert set(got["sampling_params"]) <= SAMPLING_KEYS


def test_payload_is_identical_for_equal_requests() -> None:
    a = ScoreRequest(tokens=TOKENS, response_length=R, ids=IDS, id_form="blocked", block_size=2)
    b = ScoreRequest(
        tokens=TOKENS.copy(), response_length=R, ids=IDS.copy(), id_form="blocked", block_size=2
    )
    assert build_score_payload(a) == build_score_payload(b)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"response_length": 0}, "response_length"),
        ({"response_length": 8}, "response_length"),  # P would be 0
        ({"top_k": -1}, "top_k"),
        ({"block_size": -1}, "block_size"),
        ({"ids": IDS[:4]}, "ids"),
        ({"ids": np.zeros((R, 0), dtype=np.int64)}, "ids"),
        ({"ids": np.array([[1, 1]] * R, dtype=np.int64)}, "ids"),
        ({"ids": np.array([[1, -2]] * R, dtype=np.int64)}, "ids"),
        ({"ids": np.array([[1, 2**31]] * R, dtype=np.int64)}, "ids"),
        ({"tokens": TOKENS.astype(np.float64)}, "tokens"),
    ],
)
def test_malformed_request_raises_invalid_sample_naming_the_field(
    kw: dict[str, Any], field: str
) -> None:
    args: dict[str, Any] = {"tokens": TOKENS, "response_length": R, **kw}
    with pytest.raises(InvalidSampleError) as info:
        build_score_payload(ScoreRequest(**args))
    assert info.value.field == field


def test_duplicate_id_error_names_the_response_position() -> None:
    ids = IDS.copy()
    ids[3] = [6, 6]
    with pytest.raises(InvalidSampleError, match="response position 3"):
        build_score_payload(ScoreRequest(tokens=TOKENS, response_length=R, ids=ids))


def test_generate_payload_single_prompt() -> None:
    got = json.loads(build_generate_payload([1, 2, 3], max_new_tokens=16))
    assert got == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 16},
        "return_logprob": True,
        **TAIL,
    }


def test_generate_payload_batch_with_seed_and_topk() -> None:
    body = build_generate_payload(
        [[1, 2], [3]], max_new_tokens=4, temperature=0.7, top_logprobs_num=5, seed=42
    )
    got = json.loads(body)
    assert got == {
        "input_ids": [[1, 2], [3]],
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 4, "sampling_seed": 42},
        "return_logprob": True,
        "top_logprobs_num": 5,
        **TAIL,
    }
    assert set(got["sampling_params"]) <= SAMPLING_KEYS


@pytest.mark.parametrize(
    ("prompts", "kw"),
    [
        ([], {}),
        ([[]], {}),
        ([1, -2], {}),
        ([[1], [True]], {}),
        ([1, 2], {"max_new_tokens": 0}),
        ([1, 2], {"top_logprobs_num": -1}),
    ],
)
def test_generate_payload_rejects_bad_arguments(prompts: Any, kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"max_new_tokens": 4, **kw}
    with pytest.raises(ValueError):
        build_generate_payload(prompts, **args)
