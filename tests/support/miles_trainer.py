"""What Miles' trainer does with the OPD fields a sample carries: ``apply_opd_kl_to_advantages``
(``miles/backends/training_utils/loss_hub/opd.py``, radixark/miles 31f1ca961, lines 8-94).

Run from Miles' own source where a copy of its repository is at hand (``MILES_REPO``: a git
directory, bare or not; this machine's mirror by default): the file and the one it imports
(``miles/utils/types.py``: torch, numpy and the standard library) are extracted at test time
into a temporary package and imported. Elsewhere the same arithmetic as documented there:
``opd_reverse_kl`` when the batch has it (line 33: precomputed, used as is, line 54), else
``reverse_kl = student_log_probs - teacher_log_probs`` per token (line 89), and in both cases
``advantages <- advantages - opd_kl_coef * reverse_kl`` (lines 54, 90).
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from typing import Any

import torch

from opd_stream.testing._miles_source import MILES_TRAINER_FILES, load_miles_module, miles_repo

__all__ = ("SOURCE", "trainer_signal")


def _documented(
    args: Namespace,
    rollout_data: dict[str, Any],
    advantages: list[torch.Tensor],
    student_log_probs: list[torch.Tensor] | None,
) -> None:
    """The module docstring's formula (Miles' lines 33, 54, 89, 90)."""
    if student_log_probs is None:
        return
    pre = rollout_data.get("opd_reverse_kl")
    if pre is not None:
        kls = list(pre)
    else:
        teacher = rollout_data["teacher_log_probs"]
        kls = [s - t for s, t in zip(student_log_probs, teacher, strict=True)]
    for i, kl in enumerate(kls):
        advantages[i] = advantages[i] - args.opd_kl_coef * kl
    rollout_data["opd_reverse_kl"] = kls


def _load() -> tuple[Callable[..., None], str]:
    module = load_miles_module(MILES_TRAINER_FILES, "miles.backends.training_utils.loss_hub.opd")
    if module is not None:
        fn: Callable[..., None] = module.apply_opd_kl_to_advantages
        return fn, f"Miles' opd.py from {miles_repo()}"
    return _documented, "the formula documented in Miles' opd.py"


_APPLY, SOURCE = _load()
"""Miles' function (or the documented formula), and which of the two it is."""


def trainer_signal(
    fields: dict[str, torch.Tensor], student_log_probs: torch.Tensor
) -> torch.Tensor:
    """The per-token signal Miles' trainer applies for one sample (``opd_kl_coef = 1`` on
    zero advantages: ``-advantages``), from the fields the sample carries
    (``teacher_log_probs`` or ``opd_reverse_kl``, float32 ``[R]``) and the student logprobs
    the trainer uses (float32 ``[R]``)."""
    args = Namespace(use_opd=True, opd_type="sglang", opd_kl_coef=1.0)
    rollout_data: dict[str, Any] = {name: [value] for name, value in fields.items()}
    advantages = [torch.zeros_like(student_log_probs)]
    _APPLY(args, rollout_data, advantages, [student_log_probs])
    return -advantages[0]
