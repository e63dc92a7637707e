"""What each strategy needs, and so which requests a sample needs (``docs/semantics.md``,
"Which requests each strategy makes").

A top-k sample needs up to four things: the student top-k ``S`` (from the rollout, or
fetched from the student server), the teacher top-k ``T``, the teacher's logprobs of the
``S`` ids, and the student's logprobs of the ``T`` ids. The teacher request always
returns the teacher's logprob of every sampled token as well. :data:`STRATEGY_NEEDS` is
the one table of what each strategy reads; the configuration rules, the request plan and
the candidate width (:func:`candidate_width`) are read from it, and so are the
:class:`~opd_stream.kl._tensors.TopKBatch` fields each strategy reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal, NamedTuple

import msgspec

from ._names import Strategy

__all__ = (
    "STRATEGY_NEEDS",
    "CandidateColumns",
    "RequestPlan",
    "StrategyNeeds",
    "candidate_width",
    "plan_requests",
)

CandidateColumns = Literal["student", "teacher", "both"]
"""Whose top-k columns a strategy's candidates are: ``S``'s, ``T``'s, or ``S`` then ``T``."""


class StrategyNeeds(NamedTuple):
    """What one top-k strategy reads, and how wide its candidate set is."""

    student_topk: bool
    """``S``: the student's top-k ids and logprobs."""
    teacher_topk: bool
    """``T``: the teacher's top-k ids and logprobs."""
    teacher_scores_student_ids: bool
    """The teacher's logprobs of the ``S`` ids."""
    student_scores_teacher_ids: bool
    """The student's logprobs of the ``T`` ids (so the student server is needed)."""
    candidates: CandidateColumns
    """Whose top-k columns the candidate axis ``C`` holds (:func:`candidate_width`)."""

    @property
    def width(self) -> int:
        """Candidate columns per top-k slot: a result has ``width * top_k`` candidates."""
        return 2 if self.candidates == "both" else 1

    def candidate_width(self, ks: int, kt: int) -> int:
        """``C`` for a student top-k ``Ks`` wide and a teacher top-k ``Kt`` wide."""
        return {"student": ks, "teacher": kt, "both": ks + kt}[self.candidates]


STRATEGY_NEEDS: Final[Mapping[Strategy, StrategyNeeds]] = MappingProxyType(
    {
        "only-student": StrategyNeeds(True, False, True, False, candidates="student"),
        "only-teacher": StrategyNeeds(False, True, False, True, candidates="teacher"),
        "intersection": StrategyNeeds(True, True, False, False, candidates="student"),
        "union": StrategyNeeds(True, True, True, True, candidates="both"),
        "xor": StrategyNeeds(True, True, True, True, candidates="both"),
    }
)
"""Strategy -> what it reads: the one table (``STRATEGIES`` lists the same names)."""


def candidate_width(strategy: Strategy, ks: int, kt: int | None = None) -> int:
    """``C``, the candidate columns of a top-k result: ``Ks`` (only-student, intersection),
    ``Kt`` (only-teacher) or ``Ks + Kt`` (union, xor); ``kt`` defaults to ``ks``.

    Raises:
        KeyError: ``strategy`` is not one of ``STRATEGIES``.
    """
    return STRATEGY_NEEDS[strategy].candidate_width(ks, ks if kt is None else kt)


class RequestPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What to ask for one sample, in execution order.

    1. ``fetch_student_topk``: ask the student server for its top-k (``S`` was not given).
    2. the teacher request: ``teacher_topk`` (``top_logprobs_num = k``) and/or
       ``teacher_scores_student_ids`` (score the ``S`` ids); always the sampled tokens.
    3. ``student_scores_teacher_ids``: ask the student server to score the ``T`` ids
       (depends on the teacher's answer, so it runs after it).
    """

    fetch_student_topk: bool = False
    teacher_topk: bool = False
    teacher_scores_student_ids: bool = False
    student_scores_teacher_ids: bool = False

    @property
    def needs_student_server(self) -> bool:
        return self.fetch_student_topk or self.student_scores_teacher_ids


def plan_requests(top_k: int, strategy: Strategy, *, have_student_topk: bool) -> RequestPlan:
    """The requests a sample needs.

    Args:
        top_k: 0 for sampled-token mode (one teacher request, nothing else).
        strategy: the top-k candidate strategy.
        have_student_topk: the sample carries the student's top-k from the rollout.
    """
    if top_k == 0:
        return RequestPlan()
    needs = STRATEGY_NEEDS[strategy]
    return RequestPlan(
        fetch_student_topk=needs.student_topk and not have_student_topk,
        teacher_topk=needs.teacher_topk,
        teacher_scores_student_ids=needs.teacher_scores_student_ids,
        student_scores_teacher_ids=needs.student_scores_teacher_ids,
    )
