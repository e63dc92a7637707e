"""Teachers with another tokenizer, end to end, with the real tokenizer files: a Qwen 3.5
student scored by DeepSeek V3 and GLM 4.7 teachers, real aiohttp mock servers answering
from a model over bytes (:class:`ByteModel`), so every expected value is computable from the
text alone.

Asyncio only (the backend-neutral paths run on both in ``test_xtok_stream.py``, with the
small trained tokenizers; the aiohttp mock server is asyncio-only anyway). A stream's start
loads both real tokenizers in processes of their own (~5 s on a 2-core box): the module's
tests share one stream per teacher family (:func:`teacher_stream`), each test reading only
its own results and the stats' growth during its own run."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from support.config import stream_config
from support.xtok_stream import (
    PROMPT,
    Q_STUDENT,
    Q_TEACHER,
    RESPONSES,
    byte_reference,
    config,
    make_sample,
    response_ids,
)
from support.xtok_vocabs import family_dir, family_vocab

from opd_stream import OPDStream, SampleFailure, ScoredSample
from opd_stream.testing.mock_sglang import ByteModel, MockOptions, serve_mock


@pytest.fixture(scope="module")
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # one loop for the module: its streams are shared


def _models(teacher_family: str) -> dict[str, ByteModel]:
    """The byte model of each teacher of :func:`teacher_stream`: with the teacher's
    tokenizer, the student's model (``same``) and another one (``other``; ``misaligned``
    answers from it in other ids than it was sent); ``self``, with the student's tokenizer."""
    teacher = family_vocab(teacher_family, "teacher_tokenizers[same]")
    other = ByteModel(teacher.token_bytes, q=Q_TEACHER)
    return {
        "same": ByteModel(teacher.token_bytes, q=Q_STUDENT, salt=3),
        "other": other,
        "misaligned": other,
        "self": ByteModel(family_vocab("qwen-3.5").token_bytes, q=Q_TEACHER, salt=1),
    }


@pytest.fixture(scope="module", params=["deepseek-v3", "glm-4.7-flash"])
async def teacher_stream(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[str, OPDStream, dict[str, str]]]:
    """(the teacher's family, a Qwen 3.5 student's stream, each teacher's URL): the
    teachers of :func:`_models`, one real aiohttp mock server each, ``self`` configured with
    the student's tokenizer file as its own; one attempt per request. One per family for the
    module."""
    family = request.param
    path, qwen = family_dir(family), family_dir("qwen-3.5")
    opts = MockOptions(vocab_size=262144)
    async with AsyncExitStack() as stack:
        urls = {}
        for name, model in _models(family).items():
            fault = 1.0 if name == "misaligned" else 0.0
            server = await stack.enter_async_context(
                serve_mock(
                    "teacher",
                    1,
                    options=msgspec.structs.replace(opts, fault_misaligned=fault),
                    byte_model=model,
                )
            )
            urls[name] = server.url
        tokenizers = dict.fromkeys(urls, path) | {"self": qwen}
        cfg = config(qwen, path, teachers=urls, teacher_tokenizers=tokenizers, max_attempts=1)
        async with OPDStream(cfg) as stream:
            yield family, stream, urls


def _to(teacher: str, samples: list[Any]) -> list[Any]:
    return [msgspec.structs.replace(s, metadata={"opd_teacher": teacher}) for s in samples]


async def _scored(stream: OPDStream, samples: list[Any]) -> list[Any]:
    async with stream.run(samples) as results:
        return sorted([r async for r in results], key=lambda r: r.index)


async def test_qwen_student_with_real_teacher_tokenizers_matches_the_byte_reference(
    teacher_stream: tuple[str, OPDStream, dict[str, str]],
) -> None:
    teacher_family, stream, _ = teacher_stream
    student = family_vocab("qwen-3.5")
    teacher = family_vocab(teacher_family, "teacher_tokenizers[same]")
    s_model = ByteModel(student.token_bytes, q=Q_STUDENT, salt=3)
    # two teachers with the teacher's tokenizer: the student's byte model, and another one
    t_models = {name: _models(teacher_family)[name] for name in ("same", "other")}
    samples = []
    for name in t_models:
        for text in RESPONSES:
            ids = response_ids(student, text, "<|im_end|>")
            sample = make_sample(student, teacher, s_model, ids, len(samples))
            samples.append(msgspec.structs.replace(sample, metadata={"opd_teacher": name}))
    out = await _scored(stream, samples)
    assert len(out) == 2 * len(RESPONSES)
    for res in out:
        assert isinstance(res, ScoredSample), res
        name = res.sample.metadata["opd_teacher"]
        text = RESPONSES[res.index % len(RESPONSES)]
        r = res.sample.response_length
        assert res.teacher == name
        assert res.teacher_logprobs.shape == (r,) and res.teacher_logprobs.dtype == torch.float32
        assert res.reverse_kl is not None and res.reverse_kl.shape == (r,)
        al = res.alignment
        assert al is not None
        assert teacher.join(al.teacher_ids.numpy()) == text.encode("utf-8")
        spans = al.student_spans.tolist()
        # the reference over bytes, span by span, on each span's last student token
        ref = byte_reference(
            PROMPT.encode(), text.encode(), al.span_bytes.tolist(), s_model, t_models[name]
        )
        expected = np.zeros(r)
        for j, value in enumerate(ref):
            if al.scored[j]:
                expected[spans[j + 1] - 1] = value
        np.testing.assert_allclose(res.reverse_kl.numpy(), expected, rtol=0, atol=2e-4)
        if name == "same":  # the same byte model: 0 whatever the two tokenizations
            assert float(res.reverse_kl.abs().max()) < 2e-4
        else:
            assert float(res.reverse_kl.abs().max()) > 0.1
        # the textless <|im_end|> is a span of its own, not compared, value 0
        assert not bool(al.scored[-1]) and float(res.reverse_kl[-1]) == 0.0
        # the teacher's span logprobs are its token logprobs summed
        t_lp = al.teacher_token_logprobs.numpy().astype(np.float64)
        t_sp = al.teacher_spans.tolist()
        for j in range(len(spans) - 1):
            if al.scored[j]:
                assert math.isclose(
                    float(res.teacher_logprobs[spans[j + 1] - 1]),
                    math.fsum(t_lp[t_sp[j] : t_sp[j + 1]].tolist()),
                    rel_tol=1e-6,
                    abs_tol=1e-5,
                )


@pytest.mark.parametrize("teacher_stream", ["deepseek-v3"], indirect=True)
async def test_a_same_tokenizer_teacher_configured_as_cross_gives_todays_values(
    teacher_stream: tuple[str, OPDStream, dict[str, str]],
) -> None:
    """Teacher ``self`` has the student's own tokenizer file as its tokenizer: its results
    equal those of a stream without any tokenizer setting, from the same server."""
    _, stream, urls = teacher_stream
    qwen = family_vocab("qwen-3.5")
    rollout_model = ByteModel(qwen.token_bytes, q=Q_STUDENT)
    samples = [
        make_sample(qwen, qwen, rollout_model, qwen.encode(text), i)
        for i, text in enumerate(RESPONSES)
    ]
    cross = await _scored(stream, _to("self", samples))
    async with OPDStream(stream_config(urls["self"])) as plain_stream:
        plain = await _scored(plain_stream, samples)
    for a, b in zip(cross, plain, strict=True):
        assert isinstance(a, ScoredSample) and isinstance(b, ScoredSample)
        assert torch.equal(a.teacher_logprobs, b.teacher_logprobs)
        assert a.reverse_kl is not None and b.reverse_kl is not None
        assert torch.equal(a.reverse_kl, b.reverse_kl)
        assert a.alignment is not None and b.alignment is None


@pytest.mark.parametrize("teacher_stream", ["deepseek-v3"], indirect=True)
async def test_the_real_aiohttp_mock_serves_the_byte_model_in_the_teachers_ids(
    teacher_stream: tuple[str, OPDStream, dict[str, str]],
) -> None:
    _, stream, _ = teacher_stream
    t_model = _models("deepseek-v3")["other"]
    student = family_vocab("qwen-3.5")
    teacher = family_vocab("deepseek-v3", "teacher_tokenizers[default]")
    s_model = ByteModel(student.token_bytes, q=Q_STUDENT)
    samples = [
        make_sample(student, teacher, s_model, response_ids(student, text, "<|im_end|>"), i)
        for i, text in enumerate(RESPONSES[:2])
    ]
    out = await _scored(stream, _to("other", samples))
    for text, res in zip(RESPONSES[:2], out, strict=True):
        assert isinstance(res, ScoredSample), res
        assert res.teacher == "other"
        assert res.alignment is not None and res.reverse_kl is not None
        ref = byte_reference(
            PROMPT.encode(), text.encode(), res.alignment.span_bytes.tolist(), s_model, t_model
        )
        assert math.isclose(
            float(res.reverse_kl.double().sum()), math.fsum(ref), rel_tol=0, abs_tol=1e-3
        )


@pytest.mark.parametrize("teacher_stream", ["glm-4.7-flash"], indirect=True)
async def test_a_long_response_is_aligned_in_a_thread_with_the_same_values(
    teacher_stream: tuple[str, OPDStream, dict[str, str]],
) -> None:
    _, glm_stream, _ = teacher_stream
    student = family_vocab("qwen-3.5")
    teacher = family_vocab("glm-4.7-flash", "teacher_tokenizers[other]")
    s_model = ByteModel(student.token_bytes, q=Q_STUDENT)
    t_model = _models("glm-4.7-flash")["other"]
    text = " ".join(RESPONSES) * 8
    ids = student.encode(text)
    assert ids.shape[0] >= 256  # opd_stream.xtok._tokenizers.THREAD_TOKENS
    sample = make_sample(student, teacher, s_model, ids, 0)
    before = glm_stream.stats().cpu_s.align
    (res,) = await _scored(
        glm_stream, [msgspec.structs.replace(sample, metadata={"opd_teacher": "other"})]
    )
    assert glm_stream.stats().cpu_s.align > before
    assert isinstance(res, ScoredSample) and res.reverse_kl is not None
    assert res.alignment is not None
    ref = byte_reference(
        PROMPT.encode(), text.encode(), res.alignment.span_bytes.tolist(), s_model, t_model
    )
    ends = res.alignment.student_spans[1:] - 1
    np.testing.assert_allclose(res.reverse_kl[ends].numpy(), ref, rtol=0, atol=2e-4)


@pytest.mark.parametrize("teacher_stream", ["deepseek-v3"], indirect=True)
async def test_a_teacher_answer_in_other_ids_than_sent_fails_as_misaligned(
    teacher_stream: tuple[str, OPDStream, dict[str, str]],
) -> None:
    _, stream, _ = teacher_stream
    a = family_vocab("qwen-3.5")
    b = family_vocab("deepseek-v3", "teacher_tokenizers[misaligned]")
    sample = make_sample(a, b, ByteModel(a.token_bytes), a.encode(RESPONSES[0]), 0)
    (res,) = await _scored(
        stream, [msgspec.structs.replace(sample, metadata={"opd_teacher": "misaligned"})]
    )
    assert isinstance(res, SampleFailure) and res.reason == "misaligned_response", res
