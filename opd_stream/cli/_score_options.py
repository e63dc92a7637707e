"""The command line of ``opd-stream score``: its options (:func:`add_score_arguments`) and
the configuration they give (:func:`score_config`: ``OPD_STREAM_*`` variables, then flags);
the teachers of ``--teacher`` flags (:func:`flag_teachers`, ``probe``'s too)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any, get_args

from .._errors import ConfigError
from .._logging import LOG_LEVELS
from ..config._settings import CacheSalt, IdScoring, StreamConfig
from ..fleet._engines import ENGINE_SETTINGS
from ..fleet._ensemble import is_ensemble_text
from ..fleet._routing import DEFAULT_TEACHER, Teacher, normalize_teachers
from ..kl._names import Divergence, Strategy, WeightMode
from ._score_files import DEFAULT_MAX_LINE_BYTES, UsageError

__all__ = (
    "add_engine_arguments",
    "add_score_arguments",
    "engine_overrides",
    "flag_teachers",
    "score_config",
)

_TEACHERS_VAR = "OPD_STREAM_TEACHERS"


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    """Declare the options of ``opd-stream score`` on ``p``."""
    p.add_argument(
        "--teacher",
        action="append",
        metavar="NAME=URL",
        help="a teacher server (repeatable); replicas joined with '|'; a weighted ensemble "
        "as NAME=W*URLS;W*URLS (weights summing to 1); a value without a name (a URL, "
        "replicas or W*URLS;W*URLS) is the teacher 'default'; required unless "
        "OPD_STREAM_TEACHERS is set (the flags then replace it)",
    )
    p.add_argument(
        "--default-teacher",
        metavar="NAME",
        help="teacher of lines that name none (default: the first --teacher)",
    )
    p.add_argument("--student-url", metavar="URL", help="student scoring server")
    p.add_argument("--input", required=True, metavar="PATH", help="JSON Lines input ('-': stdin)")
    p.add_argument(
        "--output", required=True, metavar="PATH", help="JSON Lines output ('-': stdout)"
    )
    p.add_argument("--top-k", type=int, help="0 = sampled-token mode; > 0 = top-k mode")
    p.add_argument("--strategy", choices=get_args(Strategy), help="top-k candidate set")
    p.add_argument("--weight-mode", choices=get_args(WeightMode), help="candidate weights")
    p.add_argument(
        "--divergence",
        choices=get_args(Divergence),
        help="top-k signal: reverse_kl (default), forward_kl (with --weight-mode teacher_p) or jsd",
    )
    p.add_argument("--jsd-beta", type=float, help="beta of --divergence jsd, in (0, 1)")

    add_engine_arguments(p)
    p.add_argument("--id-scoring", choices=get_args(IdScoring), help="how ids are scored")
    p.add_argument("--max-inflight", type=int, help="samples in the pipeline at once")
    p.add_argument(
        "--request-deadline-s", type=float, help="budget of one logical request, in seconds"
    )
    p.add_argument(
        "--cache-salt",
        choices=get_args(CacheSalt),
        help="SGLang cache_salt on scoring requests: none (default), weight-version (the "
        "server's weight version: a fresh cache per weight update), per-sample or "
        "per-request (debugging: no prefix reuse within a GRPO group)",
    )
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="read the API key from environment variable VAR (never from the command line)",
    )
    p.add_argument(
        "--student-tokenizer",
        metavar="PATH",
        help="the student's tokenizer.json (or a directory holding one); needed with "
        "--teacher-tokenizer",
    )
    p.add_argument(
        "--teacher-tokenizer",
        action="append",
        metavar="NAME=PATH",
        help="a teacher with its own tokenizer (repeatable): its tokenizer.json or a "
        "directory holding one (sampled-token mode or top-k only-student; see "
        "docs/cross-tokenizer.md in the repository); such a teacher's lines need "
        "teacher_prompt_ids or prompt_messages",
    )
    p.add_argument(
        "--with-alignment",
        action="store_true",
        help="include the span alignment of a teacher with its own tokenizer",
    )
    p.add_argument("--ordered", action="store_true", help="write results in input order")
    p.add_argument(
        "--with-candidates",
        action="store_true",
        help="include the per-candidate arrays in top-k mode (large)",
    )
    p.add_argument(
        "--max-line-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_LINE_BYTES,
        metavar="N",
        help="longest input line, in bytes; a longer line fails alone "
        f"(default {DEFAULT_MAX_LINE_BYTES >> 20} MiB)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--fail-on-error", action="store_true", help="exit 1 when any sample failed")
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,  # keeps a value given before the sub-command
        help="structlog level, also accepted before 'score' (default warning)",
    )


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """``--engine`` and ``--server-engine`` (``score``, ``probe``)."""
    p.add_argument(
        "--engine",
        choices=ENGINE_SETTINGS,
        help="the servers' dialect: auto (default: SGLang, detected per server otherwise), "
        "sglang, vllm (vLLM's scale-out API, vllm serve --enable-scale-out: every strategy) "
        "or vllm-completions (/v1/completions, any vLLM: sampled-token mode and the "
        "teacher's top-k only; every prompt row recomputed and sent back, no prefix reuse)",
    )
    p.add_argument(
        "--server-engine",
        action="append",
        metavar="URL=ENGINE",
        help="one server's engine where servers differ (repeatable); the flags replace "
        "OPD_STREAM_SERVER_ENGINES",
    )
    p.add_argument(
        "--vllm-max-logprobs",
        type=int,
        metavar="N",
        help="the vLLM servers' --max-logprobs (default 20; -1 = unbounded): ids per "
        "position beyond it are split into several requests",
    )


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of :func:`add_engine_arguments`' flags that were given."""
    out: dict[str, Any] = {}
    if getattr(args, "engine", None) is not None:
        out["engine"] = args.engine
    if getattr(args, "server_engine", None):
        out["server_engines"] = list(args.server_engine)
    if getattr(args, "vllm_max_logprobs", None) is not None:
        out["vllm_max_logprobs"] = args.vllm_max_logprobs
    return out


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# StreamConfig fields with a flag of the same name (``--top-k`` -> ``top_k``); unset = env.
_FLAG_FIELDS = (
    "student_url",
    "top_k",
    "strategy",
    "weight_mode",
    "divergence",
    "jsd_beta",
    "id_scoring",
    "max_inflight",
    "request_deadline_s",
    "cache_salt",
)


def score_config(args: argparse.Namespace) -> tuple[StreamConfig, str]:
    """The configuration (env, then flags) and the default teacher's name."""
    env_teachers: dict[str, Teacher] | None = None
    if _TEACHERS_VAR in os.environ:  # validated even when --teacher replaces it
        try:
            env_teachers = normalize_teachers(os.environ[_TEACHERS_VAR].strip())
        except ConfigError as exc:
            raise UsageError(f"{_TEACHERS_VAR}: {exc}") from None
    if args.teacher:
        try:
            # a plain URL (no NAME=) is the teacher "default", as in OPD_STREAM_TEACHERS
            teachers = flag_teachers(args.teacher)
        except ConfigError as exc:
            raise UsageError(f"--teacher: {exc}") from None
    elif env_teachers is not None:
        teachers = env_teachers
    else:
        raise UsageError(f"--teacher is required (or set {_TEACHERS_VAR})")
    default = args.default_teacher if args.default_teacher is not None else next(iter(teachers))
    if default not in teachers:
        raise UsageError(
            f"--default-teacher {default!r} is not a configured teacher "
            f"(known: {', '.join(sorted(teachers))})"
        )
    overrides: dict[str, Any] = {"teachers": teachers}
    for field in _FLAG_FIELDS:
        value = getattr(args, field)
        if value is not None:
            overrides[field] = value
    overrides.update(engine_overrides(args))
    if args.ordered:
        overrides["order"] = "input"
    if getattr(args, "student_tokenizer", None) is not None:
        overrides["student_tokenizer"] = args.student_tokenizer
    if getattr(args, "teacher_tokenizer", None):
        overrides["teacher_tokenizers"] = list(args.teacher_tokenizer)
    if getattr(args, "with_alignment", False):
        overrides["return_alignment"] = True
    if args.api_key_env is not None:
        key = os.environ.get(args.api_key_env, "")
        if not key.strip():
            raise UsageError(
                f"--api-key-env: environment variable {args.api_key_env} is not set or empty"
            )
        overrides["api_key"] = key.strip()
    try:
        cfg = StreamConfig.from_env(**overrides)
    except ConfigError as exc:
        raise UsageError(f"configuration: {exc}") from None
    if args.with_candidates and cfg.top_k == 0:
        raise UsageError("--with-candidates needs top-k mode (--top-k > 0)")
    return cfg, default


def flag_teachers(entries: Sequence[str]) -> dict[str, Teacher]:
    """The teachers that the ``--teacher`` flags ``entries`` name (``score``, ``probe``).

    Each flag is a ``NAME=URL`` entry or, without a name, a value of the teacher
    ``default`` spelled as in ``OPD_STREAM_TEACHERS``: a URL, replicas joined with ``|``,
    or a weighted ensemble ``W*URLS;W*URLS``. Several flags without a name are replicas of
    ``default``.

    Raises:
        ConfigError: a bad entry, name, URL or ensemble; an ensemble given with other
            values of ``default``.
    """
    values = [entry.strip() for entry in entries]
    plain = [v for v in values if _is_plain(v)]
    if len(values) == 1 and plain:
        # one value of the teacher 'default': a URL, replicas or an ensemble
        return normalize_teachers({DEFAULT_TEACHER: values[0]})
    if len(values) > 1 and any(is_ensemble_text(v) for v in plain):
        raise ConfigError(
            "an ensemble (W*URLS;W*URLS) is one --teacher value: give it alone, or name it "
            "(NAME=W*URLS;W*URLS)"
        )
    return normalize_teachers(values)


def _is_plain(value: str) -> bool:
    """A value without a name: a ``://`` comes before any ``=`` (as teacher routing reads it)."""
    scheme_at = value.find("://")
    equals_at = value.find("=")
    return scheme_at >= 0 and (equals_at < 0 or scheme_at < equals_at)
