"""Independent expectations for pipeline results, from the mock's closed-form model.

For a sample scored against mock servers, recompute in float64, per position, what the
teacher and student servers would answer (values rounded to float32 as SGLang sends them)
and what the scoring math (the independent ``kl_reference``) gives. Nothing here imports
opd_stream's wire or KL code.

``teacher_prompt`` (issue 18): the teacher's values are those of the sequence
``teacher_prompt + response``, the student's those of the sample's own tokens; ``tail``: the
tail bucket (``kl_reference``'s ``tail=True``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from opd_stream import ScoredSample
from opd_stream.testing.mock_sglang import MockModel
from support.kl_reference import reference_divergence_position, reference_position

__all__ = (
    "Expected",
    "MixtureTeacher",
    "assert_all_scored",
    "assert_matches",
    "expected_result",
    "rollout_topk_rows",
)


class Expected:
    """Expected teacher logprobs, reverse KL and candidates of one sample."""

    def __init__(
        self,
        teacher_logprobs: list[float],
        reverse_kl: list[float] | None,
        ids: list[list[int]] | None,
        weights: list[list[float]] | None,
        scale: list[float],
        tails: list[tuple[float, float]] | None = None,
    ) -> None:
        self.teacher_logprobs = teacher_logprobs
        self.reverse_kl = reverse_kl
        self.ids = ids
        self.weights = weights
        self.scale = scale
        self.tails = tails


class MixtureTeacher:
    """An ensemble teacher as the servers make it (issue 27), written from its definition:
    a token's logprob is ``log sum_i w_i exp(t_i)`` of the members' values as sent
    (float32), in float64, one position and one id at a time; the top-k is the ``k`` ids of
    highest mixture logprob among the members' top-k ids (member 1's first, then each next
    member's new ones; ties: the earlier). Same interface as the MockModel methods
    :func:`expected_result` uses."""

    def __init__(self, members: list[MockModel], weights: list[float]) -> None:
        self.members = members
        self.weights = weights

    def _mix(self, values: list[float]) -> float:
        terms = [w * math.exp(v) for w, v in zip(self.weights, values, strict=True)]
        total = math.fsum(terms)
        return math.log(total) if total > 0 else -math.inf

    def _sent(self, per_member: list[Any]) -> list[list[float]]:
        """Per member, one row of float32 values as a server sends them."""
        return [[float(np.float32(v)) for v in np.ravel(x)] for x in per_member]

    def token_logprobs(self, tokens: Any, positions: Any) -> np.ndarray:
        sent = self._sent([m.token_logprobs(tokens, positions) for m in self.members])
        return np.array([self._mix(list(col)) for col in zip(*sent, strict=True)])

    def logprobs(self, tokens: Any, positions: Any, ids: Any) -> np.ndarray:
        assert len(positions) == 1
        sent = self._sent([m.logprobs(tokens, positions, ids) for m in self.members])
        return np.array([[self._mix(list(col)) for col in zip(*sent, strict=True)]])

    def topk(self, tokens: Any, positions: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        assert len(positions) == 1
        union: list[int] = []
        for m in self.members:
            for v in m.topk(tokens, positions, k)[0][0].tolist():
                if v not in union:
                    union.append(int(v))
        values = self.logprobs(tokens, positions, np.array([union]))[0].tolist()
        ranked = sorted(range(len(union)), key=lambda j: (-values[j], j))[:k]
        return np.array([[union[j] for j in ranked]]), np.array([[values[j] for j in ranked]])


def _f32(values: Any) -> list[float]:
    return [float(np.float32(v)) for v in np.asarray(values, dtype=np.float64).ravel()]


def rollout_topk_rows(
    model: MockModel, tokens: list[int], prompt_len: int, k: int
) -> list[list[list[Any]]]:
    """The student top-k a rollout engine would return, as ``[logprob, id]`` rows."""
    positions = np.arange(prompt_len, len(tokens))
    ids, lps = model.topk(np.asarray(tokens), positions, k)
    return [
        [[float(np.float32(lp)), int(i)] for i, lp in zip(ids[t], lps[t], strict=True)]
        for t in range(len(positions))
    ]


def expected_result(
    *,
    tokens: list[int],
    response_length: int,
    teacher: MockModel,
    student: MockModel,
    top_k: int,
    strategy: str,
    weight_mode: str,
    rollout_logprobs: list[float] | None = None,
    tail: bool = False,
    teacher_prompt: list[int] | None = None,
    divergence: str = "reverse_kl",
    jsd_beta: float = 0.5,
) -> Expected:
    """What a correct pipeline must return for this sample (float64, per position).

    ``teacher`` is a MockModel or anything with its ``token_logprobs``, ``topk`` and
    ``logprobs`` (an ensemble's mixture, see ``test_ensembles``); ``divergence`` other than
    ``reverse_kl``: the expected ``signal`` (``Expected.reverse_kl`` holds it)."""
    tok = np.asarray(tokens, dtype=np.int64)
    p = len(tokens) - response_length
    # the teacher's sequence and its first response position
    t_tok, tp = tok, p
    if teacher_prompt is not None:
        t_tok = np.concatenate([np.asarray(teacher_prompt, dtype=np.int64), tok[p:]])
        tp = len(teacher_prompt)
    teacher_lp = _f32(teacher.token_logprobs(t_tok, np.arange(tp, len(t_tok))))
    if top_k == 0:
        rkl = None
        if rollout_logprobs is not None:
            rkl = [
                max(float(np.float32(s)), -1e4) - max(t, -1e4)
                for s, t in zip(rollout_logprobs, teacher_lp, strict=True)
            ]
        return Expected(teacher_lp, rkl, None, None, [1.0] * response_length)
    rkl_out: list[float] = []
    ids_out: list[list[int]] = []
    w_out: list[list[float]] = []
    scale: list[float] = []
    tails: list[tuple[float, float]] = []
    for t in range(response_length):
        pos = np.array([p + t])
        t_pos = np.array([tp + t])
        s_ids, s_lp = student.topk(tok, pos, top_k)
        t_ids, t_lp = teacher.topk(t_tok, t_pos, top_k)
        t_on_s = teacher.logprobs(t_tok, t_pos, s_ids)
        s_on_t = student.logprobs(tok, pos, t_ids)
        rows: dict[str, Any] = {
            "s_ids": [int(x) for x in s_ids[0]],
            "s_lp": _f32(s_lp[0]),
            "t_on_s": _f32(t_on_s[0]),
            "t_ids": [int(x) for x in t_ids[0]],
            "t_lp": _f32(t_lp[0]),
            "s_on_t": _f32(s_on_t[0]),
        }
        if divergence == "reverse_kl":
            ref = reference_position(strategy=strategy, weight_mode=weight_mode, tail=tail, **rows)
        else:
            ref = reference_divergence_position(
                divergence=divergence, beta=jsd_beta, strategy=strategy, tail=tail, **rows
            )
        rkl_out.append(ref.r)
        ids_out.append(ref.ids)
        w_out.append(ref.weights)
        scale.append(ref.scale)
        if ref.tails is not None:
            tails.append(ref.tails)
    return Expected(teacher_lp, rkl_out, ids_out, w_out, scale, tails if tail else None)


def assert_matches(
    result: Any, expected: Expected, *, atol: float = 1e-5, teacher_rtol: float = 0.0
) -> None:
    """Compare a ScoredSample with an :class:`Expected`, position by position (its
    ``signal``; ``reverse_kl`` is the same tensor or, for another divergence, None).
    ``teacher_rtol``: the teacher logprobs' relative tolerance (exact by default)."""
    got_t = result.teacher_logprobs.tolist()
    assert len(got_t) == len(expected.teacher_logprobs)
    for g, e in zip(got_t, expected.teacher_logprobs, strict=True):
        ok = g == e or (math.isinf(g) and math.isinf(e)) or abs(g - e) <= teacher_rtol * abs(e)
        assert ok, (g, e)
    if result.divergence == "reverse_kl":
        assert result.reverse_kl is result.signal
    else:
        assert result.reverse_kl is None
    if expected.reverse_kl is None:
        assert result.signal is None
        return
    got_r = result.signal.tolist()
    assert len(got_r) == len(expected.reverse_kl)
    for t, (g, e) in enumerate(zip(got_r, expected.reverse_kl, strict=True)):
        tol = atol + 1e-6 * expected.scale[t]
        assert abs(g - e) <= tol, (t, g, e)
    if expected.ids is None:
        return
    cands = result.candidates
    for t, ids in enumerate(expected.ids):
        n = len(ids)
        assert cands.ids[t, :n].tolist() == ids, t
        assert cands.mask[t, :n].all() and not cands.mask[t, n:].any(), t
        for g, e in zip(cands.weights[t, :n].tolist(), expected.weights[t], strict=True):  # type: ignore[index]
            assert abs(g - e) <= atol, (t, g, e)
    if expected.tails is None:
        assert cands.student_tail_logprobs is None and cands.teacher_tail_logprobs is None
        return
    got_s = cands.student_tail_logprobs.tolist()
    got_t = cands.teacher_tail_logprobs.tolist()
    assert len(got_s) == len(got_t) == len(expected.tails)
    for t, (ls, lt) in enumerate(expected.tails):
        assert abs(got_s[t] - ls) <= 1e-6 * abs(ls) + 1e-9, (t, got_s[t], ls)
        assert abs(got_t[t] - lt) <= 1e-6 * abs(lt) + 1e-9, (t, got_t[t], lt)


def assert_all_scored(
    out: list[Any],
    teacher: Any,
    student: Any = None,
    *,
    top_k: int = 0,
    strategy: str = "only-student",
) -> None:
    """Every item is a ScoredSample that matches :func:`expected_result` of its own sample
    (its tokens and rollout logprobs; ``student_p`` weights). ``student`` defaults to the
    teacher's model (fleets of one model scoring samples without rollout logprobs)."""
    for item in out:
        assert isinstance(item, ScoredSample), (item.reason, item.message)
        rollout = item.sample.rollout_logprobs
        exp = expected_result(
            tokens=list(item.sample.tokens),
            response_length=item.sample.response_length,
            teacher=teacher,
            student=teacher if student is None else student,
            top_k=top_k,
            strategy=strategy,
            weight_mode="student_p",
            rollout_logprobs=None if rollout is None else list(rollout),
        )
        assert_matches(item, exp)
