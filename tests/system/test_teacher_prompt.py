"""Issue 18 through the pipeline: a teacher that sees its own prompt, and the tail bucket.

With ``Sample.teacher_prompt_ids``, every teacher request is ``teacher_prompt + response``
and the student's keep the sample's tokens: the results must be exactly what scoring
``teacher_prompt + response`` on the teacher by hand gives (``pipeline_reference``, from the
mock's closed form), whatever the strategy, weight mode, id form, top-k wire and
``logprob_start``. The tail bucket (``tail=True``) is checked the same way end to end.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import msgspec
import numpy as np
import pytest
from support.config import stream_config
from support.pipeline_reference import assert_matches, expected_result, rollout_topk_rows

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample, StreamConfig
from opd_stream.kl._math import STRATEGIES, WEIGHT_MODES
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

T = "http://teacher:1"
S = "http://student:2"
K = 3


_cfg = partial(stream_config, T, student_url=S)


def _servers(per_position: Any = "patched") -> dict[str, InProcessSGLang]:
    return {
        T: InProcessSGLang("teacher", 1, per_position=per_position),
        S: InProcessSGLang("student", 1, per_position=per_position),
    }


async def _run(cfg: StreamConfig, servers: Any, samples: list[Any]) -> list[Any]:
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
    return sorted(out, key=lambda r: r.index)


def _samples(seed: int, n: int, *, with_topk: bool = False) -> list[Sample]:
    """Samples whose teacher prompts differ from their prompts in content and length
    (shorter, longer, one token); one without a teacher prompt."""
    rng = np.random.default_rng(seed)
    student = InProcessSGLang("student", 1).model
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 9)), int(rng.integers(1, 7))
        tokens = rng.integers(0, 3000, p + r).tolist()
        prompt_len = [1, p + 7, max(1, p - 1), p + 30][i % 4]
        teacher_prompt = rng.integers(0, 3000, prompt_len).tolist() if i % 5 != 4 else None
        rows = rollout_topk_rows(student, tokens, p, K) if with_topk else None
        out.append(
            Sample(
                tokens,
                r,
                student_top_logprobs=rows,
                rollout_logprobs=[-1.0] * r,
                teacher_prompt_ids=teacher_prompt,
                sample_id=i,
            )
        )
    return out


def _expected(smp: Sample, servers: Any, cfg: StreamConfig) -> Any:
    return expected_result(
        tokens=list(smp.tokens),
        response_length=smp.response_length,
        teacher=servers[T].model,
        student=servers[S].model,
        top_k=cfg.top_k,
        strategy=cfg.strategy,
        weight_mode=cfg.weight_mode,
        rollout_logprobs=smp.rollout_logprobs,
        tail=cfg.tail,
        teacher_prompt=None if smp.teacher_prompt_ids is None else list(smp.teacher_prompt_ids),
    )


def _sent_input_ids(server: InProcessSGLang) -> list[list[int]]:
    """The ``input_ids`` of every item the server was sent (batch items one by one)."""
    out = []
    for body in server.bodies:
        ids = msgspec.json.decode(body)["input_ids"]
        out.extend(ids if ids and isinstance(ids[0], list) else [ids])
    return out


def _check_requests(samples: list[Sample], servers: Any, *, student_asked: bool) -> None:
    """Teacher items are prefixes of teacher_prompt + response (whole sequences, or blocks
    cut at a block's end), student items prefixes of the sample's own tokens."""
    teacher_seqs = [
        list(s.teacher_prompt_ids or s.tokens[: len(s.tokens) - s.response_length])
        + list(s.tokens[len(s.tokens) - s.response_length :])
        for s in samples
        if s.response_length
    ]
    for ids in _sent_input_ids(servers[T]):
        assert any(seq[: len(ids)] == ids for seq in teacher_seqs), ids
    student_seqs = [list(s.tokens) for s in samples if s.response_length]
    sent = _sent_input_ids(servers[S])
    assert bool(sent) == student_asked
    for ids in sent:
        assert any(seq[: len(ids)] == ids for seq in student_seqs), ids


# ------------------------------------------------------------------------------ the numbers


async def test_sampled_token_mode_scores_the_teacher_prompt_plus_response() -> None:
    servers = _servers()
    cfg = _cfg(top_k=0)
    samples = _samples(1, 12)
    out = await _run(cfg, servers, samples)
    for res in out:
        assert isinstance(res, ScoredSample), res
        assert_matches(res, _expected(samples[res.index], servers, cfg))
    _check_requests(samples, servers, student_asked=False)


COMBOS = [(s, w, False) for s in STRATEGIES for w in WEIGHT_MODES]
COMBOS += [(s, "student_p", True) for s in STRATEGIES]


@pytest.mark.parametrize(("strategy", "weight_mode", "tail"), COMBOS)
@pytest.mark.parametrize("with_topk", [True, False], ids=["rollout-topk", "fetched-topk"])
async def test_every_strategy_and_weight_mode_scores_the_teacher_prompt_plus_response(
    strategy: str, weight_mode: str, tail: bool, with_topk: bool
) -> None:
    servers = _servers()
    cfg = _cfg(top_k=K, strategy=strategy, weight_mode=weight_mode, tail=tail)
    samples = _samples(2, 10, with_topk=with_topk)
    out = await _run(cfg, servers, samples)
    for res in out:
        assert isinstance(res, ScoredSample), res
        assert_matches(res, _expected(samples[res.index], servers, cfg))
        assert res.candidates is not None
        assert (res.candidates.student_tail_logprobs is not None) is tail
    student_asked = not with_topk or strategy in ("only-teacher", "union", "xor")
    _check_requests(samples, servers, student_asked=student_asked)


WIRE = [
    # (server, id_scoring, topk_wire, logprob_start)
    ("patched", "per-position", "b64", "prompt"),
    ("patched", "per-position", "json", "zero"),
    ("patched", "auto", "auto", "prompt"),
    ("unpatched", "auto", "b64", "prompt"),  # falls back to blocked
    ("unpatched", "blocked", "json", "zero"),
    ("unpatched", "flat", "b64", "prompt"),
    ("unpatched", "flat", "json", "zero"),
]


@pytest.mark.parametrize(("per_position", "id_scoring", "topk_wire", "start"), WIRE)
@pytest.mark.parametrize("block", [0, 2])
async def test_every_id_form_wire_and_start_scores_the_teacher_prompt_plus_response(
    per_position: str, id_scoring: str, topk_wire: str, start: str, block: int
) -> None:
    servers = _servers(per_position)
    cfg = _cfg(
        top_k=K,
        strategy="union",
        id_scoring=id_scoring,
        topk_wire=topk_wire,
        logprob_start=start,
        id_block_size=block,
    )
    samples = _samples(3, 12, with_topk=True)
    out = await _run(cfg, servers, samples)
    for res in out:
        assert isinstance(res, ScoredSample), res
        assert_matches(res, _expected(samples[res.index], servers, cfg))
    _check_requests(samples, servers, student_asked=True)


async def test_a_teacher_prompt_with_a_zero_length_response_sends_nothing() -> None:
    servers = _servers()
    cfg = _cfg(top_k=K, strategy="union", tail=True)
    out = await _run(cfg, servers, [Sample([1, 2, 3], 0, teacher_prompt_ids=[4, 5, 6, 7])])
    (res,) = out
    assert isinstance(res, ScoredSample)
    assert res.teacher_logprobs.shape == (0,) and res.reverse_kl is not None
    assert res.candidates is not None and res.candidates.student_tail_logprobs is not None
    assert res.candidates.student_tail_logprobs.shape == (0,)
    assert servers[T].requests == servers[S].requests == 0


async def test_array_and_tensor_teacher_prompts_are_accepted() -> None:
    import torch

    servers = _servers()
    cfg = _cfg(top_k=0)
    tokens = [5, 6, 7, 8, 9]
    samples = [
        Sample(tokens, 2, teacher_prompt_ids=np.array([40, 41], dtype=np.int32)),
        Sample(tokens, 2, teacher_prompt_ids=torch.tensor([40, 41])),
        Sample(tokens, 2, teacher_prompt_ids=(40, 41)),
        Sample([40, 41, 8, 9], 2),  # the same teacher sequence, by hand
    ]
    out = await _run(cfg, servers, samples)
    values = [r.teacher_logprobs.tolist() for r in out]
    assert values[0] == values[1] == values[2] == values[3]


async def test_bad_teacher_prompts_fail_alone_with_a_clear_message() -> None:
    servers = _servers()
    cfg = _cfg(top_k=K, tail=True)
    good = _samples(4, 2, with_topk=True)
    bad = [
        Sample([1, 2, 3], 1, teacher_prompt_ids=[]),
        Sample([1, 2, 3], 1, teacher_prompt_ids="1 2"),
        Sample([1, 2, 3], 1, teacher_prompt_ids=[1, 2.5]),
    ]
    out = await _run(cfg, servers, [good[0], *bad, good[1]])
    assert isinstance(out[0], ScoredSample) and isinstance(out[-1], ScoredSample)
    messages = []
    for res in out[1:-1]:
        assert isinstance(res, SampleFailure)
        assert res.reason == "invalid_sample" and res.attempts == 0
        messages.append(res.message)
    assert messages == [
        "teacher_prompt_ids: empty teacher prompt (it needs at least one token, as nothing "
        "predicts the first; None means the teacher sees tokens)",
        "teacher_prompt_ids: expected a sequence of int token ids, got str",
        "teacher_prompt_ids: element 1 is float, expected int",
    ]
