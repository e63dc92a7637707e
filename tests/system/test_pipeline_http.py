"""End to end over real HTTP: OPDStream with its default transport against the aiohttp mock
servers (run in a thread), on both backends: aiohttp under asyncio, httpx under trio.

Every result must equal (a) the core functions (wire decode + KL) applied to the same
server answers, and (b) an independent float64 per-position recomputation from the
mock's closed-form model. Sampled-token mode, and every strategy x weight mode x id form.
"""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
import torch
from support.config import stream_config
from support.pipeline_reference import assert_matches, expected_result, rollout_topk_rows
from support.threaded_mock import serve_mock_threaded as serve_mock

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample, StreamConfig
from opd_stream.fleet._routing import generate_url
from opd_stream.kl import TopKBatch, sampled_reverse_kl, topk_reverse_kl
from opd_stream.testing.mock_sglang import MockOptions
from opd_stream.wire import ScoreRequest, build_score_payload, decode_score_response

STRATEGIES = ["only-student", "only-teacher", "intersection", "union", "xor"]
WEIGHT_MODES = ["student_p", "teacher_p", "none"]
K = 4


def _samples(
    student_model: Any, *, n: int, top_k: int, with_topk: bool, seed: int = 0
) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(3, 12)), int(rng.integers(1, 11))
        tokens = rng.integers(0, 5000, p + r).tolist()
        rollout = student_model.token_logprobs(np.asarray(tokens), np.arange(p, p + r))
        rows = rollout_topk_rows(student_model, tokens, p, top_k) if (top_k and with_topk) else None
        out.append(
            Sample(
                tokens,
                r,
                rollout_logprobs=[float(np.float32(x)) for x in rollout],
                student_top_logprobs=rows,
                sample_id=f"s{i}",
            )
        )
    return out


async def _score(cfg: StreamConfig, samples: list[Sample]) -> list[ScoredSample]:
    async with OPDStream(cfg) as stream, stream.run(samples) as results:
        out = [r async for r in results]
    assert len(out) == len(samples)
    failures = [r for r in out if isinstance(r, SampleFailure)]
    assert not failures, [(f.reason, f.message) for f in failures]
    scored = [r for r in out if isinstance(r, ScoredSample)]
    assert sorted(r.index for r in scored) == list(range(len(samples)))
    return sorted(scored, key=lambda r: r.index)


async def _core(session: httpx.AsyncClient, url: str, req: ScoreRequest) -> Any:
    resp = await session.post(generate_url(url), content=build_score_payload(req))
    assert resp.status_code == 200
    return decode_score_response(resp.content, req)


async def _core_result(
    session: httpx.AsyncClient,
    teacher: str,
    student: str,
    sample: Sample,
    *,
    strategy: str,
    weight_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The core functions applied by hand to the servers' answers for one sample."""
    tokens = np.asarray(sample.tokens, dtype=np.int64)
    r = sample.response_length
    s = await _core(session, student, ScoreRequest(tokens=tokens, response_length=r, top_k=K))
    t = await _core(
        session,
        teacher,
        ScoreRequest(tokens=tokens, response_length=r, top_k=K, ids=s.top_ids),
    )
    s_on_t = await _core(
        session, student, ScoreRequest(tokens=tokens, response_length=r, ids=t.top_ids)
    )

    def ten(a: Any) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))[None]

    batch = TopKBatch(
        student_ids=ten(s.top_ids),
        student_lp=ten(s.top_logprobs),
        teacher_on_student=ten(t.id_logprobs),
        teacher_ids=ten(t.top_ids),
        teacher_lp=ten(t.top_logprobs),
        student_on_teacher=ten(s_on_t.id_logprobs),
        valid=torch.ones((1, r), dtype=torch.bool),
    )
    res = topk_reverse_kl(batch, strategy, weight_mode)  # type: ignore[arg-type]
    return res.signal[0], torch.from_numpy(t.token_logprobs)


async def test_sampled_token_mode_matches_core_and_closed_form() -> None:
    async with serve_mock("teacher", 3) as teacher, serve_mock("student", 3) as student:
        samples = _samples(student.model, n=6, top_k=0, with_topk=False)
        samples.append(Sample(samples[0].tokens, samples[0].response_length))  # no rollout lps
        cfg = stream_config(teacher.url)
        results = await _score(cfg, samples)
        async with httpx.AsyncClient() as session:
            for res, smp in zip(results, samples, strict=True):
                rows = await _core(
                    session,
                    teacher.url,
                    ScoreRequest(
                        tokens=np.asarray(smp.tokens), response_length=smp.response_length
                    ),
                )
                assert torch.equal(res.teacher_logprobs, torch.from_numpy(rows.token_logprobs))
                if smp.rollout_logprobs is not None:
                    core = sampled_reverse_kl(
                        torch.tensor(smp.rollout_logprobs, dtype=torch.float32),
                        res.teacher_logprobs,
                    )
                    assert torch.allclose(res.reverse_kl, core, atol=1e-6)
                exp = expected_result(
                    tokens=smp.tokens,
                    response_length=smp.response_length,
                    teacher=teacher.model,
                    student=student.model,
                    top_k=0,
                    strategy="only-student",
                    weight_mode="student_p",
                    rollout_logprobs=smp.rollout_logprobs,
                )
                assert_matches(res, exp)


@pytest.mark.parametrize("weight_mode", WEIGHT_MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_topk_every_strategy_and_weight_mode_matches_core_and_closed_form(
    strategy: str, weight_mode: str
) -> None:
    async with serve_mock("teacher", 5) as teacher, serve_mock("student", 5) as student:
        samples = _samples(student.model, n=4, top_k=K, with_topk=True, seed=1)
        cfg = stream_config(
            teacher.url,
            student_url=student.url,
            top_k=K,
            strategy=strategy,
            weight_mode=weight_mode,
        )
        results = await _score(cfg, samples)
        async with httpx.AsyncClient() as session:
            for res, smp in zip(results, samples, strict=True):
                core_rkl, core_tlp = await _core_result(
                    session,
                    teacher.url,
                    student.url,
                    smp,
                    strategy=strategy,
                    weight_mode=weight_mode,
                )
                assert torch.equal(res.teacher_logprobs, core_tlp)
                assert res.reverse_kl is not None
                assert torch.allclose(res.reverse_kl, core_rkl, atol=1e-5, rtol=0)
                exp = expected_result(
                    tokens=smp.tokens,
                    response_length=smp.response_length,
                    teacher=teacher.model,
                    student=student.model,
                    top_k=K,
                    strategy=strategy,
                    weight_mode=weight_mode,
                )
                assert_matches(res, exp)


ID_FORMS = [
    pytest.param("per-position", "patched", id="per-position-patched"),
    pytest.param("blocked", "patched", id="blocked"),
    pytest.param("flat", "patched", id="flat"),
    pytest.param("auto", "unpatched", id="auto-unpatched"),
    pytest.param("auto", "patched", id="auto-patched"),
]


@pytest.mark.parametrize(("id_scoring", "per_position"), ID_FORMS)
@pytest.mark.parametrize("weight_mode", WEIGHT_MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_every_id_form_gives_the_same_answers(
    id_scoring: str, per_position: str, strategy: str, weight_mode: str
) -> None:
    opts = MockOptions(per_position=per_position)  # type: ignore[arg-type]
    async with (
        serve_mock("teacher", 7, options=opts) as teacher,
        serve_mock("student", 7, options=opts) as student,
    ):
        samples = _samples(student.model, n=3, top_k=K, with_topk=False, seed=2)
        cfg = stream_config(
            teacher.url,
            student_url=student.url,
            top_k=K,
            strategy=strategy,
            weight_mode=weight_mode,
            id_scoring=id_scoring,
            id_block_size=3,
        )
        async with OPDStream(cfg) as stream, stream.run(samples) as results:
            out = sorted([r async for r in results], key=lambda r: r.index)
            stats = stream.stats()
        assert all(isinstance(r, ScoredSample) for r in out), [
            getattr(r, "message", "") for r in out
        ]
        for res, smp in zip(out, samples, strict=True):
            assert isinstance(res, ScoredSample)
            exp = expected_result(
                tokens=smp.tokens,
                response_length=smp.response_length,
                teacher=teacher.model,
                student=student.model,
                top_k=K,
                strategy=strategy,
                weight_mode=weight_mode,
            )
            assert_matches(res, exp)
        if id_scoring == "auto":
            detected = stats.endpoints[teacher.url].per_position
            if strategy not in ("only-teacher", "intersection"):  # no ids sent to the teacher
                assert detected is (per_position == "patched")


async def test_auto_against_unpatched_server_probes_once_then_uses_blocked() -> None:
    opts = MockOptions(per_position="unpatched")
    async with (
        serve_mock("teacher", 9, options=opts) as teacher,
        serve_mock("student", 9) as student,
    ):
        samples = _samples(student.model, n=10, top_k=K, with_topk=True, seed=3)
        cfg = stream_config(teacher.url, student_url=student.url, top_k=K, max_inflight=1)
        await _score(cfg, samples)
        # one probe (answered without input_token_ids_logprobs) + one blocked request per sample
        assert teacher.stats[0].generate_requests == len(samples) + 1


async def test_api_key_is_sent_as_bearer_and_required() -> None:
    opts = MockOptions(api_key="s3cret-key")
    async with serve_mock("teacher", 1, options=opts) as teacher:
        samples = [Sample([1, 2, 3, 4], 2)]
        good = stream_config(teacher.url, api_key="s3cret-key")
        await _score(good, samples)
        bad = stream_config(teacher.url)
        async with OPDStream(bad) as stream, stream.run(samples) as results:
            out = [r async for r in results]
        assert isinstance(out[0], SampleFailure)
        assert out[0].reason == "teacher_http_401"
