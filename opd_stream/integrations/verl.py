"""verl drop-in: SGLang teacher logprobs in verl's vLLM ``prompt_logprobs`` contract.

verl's distillation teacher manager consumes, per sequence of ``sequence_length`` tokens,
two lists of ``sequence_length`` rows each, every row ``max(k, 1)`` wide:

* ``prompt_ids[j]`` / ``prompt_logprobs[j]`` for ``j < sequence_length - 1``: the
  prediction of token ``j + 1`` (position 0 has no context and is skipped): with
  ``k = 0`` the scored token itself ``[token_id]`` / ``[logprob]``; with ``k > 0`` the
  teacher's top-k there, best first.
* one pad row last, ``[0] * max(k, 1)`` / ``[0.0] * max(k, 1)``.

:class:`TeacherManager` is a drop-in for verl's ``AsyncTeacherLLMServerManager``: it
scores against external SGLang teacher servers through one shared
:class:`~opd_stream.OPDStream` (pooled connections, per-endpoint bounds, retries, deadlines,
replica balancing) and returns verl's ``(ids int32 [S, K], logprobs float32 [S, K])``
tensors. :func:`extract_prompt_logprobs` is the lower-level converter.

This module builds those lists from an SGLang ``/generate`` answer asked with
:func:`sglang_prompt_logprobs_params` (``logprob_start_len = 0``), in the nested form
(``[logprob, token_id, text]`` triples) or the flat forms of SGLang >= 0.5.23 (base64 or
plain lists). Unlike verl's own ``_extract_prompt_logprobs_sglang`` it never asserts: a
short or misaligned
answer raises :class:`~opd_stream.MisalignedResponseError` naming the position and the
counts, a missing field :class:`~opd_stream.MalformedResponseError`, a bad argument
:class:`~opd_stream.ConfigError`, an aborted answer :class:`~opd_stream.ServerAbortError`.
SGLang's ``null`` logprob (``-inf``), and NaN in any form, becomes ``float("-inf")``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import numpy as np

from .._config import StreamConfig
from .._errors import (
    ConfigError,
    MalformedResponseError,
    MisalignedResponseError,
    ServerAbortError,
)
from .._sample import Sample, prepare_sample
from .._scorer import SampleScorer, ScoreAttemptError
from .._stream import OPDStream
from .._transport import Transport

if TYPE_CHECKING:
    import torch

__all__ = (
    "TeacherManager",
    "extract_prompt_logprobs",
    "fill_prompt_logprobs",
    "sglang_prompt_logprobs_params",
    "verl_teacher_names",
    "verl_top_k",
)


def sglang_prompt_logprobs_params(num_prompt_logprobs: int) -> dict[str, Any]:
    """Top-level ``/generate`` fields that make SGLang answer what this module reads.

    ``{"return_logprob": True, "logprob_start_len": 0}`` plus ``top_logprobs_num`` when
    ``num_prompt_logprobs > 0`` (top level: SGLang rejects it inside ``sampling_params``).

    Raises:
        ConfigError: ``num_prompt_logprobs`` is not an integer >= 0.
    """
    k = _check_k(num_prompt_logprobs)
    out: dict[str, Any] = {"return_logprob": True, "logprob_start_len": 0}
    if k > 0:
        out["top_logprobs_num"] = k
    return out


def _check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(f"num_prompt_logprobs must be an integer >= 0, got {k!r}")
    return k


def _lp(value: Any, where: str) -> float:
    if value is None:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedResponseError(f"{where}: logprob is {type(value).__name__}, not a number")
    out = float(value)
    # SGLang writes NaN as null (-inf); the b64 and flat forms map NaN the same way.
    return -math.inf if math.isnan(out) else out


def _entry(entry: Any, where: str) -> tuple[int, float]:
    if not isinstance(entry, list | tuple) or len(entry) < 2:
        raise MalformedResponseError(f"{where}: expected a [logprob, token_id, text] entry")
    token = entry[1]
    if isinstance(token, bool) or not isinstance(token, int):
        raise MalformedResponseError(f"{where}: token id is not an integer")
    return int(token), _lp(entry[0], where)


_Lists = tuple[list[list[int]], list[list[float]]]


def _nested_topk(meta: Mapping[str, Any], k: int, n_rows: int) -> _Lists:
    rows = meta.get("input_top_logprobs")
    if rows is None:
        raise MalformedResponseError(
            "meta_info.input_top_logprobs is missing (ask with top_logprobs_num > 0)"
        )
    if not isinstance(rows, list) or len(rows) != n_rows + 1:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise MisalignedResponseError(
            f"meta_info.input_top_logprobs has {got} entries, expected {n_rows + 1} "
            "(one per input token with logprob_start_len=0)"
        )
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for position in range(1, n_rows + 1):
        row = rows[position] or []
        if len(row) != k:
            raise MisalignedResponseError(
                f"SGLang returned {len(row)} top logprobs at position {position}, expected {k}"
            )
        pairs = [_entry(e, f"input_top_logprobs[{position}]") for e in row]
        ids.append([p[0] for p in pairs])
        lps.append([p[1] for p in pairs])
    return ids, lps


def _b64(meta: Mapping[str, Any], name: str, dtype: str, count: int) -> Any:
    text = meta.get(name)
    if not isinstance(text, str):
        raise MalformedResponseError(f"meta_info.{name} is missing")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedResponseError(f"meta_info.{name} is not valid base64") from None
    if len(raw) != 4 * count:
        raise MisalignedResponseError(
            f"meta_info.{name} holds {len(raw) // 4} values, expected {count}"
        )
    return np.frombuffer(raw, dtype=dtype)


def _flat_shape(meta: Mapping[str, Any], k: int, n_rows: int) -> int:
    """Check ``input_top_logprobs_shape`` / ``_null_prefix`` of a flat answer; return rows."""
    shape = meta.get("input_top_logprobs_shape")
    prefix = meta.get("input_top_logprobs_null_prefix")
    if not (isinstance(shape, list) and len(shape) == 2 and isinstance(prefix, int)):
        raise MalformedResponseError(
            "meta_info.input_top_logprobs_shape / _null_prefix are missing or malformed"
        )
    rows, width = int(shape[0]), int(shape[1])
    if width != k:
        raise MisalignedResponseError(
            f"SGLang returned {width} top logprobs per position, expected {k}"
        )
    if prefix + rows != n_rows + 1 or prefix < 1:
        raise MisalignedResponseError(
            f"meta_info.input_top_logprobs covers null_prefix {prefix} + {rows} rows, "
            f"expected 1 + {n_rows} (one per input token with logprob_start_len=0)"
        )
    return rows


def _b64_topk(meta: Mapping[str, Any], k: int, n_rows: int) -> _Lists:
    rows = _flat_shape(meta, k, n_rows)
    vals = _b64(meta, "input_top_logprobs_val_flat_b64", "<f4", rows * k).reshape(rows, k)
    idx = _b64(meta, "input_top_logprobs_idx_flat_b64", "<i4", rows * k).reshape(rows, k)
    keep = slice(rows - n_rows, rows)
    lps = [[-math.inf if math.isnan(v) else float(v) for v in row] for row in vals[keep].tolist()]
    return [[int(i) for i in row] for row in idx[keep].tolist()], lps


def _plain_flat_topk(meta: Mapping[str, Any], k: int, n_rows: int) -> _Lists:
    """``return_flat_raw_top_logprobs`` without b64: ``_val_flat`` (numbers or null) and
    ``_idx_flat`` (ints), row-major, with the same ``_shape`` and ``_null_prefix``."""
    rows = _flat_shape(meta, k, n_rows)
    vals, idx = meta.get("input_top_logprobs_val_flat"), meta.get("input_top_logprobs_idx_flat")
    for name, arr in (("val_flat", vals), ("idx_flat", idx)):
        if not isinstance(arr, list):
            raise MalformedResponseError(f"meta_info.input_top_logprobs_{name} is missing")
        if len(arr) != rows * k:
            raise MisalignedResponseError(
                f"meta_info.input_top_logprobs_{name} holds {len(arr)} values, expected {rows * k}"
            )
    assert isinstance(vals, list)
    assert isinstance(idx, list)
    start = (rows - n_rows) * k
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for r in range(n_rows):
        at = start + r * k
        where = f"input_top_logprobs row {r + 1}"
        pairs = [_entry([vals[at + j], idx[at + j]], where) for j in range(k)]
        ids.append([p[0] for p in pairs])
        lps.append([p[1] for p in pairs])
    return ids, lps


def _check_not_aborted(meta: Mapping[str, Any]) -> None:
    reason = meta.get("finish_reason")
    if isinstance(reason, Mapping) and reason.get("type") == "abort":
        detail = reason.get("message")
        raise ServerAbortError(
            "SGLang aborted the request (finish_reason=abort"
            + (f": {str(detail)[:200]}" if detail else "")
            + "); there are no logprobs to read"
        )


def extract_prompt_logprobs(
    meta_info: Mapping[str, Any],
    num_prompt_logprobs: int,
    sequence_length: int,
    *,
    input_ids: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Build verl's ``(prompt_ids, prompt_logprobs)`` from an SGLang ``meta_info``.

    Args:
        meta_info: the ``meta_info`` of one SGLang ``/generate`` answer, asked with
            :func:`sglang_prompt_logprobs_params` (``logprob_start_len = 0``).
        num_prompt_logprobs: k; 0 = the scored tokens' own logprobs.
        sequence_length: tokens sent; both lists get exactly this many rows.
        input_ids: the tokens sent; when given, the token ids SGLang echoes are checked.

    Returns:
        ``(prompt_ids, prompt_logprobs)``, each ``sequence_length`` rows of
        ``max(k, 1)`` entries, the last row padding (see the module docstring).

    Raises:
        ConfigError: ``num_prompt_logprobs`` < 0, ``sequence_length`` < 1, or
            ``input_ids`` of another length.
        MalformedResponseError: a field is missing or not SGLang's shape.
        MisalignedResponseError: row counts, top-k widths or echoed token ids differ
            from what was asked (SGLang returned fewer entries than asked, or the
            request did not use ``logprob_start_len = 0``).
        ServerAbortError: the answer's ``finish_reason`` is ``abort`` (the message says
            ``finish_reason=abort``).

    Top-k is read from the nested ``input_top_logprobs``, or the flat fields
    (``return_flat_raw_top_logprobs``, with or without ``_b64``). A ``null`` or NaN logprob
    is ``-inf`` in every form (SGLang writes NaN as ``null``).
    """
    k = _check_k(num_prompt_logprobs)
    _check_not_aborted(meta_info)
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, int):
        raise ConfigError("sequence_length must be an integer")
    if sequence_length < 1:
        raise ConfigError(f"sequence_length must be >= 1, got {sequence_length}")
    if input_ids is not None and len(input_ids) != sequence_length:
        raise ConfigError(
            f"input_ids has {len(input_ids)} tokens but sequence_length is {sequence_length}"
        )
    n_rows = sequence_length - 1
    tokens = meta_info.get("input_token_logprobs")
    if not isinstance(tokens, list):
        raise MalformedResponseError("meta_info.input_token_logprobs is missing")
    if len(tokens) != sequence_length:
        raise MisalignedResponseError(
            f"SGLang prompt_logprobs length ({len(tokens)}) does not match sequence length "
            f"({sequence_length}); ask with logprob_start_len=0"
        )
    token_rows = [
        _entry(tokens[j], f"input_token_logprobs[{j}]") for j in range(1, sequence_length)
    ]
    if input_ids is not None:
        for j, (token, _) in enumerate(token_rows, start=1):
            if token != int(input_ids[j]):
                raise MisalignedResponseError(
                    f"input_token_logprobs[{j}] echoes a token id that differs from input_ids[{j}]"
                )
    if k == 0:
        ids = [[token] for token, _ in token_rows]
        lps = [[lp] for _, lp in token_rows]
    elif meta_info.get("input_top_logprobs_val_flat_b64") is not None:
        ids, lps = _b64_topk(meta_info, k, n_rows)
    elif meta_info.get("input_top_logprobs_val_flat") is not None:
        ids, lps = _plain_flat_topk(meta_info, k, n_rows)
    else:
        ids, lps = _nested_topk(meta_info, k, n_rows)
    width = max(k, 1)
    ids.append([0] * width)
    lps.append([0.0] * width)
    return ids, lps


def fill_prompt_logprobs(
    meta_info: Mapping[str, Any],
    num_prompt_logprobs: int,
    sequence_length: int,
    result_dict: MutableMapping[str, Any],
) -> None:
    """Drop-in for verl's ``_extract_prompt_logprobs_sglang``: set ``result_dict``'s
    ``prompt_ids`` and ``prompt_logprobs`` (see :func:`extract_prompt_logprobs`)."""
    ids, lps = extract_prompt_logprobs(meta_info, num_prompt_logprobs, sequence_length)
    result_dict["prompt_ids"] = ids
    result_dict["prompt_logprobs"] = lps


# --------------------------------------------------------------------------- TeacherManager


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

    One shared :class:`~opd_stream.OPDStream` scores every call: one connection pool, the
    per-endpoint bounds (``max_inflight_per_endpoint``), at most ``max_inflight`` calls at
    once, retries, hedging and deadlines (``request_deadline_s``), replica balancing.
    Concurrent calls (verl awaits one per sample, many at once) share it. The stream
    starts on the first call, on that call's asyncio loop, and ends with :meth:`aclose`.

    Args:
        stream_config: teachers (names as verl routes them), transport settings and tuning.
            ``top_k`` and ``strategy`` in it are ignored (only the teacher is asked).
        top_k: verl's ``K`` (``distillation_loss.topk`` with a top-k loss); 0 means verl's
            K = 1, the logprob of each next token.
        transport: passed to :class:`~opd_stream.OPDStream` (default: pooled aiohttp).
        teacher_key: verl's ``distillation.teacher_key``, named in routing errors.

    Raises:
        ConfigError: ``top_k`` is not an integer >= 0.
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
        k = _check_k(top_k)
        # Teacher top-k with no student at all: the "intersection" plan with an empty
        # student top-k asks the teacher for top_logprobs_num = K and nothing else.
        self.config = stream_config.evolve(
            top_k=k, strategy="intersection" if k > 0 else "only-student"
        )
        self.top_k = k
        self.teacher_key = teacher_key
        self._transport = transport
        self._names = sorted(stream_config.teachers)
        self._scorer: SampleScorer | None = None
        self._stream: OPDStream | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stop: asyncio.Event | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._in_flight = 0
        self._idle: asyncio.Event | None = None
        self._closed = False

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
        name, or a plain URL).

        Args:
            config: verl's whole configuration (an OmegaConf node, a dataclass or a dict),
                or its ``distillation`` section.
            teacher_client: verl's in-process teacher clients; unused (accepted so that the
                call has verl's shape).
            environ: the variables to read; ``None`` reads ``os.environ``.
            transport: see :class:`TeacherManager`.

        Raises:
            ConfigError: (a ``ValueError``) no teacher servers, names that do not match
                verl's teachers, or an invalid ``OPD_STREAM_*`` variable.
        """
        del teacher_client
        dist = _distillation(config)
        top_k = verl_top_k(dist)
        names = verl_teacher_names(dist)
        stream_config = StreamConfig.from_env(environ)
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
        return self._stream

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

    async def _start(self) -> SampleScorer:
        if self._closed:
            raise RuntimeError("TeacherManager is closed")
        loop = asyncio.get_running_loop()
        if self._loop is not None and loop is not self._loop:
            raise RuntimeError("TeacherManager used from a different event loop")
        if self._ready is None:
            self._loop = loop
            self._ready = loop.create_future()
            self._stop = asyncio.Event()
            self._idle = asyncio.Event()
            self._limiter = anyio.CapacityLimiter(self.config.max_inflight)
            self._task = loop.create_task(self._serve(), name="opd_stream.verl_teacher")
        await asyncio.shield(self._ready)
        if self._scorer is None:
            raise RuntimeError("the shared OPD stream is not running")
        return self._scorer

    async def _serve(self) -> None:
        assert self._ready is not None
        assert self._stop is not None
        try:
            async with OPDStream(self.config, transport=self._transport) as stream:
                self._stream = stream
                self._scorer = stream._scorer  # the stream's pool, limits and retries
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise
        finally:
            self._scorer = None
            self._stream = None

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
            raise ConfigError("sequence_ids is empty")
        width = max(self.top_k, 1)
        prepared = prepare_sample(
            Sample(sequence_ids, seq - 1),
            0,
            teacher=teacher,
            top_k=0,
            parse_student_topk=None,
        )
        ids = np.zeros((seq, width), dtype=np.int32)
        lps = np.zeros((seq, width), dtype=np.float32)
        if seq > 1:
            rows = await self._fetch(prepared, teacher)
            if self.top_k == 0:
                ids[:-1, 0] = prepared.tokens[1:]
                lps[:-1, 0] = rows.token_logprobs
            else:
                assert rows.top_ids is not None
                assert rows.top_logprobs is not None
                ids[:-1] = rows.top_ids
                lps[:-1] = rows.top_logprobs
        import torch  # here, where tensors are made (not when the module is imported)

        return torch.from_numpy(ids), torch.from_numpy(lps)

    async def _fetch(self, prepared: Any, teacher: str) -> Any:
        scorer = await self._start()
        assert self._limiter is not None
        assert self._idle is not None
        if self.top_k > 0:  # an empty student top-k: the teacher's top-k is all it asks for
            empty = np.empty((prepared.response_length, 0), dtype=np.int64)
            prepared = msgspec.structs.replace(
                prepared,
                student_top_ids=empty,
                student_top_logprobs=empty.astype(np.float32),
            )
        urls = self.config.teachers[teacher]
        self._in_flight += 1
        self._idle.clear()
        try:
            async with self._limiter:
                fetched = await scorer.fetch(prepared, urls, anyio.current_time())
        except ScoreAttemptError as exc:
            raise exc.error from None
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        return fetched.teacher_rows

    async def aclose(self) -> None:
        """Wait for the calls in flight, then end the shared stream. Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        if task is None:
            return
        if self._idle is not None and self._in_flight:
            await self._idle.wait()
        if self._stop is not None:
            self._stop.set()
        with contextlib.suppress(Exception):  # already raised to the calls that needed it
            await task
