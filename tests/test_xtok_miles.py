"""The Miles adapter with a teacher of another tokenizer: ``--opd-student-tokenizer`` /
``--opd-teacher-tokenizers``, and the teacher prompt rendered from the sample's ``prompt``
(chat messages or text) with the teacher's chat template."""

from __future__ import annotations

import asyncio
import json
import math
from argparse import Namespace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.xtok_vocabs import small_vocab, write_small

from opd_stream import ConfigError
from opd_stream.integrations import miles
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.testing.mock_sglang import ByteModel

TEACHER = "http://teacher:1"
# a small chat template: one line per message, the assistant's turn opened at the end
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # Miles runs on asyncio


class _MilesSample:
    def __init__(self, tokens: list[int], r: int, prompt: Any, metadata: Any = None) -> None:
        self.tokens = tokens
        self.response_length = r
        self.prompt = prompt
        self.metadata = metadata or {}
        self.reward: Any = None

    def get_reward_value(self, args: Any) -> Any:
        return self.reward


@pytest.fixture
def paths(tmp_path: Path) -> tuple[str, str]:
    student, teacher = write_small(tmp_path, "a"), write_small(tmp_path, "b")
    config = {"chat_template": TEMPLATE, "bos_token": {"content": "<s>", "special": True}}
    (Path(teacher) / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return student, teacher


def _args(student: str, teacher: str, **kw: Any) -> Namespace:
    base: dict[str, Any] = {
        "use_opd": True,
        "opd_type": "sglang",
        "rm_url": TEACHER,
        "opd_student_tokenizer": student,
        "opd_teacher_tokenizers": [f"default={teacher}"],
    }
    return Namespace(**(base | kw))


def test_the_tokenizer_flags_map_to_the_settings(paths: tuple[str, str]) -> None:
    cfg = miles.config_from_miles_args(_args(*paths), environ={})
    assert cfg.student_tokenizer == paths[0]
    assert cfg.teacher_tokenizers == {"default": paths[1]}
    assert miles.config_from_miles_args(_args(*paths, opd_log_prob_top_k=4), environ={}).top_k == 4
    with pytest.raises(
        ConfigError,
        match=r"strategy xor reads the teacher's top-k.*\(Miles "
        r"flags: --opd-teacher-tokenizers, --opd-log-prob-top-k, "
        r"--opd-top-k-strategy\)",
    ):
        args = _args(
            *paths,
            opd_log_prob_top_k=4,
            opd_top_k_strategy="xor",
            sglang_router_ip="s",
            sglang_router_port=1,
        )
        miles.config_from_miles_args(args, environ={})
    with pytest.raises(
        ConfigError,
        match=r"--opd-student-tokenizer, --opd-teacher-tokenizers "
        r"given without --use-opd",
    ):
        miles.config_from_miles_args(_args(*paths, use_opd=False), environ={})


async def test_the_teacher_prompt_is_rendered_from_the_samples_messages(
    paths: tuple[str, str],
) -> None:
    a, b = small_vocab("a"), small_vocab("b")
    s_model, t_model = ByteModel(a.token_bytes, q=0.5), ByteModel(b.token_bytes, q=0.7)
    servers = {TEACHER: InProcessSGLang("teacher", 1, byte_model=t_model)}
    args = _args(*paths)
    text = "the quick brown fox 🎉"
    student_prompt = a.encode("Q: fox?\n").tolist()
    response = a.encode(text).tolist()
    messages = [{"role": "user", "content": "fox?"}]
    samples = [
        _MilesSample(student_prompt + response, len(response), messages),
        _MilesSample(student_prompt + response, len(response), "fox?"),  # one user message
    ]
    miles.engine_for(args, transport=mock_transport(servers))
    try:
        rewards = await asyncio.gather(*(miles.reward_func(args, s) for s in samples))
        with pytest.raises(
            miles.MilesInvalidSampleError,
            match=r"prompt: required: teacher "
            r"'default' has its own tokenizer",
        ):
            await miles.reward_func(args, _MilesSample(student_prompt + response, 2, None))
        with pytest.raises(
            miles.MilesInvalidSampleError,
            match=r"prompt: message 0 is not a "
            "mapping",
        ):
            await miles.reward_func(args, _MilesSample(student_prompt + response, 2, [3]))
    finally:
        await miles.close()
    # what the teacher was sent: "<s>" (textless) + "[user] fox?\n[assistant] " in b's ids
    history = b"[user] fox?\n[assistant] "
    ls = s_model.byte_logprobs(text.encode(), history=b"Q: fox?\n")
    lt = t_model.byte_logprobs(text.encode(), history=history)
    for reward in rewards:
        got = reward["teacher_log_probs"]
        assert got.shape == (len(response),)
        # the teacher's log-probability of the whole response text
        assert math.isclose(float(got.double().sum()), math.fsum(lt), abs_tol=1e-4)
    rollout = s_model.token_logprobs(
        np.array(student_prompt + response),
        np.arange(len(student_prompt), len(student_prompt) + len(response)),
    )
    assert math.isclose(float(rollout.sum()), math.fsum(ls), abs_tol=1e-6)
