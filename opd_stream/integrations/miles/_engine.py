"""The shared engine of the Miles adapter: :class:`MilesEngine` (one shared stream scoring
concurrent ``reward_func`` calls through :meth:`OPDStream.score`), the Miles sample ->
:class:`Sample` mapping and the errors ``reward_func`` raises, in the reference's families.

**A teacher with its own tokenizer** (``teacher_tokenizers``): each trained turn is scored
as a response of its own (:mod:`._turns` says which turns and what the teacher sees before
each), all turns at once, and the sample's result joins theirs.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Mapping
from typing import Any, Final

import anyio
import msgspec

from ..._errors import InvalidSampleError, OPDStreamError
from ..._sample import (
    PreparedSample,
    Sample,
    SampleFailure,
    ScoredSample,
    prepare_sample,
)
from ..._stream import OPDStream
from ...config._settings import StreamConfig
from ...fleet._routing import DEFAULT_TEACHER, show_value
from ...transport._transports import Transport
from ...xtok._chat import TeacherPrompts
from ...xtok._tokenizers import CrossTokenizers
from .._shared import SharedStream
from ._turns import Turn, join_turns, plan_turns, special_texts, turn_sample

__all__ = (
    "MilesEngine",
    "MilesInvalidSampleError",
    "MilesRoutingError",
    "MilesTimeoutError",
    "OPDSampleError",
    "sample_error",
    "TEACHER_PROMPT_KEY",
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
    ``default`` teacher is configured, else None (the same rule as the stream's teacher routing)."""
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


class MilesEngine:
    """The shared stream of concurrent :meth:`score` calls (:meth:`OPDStream.score`).

    Bound to the asyncio loop of its first :meth:`score` call. Not reusable after
    :meth:`aclose`.

    Args:
        config: the stream configuration.
        transport: passed to :class:`OPDStream` (default: the pooled asyncio transport).

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
        parts = [turn_sample(full, checked, turn) for turn in turns]
        results: list[ScoredSample | SampleFailure | None] = [None] * len(parts)

        async def score_one(i: int) -> None:
            results[i] = await self._shared.score(parts[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(parts)):
                tg.start_soon(score_one, i)
        done = [x for x in results if x is not None]
        return join_turns(full, turns, done, teacher, r, self.config.divergence)

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
