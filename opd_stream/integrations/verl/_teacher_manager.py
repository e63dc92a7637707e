""":class:`TeacherManager`: verl's ``AsyncTeacherLLMServerManager`` against external SGLang
teacher servers through one shared :class:`~opd_stream.OPDStream`, and the readers of verl's
configuration it is built from (:func:`verl_top_k`, :func:`verl_teacher_names`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import msgspec
import numpy as np

from ..._errors import ConfigError, InvalidSampleError
from ..._sample import Sample, prepare_sample
from ..._stream import OPDStream
from ...config._settings import ENV_PREFIX, StreamConfig
from ...transport._transports import Transport
from .._shared import SharedStream
from ._prompt_logprobs import check_k

if TYPE_CHECKING:
    import torch

__all__ = ("TeacherManager", "verl_teacher_names", "verl_top_k")

_LOSS_FIELDS: Final = ("strategy", "divergence", "jsd_beta", "weight_mode", "tail")
"""The settings of opd_stream's own loss: verl computes its loss itself, so they do nothing
there (``top_k`` is verl's ``K``, read from its configuration)."""

_LOSS_DEFAULTS: Final[dict[str, Any]] = {
    f.name: f.default for f in msgspec.structs.fields(StreamConfig) if f.name in _LOSS_FIELDS
}


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name`` or ``obj[name]`` (a dataclass, an OmegaConf node or a dict)."""
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    try:
        return getattr(obj, name)
    except AttributeError:
        getter = getattr(obj, "get", None)
        return getter(name, default) if callable(getter) else default


def _distillation(config: Any) -> Any:
    dist = _get(config, "distillation")
    return config if dist is None else dist


def verl_top_k(config: Any) -> int:
    """verl's ``K`` as :class:`TeacherManager`'s ``top_k``: ``distillation_loss.topk`` when
    ``distillation_loss.loss_settings.use_topk``, else 0 (one logprob per token).

    ``loss_settings`` is filled at run time by verl from ``loss_mode``; in a raw
    configuration (no ``loss_settings``) a top-k loss is one whose ``loss_mode`` ends in
    ``topk`` (verl's ``forward_kl_topk``).

    Args:
        config: verl's whole configuration or its ``distillation`` section.
    """
    loss = _get(_distillation(config), "distillation_loss") or {}
    settings = _get(loss, "loss_settings")
    use_topk = _get(settings, "use_topk") if settings is not None else None
    if use_topk is None:
        use_topk = str(_get(loss, "loss_mode", "") or "").endswith("topk")
    if not use_topk:
        return 0
    topk = _get(loss, "topk")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ConfigError(
            f"distillation.distillation_loss.topk must be an integer >= 1 with a top-k loss, "
            f"got {topk!r}"
        )
    return topk


def _loss_mode(config: Any) -> str | None:
    loss = _get(_distillation(config), "distillation_loss") or {}
    mode = _get(loss, "loss_mode")
    return None if mode is None else str(mode)


def _verl_loss(top_k: int, loss_mode: str | None) -> str:
    """verl's loss setting behind ``top_k``, in its own keys, for messages."""
    at = "distillation.distillation_loss"
    if loss_mode is None:
        return f"{at}.topk={top_k}" if top_k else f"{at} with no top-k loss_mode"
    return f"{at}.loss_mode={loss_mode!r}" + (f", topk={top_k}" if top_k else "")


def _verl_reads(top_k: int) -> str:
    """What verl's loss reads of the teacher, per position of the student's sequence."""
    if top_k == 0:
        return "the teacher's logprob of each of the student's tokens"
    return f"the teacher's top-{top_k} ids in the student's vocabulary and their logprobs"


def _own_tokenizer_problem(config: StreamConfig, top_k: int, loss_mode: str | None) -> str | None:
    """Why verl cannot distill from a teacher with its own tokenizer, or None."""
    names = sorted(config.teacher_tokenizers or ())
    if not names:
        return None
    if top_k == 0:
        why = (
            "a teacher with another vocabulary scores the student's text span by span, and no "
            "per-token value gives a span's signal through verl's per-token estimators"
        )
    else:
        why = (
            "verl looks those ids up in the student's logits, while a teacher with another "
            "vocabulary has its top-k in its own ids"
        )
    return (
        f"teacher {', '.join(map(repr, names))} has its own tokenizer "
        f"({ENV_PREFIX}TEACHER_TOKENIZERS), which verl cannot distill from: verl's loss "
        f"({_verl_loss(top_k, loss_mode)}) reads {_verl_reads(top_k)}; {why}. With verl, "
        "serve a teacher that shares the student's tokenizer and leave "
        f"{ENV_PREFIX}TEACHER_TOKENIZERS unset"
    )


def _check_verl_environment(environ: Mapping[str, str], top_k: int, loss_mode: str | None) -> None:
    """Refuse an ``OPD_STREAM_*`` loss setting: in verl, verl's configuration decides them.

    ``OPD_STREAM_TOP_K`` may repeat verl's ``K``; the settings of opd_stream's own loss
    (``_LOSS_FIELDS``) do nothing in verl, so setting one is an error rather than ignored.
    """
    value = environ.get(ENV_PREFIX + "TOP_K")
    if value is not None:
        try:
            same = int(value.strip()) == top_k
        except ValueError:
            same = False
        if not same:
            raise ConfigError(
                f"{ENV_PREFIX}TOP_K={value!r}, but verl decides K: its loss "
                f"({_verl_loss(top_k, loss_mode)}) reads {_verl_reads(top_k)}; "
                f"unset {ENV_PREFIX}TOP_K (or set it to {top_k})"
            )
    given = [ENV_PREFIX + f.upper() for f in _LOSS_FIELDS if ENV_PREFIX + f.upper() in environ]
    if given:
        mode = "distillation.distillation_loss.loss_mode" + (
            "" if loss_mode is None else f"={loss_mode!r}"
        )
        raise ConfigError(
            f"{', '.join(given)} set, but in verl the loss is verl's own ({mode}): opd_stream "
            "only returns the teacher's logprobs, so strategy, divergence, jsd_beta, "
            f"weight_mode and tail would change nothing; unset {', '.join(given)} and choose "
            "the loss with verl's loss_mode"
        )


def verl_teacher_names(config: Any) -> list[str]:
    """The routing names of verl's teachers, as verl resolves them: one teacher is
    ``default``; with several, each entry's ``key`` (else its entry name).

    Args:
        config: verl's whole configuration or its ``distillation`` section.
    """
    models = _get(_distillation(config), "teacher_models") or {}
    entries = list(models.items()) if hasattr(models, "items") else []
    if len(entries) == 1:
        return ["default"]
    # Several: verl drops its default ``teacher_model`` entry and keys each by its ``key``.
    return [str(_get(entry, "key") or name) for name, entry in entries if name != "teacher_model"]


class TeacherManager:
    """verl's ``AsyncTeacherLLMServerManager`` against external SGLang teacher servers.

    One shared :class:`~opd_stream.OPDStream` scores every call, each one
    :meth:`OPDStream.teacher_rows` (so each shows in the stream's ``stats()``): one
    connection pool, the per-endpoint bounds (``max_inflight_per_endpoint``), at most
    ``max_inflight`` calls at once, retries, hedging and deadlines (``request_deadline_s``),
    replica balancing. Concurrent calls (verl awaits one per sample, many at once) share
    it. The stream starts on the first call, on that call's asyncio loop, and ends with
    :meth:`aclose`. A cancelled call cancels its requests.

    Args:
        stream_config: teachers (names as verl routes them), transport settings and tuning.
            The settings of opd_stream's loss in it (``top_k``, ``strategy``,
            ``divergence``, ``jsd_beta``, ``weight_mode``, ``tail``) are ignored: only the
            teacher is asked, and verl computes the loss.
        top_k: verl's ``K`` (``distillation_loss.topk`` with a top-k loss); 0 means verl's
            K = 1, the logprob of each next token.
        transport: passed to :class:`~opd_stream.OPDStream` (default: the pooled asyncio transport).
        teacher_key: verl's ``distillation.teacher_key``, named in routing errors.

    Raises:
        ConfigError: ``top_k`` is not an integer >= 0, or a teacher has its own tokenizer
            (``teacher_tokenizers``): verl's loss reads the teacher's logprobs of the
            student's own tokens (or its top-k ids in the student's vocabulary), which such a
            teacher does not have.
    """

    def __init__(
        self,
        stream_config: StreamConfig,
        *,
        top_k: int,
        transport: Transport | None = None,
        teacher_key: str = "data_source",
    ) -> None:
        if not isinstance(stream_config, StreamConfig):
            raise ConfigError(
                f"stream_config must be a StreamConfig, got {type(stream_config).__name__}"
            )
        k = check_k(top_k)
        problem = _own_tokenizer_problem(stream_config, k, None)
        if problem is not None:
            raise ConfigError(problem)
        # Teacher top-k with no student at all: the "intersection" plan with an empty
        # student top-k asks the teacher for top_logprobs_num = K and nothing else.
        strategy = "intersection" if k > 0 else "only-student"
        self.config = stream_config.evolve(**(_LOSS_DEFAULTS | {"top_k": k, "strategy": strategy}))
        self.top_k = k
        self.teacher_key = teacher_key
        self._names = sorted(stream_config.teachers)
        self._shared = SharedStream(self.config, transport=transport, owner="TeacherManager")

    @classmethod
    def from_verl_config(
        cls,
        config: Any,
        teacher_client: Any = None,
        *,
        environ: Mapping[str, str] | None = None,
        transport: Transport | None = None,
    ) -> TeacherManager:
        """Build from verl's configuration, without importing verl.

        Reads ``distillation.distillation_loss`` (``topk``, ``loss_settings.use_topk``, see
        :func:`verl_top_k`), the teacher names of ``distillation.teacher_models`` (see
        :func:`verl_teacher_names`) and ``distillation.teacher_key``; the servers and every
        other setting come from the ``OPD_STREAM_*`` variables (:meth:`StreamConfig.from_env`):
        ``OPD_STREAM_TEACHERS`` must name exactly verl's teachers (with one teacher, any one
        name, or a plain URL). verl's configuration decides the loss: ``OPD_STREAM_TOP_K``
        other than verl's ``K``, or any of ``OPD_STREAM_STRATEGY``, ``_DIVERGENCE``,
        ``_JSD_BETA``, ``_WEIGHT_MODE``, ``_TAIL`` (settings of opd_stream's own loss,
        which would change nothing in verl) is refused, and so is a teacher with its own
        tokenizer (``OPD_STREAM_TEACHER_TOKENIZERS``).

        Args:
            config: verl's whole configuration (an OmegaConf node, a dataclass or a dict),
                or its ``distillation`` section.
            teacher_client: verl's in-process teacher clients; unused (accepted so that the
                call has verl's shape).
            environ: the variables to read; ``None`` reads ``os.environ``.
            transport: see :class:`TeacherManager`.

        Raises:
            ConfigError: (a ``ValueError``) no teacher servers, names that do not match
                verl's teachers, an invalid ``OPD_STREAM_*`` variable, one of the loss
                variables above, or a teacher with its own tokenizer; the message names
                the variable and verl's setting.
        """
        del teacher_client
        dist = _distillation(config)
        top_k = verl_top_k(dist)
        loss_mode = _loss_mode(dist)
        names = verl_teacher_names(dist)
        env = os.environ if environ is None else environ
        _check_verl_environment(env, top_k, loss_mode)
        stream_config = StreamConfig.from_env(
            {name: value for name, value in env.items() if name != ENV_PREFIX + "TOP_K"}
        )
        problem = _own_tokenizer_problem(stream_config, top_k, loss_mode)
        if problem is not None:
            raise ConfigError(problem)
        servers = sorted(stream_config.teachers)
        if len(names) > 1 and set(servers) != set(names):
            raise ConfigError(
                f"OPD_STREAM_TEACHERS names {servers}, but verl's distillation.teacher_models "
                f"route to {sorted(names)}: give one NAME=URL entry per teacher"
            )
        if len(names) <= 1 and len(servers) != 1:
            raise ConfigError(
                f"verl has one teacher, but OPD_STREAM_TEACHERS names {len(servers)}: {servers}"
            )
        key = str(_get(dist, "teacher_key", "data_source") or "data_source")
        return cls(stream_config, top_k=top_k, transport=transport, teacher_key=key)

    @property
    def stream(self) -> OPDStream | None:
        """The shared stream while it runs (for ``stream.stats()``), else None."""
        return self._shared.stream

    def _resolve(self, routing_key: Any) -> str:
        """verl's routing: one teacher takes every sample; with several, the key must name
        one (``ValueError`` otherwise)."""
        if len(self._names) == 1:
            return self._names[0]
        if routing_key is None:
            raise ConfigError(
                "Routing key is required for multi-teacher distillation (configured via "
                f"distillation.teacher_key={self.teacher_key!r})."
            )
        name = str(routing_key)
        if name not in self._names:
            raise ConfigError(
                f"No teacher configured for routing key {routing_key!r}. "
                f"Configured teachers: {self._names}."
            )
        return name

    async def compute_teacher_logprobs_single(
        self,
        sequence_ids: Any,
        multi_modal_data: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        routing_key: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher logprobs of one unpadded sequence, as verl's SGLang teacher path gives them.

        Returns:
            ``(ids, logprobs)``: int32 and float32 ``[S, max(top_k, 1)]``, ``S =
            len(sequence_ids)``. Row ``j < S - 1`` describes position ``j + 1``: with
            ``top_k = 0`` its token and that token's logprob; else the teacher's top-k
            there, best first in SGLang's order. A probability-0 token's logprob is
            ``-inf``. The last row is padding (ids 0, logprobs 0.0).

        Raises:
            ValueError: (:class:`~opd_stream.ConfigError`) a missing or unknown
                ``routing_key`` with several teachers; (:class:`~opd_stream.InvalidSampleError`)
                an empty sequence or invalid token ids.
            NotImplementedError: multi-modal inputs (only token ids are sent).
            TimeoutError: (:class:`~opd_stream.DeadlineExceeded`) the request ran past
                ``request_deadline_s``.
            OPDStreamError: any other failure (HTTP errors, invalid answers).
        """
        del mm_processor_kwargs
        media = dict(multi_modal_data or {})
        extra = {name: value for name, value in kwargs.items() if value is not None}
        if any(value for value in media.values()) or extra:
            raise NotImplementedError(
                "TeacherManager sends token ids only: multi-modal inputs are not supported"
            )
        teacher = self._resolve(routing_key)
        seq = len(sequence_ids)
        if seq < 1:
            raise InvalidSampleError(
                "sequence_ids", "empty (verl sends prompt_ids + response_ids: at least one id)"
            )
        width = max(self.top_k, 1)
        ids = np.zeros((seq, width), dtype=np.int32)
        lps = np.zeros((seq, width), dtype=np.float32)
        if seq == 1:  # nothing to ask: the ids checked, the pad row alone
            prepare_sample(Sample(sequence_ids, 0), 0, teacher=teacher, top_k=0)
        else:
            # position 0 is the prompt; every later token is scored (validated in the stream)
            sample = Sample(sequence_ids, seq - 1, metadata={self.config.teacher_key: teacher})
            rows = await self._shared.teacher_rows(sample)
            if self.top_k == 0:
                ids[:-1, 0] = rows.token_ids
                lps[:-1, 0] = rows.token_logprobs
            else:
                assert rows.top_ids is not None
                assert rows.top_logprobs is not None
                ids[:-1] = rows.top_ids
                lps[:-1] = rows.top_logprobs
        import torch  # here, where tensors are made (not when the module is imported)

        return torch.from_numpy(ids), torch.from_numpy(lps)

    async def aclose(self) -> None:
        """Wait for the calls in flight, then end the shared stream. Idempotent."""
        await self._shared.aclose()
