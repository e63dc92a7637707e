"""The KL building blocks, for trainers that compute signals from their own arrays.

Importing this module imports torch. The stream uses these internally.

* :func:`topk_reverse_kl` over a :class:`TopKBatch` gives a :class:`TopKResult` (the
  per-position signal and the per-candidate arrays), for every strategy in
  :data:`STRATEGIES` and weight mode in :data:`WEIGHT_MODES`;
* :func:`topk_divergence`: the same with another :data:`Divergence` (``forward_kl``,
  TRL's generalized ``jsd`` with its ``beta``), tail bucket or not;
* :func:`sampled_reverse_kl`: the sampled-token estimate ``student_lp - teacher_lp``;
* :data:`LOGPROB_FLOOR`: the value a ``-inf`` logprob takes inside the candidate math.

The exact semantics are in ``docs/semantics.md``.
"""

from __future__ import annotations

from ._kl import TopKBatch, TopKResult, sampled_reverse_kl, topk_divergence, topk_reverse_kl
from ._kltypes import (
    DIVERGENCES,
    LOGPROB_FLOOR,
    STRATEGIES,
    WEIGHT_MODES,
    Divergence,
    Strategy,
    WeightMode,
)

__all__ = (
    "DIVERGENCES",
    "Divergence",
    "LOGPROB_FLOOR",
    "STRATEGIES",
    "WEIGHT_MODES",
    "Strategy",
    "TopKBatch",
    "TopKResult",
    "WeightMode",
    "sampled_reverse_kl",
    "topk_divergence",
    "topk_reverse_kl",
)
