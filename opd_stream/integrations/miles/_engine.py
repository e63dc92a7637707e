"""The shared engine of the Miles adapter: :class:`MilesEngine` (one shared stream scoring
concurrent ``reward_func`` calls through :meth:`OPDStream.score`), the Miles sample ->
:class:`Sample` mapping and the errors ``reward_func`` raises, in the reference's families.

**A teacher with its own tokenizer** (``teacher_tokenizers``): the sample's trained turns,
and what the teacher sees before each (plain functions, run in a worker thread: chat
templates, encoding).

A Miles sample may be a merged multi-turn rollout (``merge_samples``): its response is turn
1, an observation (a tool's answer, in the student's chat format: ``loss_mask`` 0,
``rollout_log_probs`` 0.0), turn 2, ... Only the trained tokens (``loss_mask`` 1) are the
student's; an observation is context. So each **trained turn**, a run of ``loss_mask`` 1
(the whole response when ``loss_mask`` is None), is scored as a response of its own
(:meth:`OPDStream.score`, all turns at once), after the teacher's context for it
(:func:`plan_turns`):

* the sample carries the conversation (``metadata["messages"]``, Miles' trajectory: its
  multi-turn and session rollouts record it with ``--save-debug-trajectory-data``) and no
  ``metadata["opd_teacher_prompt_ids"]``: the conversation up to the turn's assistant
  message (the trained turns are the last assistant messages, in order), rendered with the
  teacher's chat template, so the teacher reads every earlier turn and tool answer in its
  own format;
* else the teacher's prompt (``metadata["opd_teacher_prompt_ids"]``, or the sample's prompt
  rendered with the teacher's template) followed by the text of the response before the
  turn, as the student's tokens spell it, encoded by the teacher's tokenizer: earlier turns
  and observations in the **student's** chat format, its special tokens left out (they
  have no text), so the student's role words (``user``, ``assistant``) read as plain text.

Values land on trained tokens only; a masked token gets 0. ``metadata["tools"]`` (Miles'
``--tool-key`` column) is given to the teacher's template as ``tools``.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio
import msgspec
import numpy as np
import numpy.typing as npt

from ..._cross import CrossTokenizers
from ..._errors import InvalidSampleError, OPDStreamError
from ..._sample import (
    PreparedSample,
    Sample,
    SampleFailure,
    ScoredSample,
    _as_token_array,
    prepare_sample,
)
from ..._stream import OPDStream
from ...config._settings import StreamConfig
from ...fleet._router import DEFAULT_TEACHER, show_value
from ...transport._transports import Transport
from ...xtok._chat import TeacherPrompts, as_messages
from ...xtok._vocab import Vocab
from .._shared import SharedStream

if TYPE_CHECKING:
    import torch

__all__ = (
    "MESSAGES_KEY",
    "MilesEngine",
    "MilesInvalidSampleError",
    "MilesRoutingError",
    "MilesTimeoutError",
    "OPDSampleError",
    "plan_turns",
    "sample_error",
    "special_texts",
    "TEACHER_PROMPT_KEY",
    "TOOLS_KEY",
    "trained_turns",
    "Turn",
)

_TOP_KEY: Final = "opd_student_top_logprobs"
TEACHER_PROMPT_KEY: Final = "opd_teacher_prompt_ids"
"""The sample metadata key of the teacher's own prompt (token ids), for a teacher that sees
another context than the student (privileged context, self-distillation): when present (not
None), teacher requests send it + the response (``Sample.teacher_prompt_ids``)."""


class OPDSampleError(OPDStreamError):
    """A sample could not be scored; ``reason`` is the :class:`SampleFailure` reason.

    Raised as one of its subclasses where the reference raises a ``ValueError`` or a
    ``TimeoutError`` (see :func:`sample_error`).
    """

    def __init__(self, failure: SampleFailure, message: str | None = None) -> None:
        super().__init__(message or f"OPD scoring failed ({failure.reason}): {failure.message}")
        self.reason = failure.reason
        self.attempts = failure.attempts


class MilesRoutingError(OPDSampleError, ValueError):
    """The sample's teacher key is missing or names no teacher, and there is no ``default``
    teacher (the reference raises ``ValueError`` with the same wording)."""


class MilesInvalidSampleError(OPDSampleError, ValueError):
    """The sample itself is invalid (``invalid_sample``), or a selected candidate has no
    logprob (``missing_logprob``): the reference raises ``ValueError`` for both."""


class MilesTimeoutError(OPDSampleError, TimeoutError):
    """A request did not finish within ``request_deadline_s`` (``deadline_exceeded``); the
    reference's aiohttp timeout is a ``TimeoutError`` too."""


_VALUE_ERROR_REASONS: Final = frozenset({"invalid_sample", "missing_logprob"})


def sample_error(failure: SampleFailure) -> OPDSampleError:
    """The exception :func:`reward_func` raises for ``failure``, in the reference's family:
    :class:`MilesRoutingError` (``routing``), :class:`MilesInvalidSampleError`
    (``invalid_sample``, ``missing_logprob``), :class:`MilesTimeoutError`
    (``deadline_exceeded``), else :class:`OPDSampleError`."""
    if failure.reason == "routing":
        return MilesRoutingError(failure, failure.message)
    if failure.reason in _VALUE_ERROR_REASONS:
        return MilesInvalidSampleError(failure)
    if failure.reason == "deadline_exceeded":
        return MilesTimeoutError(failure)
    return OPDSampleError(failure)


def _to_sample(sample: Any, key: int, config: StreamConfig) -> Sample:
    """A :class:`Sample` from a duck-typed Miles sample (tokens, response_length, metadata).

    Only what the reference reads is taken: the student top-k rows
    (``metadata["opd_student_top_logprobs"]``, its last R rows) when the strategy reads the
    student's top-k, never ``rollout_log_probs`` (the reference does not use them: a
    merged multi-turn sample's 0.0 on observation spans, or any other value there, must not
    fail the sample; a teacher with its own tokenizer takes them in
    :meth:`MilesEngine.score`). Rows may be short or empty (``[]``), and hold ``None``
    entries. The teacher's own prompt, when the sample has one, is
    ``metadata[TEACHER_PROMPT_KEY]``.
    """
    response_length = int(sample.response_length)
    metadata = getattr(sample, "metadata", None)
    metadata = metadata if isinstance(metadata, Mapping) else {}
    top = None
    if config.top_k > 0 and config.strategy != "only-teacher":
        top = metadata.get(_TOP_KEY)
        if top is not None:
            top = list(top)[-response_length:] if response_length > 0 else []
    return Sample(
        list(sample.tokens),
        response_length,
        metadata=metadata,
        student_top_logprobs=top,
        sample_id=key,
        teacher_prompt_ids=metadata.get(TEACHER_PROMPT_KEY),
    )


def _route_error(config: StreamConfig, metadata: Mapping[str, Any]) -> str | None:
    """The reference's message when the sample's teacher key is missing or unknown and no
    ``default`` teacher is configured, else None (the same rule as the stream's router)."""
    teachers = config.teachers
    if DEFAULT_TEACHER in teachers:
        return None
    key = config.teacher_key
    name = metadata.get(key)
    if name is not None and str(name) in teachers:
        return None
    if name is not None:
        return (
            f"Sample metadata[{key!r}]={show_value(name)} matches no teacher name configured "
            f"by --opd-teacher-urls (known: {sorted(teachers)}) and no 'default' entry is "
            "configured."
        )
    return (
        f"Sample metadata is missing teacher key {key!r} and no 'default' teacher entry "
        "is configured."
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
    texts = {vocab.tokenizer.id_to_token(int(i)) for i in np.flatnonzero(vocab.textless)}
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


class MilesEngine:
    """The shared stream of concurrent :meth:`score` calls (:meth:`OPDStream.score`).

    Bound to the asyncio loop of its first :meth:`score` call. Not reusable after
    :meth:`aclose`.

    Args:
        config: the stream configuration.
        transport: passed to :class:`OPDStream` (default: pooled aiohttp).

    Raises:
        ConfigError: a teacher with its own tokenizer whose folder holds no chat template
            (checked here, from the small files only: the teacher's prompts and turns are
            rendered with it).
    """

    def __init__(self, config: StreamConfig, *, transport: Transport | None = None) -> None:
        self.config = config
        self._keys = itertools.count()
        # teachers with their own tokenizer: prompts rendered with their chat templates
        self._prompts = TeacherPrompts(config.teacher_tokenizers)
        self._prompts.check()
        self._shared = SharedStream(config, transport=transport, owner="MilesEngine")
        self._specials: re.Pattern[str] | None = None  # the student's special tokens' text
        self._specials_read = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the engine runs on (``None`` before the first call)."""
        return self._shared.loop

    @property
    def stream(self) -> OPDStream | None:
        """The shared stream while it runs (for ``stream.stats()``), else None."""
        return self._shared.stream

    async def score(self, sample: Any) -> ScoredSample | SampleFailure:
        """Score one duck-typed sample through the shared stream; wait for its result.

        A sample routed to a teacher with its own tokenizer is scored turn by turn (see the
        module docstring): each trained turn (a run of ``loss_mask`` 1) is one
        :meth:`OPDStream.score` after the teacher's context for it, all at once, and the
        result holds their values on the turns' tokens, 0 elsewhere (one turn covering the
        whole response: that call's result as it is). Its ``sample`` carries the
        rollout logprobs (sampled-token mode: required, ``rollout_log_probs``).

        A cancelled caller cancels its sample's requests (see :meth:`OPDStream.score`)."""
        key = next(self._keys)
        prepared = _to_sample(sample, key, self.config)
        message = _route_error(self.config, prepared.metadata)
        if message is not None:  # before the stream, in the reference's words
            failure = SampleFailure(
                sample=prepared, index=-1, reason="routing", message=message, attempts=0
            )
            raise MilesRoutingError(failure, message)
        name = prepared.metadata.get(self.config.teacher_key)
        teacher = str(name) if name is not None and str(name) in self.config.teachers else None
        teacher = teacher or DEFAULT_TEACHER
        if teacher not in (self.config.teacher_tokenizers or {}):
            return await self._shared.score(prepared)
        try:
            return await self._score_turns(sample, prepared, teacher)
        except InvalidSampleError as exc:
            return SampleFailure(
                sample=prepared, index=-1, reason=exc.reason, message=str(exc), attempts=0
            )

    async def _score_turns(
        self, sample: Any, prepared: Sample, teacher: str
    ) -> ScoredSample | SampleFailure:
        """A sample of a teacher with its own tokenizer: its trained turns, each scored
        after the teacher's context for it."""
        if self.config.top_k == 0:
            rollout = getattr(sample, "rollout_log_probs", None)
            if rollout is None:
                raise InvalidSampleError(
                    "rollout_log_probs",
                    f"required: teacher {teacher!r} has its own tokenizer, and Miles' trainer "
                    "takes student_logp - teacher_log_probs per token: the values that give "
                    "each span's signal are computed from the student's logprob of each "
                    "response token",
                )
            prepared = msgspec.structs.replace(prepared, rollout_logprobs=rollout)
        xtok = await self._shared.cross_tokenizers()
        if xtok is None:  # pragma: no cover  (a stream with teacher_tokenizers loads them)
            raise OPDStreamError("the shared stream has no tokenizers loaded")
        checked, turns = await anyio.to_thread.run_sync(self._plan, sample, prepared, teacher, xtok)
        full = msgspec.structs.replace(prepared, rollout_logprobs=checked.rollout_logprobs)
        r = checked.response_length
        if len(turns) == 1 and (turns[0].start, turns[0].end) == (0, r):
            one = msgspec.structs.replace(full, teacher_prompt_ids=turns[0].teacher_prompt_ids)
            return await self._shared.score(one)
        parts = [_turn_sample(full, checked, turn) for turn in turns]
        results: list[ScoredSample | SampleFailure | None] = [None] * len(parts)

        async def score_one(i: int) -> None:
            results[i] = await self._shared.score(parts[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(parts)):
                tg.start_soon(score_one, i)
        done = [x for x in results if x is not None]
        return _joined(full, turns, done, teacher, r, self.config.divergence)

    def _plan(
        self, sample: Any, prepared: Sample, teacher: str, xtok: CrossTokenizers
    ) -> tuple[PreparedSample, list[Turn]]:
        """(worker thread) The sample checked, and its trained turns with the teacher's
        context for each."""
        checked = prepare_sample(prepared, -1, teacher=teacher, top_k=self.config.top_k)
        if not self._specials_read:
            self._specials = special_texts(xtok.student)
            self._specials_read = True
        vocab = xtok.teacher(teacher)
        assert vocab is not None  # a teacher of teacher_tokenizers
        r = checked.response_length
        turns = plan_turns(
            teacher=teacher,
            prompts=self._prompts,
            student=xtok.student,
            teacher_vocab=vocab,
            response=checked.tokens[checked.tokens.shape[0] - r :],
            loss_mask=getattr(sample, "loss_mask", None),
            prompt=getattr(sample, "prompt", None),
            metadata=prepared.metadata,
            prompt_key=TEACHER_PROMPT_KEY,
            student_specials=self._specials,
        )
        return checked, turns

    async def aclose(self) -> None:
        """Let the samples already sent finish, then end the shared stream."""
        await self._shared.aclose()


def _turn_sample(full: Sample, checked: PreparedSample, turn: Turn) -> Sample:
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


def _joined(
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
