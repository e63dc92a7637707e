"""The tensor contract of the top-k KL: :class:`TopKBatch` (inputs), :class:`TopKResult`
(outputs), which inputs each strategy reads (:func:`needed_inputs`), and the checks of a
batch's fields (:func:`checked_fields`). The math is :mod:`opd_stream.kl._math`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, NamedTuple

import torch
from torch import Tensor

from .._deprecated import warn_renamed
from ._names import STRATEGIES, Strategy
from ._plan import STRATEGY_NEEDS, StrategyNeeds

__all__ = (
    "TopKBatch",
    "TopKResult",
    "checked_fields",
    "empty_topk_result",
    "needed_inputs",
)

_FIELDS = (
    "student_ids",
    "student_lp",
    "teacher_on_student",
    "teacher_ids",
    "teacher_lp",
    "student_on_teacher",
)


def _fields_read(needs: StrategyNeeds) -> frozenset[str]:
    """The batch fields that hold what ``needs`` says a strategy reads."""
    return frozenset(
        (["student_ids", "student_lp"] if needs.student_topk else [])
        + (["teacher_ids", "teacher_lp"] if needs.teacher_topk else [])
        + (["teacher_on_student"] if needs.teacher_scores_student_ids else [])
        + (["student_on_teacher"] if needs.student_scores_teacher_ids else [])
    )


_NEEDED: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {strategy: _fields_read(needs) for strategy, needs in STRATEGY_NEEDS.items()}
)
"""Strategy -> the fields it reads: read from :data:`~opd_stream.kl._plan.STRATEGY_NEEDS`."""


class TopKBatch(NamedTuple):
    """The inputs of :func:`topk_reverse_kl` for a padded batch of samples.

    Every tensor is ``[B, R, K]`` (``R`` = the longest response in the batch) on one device;
    a field a strategy does not need (see :func:`needed_inputs`) may be ``None``.  Student
    fields have width ``Ks``, teacher fields ``Kt`` (normally equal).  Values at padding
    positions (``valid`` False) are ignored, whatever they are.

    Attributes:
        student_ids: int64, ``S``: the student top-k ids, best first.
        student_lp: float32, student logprob of each ``S`` id (from the student's own top-k).
        teacher_on_student: float32, teacher logprob of each ``S`` id (the teacher scored ``S``).
        teacher_ids: int64, ``T``: the teacher top-k ids, best first.
        teacher_lp: float32, teacher logprob of each ``T`` id.
        student_on_teacher: float32, student logprob of each ``T`` id (the student scored ``T``).
        valid: bool ``[B, R]``; False on padding positions.
    """

    student_ids: Tensor | None
    student_lp: Tensor | None
    teacher_on_student: Tensor | None
    teacher_ids: Tensor | None
    teacher_lp: Tensor | None
    student_on_teacher: Tensor | None
    valid: Tensor


class TopKResult(NamedTuple):
    """The output of :func:`topk_reverse_kl` and :func:`topk_divergence`.

    The candidate axis ``C`` is ``Ks`` (only-student, intersection), ``Kt`` (only-teacher) or
    ``Ks + Kt`` (union, xor).  The selected candidates of a position are packed to the front
    of the ``C`` axis in the strategy's order (``docs/semantics.md``, "Top-k mode"); the
    remaining slots hold id ``-1``, logprobs ``0``, weight ``0`` and mask False.  Padding
    positions have no selected candidate.

    Attributes:
        signal: float32 ``[B, R]``: ``r_t``, the per-token signal of the divergence asked
            (the reverse KL unless :func:`topk_divergence` was asked for another); 0 where
            nothing is selected or on padding. (Before 1.0 this field was ``reverse_kl``,
            a name still readable for one release, with a ``DeprecationWarning``.)
        ids: int64 ``[B, R, C]``: candidate token ids.
        student_lp: float32 ``[B, R, C]``: student logprob of each candidate (floored).
        teacher_lp: float32 ``[B, R, C]``: teacher logprob of each candidate (floored).
        weights: float32 ``[B, R, C]``: the candidate weights ``w(v)`` (with ``tail``:
            ``exp(s(v))``; forward_kl: the teacher's, ``exp(t(v))`` with ``tail``; jsd: the
            mixture's probabilities of the candidates).
        mask: bool ``[B, R, C]``: True on selected candidates.
        student_tail_lp: float32 ``[B, R]``, only with ``tail`` (else None):
            ``log S_tail``, the student's log-mass outside the candidates (0 where nothing
            is selected or on padding).
        teacher_tail_lp: float32 ``[B, R]``, only with ``tail`` (else None): ``log T_tail``.
    """

    signal: Tensor
    ids: Tensor
    student_lp: Tensor
    teacher_lp: Tensor
    weights: Tensor
    mask: Tensor
    student_tail_lp: Tensor | None = None
    teacher_tail_lp: Tensor | None = None

    @property
    def reverse_kl(self) -> Tensor:
        """Deprecated: :attr:`signal` (whichever divergence was asked)."""
        warn_renamed("TopKResult.reverse_kl", "TopKResult.signal")
        return self.signal


def needed_inputs(strategy: Strategy) -> frozenset[str]:
    """Name the :class:`TopKBatch` fields that ``strategy`` reads (besides ``valid``).

    Args:
        strategy: One of :data:`STRATEGIES`.

    Returns:
        only-student: ``student_ids``, ``student_lp``, ``teacher_on_student``;
        only-teacher: ``teacher_ids``, ``teacher_lp``, ``student_on_teacher``;
        intersection: ``student_ids``, ``student_lp``, ``teacher_ids``, ``teacher_lp``;
        union and xor: all six.

    Raises:
        ValueError: ``strategy`` is not one of :data:`STRATEGIES`.
    """
    try:
        return _NEEDED[strategy]
    except KeyError:
        raise ValueError(
            f"unknown top-k strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}"
        ) from None


def empty_topk_result(b: int, r: int, c: int, device: torch.device, tail: bool) -> TopKResult:
    """The result of a batch with nothing to select (``B * R == 0`` or ``C == 0``)."""

    def f32(*shape: int) -> Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=device)

    return TopKResult(
        signal=f32(b, r),
        ids=torch.full((b, r, c), -1, dtype=torch.int64, device=device),
        student_lp=f32(b, r, c),
        teacher_lp=f32(b, r, c),
        weights=f32(b, r, c),
        mask=torch.zeros((b, r, c), dtype=torch.bool, device=device),
        student_tail_lp=f32(b, r) if tail else None,
        teacher_tail_lp=f32(b, r) if tail else None,
    )


def checked_fields(batch: TopKBatch, strategy: str, needed: frozenset[str]) -> dict[str, Tensor]:
    """Return the needed fields by name after checking presence, shapes, dtypes and devices."""
    valid = batch.valid
    if valid.dtype != torch.bool or valid.dim() != 2:
        raise ValueError(
            f"valid must be a bool [B, R] tensor, got {valid.dtype} of shape {tuple(valid.shape)}"
        )
    fields: dict[str, Tensor] = {}
    for name in _FIELDS:
        if name not in needed:
            continue
        x = getattr(batch, name)
        if x is None:
            raise ValueError(
                f"strategy {strategy!r} needs TopKBatch.{name}, which is None "
                f"(it needs {', '.join(f for f in _FIELDS if f in needed)})"
            )
        if x.dim() != 3 or tuple(x.shape[:2]) != tuple(valid.shape):
            raise ValueError(
                f"TopKBatch.{name} has shape {tuple(x.shape)}; expected "
                f"[{valid.shape[0]}, {valid.shape[1]}, K] to match valid"
            )
        if x.device != valid.device:
            raise ValueError(f"TopKBatch.{name} is on {x.device}, valid on {valid.device}")
        is_ids = name.endswith("_ids")
        if is_ids and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
            raise ValueError(f"TopKBatch.{name} must hold integer ids, got {x.dtype}")
        if not is_ids and not x.dtype.is_floating_point:
            raise ValueError(f"TopKBatch.{name} must hold float logprobs, got {x.dtype}")
        fields[name] = x
    for ids_name, partners in (
        ("student_ids", ("student_lp", "teacher_on_student")),
        ("teacher_ids", ("teacher_lp", "student_on_teacher")),
    ):
        present = [f for f in (ids_name, *partners) if f in fields]
        widths = {fields[f].shape[-1] for f in present}
        if len(widths) > 1:
            shapes = ", ".join(f"{f}={tuple(fields[f].shape)}" for f in present)
            raise ValueError(f"top-k widths disagree: {shapes}")
    return fields
