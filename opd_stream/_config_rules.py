"""The rules between :class:`~opd_stream.StreamConfig` fields, and the check that runs
them after every field on its own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from ._config_fields import FieldSpec, Invalid
from ._plan import STRATEGY_NEEDS

__all__ = ("RULES", "check_values")

Settings = dict[str, Any]
Rule = tuple[tuple[str, ...], Callable[[Settings], str | None]]


def _tail_needs_top_k(v: Settings) -> str | None:
    if v["tail"] and v["top_k"] == 0:
        return "the tail bucket applies to top-k mode; set top_k > 0"
    return None


def _tail_needs_student_weights(v: Settings) -> str | None:
    if v["tail"] and v["weight_mode"] != "student_p":
        return (
            "the tail bucket weighs candidates by the student's probabilities; "
            f"set weight_mode student_p (got {v['weight_mode']})"
        )
    return None


def _strategy_needs_top_k(v: Settings) -> str | None:
    if v["strategy"] != "only-student" and v["top_k"] == 0:
        return "strategy applies to top-k mode; set top_k > 0"
    return None


def _strategy_needs_student_server(v: Settings) -> str | None:
    if STRATEGY_NEEDS[v["strategy"]].student_scores_teacher_ids and v["student_url"] is None:
        return (
            f"strategy {v['strategy']} needs the student server to score the teacher's "
            "top-k ids; set student_url"
        )
    return None


def _backoff_grows(v: Settings) -> str | None:
    if v["backoff_max_s"] < v["backoff_initial_s"]:
        return (
            f"backoff_max_s ({v['backoff_max_s']:g}) must be >= backoff_initial_s "
            f"({v['backoff_initial_s']:g})"
        )
    return None


def _tokenizers_name_teachers(v: Settings) -> str | None:
    unknown = sorted(set(v["teacher_tokenizers"] or ()) - set(v["teachers"]))
    if unknown:
        return (
            f"names no configured teacher: {', '.join(map(repr, unknown))} "
            f"(teachers: {', '.join(map(repr, sorted(v['teachers'])))})"
        )
    return None


def _teacher_tokenizers_need_student(v: Settings) -> str | None:
    if v["teacher_tokenizers"] and v["student_tokenizer"] is None:
        return (
            "a teacher with its own tokenizer is compared with the student over the response's "
            "bytes, which needs the student's tokenizer too; set student_tokenizer"
        )
    return None


def _teacher_tokenizers_only_student(v: Settings) -> str | None:
    if v["teacher_tokenizers"] and v["top_k"] > 0 and v["strategy"] != "only-student":
        return (
            f"strategy {v['strategy']} reads the teacher's top-k, whose ids are in another "
            "vocabulary for a teacher with its own tokenizer; such teachers work in "
            "sampled-token mode (top_k = 0) or with strategy only-student (the student's "
            "candidates asked by their bytes)"
        )
    return None


RULES: Final[tuple[Rule, ...]] = (
    (("tail", "top_k"), _tail_needs_top_k),
    (("tail", "weight_mode"), _tail_needs_student_weights),
    (("strategy", "top_k"), _strategy_needs_top_k),
    (("strategy", "student_url"), _strategy_needs_student_server),
    (("backoff_max_s", "backoff_initial_s"), _backoff_grows),
    (("teacher_tokenizers", "teachers"), _tokenizers_name_teachers),
    (("teacher_tokenizers", "student_tokenizer"), _teacher_tokenizers_need_student),
    (("teacher_tokenizers", "top_k", "strategy"), _teacher_tokenizers_only_student),
)
"""(the fields a rule reads, named in its message; the check): in the order checked."""


def check_values(specs: Mapping[str, FieldSpec], values: Mapping[str, Any]) -> Settings:
    """Check each given field (in declaration order), then every rule whose fields are all
    given; return the normalised values.

    Raises:
        Invalid: the first problem found.
    """
    out = {name: spec.check(values[name]) for name, spec in specs.items() if name in values}
    for fields, rule in RULES:
        if all(name in out for name in fields):
            problem = rule(out)
            if problem is not None:
                raise Invalid(fields, problem)
    return out
