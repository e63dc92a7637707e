"""The KL math's names and constants, without torch (importing :mod:`opd_stream` must not
load torch: it is loaded only where tensors are made, see :mod:`opd_stream.kl._math`)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = (
    "DIVERGENCES",
    "LOGPROB_FLOOR",
    "STRATEGIES",
    "TAIL_MIN",
    "WEIGHT_MODES",
    "Divergence",
    "Strategy",
    "WeightMode",
    "divergence_weight_problem",
)

LOGPROB_FLOOR = -1e4
"""Every logprob (``-inf`` included) is clamped to at least this before any arithmetic."""

TAIL_MIN = 1e-6
"""The tail bucket's smallest mass (``tail=True``): the candidates' mass is clamped to at most
``1 - TAIL_MIN`` before ``log(1 - mass)``."""

Strategy = Literal["only-student", "only-teacher", "intersection", "union", "xor"]
"""How the candidate set is chosen (``docs/semantics.md``, "Top-k mode")."""

WeightMode = Literal["student_p", "teacher_p", "none"]
"""How candidates are weighted (``docs/semantics.md``, "Weights")."""

Divergence = Literal["reverse_kl", "forward_kl", "jsd"]
"""Which per-position divergence the top-k signal is (docs/semantics.md, "The signal")."""

STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
WEIGHT_MODES: tuple[WeightMode, ...] = get_args(WeightMode)
DIVERGENCES: tuple[Divergence, ...] = get_args(Divergence)


def divergence_weight_problem(divergence: str, weight_mode: str, tail: bool) -> str | None:
    """Why ``weight_mode`` makes no sense with ``divergence`` (and ``tail``), or None.

    * ``reverse_kl`` takes every weight mode (the reference's), but the tail bucket's
      weights are the student's probabilities: ``student_p``;
    * ``forward_kl`` is ``sum w(v) (t(v) - s(v))`` weighted by the teacher: ``teacher_p``
      (``student_p`` or ``none`` would weigh a teacher-minus-student log-ratio by the
      student or uniformly, which is minus a reverse-KL estimate, not a forward KL);
    * ``jsd`` weighs each of its two terms by its own side's probabilities, so no weight
      mode applies: it takes the default, ``student_p``, only.
    """
    if divergence == "forward_kl" and weight_mode != "teacher_p":
        return (
            "divergence forward_kl weighs the log-ratios t - s by the teacher's "
            f"probabilities; set weight_mode teacher_p (got {weight_mode})"
        )
    if divergence == "jsd" and weight_mode != "student_p":
        return (
            "divergence jsd weighs each of its two terms by its own side's probabilities, "
            f"so weight_mode does not apply; leave it at student_p (got {weight_mode})"
        )
    if divergence == "reverse_kl" and tail and weight_mode != "student_p":
        return (
            "the tail bucket weighs candidates by the student's probabilities; "
            f"set weight_mode student_p (got {weight_mode})"
        )
    return None
