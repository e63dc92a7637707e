"""Issue 27 through the pipeline: the forward KL and the JSD, end to end.

A stream configured with ``divergence`` returns the signal of that divergence in
``ScoredSample.signal`` (``reverse_kl`` stays None, so a forward KL is never taken for a
reverse one), equal to the independent float64 reference on the mock's closed form, for
every strategy, with and without the tail bucket.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest
from support.config import stream_config
from support.pipeline_reference import assert_matches, expected_result, rollout_topk_rows

from opd_stream import OPDStream, Sample, ScoredSample, StreamConfig
from opd_stream.kl._math import STRATEGIES
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

T = "http://teacher:1"
S = "http://student:2"
K = 3
WEIGHTS = {"reverse_kl": "student_p", "forward_kl": "teacher_p", "jsd": "student_p"}


_cfg = partial(stream_config, T, student_url=S)


def _servers() -> dict[str, InProcessSGLang]:
    return {T: InProcessSGLang("teacher", 1), S: InProcessSGLang("student", 1)}


def _samples(seed: int, n: int, *, with_topk: bool) -> list[Sample]:
    rng = np.random.default_rng(seed)
    student = InProcessSGLang("student", 1).model
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 9)), int(rng.integers(0, 7))
        tokens = rng.integers(0, 3000, p + r).tolist()
        rows = rollout_topk_rows(student, tokens, p, K) if with_topk else None
        out.append(Sample(tokens, r, student_top_logprobs=rows, sample_id=i))
    return out


def _expected(servers: Any, smp: Sample, strategy: str, **signal: Any) -> Any:
    """The float64 reference of ``smp`` on the mock's models (``signal``: weight_mode,
    tail, divergence, jsd_beta)."""
    return expected_result(
        tokens=list(smp.tokens),
        response_length=smp.response_length,
        teacher=servers[T].model,
        student=servers[S].model,
        top_k=K,
        strategy=strategy,
        **signal,
    )


async def _run(cfg: StreamConfig, servers: Any, samples: list[Any]) -> list[Any]:
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
    return sorted(out, key=lambda r: r.index)


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_every_strategy_gives_the_divergence_asked(
    strategy: str, divergence: str, tail: bool
) -> None:
    servers = _servers()
    beta = 0.3 if divergence == "jsd" else 0.5
    cfg = _cfg(
        top_k=K,
        strategy=strategy,
        weight_mode=WEIGHTS[divergence],
        divergence=divergence,
        jsd_beta=beta,
        tail=tail,
    )
    samples = _samples(5, 8, with_topk=strategy != "only-teacher")
    out = await _run(cfg, servers, samples)
    assert len(out) == len(samples)
    for res in out:
        assert isinstance(res, ScoredSample), res
        assert res.divergence == divergence and res.reverse_kl is None
        expected = _expected(
            servers,
            samples[res.index],
            strategy,
            weight_mode=WEIGHTS[divergence],
            tail=tail,
            divergence=divergence,
            jsd_beta=beta,
        )
        assert_matches(res, expected)
        assert res.candidates is not None
        assert (res.candidates.student_tail_logprobs is not None) is tail


async def test_the_reverse_kl_default_fills_both_names() -> None:
    servers = _servers()
    out = await _run(_cfg(top_k=K), servers, _samples(6, 3, with_topk=True))
    for res in out:
        assert isinstance(res, ScoredSample)
        assert res.divergence == "reverse_kl" and res.reverse_kl is res.signal


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_a_stream_without_candidates_gives_the_signal_alone(strategy: str) -> None:
    # the same signal as the reference (and, bit for bit, as a stream with candidates),
    # no per-candidate arrays; empty responses included
    servers = _servers()
    samples = _samples(7, 8, with_topk=strategy != "only-teacher")
    assert any(s.response_length == 0 for s in samples)
    full = await _run(_cfg(top_k=K, strategy=strategy), servers, samples)
    alone = await _run(_cfg(top_k=K, strategy=strategy, candidates=False), servers, samples)
    assert len(alone) == len(samples)
    for res, other in zip(alone, full, strict=True):
        assert isinstance(res, ScoredSample) and isinstance(other, ScoredSample)
        assert res.candidates is None and other.candidates is not None
        assert res.signal is not None and other.signal is not None
        assert res.signal.numpy().tobytes() == other.signal.numpy().tobytes()
        expected = _expected(servers, samples[res.index], strategy, weight_mode="student_p")
        expected.ids = None  # (no candidates to compare)
        assert_matches(res, expected)
