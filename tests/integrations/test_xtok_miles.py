"""The Miles adapter with a teacher of another tokenizer: ``--opd-student-tokenizer`` /
``--opd-teacher-tokenizers``, the teacher prompt rendered from the sample's ``prompt``
(chat messages or text) with the teacher's chat template, and what is refused (small
trained tokenizers; the real ones and Miles' trainer: ``test_xtok_miles_trainer.py``)."""

from __future__ import annotations

import asyncio
import json
import math
from argparse import Namespace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from support.xtok_vocabs import SPECIAL, small_vocab, write_small

from opd_stream import ConfigError, InvalidSampleError
from opd_stream.integrations import miles
from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.testing.mock_sglang import ByteModel
from opd_stream.transport._transports import MockTransport, Response

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
    def __init__(
        self, tokens: list[int], r: int, prompt: Any, metadata: Any = None, **more: Any
    ) -> None:
        self.tokens = tokens
        self.response_length = r
        self.prompt = prompt
        self.metadata = metadata or {}
        self.reward: Any = None
        self.__dict__.update(more)

    def get_reward_value(self, args: Any) -> Any:
        return self.reward


S_MODEL_Q, T_MODEL_Q = 0.5, 0.7
STUDENT_PROMPT = "Q: fox?\n"
TEXT = "the quick brown fox 🎉"


def _sample(prompt: Any, metadata: Any = None, **more: Any) -> _MilesSample:
    """A single-turn sample of :data:`TEXT` after :data:`STUDENT_PROMPT` (small tokenizer
    ``a``), with its rollout logprobs (a byte model)."""
    a = small_vocab("a")
    head, response = a.encode(STUDENT_PROMPT).tolist(), a.encode(TEXT).tolist()
    tokens = head + response
    model = ByteModel(a.token_bytes, q=S_MODEL_Q)
    rollout = model.token_logprobs(tokens, np.arange(len(head), len(tokens))).tolist()
    fields = {"rollout_log_probs": rollout} | more
    return _MilesSample(tokens, len(response), prompt, metadata, **fields)


def _recording(server: InProcessSGLang) -> tuple[MockTransport, list[list[int]]]:
    """A transport to ``server`` that keeps each request's ``input_ids``."""
    sent: list[list[int]] = []

    def handler(method: str, url: str, body: bytes) -> Response:
        if url.endswith("/generate"):
            sent.append(list(msgspec.json.decode(body)["input_ids"]))
        return server.handle(method, url[len(TEACHER) :].split("?")[0], body)

    return MockTransport(handler), sent


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
    b = small_vocab("b")
    t_model = ByteModel(b.token_bytes, q=T_MODEL_Q)
    transport, sent = _recording(InProcessSGLang("teacher", 1, byte_model=t_model))
    args = _args(*paths)
    messages = [{"role": "user", "content": "fox?"}]
    samples = [_sample(messages), _sample("fox?")]  # a string: one user message
    miles.engine_for(args, transport=transport)
    try:
        rewards = await asyncio.gather(*(miles.reward_func(args, s) for s in samples))
        with pytest.raises(
            miles.MilesInvalidSampleError,
            match=r"prompt: required: teacher 'default' has its own tokenizer",
        ):
            await miles.reward_func(args, _sample(None))
        with pytest.raises(miles.MilesInvalidSampleError, match=r"prompt: message 0 is not a"):
            await miles.reward_func(args, _sample([3]))
    finally:
        await miles.close()
    # what the teacher was sent: "<s>" (textless) + "[user] fox?\n[assistant] " in b's ids
    history = b"[user] fox?\n[assistant] "
    assert [b"".join(b.token_bytes[i] for i in ids).startswith(history) for ids in sent] == [
        True,
        True,
    ]
    lt = t_model.byte_logprobs(TEXT.encode(), history=history)
    for reward in rewards:
        got = reward["teacher_log_probs"]
        assert got.shape == (samples[0].response_length,)
        # Miles' trainer takes rollout - teacher_log_probs per token: the sum over the
        # response is the response text's log-ratio, whatever the spans
        rollout = np.asarray(samples[0].rollout_log_probs)
        assert math.isclose(
            math.fsum(rollout.tolist()) - float(got.double().sum()),
            math.fsum(rollout.tolist()) - math.fsum(lt.tolist()),
            abs_tol=1e-4,
        )


async def test_an_empty_or_student_rendered_prompt_is_refused(paths: tuple[str, str]) -> None:
    """Miles' default prompt (``""``) and a prompt rendered with the student's chat template
    (``--apply-chat-template``: it holds the student's special tokens) are no user text."""
    b = small_vocab("b")
    transport, sent = _recording(
        InProcessSGLang("teacher", 1, byte_model=ByteModel(b.token_bytes, q=T_MODEL_Q))
    )
    args = _args(*paths)
    miles.engine_for(args, transport=transport)
    try:
        for empty in ("", "  ", []):
            with pytest.raises(
                miles.MilesInvalidSampleError, match=r"prompt: required: .*it is empty"
            ):
                await miles.reward_func(args, _sample(empty))
        with pytest.raises(
            miles.MilesInvalidSampleError,
            match=r"prompt: the text holds '<\|end\|>', a special token of the student's "
            r"tokenizer: it is already rendered with the student's chat template",
        ):
            await miles.reward_func(args, _sample(f"[user] fox?{SPECIAL}[assistant] "))
        # the teacher's own prompt ids need no prompt
        own = {miles.TEACHER_PROMPT_KEY: b.encode("[user] fox?\n[assistant] ").tolist()}
        reward = await miles.reward_func(args, _sample("", own))
    finally:
        await miles.close()
    assert reward["teacher_log_probs"].shape == (len(small_vocab("a").encode(TEXT)),)
    assert len(sent) == 1


async def test_the_samples_tools_reach_the_teachers_template(tmp_path: Path) -> None:
    student, teacher = write_small(tmp_path, "a"), write_small(tmp_path, "b")
    template = (
        "{% if tools %}[tools] {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    config = {"chat_template": template}
    (Path(teacher) / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    b = small_vocab("b")
    transport, sent = _recording(
        InProcessSGLang("teacher", 1, byte_model=ByteModel(b.token_bytes, q=T_MODEL_Q))
    )
    args = _args(student, teacher)
    tools = [{"type": "function", "function": {"name": "calc"}}]
    miles.engine_for(args, transport=transport)
    try:
        await miles.reward_func(args, _sample("fox?", {"tools": tools}))
    finally:
        await miles.close()
    shown = b"".join(b.token_bytes[i] for i in sent[0]).decode()
    assert shown.startswith(f"[tools] {json.dumps(tools)}\n[user] fox?\n[assistant] the")


async def test_a_teacher_folder_without_a_chat_template_fails_at_start(tmp_path: Path) -> None:
    """One ConfigError when the engine is made (the small files only), not a failure of
    each sample that reads the tokenizer again."""
    student, teacher = write_small(tmp_path, "a"), write_small(tmp_path, "b")
    with pytest.raises(
        ConfigError,
        match=r"teacher_tokenizers\[default\]: no chat template in .*/b "
        r"\(tokenizer_config.json 'chat_template' or chat_template.jinja\)",
    ):
        miles.engine_for(_args(student, teacher))


def test_a_template_that_does_not_load_is_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opd_stream.xtok import _chat

    loads = []
    real = _chat.ChatTemplate.load

    def counted(setting: str, path: str) -> _chat.ChatTemplate:
        loads.append(path)
        return real(setting, path)

    monkeypatch.setattr(_chat.ChatTemplate, "load", staticmethod(counted))
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{not json", encoding="utf-8")
    (folder / "chat_template.jinja").write_text("{{ messages }}", encoding="utf-8")
    prompts = _chat.TeacherPrompts({"t": str(folder)})  # a template is there, not a tokenizer
    for _ in range(3):
        with pytest.raises(InvalidSampleError, match=r"cannot read the tokenizer in"):
            prompts.ids("t", "fox?", "prompt")
    assert len(loads) == 1


def test_one_teacher_tokenizer_in_a_list_is_accepted(paths: tuple[str, str]) -> None:
    """``--opd-teacher-tokenizers PATH`` with ``nargs='+'``: a one-item list."""
    student, teacher = paths
    cfg = miles.config_from_miles_args(_args(student, teacher, opd_teacher_tokenizers=[teacher]))
    assert cfg.teacher_tokenizers == {"default": teacher}
    two = [f"default={teacher},other={student}"]  # one item of comma-separated entries
    cfg = miles.config_from_miles_args(
        _args(
            student,
            teacher,
            rm_url=None,
            opd_teacher_urls=[f"default={TEACHER}", "other=http://o:1"],
            opd_teacher_tokenizers=two,
        ),
        environ={},
    )
    assert cfg.teacher_tokenizers == {"default": teacher, "other": student}


async def test_a_bad_loss_mask_or_conversation_fails_the_sample(paths: tuple[str, str]) -> None:
    b = small_vocab("b")
    transport, sent = _recording(
        InProcessSGLang("teacher", 1, byte_model=ByteModel(b.token_bytes, q=T_MODEL_Q))
    )
    args = _args(*paths)
    r = len(small_vocab("a").encode(TEXT))
    miles.engine_for(args, transport=transport)
    try:
        with pytest.raises(
            miles.MilesInvalidSampleError,
            match=rf"loss_mask: expected {r} values \(one per response token\)",
        ):
            await miles.reward_func(args, _sample("fox?", loss_mask=[1, 0]))
        with pytest.raises(miles.MilesInvalidSampleError, match=r"loss_mask: a value other"):
            await miles.reward_func(args, _sample("fox?", loss_mask=[2] * r))
        two_turns = [1] * 3 + [0] * 2 + [1] * (r - 5)
        chat = {"messages": [{"role": "user", "content": "fox?"}, {"role": "assistant"}]}
        with pytest.raises(
            miles.MilesInvalidSampleError,
            match=r"metadata\['messages'\]: holds 1 assistant messages for 2 trained turns",
        ):
            await miles.reward_func(args, _sample("fox?", chat, loss_mask=two_turns))
        # no trained token: nothing asked, 0 everywhere (Miles' trainer gets rollout - 0)
        reward = await miles.reward_func(args, _sample("fox?", loss_mask=[0] * r))
    finally:
        await miles.close()
    assert sent == []
    rollout = np.asarray(_sample("fox?").rollout_log_probs, dtype=np.float32)
    assert reward["teacher_log_probs"].tolist() == rollout.tolist()


async def test_merged_turns_in_top_k_mode_are_the_turns_scored_alone(
    paths: tuple[str, str],
) -> None:
    """Only-student top-k: each trained turn gets what ``OPDStream.score`` gives it scored
    alone after the teacher's own rendering of the conversation before it; observation rows
    (empty student rows, loss_mask 0) get 0."""
    from support.xtok_vocabs import small_json
    from tokenizers import Tokenizer

    from opd_stream import OPDStream, Sample, ScoredSample

    a, b = small_vocab("a"), small_vocab("b")
    end = a.tokenizer.token_to_id(SPECIAL)
    turns = ["the quick fox 🎉", "brown dogs, naïve café"]
    obs = a.encode("\n[tool] 42\n").tolist()
    head = a.encode(STUDENT_PROMPT).tolist()
    response: list[int] = []
    mask: list[int] = []
    for i, text in enumerate(turns):
        ids = [*a.encode(text).tolist(), end]
        response += ids
        mask += [1] * len(ids)
        if i == 0:
            response += obs
            mask += [0] * len(obs)
    rows = [
        [[-0.25, tok], [-1.75, (tok + 7) % 300]] if m else []
        for tok, m in zip(response, mask, strict=True)
    ]
    conversation = [
        {"role": "user", "content": "fox?"},
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": turns[1]},
    ]
    meta = {"opd_student_top_logprobs": rows, "messages": conversation}
    sample = _MilesSample(head + response, len(response), "fox?", meta, loss_mask=mask)
    server = InProcessSGLang("teacher", 1, byte_model=ByteModel(b.token_bytes, q=T_MODEL_Q))
    transport, _ = _recording(server)
    args = _args(*paths, opd_log_prob_top_k=2)
    miles.engine_for(args, transport=transport)
    try:
        sample.reward = await miles.reward_func(args, sample)
    finally:
        await miles.close()
    miles.post_process_rewards(args, [sample])
    got = sample.opd_reverse_kl.tolist()  # type: ignore[attr-defined]
    # the teacher's context of each turn, by hand: the small template's lines
    b_file = Tokenizer.from_str(small_json("b"))
    contexts = [
        "<s>[user] fox?\n[assistant] ",
        f"<s>[user] fox?\n[assistant] {turns[0]}\n[tool] 42\n[assistant] ",
    ]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    spans = list(zip(edges[0::2], edges[1::2], strict=True))
    alone = []
    async with OPDStream(
        miles.config_from_miles_args(args, environ={}), transport=transport
    ) as stream:
        for (s, e), context in zip(spans, contexts, strict=True):
            one = Sample(
                head + response[:e],
                int(e - s),
                student_top_logprobs=rows[s:e],
                teacher_prompt_ids=b_file.encode(context, add_special_tokens=False).ids,
            )
            result = await stream.score(one)
            assert isinstance(result, ScoredSample)
            assert result.signal is not None
            alone.append((int(s), int(e), result.signal.tolist()))
    want = [0.0] * len(response)
    for s, e, values in alone:
        want[s:e] = values
    assert got == want
    assert any(want[: edges[1]]) and any(want[edges[2] :])
