"""The trained turns of a Miles sample, for a teacher with its own tokenizer
(``teacher_tokenizers``): which turns, what the teacher sees before each (plain functions,
run in a worker thread: chat templates, encoding), and the sample's result joined from
theirs. Each **trained turn** (a run of ``loss_mask`` 1; the whole response when
``loss_mask`` is None) is scored as a response of its own, all turns at once, after the
teacher's context for it (:func:`plan_turns`): the conversation up to that assistant
message (``metadata["messages"]``) rendered with the teacher's chat template, else the
teacher's prompt followed by the earlier response text as the student's tokens spell it
(special tokens left out). Values land on trained tokens only (a masked token gets 0);
``metadata["tools"]`` goes to the teacher's template as ``tools``. In full:
``docs/design-notes.md``, "opd_stream/integrations/miles/_turns.py".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from ..._errors import InvalidSampleError
from ..._sample import PreparedSample, Sample, SampleFailure, ScoredSample, _as_token_array
from ...xtok._chat import TeacherPrompts, as_messages
from ...xtok._vocab import Vocab

if TYPE_CHECKING:
    import torch

__all__ = (
    "MESSAGES_KEY",
    "TOOLS_KEY",
    "Turn",
    "join_turns",
    "plan_turns",
    "special_texts",
    "trained_turns",
    "turn_sample",
)

MESSAGES_KEY: Final = "messages"
"""The sample metadata key of the conversation (Miles' trajectory)."""
TOOLS_KEY: Final = "tools"
"""The sample metadata key of the tool definitions (Miles' ``--tool-key`` column)."""
_FIELD_MESSAGES: Final = f"metadata[{MESSAGES_KEY!r}]"

IntArray = npt.NDArray[np.int64]


class Turn(msgspec.Struct, frozen=True):
    """One trained turn: response positions ``start:end``, scored after
    ``teacher_prompt_ids`` (the teacher's ids of everything before it)."""

    start: int
    end: int
    teacher_prompt_ids: Any


def trained_turns(loss_mask: Any, r: int) -> list[tuple[int, int]]:
    """The runs of ``loss_mask`` 1, as ``(start, end)`` response positions; None: the whole
    response (none when it is empty).

    Raises:
        InvalidSampleError: (field ``loss_mask``) not ``r`` values of 0 or 1.
    """
    if loss_mask is None:
        return [(0, r)] if r else []
    values = loss_mask.tolist() if hasattr(loss_mask, "tolist") else loss_mask
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidSampleError(
            "loss_mask", f"expected a sequence of 0 and 1, got {type(loss_mask).__name__}"
        )
    try:
        mask = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidSampleError("loss_mask", "expected a sequence of 0 and 1") from None
    if mask.ndim != 1 or mask.shape[0] != r:
        raise InvalidSampleError(
            "loss_mask", f"expected {r} values (one per response token), got shape {mask.shape}"
        )
    bad = (mask != 0) & (mask != 1)
    if bad.any():
        raise InvalidSampleError(
            "loss_mask", f"a value other than 0 or 1 at response position {int(np.argmax(bad))}"
        )
    edges = np.flatnonzero(np.diff(np.concatenate([[0.0], mask, [0.0]])))
    return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2], strict=True)]


def special_texts(vocab: Vocab) -> re.Pattern[str] | None:
    """A pattern matching the text of any textless (special) token of ``vocab``
    (``<|im_start|>``, ...), longest first; None when it has none."""
    texts = set(vocab.special_texts().values())
    ordered = sorted((t for t in texts if t), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def _no_prompt(prompt: Any) -> bool:
    if prompt is None:
        return True
    if isinstance(prompt, str):
        return not prompt.strip()
    return isinstance(prompt, Sequence) and not prompt


def _prompt_messages(
    prompt: Any, teacher: str, key: str, student_specials: re.Pattern[str] | None
) -> list[dict[str, Any]]:
    """The sample's prompt as chat messages (a string: one user message).

    Raises:
        InvalidSampleError: (field ``prompt``) no prompt (None, ``""``: Miles' default), a
            string already rendered with the student's chat template, or not messages.
    """
    if _no_prompt(prompt):
        raise InvalidSampleError(
            "prompt",
            f"required: teacher {teacher!r} has its own tokenizer and the sample has neither "
            f"metadata[{key!r}], nor the conversation in {_FIELD_MESSAGES}, nor a prompt "
            "(chat messages or text; it is empty, Miles' default) to render its prompt from",
        )
    if isinstance(prompt, str) and student_specials is not None:
        found = student_specials.search(prompt)
        if found is not None:
            raise InvalidSampleError(
                "prompt",
                f"the text holds {found.group()!r}, a special token of the student's "
                "tokenizer: it is already rendered with the student's chat template (what "
                f"Miles' --apply-chat-template stores), which teacher {teacher!r} would read "
                "as a user's words. Keep the prompt as chat messages (a dataset of message "
                "lists without --apply-chat-template, with a generate function that renders "
                "them, e.g. miles.rollout.generate_hub.single_turn), or give the teacher's "
                f"prompt ids in metadata[{key!r}]",
            )
    return as_messages(prompt, "prompt")


def _conversation(
    prompt: Any, messages: Any, teacher: str, key: str, student_specials: re.Pattern[str] | None
) -> list[dict[str, Any]]:
    """The whole conversation from ``metadata["messages"]`` and the sample's prompt: the
    messages alone when the prompt is empty (Miles' session rollouts) or they start with
    the prompt's messages (its multi-turn rollouts of a message-list prompt), else the
    prompt's messages then them (a string prompt: the trajectory starts after it)."""
    chat = as_messages(messages, _FIELD_MESSAGES)
    if _no_prompt(prompt):
        return chat
    head = _prompt_messages(prompt, teacher, key, student_specials)
    return chat if chat[: len(head)] == head else head + chat


def _history_ids(student: Vocab, teacher: Vocab, response: IntArray, start: int) -> IntArray:
    """The teacher's ids of the text of ``response[:start]`` (the student's tokens' bytes;
    textless tokens have none)."""
    if start == 0:
        return np.zeros(0, np.int64)
    before = response[:start]
    if int(before.max()) >= student.size:
        p = int(np.argmax(before >= student.size))
        raise InvalidSampleError(
            "tokens",
            f"response token id {int(before[p])} at response position {p} is outside the "
            f"student tokenizer's vocabulary (size {student.size}, {student.path})",
        )
    data = student.join(before)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidSampleError(
            "tokens",
            f"the response before its trained turn at response position {start} is not UTF-8 "
            f"text (byte {exc.start}), which the teacher's tokenizer needs",
        ) from None
    return teacher.encode(text)


def plan_turns(
    *,
    teacher: str,
    prompts: TeacherPrompts,
    student: Vocab,
    teacher_vocab: Vocab,
    response: IntArray,
    loss_mask: Any,
    prompt: Any,
    metadata: Mapping[str, Any],
    prompt_key: str,
    student_specials: re.Pattern[str] | None,
) -> list[Turn]:
    """The trained turns of one sample and the teacher's ids before each (see the module
    docstring for which context).

    Args:
        teacher: the teacher's name.
        prompts: the teachers' chat templates.
        student: the student's tokenizer; teacher_vocab: the teacher's.
        response: the response's student ids.
        loss_mask: the sample's ``loss_mask`` (None: every token is trained).
        prompt: the sample's ``prompt``.
        metadata: the sample's metadata.
        prompt_key: the metadata key of the teacher's own prompt ids.
        student_specials: :func:`special_texts` of the student's tokenizer.

    Raises:
        InvalidSampleError: naming the field: a bad ``loss_mask``, no usable prompt, a
            conversation with fewer assistant messages than trained turns, a template that
            refuses the messages, ...
    """
    turns = trained_turns(loss_mask, int(response.shape[0]))
    if not turns:
        return []
    tools = metadata.get(TOOLS_KEY)
    given = metadata.get(prompt_key)
    messages = metadata.get(MESSAGES_KEY)
    if given is None and messages is not None:
        chat = _conversation(prompt, messages, teacher, prompt_key, student_specials)
        answers = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
        if len(answers) < len(turns):
            raise InvalidSampleError(
                _FIELD_MESSAGES,
                f"holds {len(answers)} assistant messages for {len(turns)} trained turns (runs "
                "of loss_mask 1): each trained turn is one of the last assistant messages",
            )
        template = prompts.template(teacher, _FIELD_MESSAGES)
        return [
            Turn(start, end, template.prompt_ids(chat[:at], _FIELD_MESSAGES, tools=tools))
            for (start, end), at in zip(turns, answers[len(answers) - len(turns) :], strict=True)
        ]
    if given is not None:
        base: Any = given
    else:
        chat = _prompt_messages(prompt, teacher, prompt_key, student_specials)
        base = prompts.template(teacher, "prompt").prompt_ids(chat, "prompt", tools=tools)
    out = []
    for start, end in turns:
        ids = base
        if start > 0:
            history = _history_ids(student, teacher_vocab, response, start)
            ids = np.concatenate([_as_token_array(base, prompt_key), history])
        out.append(Turn(start, end, ids))
    return out


def turn_sample(full: Sample, checked: PreparedSample, turn: Turn) -> Sample:
    """One trained turn as a sample of its own: the tokens up to its end, its rows."""
    s, e = turn.start, turn.end
    top = None
    if checked.student_top_ids is not None and checked.student_top_logprobs is not None:
        top = (checked.student_top_ids[s:e], checked.student_top_logprobs[s:e])
    rollout = checked.rollout_logprobs
    return msgspec.structs.replace(
        full,
        tokens=checked.tokens[: checked.prompt_length + e],
        response_length=e - s,
        rollout_logprobs=None if rollout is None else rollout[s:e],
        student_top_logprobs=top,
        teacher_prompt_ids=turn.teacher_prompt_ids,
    )


def _signal(x: ScoredSample) -> torch.Tensor | None:
    """The result's signal (its reverse KL when that is the divergence)."""
    if x.signal is not None or x.divergence != "reverse_kl":
        return x.signal
    return x.reverse_kl


def join_turns(
    full: Sample,
    turns: list[Turn],
    results: list[ScoredSample | SampleFailure],
    teacher: str,
    r: int,
    divergence: str,
) -> ScoredSample | SampleFailure:
    """The sample's result from its turns': their values on the turns' tokens, 0 on every
    other (CPU float32 tensors; no candidate arrays or alignment), or the first failure."""
    import torch

    attempts = sum(x.attempts for x in results)
    for i, (turn, x) in enumerate(zip(turns, results, strict=True)):
        if isinstance(x, SampleFailure):
            return SampleFailure(
                sample=full,
                index=x.index,
                reason=x.reason,
                message=f"trained turn {i + 1} of {len(turns)} (response positions "
                f"{turn.start}:{turn.end}): {x.message}",
                attempts=attempts,
            )
    scored = [x for x in results if isinstance(x, ScoredSample)]

    def join(values: list[torch.Tensor | None]) -> torch.Tensor | None:
        if any(v is None for v in values):
            return None
        out = torch.zeros(r, dtype=torch.float32)
        for turn, v in zip(turns, values, strict=True):
            assert v is not None
            out[turn.start : turn.end] = v.detach().to(device="cpu", dtype=torch.float32)
        return out

    teacher_lps = join([x.teacher_logprobs for x in scored])
    reverse_kl = join([x.reverse_kl for x in scored])
    signal = join([_signal(x) for x in scored])
    assert teacher_lps is not None  # no turn (no trained token): 0 everywhere
    return ScoredSample(
        sample=full,
        index=scored[0].index if scored else -1,
        teacher=teacher,
        teacher_logprobs=teacher_lps,
        reverse_kl=reverse_kl,
        candidates=None,
        attempts=attempts,
        latency_s=max((x.latency_s for x in scored), default=0.0),
        alignment=None,
        signal=signal,
        divergence=divergence,
    )
