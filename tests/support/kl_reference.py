"""Independent float64 reference for the KL math (``docs/semantics.md``, "Top-k mode", and
its "Sampled-token mode").

Plain Python over dicts, one position at a time, written from the docs' text only (it imports
nothing from ``opd_stream.kl._math``).  The floor ``-1e4`` and the smallest tail mass ``1e-6`` are
the documented constants.

The tail bucket (``tail=True``, issue 18) is written from its formula, straight:
``r = sum_C exp(s) (s - t) + S (log S - log T)`` with ``S = max(1 - sum_C exp(s), 1e-6)``
(``math.fsum``, ``math.log``), ``T`` likewise, and ``r`` at least 0.
:func:`reference_full_reverse_kl` is the full-vocabulary reverse KL of a distribution given
as a head of explicit logprobs plus ``n_tail`` ids of one shared logprob (the mock model's
closed form).

The other divergences (issue 27) are written from docs/semantics.md the same way:
:func:`reference_divergence_position` gives ``forward_kl`` (``sum w (t - s)``, teacher
weights; with the tail ``sum exp(t) (t - s) + T (log T - log S)``) and TRL's generalized
``jsd`` (``beta KL(Q || M) + (1 - beta) KL(P || M)``, ``M = beta Q + (1 - beta) P``, over the
candidates renormalised, or over the candidates and the tail bucket), one term at a time;
:func:`reference_full_divergence` their full-vocabulary values on the mock's closed form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = (
    "FLOOR",
    "Missing",
    "RefPosition",
    "reference_divergence_position",
    "reference_full_divergence",
    "reference_full_reverse_kl",
    "reference_position",
    "reference_sampled",
)

FLOOR = -1e4
TAIL_MIN = 1e-6


class Missing(Exception):
    """A selected candidate has no value (NaN) on ``side``."""

    def __init__(self, side: str, token_id: int) -> None:
        super().__init__(side, token_id)
        self.side = side
        self.token_id = token_id


class RefPosition:
    """The reference answer for one position: ``r`` and the selected candidates in order."""

    def __init__(
        self,
        r: float,
        ids: list[int],
        student: list[float],
        teacher: list[float],
        weights: list[float],
        scale: float,
        tails: tuple[float, float] | None = None,
    ) -> None:
        self.r = r
        self.ids = ids
        self.student = student
        self.teacher = teacher
        self.weights = weights
        # Sum of |w (s - t)|: the magnitude float32 rounding is relative to.
        self.scale = scale
        # tail=True: (log S_tail, log T_tail)
        self.tails = tails


def _floor(x: float) -> float:
    return max(float(x), FLOOR)


def _as_dict(ids: Sequence[int] | None, values: Sequence[float] | None) -> dict[int, float]:
    if ids is None or values is None:
        return {}
    return {int(i): float(v) for i, v in zip(ids, values, strict=True) if int(i) >= 0}


def reference_position(
    *,
    strategy: str,
    weight_mode: str,
    s_ids: Sequence[int] | None = None,
    s_lp: Sequence[float] | None = None,
    t_on_s: Sequence[float] | None = None,
    t_ids: Sequence[int] | None = None,
    t_lp: Sequence[float] | None = None,
    s_on_t: Sequence[float] | None = None,
    tail: bool = False,
) -> RefPosition:
    """Score one position; negative ids are empty slots.  Raises :class:`Missing` on NaN.

    ``tail``: the tail bucket (weights ``exp(s)`` whatever ``weight_mode``)."""
    student_top = _as_dict(s_ids, s_lp)  # S with the student's own values (insertion order)
    teacher_on_s = _as_dict(s_ids, t_on_s)
    teacher_top = _as_dict(t_ids, t_lp)
    student_on_t = _as_dict(t_ids, s_on_t)

    if strategy == "only-student":
        selected = list(student_top)
        pairs = [(student_top[v], teacher_on_s[v]) for v in selected]
    elif strategy == "only-teacher":
        selected = list(teacher_top)
        pairs = [(student_on_t[v], teacher_top[v]) for v in selected]
    elif strategy == "intersection":
        selected = [v for v in student_top if v in teacher_top]
        pairs = [(student_top[v], teacher_top[v]) for v in selected]
    elif strategy in ("union", "xor"):
        s_part = list(student_top)
        if strategy == "xor":
            s_part = [v for v in s_part if v not in teacher_top]
        t_part = [v for v in teacher_top if v not in student_top]
        selected = s_part + t_part
        pairs = []
        for v in selected:
            s = student_top[v] if v in student_top else student_on_t[v]
            t = teacher_top[v] if v in teacher_top else teacher_on_s[v]
            pairs.append((s, t))
    else:
        raise AssertionError(strategy)

    for v, (s, t) in zip(selected, pairs, strict=True):
        if math.isnan(s):
            raise Missing("student", v)
        if math.isnan(t):
            raise Missing("teacher", v)
    student = [_floor(s) for s, _ in pairs]
    teacher = [_floor(t) for _, t in pairs]

    n = len(selected)
    if tail:
        weights = [math.exp(x) for x in student]
        r = sum(w * (s - t) for w, s, t in zip(weights, student, teacher, strict=True))
        s_tail = max(1.0 - math.fsum(math.exp(x) for x in student), TAIL_MIN)
        t_tail = max(1.0 - math.fsum(math.exp(x) for x in teacher), TAIL_MIN)
        tail_term = s_tail * (math.log(s_tail) - math.log(t_tail))
        scale = sum(abs(w * (s - t)) for w, s, t in zip(weights, student, teacher, strict=True))
        tails = (math.log(s_tail), math.log(t_tail))
        return RefPosition(
            max(r + tail_term, 0.0), selected, student, teacher, weights, scale, tails
        )
    if weight_mode == "none":
        weights = [1.0 if strategy == "xor" else 1.0 / n for _ in range(n)]
    else:
        basis = student if weight_mode == "student_p" else teacher
        if strategy == "xor":
            weights = [math.exp(x) for x in basis]
        elif n:
            top = max(basis)
            exps = [math.exp(x - top) for x in basis]
            total = sum(exps)
            weights = [e / total for e in exps]
        else:
            weights = []
    r = 0.0
    scale = 0.0
    for w, s, t in zip(weights, student, teacher, strict=True):
        r += w * (s - t)
        scale += abs(w * (s - t))
    return RefPosition(r, selected, student, teacher, weights, scale)


def reference_full_reverse_kl(
    head_s: Sequence[float],
    head_t: Sequence[float],
    tail_s: float,
    tail_t: float,
    n_tail: int,
) -> float:
    """``KL(student || teacher)`` over the full vocabulary: the same head ids with logprobs
    ``head_s`` / ``head_t``, plus ``n_tail`` ids of logprob ``tail_s`` / ``tail_t`` each
    (ids of probability 0 in both contribute nothing)."""
    terms = [math.exp(s) * (s - t) for s, t in zip(head_s, head_t, strict=True) if s > -math.inf]
    terms.append(n_tail * math.exp(tail_s) * (tail_s - tail_t))
    return math.fsum(terms)


def reference_sampled(rollout: Sequence[float], teacher: Sequence[float]) -> list[float]:
    """``rollout - teacher`` per token after the floor; raises :class:`Missing` on NaN."""
    out = []
    for s, t in zip(rollout, teacher, strict=True):
        if math.isnan(s):
            raise Missing("student", -1)
        if math.isnan(t):
            raise Missing("teacher", -1)
        out.append(_floor(s) - _floor(t))
    return out


def _kl_terms(p: Sequence[float], lp: Sequence[float], lq: Sequence[float]) -> float:
    """``sum p (log p - log q)`` over outcomes of probability ``p > 0``."""
    return math.fsum(x * (a - b) for x, a, b in zip(p, lp, lq, strict=True) if x > 0.0)


def _jsd_of(p: list[float], q: list[float], beta: float) -> tuple[float, list[float]]:
    """TRL's generalized JSD of two distributions over the same outcomes, and ``M``."""
    m = [beta * b + (1.0 - beta) * a for a, b in zip(p, q, strict=True)]
    lm = [math.log(x) if x > 0 else -math.inf for x in m]
    lp = [math.log(x) if x > 0 else -math.inf for x in p]
    lq = [math.log(x) if x > 0 else -math.inf for x in q]
    return beta * _kl_terms(q, lq, lm) + (1.0 - beta) * _kl_terms(p, lp, lm), m


def reference_divergence_position(
    *, divergence: str, beta: float = 0.5, strategy: str, tail: bool = False, **rows: Any
) -> RefPosition:
    """Score one position with ``divergence`` (``reverse_kl``, ``forward_kl``, ``jsd``).

    The candidates are :func:`reference_position`'s; ``rows`` are its id/value keywords.
    ``forward_kl`` weighs by the teacher (``teacher_p``), ``reverse_kl`` by the student."""
    if divergence == "reverse_kl":
        return reference_position(strategy=strategy, weight_mode="student_p", tail=tail, **rows)
    base = reference_position(strategy=strategy, weight_mode="teacher_p", **rows)
    student, teacher = base.student, base.teacher
    p = [math.exp(x) for x in student]
    q = [math.exp(x) for x in teacher]
    s_tail = max(1.0 - math.fsum(p), TAIL_MIN)
    t_tail = max(1.0 - math.fsum(q), TAIL_MIN)
    tails = (math.log(s_tail), math.log(t_tail)) if tail else None
    if divergence == "forward_kl":
        if not tail:  # the teacher-weighted sum of t - s: minus teacher_p's s - t
            return RefPosition(-base.r, base.ids, student, teacher, base.weights, base.scale)
        terms = [w * (t - s) for w, s, t in zip(q, student, teacher, strict=True)]
        r = math.fsum(terms) + t_tail * (math.log(t_tail) - math.log(s_tail))
        scale = math.fsum(abs(x) for x in terms)
        return RefPosition(max(r, 0.0), base.ids, student, teacher, q, scale, tails)
    assert divergence == "jsd", divergence
    if not base.ids:
        return RefPosition(0.0, [], [], [], [], 0.0, tails)
    if tail:
        r, m = _jsd_of([*p, s_tail], [*q, t_tail], beta)
        m = m[:-1]
    else:
        zs, zt = math.fsum(p), math.fsum(q)
        if zs == 0.0 or zt == 0.0:  # every candidate floored on a side: renormalise in logs
            top_s, top_t = max(student), max(teacher)
            p = [math.exp(x - top_s) for x in student]
            q = [math.exp(x - top_t) for x in teacher]
            zs, zt = math.fsum(p), math.fsum(q)
        r, m = _jsd_of([x / zs for x in p], [x / zt for x in q], beta)
    return RefPosition(max(r, 0.0), base.ids, student, teacher, m, 1.0, tails)


def reference_full_divergence(
    divergence: str,
    head_s: Sequence[float],
    head_t: Sequence[float],
    tail_s: float,
    tail_t: float,
    n_tail: int,
    beta: float = 0.5,
) -> float:
    """The full-vocabulary value of ``divergence`` on :func:`reference_full_reverse_kl`'s
    distributions (a head of explicit logprobs plus ``n_tail`` ids of one shared logprob)."""
    if divergence == "reverse_kl":
        return reference_full_reverse_kl(head_s, head_t, tail_s, tail_t, n_tail)
    if divergence == "forward_kl":
        return reference_full_reverse_kl(head_t, head_s, tail_t, tail_s, n_tail)
    assert divergence == "jsd", divergence
    total = 0.0
    terms = []
    pairs = [(s, t, 1) for s, t in zip(head_s, head_t, strict=True)] + [(tail_s, tail_t, n_tail)]
    for s, t, count in pairs:
        p, q = math.exp(s), math.exp(t)
        m = beta * q + (1.0 - beta) * p
        if m == 0.0:
            continue
        lm = math.log(m)
        if q > 0:
            terms.append(count * beta * q * (t - lm))
        if p > 0:
            terms.append(count * (1.0 - beta) * p * (s - lm))
    total = math.fsum(terms)
    return total
