"""The rules between :class:`~opd_stream.StreamConfig` fields, and the check that runs
them after every field on its own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from ..fleet._ensemble import Ensemble
from ..kl._names import divergence_weight_problem
from ..kl._plan import STRATEGY_NEEDS
from ._fields import FieldSpec, Invalid

__all__ = ("RULES", "check_values")

Settings = dict[str, Any]
Rule = tuple[tuple[str, ...], Callable[[Settings], str | None]]


def _tail_needs_top_k(v: Settings) -> str | None:
    if v["tail"] and v["top_k"] == 0:
        return "the tail bucket applies to top-k mode; set top_k > 0"
    return None


def _tail_needs_student_weights(v: Settings) -> str | None:
    if v.get("divergence", "reverse_kl") != "reverse_kl":
        return None  # the divergence's own rule
    return divergence_weight_problem("reverse_kl", v["weight_mode"], v["tail"])


def _divergence_weights(v: Settings) -> str | None:
    if v["divergence"] == "reverse_kl":
        return None  # every weight mode; with the tail, see _tail_needs_student_weights
    return divergence_weight_problem(v["divergence"], v["weight_mode"], False)


def _divergence_needs_top_k(v: Settings) -> str | None:
    if v["divergence"] != "reverse_kl" and v["top_k"] == 0:
        return (
            f"divergence {v['divergence']} needs top-k mode (a sampled token is drawn from "
            "the student, so its log-ratio estimates only the reverse KL); set top_k > 0"
        )
    return None


def _jsd_beta_needs_jsd(v: Settings) -> str | None:
    if v["jsd_beta"] != 0.5 and v["divergence"] != "jsd":
        return f"jsd_beta applies to divergence jsd only (divergence is {v['divergence']})"
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


def _tokenizer_teachers_not_ensembles(v: Settings) -> str | None:
    mixed = sorted(
        name
        for name in v["teacher_tokenizers"] or ()
        if isinstance(v["teachers"].get(name), Ensemble)
    )
    if mixed:
        return (
            f"{', '.join(map(repr, mixed))} is an ensemble: a teacher with its own tokenizer "
            "is aligned with the student span by span, which is defined for one teacher "
            "vocabulary only; give the tokenizer to a plain teacher"
        )
    return None


RULES: Final[tuple[Rule, ...]] = (
    (("tail", "top_k"), _tail_needs_top_k),
    (("tail", "weight_mode"), _tail_needs_student_weights),
    (("divergence", "top_k"), _divergence_needs_top_k),
    (("divergence", "weight_mode"), _divergence_weights),
    (("jsd_beta", "divergence"), _jsd_beta_needs_jsd),
    (("strategy", "top_k"), _strategy_needs_top_k),
    (("strategy", "student_url"), _strategy_needs_student_server),
    (("backoff_max_s", "backoff_initial_s"), _backoff_grows),
    (("teacher_tokenizers", "teachers"), _tokenizers_name_teachers),
    (("teacher_tokenizers", "student_tokenizer"), _teacher_tokenizers_need_student),
    (("teacher_tokenizers", "top_k", "strategy"), _teacher_tokenizers_only_student),
    (("teacher_tokenizers", "teachers"), _tokenizer_teachers_not_ensembles),
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
