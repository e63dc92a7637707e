"""The KL stage's synchronous core: a batch of fetched samples in, scored samples out.

Runs in a worker thread (sharing the GIL with the event loop). The samples' response
positions are concatenated, not padded: one ``[1, sum(R_i), K]``
:class:`~opd_stream.kl._math.TopKBatch`, each sample's result the row range of its
positions. The number of GIL-releasing numpy/torch calls stays independent of the batch size
(plain memory copies join and split, numpy's only from ``_GIL_FREE_COPY`` bytes on). Every
tensor of a :class:`~opd_stream._sample.ScoredSample` owns its memory (no views into the
batch). torch's settings are the host's, never changed; the stage runs on one intra-op
thread in its own worker thread only (:mod:`opd_stream.kl._threads`). Why, with the
measurements: ``docs/design-notes.md``, "opd_stream/_scoring.py".
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from ._errors import MissingLogprobError
from ._sample import Candidates, Fetched, PreparedSample, ScoredSample, TokenAlignment
from .config._settings import StreamConfig
from .kl._math import (
    Divergence,
    Strategy,
    TopKBatch,
    WeightMode,
    needed_inputs,
    sampled_reverse_kl,
    topk_divergence,
)
from .kl._plan import candidate_width
from .xtok._align import span_signal

__all__ = ("empty_scored_sample", "score_batch", "timed_score_batch")

_GIL_FREE_COPY = 1 << 20


class _Signal(NamedTuple):
    """Which top-k signal a batch is scored with."""

    divergence: Divergence
    jsd_beta: float


_REVERSE_KL = _Signal("reverse_kl", 0.5)


def _source(f: Fetched, field: str) -> npt.NDArray[Any] | None:
    """The per-sample array behind a :class:`TopKBatch` field (``[R, K]``), if fetched."""
    rows = f.teacher_rows
    if field == "student_ids":
        return f.student_ids
    if field == "student_lp":
        return f.student_lps
    if field == "teacher_ids":
        return rows.top_ids
    if field == "teacher_lp":
        return rows.top_logprobs
    if field == "teacher_on_student":
        return rows.id_logprobs
    return f.student_rows.id_logprobs if f.student_rows is not None else None


@functools.cache
def _inputs(strategy: Strategy) -> tuple[tuple[str, np.dtype[Any]], ...]:
    """The :class:`TopKBatch` fields ``strategy`` reads, by name, with their dtypes."""
    return tuple(
        (name, np.dtype(np.int64 if name.endswith("_ids") else np.float32))
        for name in sorted(needed_inputs(strategy))
    )


def _joined_batch(items: Sequence[Fetched], strategy: Strategy, device: torch.device) -> TopKBatch:
    """The batch as one ``[1, N, K]`` TopKBatch, ``N = sum(R_i)``.

    The fields are views of one host allocation (an allocator reuses one block from batch
    to batch; fresh ones cost page faults), filled with plain memory copies (see the module
    doc); with one sample, its arrays are used as they are when they can be. A field is None
    when a sample lacks its array (all samples of a stream share one request plan, so that
    is a bug, and ``topk_reverse_kl`` names the field).

    Raises:
        ValueError: The samples' arrays of a field do not have ``R_i`` rows of one width.
    """
    lengths = [f.prepared.response_length for f in items]
    n = sum(lengths)
    fields: dict[str, torch.Tensor | None] = dict.fromkeys(TopKBatch._fields)
    todo: list[tuple[str, list[npt.NDArray[Any]], np.dtype[Any], int]] = []
    for name, dtype in _inputs(strategy):
        arrays = []
        width = -1
        for f, r in zip(items, lengths, strict=True):
            a = _source(f, name)
            if a is None:
                break
            if a.ndim != 2 or a.shape[0] != r or (width >= 0 and a.shape[1] != width):
                raise ValueError(f"KL stage: {name} arrays do not have R rows of one width each")
            width = a.shape[1]
            arrays.append(a)
        else:
            a = arrays[0]  # (items is never empty: the stage scores what it was given)
            if len(arrays) == 1 and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable:
                fields[name] = torch.from_numpy(a)
            else:
                todo.append((name, arrays, dtype, width))
    if todo:
        _join_into(fields, todo, n)
    for name, tensor in fields.items():
        if tensor is not None:
            fields[name] = (tensor if device.type == "cpu" else tensor.to(device))[None]
    fields["valid"] = torch.ones((1, n), dtype=torch.bool, device=device)
    return TopKBatch(**fields)  # type: ignore[arg-type]


def _join_into(
    fields: dict[str, torch.Tensor | None],
    todo: list[tuple[str, list[npt.NDArray[Any]], np.dtype[Any], int]],
    n: int,
) -> None:
    """Copy each field of ``todo`` (its samples' arrays, dtype, width) into one host
    allocation, one ``[n, width]`` view of it a field."""
    # int64 fields first, so that every view is aligned.
    todo.sort(key=lambda t: -t[2].itemsize)
    block = np.empty(sum(n * w * d.itemsize for _, _, d, w in todo), dtype=np.uint8)
    dst = block.data
    offset = 0
    for name, arrays, dtype, width in todo:
        start = offset
        for a in arrays:
            if a.size:
                src = np.ascontiguousarray(a, dtype=dtype).data.cast("B")
                if src.nbytes >= _GIL_FREE_COPY:  # a long copy: numpy's, the GIL released
                    np.copyto(block[offset : offset + src.nbytes], np.frombuffer(src, np.uint8))
                else:
                    dst[offset : offset + src.nbytes] = src
                offset += src.nbytes
        host = block[start:offset].view(dtype).reshape(n, width)
        fields[name] = torch.from_numpy(host)


class _Owner:
    """For a batch of one sample: a tensor the KL computed for it alone (the whole of its
    storage, C-contiguous, overlapping neither the batch's inputs nor a tensor already
    handed over) becomes the result's tensor as it is; any other is copied (:func:`_own`).
    Saves a sample's 6-8 copies of what its batch of one computed.

    Judged on the tensors themselves (their storages' address ranges, kept as ``(start,
    end)`` pairs; an input's whole storage counts as taken), with no numpy view made of an
    array that is handed over."""

    def __init__(self, batch: TopKBatch) -> None:
        # the batch's host storages (on a device, its inputs are copies: nothing to share)
        self._spans: list[tuple[int, int]] = []
        for t in batch:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
                storage = t.untyped_storage()
                start = storage.data_ptr()
                self._spans.append((start, start + storage.nbytes()))

    def __call__(self, t: torch.Tensor, row: int = 0, end: int = -1) -> torch.Tensor:
        """``t`` itself where it may be handed over, else a copy (``row``, ``end``: the
        sample's rows, which are all of the batch's; unused)."""
        storage = t.untyped_storage()
        start = storage.data_ptr()
        size = storage.nbytes()
        if t.data_ptr() != start or size != t.numel() * t.element_size() or not t.is_contiguous():
            return _own(t.numpy())
        end = start + size
        for lo, hi in self._spans:
            if lo < end and start < hi:
                return _own(t.numpy())
        if end > start:  # (an empty tensor overlaps nothing)
            self._spans.append((start, end))
        return t


def _own_rows(t: torch.Tensor, row: int, end: int) -> torch.Tensor:
    """A copy of the rows ``row:end`` of the (CPU, C-contiguous) batch tensor ``t``."""
    return _own(t.numpy()[row:end])


def _own(a: npt.NDArray[Any]) -> torch.Tensor:
    """A CPU tensor holding a copy of the C-contiguous ``a`` (a plain memory copy that keeps
    the GIL, see the module doc; numpy's, which releases it, from ``_GIL_FREE_COPY``)."""
    if a.nbytes >= _GIL_FREE_COPY:
        return torch.from_numpy(a.copy())
    return torch.from_numpy(np.frombuffer(bytearray(a.data), dtype=a.dtype).reshape(a.shape))


def empty_alignment() -> TokenAlignment:
    """The alignment of an empty response (``R = 0``): no teacher ids, no spans (each span
    boundary array holds its one ``0``)."""
    return TokenAlignment(
        teacher_ids=torch.zeros(0, dtype=torch.int64),
        teacher_token_logprobs=torch.zeros(0, dtype=torch.float32),
        student_spans=torch.zeros(1, dtype=torch.int64),
        teacher_spans=torch.zeros(1, dtype=torch.int64),
        span_bytes=torch.zeros(1, dtype=torch.int64),
        scored=torch.zeros(0, dtype=torch.bool),
    )


def token_alignment(f: Fetched) -> TokenAlignment | None:
    """The result's alignment: when the sample's teacher has its own tokenizer and
    ``return_alignment`` asked for it, else None."""
    a = f.alignment
    if a is None or not f.return_alignment:
        return None
    raw = f.teacher_token_logprobs
    if raw is None:
        raw = f.teacher_rows.token_logprobs
    return TokenAlignment(
        teacher_ids=torch.from_numpy(a.teacher_ids.copy()),
        teacher_token_logprobs=torch.from_numpy(np.array(raw, dtype=np.float32)),
        student_spans=torch.from_numpy(a.student_spans.copy()),
        teacher_spans=torch.from_numpy(a.teacher_spans.copy()),
        span_bytes=torch.from_numpy(a.span_bytes.copy()),
        scored=torch.from_numpy(a.scored.copy()),
    )


def score_cross(f: Fetched) -> ScoredSample:
    """The result of a sample scored by a teacher with its own tokenizer (sampled-token)."""
    a = f.alignment
    assert a is not None
    teacher, rkl = span_signal(a, f.teacher_rows.token_logprobs, f.prepared.rollout_logprobs)
    p = f.prepared
    signal = None if rkl is None else torch.from_numpy(rkl)
    return ScoredSample(
        sample=p.sample,
        index=p.index,
        teacher=p.teacher,
        teacher_logprobs=torch.from_numpy(teacher),
        reverse_kl=signal,
        candidates=None,
        attempts=f.attempts,
        latency_s=time.monotonic() - f.admitted_at,
        alignment=token_alignment(f),
        # sampled-token mode's one divergence: ``signal`` is ``reverse_kl`` (the same tensor)
        signal=signal,
        divergence="reverse_kl",
    )


def _result(
    f: Fetched,
    signal: torch.Tensor | None,
    candidates: Candidates | None,
    divergence: Divergence = "reverse_kl",
) -> ScoredSample:
    p = f.prepared
    return ScoredSample(
        sample=p.sample,
        index=p.index,
        teacher=p.teacher,
        teacher_logprobs=torch.from_numpy(np.ascontiguousarray(f.teacher_rows.token_logprobs)),
        reverse_kl=signal if divergence == "reverse_kl" else None,
        candidates=candidates,
        attempts=f.attempts,
        latency_s=time.monotonic() - f.admitted_at,
        alignment=None if f.alignment is None else token_alignment(f),
        signal=signal,
        divergence=divergence,
    )


def _score_sampled(f: Fetched) -> ScoredSample:
    if f.alignment is not None:  # a teacher with its own tokenizer
        return score_cross(f)
    rollout = f.prepared.rollout_logprobs
    rkl = None
    if rollout is not None:
        rkl = sampled_reverse_kl(
            torch.from_numpy(rollout), torch.from_numpy(f.teacher_rows.token_logprobs)
        )
    return _result(f, rkl, None)


def score_batch(
    items: Sequence[Fetched],
    *,
    top_k: int,
    strategy: Strategy,
    weight_mode: WeightMode,
    device: torch.device,
    tail: bool = False,
    divergence: Divergence = "reverse_kl",
    jsd_beta: float = 0.5,
    candidates: bool = True,
) -> list[ScoredSample | tuple[Fetched, MissingLogprobError]]:
    """Score fetched samples; a sample with a missing logprob comes back as its error.

    The output has one entry per input, in input order. A sample's error names the first
    selected candidate with a missing logprob, its response position in that sample, and the
    sample's index among the samples scored together; the others are scored again without it.
    ``tail``: top-k with the tail bucket; ``divergence``, ``jsd_beta``: the top-k signal (see
    :func:`~opd_stream.kl._math.topk_divergence`); ``candidates`` False: each result's
    ``candidates`` is None (only the signal is copied out of the batch).
    """
    signal = _Signal(divergence, jsd_beta)
    return _score_batch(items, top_k, strategy, weight_mode, device, tail, signal, candidates)


def timed_score_batch(
    batch: list[Fetched], cfg: StreamConfig, device: torch.device
) -> tuple[list[Any], float, float]:
    """Score one KL batch (in the worker thread) and time it, for ``stats().kl``:
    ``(results, wall seconds, CPU seconds of this thread)``."""
    start, cpu = time.perf_counter(), time.thread_time()
    results = score_batch(
        batch,
        top_k=cfg.top_k,
        strategy=cfg.strategy,
        weight_mode=cfg.weight_mode,
        device=device,
        tail=cfg.tail,
        divergence=cfg.divergence,
        jsd_beta=cfg.jsd_beta,
        candidates=cfg.candidates,
    )
    return results, time.perf_counter() - start, time.thread_time() - cpu


def empty_scored_sample(
    prepared: PreparedSample,
    admitted_at: float,
    top_k: int,
    strategy: Strategy,
    tail: bool,
    divergence: Divergence = "reverse_kl",
    *,
    aligned: bool = False,
    candidates: bool = True,
) -> ScoredSample:
    """The result of a sample with ``R = 0`` (nothing to ask): empty tensors of the right
    shapes; ``aligned`` (its teacher has its own tokenizer, and ``return_alignment`` is
    set): with the empty alignment; ``candidates`` False: no per-candidate arrays."""
    width = candidate_width(strategy, top_k)
    cands = None
    if top_k > 0 and candidates:
        cands = Candidates(
            ids=torch.empty((0, width), dtype=torch.int64),
            student_logprobs=torch.empty((0, width)),
            teacher_logprobs=torch.empty((0, width)),
            weights=torch.empty((0, width)),
            mask=torch.empty((0, width), dtype=torch.bool),
            student_tail_logprobs=torch.empty(0) if tail else None,
            teacher_tail_logprobs=torch.empty(0) if tail else None,
        )
    has_kl = top_k > 0 or prepared.rollout_logprobs is not None
    signal = torch.empty(0) if has_kl else None
    return ScoredSample(
        sample=prepared.sample,
        index=prepared.index,
        teacher=prepared.teacher,
        teacher_logprobs=torch.empty(0),
        reverse_kl=signal if divergence == "reverse_kl" else None,
        candidates=cands,
        attempts=0,
        latency_s=time.monotonic() - admitted_at,
        alignment=empty_alignment() if aligned else None,
        signal=signal,
        divergence=divergence,
    )


def _score_batch(
    items: Sequence[Fetched],
    top_k: int,
    strategy: Strategy,
    weight_mode: WeightMode,
    device: torch.device,
    tail: bool = False,
    signal: _Signal = _REVERSE_KL,
    candidates: bool = True,
) -> list[ScoredSample | tuple[Fetched, MissingLogprobError]]:
    if top_k == 0:
        return [_score_sampled(f) for f in items]  # (sampled-token: reverse_kl only)
    failed: dict[int, MissingLogprobError] = {}
    scored: dict[int, ScoredSample] = {}
    todo = list(items)
    while todo:
        joined = _joined_batch(todo, strategy, device)
        try:
            res = topk_divergence(
                joined,
                strategy,
                weight_mode,
                divergence=signal.divergence,
                jsd_beta=signal.jsd_beta,
                tail=tail,
            )
        except MissingLogprobError as exc:
            f, err = _locate(todo, exc)
            failed[f.prepared.index] = err
            todo = [g for g in todo if g is not f]
            continue
        # One device-to-host copy per array, then each sample's rows, as its own copy
        # (a batch of one sample: the arrays themselves where they are its alone). Without
        # candidates, the signal alone.
        on_host = device.type == "cpu"
        wanted = res[:6] if candidates else res[:1]
        rkl, *per_candidate = (x[0] if on_host else x[0].cpu() for x in wanted)
        tails = [
            None if x is None else (x[0] if on_host else x[0].cpu())
            for x in (res[6:] if candidates else ())
        ]
        own = _Owner(joined) if len(todo) == 1 else _own_rows
        row = 0
        for f in todo:
            end = row + f.prepared.response_length
            cands = None
            if candidates:
                ids, s_lp, t_lp, weights, mask = (own(a, row, end) for a in per_candidate)
                s_tail, t_tail = (None if a is None else own(a, row, end) for a in tails)
                cands = Candidates(
                    ids=ids,
                    student_logprobs=s_lp,
                    teacher_logprobs=t_lp,
                    weights=weights,
                    mask=mask,
                    student_tail_logprobs=s_tail,
                    teacher_tail_logprobs=t_tail,
                )
            scored[f.prepared.index] = _result(f, own(rkl, row, end), cands, signal.divergence)
            row = end
        break
    out: list[ScoredSample | tuple[Fetched, MissingLogprobError]] = []
    for f in items:
        idx = f.prepared.index
        out.append((f, failed[idx]) if idx in failed else scored[idx])
    return out


def _locate(
    todo: Sequence[Fetched], exc: MissingLogprobError
) -> tuple[Fetched, MissingLogprobError]:
    """The sample of a batch-wide error (its position is a row of the joined batch) and the
    error as that sample's: its response position, its index among ``todo``."""
    starts = [0]
    for f in todo:
        starts.append(starts[-1] + f.prepared.response_length)
    # The last sample starting at or before the row (samples with R = 0 own no rows).
    j = bisect.bisect_right(starts, exc.position) - 1
    err = MissingLogprobError(exc.side, exc.token_id, exc.position - starts[j], j)
    return todo[j], err
