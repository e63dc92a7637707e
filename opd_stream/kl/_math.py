"""Vectorised torch KL math over top-k candidate sets: per-token reverse KL
(:func:`sampled_reverse_kl`, :func:`topk_reverse_kl`), forward KL and generalized JSD
(:func:`topk_divergence`), with the per-candidate arrays a candidate-level loss needs.

Semantics: ``docs/semantics.md``; the tensors: ``docs/internals.md``, "The KL contract".
Every logprob is clamped to :data:`LOGPROB_FLOOR` (``-1e4``) first, so no value is infinite;
``tail=True`` adds the rest-of-mass bucket (float64 tails, at least :data:`TAIL_MIN`). A NaN
in a selected candidate raises :class:`~opd_stream._errors.MissingLogprobError`; NaN never
leaves the module. float32 on the inputs' device (one per call), per-row reductions only
(batch-invariant on CPU); ids int64, a negative id an empty slot. The selection plan is
:mod:`opd_stream.kl._select`'s. In full: ``docs/design-notes.md``, "opd_stream/kl/_math.py".
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .._errors import MissingLogprobError
from ._names import (
    DIVERGENCES,
    LOGPROB_FLOOR,
    STRATEGIES,
    TAIL_MIN,
    WEIGHT_MODES,
    Divergence,
    Strategy,
    WeightMode,
    divergence_weight_problem,
)
from ._plan import candidate_width
from ._select import SelectionPlan, plan_selection
from ._tensors import TopKBatch, TopKResult, checked_fields, empty_topk_result, needed_inputs

__all__ = (
    "DIVERGENCES",
    "Divergence",
    "LOGPROB_FLOOR",
    "STRATEGIES",
    "Strategy",
    "TAIL_MIN",
    "TopKBatch",
    "TopKResult",
    "WEIGHT_MODES",
    "WeightMode",
    "needed_inputs",
    "sampled_reverse_kl",
    "topk_divergence",
    "topk_reverse_kl",
)

# A log-probability whose exp is 0 in float64 whatever a row holds (floored values are
# >= -1e4): the renormalising basis of an unselected slot in the JSD.
_UNSELECTED_LOG = -1e30


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


def topk_reverse_kl(
    batch: TopKBatch, strategy: Strategy, weight_mode: WeightMode, *, tail: bool = False
) -> TopKResult:
    """Select candidates, weight them and reduce to the per-token reverse KL (``docs/semantics.md``,
    "Top-k mode").

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

    With ``tail`` (see the module doc), the weights are ``exp(s(v))`` and ``r_t`` gains the
    tail bucket's term: the reverse KL over ``|C| + 1`` outcomes, never negative.

    This is :func:`topk_divergence` with ``divergence="reverse_kl"``.

    Args:
        batch: The padded inputs; the fields :func:`needed_inputs` names must be set.
        strategy: One of :data:`STRATEGIES`.
        weight_mode: One of :data:`WEIGHT_MODES` (``"student_p"`` with ``tail``).
        tail: Add the tail bucket (and return the two tail logprobs).

    Returns:
        A :class:`TopKResult` on the inputs' device.

    Raises:
        ValueError: Unknown strategy or weight mode, a needed field is None, the shapes
            or devices do not agree, or ``tail`` with a weight mode other than student_p.
        MissingLogprobError: A selected candidate's student or teacher value is NaN.
    """
    return topk_divergence(batch, strategy, weight_mode, tail=tail)


def topk_divergence(
    batch: TopKBatch,
    strategy: Strategy,
    weight_mode: WeightMode,
    *,
    divergence: Divergence = "reverse_kl",
    jsd_beta: float = 0.5,
    tail: bool = False,
) -> TopKResult:
    """The per-token signal of ``divergence`` over each position's candidate set.

    The candidates (ids, both sides' values, mask) are chosen as in
    :func:`topk_reverse_kl`; ``r_t`` (the result's first field, ``signal``) is:

    * ``reverse_kl``: ``sum_C w(v) (s - t)`` (weights by ``weight_mode``); with ``tail``
      the reverse KL over ``|C| + 1`` outcomes (see the module doc);
    * ``forward_kl`` (``weight_mode="teacher_p"`` only): ``sum_C w(v) (t - s)`` with the
      teacher's weights (softmax of ``t`` over ``C``; ``exp(t)`` for xor); with ``tail``,
      ``sum_C exp(t) (t - s) + T_tail (log T_tail - log S_tail)``, the forward KL over
      ``|C| + 1`` outcomes (>= 0, at most the full-vocabulary ``KL(teacher || student)``);
    * ``jsd`` (``weight_mode="student_p"`` only, where it is unused): TRL's generalized JSD
      ``beta KL(Q || M) + (1 - beta) KL(P || M)``, ``M = beta Q + (1 - beta) P``, ``Q`` the
      teacher's distribution and ``P`` the student's, over the candidates renormalised
      (every strategy, xor included), or, with ``tail``, over the raw candidates plus the
      tail bucket. In float64; ``0 <= r_t <= h(beta) <= log 2`` (``h`` the binary
      entropy), symmetric in the two models at ``beta = 0.5``. ``weights`` holds ``M``'s
      probabilities of the candidates.

    Args:
        batch, strategy, weight_mode, tail: as for :func:`topk_reverse_kl`.
        divergence: One of :data:`DIVERGENCES`.
        jsd_beta: ``beta`` of ``jsd``, in ``(0, 1)`` (ignored by the other divergences).

    Raises:
        ValueError: as :func:`topk_reverse_kl`; an unknown divergence, a weight mode the
            divergence does not take, or ``jsd_beta`` outside ``(0, 1)``.
        MissingLogprobError: A selected candidate's student or teacher value is NaN.
    """
    needed = needed_inputs(strategy)
    if weight_mode not in WEIGHT_MODES:
        raise ValueError(
            f"unknown weight mode {weight_mode!r}; expected one of {', '.join(WEIGHT_MODES)}"
        )
    if divergence not in DIVERGENCES:
        raise ValueError(
            f"unknown divergence {divergence!r}; expected one of {', '.join(DIVERGENCES)}"
        )
    problem = divergence_weight_problem(divergence, weight_mode, tail)
    if problem is not None:
        raise ValueError(problem)
    if divergence == "jsd" and not 0.0 < jsd_beta < 1.0:
        raise ValueError(f"jsd_beta must be in (0, 1), got {jsd_beta!r}")
    fields = checked_fields(batch, strategy, needed)
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
    c = candidate_width(
        strategy,
        fields["student_ids"].shape[-1] if "student_ids" in fields else 0,
        fields["teacher_ids"].shape[-1] if "teacher_ids" in fields else 0,
    )
    if n == 0 or c == 0:
        return empty_topk_result(b, r, c, ids.device, tail)

    raw = strategy == "xor" or tail  # unnormalised weights
    # forward_kl's weights are the teacher's (weight_mode teacher_p); jsd makes its own.
    basis = weight_mode != "none" and not raw and divergence != "jsd"
    plan = plan_selection(strategy, ids, ks, row_valid, basis)
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
    forward = divergence == "forward_kl"
    tails: tuple[Tensor, Tensor] | None = None
    if divergence == "jsd":
        if tail:
            selected = None if plan is None else plan.mask
            tails = (_tail_lp(s_val, selected), _tail_lp(t_val, selected))
        reverse_kl, weights = _jsd(s_val, t_val, mask, jsd_beta, tails, plan is None)
    else:
        weights = _weights(raw, weight_mode, s_val, t_val, plan)
        # (Not torch.mv with ones, which is faster on CPU: BLAS rounds a row differently
        # depending on the row count, so a sample's r_t would depend on its batch mates.)
        diff = torch.sub(t_val, s_val) if forward else torch.sub(s_val, t_val)
        reverse_kl = diff.mul_(weights).sum(dim=1)
    # NaN is now only possible in selected slots, and one there makes its row's r_t NaN
    # (d = s - t is NaN, and w * NaN is NaN for any weight; the JSD's logs and sums carry
    # it too); everything else is finite (no logprob is +inf, -inf was floored), so one
    # small reduction finds out.
    if bool(torch.isnan(reverse_kl.sum())):
        _raise_on_missing(out_ids, s_val, t_val, r)
    if tail and divergence != "jsd":
        selected = None if plan is None else plan.mask
        tails = (_tail_lp(s_val, selected), _tail_lp(t_val, selected))
        # X_tail (log X_tail - log Y_tail), X the weighing side (the student for the
        # reverse KL, the teacher for the forward KL), added in float64; never below 0
        own, other = (tails[1], tails[0]) if forward else tails
        term = torch.exp(own).mul_(own - other)
        reverse_kl = term.add_(reverse_kl).clamp_min_(0.0).to(torch.float32)
    if tails is not None:
        tails = (tails[0].to(torch.float32), tails[1].to(torch.float32))
    outputs = (reverse_kl, out_ids, s_val, t_val, weights, mask)
    if b == 1:
        res = TopKResult(*(x[None] for x in outputs))
    else:
        res = TopKResult(reverse_kl.reshape(b, r), *(x.reshape(b, r, c) for x in outputs[1:]))
    if tails is None:
        return res
    return res._replace(
        student_tail_lp=tails[0].reshape(b, r), teacher_tail_lp=tails[1].reshape(b, r)
    )


def _jsd(
    s_val: Tensor,
    t_val: Tensor,
    mask: Tensor,
    beta: float,
    tails: tuple[Tensor, Tensor] | None,
    all_selected: bool,
) -> tuple[Tensor, Tensor]:
    """The generalized JSD per row and the mixture's probabilities of the candidates
    (float32 ``[N]``, ``[N, C]``), computed in float64 from floored values (+0.0 in
    unselected slots). Without ``tails`` both sides are renormalised over the selected
    candidates; with them (float64 log-masses), the raw candidates plus the tail bucket.

    With ``m = beta q + (1 - beta) p`` per outcome, ``beta KL(Q || M) + (1 - beta) KL(P || M)
    = sum beta q log q + (1 - beta) p log p - m log m`` (each ``x log x`` 0 at ``x = 0``):
    a few products and one log, no ``logaddexp`` (several times slower on CPU).
    """
    f64 = torch.float64
    s64, t64 = s_val.to(f64, copy=True), t_val.to(f64, copy=True)  # (written in place)
    if tails is None:
        # each side renormalised over the selection: unselected slots get a log whose exp
        # is exactly 0 (a row that selects nothing is uniform on both sides: JSD 0)
        if not all_selected:
            unsel = torch.tensor(_UNSELECTED_LOG, dtype=f64, device=s64.device)
            s64 = torch.where(mask, s64, unsel)
            t64 = torch.where(mask, t64, unsel)
        # (x - logsumexp(x) costs half of torch.log_softmax in float64 on CPU)
        s64.sub_(torch.logsumexp(s64, dim=1, keepdim=True))
        t64.sub_(torch.logsumexp(t64, dim=1, keepdim=True))
    # In place wherever it can be: each new [N, C] float64 temporary is fresh memory, and
    # its page faults cost more than the arithmetic on it.
    p, q = torch.exp(s64), torch.exp(t64)
    if not all_selected:
        sel = mask.to(f64)
        p.mul_(sel)
        q.mul_(sel)
    m = torch.mul(q, beta).add_(p, alpha=1.0 - beta)
    js = q.mul_(t64).mul_(beta).add_(p.mul_(s64), alpha=1.0 - beta)
    js = js.sub_(_xlogx(m, out=s64)).sum(dim=1)
    if tails is not None:
        ls, lt = tails
        ps, pt = torch.exp(ls), torch.exp(lt)
        mt = pt * beta + ps * (1.0 - beta)
        js += (pt * lt).mul_(beta).add_((ps * ls).mul_(1.0 - beta)).sub_(_xlogx(mt))
    return js.clamp_min_(0.0).to(torch.float32), m.to(torch.float32)


def _xlogx(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``x log x`` of float64 probabilities, 0 at ``x = 0`` (``torch.xlogy`` is ~5x slower
    on CPU): the clamp keeps ``log`` finite, and ``0 * log(1e-300)`` is 0. ``out``: a
    tensor of ``x``'s shape to write it into."""
    y = torch.clamp_min(x, 1e-300, out=out) if out is not None else x.clamp_min(1e-300)
    return y.log_().mul_(x)


def _tail_lp(x: Tensor, selected: Tensor | None) -> Tensor:
    """float64 ``[N]``: ``log(1 - sum_{selected} exp(x))``, the mass clamped to at most
    ``1 - TAIL_MIN`` (``x`` floored, +0.0 in unselected slots; ``selected`` None: all)."""
    p = torch.exp(x.to(torch.float64))
    if selected is not None:
        p.mul_(selected)
    return torch.log1p(p.sum(dim=1).clamp_(max=1.0 - TAIL_MIN).neg_())


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
    raw: bool, weight_mode: str, s_val: Tensor, t_val: Tensor, plan: SelectionPlan | None
) -> Tensor:
    """Candidate weights (``docs/semantics.md``, "Weights") from floored values; +0.0
    where not selected. ``raw``: not normalised (xor, and the tail bucket)."""
    n, c = s_val.shape
    if weight_mode == "none":
        if plan is None:
            return torch.full((n, c), 1.0 if raw else 1.0 / c, device=s_val.device)
        w = plan.mask.to(s_val.dtype)
        if raw:
            return w
        return w.div_(w.sum(dim=1, keepdim=True).clamp_min_(1.0))
    x = s_val if weight_mode == "student_p" else t_val
    if plan is None:
        return torch.exp(x) if raw else torch.softmax(x, dim=1)
    if raw:
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
