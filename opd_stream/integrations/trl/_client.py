""":class:`TeacherClient`: TRL's server teacher (``VLLMClient.get_sequence_logprobs``)
through one :class:`~opd_stream.OPDStream` per ``top_logprobs`` value, on an event loop of
its own."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from ..._errors import ConfigError, OPDStreamError
from ..._sample import Sample
from ..._stats import StreamStats
from ...config._settings import ENV_PREFIX, StreamConfig
from ...transport._transports import Transport
from ...wire._answers import ScoreRows
from .._shared import SharedStream
from ._loop import LoopThread
from ._rows import (
    KEYS,
    check_batch,
    check_temperature,
    check_top_logprobs,
    sequence_result,
    sequence_tokens,
)

__all__ = ("SequenceScoringError", "TeacherClient")

_LOSS_FIELDS: Final = ("top_k", "strategy", "divergence", "jsd_beta", "weight_mode", "tail")
"""The settings of opd_stream's own loss: TRL computes its loss itself and each call's
``top_logprobs`` is the top-k, so they do nothing here."""

_LOSS_DEFAULTS: Final[dict[str, Any]] = {
    f.name: f.default for f in msgspec.structs.fields(StreamConfig) if f.name in _LOSS_FIELDS
}

_TRL_MAX_LOGPROBS: Final = -1
"""``vllm_max_logprobs`` when nothing sets it: TRL's teacher server runs ``vllm serve
--max-logprobs -1`` (TRL's documented command), so any ``top_logprobs`` is allowed."""


class SequenceScoringError(OPDStreamError):
    """Some sequences of a :meth:`TeacherClient.get_sequence_logprobs` call could not be
    scored; the message says how many and why.

    Attributes:
        failures: sequence index -> the error that failed it (every failed sequence).
        total: the number of sequences in the call.
    """

    reason = "sequences_failed"

    def __init__(self, failures: Mapping[int, BaseException], total: int) -> None:
        self.failures = dict(sorted(failures.items()))
        self.total = total
        by_reason: dict[str, list[int]] = {}
        for index, error in self.failures.items():
            by_reason.setdefault(getattr(error, "reason", type(error).__name__), []).append(index)
        parts = []
        for reason, indices in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            first = indices[0]
            parts.append(
                f"{len(indices)} {reason} (sequence {first}: {type(self.failures[first]).__name__}:"
                f" {self.failures[first]})"
            )
        super().__init__(
            f"{len(self.failures)} of {total} sequences could not be scored by the teacher: "
            + "; ".join(parts)
        )


def _teachers_spec(base_url: str | Sequence[str]) -> str | list[str]:
    if isinstance(base_url, str):
        return base_url
    urls = list(base_url)
    if not urls or not all(isinstance(u, str) for u in urls):
        raise ConfigError("base_url must be a URL or a non-empty list of replica URLs")
    return urls


def _check_environment(environ: Mapping[str, str]) -> None:
    """Refuse ``OPD_STREAM_*`` settings of opd_stream's own loss: with TRL, the call's
    ``top_logprobs`` is the top-k and TRL computes the loss."""
    given = [ENV_PREFIX + f.upper() for f in _LOSS_FIELDS if ENV_PREFIX + f.upper() in environ]
    if given:
        raise ConfigError(
            f"{', '.join(given)} set, but with TRL each get_sequence_logprobs call's "
            "top_logprobs is the top-k and TRL computes the loss: they would change nothing; "
            f"unset {', '.join(given)}"
        )


def _config(
    base_url: str | Sequence[str] | None,
    config: StreamConfig | None,
    environ: Mapping[str, str] | None,
) -> StreamConfig:
    if config is not None:
        if not isinstance(config, StreamConfig):
            raise ConfigError(f"config must be a StreamConfig, got {type(config).__name__}")
        if base_url is None:
            return config
        return config.evolve(teachers=_teachers_spec(base_url))
    env = os.environ if environ is None else environ
    _check_environment(env)
    overrides: dict[str, Any] = {}
    if base_url is not None:
        overrides["teachers"] = _teachers_spec(base_url)
    if (
        "vllm_max_logprobs" in StreamConfig.__struct_fields__
        and ENV_PREFIX + "VLLM_MAX_LOGPROBS" not in env
    ):
        overrides["vllm_max_logprobs"] = _TRL_MAX_LOGPROBS
    return StreamConfig.from_env(env, **overrides)


class TeacherClient:
    """A drop-in for TRL 1.16.0's teacher client: :meth:`get_sequence_logprobs` with
    ``VLLMClient.get_sequence_logprobs``' signature and result, computed by opd_stream.

    Each call is synchronous, as TRL's training step calls it. Underneath, one
    :class:`~opd_stream.OPDStream` per ``top_logprobs`` value (started by the first call
    with that value) scores every sequence as one sample (``teacher_rows``), on an asyncio
    loop in a thread of the client's own: bounded concurrency (``max_inflight``,
    ``max_inflight_per_endpoint``), deadlines (``request_deadline_s``), retries, hedging,
    replicas with prefix-aware balancing, and any teacher engine (vLLM scale-out, vLLM
    completions, SGLang; ``engine``, detected by default). The calls' samples are in the
    streams' ``stats()`` (:meth:`stats`).

    Close it with :meth:`close` (or use it as a context manager): that ends the streams
    and joins the thread. A client never closed does not keep the interpreter from
    exiting (its loop stops once the main thread has ended).

    Args:
        base_url: the teacher server's URL as TRL's ``teacher_model_server_url`` (or a
            list of replica URLs of one teacher). ``None``: the teacher of ``config``, else
            of ``OPD_STREAM_TEACHERS``.
        config: the stream's settings (transport, bounds, deadlines, engines, ...);
            ``None``: :meth:`StreamConfig.from_env` (the ``OPD_STREAM_*`` variables, with
            ``vllm_max_logprobs`` -1 unless ``OPD_STREAM_VLLM_MAX_LOGPROBS`` is set: TRL's
            teacher server runs ``--max-logprobs -1``). Its loss settings (``top_k``,
            ``strategy``, ``divergence``, ``jsd_beta``, ``weight_mode``, ``tail``) are
            ignored: each call's ``top_logprobs`` is the top-k, and TRL computes the loss.
        transport: passed to :class:`~opd_stream.OPDStream` (default: the pooled asyncio transport).
        environ: the variables read when ``config`` is None (``None``: ``os.environ``).

    Raises:
        ConfigError: no teacher, more than one teacher name, an invalid setting, or (with
            ``config`` None) one of ``OPD_STREAM_TOP_K``, ``_STRATEGY``, ``_DIVERGENCE``,
            ``_JSD_BETA``, ``_WEIGHT_MODE``, ``_TAIL`` set (they would change nothing).
    """

    def __init__(
        self,
        base_url: str | Sequence[str] | None = None,
        *,
        config: StreamConfig | None = None,
        transport: Transport | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        cfg = _config(base_url, config, environ)
        names = sorted(cfg.teachers)
        if len(names) != 1:
            raise ConfigError(
                f"TeacherClient scores against one teacher (TRL's teacher_model_server_url), "
                f"but the configuration names {len(names)}: {names}; give one URL (or a list "
                "of its replicas)"
            )
        self.config = cfg.evolve(**_LOSS_DEFAULTS)
        self.teacher = names[0]
        self._transport = transport
        self._streams: dict[int, SharedStream] = {}
        self._loop = LoopThread("opd_stream.trl", self._close_streams)

    # -- TRL's method -------------------------------------------------------------------

    def get_sequence_logprobs(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lengths: Sequence[int],
        top_logprobs: int = 100,
        temperature: float = 1.0,
        chunk_size: int = 0,
        max_concurrent_requests: int = 4,
    ) -> dict[str, list[Any]]:
        """The teacher's logprobs of existing sequences, from each ``prompt_length`` on:
        TRL 1.16.0's ``VLLMClient.get_sequence_logprobs``, value for value.

        Args:
            sequences: prompt + completion token ids, one list per sequence.
            prompt_lengths: the prompt's length in each sequence (``0 <= P <= len``); rows
                are returned for positions ``P .. len - 1``.
            top_logprobs: the teacher's top entries per position (>= 0; above the server's
                ``--max-logprobs`` the server refuses it, and so does this client when
                ``vllm_max_logprobs`` is set lower).
            temperature: must be 1.0: vLLM computes prompt logprobs from the raw logits
                whatever the temperature, while TRL's trainer divides the student's logits
                by it; any other value is refused rather than ignored.
            chunk_size: accepted for TRL's signature; superseded: every sequence is its own
                sample, streamed under the stream's bounds (``max_inflight``,
                ``max_inflight_per_endpoint``, ``max_inflight_response_bytes``).
            max_concurrent_requests: accepted for TRL's signature; superseded by the same
                bounds.

        Returns:
            ``{"logprobs", "logprob_token_ids", "actual_logprobs", "actual_token_ids"}``, each
            a list (one entry per sequence, in order) of per-position lists: ``logprobs``
            ``[R][top_logprobs]`` by rank (best first), padded with ``-inf`` (ids with 0);
            ``actual_logprobs`` ``[R][1]`` the actual token's logprob; ``actual_token_ids``
            ``[R][1]``. A logprob of ``-inf`` from the teacher (a probability-0 token) is
            ``-9999.0``, as vLLM writes it and TRL passes it on; only padding is ``-inf``.
            Position 0 (no context) is a padding row.

        Raises:
            ConfigError: ``temperature`` other than 1.0, a bad ``top_logprobs``.
            ValueError: ``sequences`` and ``prompt_lengths`` differ in length.
            InvalidSampleError: an empty sequence or a prompt length outside the sequence.
            SequenceScoringError: some sequences could not be scored (after the stream's
                retries and within its deadlines); names how many, and why.
            RuntimeError: the client is closed.
        """
        del chunk_size, max_concurrent_requests  # superseded by the stream's bounds
        check_temperature(temperature)
        k = check_top_logprobs(top_logprobs)
        lengths = check_batch(sequences, prompt_lengths)
        tokens = [sequence_tokens(seq, i) for i, seq in enumerate(sequences)]
        rows = self._loop.run(self._score(tokens, lengths, k))
        results = [
            sequence_result(r, t, p, k, seq)
            for r, t, p, seq in zip(rows, tokens, lengths, sequences, strict=True)
        ]
        if not results:
            # TRL's client has no answer for an empty batch; an empty result is the only one.
            return {key: [] for key in KEYS}
        return {key: [result[key] for result in results] for key in KEYS}

    async def _score(
        self, tokens: list[npt.NDArray[np.int64]], lengths: list[int], k: int
    ) -> list[ScoreRows | None]:
        shared = self._stream(k)
        jobs: list[tuple[int, Sample]] = []
        for i, (seq, p) in enumerate(zip(tokens, lengths, strict=True)):
            start = max(p, 1)  # position 0 has no context: a padding row
            if start < len(seq):
                meta = {self.config.teacher_key: self.teacher}
                jobs.append((i, Sample(seq, len(seq) - start, metadata=meta)))
        outcomes = await asyncio.gather(
            *(shared.teacher_rows(sample) for _, sample in jobs), return_exceptions=True
        )
        rows: list[ScoreRows | None] = [None] * len(tokens)
        failures: dict[int, BaseException] = {}
        for (i, _), outcome in zip(jobs, outcomes, strict=True):
            if isinstance(outcome, ScoreRows):
                rows[i] = outcome
            elif isinstance(outcome, Exception):
                failures[i] = outcome
            else:
                raise outcome  # cancelled: the caller stopped waiting
        if failures:
            raise SequenceScoringError(failures, len(tokens))
        return rows

    def _stream(self, k: int) -> SharedStream:
        shared = self._streams.get(k)
        if shared is None:
            strategy = "intersection" if k > 0 else "only-student"
            cfg = self.config.evolve(top_k=k, strategy=strategy)
            shared = SharedStream(cfg, transport=self._transport, owner="TeacherClient")
            self._streams[k] = shared
        return shared

    # -- the client's life --------------------------------------------------------------

    def stats(self) -> dict[int, StreamStats]:
        """Each running stream's :meth:`~opd_stream.OPDStream.stats`, by ``top_logprobs``."""

        async def collect() -> dict[int, StreamStats]:
            return {
                k: shared.stream.stats()
                for k, shared in sorted(self._streams.items())
                if shared.stream is not None
            }

        return self._loop.run(collect())

    async def _close_streams(self) -> None:
        streams = list(self._streams.values())
        for shared in streams:
            await shared.aclose()

    def close(self) -> None:
        """Let the calls in flight finish, end the streams and join the loop's thread.
        Idempotent."""
        self._loop.close()

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
