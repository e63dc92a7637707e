"""The vLLM wire (issue 33, part 1): request bodies for vLLM 0.34.0's scale-out generate and
OpenAI completions, and their answers decoded into the same ScoreRows as SGLang's.

Answers are written here by hand the way vLLM writes them (``np.save`` + base64 as
``numpy2base64``; prompt-logprob dicts as ``append_logprobs_for_next_position`` builds them,
-inf clamped to -9999.0 as ``clamp_prompt_logprobs``) from a float64 reference computed with
loops; the field names the bodies use are read from vLLM's own source (ast, never imported).
"""

from __future__ import annotations

import ast
import base64
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from opd_stream._errors import (
    CapabilityError,
    InvalidSampleError,
    MalformedResponseError,
    MisalignedResponseError,
    ServerAbortError,
    WeightVersionChanged,
)
from opd_stream.wire._codec import build_block_payloads, decode, decode_score_response
from opd_stream.wire._payloads import build_score_payload, probe_body
from opd_stream.wire._request import ENGINES, ScoreRequest, column_chunks, layout, multi_body
from opd_stream.wire._vllm import ENGINE_PATHS, engine_problem, sends_id_columns

VLLM_SRC = Path(__file__).resolve().parents[2] / ".cache/vllm/src/vllm"
V = 12  # vocabulary; ids 10 and 11 are masked (-inf) everywhere
MASKED = (10, 11)
P, R = 5, 4
L = P + R


# ---- the float64 reference (loops) and answers written as vLLM writes them ----------------


def _reference() -> list[list[float]]:
    """``lsm[j][v]``: log p(v | tokens[:j]) for every absolute position ``j`` (float64)."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(L):
        logits = [float(x) for x in rng.normal(0.0, 2.0, V)]
        finite = [x for v, x in enumerate(logits) if v not in MASKED]
        top = max(finite)
        lse = top + math.log(math.fsum(math.exp(x - top) for x in finite))
        out.append([-math.inf if v in MASKED else x - lse for v, x in enumerate(logits)])
    return out


LSM = _reference()
TOKENS = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5], dtype=np.int64)
IDS = np.array([[0, 7, 11], [2, 3, 4], [9, 8, 10], [6, 1, 0]], dtype=np.int64)


def f32(x: float) -> float:
    """A value as vLLM holds it (float32), as JSON carries it."""
    return float(np.float32(x))


def npy_b64(values: Any) -> str:
    with io.BytesIO() as buf:  # numpy2base64
        np.save(buf, values, allow_pickle=False)
        return base64.b64encode(buf.getbuffer()).decode("ascii")


def vllm_row(j: int, top_k: int) -> dict[str, dict[str, Any]]:
    """Position ``j``'s prompt-logprob dict: the actual token first (its rank counts ties),
    then the top-k by position (a duplicate key keeps its place, takes the top-k rank)."""
    lp = LSM[j]
    actual = int(TOKENS[j])
    order = sorted(range(V), key=lambda v: -lp[v])[:top_k]
    row = {str(actual): (lp[actual], 1 + sum(x > lp[actual] for x in lp))}
    for i, v in enumerate(order):
        row[str(v)] = (lp[v], i + 1)
    return {
        key: {"logprob": -9999.0 if x == -math.inf else f32(x), "rank": rank, "decoded_token": None}
        for key, (x, rank) in row.items()
    }


def scale_out_answer(
    req: ScoreRequest, chunk: int = 0, *, version: str = "v1", cached: int | None = 3
) -> dict[str, Any]:
    lo, hi = column_chunks(req)[chunk]
    cols = [
        [int(TOKENS[P + t]), *([] if req.ids is None else req.ids[t].tolist())] for t in range(R)
    ]
    values = np.array(
        [[LSM[P + t][v] for v in row[lo:hi]] for t, row in enumerate(cols)], dtype=np.float32
    )
    prompt_logprobs = None
    if req.top_k > 0 and chunk == 0:
        prompt_logprobs = [None] * P + [vllm_row(P + t, req.top_k) for t in range(R)]
    usage: dict[str, Any] = {"prompt_tokens": L, "completion_tokens": 1, "total_tokens": L + 1}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {
        "request_id": "r",
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": [0],
                "weight_versions": [{"version": version, "start": 0, "end": 1}],
            }
        ],
        "usage": usage,
        "prompt_logprobs": prompt_logprobs,
        # vLLM's null where no prompt_logprob_token_ids were sent (the top-k alone)
        "prompt_token_id_logprobs": npy_b64(values) if sends_id_columns(req) else None,
    }


def completions_answer(top_k: int, *, echo: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": "",
        "finish_reason": "length",
        "prompt_logprobs": [None] + [vllm_row(j, top_k) for j in range(1, L)],
        "weight_versions": [{"version": "w7", "start": 0, "end": 1}],
    }
    if echo:
        choice["prompt_token_ids"] = TOKENS.tolist()
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "m",
        "choices": [choice],
        "usage": {"prompt_tokens": L, "total_tokens": L + 1, "completion_tokens": 1},
    }


def enc(answer: Any) -> bytes:
    return json.dumps(answer).encode()


def req_of(engine: str = "vllm", **kw: Any) -> ScoreRequest:
    kw.setdefault("ids", IDS)
    return ScoreRequest(tokens=TOKENS, response_length=R, engine=engine, **kw)  # type: ignore[arg-type]


def expected(top_k: int, ids: Any = IDS) -> dict[str, Any]:
    """The reference rows, float32 as the decoders give them."""
    resp = [P + t for t in range(R)]
    out: dict[str, Any] = {
        "token": np.array([LSM[j][TOKENS[j]] for j in resp], dtype=np.float32),
        "ids": None
        if ids is None
        else np.array([[LSM[j][v] for v in ids[t]] for t, j in enumerate(resp)], np.float32),
    }
    tops = [sorted(range(V), key=lambda v: -LSM[j][v])[:top_k] for j in resp]
    out["top_ids"] = np.array(tops, dtype=np.int64).reshape(R, top_k)
    out["top_lp"] = np.array(
        [[LSM[j][v] for v in tops[t]] for t, j in enumerate(resp)], np.float32
    ).reshape(R, top_k)
    return out


# ---- names and bodies ---------------------------------------------------------------------


def test_engines_and_their_paths() -> None:
    assert ENGINES == ("sglang", "vllm", "vllm-completions")
    assert dict(ENGINE_PATHS) == {
        "sglang": "generate",
        "vllm": "inference/v1/generate",
        "vllm-completions": "v1/completions",
    }


def test_paths_are_the_routes_vllm_registers() -> None:
    scale_out = _read("entrypoints/scale_out/token_in_token_out/api_router.py")
    completions = _read("entrypoints/openai/completion/api_router.py")
    assert f'"/{ENGINE_PATHS["vllm"]}"' in scale_out
    assert f'"/{ENGINE_PATHS["vllm-completions"]}"' in completions


def test_scale_out_body_fields() -> None:
    req = req_of(top_k=3, cache_salt="s")
    body = json.loads(build_score_payload(req))
    assert body["token_ids"] == TOKENS.tolist()
    assert body["output_mode"] == "tokens"
    assert body["cache_salt"] == "s"
    assert body["stream"] is False
    sp = body["sampling_params"]
    assert sp["max_tokens"] == 1
    assert sp["prompt_logprob_start"] == P - 1
    assert sp["skip_reading_prefix_cache"] is False
    assert sp["prompt_logprobs"] == 3
    assert sp["detokenize"] is False
    want = [[int(TOKENS[P + t]), *IDS[t].tolist()] for t in range(R)]
    assert sp["prompt_logprob_token_ids"] == want


def test_scale_out_body_uses_only_vllm_fields() -> None:
    body = json.loads(build_score_payload(req_of(top_k=2, cache_salt="s")))
    assert set(body) - {"sampling_params"} <= _fields("GenerateRequest", _PROTOCOL)
    assert set(body["sampling_params"]) <= _fields("SamplingParams", "sampling_params.py")


def test_completions_body_uses_only_vllm_fields() -> None:
    body = json.loads(
        build_score_payload(req_of("vllm-completions", ids=None, top_k=2, cache_salt="s"))
    )
    assert set(body) <= _fields("CompletionRequest", "entrypoints/openai/completion/protocol.py")
    assert body["prompt"] == TOKENS.tolist()
    assert (body["max_tokens"], body["prompt_logprobs"]) == (1, 2)


def test_sampled_token_only_scale_out_body_scores_one_column() -> None:
    sp = json.loads(build_score_payload(req_of(ids=None)))["sampling_params"]
    assert sp["prompt_logprob_token_ids"] == [[int(t)] for t in TOKENS[P:]]
    assert "prompt_logprobs" not in sp


def test_the_teachers_top_k_alone_sends_no_id_column() -> None:
    # the dicts hold the sampled token: no column, no .npy, fewer bytes each way
    sp = json.loads(build_score_payload(req_of(ids=None, top_k=3)))["sampling_params"]
    assert "prompt_logprob_token_ids" not in sp
    assert (sp["prompt_logprobs"], sp["prompt_logprob_start"]) == (3, P - 1)


def test_columns_over_max_ids_are_split_into_bodies() -> None:
    req = req_of(top_k=2, max_ids=2)  # 1 + 3 columns -> [0, 2), [2, 4)
    assert multi_body(req)
    assert column_chunks(req) == [(0, 2), (2, 4)]
    bodies = [json.loads(b) for b in build_block_payloads(req)]
    rows = [b["sampling_params"]["prompt_logprob_token_ids"] for b in bodies]
    full = [[int(TOKENS[P + t]), *IDS[t].tolist()] for t in range(R)]
    assert [a + b for a, b in zip(rows[0], rows[1], strict=True)] == full
    assert [("prompt_logprobs" in b["sampling_params"]) for b in bodies] == [True, False]


def test_a_multi_body_request_refuses_a_single_body() -> None:
    with pytest.raises(ValueError, match="several bodies"):
        build_score_payload(req_of(max_ids=2))


def test_within_max_ids_is_one_body() -> None:
    assert not multi_body(req_of(max_ids=4))
    assert not multi_body(req_of(ids=None, max_ids=1))
    assert len(build_block_payloads(req_of(max_ids=4))) == 1


def test_multi_body_keeps_sglang_blocks() -> None:
    assert multi_body(req_of("sglang", id_form="blocks", block_size=2))
    assert not multi_body(req_of("sglang"))


def test_layout_of_a_vllm_request_is_one_segment_from_the_response_start() -> None:
    (seg,) = layout(req_of()).segments
    assert (seg.length, seg.start, seg.rows) == (L, P - 1, R)


@pytest.mark.parametrize("engine", ENGINES)
def test_probe_body_is_a_valid_tiny_request(engine: str) -> None:
    body = json.loads(probe_body(engine))  # type: ignore[arg-type]
    if engine == "vllm":
        assert body["token_ids"] == [0, 0]
        assert body["sampling_params"]["prompt_logprob_token_ids"] == [[0]]
    elif engine == "vllm-completions":
        assert body["prompt"] == [0, 0]
    else:
        assert body["input_ids"] == [0, 0]


def test_completions_cannot_score_chosen_ids() -> None:
    problem = engine_problem("vllm-completions", top_k=0, ids=True)
    assert problem is not None
    assert "--enable-scale-out" in problem
    with pytest.raises(CapabilityError, match="--enable-scale-out"):
        build_score_payload(req_of("vllm-completions"))


def test_top_k_over_max_logprobs_names_the_flag() -> None:
    problem = engine_problem("vllm", top_k=32, ids=False, max_logprobs=20)
    assert problem is not None
    assert "--max-logprobs 32 or more" in problem
    assert engine_problem("vllm", top_k=20, ids=True, max_logprobs=20) is None
    assert engine_problem("sglang", top_k=99, ids=True, max_logprobs=1) is None
    with pytest.raises(CapabilityError, match="--max-logprobs 3"):
        build_score_payload(req_of(ids=None, top_k=3, max_ids=2))


def test_bad_engine_and_max_ids_are_invalid_samples() -> None:
    with pytest.raises(InvalidSampleError, match="engine"):
        layout(req_of("trtllm"))
    with pytest.raises(InvalidSampleError, match="max_ids"):
        layout(req_of(max_ids=-1))


# ---- answers ------------------------------------------------------------------------------


def test_scale_out_round_trip_equals_the_reference() -> None:
    req = req_of(top_k=4)
    rows = decode_score_response(enc(scale_out_answer(req)), req)
    want = expected(4)
    np.testing.assert_array_equal(rows.token_ids, TOKENS[P:])
    np.testing.assert_array_equal(rows.token_logprobs, want["token"])
    np.testing.assert_array_equal(rows.id_logprobs, want["ids"])
    np.testing.assert_array_equal(rows.top_ids, want["top_ids"])
    np.testing.assert_array_equal(rows.top_logprobs, want["top_lp"])
    assert rows.token_logprobs.dtype == np.float32
    assert rows.top_ids is not None
    assert rows.top_ids.dtype == np.int64
    assert (rows.weight_version, rows.cached_tokens) == ("v1", 3)


def test_the_top_k_alone_reads_the_sampled_tokens_logprob_from_the_dicts() -> None:
    req = req_of(ids=None, top_k=4)
    answer = scale_out_answer(req)
    assert answer["prompt_token_id_logprobs"] is None
    rows = decode_score_response(enc(answer), req)
    want = expected(4, ids=None)
    np.testing.assert_array_equal(rows.token_logprobs, want["token"])
    np.testing.assert_array_equal(rows.top_ids, want["top_ids"])
    np.testing.assert_array_equal(rows.top_logprobs, want["top_lp"])
    assert rows.token_logprobs.dtype == np.float32
    assert rows.id_logprobs is None


def test_a_masked_sampled_token_read_from_the_dicts_is_minus_inf() -> None:
    tokens = TOKENS.copy()
    tokens[P + 1] = MASKED[0]  # vLLM writes its logprob -9999.0
    req = ScoreRequest(tokens=tokens, response_length=R, engine="vllm", top_k=2)
    answer = scale_out_answer(req)
    top = {k: v for k, v in answer["prompt_logprobs"][P + 1].items() if v["rank"] <= 2}
    masked = {"logprob": -9999.0, "rank": V - 1, "decoded_token": None}
    answer["prompt_logprobs"][P + 1] = {str(MASKED[0]): masked, **top}
    rows = decode_score_response(enc(answer), req)
    assert np.isneginf(rows.token_logprobs[1])
    assert np.isfinite(np.delete(rows.token_logprobs, 1)).all()


def test_masked_ids_read_as_minus_inf() -> None:
    req = req_of(top_k=V)  # the whole vocabulary: -9999.0 entries in the dicts
    rows = decode_score_response(enc(scale_out_answer(req)), req)
    assert rows.top_logprobs is not None
    assert rows.id_logprobs is not None
    assert np.isneginf(rows.top_logprobs[:, -2:]).all()
    assert np.isneginf(rows.id_logprobs[0, 2])  # id 11, from the .npy's own -inf
    assert set(rows.top_ids[:, -2:].ravel().tolist()) == set(MASKED)  # type: ignore[union-attr]


def test_column_chunks_stitch_to_the_one_body_result() -> None:
    req = req_of(top_k=2, max_ids=2)
    answers = [enc(scale_out_answer(req, n, cached=2)) for n in range(2)]
    rows, parser = decode(answers, req)
    one = req_of(top_k=2)
    whole = decode_score_response(enc(scale_out_answer(one)), one)
    np.testing.assert_array_equal(rows.id_logprobs, whole.id_logprobs)
    np.testing.assert_array_equal(rows.token_logprobs, whole.token_logprobs)
    np.testing.assert_array_equal(rows.top_logprobs, whole.top_logprobs)
    assert rows.cached_tokens == 4
    assert parser == "msgspec"


def test_chunks_with_different_weight_versions_fail() -> None:
    req = req_of(max_ids=2)
    answers = [enc(scale_out_answer(req, n, version=f"v{n}")) for n in range(2)]
    with pytest.raises(WeightVersionChanged):
        decode(answers, req)


def test_weight_version_is_the_span_over_output_token_0() -> None:
    req = req_of()
    answer = scale_out_answer(req)
    answer["choices"][0]["weight_versions"] = [
        {"version": "old", "start": 1, "end": 2},
        {"version": "new", "start": 0, "end": 1},
    ]
    assert decode_score_response(enc(answer), req).weight_version == "new"
    answer["choices"][0]["weight_versions"] = None
    assert decode_score_response(enc(answer), req).weight_version is None


@pytest.mark.parametrize("top_k", [0, 3])
def test_completions_round_trip_equals_the_reference(top_k: int) -> None:
    req = req_of("vllm-completions", ids=None, top_k=top_k)
    rows = decode_score_response(enc(completions_answer(top_k, echo=True)), req)
    want = expected(top_k)
    np.testing.assert_array_equal(rows.token_logprobs, want["token"])
    assert rows.id_logprobs is None
    if top_k:
        np.testing.assert_array_equal(rows.top_ids, want["top_ids"])
        np.testing.assert_array_equal(rows.top_logprobs, want["top_lp"])
    else:
        assert rows.top_ids is None
    assert rows.weight_version == "w7"
    assert rows.cached_tokens is None


def test_completions_row_count_must_be_the_prompt_length() -> None:
    answer = completions_answer(2)
    answer["choices"][0]["prompt_logprobs"].pop()
    with pytest.raises(MisalignedResponseError, match="8 entries, expected 9"):
        decode_score_response(enc(answer), req_of("vllm-completions", ids=None, top_k=2))


# ---- malformed .npy ------------------------------------------------------------------------


def _npy_answer(text: str) -> bytes:
    req = req_of()
    answer = scale_out_answer(req)
    answer["prompt_token_id_logprobs"] = text
    return enc(answer)


def _good_values() -> Any:
    return np.zeros((R, 4), dtype=np.float32) - 1.0


def _header_bytes(header: str, data: bytes, *, hlen: int | None = None) -> str:
    text = header.encode("latin-1")
    size = len(text) if hlen is None else hlen
    return base64.b64encode(
        b"\x93NUMPY\x01\x00" + size.to_bytes(2, "little") + text + data
    ).decode()


_DATA = _good_values().tobytes()
_OK_HEADER = "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 4), }\n"

NPY_CASES = {
    "float64": (
        npy_b64(_good_values().astype(np.float64)),
        MalformedResponseError,
        "expected '<f4'",
    ),
    "big-endian": (npy_b64(_good_values().astype(">f4")), MalformedResponseError, "big-endian"),
    "fortran": (
        _header_bytes(_OK_HEADER.replace("False", "True"), _DATA),
        MalformedResponseError,
        "Fortran",
    ),
    "pickle": (
        _header_bytes(_OK_HEADER.replace("<f4", "|O"), _DATA),
        MalformedResponseError,
        "pickle",
    ),
    "header lies": (_header_bytes(_OK_HEADER, b"", hlen=2000), MalformedResponseError, "claims"),
    "huge shape": (
        _header_bytes(_OK_HEADER.replace("(4, 4)", "(4000000000000, 4)"), _DATA),
        MisalignedResponseError,
        "shape",
    ),
    "wrong shape": (npy_b64(np.zeros((R + 1, 4), np.float32)), MisalignedResponseError, "shape"),
    "short data": (_header_bytes(_OK_HEADER, _DATA[:-4]), MalformedResponseError, "data bytes"),
    "truncated base64": (npy_b64(_good_values())[:-3], MalformedResponseError, "base64"),
    "invalid base64": ("#" + npy_b64(_good_values())[1:], MalformedResponseError, "base64"),
    "not npy": (base64.b64encode(_DATA).decode(), MalformedResponseError, "magic"),
    "header not a dict": (_header_bytes("[1, 2]\n", _DATA), MalformedResponseError, "not a dict"),
    "header not python": (_header_bytes("{'descr': \n", _DATA), MalformedResponseError, "parse"),
    "three dims": (
        _header_bytes(_OK_HEADER.replace("(4, 4)", "(4, 4, 1)"), _DATA),
        MalformedResponseError,
        "two non-negative",
    ),
    "NaN": (npy_b64(np.full((R, 4), np.nan, np.float32)), MalformedResponseError, "NaN"),
    "positive": (npy_b64(np.full((R, 4), 0.5, np.float32)), MalformedResponseError, "above 0"),
    "oversized text": (
        base64.b64encode(b"\x93NUMPY" + bytes(200_000)).decode(),
        MalformedResponseError,
        "more than a float32",
    ),
}


@pytest.mark.parametrize("case", NPY_CASES)
def test_malformed_npy_fails_the_sample(case: str) -> None:
    text, error, words = NPY_CASES[case]
    with pytest.raises(error, match=words) as info:
        decode_score_response(_npy_answer(text), req_of())
    assert "prompt_token_id_logprobs" in str(info.value)


def test_version_2_header_reads() -> None:
    header = _OK_HEADER.encode()
    raw = b"\x93NUMPY\x02\x00" + len(header).to_bytes(4, "little") + header + _DATA
    rows = decode_score_response(_npy_answer(base64.b64encode(raw).decode()), req_of())
    assert (rows.token_logprobs == -1.0).all()


# ---- malformed answers ----------------------------------------------------------------------


def _broken(change: Any, **kw: Any) -> tuple[bytes, ScoreRequest]:
    req = req_of(top_k=3, **kw)
    answer = scale_out_answer(req)
    change(answer)
    return enc(answer), req


def _row(answer: dict[str, Any], t: int = 1) -> dict[str, Any]:
    row: dict[str, Any] = answer["prompt_logprobs"][P + t]
    return row


def _drop_actual(answer: dict[str, Any]) -> None:
    row = _row(answer)
    actual = str(int(TOKENS[P + 1]))
    if len(row) == 4:  # not among the top-3: drop it
        del row[actual]
    else:  # among them: replace it by another top entry
        spare = next(str(v) for v in range(10) if str(v) not in row)
        row[spare] = row.pop(actual)


def _bad_rank(answer: dict[str, Any]) -> None:
    for value in _row(answer).values():
        if value["rank"] == 2:
            value["rank"] = 1


def _extra_entry(answer: dict[str, Any]) -> None:
    row = _row(answer)
    for v in range(V):
        row.setdefault(str(v), {"logprob": -20.0, "rank": 9, "decoded_token": None})
        if len(row) == 5:
            break


MALFORMED = {
    "top-k row missing": (
        lambda a: a["prompt_logprobs"].__setitem__(P + 2, None),
        MisalignedResponseError,
        "no row for absolute position 7",
    ),
    "top-k count": (_extra_entry, MisalignedResponseError, "5 entries, expected 3"),
    "top-k ranks": (_bad_rank, MisalignedResponseError, r"ranks are not 1\.\.3"),
    "actual token missing": (_drop_actual, MisalignedResponseError, "lacks the actual token"),
    "prompt_logprobs length": (
        lambda a: a["prompt_logprobs"].pop(0),
        MisalignedResponseError,
        "8 entries, expected 9",
    ),
    "prompt_logprobs missing": (
        lambda a: a.__setitem__("prompt_logprobs", None),
        MalformedResponseError,
        "missing required field `\\$.prompt_logprobs`",
    ),
    "echoed ids": (
        lambda a: a.__setitem__("prompt_token_ids", [*TOKENS.tolist()[:-1], 0]),
        MisalignedResponseError,
        "absolute position 8 differs",
    ),
    "echoed count": (
        lambda a: a.__setitem__("prompt_token_ids", TOKENS.tolist()[:-1]),
        MisalignedResponseError,
        "8 ids, expected the 9 sent",
    ),
    "choices missing": (lambda a: a.pop("choices"), MalformedResponseError, "choices"),
    "wrong types": (
        lambda a: a.__setitem__("prompt_token_id_logprobs", 5),
        MalformedResponseError,
        "Expected `str | null`",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_answer_fails_the_sample(case: str) -> None:
    change, error, words = MALFORMED[case]
    body, req = _broken(change)
    with pytest.raises(error, match=words):
        decode_score_response(body, req)


@pytest.mark.parametrize("case", ["actual token missing", "top-k row missing", "top-k count"])
def test_a_bad_row_fails_the_top_k_alone_too(case: str) -> None:
    # the sampled token's logprob then comes from the dicts alone: a row without it fails
    change, error, words = MALFORMED[case]
    body, req = _broken(change, ids=None)
    with pytest.raises(error, match=words):
        decode_score_response(body, req)


def test_echoed_ids_that_match_are_accepted() -> None:
    body, req = _broken(lambda a: a.__setitem__("prompt_token_ids", TOKENS.tolist()))
    assert decode_score_response(body, req).token_logprobs.shape == (R,)


def test_not_json_is_malformed() -> None:
    with pytest.raises(MalformedResponseError):
        decode_score_response(b'{"choices": [', req_of())


def test_abort_is_a_server_abort() -> None:
    body, req = _broken(lambda a: a["choices"][0].__setitem__("finish_reason", "abort"))
    with pytest.raises(ServerAbortError):
        decode_score_response(body, req)


def test_an_answer_without_token_id_logprobs_names_the_capability() -> None:
    body, req = _broken(lambda a: a.__setitem__("prompt_token_id_logprobs", None))
    with pytest.raises(CapabilityError, match=r"0\.34\.0") as info:
        decode_score_response(body, req)
    assert info.value.capability == "vllm_token_id_logprobs"


def test_messages_never_quote_payload_values() -> None:
    secret = 987654321
    body, req = _broken(lambda a: a.__setitem__("prompt_token_ids", [secret] * L))
    with pytest.raises(MisalignedResponseError) as info:
        decode_score_response(body, req)
    assert str(secret) not in str(info.value)


def test_completions_wants_one_choice() -> None:
    answer = completions_answer(0)
    answer["choices"].append(answer["choices"][0])
    with pytest.raises(MisalignedResponseError, match="2 entries, expected 1"):
        decode_score_response(enc(answer), req_of("vllm-completions", ids=None))


def test_completions_keys_must_be_ids() -> None:
    answer = completions_answer(1)
    row = answer["choices"][0]["prompt_logprobs"][P]
    row["x"] = row.pop(next(iter(row)))
    with pytest.raises(MalformedResponseError):
        decode_score_response(enc(answer), req_of("vllm-completions", ids=None, top_k=1))


# ---- vLLM's own source, read (never imported) -----------------------------------------------

_PROTOCOL = "entrypoints/scale_out/token_in_token_out/protocol.py"


def _read(rel: str) -> str:
    path = VLLM_SRC / rel
    if not path.is_file():
        pytest.fail(
            f"vLLM 0.34.0's source {path} is missing: run the set-up step (dev.sh setup "
            "downloads the wheel --no-deps into .cache/vllm)"
        )
    return path.read_text()


def _fields(name: str, rel: str) -> set[str]:
    """The annotated fields of class ``name`` in vLLM's file ``rel``."""
    tree = ast.parse(_read(rel))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    pytest.fail(f"no class {name} in {rel}")


def test_answer_fields_read_are_vllms() -> None:
    """Every answer field the decoder reads is in vLLM's response models."""
    base = _fields("GenerateResponseBase", _PROTOCOL)
    assert {"prompt_logprobs", "prompt_token_id_logprobs", "prompt_token_ids", "usage"} <= base
    assert {"weight_versions", "finish_reason"} <= _fields("GenerateChoiceBase", _PROTOCOL)
    completion = _fields("CompletionResponseChoice", "entrypoints/openai/completion/protocol.py")
    assert {"prompt_logprobs", "prompt_token_ids", "weight_versions"} <= completion
    usage = _fields("PromptTokenUsageInfo", "entrypoints/serve/engine/protocol.py")
    assert "cached_tokens" in usage
    assert {"logprob", "rank"} <= _fields("Logprob", "logprobs.py")


def test_completions_read_minus_9999_as_minus_inf() -> None:
    req = req_of("vllm-completions", ids=None, top_k=V)
    rows = decode_score_response(enc(completions_answer(V)), req)
    assert rows.top_logprobs is not None
    assert np.isneginf(rows.top_logprobs[:, -2:]).all()
    assert (rows.top_logprobs[:, :-2] > -9999.0).all()


def test_a_mutated_npy_is_rejected_or_read_never_anything_else() -> None:
    """Every byte of a valid .npy changed in turn: a protocol error or the right shape."""
    raw = bytearray(base64.b64decode(npy_b64(_good_values())))
    rng = np.random.default_rng(3)
    for i in range(len(raw)):
        broken = bytearray(raw)
        broken[i] = int(rng.integers(0, 256))
        try:
            rows = decode_score_response(_npy_answer(base64.b64encode(broken).decode()), req_of())
        except (MalformedResponseError, MisalignedResponseError):
            continue
        assert rows.id_logprobs is not None
        assert rows.id_logprobs.shape == (R, 3)
