"""Differential tests, end to end (issue 33, part 2): the same samples through ``OPDStream`` on the
vLLM mocks and on the SGLang mocks give the same results bit for bit, and both equal the
float64 reference of the mocks' closed form (``support.pipeline_reference``).

One server set for the module (in a thread, so that asyncio and trio tests share it): for
each role and seed an SGLang mock, a vLLM scale-out mock and a vLLM mock without
``--enable-scale-out`` (``/v1/completions`` only), all on the same closed-form model. Each
stream routes every sample to three teachers at once (one per engine: ``teacher_key``), so
one run compares the engines sample by sample. Engines are found by detection
(``engine="auto"``, the default). The vLLM servers allow 5 logprobs per row (``--max-logprobs
5``); half the streams say 4 (``vllm_max_logprobs``), so that their id rows (the sampled
token and the 4 ids) are split into two requests and stitched.

A completions server cannot score chosen ids: a strategy that needs them of it fails each
such sample with reason ``capability`` naming ``--enable-scale-out``; every other result of
a completions server equals SGLang's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from support.config import stream_config
from support.pipeline_reference import (
    MixtureTeacher,
    assert_matches,
    expected_result,
    rollout_topk_rows,
)
from support.threaded_mock import servers_in_thread

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample, StreamConfig
from opd_stream.fleet._ensemble import Ensemble
from opd_stream.kl._names import DIVERGENCES, STRATEGIES, WEIGHT_MODES, divergence_weight_problem
from opd_stream.testing.mock_sglang import MockCluster, MockModel, serve_mock
from opd_stream.testing.mock_vllm import VllmMockOptions, serve_vllm_mock

K = 4
SEED, SEED2 = 5, 6
ENGINES = ("sglang", "vllm", "completions")
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", [("asyncio", {"debug": False})])
# Which side scores the other side's ids under each strategy: what a completions server
# cannot do (docs/semantics.md, "Which requests each strategy makes").
TEACHER_SCORES_IDS = {"only-student", "union", "xor"}
STUDENT_SCORES_IDS = {"only-teacher", "union", "xor"}
# every weight mode x tail x divergence that the settings accept (the rest is a ConfigError)
MATH = [
    (w, tail, d)
    for d, w, tail in itertools.product(DIVERGENCES, WEIGHT_MODES, (False, True))
    if divergence_weight_problem(d, w, tail) is None
]


@dataclass
class Fleet:
    """The module's servers: ``teacher[engine]``, ``student[engine]``, ``teacher2[engine]``
    (the second ensemble member) and their closed-form models."""

    teacher: dict[str, MockCluster]
    student: dict[str, MockCluster]
    teacher2: dict[str, MockCluster]
    t_model: MockModel
    s_model: MockModel
    t2_model: MockModel


async def _start(stack: AsyncExitStack) -> Fleet:
    opts = VllmMockOptions(max_logprobs=K + 1)

    async def trio_of(role: Any, seed: int, replicas: int = 1) -> dict[str, MockCluster]:
        return {
            "sglang": await stack.enter_async_context(serve_mock(role, seed)),
            "vllm": await stack.enter_async_context(
                serve_vllm_mock(role, seed, replicas=replicas, options=opts)
            ),
            "completions": await stack.enter_async_context(
                serve_vllm_mock(role, seed, options=opts, scale_out=False)
            ),
        }

    teacher = await trio_of("teacher", SEED, replicas=2)
    student = await trio_of("student", SEED)
    teacher2 = await trio_of("teacher", SEED2)
    return Fleet(
        teacher,
        student,
        teacher2,
        teacher["sglang"].model,
        student["sglang"].model,
        teacher2["sglang"].model,
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with servers_in_thread(_start) as f:
        yield f


def _base_samples(s_model: MockModel, *, n: int = 3, seed: int = 0) -> list[Sample]:
    """Small samples; the first carries the rollout's student top-k, the others have the
    student server asked for it."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(3, 9)), int(rng.integers(1, 5))
        tokens = rng.integers(0, 5000, p + r).tolist()
        lps = s_model.token_logprobs(np.asarray(tokens), np.arange(p, p + r))
        rows = rollout_topk_rows(s_model, tokens, p, K) if i == 0 else None
        out.append(
            Sample(
                tokens,
                r,
                rollout_logprobs=[float(np.float32(x)) for x in lps],
                student_top_logprobs=rows,
                sample_id=i,
            )
        )
    return out


def _to_each(samples: list[Sample], teachers: tuple[str, ...]) -> list[Sample]:
    """Every sample once per teacher (its name in ``metadata``)."""
    return [
        msgspec.structs.replace(s, metadata={"opd_teacher": t}) for t in teachers for s in samples
    ]


async def _run(cfg: StreamConfig, samples: list[Sample]) -> dict[tuple[str, Any], Any]:
    """Every result, keyed by (teacher, sample_id); each sample comes out exactly once."""
    async with OPDStream(cfg) as stream, stream.run(samples) as results:
        out = [r async for r in results]
    assert sorted(r.index for r in out) == list(range(len(samples)))
    keyed = {(r.sample.metadata["opd_teacher"], r.sample.sample_id): r for r in out}
    assert len(keyed) == len(samples)
    return keyed


def _same(a: Any, b: Any) -> None:
    """Two scored samples hold the same values, bit for bit (NaN where NaN)."""
    assert isinstance(a, ScoredSample), (a.reason, a.message)
    assert isinstance(b, ScoredSample), (b.reason, b.message)

    def eq(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        if x is None or y is None:
            return x is y
        return x.dtype == y.dtype and np.array_equal(x.numpy(), y.numpy(), equal_nan=True)

    assert eq(a.teacher_logprobs, b.teacher_logprobs)
    assert eq(a.signal, b.signal) and eq(a.reverse_kl, b.reverse_kl)
    assert a.divergence == b.divergence
    ca, cb = a.candidates, b.candidates
    if ca is None or cb is None:
        assert ca is cb
        return
    for name in ca.__struct_fields__:
        assert eq(getattr(ca, name), getattr(cb, name)), name


def _refused(res: Any, needs: str) -> None:
    """A per-sample refusal of a completions server: reason capability, saying what to do."""
    assert isinstance(res, SampleFailure), res
    assert res.reason == "capability", (res.reason, res.message)
    assert "--enable-scale-out" in res.message and needs in res.message, res.message


def _teachers(f: Fleet, names: tuple[str, ...] = ENGINES) -> dict[str, list[str]]:
    return {name: f.teacher[name].urls for name in names}


# ------------------------------------------------------------------ top-k mode, the whole grid


@ASYNCIO_ONLY
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_every_weight_mode_tail_and_divergence_equal_across_engines_and_reference(
    fleet: Fleet, strategy: str
) -> None:
    """Per strategy, every weight mode x tail x divergence: the vLLM teacher (and the
    completions one where the strategy allows) == the SGLang teacher == the reference. The
    student alternates between vLLM and SGLang (mixed fleets both ways; the first
    combination runs on both, so all-vLLM == all-SGLang too), and the vLLM requests between
    one body per row set and two (``vllm_max_logprobs`` 4)."""
    base = _base_samples(fleet.s_model)
    before = [st.generate_requests for st in fleet.teacher["vllm"].stats]
    for n, (weight_mode, tail, divergence) in enumerate(MATH):
        expected = {
            smp.sample_id: expected_result(
                tokens=smp.tokens,
                response_length=smp.response_length,
                teacher=fleet.t_model,
                student=fleet.s_model,
                top_k=K,
                strategy=strategy,
                weight_mode=weight_mode,
                tail=tail,
                divergence=divergence,
            )
            for smp in base
        }
        students = ("vllm", "sglang") if n == 0 else (("vllm", "sglang")[n % 2],)
        runs = []
        for student in students:
            cfg = stream_config(
                _teachers(fleet),
                student_url=fleet.student[student].url,
                top_k=K,
                strategy=strategy,
                weight_mode=weight_mode,
                tail=tail,
                divergence=divergence,
                vllm_max_logprobs=4 if n % 2 == 0 else 20,
                balance="round-robin",  # both vLLM replicas serve (prefix: by the ports' hashes)
            )
            got = await _run(cfg, _to_each(base, ENGINES))
            runs.append(got)
            for smp in base:
                ref = got["sglang", smp.sample_id]
                assert_matches(ref, expected[smp.sample_id])
                _same(got["vllm", smp.sample_id], ref)
                comp = got["completions", smp.sample_id]
                if strategy in TEACHER_SCORES_IDS:
                    _refused(comp, "cannot score chosen ids per position")
                else:
                    _same(comp, ref)
        if len(runs) == 2:  # the student on vLLM, then on SGLang: the same results
            for key, res in runs[0].items():
                if isinstance(res, ScoredSample):
                    _same(res, runs[1][key])
    # both replicas of the vLLM teacher took work
    after = [st.generate_requests for st in fleet.teacher["vllm"].stats]
    assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)


@ASYNCIO_ONLY
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_a_student_on_completions_serves_what_needs_no_ids_of_it(
    fleet: Fleet, strategy: str
) -> None:
    base = _base_samples(fleet.s_model, seed=1)
    cfg = stream_config(
        _teachers(fleet, ("sglang", "vllm")),
        student_url=fleet.student["completions"].url,
        top_k=K,
        strategy=strategy,
    )
    got = await _run(cfg, _to_each(base, ("sglang", "vllm")))
    sglang = await _run(
        stream_config(
            _teachers(fleet, ("sglang",)),
            student_url=fleet.student["sglang"].url,
            top_k=K,
            strategy=strategy,
        ),
        _to_each(base, ("sglang",)),
    )
    for smp in base:
        for teacher in ("sglang", "vllm"):
            res = got[teacher, smp.sample_id]
            if strategy in STUDENT_SCORES_IDS:
                _refused(res, "cannot score chosen ids per position")
            else:
                _same(res, sglang["sglang", smp.sample_id])


# ------------------------------------------------------------------------ sampled-token mode


async def test_sampled_token_mode_is_the_same_on_every_engine(fleet: Fleet) -> None:
    base = _base_samples(fleet.s_model, n=4, seed=2)
    base.append(msgspec.structs.replace(base[0], rollout_logprobs=None, sample_id=9))
    got = await _run(stream_config(_teachers(fleet)), _to_each(base, ENGINES))
    for smp in base:
        exp = expected_result(
            tokens=smp.tokens,
            response_length=smp.response_length,
            teacher=fleet.t_model,
            student=fleet.s_model,
            top_k=0,
            strategy="only-student",
            weight_mode="student_p",
            rollout_logprobs=smp.rollout_logprobs,
        )
        ref = got["sglang", smp.sample_id]
        assert_matches(ref, exp)
        _same(got["vllm", smp.sample_id], ref)
        _same(got["completions", smp.sample_id], ref)


# -------------------------------------------------------------------------------- ensembles


async def test_ensembles_on_vllm_and_mixed_members_equal_sglang_and_the_mixture(
    fleet: Fleet,
) -> None:
    """An ensemble with both members on vLLM, one with a member on each engine, and the
    SGLang one: the same values, the float64 mixture's (union: the members score the
    union's ids, the student the teacher's)."""
    w = (0.3, 0.7)

    def ens(first: str, second: str) -> Ensemble:
        return Ensemble((tuple(fleet.teacher[first].urls), tuple(fleet.teacher2[second].urls)), w)

    teachers = {
        "sglang": ens("sglang", "sglang"),
        "vllm": ens("vllm", "vllm"),
        "mixed": ens("sglang", "vllm"),
    }
    names = tuple(teachers)
    base = _base_samples(fleet.s_model, seed=3)
    mixture = MixtureTeacher([fleet.t_model, fleet.t2_model], list(w))
    for top_k, strategy in ((0, "only-student"), (K, "union")):
        cfg = stream_config(
            teachers,
            student_url=fleet.student["vllm"].url,
            top_k=top_k,
            strategy=strategy,
            vllm_max_logprobs=K + 1,  # the servers' (the union's ids are split)
        )
        got = await _run(cfg, _to_each(base, names))
        for smp in base:
            exp = expected_result(
                tokens=smp.tokens,
                response_length=smp.response_length,
                teacher=mixture,
                student=fleet.s_model,
                top_k=top_k,
                strategy=strategy,
                weight_mode="student_p",
                rollout_logprobs=smp.rollout_logprobs,
            )
            ref = got["sglang", smp.sample_id]
            assert_matches(ref, exp, atol=1e-5, teacher_rtol=1e-6)
            _same(got["vllm", smp.sample_id], ref)
            _same(got["mixed", smp.sample_id], ref)


# -------------------------------------------------------------------------- teacher prompts


async def test_teacher_prompts_score_the_same_on_vllm(fleet: Fleet) -> None:
    """``teacher_prompt_ids``: the teacher is asked ``teacher_prompt + response`` (shorter,
    longer, one token), the student the sample's own tokens."""
    rng = np.random.default_rng(4)
    base = []
    for i, s in enumerate(_base_samples(fleet.s_model, n=4, seed=4)):
        p = len(s.tokens) - s.response_length
        n = [1, p + 5, max(1, p - 1), p][i]
        prompt = rng.integers(0, 5000, n).tolist() if i < 3 else None
        base.append(msgspec.structs.replace(s, teacher_prompt_ids=prompt))
    for top_k, strategy in ((0, "only-student"), (K, "union"), (K, "only-teacher")):
        cfg = stream_config(
            _teachers(fleet),
            student_url=fleet.student["vllm"].url,
            top_k=top_k,
            strategy=strategy,
        )
        got = await _run(cfg, _to_each(base, ENGINES))
        for smp in base:
            tp = smp.teacher_prompt_ids
            exp = expected_result(
                tokens=smp.tokens,
                response_length=smp.response_length,
                teacher=fleet.t_model,
                student=fleet.s_model,
                top_k=top_k,
                strategy=strategy,
                weight_mode="student_p",
                rollout_logprobs=smp.rollout_logprobs,
                teacher_prompt=None if tp is None else list(tp),
            )
            ref = got["sglang", smp.sample_id]
            assert_matches(ref, exp)
            _same(got["vllm", smp.sample_id], ref)
            comp = got["completions", smp.sample_id]
            if top_k and strategy in TEACHER_SCORES_IDS:
                _refused(comp, "cannot score chosen ids per position")
            else:
                _same(comp, ref)


# ------------------------------------------------------------------------------- max-logprobs


async def test_a_student_top_k_beyond_max_logprobs_fails_naming_the_student_side(
    fleet: Fleet,
) -> None:
    """The student's top-k above ``vllm_max_logprobs`` cannot be split: samples that ask it
    of the student fail alone (capability), in words that do not blame the teacher."""
    base = _base_samples(fleet.s_model, seed=5)  # sample 0 carries its top-k: not asked
    cfg = stream_config(
        _teachers(fleet, ("vllm",)),
        student_url=fleet.student["vllm"].url,
        top_k=K,
        strategy="only-student",
        vllm_max_logprobs=K - 1,
    )
    got = await _run(cfg, _to_each(base, ("vllm",)))
    assert isinstance(got["vllm", 0], ScoredSample)
    for smp in base[1:]:
        res = got["vllm", smp.sample_id]
        assert isinstance(res, SampleFailure) and res.reason == "capability", res
        assert f"--max-logprobs {K} or more" in res.message, res.message
        assert f"the student at {fleet.student['vllm'].url}: " in res.message, res.message
        assert "teacher" not in res.message, res.message
