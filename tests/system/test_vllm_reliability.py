"""vLLM teachers and students when things change or go wrong (issue 33, part 2), on the mock vLLM
servers over HTTP; the fault matrix's rows run on them too (``tests/system/test_fault_matrix.py``).

* misaligned answers: vLLM's binary rows (``prompt_token_id_logprobs``) carry values only,
  no token ids, so a server that shifts them is caught where the answer also names the
  tokens: ``prompt_logprobs`` (a top-k request), whose every row must hold the token sent at
  its position. Such a sample fails alone (``misaligned_response``), not retried.
* weight updates mid-sample (the mock's ``weight_versions``): the chunks of one request
  split by ``vllm_max_logprobs``, and a side's several requests, must report one version;
  otherwise the side is asked once more, then the sample fails (``weight_version_changed``).
* ``/v1/completions`` answers under the mock's faults: retryable ones cost a retry each,
  rows shifted or missing fail their sample alone.
* ``cache_salt`` reaches both vLLM dialects and isolates the prefix cache; the
  ``cached_tokens`` vLLM reports (``usage.prompt_tokens_details``) show in ``stats()``.

The mock servers run in the test's loop: asyncio only.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest
from support.config import FAST_BACKOFF, stream_config
from support.pipeline_reference import assert_matches, expected_result

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample, StreamConfig
from opd_stream.testing.mock_sglang import MockModel, serve_mock
from opd_stream.testing.mock_vllm import VllmMockOptions, serve_vllm_mock

pytestmark = pytest.mark.parametrize("anyio_backend", [("asyncio", {"debug": True})])

K = 3
_cfg = partial(stream_config, **FAST_BACKOFF)


def _tokens(seed: int, p: int, r: int) -> list[int]:
    """``p + r`` distinct ids (a shifted row can never hold the token sent there)."""
    rng = np.random.default_rng(seed)
    return rng.choice(5000, p + r, replace=False).tolist()


async def _run(cfg: StreamConfig, samples: list[Sample]) -> list[Any]:
    async with OPDStream(cfg) as stream, stream.run(samples) as results:
        out = [r async for r in results]
    assert sorted(r.index for r in out) == list(range(len(samples)))
    return sorted(out, key=lambda r: r.index)


def _expected(sample: Sample, teacher: MockModel, student: MockModel, strategy: str) -> Any:
    return expected_result(
        tokens=list(sample.tokens),
        response_length=sample.response_length,
        teacher=teacher,
        student=student,
        top_k=K,
        strategy=strategy,
        weight_mode="student_p",
    )


# ------------------------------------------------------------------------------ misaligned


async def test_shifted_rows_fail_their_sample_alone_where_the_answer_names_its_tokens() -> None:
    opts = VllmMockOptions(fault_misaligned=1.0)
    async with (
        serve_vllm_mock("teacher", 2, options=opts) as teacher,
        serve_mock("student", 2) as student,
    ):
        # only-teacher: the teacher is asked its top-k (prompt_logprobs), no ids
        cfg = _cfg(
            teacher.url,
            engine="vllm",
            server_engines={student.url: "sglang"},
            student_url=student.url,
            top_k=K,
            strategy="only-teacher",
        )
        samples = [Sample(_tokens(i, 5, r), r) for i, r in enumerate((3, 1, 4))]
        out = await _run(cfg, samples)
        faults = teacher.stats[0].faults.get("misaligned", 0)
    for res, smp in zip(out, samples, strict=True):
        if smp.response_length == 1:  # one row: nothing to shift, the answer is right
            assert isinstance(res, ScoredSample), res
            assert_matches(res, _expected(smp, teacher.model, student.model, "only-teacher"))
            continue
        assert isinstance(res, SampleFailure), res
        assert res.reason == "misaligned_response", (res.reason, res.message)
        assert "prompt_logprobs" in res.message and "actual token" in res.message, res.message
        assert res.attempts == 1  # not retried
    assert faults == 3


# --------------------------------------------------------------------------- weight versions


async def test_a_weight_update_between_the_chunks_of_a_request_is_asked_again_and_scores() -> None:
    # 1 + K columns, at most 2 per request: two chunks; the first answer v1, the rest v2
    opts = VllmMockOptions(weight_versions=("v1", "v2"), max_logprobs=2)
    async with serve_vllm_mock("teacher", 3, options=opts) as teacher:
        student = MockModel("student", 3)
        tokens = _tokens(10, 6, 4)
        ids, lps = student.topk(np.asarray(tokens), np.arange(6, 10), K)
        sample = Sample(tokens, 4, student_top_logprobs=(ids, lps.astype(np.float32)))
        cfg = _cfg(teacher.url, engine="vllm", top_k=K, vllm_max_logprobs=2)
        (res,) = await _run(cfg, [sample])
        requests = teacher.stats[0].generate_requests
    assert isinstance(res, ScoredSample), res
    assert_matches(res, _expected(sample, teacher.model, student, "only-student"))
    assert requests == 4  # two chunks, asked twice


async def test_a_vllm_teacher_whose_versions_keep_changing_fails_the_sample() -> None:
    opts = VllmMockOptions(weight_versions=("a", "b") * 8, max_logprobs=2)
    async with serve_vllm_mock("teacher", 3, options=opts) as teacher:
        student = MockModel("student", 3)
        tokens = _tokens(11, 6, 4)
        ids, lps = student.topk(np.asarray(tokens), np.arange(6, 10), K)
        sample = Sample(tokens, 4, student_top_logprobs=(ids, lps.astype(np.float32)))
        cfg = _cfg(teacher.url, engine="vllm", top_k=K, vllm_max_logprobs=2)
        (res,) = await _run(cfg, [sample])
        requests = teacher.stats[0].generate_requests
    assert isinstance(res, SampleFailure), res
    assert res.reason == "weight_version_changed"
    assert res.message.startswith("teacher: ") and "'a'" in res.message and "'b'" in res.message
    assert requests == 4  # one more pass of the side, no attempt-level retries


async def test_a_vllm_student_updated_between_its_requests_is_asked_again() -> None:
    # union without the rollout's top-k: the student's top-k, then its scores of the
    # teacher's ids; the two answers report s1, then s2
    async with (
        serve_vllm_mock("teacher", 4) as teacher,
        serve_vllm_mock(
            "student", 4, options=VllmMockOptions(weight_versions=("s1", "s2"))
        ) as student,
    ):
        cfg = _cfg(teacher.url, engine="vllm", student_url=student.url, top_k=K, strategy="union")
        sample = Sample(_tokens(12, 5, 3), 3)
        (res,) = await _run(cfg, [sample])
        asked = student.stats[0].generate_requests
    assert isinstance(res, ScoredSample), res
    assert_matches(res, _expected(sample, teacher.model, student.model, "union"))
    assert asked == 4  # both student requests, twice


# ---------------------------------------------------------------- cache_salt, cached_tokens


@pytest.mark.parametrize("salt", ["none", "per-sample"])
async def test_cache_salt_reaches_both_dialects_and_isolates_the_prefix_cache(
    salt: str,
) -> None:
    """A group of samples sharing one prompt, one after the other: without a salt, every
    sample after the first reuses the prompt (``prompt_logprob_start`` tokens: what vLLM
    may read from its cache when it returns prompt logprobs) on scale-out, and that shows
    in ``stats()``; with a salt per sample, nothing is shared, and each server saw each
    sample's salt. ``/v1/completions`` scores every prompt row: it reuses nothing."""
    opts = VllmMockOptions(prefix_cache_tokens=100_000)
    p, r, n = 7, 3, 4
    prompt = _tokens(20, p, 0)
    samples = [
        Sample(prompt + _tokens(30 + i, 0, r), r, metadata={"opd_teacher": name}, sample_id=i)
        for name in ("scale-out", "completions")
        for i in range(n)
    ]
    async with (
        serve_vllm_mock("teacher", 5, options=opts) as scale_out,
        serve_vllm_mock("teacher", 5, options=opts, scale_out=False) as completions,
    ):
        teachers = {"scale-out": scale_out.url, "completions": completions.url}
        cfg = _cfg(teachers, cache_salt=salt)
        async with OPDStream(cfg) as stream:
            out = [await stream.score(s) for s in samples]
            endpoints = stream.stats().endpoints
        salts = [set(c.stats[0].cache_salts) for c in (scale_out, completions)]
        salted = [c.stats[0].salted_items for c in (scale_out, completions)]
    assert all(isinstance(res, ScoredSample) for res in out), out
    assert endpoints[scale_out.url].engine == "vllm"
    assert endpoints[completions.url].engine == "vllm-completions"
    assert endpoints[completions.url].cached_tokens == 0
    assert endpoints[scale_out.url].prompt_tokens == n * (p + r)
    if salt == "none":
        assert endpoints[scale_out.url].cached_tokens == (n - 1) * (p - 1)
        assert salts == [set(), set()]
    else:
        assert endpoints[scale_out.url].cached_tokens == 0
        assert salted == [n, n] and len(salts[0]) == len(salts[1]) == n
        assert not salts[0] & salts[1]  # one salt per sample, never reused


# ------------------------------------------------------------------- /v1/completions answers


def _sampled(seed: int, n: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(3, 8)), int(rng.integers(1, 5))
        out.append(Sample(_tokens(100 * seed + i, p, r), r, rollout_logprobs=[-1.0] * r))
    return out


@pytest.mark.parametrize(
    "kind", ["http_503", "http_429", "abort", "reset", "truncated", "malformed"]
)
async def test_completions_answers_recover_from_retryable_faults(kind: str) -> None:
    """Half the answers hit (seeded): each costs one retry, every sample scores right."""
    opts = VllmMockOptions(**{f"fault_{kind}": 0.5, "fault_seed": 7})
    samples = _sampled(1, 6)
    async with serve_vllm_mock("teacher", 6, options=opts, scale_out=False) as server:
        cfg = _cfg(server.url, engine="vllm-completions", max_attempts=12)
        async with OPDStream(cfg) as stream:
            out = [await stream.score(s) for s in samples]
            retries = stream.stats().retries
        injected = server.stats[0].faults.get(kind, 0)
    for res, smp in zip(out, samples, strict=True):
        assert isinstance(res, ScoredSample), (res.reason, res.message)
        exp = expected_result(
            tokens=list(smp.tokens),
            response_length=smp.response_length,
            teacher=server.model,
            student=server.model,
            top_k=0,
            strategy="only-student",
            weight_mode="student_p",
            rollout_logprobs=smp.rollout_logprobs,
        )
        assert_matches(res, exp)
    assert injected > 0
    assert retries == injected


@pytest.mark.parametrize("kind", ["misaligned", "missing_rows"])
async def test_completions_rows_shifted_or_missing_fail_their_sample_alone(kind: str) -> None:
    """Completions rows name their tokens: a shifted or a short ``prompt_logprobs`` list is
    caught on every answer, never retried."""
    opts = VllmMockOptions(**{f"fault_{kind}": 1.0})
    samples = _sampled(2, 4)
    async with serve_vllm_mock("teacher", 6, options=opts, scale_out=False) as server:
        cfg = _cfg(server.url, engine="vllm-completions")
        async with OPDStream(cfg) as stream:
            out = [await stream.score(s) for s in samples]
    for res in out:
        assert isinstance(res, SampleFailure), res
        assert res.reason == "misaligned_response", (res.reason, res.message)
        assert "prompt_logprobs" in res.message, res.message
        assert res.attempts == 1
