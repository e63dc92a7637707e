"""The KL building blocks, for trainers that compute signals from their own arrays.

The stream uses these internally. The names computed with torch (the batch, the result
and the three functions) load torch on first use; the names of the choices do not, so
the settings can check them without torch.

* :func:`topk_reverse_kl` over a :class:`TopKBatch` gives a :class:`TopKResult` (the
  per-position signal and the per-candidate arrays), for every strategy in
  :data:`STRATEGIES` and weight mode in :data:`WEIGHT_MODES`;
* :func:`topk_divergence`: the same with another :data:`Divergence` (``forward_kl``,
  TRL's generalized ``jsd`` with its ``beta``), tail bucket or not;
* :func:`sampled_reverse_kl`: the sampled-token estimate ``student_lp - teacher_lp``;
* :data:`LOGPROB_FLOOR`: the value a ``-inf`` logprob takes inside the candidate math.

The exact semantics are in ``docs/semantics.md``.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._names import (
    DIVERGENCES,
    LOGPROB_FLOOR,
    STRATEGIES,
    WEIGHT_MODES,
    Divergence,
    Strategy,
    WeightMode,
)

if TYPE_CHECKING:
    from ._math import (
        TopKBatch,
        TopKResult,
        sampled_reverse_kl,
        topk_divergence,
        topk_reverse_kl,
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


def __getattr__(name: str) -> Any:
    """A public name not yet defined here is one of :mod:`opd_stream.kl._math`'s (they need
    torch): loaded on first use, then a plain attribute."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _math

    value = getattr(_math, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
