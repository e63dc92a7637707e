"""The KL stage's synchronous core: a batch of fetched samples in, scored samples out.

Runs in a worker thread (torch releases the GIL in its kernels). Samples are padded to
``[B, R_max, K]`` on the configured device, scored by ``_kl``, and sliced back into
per-sample CPU tensors.

On CPU the batch is scored with one intra-op thread: the KL kernels are small and many, and
torch's OpenMP pool spends far more CPU spinning at their barriers than it saves (measured
on 2 cores, ``[32, 1024, 16]`` only-student: 22 ms CPU with one thread, 260 ms with two).
With torch's OpenMP backend the thread count is a per-thread setting, so this touches only
the KL worker thread, and it is restored afterwards.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ._errors import MissingLogprobError
from ._kl import (
    Strategy,
    TopKBatch,
    WeightMode,
    pad_topk_batch,
    sampled_reverse_kl,
    topk_reverse_kl,
)
from ._sample import Candidates, ScoredSample
from ._scorer import Fetched

__all__ = ("score_batch",)


def _topk_batch(items: Sequence[Fetched], device: torch.device) -> TopKBatch:
    """Pad the batch's per-sample ``[R_i, K]`` arrays (a field is left out when a sample
    lacks it: all samples of a stream share one request plan)."""

    def field(arrays: list[npt.NDArray[Any] | None]) -> list[npt.NDArray[Any]] | None:
        return None if any(a is None for a in arrays) else arrays  # type: ignore[return-value]

    return pad_topk_batch(
        student_ids=field([f.student_ids for f in items]),
        student_lp=field([f.student_lps for f in items]),
        teacher_on_student=field([f.teacher_rows.id_logprobs for f in items]),
        teacher_ids=field([f.teacher_rows.top_ids for f in items]),
        teacher_lp=field([f.teacher_rows.top_logprobs for f in items]),
        student_on_teacher=field(
            [f.student_rows.id_logprobs if f.student_rows is not None else None for f in items]
        ),
        device=device,
    )


def _result(
    f: Fetched, reverse_kl: torch.Tensor | None, candidates: Candidates | None
) -> ScoredSample:
    p = f.prepared
    return ScoredSample(
        sample=p.sample,
        index=p.index,
        teacher=p.teacher,
        teacher_logprobs=torch.from_numpy(np.ascontiguousarray(f.teacher_rows.token_logprobs)),
        reverse_kl=reverse_kl,
        candidates=candidates,
        attempts=f.attempts,
        latency_s=time.monotonic() - f.admitted_at,
    )


def _score_sampled(f: Fetched) -> ScoredSample:
    rollout = f.prepared.rollout_logprobs
    rkl = None
    if rollout is not None:
        rkl = sampled_reverse_kl(
            torch.from_numpy(rollout), torch.from_numpy(f.teacher_rows.token_logprobs)
        )
    return _result(f, rkl, None)


_PER_THREAD_POOL = "parallel backend: OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def _one_intraop_thread(device: torch.device) -> Iterator[None]:
    """Run the block with one torch intra-op thread (CPU, OpenMP backend only)."""
    prev = torch.get_num_threads()
    if device.type != "cpu" or prev == 1 or not _PER_THREAD_POOL:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def score_batch(
    items: Sequence[Fetched],
    *,
    top_k: int,
    strategy: Strategy,
    weight_mode: WeightMode,
    device: torch.device,
) -> list[ScoredSample | tuple[Fetched, MissingLogprobError]]:
    """Score fetched samples; a sample with a missing logprob comes back as its error.

    The output has one entry per input, in input order.
    """
    with _one_intraop_thread(device):
        return _score_batch(items, top_k, strategy, weight_mode, device)


def _score_batch(
    items: Sequence[Fetched],
    top_k: int,
    strategy: Strategy,
    weight_mode: WeightMode,
    device: torch.device,
) -> list[ScoredSample | tuple[Fetched, MissingLogprobError]]:
    if top_k == 0:
        return [_score_sampled(f) for f in items]
    pending = list(items)
    failed: dict[int, MissingLogprobError] = {}
    scored: dict[int, ScoredSample] = {}
    while True:
        todo = [f for f in pending if f.prepared.index not in failed]
        if not todo:
            break
        try:
            res = topk_reverse_kl(_topk_batch(todo, device), strategy, weight_mode)
        except MissingLogprobError as exc:
            failed[todo[exc.batch_index].prepared.index] = exc
            continue
        for i, f in enumerate(todo):
            r = f.prepared.response_length
            cands = Candidates(
                ids=res.ids[i, :r].cpu().clone(),
                student_logprobs=res.student_lp[i, :r].cpu().clone(),
                teacher_logprobs=res.teacher_lp[i, :r].cpu().clone(),
                weights=res.weights[i, :r].cpu().clone(),
                mask=res.mask[i, :r].cpu().clone(),
            )
            scored[f.prepared.index] = _result(f, res.reverse_kl[i, :r].cpu().clone(), cands)
        break
    out: list[ScoredSample | tuple[Fetched, MissingLogprobError]] = []
    for f in items:
        idx = f.prepared.index
        out.append((f, failed[idx]) if idx in failed else scored[idx])
    return out
