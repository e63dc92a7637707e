"""Differential tests for teachers with another tokenizer (issue 33, part 2): a teacher served by
the vLLM mocks with a model over bytes (:class:`ByteModel`) gives the same results as the
SGLang mock bit for bit, and the float64 byte reference (the expected values computable from
the text alone: ``test_xtok_stream.py``'s reference, restated here).

One server set for the module (in a thread: asyncio and trio share it): the same byte model
on an SGLang mock, a vLLM scale-out mock and a vLLM completions-only mock; the small trained
tokenizers (``support.xtok_vocabs``: ``a`` the student's, ``b`` the teachers').
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from support.config import stream_config
from support.threaded_mock import servers_in_thread
from support.xtok_vocabs import SPECIAL, small_vocab, write_small

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample, StreamConfig
from opd_stream.testing.mock_sglang import ByteModel, MockCluster, serve_mock
from opd_stream.testing.mock_vllm import serve_vllm_mock

ENGINES = ("sglang", "vllm", "completions")
PROMPT = "Question: say something.\nAnswer: "
TEXTS = [
    "the quick brown fox jumps over",
    "Größe café 東京 你好世界 🎉 done",
    "def square(x):\n    return x * x\n",
]
K = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vocabs")
    a, b = small_vocab("a"), small_vocab("b")
    s_model = ByteModel(a.token_bytes, q=0.5)
    t_model = ByteModel(b.token_bytes, q=0.6)

    async def start(stack: AsyncExitStack) -> dict[str, MockCluster]:
        return {
            "sglang": await stack.enter_async_context(serve_mock("teacher", 1, byte_model=t_model)),
            "vllm": await stack.enter_async_context(
                serve_vllm_mock("teacher", 1, byte_model=t_model)
            ),
            "completions": await stack.enter_async_context(
                serve_vllm_mock("teacher", 1, byte_model=t_model, scale_out=False)
            ),
        }

    with servers_in_thread(start) as servers:
        yield {
            "a": a,
            "b": b,
            "a_path": write_small(tmp, "a"),
            "b_path": write_small(tmp, "b"),
            "s_model": s_model,
            "t_model": t_model,
            "servers": servers,
        }


def _config(w: dict[str, Any], **kw: Any) -> StreamConfig:
    teachers = {name: w["servers"][name].url for name in ENGINES}
    return stream_config(
        teachers,
        student_tokenizer=w["a_path"],
        teacher_tokenizers=dict.fromkeys(ENGINES, w["b_path"]),
        return_alignment=True,
        **kw,
    )


def _samples(w: dict[str, Any], *, with_topk: bool = False) -> list[Sample]:
    """Each text once per teacher; the rollout's logprobs from the student's byte model;
    with ``with_topk`` a student top-k per position (the sampled token and random ids)."""
    a, b = w["a"], w["b"]
    rng = np.random.default_rng(7)
    end = a.tokenizer.token_to_id(SPECIAL)
    out = []
    for i, text in enumerate(TEXTS):
        prompt = a.encode(PROMPT)
        tokens = np.concatenate([prompt, a.encode(text), [end]])
        p, r = int(prompt.shape[0]), int(tokens.shape[0] - prompt.shape[0])
        rollout = w["s_model"].token_logprobs(tokens, np.arange(p, p + r)).astype(np.float32)
        topk = None
        if with_topk:
            ids = np.array(
                [
                    [s, *rng.choice([v for v in range(a.size) if v != s], K - 1, replace=False)]
                    for s in tokens[p:].tolist()
                ],
                dtype=np.int64,
            )
            probs = 0.9 * rng.dirichlet(np.ones(K), r)
            topk = (ids, np.log(np.sort(probs, axis=1)[:, ::-1]).astype(np.float32))
        smp = Sample(
            tokens=tokens.tolist(),
            response_length=r,
            rollout_logprobs=rollout.tolist(),
            student_top_logprobs=topk,
            teacher_prompt_ids=b.encode(PROMPT).tolist(),
            sample_id=i,
        )
        out.extend(msgspec.structs.replace(smp, metadata={"opd_teacher": name}) for name in ENGINES)
    return out


async def _run(cfg: StreamConfig, samples: list[Sample]) -> dict[tuple[str, int], Any]:
    async with OPDStream(cfg) as stream, stream.run(samples) as results:
        out = [r async for r in results]
    assert sorted(r.index for r in out) == list(range(len(samples)))
    return {(r.sample.metadata["opd_teacher"], r.sample.sample_id): r for r in out}


def _same(a: Any, b: Any) -> None:
    assert isinstance(a, ScoredSample), (a.reason, a.message)
    assert isinstance(b, ScoredSample), (b.reason, b.message)
    assert torch.equal(a.teacher_logprobs, b.teacher_logprobs)
    assert a.signal is not None and b.signal is not None
    assert torch.equal(a.signal, b.signal)
    assert a.alignment is not None and b.alignment is not None
    for name in a.alignment.__struct_fields__:
        assert torch.equal(getattr(a.alignment, name), getattr(b.alignment, name)), name
    ca, cb = a.candidates, b.candidates
    assert (ca is None) == (cb is None)
    if ca is not None and cb is not None:
        for name in ca.__struct_fields__:
            x, y = getattr(ca, name), getattr(cb, name)
            assert (x is None and y is None) or torch.equal(x, y), name


def _byte_reference(res: ScoredSample, w: dict[str, Any], text: str) -> np.ndarray:
    """float64: per scored span, the sum over its bytes of log p_student - log p_teacher
    (each byte given every byte before it), on the span's last student token; 0 elsewhere."""
    al = res.alignment
    assert al is not None
    ls = w["s_model"].byte_logprobs(text.encode(), history=PROMPT.encode())
    lt = w["t_model"].byte_logprobs(text.encode(), history=PROMPT.encode())
    spans = al.student_spans.tolist()
    out = np.zeros(res.sample.response_length)
    for j, (lo, hi) in enumerate(itertools.pairwise(al.span_bytes.tolist())):
        if al.scored[j]:
            out[spans[j + 1] - 1] = math.fsum(ls[lo:hi].tolist()) - math.fsum(lt[lo:hi].tolist())
    return out


async def test_sampled_token_mode_equals_sglang_and_the_byte_reference(
    world: dict[str, Any],
) -> None:
    got = await _run(_config(world), _samples(world))
    for i, text in enumerate(TEXTS):
        ref = got["sglang", i]
        assert isinstance(ref, ScoredSample), ref
        assert ref.signal is not None
        expected = _byte_reference(ref, world, text)
        assert float(np.abs(expected).max()) > 0.1
        np.testing.assert_allclose(ref.signal.numpy(), expected, rtol=0, atol=2e-4)
        _same(got["vllm", i], ref)
        _same(got["completions", i], ref)


@pytest.mark.parametrize("tail", [False, True], ids=["normalised", "tail"])
async def test_only_student_top_k_equals_sglang_and_completions_refuses(
    world: dict[str, Any], tail: bool
) -> None:
    got = await _run(_config(world, top_k=K, tail=tail), _samples(world, with_topk=True))
    for i in range(len(TEXTS)):
        ref = got["sglang", i]
        assert isinstance(ref, ScoredSample), ref
        assert ref.candidates is not None and bool(ref.candidates.mask.any())
        _same(got["vllm", i], ref)
        comp = got["completions", i]
        assert isinstance(comp, SampleFailure) and comp.reason == "capability", comp
        assert "--enable-scale-out" in comp.message, comp.message
