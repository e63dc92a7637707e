"""The KL math's names and constants, without torch (importing :mod:`opd_stream` must not
load torch: it is loaded only where tensors are made, see :mod:`opd_stream._kl`)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ("LOGPROB_FLOOR", "STRATEGIES", "TAIL_MIN", "WEIGHT_MODES", "Strategy", "WeightMode")

LOGPROB_FLOOR = -1e4
"""Every logprob (``-inf`` included) is clamped to at least this before any arithmetic."""

TAIL_MIN = 1e-6
"""The tail bucket's smallest mass (``tail=True``): the candidates' mass is clamped to at most
``1 - TAIL_MIN`` before ``log(1 - mass)``."""

Strategy = Literal["only-student", "only-teacher", "intersection", "union", "xor"]
"""How the candidate set is chosen (spec §2)."""

WeightMode = Literal["student_p", "teacher_p", "none"]
"""How candidates are weighted (spec §3)."""

STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
WEIGHT_MODES: tuple[WeightMode, ...] = get_args(WeightMode)
