"""Vectorised torch KL math: top-k candidate sets, weights, per-token reverse KL.

Semantics are spec ``opd-semantics`` §1-§3 (numerically compatible with the reference
Miles implementation); the tensor contract is ``docs/internals.md`` (``_kl.py``).

Two signal families:

* **Sampled-token** (:func:`sampled_reverse_kl`): ``r_t = rollout_lp[t] - teacher_lp[t]``.
* **Top-k** (:func:`topk_reverse_kl`): per response position a candidate set ``sel(t)`` is
  chosen from the student top-k ``S`` and the teacher top-k ``T`` by a :data:`Strategy`, each
  candidate gets a weight by a :data:`WeightMode`, and
  ``r_t = sum_{v in sel(t)} w(v) * (s(v) - t(v))``.  Besides ``r_t`` the per-candidate arrays
  (ids, student and teacher logprobs, weights, mask) are returned, so a trainer can use a
  candidate-level loss (``r_t`` alone depends only on the prefix).

The -inf floor:
    A logprob of ``-inf`` is a real value: SGLang serialises it as JSON ``null`` and it means
    probability 0.  Every logprob is clamped to :data:`LOGPROB_FLOOR` (``-1e4``) before any
    arithmetic.  With the floor every weight and every log-ratio stays finite, so no NaN can
    arise (``-inf - -inf`` becomes ``0``, ``exp(-1e4)`` is exactly ``0.0`` in float32, and a
    softmax over floored values is well defined).  Finite values above the floor are never
    changed; finite values below it (which no real model produces) are clamped too.  The
    per-candidate logprobs in :class:`TopKResult` are the floored values.

NaN means "missing":
    NaN never leaves this module.  A NaN in a *selected* candidate's student or teacher value
    raises :class:`~opd_stream._errors.MissingLogprobError` naming the side, the token id, the
    response position and the batch index of the first offender (in batch, position, candidate
    order).  A NaN in a slot that is not used (a padding position, an unselected candidate, or
    ``teacher_on_student`` for an id of ``S`` that is also in ``T`` when ``T``'s value is used)
    is ignored.  Finding an offender costs one device-to-host sync per call, never one per
    position.

Devices:
    Everything is computed on the device the input tensors are on (CPU or CUDA); the inputs of
    one call must share a device.  Nothing is moved to the host except the single boolean of
    the NaN check (and, only when it fails, the offender's coordinates).

Membership of ``S`` ids in ``T`` (and back) is decided per row either with a broadcast
equality ``[rows, Ks, Kt]`` (small k; chunked over rows so that at most
``2**22`` booleans exist at once) or, for k >= 16, by sorting ``T`` and a batched
``searchsorted`` of the ``S`` ids (faster on CPU from k = 16 on, see ``_BROADCAST_MAX_K``).

Input conventions: ids are int64 (a negative id marks an empty slot, never selected); ids
within one row of ``S`` (or ``T``) are distinct, as SGLang's top-k always is.  ``S`` and ``T``
may have different widths ``Ks`` and ``Kt``; with the usual ``Ks == Kt == K`` the candidate
axis is ``C = K`` or ``2K`` as in ``docs/internals.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple, get_args

import numpy as np
import torch
from torch import Tensor

from ._errors import MissingLogprobError

__all__ = (
    "LOGPROB_FLOOR",
    "STRATEGIES",
    "Strategy",
    "TopKBatch",
    "TopKResult",
    "WEIGHT_MODES",
    "WeightMode",
    "needed_inputs",
    "pad_batch",
    "pad_topk_batch",
    "sampled_reverse_kl",
    "topk_reverse_kl",
)

LOGPROB_FLOOR = -1e4
"""Every logprob (``-inf`` included) is clamped to at least this before any arithmetic."""

Strategy = Literal["only-student", "only-teacher", "intersection", "union", "xor"]
"""How the candidate set is chosen (spec §2)."""

WeightMode = Literal["student_p", "teacher_p", "none"]
"""How candidates are weighted (spec §3)."""

STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
WEIGHT_MODES: tuple[WeightMode, ...] = get_args(WeightMode)

_FIELDS = (
    "student_ids",
    "student_lp",
    "teacher_on_student",
    "teacher_ids",
    "teacher_lp",
    "student_on_teacher",
)
_NEEDED: dict[str, frozenset[str]] = {
    "only-student": frozenset({"student_ids", "student_lp", "teacher_on_student"}),
    "only-teacher": frozenset({"teacher_ids", "teacher_lp", "student_on_teacher"}),
    "intersection": frozenset({"student_ids", "student_lp", "teacher_ids", "teacher_lp"}),
    "union": frozenset(_FIELDS),
    "xor": frozenset(_FIELDS),
}

# Membership: broadcast equality below this k, sort + searchsorted from it on.  perf-facts §3
# puts the crossover at 32 for its variants; with one sort (of T only) the sorted path here
# wins from k = 16 on (CPU, R = 4096: k=16 5.0 vs 6.5 ms, k=32 12.7 vs 22 ms, 1 thread).
_BROADCAST_MAX_K = 16
# At most this many booleans in one broadcast equality chunk.
_EQ_CHUNK_ELEMENTS = 1 << 22


class TopKBatch(NamedTuple):
    """The inputs of :func:`topk_reverse_kl` for a padded batch of samples.

    Every tensor is ``[B, R, K]`` (``R`` = the longest response in the batch) on one device;
    a field a strategy does not need (see :func:`needed_inputs`) may be ``None``.  Student
    fields have width ``Ks``, teacher fields ``Kt`` (normally equal).  Values at padding
    positions (``valid`` False) are ignored, whatever they are.

    Attributes:
        student_ids: int64, ``S``: the student top-k ids, best first.
        student_lp: float32, student logprob of each ``S`` id (from the student's own top-k).
        teacher_on_student: float32, teacher logprob of each ``S`` id (the teacher scored ``S``).
        teacher_ids: int64, ``T``: the teacher top-k ids, best first.
        teacher_lp: float32, teacher logprob of each ``T`` id.
        student_on_teacher: float32, student logprob of each ``T`` id (the student scored ``T``).
        valid: bool ``[B, R]``; False on padding positions.
    """

    student_ids: Tensor | None
    student_lp: Tensor | None
    teacher_on_student: Tensor | None
    teacher_ids: Tensor | None
    teacher_lp: Tensor | None
    student_on_teacher: Tensor | None
    valid: Tensor


class TopKResult(NamedTuple):
    """The output of :func:`topk_reverse_kl`.

    The candidate axis ``C`` is ``Ks`` (only-student, intersection), ``Kt`` (only-teacher) or
    ``Ks + Kt`` (union, xor).  The selected candidates of a position are packed to the front
    of the ``C`` axis in the spec order; the remaining slots hold id ``-1``, logprobs ``0``,
    weight ``0`` and mask False.  Padding positions have no selected candidate.

    Attributes:
        reverse_kl: float32 ``[B, R]``: ``r_t``; 0 where nothing is selected or on padding.
        ids: int64 ``[B, R, C]``: candidate token ids.
        student_lp: float32 ``[B, R, C]``: student logprob of each candidate (floored).
        teacher_lp: float32 ``[B, R, C]``: teacher logprob of each candidate (floored).
        weights: float32 ``[B, R, C]``: the candidate weights ``w(v)``.
        mask: bool ``[B, R, C]``: True on selected candidates.
    """

    reverse_kl: Tensor
    ids: Tensor
    student_lp: Tensor
    teacher_lp: Tensor
    weights: Tensor
    mask: Tensor


def needed_inputs(strategy: Strategy) -> frozenset[str]:
    """Name the :class:`TopKBatch` fields that ``strategy`` reads (besides ``valid``).

    Args:
        strategy: One of :data:`STRATEGIES`.

    Returns:
        only-student: ``student_ids``, ``student_lp``, ``teacher_on_student``;
        only-teacher: ``teacher_ids``, ``teacher_lp``, ``student_on_teacher``;
        intersection: ``student_ids``, ``student_lp``, ``teacher_ids``, ``teacher_lp``;
        union and xor: all six.

    Raises:
        ValueError: ``strategy`` is not one of :data:`STRATEGIES`.
    """
    try:
        return _NEEDED[strategy]
    except KeyError:
        raise ValueError(
            f"unknown top-k strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}"
        ) from None


# --------------------------------------------------------------------------- sampled-token


def sampled_reverse_kl(
    rollout_lp: Tensor,
    teacher_lp: Tensor,
    *,
    valid: Tensor | None = None,
    token_ids: Tensor | None = None,
) -> Tensor:
    """Sampled-token reverse-KL estimate: ``rollout_lp - teacher_lp`` per token.

    Both sides are floored at :data:`LOGPROB_FLOOR` first, so ``-inf`` never yields NaN
    (``-inf - -inf`` gives ``0``).  Computed on the inputs' device.

    Args:
        rollout_lp: Float ``[R]`` or ``[B, R]``: the rollout (student) logprob of each sampled
            token.
        teacher_lp: Same shape: the teacher logprob of the same tokens.
        valid: Optional bool mask of the same shape; False marks padding, whose output is 0
            and whose inputs are ignored (NaN included).
        token_ids: Optional int64 tensor of the same shape, only used to name the token in a
            :class:`MissingLogprobError` (``-1`` is reported without it).

    Returns:
        float32 tensor of the input shape.

    Raises:
        ValueError: The shapes differ.
        MissingLogprobError: A (valid) input is NaN: the first offender in row-major order;
            ``side`` is ``"student"`` when ``rollout_lp`` is NaN there, else ``"teacher"``.
    """
    if rollout_lp.shape != teacher_lp.shape:
        raise ValueError(
            f"rollout_lp shape {tuple(rollout_lp.shape)} != teacher_lp shape "
            f"{tuple(teacher_lp.shape)}"
        )
    for name, other in (("valid", valid), ("token_ids", token_ids)):
        if other is not None and other.shape != rollout_lp.shape:
            raise ValueError(
                f"{name} shape {tuple(other.shape)} != logprob shape {tuple(rollout_lp.shape)}"
            )
    s = rollout_lp.to(torch.float32)
    t = teacher_lp.to(torch.float32)
    s_nan = torch.isnan(s)
    t_nan = torch.isnan(t)
    bad = s_nan | t_nan
    if valid is not None:
        bad &= valid
    if bool(bad.any()):
        first = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
        side = "student" if bool(s_nan[first]) else "teacher"
        token_id = -1 if token_ids is None else int(token_ids[first])
        batch_index = first[0] if len(first) >= 2 else 0
        position = first[-1] if first else 0
        raise MissingLogprobError(side, token_id, position, batch_index)
    kl = s.clamp_min(LOGPROB_FLOOR) - t.clamp_min(LOGPROB_FLOOR)
    if valid is not None:
        kl = torch.where(valid, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    return kl


# --------------------------------------------------------------------------------- top-k


def topk_reverse_kl(batch: TopKBatch, strategy: Strategy, weight_mode: WeightMode) -> TopKResult:
    """Select candidates, weight them and reduce to the per-token reverse KL (spec §2-§3).

    Selected ids, in order: only-student ``S``; only-teacher ``T``; intersection the ids of
    ``S`` in ``T`` (``S`` order); union ``S`` then ``T \\ S``; xor ``S \\ T`` then ``T \\ S``.
    A candidate's student value comes from ``student_lp`` when its id is in ``S`` (and the
    strategy reads ``S``), else from ``student_on_teacher``; its teacher value comes from
    ``teacher_lp`` when its id is in ``T`` (and the strategy reads ``T``), else from
    ``teacher_on_student``.

    Weights: ``student_p`` / ``teacher_p`` are the softmax over the selected set of the
    (floored) student / teacher values, ``none`` is ``1/|sel|``; for xor they are NOT
    normalised: ``exp(s)``, ``exp(t)`` and ``1``.  An empty selected set gives ``r_t = 0``;
    ``R = 0`` gives empty tensors.  No Python loop over positions and no per-position sync.

    Args:
        batch: The padded inputs; the fields :func:`needed_inputs` names must be set.
        strategy: One of :data:`STRATEGIES`.
        weight_mode: One of :data:`WEIGHT_MODES`.

    Returns:
        A :class:`TopKResult` on the inputs' device.

    Raises:
        ValueError: Unknown strategy or weight mode, a needed field is None, or the shapes
            or devices do not agree.
        MissingLogprobError: A selected candidate's student or teacher value is NaN.
    """
    needed = needed_inputs(strategy)
    if weight_mode not in WEIGHT_MODES:
        raise ValueError(
            f"unknown weight mode {weight_mode!r}; expected one of {', '.join(WEIGHT_MODES)}"
        )
    fields = _checked_fields(batch, strategy, needed)
    valid = batch.valid
    b, r = valid.shape
    n = b * r
    row_valid = valid.reshape(n, 1)

    def flat(name: str, dtype: torch.dtype) -> Tensor:
        x = fields[name]
        return x.reshape(n, x.shape[-1]).to(dtype)

    f32, i64 = torch.float32, torch.int64
    if strategy == "only-student":
        ids = flat("student_ids", i64)
        s_val = flat("student_lp", f32)
        t_val = flat("teacher_on_student", f32)
        sel = row_valid & (ids >= 0)
    elif strategy == "only-teacher":
        ids = flat("teacher_ids", i64)
        s_val = flat("student_on_teacher", f32)
        t_val = flat("teacher_lp", f32)
        sel = row_valid & (ids >= 0)
    else:
        s_ids = flat("student_ids", i64)
        t_ids = flat("teacher_ids", i64)
        s_in_t, s_match, t_in_s = _membership(s_ids, t_ids)
        student_lp = flat("student_lp", f32)
        teacher_lp = flat("teacher_lp", f32)
        # Teacher value of each S id from T's source (meaningful where s_in_t).
        t_of_s = teacher_lp.gather(1, s_match)
        if strategy == "intersection":
            ids, s_val, t_val = s_ids, student_lp, t_of_s
            sel = row_valid & s_in_t
        else:
            s_has = row_valid & (s_ids >= 0)
            t_has = row_valid & (t_ids >= 0)
            ids = torch.cat((s_ids, t_ids), dim=1)
            s_val = torch.cat((student_lp, flat("student_on_teacher", f32)), dim=1)
            if strategy == "union":
                t_first = torch.where(s_in_t, t_of_s, flat("teacher_on_student", f32))
                sel = torch.cat((s_has, t_has & ~t_in_s), dim=1)
            else:  # xor
                t_first = flat("teacher_on_student", f32)
                sel = torch.cat((s_has & ~s_in_t, t_has & ~t_in_s), dim=1)
            t_val = torch.cat((t_first, teacher_lp), dim=1)

    ids, s_val, t_val, mask, count = _pack_front(sel, ids, s_val, t_val)
    _raise_on_missing(mask, ids, s_val, t_val, r)

    zero = torch.zeros((), dtype=f32, device=ids.device)
    s_val = torch.where(mask, s_val.clamp_min(LOGPROB_FLOOR), zero)
    t_val = torch.where(mask, t_val.clamp_min(LOGPROB_FLOOR), zero)
    ids = torch.where(mask, ids, torch.full((), -1, dtype=i64, device=ids.device))
    weights = _weights(strategy, weight_mode, s_val, t_val, mask, count)
    reverse_kl = (weights * (s_val - t_val)).sum(dim=1)

    c = ids.shape[1]
    return TopKResult(
        reverse_kl=reverse_kl.reshape(b, r),
        ids=ids.reshape(b, r, c),
        student_lp=s_val.reshape(b, r, c),
        teacher_lp=t_val.reshape(b, r, c),
        weights=weights.reshape(b, r, c),
        mask=mask.reshape(b, r, c),
    )


def _checked_fields(batch: TopKBatch, strategy: str, needed: frozenset[str]) -> dict[str, Tensor]:
    """Return the needed fields by name after checking presence, shapes, dtypes and devices."""
    valid = batch.valid
    if valid.dtype != torch.bool or valid.dim() != 2:
        raise ValueError(
            f"valid must be a bool [B, R] tensor, got {valid.dtype} of shape {tuple(valid.shape)}"
        )
    fields: dict[str, Tensor] = {}
    for name in _FIELDS:
        if name not in needed:
            continue
        x = getattr(batch, name)
        if x is None:
            raise ValueError(
                f"strategy {strategy!r} needs TopKBatch.{name}, which is None "
                f"(it needs {', '.join(f for f in _FIELDS if f in needed)})"
            )
        if x.dim() != 3 or tuple(x.shape[:2]) != tuple(valid.shape):
            raise ValueError(
                f"TopKBatch.{name} has shape {tuple(x.shape)}; expected "
                f"[{valid.shape[0]}, {valid.shape[1]}, K] to match valid"
            )
        if x.device != valid.device:
            raise ValueError(f"TopKBatch.{name} is on {x.device}, valid on {valid.device}")
        is_ids = name.endswith("_ids")
        if is_ids and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
            raise ValueError(f"TopKBatch.{name} must hold integer ids, got {x.dtype}")
        if not is_ids and not x.dtype.is_floating_point:
            raise ValueError(f"TopKBatch.{name} must hold float logprobs, got {x.dtype}")
        fields[name] = x
    for ids_name, partners in (
        ("student_ids", ("student_lp", "teacher_on_student")),
        ("teacher_ids", ("teacher_lp", "student_on_teacher")),
    ):
        present = [f for f in (ids_name, *partners) if f in fields]
        widths = {fields[f].shape[-1] for f in present}
        if len(widths) > 1:
            shapes = ", ".join(f"{f}={tuple(fields[f].shape)}" for f in present)
            raise ValueError(f"top-k widths disagree: {shapes}")
    return fields


def _membership(s_ids: Tensor, t_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: which S ids are in T (and at which T column), which T ids are in S.

    Args:
        s_ids: int64 ``[N, Ks]``, distinct per row apart from negative (empty) slots.
        t_ids: int64 ``[N, Kt]``, likewise.

    Returns:
        ``(s_in_t [N, Ks] bool, s_match [N, Ks] int64, t_in_s [N, Kt] bool)``; ``s_match`` is
        the T column holding the same id where ``s_in_t``, some column in ``[0, Kt)``
        elsewhere.  Negative ids are never members.
    """
    n, ks = s_ids.shape
    kt = t_ids.shape[1]
    if n == 0 or ks == 0 or kt == 0:
        return (
            torch.zeros_like(s_ids, dtype=torch.bool),
            torch.zeros_like(s_ids),
            torch.zeros_like(t_ids, dtype=torch.bool),
        )
    if max(ks, kt) >= _BROADCAST_MAX_K:
        s_in_t, s_match = _find_sorted(s_ids, t_ids)
    else:
        rows_per_chunk = max(1, _EQ_CHUNK_ELEMENTS // (ks * kt))
        parts = [
            _find_broadcast(s_ids[i : i + rows_per_chunk], t_ids[i : i + rows_per_chunk])
            for i in range(0, n, rows_per_chunk)
        ]
        s_in_t = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        s_match = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
    # T ids in S are exactly the matched T columns (ids are distinct within a row): scatter
    # True to them; unmatched S slots write False to an extra column that is dropped.
    target = torch.where(s_in_t, s_match, kt)
    t_in_s = torch.zeros((n, kt + 1), dtype=torch.bool, device=s_ids.device)
    t_in_s.scatter_(1, target, s_in_t)
    return s_in_t, s_match, t_in_s[:, :kt]


def _find_broadcast(s_ids: Tensor, t_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Broadcast equality ``[rows, Ks, Kt]``: S membership in T and the matching T column."""
    eq = (s_ids.unsqueeze(2) == t_ids.unsqueeze(1)) & (s_ids >= 0).unsqueeze(2)
    return eq.any(dim=2), eq.view(torch.uint8).argmax(dim=2)


def _find_sorted(s_ids: Tensor, t_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Sort T per row, then batched ``searchsorted`` of the S ids."""
    t_sorted, t_perm = torch.sort(t_ids, dim=1)
    col = torch.searchsorted(t_sorted, s_ids.contiguous())
    col = col.clamp_max(t_ids.shape[1] - 1)
    s_in_t = (t_sorted.gather(1, col) == s_ids) & (s_ids >= 0)
    return s_in_t, t_perm.gather(1, col)


def _pack_front(
    sel: Tensor, ids: Tensor, s_val: Tensor, t_val: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Stably move the selected columns of each row to the front.

    Returns the permuted ``ids``, ``s_val``, ``t_val``, the packed mask and the per-row count
    ``[N, 1]`` of selected candidates.  Unselected slots still hold their (unused) values.
    """
    c = sel.shape[1]
    cols = torch.arange(c, device=sel.device)
    csum = sel.cumsum(dim=1)
    count = sel.sum(dim=1, keepdim=True)
    # Selected column j goes to csum[j] - 1; unselected ones follow, in order.
    dest = torch.where(sel, csum - 1, count + cols - csum)
    source = torch.empty_like(dest).scatter_(1, dest, cols.expand_as(dest))
    mask = cols < count
    return ids.gather(1, source), s_val.gather(1, source), t_val.gather(1, source), mask, count


def _raise_on_missing(mask: Tensor, ids: Tensor, s_val: Tensor, t_val: Tensor, r: int) -> None:
    """Raise MissingLogprobError for the first selected candidate with a NaN value."""
    # NaN + x is NaN for every x; logprobs are never +inf, so the sum has no false alarm.
    bad = torch.isnan(s_val + t_val) & mask
    if not bool(bad.any()):
        return
    row, col = (int(i) for i in torch.nonzero(bad)[0].tolist())
    side = "student" if bool(torch.isnan(s_val[row, col])) else "teacher"
    raise MissingLogprobError(side, int(ids[row, col]), row % r, row // r)


def _weights(
    strategy: str, weight_mode: str, s_val: Tensor, t_val: Tensor, mask: Tensor, count: Tensor
) -> Tensor:
    """Candidate weights (spec §3) from floored values; 0 where ``mask`` is False."""
    zero = torch.zeros((), dtype=s_val.dtype, device=s_val.device)
    if weight_mode == "none":
        if strategy == "xor":
            return mask.to(s_val.dtype)
        per_row = 1.0 / count.clamp_min(1).to(s_val.dtype)
        return torch.where(mask, per_row, zero)
    x = s_val if weight_mode == "student_p" else t_val
    if strategy == "xor":
        return torch.where(mask, torch.exp(x), zero)
    neg_inf = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    row_max = torch.where(mask, x, neg_inf).amax(dim=1, keepdim=True)
    row_max = torch.where(count > 0, row_max, zero)
    e = torch.where(mask, torch.exp(x - row_max), zero)
    total = e.sum(dim=1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


# ------------------------------------------------------------------------------- padding


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
    padded: dict[str, Tensor | None] = dict.fromkeys(_FIELDS)
    valid: Tensor | None = None
    for k, v in present.items():
        padded[k], valid = pad_batch(v, device=device)
    assert valid is not None
    return TopKBatch(valid=valid, **padded)
