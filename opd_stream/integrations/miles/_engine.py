"""The shared engine of the Miles adapter: :class:`MilesEngine` (one shared stream scoring
concurrent ``reward_func`` calls through :meth:`OPDStream.score`), the Miles sample ->
:class:`Sample` mapping and the errors ``reward_func`` raises, in the reference's
families."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from typing import Any, Final

import anyio
import msgspec

from ..._errors import InvalidSampleError, OPDStreamError
from ..._sample import Sample, SampleFailure, ScoredSample
from ..._stream import OPDStream
from ...config._settings import StreamConfig
from ...fleet._router import DEFAULT_TEACHER, show_value
from ...transport._transports import Transport
from ...xtok._chat import TeacherPrompts
from .._shared import SharedStream

__all__ = (
    "MilesEngine",
    "MilesInvalidSampleError",
    "MilesRoutingError",
    "MilesTimeoutError",
    "OPDSampleError",
    "TEACHER_PROMPT_KEY",
    "sample_error",
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
    fail the sample). Rows may be short or empty (``[]``), and hold ``None`` entries. The
    teacher's own prompt, when the sample has one, is ``metadata[TEACHER_PROMPT_KEY]``.
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


class MilesEngine:
    """The shared stream of concurrent :meth:`score` calls (:meth:`OPDStream.score`).

    Bound to the asyncio loop of its first :meth:`score` call. Not reusable after
    :meth:`aclose`.

    Args:
        config: the stream configuration.
        transport: passed to :class:`OPDStream` (default: pooled aiohttp).
    """

    def __init__(self, config: StreamConfig, *, transport: Transport | None = None) -> None:
        self.config = config
        self._keys = itertools.count()
        self._shared = SharedStream(config, transport=transport, owner="MilesEngine")
        # teachers with their own tokenizer: prompts rendered from the sample's messages
        self._prompts = TeacherPrompts(config.teacher_tokenizers)

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

        A cancelled caller cancels its sample's requests (see :meth:`OPDStream.score`)."""
        key = next(self._keys)
        prepared = _to_sample(sample, key, self.config)
        message = _route_error(self.config, prepared.metadata)
        if message is not None:  # before the stream, in the reference's words
            failure = SampleFailure(
                sample=prepared, index=-1, reason="routing", message=message, attempts=0
            )
            raise MilesRoutingError(failure, message)
        if prepared.teacher_prompt_ids is None and self._prompts:
            prepared = await self._teacher_prompt(sample, prepared)
        return await self._shared.score(prepared)

    async def _teacher_prompt(self, sample: Any, prepared: Sample) -> Sample:
        """A teacher with its own tokenizer: its prompt from the sample's ``prompt`` (chat
        messages, or a string), rendered with its chat template in a worker thread."""
        name = prepared.metadata.get(self.config.teacher_key)
        teacher = str(name) if name is not None and str(name) in self.config.teachers else None
        teacher = teacher or DEFAULT_TEACHER
        if teacher not in (self.config.teacher_tokenizers or {}):
            return prepared
        prompt = getattr(sample, "prompt", None)
        try:
            if prompt is None:
                raise InvalidSampleError(
                    "prompt",
                    f"required: teacher {teacher!r} has its own tokenizer and the sample has "
                    f"neither metadata[{TEACHER_PROMPT_KEY!r}] nor a prompt (chat messages or "
                    "text) to render its prompt from",
                )
            ids = await anyio.to_thread.run_sync(self._prompts.ids, teacher, prompt, "prompt")
        except InvalidSampleError as exc:
            failure = SampleFailure(
                sample=prepared, index=-1, reason=exc.reason, message=str(exc), attempts=0
            )
            raise sample_error(failure) from None
        return msgspec.structs.replace(prepared, teacher_prompt_ids=ids)

    async def aclose(self) -> None:
        """Let the samples already sent finish, then end the shared stream."""
        await self._shared.aclose()
