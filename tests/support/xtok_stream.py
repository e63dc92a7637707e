"""What the cross-tokenizer stream tests share (``tests/xtok/test_xtok_stream.py``, small
trained tokenizers on both backends; ``tests/xtok/test_xtok_stream_real.py``, the real ones):
the prompt and responses, samples with a byte model's rollout logprobs, the byte reference,
a stream's configuration and one run over the in-process mock."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from opd_stream import OPDStream, Sample, StreamConfig
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.testing.mock_sglang import ByteModel
from opd_stream.xtok._vocab import Vocab
from support.config import stream_config

__all__ = (
    "PROMPT",
    "Q_STUDENT",
    "Q_TEACHER",
    "RESPONSES",
    "T",
    "byte_reference",
    "config",
    "make_sample",
    "response_ids",
    "run",
)

T = "http://teacher:1"
Q_STUDENT, Q_TEACHER = 0.5, 0.6
PROMPT = "Question: say something in many scripts.\nAnswer: "
RESPONSES = [
    "Hello, world! Größe café naïve — Zürich façade.",
    "東京と北京、你好世界。Ελληνικά русский язык עברית العربية हिन्दी",
    "```python\ndef square(x):\n    return x * x  # 平方\n```\n",
    "emoji 🎉🎉 👍🏽 ❤️ 🇫🇷 family 👨‍👩‍👧 done",
    "<think>let me think</think> The answer is 42.",
]


def byte_reference(
    prompt: bytes, response: bytes, span_bytes: list[int], student: ByteModel, teacher: ByteModel
) -> list[float]:
    """float64, per span: sum over its bytes of log p_student - log p_teacher, each byte
    given every byte before it (prompt included)."""
    ls = student.byte_logprobs(response, history=prompt)
    lt = teacher.byte_logprobs(response, history=prompt)
    return [
        math.fsum(ls[a:b].tolist()) - math.fsum(lt[a:b].tolist())
        for a, b in itertools.pairwise(span_bytes)
    ]


def make_sample(
    student: Vocab,
    teacher: Vocab,
    model: ByteModel,
    response_ids: np.ndarray,
    index: int,
    *,
    prompt: str = PROMPT,
) -> Sample:
    prompt_ids = student.encode(prompt)
    tokens = np.concatenate([prompt_ids, response_ids])
    positions = np.arange(prompt_ids.shape[0], tokens.shape[0])
    rollout = model.token_logprobs(tokens, positions).astype(np.float32)
    return Sample(
        tokens=tokens.tolist(),
        response_length=int(response_ids.shape[0]),
        rollout_logprobs=rollout.tolist(),
        teacher_prompt_ids=teacher.encode(prompt).tolist(),
        sample_id=index,
    )


def config(student_path: str, teacher_path: str, **kw: Any) -> StreamConfig:
    base: dict[str, Any] = {
        "student_tokenizer": student_path,
        "teacher_tokenizers": {"default": teacher_path},
        "return_alignment": True,
    }
    return stream_config(T, **(base | kw))


async def run(cfg: StreamConfig, server: InProcessSGLang, samples: list[Any]) -> list[Any]:
    async with OPDStream(cfg, transport=mock_transport({T: server})) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
    return sorted(out, key=lambda r: r.index)


def response_ids(student: Vocab, text: str, special: str) -> np.ndarray:
    end = student.tokenizer.token_to_id(special)
    return np.concatenate([student.encode(text), [end]])
