"""The Miles adapter with a teacher of another tokenizer, through Miles' own trainer
arithmetic (``support.miles_trainer``): a Qwen 3.5 student, a DeepSeek V3 teacher (the real
tokenizer files), both served by byte models, single-turn and merged multi-turn samples.

The documented signal (``docs/semantics.md``, "A teacher with another tokenizer"): each
span's ``sum(student lp) - sum(teacher lp)`` on the span's last student token, 0 on its other
tokens, on textless tokens (``<|im_end|>``) and on masked tokens (``loss_mask`` 0)."""

from __future__ import annotations

import math
from argparse import Namespace
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from support.miles_trainer import SOURCE, trainer_signal
from support.xtok_vocabs import family_dir, family_vocab

from opd_stream.integrations import miles
from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.testing.mock_sglang import ByteModel
from opd_stream.transport._transports import MockTransport, Response

T = "http://teacher:1"
QWEN, DEEPSEEK = "qwen-3.5", "deepseek-v3"
QUESTION = "What is 6 times 7? Use the calculator."
# spans of several student tokens on one teacher token ("4" "2" / "42", the emoji's pieces)
TURNS = [
    "Let me ask the calculator: 6 times 7 is 42? 👍🏽",
    "The answer is 42 — 四十二. Größe 👍🏽!",
]
TOOL = "42"
# the observation as the student's chat template writes it (Qwen: <|im_start|> / <|im_end|>
# are special tokens, textless)
OBSERVATION = (
    f"\n<|im_start|>user\n<tool_response>\n{TOOL}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)
STUDENT_PROMPT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def _ds(name: str) -> str:
    """A DeepSeek V3 special token's text (its bars are U+FF5C)."""
    return f"<\uff5c{name}\uff5c>"


BOS, EOS = _ds("begin▁of▁sentence"), _ds("end▁of▁sentence")
USER, ASSISTANT = _ds("User"), _ds("Assistant")


@pytest.fixture(scope="module")
def anyio_backend() -> tuple[str, dict[str, Any]]:
    # Miles runs on asyncio; one loop for the module, so that its tests share one engine
    return ("asyncio", {"debug": True})


class _MilesSample:
    def __init__(self, **fields: Any) -> None:
        self.metadata: dict[str, Any] = {}
        self.reward: Any = None
        self.__dict__.update(fields)

    def get_reward_value(self, args: Any) -> Any:
        return self.reward


class _Side:
    """One tokenizer: its vocabulary (bytes per id) and the file's own tokenizer (special
    tokens recognised in text, as a chat template's output is read)."""

    def __init__(self, family: str, setting: str) -> None:
        from tokenizers import Tokenizer

        self.vocab = family_vocab(family, setting)
        self.hf = Tokenizer.from_file(f"{family_dir(family)}/tokenizer.json")

    def ids(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def text_ids(self, text: str) -> list[int]:
        """Ids of plain text (what the model sampled: no special token in it)."""
        return [int(i) for i in self.vocab.encode(text)]

    def data(self, ids: list[int]) -> bytes:
        return b"".join(self.vocab.token_bytes[i] for i in ids)


@pytest.fixture(scope="module")
def sides() -> tuple[_Side, _Side]:
    return _Side(QWEN, "student_tokenizer"), _Side(DEEPSEEK, "teacher_tokenizers[default]")


def _args() -> Namespace:
    return Namespace(
        use_opd=True,
        opd_type="sglang",
        rm_url=T,
        opd_student_tokenizer=family_dir(QWEN),
        opd_teacher_tokenizers=[f"default={family_dir(DEEPSEEK)}"],
    )


def _merged(student: _Side, s_model: ByteModel, turns: int) -> _MilesSample:
    """A Miles sample as ``merge_samples`` leaves it (``turns`` assistant turns, each ending
    with ``<|im_end|>``, an observation between two): ``loss_mask`` 0 and
    ``rollout_log_probs`` 0.0 on observations, the student's logprobs elsewhere."""
    im_end = student.hf.token_to_id("<|im_end|>")
    prompt = student.ids(STUDENT_PROMPT)
    response: list[int] = []
    mask: list[int] = []
    for i, text in enumerate(TURNS[:turns]):
        ids = [*student.text_ids(text), im_end]
        response += ids
        mask += [1] * len(ids)
        if i + 1 < turns:
            obs = student.ids(OBSERVATION)
            response += obs
            mask += [0] * len(obs)
    tokens = prompt + response
    rollout = s_model.token_logprobs(tokens, np.arange(len(prompt), len(tokens)))
    rollout[np.asarray(mask) == 0] = 0.0
    return _MilesSample(
        tokens=tokens,
        response_length=len(response),
        prompt=[{"role": "user", "content": QUESTION}],
        rollout_log_probs=[float(x) for x in rollout.astype(np.float32)],
        loss_mask=mask,
    )


def _recording(server: InProcessSGLang) -> tuple[MockTransport, list[list[int]]]:
    sent: list[list[int]] = []

    def handler(method: str, url: str, body: bytes) -> Response:
        if url.endswith("/generate"):
            sent.append(list(msgspec.json.decode(body)["input_ids"]))
        return server.handle(method, url[len(T) :].split("?")[0], body)

    return MockTransport(handler), sent


@pytest.fixture(scope="module")
async def served(
    sides: tuple[_Side, _Side],
) -> AsyncIterator[tuple[tuple[ByteModel, ByteModel], list[list[int]]]]:
    """The byte models, and the teacher's requests: one Miles engine for the module, as in
    a Miles run (its start loads both tokenizers and the teacher's chat template in
    processes of their own, ~7 s), closed after the module's last test."""
    models = _models(sides)
    transport, sent = _recording(InProcessSGLang("teacher", 1, byte_model=models[1]))
    miles.engine_for(_args(), transport=transport)
    try:
        yield models, sent
    finally:
        await miles.close()


@pytest.fixture
def models(
    served: tuple[tuple[ByteModel, ByteModel], list[list[int]]],
) -> tuple[ByteModel, ByteModel]:
    return served[0]


@pytest.fixture
def sent(served: tuple[tuple[ByteModel, ByteModel], list[list[int]]]) -> list[list[int]]:
    """The input ids of each ``/generate`` request the teacher got during the test."""
    served[1].clear()
    return served[1]


async def _score(sample: _MilesSample) -> torch.Tensor:
    """Through :func:`miles.reward_func` on the module's engine, then
    :func:`miles.post_process_rewards`: ``sample.teacher_log_probs``."""
    args = _args()
    sample.reward = await miles.reward_func(args, sample)
    miles.post_process_rewards(args, [sample])
    values: torch.Tensor = sample.teacher_log_probs  # type: ignore[attr-defined]
    return values


def _reference(
    student: _Side,
    teacher: _Side,
    s_model: ByteModel,
    t_model: ByteModel,
    sample: _MilesSample,
    start: int,
    end: int,
    teacher_prompt: list[int],
) -> list[float]:
    """float64, response positions ``start:end`` (one trained turn): the span values by
    hand, from the byte models, each side's bytes before the turn its history."""
    tokens = sample.tokens
    p = len(tokens) - sample.response_length
    turn = tokens[p + start : p + end]
    pieces = [student.vocab.token_bytes[i] for i in turn]
    data = b"".join(pieces)
    ls = s_model.byte_logprobs(data, history=student.data(tokens[: p + start]))
    lt = t_model.byte_logprobs(data, history=teacher.data(teacher_prompt))
    t_ids = teacher.ids(data.decode("utf-8"))
    t_ends = set(np.cumsum([len(teacher.vocab.token_bytes[i]) for i in t_ids]).tolist())
    out, prev, at = [0.0] * len(turn), 0, 0
    for i, piece in enumerate(pieces):
        at += len(piece)
        if piece and at in t_ends:
            out[i] = math.fsum(ls[prev:at].tolist()) - math.fsum(lt[prev:at].tolist())
            prev = at
    return out


def _teacher_prompt(sent: list[list[int]], teacher: _Side, turn_text: str) -> list[int]:
    """The prompt part of the one request that scored ``turn_text``."""
    tail = teacher.text_ids(turn_text)
    found = [ids[: len(ids) - len(tail)] for ids in sent if ids[len(ids) - len(tail) :] == tail]
    assert len(found) == 1, "one request per trained turn"
    return found[0]


def _masked_tokens_get_nothing(got: torch.Tensor, sample: _MilesSample) -> None:
    """Through Miles' trainer: 0 on every masked token (an observation)."""
    rollout = torch.tensor(sample.rollout_log_probs, dtype=torch.float32)
    signal = trainer_signal({"teacher_log_probs": got}, rollout)
    masked = torch.tensor(sample.loss_mask) == 0
    assert masked.any()
    assert signal[masked].tolist() == [0.0] * int(masked.sum()), SOURCE


def _check_turns(
    got: torch.Tensor,
    sample: _MilesSample,
    sides: tuple[_Side, _Side],
    models: tuple[ByteModel, ByteModel],
    prompts: list[list[int]],
) -> None:
    """Through Miles' trainer (student logprobs = the rollout's, on-policy): the span
    values on trained tokens, 0 on masked ones."""
    rollout = torch.tensor(sample.rollout_log_probs, dtype=torch.float32)
    signal = trainer_signal({"teacher_log_probs": got}, rollout).double()
    mask = np.asarray(sample.loss_mask if hasattr(sample, "loss_mask") else [1] * len(rollout))
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    want = np.zeros(len(rollout))
    for (a, b), prompt in zip(zip(edges[0::2], edges[1::2], strict=True), prompts, strict=True):
        want[a:b] = _reference(*sides, *models, sample, int(a), int(b), prompt)
    scale = 1e-4 + 1e-6 * (np.abs(want) + np.abs(rollout.double().numpy()))
    bad = np.flatnonzero(np.abs(signal.numpy() - want) > scale)
    assert bad.size == 0, (SOURCE, bad.tolist(), signal[bad].tolist(), want[bad].tolist())
    assert (signal[torch.from_numpy(mask == 0)] == 0).all()
    # the case in point: spans of several student tokens (inner tokens at 0) and textless ones
    assert (want[mask == 1] == 0).sum() > len(prompts)


def _models(sides: tuple[_Side, _Side]) -> tuple[ByteModel, ByteModel]:
    return (
        ByteModel(sides[0].vocab.token_bytes, q=0.5),
        ByteModel(sides[1].vocab.token_bytes, q=0.6, salt=2),
    )


async def test_a_single_turn_gives_miles_trainer_the_span_signal(
    sides: tuple[_Side, _Side],
    models: tuple[ByteModel, ByteModel],
    sent: list[list[int]],
) -> None:
    student, teacher = sides
    sample = _merged(student, models[0], 1)
    del sample.loss_mask  # a single-turn sample: every token trained
    got = await _score(sample)
    prompt = _teacher_prompt(sent, teacher, TURNS[0])
    assert (
        teacher.hf.decode(prompt, skip_special_tokens=False) == f"{BOS}{USER}{QUESTION}{ASSISTANT}"
    )
    _check_turns(got, sample, sides, models, [prompt])


async def test_merged_turns_are_scored_in_the_teachers_chat_format(
    sides: tuple[_Side, _Side],
    models: tuple[ByteModel, ByteModel],
    sent: list[list[int]],
) -> None:
    """``metadata["messages"]`` (Miles' trajectory): each trained turn after the teacher's
    own rendering of the conversation before it; values on trained tokens only."""
    student, teacher = sides
    sample = _merged(student, models[0], 2)
    sample.metadata["messages"] = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": TURNS[0]},
        {"role": "tool", "content": TOOL},
        {"role": "assistant", "content": TURNS[1]},
    ]
    got = await _score(sample)
    _masked_tokens_get_nothing(got, sample)
    prompts = [_teacher_prompt(sent, teacher, text) for text in TURNS]
    shown = [teacher.hf.decode(p, skip_special_tokens=False) for p in prompts]
    assert shown == [
        f"{BOS}{USER}{QUESTION}{ASSISTANT}",
        f"{BOS}{USER}{QUESTION}{ASSISTANT}{TURNS[0]}{EOS}{_ds('tool▁outputs▁begin')}"
        f"{_ds('tool▁output▁begin')}{TOOL}{_ds('tool▁output▁end')}{_ds('tool▁outputs▁end')}",
    ]
    _check_turns(got, sample, sides, models, prompts)


async def test_merged_turns_without_the_conversation_see_the_students_text(
    sides: tuple[_Side, _Side],
    models: tuple[ByteModel, ByteModel],
    sent: list[list[int]],
) -> None:
    """No ``metadata["messages"]``: the teacher's prompt, then the response before the turn
    as the student's tokens spell it (its special tokens have no text)."""
    student, teacher = sides
    sample = _merged(student, models[0], 2)
    got = await _score(sample)
    _masked_tokens_get_nothing(got, sample)
    prompts = [_teacher_prompt(sent, teacher, text) for text in TURNS]
    shown = [teacher.hf.decode(p, skip_special_tokens=False) for p in prompts]
    observation = OBSERVATION.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert shown == [
        f"{BOS}{USER}{QUESTION}{ASSISTANT}",
        f"{BOS}{USER}{QUESTION}{ASSISTANT}{TURNS[0]}{observation}",
    ]
    _check_turns(got, sample, sides, models, prompts)


async def test_a_sample_without_rollout_logprobs_is_refused(
    sides: tuple[_Side, _Side], models: tuple[ByteModel, ByteModel], sent: list[list[int]]
) -> None:
    student, _ = sides
    sample = _merged(student, models[0], 1)
    sample.rollout_log_probs = None
    with pytest.raises(miles.MilesInvalidSampleError, match=r"rollout_log_probs: required"):
        await _score(sample)
    assert sent == []
