"""Test helper: per-sample arrays padded into one :class:`~opd_stream.kl._math.TopKBatch`.

The library scores batches joined without padding (``_klstage``); the KL tests build padded
batches with these, to check that padding positions are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from opd_stream.kl._tensors import TopKBatch


def pad_batch(
    arrays: Sequence[np.ndarray],
    *,
    device: torch.device | str = "cpu",
    fill: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Pad per-sample arrays of different lengths into one batch tensor on ``device``.

    Args:
        arrays: ``B >= 1`` arrays, each ``[R_i]`` or ``[R_i, K]`` (same trailing shape and
            dtype kind).  Integer arrays become int64, float arrays float32.
        device: Where the result lives (one host-to-device copy for the whole batch).
        fill: Value of the padding slots; default ``-1`` for ids, ``0.0`` for logprobs.

    Returns:
        ``(padded [B, Rmax, ...], valid [B, Rmax] bool)``; ``valid[i, t]`` is ``t < R_i``.

    Raises:
        ValueError: ``arrays`` is empty, or the trailing shapes or dtype kinds differ.
    """
    if not arrays:
        raise ValueError("pad_batch needs at least one array")
    trailing = {a.shape[1:] for a in arrays}
    if len(trailing) != 1:
        raise ValueError(f"pad_batch: trailing shapes differ: {sorted(trailing)}")
    kinds = {a.dtype.kind for a in arrays}
    if kinds <= {"i", "u"}:
        dtype: type[np.generic] = np.int64
        default_fill: float = -1
    elif kinds == {"f"}:
        dtype = np.float32
        default_fill = 0.0
    else:
        raise ValueError(f"pad_batch: expected all-integer or all-float arrays, got {kinds}")
    lengths = [a.shape[0] for a in arrays]
    r_max = max(lengths)
    out = np.full(
        (len(arrays), r_max, *trailing.pop()),
        default_fill if fill is None else fill,
        dtype=dtype,
    )
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    valid = np.arange(r_max)[None, :] < np.asarray(lengths)[:, None]
    return torch.from_numpy(out).to(device), torch.from_numpy(valid).to(device)


def pad_topk_batch(
    *,
    student_ids: Sequence[np.ndarray] | None = None,
    student_lp: Sequence[np.ndarray] | None = None,
    teacher_on_student: Sequence[np.ndarray] | None = None,
    teacher_ids: Sequence[np.ndarray] | None = None,
    teacher_lp: Sequence[np.ndarray] | None = None,
    student_on_teacher: Sequence[np.ndarray] | None = None,
    device: torch.device | str = "cpu",
) -> TopKBatch:
    """Build a :class:`TopKBatch` from per-sample ``[R_i, K]`` arrays (see :func:`pad_batch`).

    Every given field must hold one array per sample, and the response lengths ``R_i`` must
    agree across fields.  Padding: ids ``-1``, logprobs ``0.0``.

    Raises:
        ValueError: No field given, or the sample counts or lengths disagree.
    """
    given = {
        "student_ids": student_ids,
        "student_lp": student_lp,
        "teacher_on_student": teacher_on_student,
        "teacher_ids": teacher_ids,
        "teacher_lp": teacher_lp,
        "student_on_teacher": student_on_teacher,
    }
    present = {k: v for k, v in given.items() if v is not None}
    if not present:
        raise ValueError("pad_topk_batch needs at least one field")
    lengths = {k: tuple(a.shape[0] for a in v) for k, v in present.items()}
    if len(set(lengths.values())) != 1:
        counts = ", ".join(f"{k}: {len(v)} samples" for k, v in lengths.items())
        raise ValueError(f"pad_topk_batch: sample counts or lengths disagree ({counts})")
    padded: dict[str, Tensor | None] = dict.fromkeys(TopKBatch._fields[:-1])
    valid: Tensor | None = None
    for k, v in present.items():
        padded[k], valid = pad_batch(v, device=device)
    assert valid is not None
    return TopKBatch(valid=valid, **padded)
