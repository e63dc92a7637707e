"""The rules between :class:`~opd_stream.StreamConfig` fields, and the check that runs
them after every field on its own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from ..fleet._engines import configured_engine
from ..fleet._ensemble import Ensemble
from ..kl._names import divergence_weight_problem
from ..kl._plan import STRATEGY_NEEDS
from ..wire._request import Engine
from ..wire._vllm import engine_problem
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


def _vllm_max_logprobs_not_zero(v: Settings) -> str | None:
    if v["vllm_max_logprobs"] == 0:
        return "must be -1 (unbounded) or >= 1, got 0 (a scoring row needs one logprob at least)"
    return None


def _server_engines_name_servers(v: Settings) -> str | None:
    servers = set(_servers(v))
    unknown = [url for url in v["server_engines"] if url not in servers]
    if unknown:
        return (
            f"names no configured server: {', '.join(unknown)} (the teachers' replicas and "
            "members, and student_url; URLs are compared normalised)"
        )
    return None


def _servers(v: Settings) -> dict[str, str]:
    """Every configured server URL -> how a message names it."""
    out: dict[str, str] = {}
    for name, teacher in v["teachers"].items():
        if isinstance(teacher, Ensemble):
            for i, member in enumerate(teacher.members):
                for url in member:
                    out.setdefault(url, f"teacher {name!r} ({teacher.member_name(i)})")
        else:
            for url in teacher:
                out.setdefault(url, f"teacher {name!r}")
    if v.get("student_url") is not None:
        out.setdefault(v["student_url"], "the student")
    return out


def _asks(v: Settings, who: str) -> tuple[int, bool]:
    """(the top-k, whether ids per position) a strategy asks of server ``who`` (a name
    from :func:`_servers`) at most."""
    k = v["top_k"]
    if k == 0:
        return 0, False  # sampled-token mode: the sampled token's logprob, nothing else
    needs = STRATEGY_NEEDS[v["strategy"]]
    if who == "the student":
        # its top-k is asked only of samples without the rollout's: a top-k beyond its
        # --max-logprobs fails those samples (reason capability, naming the flag to raise)
        return 0, needs.student_scores_teacher_ids
    ensemble = "member" in who and needs.teacher_topk  # its members score the union's ids
    return (k if needs.teacher_topk else 0), needs.teacher_scores_student_ids or ensemble


def _engines_serve_strategy(v: Settings) -> str | None:
    setting, by_url = v["engine"], v["server_engines"]
    limit = v.get("vllm_max_logprobs", 20)
    problems: dict[str, list[str]] = {}
    for url, who in _servers(v).items():
        engine: Engine | None = configured_engine(url, setting, by_url)
        if engine is None:
            continue  # auto: checked per request once known (a failure reason capability)
        top_k, ids = _asks(v, who)
        problem = engine_problem(engine, top_k=top_k, ids=ids, max_logprobs=max(limit, 0))
        if problem is not None:
            problems.setdefault(problem, []).append(f"{who} at {url} ({engine})")
    if not problems:
        return None
    mode = (
        f"strategy {v['strategy']} with top_k {v['top_k']}"
        if v["top_k"] > 0
        else "sampled-token mode"
    )
    return "; ".join(
        f"{', '.join(servers)} cannot serve {mode}: {problem}"
        for problem, servers in problems.items()
    )


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
    (("vllm_max_logprobs",), _vllm_max_logprobs_not_zero),
    (("server_engines", "teachers", "student_url"), _server_engines_name_servers),
    (
        ("engine", "server_engines", "strategy", "top_k", "teachers", "student_url"),
        _engines_serve_strategy,
    ),
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
