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
    is ignored.  Unselected slots are cleared before any arithmetic, so a selected NaN is the
    only way ``r_t`` can become NaN: one reduction over ``r`` finds out, and only then is the
    offender looked for.

Devices:
    The math is computed on the device the input tensors are on (CPU or CUDA); the inputs of
    one call must share a device.  What reaches the host is a few scalars per call, never one
    per position: whether every position is valid, whether some id is empty (only-*) or the
    id range (intersection, union, xor), whether some row selects nothing, the NaN check
    (and, only when it fails, the offender's coordinates).

Precision and batch invariance:
    Everything is float32, like the results (as the reference checks show, the error against
    a float64 computation is ~1e-6, far inside the 1e-5 tolerances; float64 would double the
    memory traffic of every pass).  Every reduction is per row (softmax, ``sum(dim=1)``; not
    BLAS, whose rounding of a row depends on the row count), so on CPU a position's results
    do not depend on the other positions or samples in the batch, bit for bit (CUDA kernels
    may pick another reduction order for another shape).

How candidates are selected (no Python loop over positions):
    Every selected candidate of a position is one column of the joined row ``[S | T]``, and
    the spec order is column order.  So the output is a stable sort of the row's columns on
    ``(unselected, column)``; the sort key carries in its low bits the column to read the
    teacher value from (a ``T`` column for an ``S`` id that is also in ``T``), and one gather
    per output array then reads ids and values.  Unselected slots are cleared with bit masks
    (id ``-1``, value ``+0.0``), which also drops any NaN there.  Membership of an ``S`` id in
    ``T`` comes from a row sort of packed ``(id, column)`` keys, where an id in both sets sorts
    as a pair ``S`` then ``T`` (ids are distinct within ``S`` and within ``T``); below
    ``_BROADCAST_MAX_K``, or for ids too large to pack (>= ``2**(63 - bits(Ks + Kt))``), from a
    broadcast equality ``[rows, Ks, Kt]`` chunked so that at most ``2**22`` booleans exist at
    once.  This index work is integer-only; on CPU it runs on numpy views of the tensors
    (numpy's row sort is SIMD, and its integer/bool kernels are several times faster than
    torch's on one thread), on other devices as the same code on torch tensors.
    The float math is torch on every device, in float32 (as the results).

Input conventions: ids are int64 (a negative id marks an empty slot, never selected); ids
within one row of ``S`` (or ``T``) are distinct, as SGLang's top-k always is.  ``S`` and ``T``
may have different widths ``Ks`` and ``Kt``; with the usual ``Ks == Kt == K`` the candidate
axis is ``C = K`` or ``2K`` as in ``docs/internals.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, get_args

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

# Membership: broadcast equality below this k, sorted packed keys from it on.  The row sort
# wins from k = 2 on (numpy, N = 8192 rows, 1 thread: k=2 0.6 vs 1.3 ms, k=8 1.6 vs 4.8 ms,
# k=16 3.3 vs 11 ms); on CUDA both are a few kernels.
_BROADCAST_MAX_K = 2
# At most this many booleans in one broadcast equality chunk.
_EQ_CHUNK_ELEMENTS = 1 << 22
# Softmax basis of an unselected slot: exp(basis - row max) is exactly 0 in float32 whenever
# the row has a selected slot (floored logprobs are >= -1e4).
_UNSELECTED_BASIS = -1e30
_UNSELECTED_BITS = int(np.array(_UNSELECTED_BASIS, dtype=np.float32).view(np.int32))


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
    The returned tensors never share memory with the inputs.

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
    # None: every position is valid (the common case, and always so in the KL stage).
    row_valid = None if n == 0 or bool(valid.all()) else valid.reshape(n)

    # (Indexing, not reshape, when B == 1, and no .to() when the dtype is right: each torch
    # call releases the GIL, and in the pipeline getting it back can take a while.)
    def flat(name: str, dtype: torch.dtype) -> Tensor:
        x = fields[name]
        x = x[0] if b == 1 else x.reshape(n, x.shape[-1])
        return x if x.dtype == dtype else x.to(dtype)

    # Every base is [N, W], columns in the joined order [S | T] of the strategy (W = Ks for
    # only-student, Kt for only-teacher, Ks + Kt otherwise); a candidate is a base column.
    f32, i64 = torch.float32, torch.int64
    if strategy == "only-student":
        ks = fields["student_ids"].shape[-1]
        ids, s_base, t_base = (
            flat("student_ids", i64),
            flat("student_lp", f32),
            flat("teacher_on_student", f32),
        )
    elif strategy == "only-teacher":
        ks = fields["teacher_ids"].shape[-1]
        ids, s_base, t_base = (
            flat("teacher_ids", i64),
            flat("student_on_teacher", f32),
            flat("teacher_lp", f32),
        )
    else:
        ks = fields["student_ids"].shape[-1]
        ids = _joined(flat("student_ids", i64), flat("teacher_ids", i64))
        if strategy == "intersection":  # S's values from S's columns, T's from T's
            s_base = t_base = _joined(flat("student_lp", f32), flat("teacher_lp", f32))
        else:
            s_base = _joined(flat("student_lp", f32), flat("student_on_teacher", f32))
            t_base = _joined(flat("teacher_on_student", f32), flat("teacher_lp", f32))
    c = ks if strategy in ("only-student", "only-teacher", "intersection") else ids.shape[1]
    if n == 0 or c == 0:
        return _empty_result(b, r, c, ids.device)

    basis = weight_mode != "none" and strategy != "xor"
    plan = _plan(strategy, ids, ks, row_valid, basis)
    if plan is None:
        # Every slot is selected, in input order: nothing to move or clear.
        out_ids = ids.clone(memory_format=torch.contiguous_format)
        s_val = s_base.clamp_min(LOGPROB_FLOOR)
        t_val = t_base.clamp_min(LOGPROB_FLOOR)
        mask = torch.ones((n, c), dtype=torch.bool, device=ids.device)
    else:
        out_ids = _gather(ids, plan.src, c)
        s_val = _gather(s_base, plan.src, c)
        t_val = _gather(t_base, plan.tsrc, c)
        # Unselected slots: id -1, value +0.0 (all bits clear: any NaN there is gone too).
        _fill(out_ids, plan.unsel, -1)
        s_val.clamp_min_(LOGPROB_FLOOR).view(torch.int32).bitwise_and_(plan.keep)
        t_val.clamp_min_(LOGPROB_FLOOR).view(torch.int32).bitwise_and_(plan.keep)
        mask = plan.mask
    weights = _weights(strategy, weight_mode, s_val, t_val, plan)
    # (Not torch.mv with ones, which is faster on CPU: BLAS rounds a row differently
    # depending on the row count, so a sample's r_t would depend on its batch mates.)
    reverse_kl = torch.sub(s_val, t_val).mul_(weights).sum(dim=1)
    # NaN is now only possible in selected slots, and one there makes its row's r_t NaN
    # (d = s - t is NaN, and w * NaN is NaN for any weight); everything else is finite (no
    # logprob is +inf, -inf was floored), so one small reduction finds out.
    if bool(torch.isnan(reverse_kl.sum())):
        _raise_on_missing(out_ids, s_val, t_val, r)
    outputs = (reverse_kl, out_ids, s_val, t_val, weights, mask)
    if b == 1:
        return TopKResult(*(x[None] for x in outputs))
    return TopKResult(reverse_kl.reshape(b, r), *(x.reshape(b, r, c) for x in outputs[1:]))


def _empty_result(b: int, r: int, c: int, device: torch.device) -> TopKResult:
    def f32(*shape: int) -> Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=device)

    return TopKResult(
        reverse_kl=f32(b, r),
        ids=torch.full((b, r, c), -1, dtype=torch.int64, device=device),
        student_lp=f32(b, r, c),
        teacher_lp=f32(b, r, c),
        weights=f32(b, r, c),
        mask=torch.zeros((b, r, c), dtype=torch.bool, device=device),
    )


def _joined(a: Tensor, b: Tensor) -> Tensor:
    """``torch.cat((a, b), dim=1)``, without a copy when ``b``'s columns follow ``a``'s in
    memory (the KL stage lays its batch out that way)."""
    n, ka = a.shape
    w = ka + b.shape[1]
    if (
        n > 0
        and a.dtype == b.dtype
        and a.device == b.device
        and a.stride() == b.stride() == (w, 1)
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.storage_offset() == a.storage_offset() + ka
    ):
        return a.as_strided((n, w), (w, 1), a.storage_offset())
    return torch.cat((a, b), dim=1)


def _gather(base: Tensor, index: Tensor, c: int) -> Tensor:
    """``base.reshape(-1)[index]`` as a new ``[N, C]`` tensor."""
    return base.reshape(-1).index_select(0, index).view(-1, c)


def _fill(x: Tensor, where: Tensor, value: int) -> None:
    """``x[where] = value`` in place (numpy's putmask is several times faster on CPU)."""
    if x.device.type == "cpu":
        np.putmask(x.numpy(), where.numpy(), value)
    else:
        x.masked_fill_(where, value)


def _raise_on_missing(ids: Tensor, s_val: Tensor, t_val: Tensor, r: int) -> None:
    """Raise MissingLogprobError for the first selected candidate with a NaN value
    (unselected slots hold 0 by now), if there is one."""
    bad = torch.isnan(s_val) | torch.isnan(t_val)
    if not bool(bad.any()):
        return
    row, col = (int(i) for i in torch.nonzero(bad)[0].tolist())
    side = "student" if bool(torch.isnan(s_val[row, col])) else "teacher"
    raise MissingLogprobError(side, int(ids[row, col]), row % r, row // r)


def _weights(
    strategy: str, weight_mode: str, s_val: Tensor, t_val: Tensor, plan: _Plan | None
) -> Tensor:
    """Candidate weights (spec §3) from floored values; +0.0 where not selected."""
    n, c = s_val.shape
    if weight_mode == "none":
        if plan is None:
            return torch.full((n, c), 1.0 if strategy == "xor" else 1.0 / c, device=s_val.device)
        w = plan.mask.to(s_val.dtype)
        if strategy == "xor":
            return w
        return w.div_(w.sum(dim=1, keepdim=True).clamp_min_(1.0))
    x = s_val if weight_mode == "student_p" else t_val
    if plan is None:
        return torch.exp(x) if strategy == "xor" else torch.softmax(x, dim=1)
    if strategy == "xor":
        w = torch.exp(x)
    else:
        # Unselected slots (+0.0 in x) get a value far below any floored logprob: their exp
        # underflows to exactly 0 in every row that selects something.
        assert plan.basis is not None
        w = torch.softmax(x.view(torch.int32).bitwise_or(plan.basis).view(x.dtype), dim=1)
        if not plan.empty_rows:
            return w
    w.view(torch.int32).bitwise_and_(plan.keep)  # unselected (and empty rows) to +0.0
    return w


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


# ------------------------------------------------------------ candidate selection (indices)


class _Plan(NamedTuple):
    """Which base column each output slot reads: the packed selection of one batch.

    ``src`` / ``tsrc``: flat ``[N * C]`` indices into the row-major ``[N, W]`` bases of the
    slot's id and student value / of its teacher value; ``keep``: int32 ``[N, C]``, ``-1`` on
    selected slots and ``0`` elsewhere; ``mask`` / ``unsel``: bool ``[N, C]``, True on
    selected / on unselected slots; ``basis``: int32 ``[N, C]``, ``0`` on selected slots and
    the bits of ``_UNSELECTED_BASIS`` elsewhere, when asked for (OR-ed into the cleared
    values: the softmax's input), else None; ``empty_rows``: some row selects nothing.
    """

    src: Tensor
    tsrc: Tensor
    keep: Tensor
    mask: Tensor
    unsel: Tensor
    basis: Tensor | None
    empty_rows: bool


class _NumpyIndex:
    """The index work's array operations on numpy (CPU): numpy's row sort is SIMD and its
    integer and bool kernels are several times faster than torch's on one CPU thread."""

    i32: Any = np.int32
    i64: Any = np.int64
    f32: Any = np.float32
    b8: Any = np.bool_
    small_index = True  # int32 flat indices when they fit

    def asarray(self, x: Tensor) -> Any:
        return (x.detach() if x.requires_grad else x).numpy()

    def tensor(self, a: Any) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    def sort_rows(self, a: Any) -> Any:
        return np.sort(a, axis=1)

    def cat(self, parts: Sequence[Any]) -> Any:
        return np.concatenate(parts, axis=1)

    def cat_rows(self, parts: Sequence[Any]) -> Any:
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def clip_neg(self, a: Any) -> Any:
        return np.maximum(a, -1)

    def arange(self, start: int, stop: int, step: int, dtype: Any) -> Any:
        return np.arange(start, stop, step, dtype=dtype)

    def cast(self, a: Any, dtype: Any) -> Any:
        return a.astype(dtype)

    def zeros(self, shape: tuple[int, int], dtype: Any) -> Any:
        return np.zeros(shape, dtype=dtype)

    def any(self, a: Any, axis: int) -> Any:
        return a.any(axis=axis)

    def argmax(self, a: Any, axis: int) -> Any:
        return a.argmax(axis=axis)

    def minmax(self, a: Any) -> tuple[int, int]:
        return int(a.min()), int(a.max())

    def has(self, a: Any) -> bool:
        return bool(a.any())


class _TorchIndex:
    """The same operations on torch tensors (any device)."""

    i32: Any = torch.int32
    i64: Any = torch.int64
    f32: Any = torch.float32
    b8: Any = torch.bool
    small_index = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def asarray(self, x: Tensor) -> Any:
        return x

    def tensor(self, a: Any) -> Tensor:
        return a.contiguous()  # type: ignore[no-any-return]

    def sort_rows(self, a: Any) -> Any:
        return torch.sort(a, dim=1).values

    def cat(self, parts: Sequence[Any]) -> Any:
        return torch.cat(list(parts), dim=1)

    def cat_rows(self, parts: Sequence[Any]) -> Any:
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=0)

    def clip_neg(self, a: Any) -> Any:
        return a.clamp_min(-1)

    def arange(self, start: int, stop: int, step: int, dtype: Any) -> Any:
        return torch.arange(start, stop, step, dtype=dtype, device=self.device)

    def cast(self, a: Any, dtype: Any) -> Any:
        return a.to(dtype)

    def zeros(self, shape: tuple[int, int], dtype: Any) -> Any:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def any(self, a: Any, axis: int) -> Any:
        return a.any(dim=axis)

    def argmax(self, a: Any, axis: int) -> Any:
        return a.view(torch.uint8).argmax(dim=axis)

    def minmax(self, a: Any) -> tuple[int, int]:
        lo, hi = torch.aminmax(a)
        return int(lo), int(hi)

    def has(self, a: Any) -> bool:
        return bool(a.any())


_Index = _NumpyIndex | _TorchIndex

# Which index backend CPU tensors use; tests set "torch" to run the other devices' path on CPU.
_CPU_INDEX_BACKEND = "numpy"


def _bits(n: int) -> int:
    """Bits needed to hold ``0 .. n - 1`` (at least 1)."""
    return max(1, (n - 1).bit_length())


def _plan(
    strategy: str, ids_t: Tensor, ks: int, row_valid_t: Tensor | None, basis: bool
) -> _Plan | None:
    """Decide each position's selected candidates and pack them to the front, in order.

    Args:
        strategy: The strategy.
        ids_t: int64 ``[N, W]``: only-*: the one id set; else the joined ``[S | T]`` (``ks``
            columns of ``S``).
        ks: Width of ``S`` (only-*: ``W``).
        row_valid_t: bool ``[N]`` or None (all valid).
        basis: Also make :attr:`_Plan.basis`.

    Returns:
        None when every slot is selected and already in place (only-* without empty slots),
        else the :class:`_Plan`.

    Every selected candidate is a column of the row, and the spec order is column order, so
    packing is a row sort of ``unselected << 2b | column << b | teacher column`` keys (``b``
    bits per column); the low bits carry the column to read the teacher value from (the
    ``T`` twin of an ``S`` id that is also in ``T``, for union and intersection).
    Membership comes from a row sort of packed ``id << b | column`` keys, where an id in both
    sets sorts as a pair, ``S`` then ``T`` (ids are distinct within ``S`` and within ``T``),
    or, for small k (``_BROADCAST_MAX_K``) or ids too large to pack, a broadcast equality.
    """
    if ids_t.device.type == "cpu" and _CPU_INDEX_BACKEND == "numpy":
        xp: _Index = _NumpyIndex()
    else:
        xp = _TorchIndex(ids_t.device)
    ids = xp.asarray(ids_t)
    row_valid = None if row_valid_t is None else xp.asarray(row_valid_t)
    w = ids.shape[1]
    b = _bits(w)
    kdt = xp.i32 if 2 * b + 1 <= 31 else xp.i64
    if strategy in ("only-student", "only-teacher"):
        unsel = ids < 0
        if row_valid is not None:
            unsel |= ~row_valid[:, None]
        if not xp.has(unsel):
            return None
        col = xp.arange(0, w, 1, kdt)
        keys = (xp.cast(unsel, kdt) << (2 * b)) | (col << b) | col
        return _unpack(xp, xp.sort_rows(keys), b, w, basis)
    kt = w - ks
    lo, hi = xp.minmax(ids)
    if min(ks, kt) == 0 or max(ks, kt) < _BROADCAST_MAX_K or hi >= 1 << (63 - b):
        unsel, key = _membership_other(xp, strategy, ids, ks, kdt, b)
    elif isinstance(xp, _NumpyIndex) and hi < 1 << (31 - b) and 2 * b + 1 <= 31:
        return _plan_sorted_numpy(strategy, ids, ks, row_valid, lo, basis)
    else:
        unsel, key = _membership_sorted(xp, strategy, ids, ks, kdt, b, lo, hi)
    if row_valid is not None:
        unsel |= ~row_valid[:, None]
    c = ks if strategy == "intersection" else w
    return _unpack(xp, xp.sort_rows((xp.cast(unsel, kdt) << (2 * b)) | key)[:, :c], b, w, basis)


def _unpack(xp: _Index, srt: Any, b: int, w: int, basis: bool) -> _Plan:
    """The :class:`_Plan` of row-sorted ``unselected << 2b | column << b | teacher column``
    keys ``[N, C]``, for row-major ``[N, W]`` bases (a flat index is ``row * W + column``)."""
    n = srt.shape[0]
    low = (1 << b) - 1
    idt = xp.i32 if xp.small_index and n * w < 2**31 else xp.i64
    rows = xp.arange(0, n * w, w, idt)[:, None]
    unsel = srt >> (2 * b)
    keep = xp.cast(unsel, xp.i32) - 1
    return _Plan(
        src=xp.tensor(xp.cast((srt >> b) & low, idt) + rows).reshape(-1),
        tsrc=xp.tensor(xp.cast(srt & low, idt) + rows).reshape(-1),
        keep=xp.tensor(keep),
        mask=xp.tensor(unsel == 0),
        unsel=xp.tensor(unsel != 0),
        basis=xp.tensor(~keep & _UNSELECTED_BITS) if basis else None,
        empty_rows=n > 0 and xp.has(unsel[:, 0] != 0),
    )


def _membership_other(xp: _Index, strategy: str, ids: Any, ks: int, kdt: Any, b: int) -> Any:
    """:func:`_membership_sorted` when a set is empty (nothing is in both), for small k, or
    for ids too large to pack: by broadcast equality ``[rows, Ks, Kt]``, chunked so that at
    most ``_EQ_CHUNK_ELEMENTS`` booleans exist at once; slots in column order."""
    n, w = ids.shape
    kt = w - ks
    col = xp.arange(0, w, 1, kdt)
    if ks == 0 or kt == 0:
        nothing = xp.zeros((n, w), xp.b8)
        return _classify(xp, strategy, ids < 0, nothing, nothing, col, col, kdt, b)
    s_ids, t_ids = ids[:, :ks], ids[:, ks:]
    rows_per_chunk = max(1, _EQ_CHUNK_ELEMENTS // (ks * kt))
    parts = []
    for i in range(0, n, rows_per_chunk):
        s, t = s_ids[i : i + rows_per_chunk], t_ids[i : i + rows_per_chunk]
        eq = (s[:, :, None] == t[:, None, :]) & (s >= 0)[:, :, None]
        parts.append((xp.any(eq, 2), xp.argmax(eq, 2), xp.any(eq, 1)))
    s_in, s_match, t_in = (xp.cat_rows([p[j] for p in parts]) for j in range(3))
    s_in_t = xp.cat((s_in, xp.zeros((n, kt), xp.b8)))
    t_in_s = xp.cat((xp.zeros((n, ks), xp.b8), t_in))
    twin = xp.cat((xp.cast(s_match, kdt) + ks, xp.zeros((n, kt), kdt) + col[ks:]))
    return _classify(xp, strategy, ids < 0, s_in_t, t_in_s, col, twin, kdt, b)


def _membership_sorted(
    xp: _Index, strategy: str, ids: Any, ks: int, kdt: Any, b: int, lo: int, hi: int
) -> Any:
    """Per slot of the joined row ``[S | T]``, in the order of a row sort of packed
    ``id << b | column`` keys: ``unselected`` and ``column << b | teacher column`` (see
    :func:`_classify`).  Every negative id is an empty slot; ids are below ``2**(63 - b)``."""
    n, w = ids.shape
    if lo < -1:
        ids = xp.clip_neg(ids)
    sdt = xp.i32 if hi < 1 << (31 - b) else xp.i64
    srt = xp.sort_rows((xp.cast(ids, sdt) << b) | xp.arange(0, w, 1, sdt))
    sid = srt >> b
    scol = xp.cast(srt & ((1 << b) - 1), kdt)
    # An S id in T sorts right before its T twin: pair (p, p + 1).
    pair = (sid[:, 1:] == sid[:, :-1]) & (sid[:, 1:] >= 0)
    none = xp.zeros((n, 1), xp.b8)
    s_in_t = xp.cat((pair, none))  # at the S slot of a pair
    t_in_s = xp.cat((none, pair))  # at the T slot of a pair
    twin = xp.cat((scol[:, 1:], scol[:, -1:]))  # the next slot's column
    return _classify(xp, strategy, sid < 0, s_in_t, t_in_s, scol, twin, kdt, b)


def _classify(
    xp: _Index,
    strategy: str,
    hole: Any,
    s_in_t: Any,
    t_in_s: Any,
    col: Any,
    twin: Any,
    kdt: Any,
    b: int,
) -> tuple[Any, Any]:
    """``(unselected, column << b | teacher column)`` per slot (spec §2).

    ``s_in_t``: an ``S`` slot whose id is in ``T``, ``twin`` its ``T`` column; ``t_in_s``: a
    ``T`` slot whose id is in ``S``; ``hole``: an empty slot.
    """
    if strategy == "xor":
        return hole | s_in_t | t_in_s, (col << b) | col
    tcol = col + xp.cast(s_in_t, kdt) * (twin - col)
    unsel = hole | t_in_s if strategy == "union" else ~s_in_t  # intersection: S ids in T
    return unsel, (col << b) | tcol


def _plan_sorted_numpy(
    strategy: str, ids: Any, ks: int, row_valid: Any, lo: int, basis: bool
) -> _Plan:
    """:func:`_plan` for intersection, union and xor on numpy when ``id << b | column``
    fits int32: the two row sorts of :func:`_membership_sorted` and :func:`_plan`, written
    as in-place passes over flat arrays of one scratch block (on one CPU thread numpy is slow
    on ``[N, small]`` slices, and every fresh array can cost page faults)."""
    n, w = ids.shape
    size = n * w
    c = ks if strategy == "intersection" else w
    b = _bits(w)
    low = (1 << b) - 1
    idt: Any = np.int32 if size < 2**31 else np.int64
    isz = np.dtype(idt).itemsize
    # Scratch: keys (int32) | work (index dtype) | out (index dtype) | pair | unsel (bool).
    block = np.empty(size * (4 + 2 * isz + 2), dtype=np.uint8)
    keys = block[: 4 * size].view(np.int32)
    work = block[4 * size : (4 + isz) * size].view(idt)
    out = block[(4 + isz) * size : (4 + 2 * isz) * size].view(idt)
    pair = block[(4 + 2 * isz) * size : (5 + 2 * isz) * size].view(np.bool_)
    unsel = block[(5 + 2 * isz) * size :].view(np.bool_)
    keys2d = keys.reshape(n, w)

    np.left_shift(ids if lo >= -1 else np.maximum(ids, -1), b, out=keys2d, casting="unsafe")
    keys2d |= np.arange(w, dtype=np.int32)
    keys2d.sort(axis=1)
    # pair[p]: sorted slots p (an S id) and p + 1 (its T twin) hold the same id, >= 0.
    tmp = work[: size - 1].view(np.uint32 if isz == 4 else np.uint64)[: size - 1]
    u = keys.view(np.uint32)
    np.bitwise_xor(u[1:], u[:-1], out=tmp, casting="unsafe")
    np.less(tmp, 1 << b, out=pair[:-1])
    pair[w - 1 :: w] = False  # a row's last slot: the next slot is another row's
    if lo < 0:
        np.less(keys, 0, out=unsel)  # holes (sorted first in a row)
        pair &= ~unsel
    else:
        unsel[:] = False
    keys &= low  # now each slot's column
    # The teacher column of each slot, in work: its T twin's for an S id in T (union,
    # intersection), else its own.
    tcol = work[:size]
    if strategy == "xor":
        tcol[:] = keys
        unsel |= pair
    else:
        twin = tcol[: size - 1]
        np.subtract(keys[1:], keys[:-1], out=twin, casting="unsafe")
        twin *= pair[:-1]
        twin += keys[:-1]
        tcol[size - 1] = keys[size - 1]
    if strategy == "intersection":
        np.logical_not(pair, out=unsel)  # an S id not in T (and every T slot)
    else:
        unsel[1:] |= pair[:-1]  # the T twin of a pair: its id is S's
    if row_valid is not None:
        unsel.reshape(n, w)[~row_valid] = True
    keys <<= b
    keys |= tcol
    np.copyto(work, unsel)  # (bool to int: a plain cast is numpy's fast loop)
    work <<= 2 * b
    keys |= work
    keys2d.sort(axis=1)

    srt = keys2d[:, :c]
    rows = np.arange(0, size, w, dtype=idt)[:, None]
    src = out[: n * c].reshape(n, c)
    np.right_shift(srt, b, out=src, casting="unsafe")
    src &= low
    src += rows
    tsrc = work[: n * c].reshape(n, c)
    np.bitwise_and(srt, low, out=tsrc, casting="unsafe")
    tsrc += rows
    keep = keys2d[:, :c]
    keep >>= 2 * b
    keep -= 1  # -1 selected, 0 not
    mask = pair[: n * c].reshape(n, c)
    np.not_equal(keep, 0, out=mask)
    np.logical_not(mask, out=unsel[: n * c].reshape(n, c))
    nb = None
    if basis:
        nb = np.invert(keep)
        nb &= _UNSELECTED_BITS
    return _Plan(
        src=torch.from_numpy(out[: n * c]),
        tsrc=torch.from_numpy(work[: n * c]),
        keep=torch.from_numpy(np.ascontiguousarray(keep)),
        mask=torch.from_numpy(mask),
        unsel=torch.from_numpy(unsel[: n * c].reshape(n, c)),
        basis=None if nb is None else torch.from_numpy(nb),
        empty_rows=n > 0 and not bool(mask[:, 0].all()),
    )


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
