"""Which requests a sample needs, per strategy (opd-semantics §4), as pure data.

A top-k sample needs up to four things: the student top-k ``S`` (from the rollout, or
fetched from the student server), the teacher top-k ``T``, the teacher's logprobs of the
``S`` ids, and the student's logprobs of the ``T`` ids. The teacher request always
returns the teacher's logprob of every sampled token as well.
"""

from __future__ import annotations

import msgspec

from ._kltypes import Strategy

__all__ = ("RequestPlan", "plan_requests")


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
    uses_s = strategy in ("only-student", "intersection", "union", "xor")
    uses_t = strategy in ("only-teacher", "intersection", "union", "xor")
    return RequestPlan(
        fetch_student_topk=uses_s and not have_student_topk,
        teacher_topk=uses_t,
        teacher_scores_student_ids=strategy in ("only-student", "union", "xor"),
        student_scores_teacher_ids=strategy in ("only-teacher", "union", "xor"),
    )
