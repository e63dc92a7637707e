"""Bad input: every invalid Sample field fails that sample alone, through the pipeline.

Each case runs ``[valid, bad, valid]`` through a stream (in-process mock servers, asyncio
and trio): the bad one comes out as ``SampleFailure(reason="invalid_sample")`` whose
message starts with the offending field's name, and the valid ones are scored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from support.config import stream_config

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

T = "http://teacher:1"
S = "http://student:2"
TOKENS = [11, 12, 13, 14, 15, 16]  # P = 3, R = 3
R = 3
GOOD_ROW = [[-0.1, 5], [-1.0, 7], [-3.0, 9]]


def _topk(rows: Any = None) -> Sample:
    return Sample(TOKENS, R, student_top_logprobs=[GOOD_ROW] * R if rows is None else rows)


# (field named in the message, the bad sample, top_k of the stream)
CASES: list[tuple[str, str, Any, int]] = [
    ("not-a-sample", "sample", {"tokens": TOKENS, "response_length": R}, 0),
    ("none-sample", "sample", None, 0),
    ("tokens-str", "tokens", Sample("1 2 3", 1), 0),
    ("tokens-bytes", "tokens", Sample(b"\x01\x02\x03", 1), 0),
    ("tokens-int", "tokens", Sample(5, 0), 0),
    ("tokens-set", "tokens", Sample({1, 2, 3}, 1), 0),
    ("tokens-empty", "tokens", Sample([], 0), 0),
    ("tokens-float-element", "tokens", Sample([1, 2.0, 3], 1), 0),
    ("tokens-bool-element", "tokens", Sample([1, True, 3], 1), 0),
    ("tokens-none-element", "tokens", Sample([1, None, 3], 1), 0),
    ("tokens-str-element", "tokens", Sample([1, "2", 3], 1), 0),
    ("tokens-nested", "tokens", Sample([[1, 2], [3, 4]], 1), 0),
    ("tokens-2d-array", "tokens", Sample(np.ones((2, 3), dtype=np.int64), 1), 0),
    ("tokens-float-array", "tokens", Sample(np.array([1.0, 2.0, 3.0]), 1), 0),
    ("tokens-bool-tensor", "tokens", Sample(torch.tensor([True, False, True]), 1), 0),
    ("tokens-float-tensor", "tokens", Sample(torch.tensor([1.0, 2.0, 3.0]), 1), 0),
    ("tokens-negative", "tokens", Sample([1, -2, 3], 1), 0),
    ("tokens-above-int32", "tokens", Sample([1, 2**31, 3], 1), 0),
    ("tokens-above-int64", "tokens", Sample([1, 2**70, 3], 1), 0),
    ("response_length-negative", "response_length", Sample(TOKENS, -1), 0),
    ("response_length-all-tokens", "response_length", Sample(TOKENS, len(TOKENS)), 0),
    ("response_length-too-long", "response_length", Sample(TOKENS, 99), 0),
    ("response_length-float", "response_length", Sample(TOKENS, 2.0), 0),
    ("response_length-bool", "response_length", Sample(TOKENS, True), 0),
    ("response_length-str", "response_length", Sample(TOKENS, "3"), 0),
    ("response_length-none", "response_length", Sample(TOKENS, None), 0),
    ("metadata-list", "metadata", Sample(TOKENS, R, metadata=[("opd_teacher", "x")]), 0),
    ("metadata-none", "metadata", Sample(TOKENS, R, metadata=None), 0),  # type: ignore[arg-type]
    ("rollout-str", "rollout_logprobs", Sample(TOKENS, R, rollout_logprobs="-1,-1,-1"), 0),
    ("rollout-scalar", "rollout_logprobs", Sample(TOKENS, R, rollout_logprobs=-1.0), 0),
    ("rollout-short", "rollout_logprobs", Sample(TOKENS, R, rollout_logprobs=[-1.0, -1.0]), 0),
    ("rollout-long", "rollout_logprobs", Sample(TOKENS, R, rollout_logprobs=[-1.0] * 4), 0),
    ("rollout-2d", "rollout_logprobs", Sample(TOKENS, R, rollout_logprobs=[[-1.0]] * 3), 0),
    ("rollout-non-number", "rollout_logprobs", Sample(TOKENS, R, rollout_logprobs=["a"] * 3), 0),
    (
        "rollout-none-element",
        "rollout_logprobs",
        Sample(TOKENS, R, rollout_logprobs=[-1, None, -1]),
        0,
    ),
    (
        "rollout-nan",
        "rollout_logprobs",
        Sample(TOKENS, R, rollout_logprobs=[-1, float("nan"), -1]),
        0,
    ),
    (
        "rollout-neg-inf",
        "rollout_logprobs",
        Sample(TOKENS, R, rollout_logprobs=[-1, -np.inf, -1]),
        0,
    ),
    (
        "rollout-pos-inf",
        "rollout_logprobs",
        Sample(TOKENS, R, rollout_logprobs=[-1, np.inf, -1]),
        0,
    ),
    ("rollout-positive", "rollout_logprobs", Sample(TOKENS, R, rollout_logprobs=[-1, 0.5, -1]), 0),
    (
        "rollout-tensor-short",
        "rollout_logprobs",
        Sample(TOKENS, R, rollout_logprobs=torch.zeros(2)),
        0,
    ),
    ("topk-str", "student_top_logprobs", _topk("rows"), 2),
    ("topk-dict", "student_top_logprobs", _topk({"a": 1}), 2),
    ("topk-row-count", "student_top_logprobs", _topk([GOOD_ROW] * 2), 2),
    ("topk-row-not-list", "student_top_logprobs", _topk([GOOD_ROW, 5, GOOD_ROW]), 2),
    ("topk-entry-short", "student_top_logprobs", _topk([GOOD_ROW, [[-0.1], [-1, 2]], GOOD_ROW]), 2),
    (
        "topk-bool-id",
        "student_top_logprobs",
        _topk([GOOD_ROW, [[-0.1, True], [-1, 2]], GOOD_ROW]),
        2,
    ),
    (
        "topk-float-id",
        "student_top_logprobs",
        _topk([GOOD_ROW, [[-0.1, 1.5], [-1, 2]], GOOD_ROW]),
        2,
    ),
    (
        "topk-str-logprob",
        "student_top_logprobs",
        _topk([GOOD_ROW, [["x", 1], [-1, 2]], GOOD_ROW]),
        2,
    ),
    (
        "topk-negative-id",
        "student_top_logprobs",
        _topk([GOOD_ROW, [[-0.1, -1], [-1, 2]], GOOD_ROW]),
        2,
    ),
    (
        "topk-duplicate-id",
        "student_top_logprobs",
        _topk([GOOD_ROW, [[-0.1, 2], [-1, 2]], GOOD_ROW]),
        2,
    ),
    (
        "topk-nan",
        "student_top_logprobs",
        _topk([GOOD_ROW, [[float("nan"), 1], [-1, 2]], GOOD_ROW]),
        2,
    ),
    (
        "topk-pos-inf",
        "student_top_logprobs",
        _topk([GOOD_ROW, [[np.inf, 1], [-1, 2]], GOOD_ROW]),
        2,
    ),
    ("topk-positive", "student_top_logprobs", _topk([GOOD_ROW, [[0.5, 1], [-1, 2]], GOOD_ROW]), 2),
]


def _teacher_prompt(prompt: Any) -> Sample:
    return Sample(TOKENS, R, rollout_logprobs=[-1.0] * R, teacher_prompt_ids=prompt)


# teacher_prompt_ids (issue 18): each case in both modes (top-k: student rows given)
_TEACHER_PROMPTS: list[tuple[str, Any]] = [
    ("empty-list", []),
    ("empty-array", np.zeros(0, dtype=np.int64)),
    ("str", "21 22"),
    ("bytes", b"\x15\x16"),
    ("int", 21),
    ("dict", {"ids": [21, 22]}),
    ("float-element", [21, 22.0]),
    ("bool-element", [21, True]),
    ("none-element", [21, None]),
    ("nested", [[21, 22]]),
    ("float-array", np.array([21.0, 22.0])),
    ("float-tensor", torch.tensor([21.0])),
    ("negative", [21, -1]),
    ("above-int32", [21, 2**31]),
]
for _name, _prompt in _TEACHER_PROMPTS:
    CASES.append((f"teacher-prompt-{_name}", "teacher_prompt_ids", _teacher_prompt(_prompt), 0))
    _bad = Sample(TOKENS, R, student_top_logprobs=[GOOD_ROW] * R, teacher_prompt_ids=_prompt)
    CASES.append((f"teacher-prompt-{_name}-topk", "teacher_prompt_ids", _bad, 2))


async def _run_cases(top_k: int) -> tuple[list[str], Any, InProcessSGLang]:
    """Every case of this ``top_k`` in one stream, each between two valid samples.

    Returns the problems found (empty when every case behaved), the stats and the teacher.
    """
    cases = [c for c in CASES if c[3] == top_k]
    servers = {T: InProcessSGLang("teacher", 1), S: InProcessSGLang("student", 1)}
    extra: dict[str, Any] = {"top_k": top_k, "student_url": S} if top_k else {}
    cfg = stream_config(T, **extra)
    good = _topk() if top_k else Sample(TOKENS, R, rollout_logprobs=[-1.0] * R)
    samples: list[Any] = [good]
    for case in cases:
        samples += [case[2], good]
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            out = sorted([r async for r in results], key=lambda r: r.index)
        stats = stream.stats()
    assert [r.index for r in out] == list(range(len(samples)))
    problems = [
        f"valid sample {r.index} not scored" for r in out[::2] if not isinstance(r, ScoredSample)
    ]
    for n, (name, field, _, _) in enumerate(cases):
        res = out[2 * n + 1]
        if not isinstance(res, SampleFailure):
            problems.append(f"{name}: scored")
        elif res.reason != "invalid_sample" or not res.message.startswith(f"{field}: "):
            problems.append(f"{name}: {res.reason} {res.message!r}")
        elif res.attempts != 0:
            problems.append(f"{name}: {res.attempts} attempts")
    return problems, stats, servers[T]


@pytest.mark.parametrize("top_k", [0, 2], ids=["sampled-token", "top-k"])
async def test_each_invalid_sample_fails_alone_with_invalid_sample_naming_its_field(
    top_k: int,
) -> None:
    problems, stats, teacher = await _run_cases(top_k)
    assert problems == []
    n_bad = sum(c[3] == top_k for c in CASES)
    assert stats.failures == {"invalid_sample": n_bad}
    assert stats.completed == n_bad + 1
    assert teacher.requests == n_bad + 1  # no bad sample reached a server


def test_every_sample_field_has_an_invalid_case() -> None:
    fields = {c[1] for c in CASES}
    declared = set(Sample.__struct_fields__) - {"sample_id"}  # sample_id may be anything
    assert fields == declared | {"sample"}


async def test_a_zero_length_response_with_empty_student_topk_is_scored_empty() -> None:
    servers = {T: InProcessSGLang("teacher", 1), S: InProcessSGLang("student", 1)}
    cfg = stream_config(T, student_url=S, top_k=2)
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run([Sample(TOKENS, 0, student_top_logprobs=[])]) as results:
            (res,) = [r async for r in results]
    assert isinstance(res, ScoredSample), res
    assert res.teacher_logprobs.shape == (0,)
    assert res.candidates is not None and res.candidates.ids.shape == (0, 2)


@pytest.mark.parametrize(
    "strategy", ["only-student", "only-teacher", "intersection", "union", "xor"]
)
async def test_a_strategy_that_never_reads_the_students_top_k_ignores_it(strategy: str) -> None:
    """only-teacher scores the teacher's top-k ids with the student server: a sample's own
    top-k is not read, so neither converted nor checked (as in sampled-token mode); every
    other strategy reads it, and a bad one fails its sample."""
    servers = {T: InProcessSGLang("teacher", 1), S: InProcessSGLang("student", 1)}
    cfg = stream_config(T, student_url=S, top_k=2, strategy=strategy)
    bad = Sample(TOKENS, R, student_top_logprobs=[[[0.5, -7]]] * R)  # > 0, a negative id
    without = Sample(TOKENS, R)
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run([bad, without]) as results:
            got, plain = sorted([r async for r in results], key=lambda r: r.index)
    assert isinstance(plain, ScoredSample), plain
    if strategy == "only-teacher":
        assert isinstance(got, ScoredSample), got
        assert got.reverse_kl is not None and plain.reverse_kl is not None
        assert torch.equal(got.reverse_kl, plain.reverse_kl)  # as if it were not there
        assert got.candidates is not None and plain.candidates is not None
        assert torch.equal(got.candidates.ids, plain.candidates.ids)
    else:
        assert isinstance(got, SampleFailure) and got.reason == "invalid_sample", got
        assert got.message.startswith("student_top_logprobs: ")
