"""Row alignment read from the answer (issue 33, part 1): LMDeploy's
``/generate`` answers SGLang's scoring dialect without the leading empty row (entry 0 is about
``input_ids[s + 1]``) and as ``[value, token_id]`` pairs. Accepted where the echoed ids say so
unambiguously, by both parsers alike; refused, naming the alignments tried, where not.

The SGLang answers come from the independent fake scorer (``support.fake_generate``); the
LMDeploy ones are those answers with the leading row dropped and the text elements removed.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from support import fake_generate as wf

from opd_stream._errors import MisalignedResponseError
from opd_stream.scanner._loader import prepare
from opd_stream.wire._answers import ScoreRows
from opd_stream.wire._codec import decode_score_response
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest

TOK = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.int64)
R = 5


def lmdeploy(answer: dict[str, Any]) -> dict[str, Any]:
    """SGLang's answer as LMDeploy writes it: no leading row, ``[value, token_id]`` pairs."""
    out = copy.deepcopy(answer)
    meta = out["meta_info"]
    meta["input_token_logprobs"] = [e[:2] for e in meta["input_token_logprobs"][1:]]
    if meta.get("input_top_logprobs") is not None:
        meta["input_top_logprobs"] = [
            [e[:2] for e in row] for row in meta["input_top_logprobs"][1:]
        ]
    out.pop("text", None)
    return out


def sglang_answer(req: ScoreRequest) -> dict[str, Any]:
    answer: dict[str, Any] = wf.answer(build_score_payload(req))
    return answer


def same(a: ScoreRows, b: ScoreRows) -> None:
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.tobytes() == y.tobytes(), name
            assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        else:
            assert x == y, name


@pytest.mark.parametrize(
    "req",
    [
        ScoreRequest(tokens=TOK, response_length=R),
        ScoreRequest(tokens=TOK, response_length=R, start="zero"),
        ScoreRequest(tokens=TOK, response_length=R, top_k=3),
    ],
    ids=["prompt", "zero", "top-k"],
)
def test_no_leading_row_gives_the_same_rows(req: ScoreRequest) -> None:
    answer = sglang_answer(req)
    want = decode_score_response(wf.encode(answer), req)
    same(decode_score_response(wf.encode(lmdeploy(answer)), req), want)


def test_both_parsers_agree_on_it() -> None:
    assert prepare(), "numba could not compile the scanner"
    req = ScoreRequest(tokens=TOK, response_length=R, top_k=2)
    body = wf.encode(lmdeploy(sglang_answer(req)))
    same(
        decode_score_response(body, req, parser="scanner"),
        decode_score_response(body, req, parser="msgspec"),
    )


def test_ambiguous_alignment_is_refused_naming_both() -> None:
    # a run of one token: the echoed ids fit "no leading row" and "SGLang's, cut one short"
    tokens = np.array([3, 1, 4, 4, 4, 4, 4, 4], dtype=np.int64)
    req = ScoreRequest(tokens=tokens, response_length=R)
    body = wf.encode(lmdeploy(sglang_answer(req)))
    with pytest.raises(MisalignedResponseError, match="alignments tried") as info:
        decode_score_response(body, req)
    assert "ambiguous" in str(info.value)
    assert "LMDeploy" in str(info.value)


def test_one_short_with_other_ids_is_refused() -> None:
    req = ScoreRequest(tokens=TOK, response_length=R)
    answer = lmdeploy(sglang_answer(req))
    answer["meta_info"]["input_token_logprobs"][2][1] = 7  # not the token sent there
    with pytest.raises(MisalignedResponseError, match="fit neither"):
        decode_score_response(wf.encode(answer), req)
