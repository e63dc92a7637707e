"""Miles' reference OPD flags -> :class:`~opd_stream.StreamConfig`
(:func:`config_from_miles_args`), with the reference's validation rules and wording."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

from ..._errors import ConfigError
from ...config._settings import StreamConfig
from ...fleet._routing import parse_teacher_urls

__all__ = ("STRATEGIES", "WEIGHT_MODES", "config_from_miles_args")

STRATEGIES: Final = ("only-student", "only-teacher", "intersection", "union", "xor")
"""The reference's ``--opd-top-k-strategy`` choices."""
WEIGHT_MODES: Final = ("student_p", "teacher_p", "none")
"""The reference's ``--opd-reward-weight-mode`` choices."""

# Flag attribute -> the value that means "not set" (argparse defaults of the reference).
_OPD_FLAG_DEFAULTS: Final[dict[str, Any]] = {
    "opd_type": None,
    "opd_log_prob_top_k": 0,
    "opd_top_k_strategy": "only-student",
    "opd_reward_weight_mode": "student_p",
    "opd_topk_per_position": False,
    "opd_teacher_urls": None,
    "opd_teacher_key": "opd_teacher",
    "opd_cache_salt": None,
    "opd_student_tokenizer": None,
    "opd_teacher_tokenizers": None,
    "opd_divergence": None,
    "opd_jsd_beta": None,
    "opd_engine": None,
    "opd_server_engines": None,
    "opd_vllm_max_logprobs": None,
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_set(value: Any, default: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, (list, tuple)) and not value:
        return False
    return bool(value != default)


def _miles_teacher_entries(teacher_urls: Any) -> list[str]:
    """``--opd-teacher-urls`` as a list of entries, checked with the reference's rules and
    wording (split on the first ``=``; a malformed entry or a duplicate name is an error)."""
    entries: Iterable[Any] = (
        [e for e in teacher_urls.split(",") if e.strip()]
        if isinstance(teacher_urls, str)
        else teacher_urls
    )
    seen: set[str] = set()
    out: list[str] = []
    for entry in entries:
        if not isinstance(entry, str):
            raise ConfigError(f"Invalid --opd-teacher-urls entry {entry!r}; expected NAME=URL.")
        name, sep, url = entry.partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not name or not url:
            raise ConfigError(f"Invalid --opd-teacher-urls entry {entry!r}; expected NAME=URL.")
        if name in seen:
            raise ConfigError(f"Duplicate teacher name {name!r} in --opd-teacher-urls.")
        seen.add(name)
        out.append(entry)
    return out


def config_from_miles_args(
    args: Any, *, environ: Mapping[str, str] | None = None, **overrides: Any
) -> StreamConfig:
    """Map Miles' reference OPD flags (an ``argparse.Namespace``) to a :class:`StreamConfig`.

    Every field no flag sets comes from its ``OPD_STREAM_*`` environment variable
    (:meth:`StreamConfig.from_env`): ``OPD_STREAM_MAX_INFLIGHT``,
    ``OPD_STREAM_REQUEST_DEADLINE_S``, ``OPD_STREAM_ATTEMPT_TIMEOUT_S``,
    ``OPD_STREAM_API_KEY``, ... Where a flag and a variable both speak, the flag wins.

    Mapping (the reference's flags: ``docs/semantics.md``, "Its flags and outputs"):

    * ``--opd-teacher-urls NAME=URL ...`` (a list, or one comma-separated string) ->
      ``teachers``; without it ``--rm-url`` is the single teacher ``default``. A URL may end
      in ``/generate`` (Miles' spelling), or name several replicas joined with ``|``.
      (``OPD_STREAM_TEACHERS`` is always overridden: Miles needs one of those flags.)
    * ``--opd-teacher-key`` -> ``teacher_key``; ``--opd-log-prob-top-k`` -> ``top_k``;
      ``--opd-top-k-strategy`` -> ``strategy`` (ignored in sampled-token mode, as in the
      reference); ``--opd-reward-weight-mode`` -> ``weight_mode``. These always win (their
      argparse defaults are opd_stream's defaults).
    * ``--opd-topk-per-position`` -> ``id_scoring="per-position"`` (fail loudly on an
      unpatched server, like the reference); without it ``OPD_STREAM_ID_SCORING``, default
      ``auto`` (per-position where the server supports it, else position blocks: the same
      numbers as the reference's flat union, without its quadratic answers).
    * ``--sglang-router-ip/--sglang-router-port`` (both set) -> ``student_url``, else
      ``OPD_STREAM_STUDENT_URL``.
    * ``--opd-cache-salt none|weight-version|per-sample|per-request`` (opd_stream's own
      flag; add it to the job's parser, or use ``OPD_STREAM_CACHE_SALT``) -> ``cache_salt``.
    * ``--opd-student-tokenizer PATH`` -> ``student_tokenizer``;
      ``--opd-teacher-tokenizers NAME=PATH ...`` (a list, or one comma-separated string; one
      plain ``PATH``, alone or as a one-item list: the teacher ``default``) ->
      ``teacher_tokenizers`` (teachers with another tokenizer; not reference flags: Miles
      declares them only with this adapter). Such a teacher's context is rendered with its
      chat template (see :mod:`opd_stream.integrations.miles._turns`).
    * ``--opd-divergence`` -> ``divergence`` and ``--opd-jsd-beta`` -> ``jsd_beta``
      (opd_stream's own flags, for a Miles launcher that declares them: the reference has
      neither; absent or ``None``, ``OPD_STREAM_DIVERGENCE`` / ``OPD_STREAM_JSD_BETA``).
      Whatever the divergence, its signal goes where Miles' trainer reads the OPD signal,
      ``opd_reverse_kl``.
    * ``--opd-engine auto|sglang|vllm|vllm-completions`` -> ``engine``,
      ``--opd-server-engines URL=ENGINE ...`` (a list, or one comma-separated string) ->
      ``server_engines`` and ``--opd-vllm-max-logprobs N`` -> ``vllm_max_logprobs``
      (opd_stream's own flags, for teachers served by vLLM; absent or ``None``,
      ``OPD_STREAM_ENGINE`` / ``OPD_STREAM_SERVER_ENGINES`` /
      ``OPD_STREAM_VLLM_MAX_LOGPROBS``, default ``auto``: detected per server).
    * ``candidates`` is false: Miles reads the signal alone, so the per-candidate arrays
      are neither copied nor kept (an override may set it).
    * ``--sglang-router-request-timeout-secs`` (> 0) -> ``request_deadline_s``; absent,
      ``None`` or 0 leaves ``OPD_STREAM_REQUEST_DEADLINE_S`` or opd_stream's finite default
      (the reference would wait forever).

    Args:
        args: the parsed Miles arguments (any object with those attributes).
        environ: the variables to read; ``None`` reads ``os.environ``.
        **overrides: further :class:`StreamConfig` fields (they win over everything).

    Raises:
        ConfigError: (a ``ValueError``) the reference's validation rules (an OPD flag
            without ``--use-opd``; ``--opd-type`` other than ``sglang``; no teacher; a
            malformed or duplicate ``--opd-teacher-urls`` entry, in the reference's
            words), an unknown strategy or weight mode, an invalid ``OPD_STREAM_*``
            variable, or any StreamConfig problem; the message names the flag or variable.
    """

    def get(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    if not get("use_opd", False):
        set_flags = [
            _flag(name)
            for name, default in _OPD_FLAG_DEFAULTS.items()
            if _is_set(get(name), default)
        ]
        if set_flags:
            raise ConfigError(f"{', '.join(set_flags)} given without --use-opd")
        raise ConfigError("--use-opd is not set: there is nothing for opd_stream to score")
    opd_type = get("opd_type")
    if opd_type != "sglang":
        if get("opd_teacher_urls"):
            raise ConfigError(
                "--opd-teacher-urls is only supported with --opd-type=sglang "
                f"(--opd-type is {opd_type!r})."
            )
        raise ConfigError(
            f"--opd-type is {opd_type!r}: opd_stream scores against SGLang teacher servers, "
            "so it needs --opd-type sglang"
        )

    teacher_urls = get("opd_teacher_urls")
    teachers: Any
    if teacher_urls:
        entries = _miles_teacher_entries(teacher_urls)
        try:
            teachers = parse_teacher_urls(entries)
        except ConfigError as exc:
            raise ConfigError(f"--opd-teacher-urls: {exc}") from None
    elif get("rm_url"):
        teachers = str(get("rm_url"))
    else:
        raise ConfigError(
            "--opd-type sglang needs a teacher: set --rm-url (single teacher) or "
            "--opd-teacher-urls NAME=URL ..."
        )

    top_k = int(get("opd_log_prob_top_k", 0) or 0)
    if top_k < 0:
        raise ConfigError(f"--opd-log-prob-top-k must be >= 0, got {top_k}")
    strategy = get("opd_top_k_strategy", "only-student") or "only-student"
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"Unknown OPD top-k strategy: {strategy} "
            f"(--opd-top-k-strategy must be one of {', '.join(STRATEGIES)})"
        )
    weight_mode = get("opd_reward_weight_mode", "student_p") or "student_p"
    if weight_mode not in WEIGHT_MODES:
        raise ConfigError(
            f"Unknown OPD reward weight mode: {weight_mode} "
            f"(--opd-reward-weight-mode must be one of {', '.join(WEIGHT_MODES)})"
        )

    fields: dict[str, Any] = {
        "teachers": teachers,
        "teacher_key": get("opd_teacher_key") or "opd_teacher",
        "top_k": top_k,
        "strategy": strategy if top_k > 0 else "only-student",
        "weight_mode": weight_mode,
        "candidates": False,  # Miles reads the signal alone
    }
    for flag_name, field in (
        ("opd_divergence", "divergence"),
        ("opd_jsd_beta", "jsd_beta"),
        ("opd_engine", "engine"),
        ("opd_vllm_max_logprobs", "vllm_max_logprobs"),
    ):
        value = get(flag_name)
        if value is not None:
            fields[field] = value
    server_engines = get("opd_server_engines")
    if server_engines:
        fields["server_engines"] = (
            server_engines if isinstance(server_engines, str) else list(server_engines)
        )
    if get("opd_topk_per_position", False):
        fields["id_scoring"] = "per-position"
    ip, port = get("sglang_router_ip"), get("sglang_router_port")
    if ip and port:
        host = f"[{ip}]" if ":" in str(ip) else str(ip)
        fields["student_url"] = f"http://{host}:{int(port)}"
    if get("opd_cache_salt") is not None:
        fields["cache_salt"] = get("opd_cache_salt")
    timeout = get("sglang_router_request_timeout_secs")
    if timeout is not None and not isinstance(timeout, bool) and timeout > 0:
        if not math.isfinite(float(timeout)):
            raise ConfigError("--sglang-router-request-timeout-secs must be finite")
        fields["request_deadline_s"] = float(timeout)
    if get("opd_student_tokenizer"):
        fields["student_tokenizer"] = str(get("opd_student_tokenizer"))
    teacher_tokenizers = get("opd_teacher_tokenizers")
    if teacher_tokenizers:
        if not isinstance(teacher_tokenizers, str):
            teacher_tokenizers = list(teacher_tokenizers)
            if len(teacher_tokenizers) == 1 and isinstance(teacher_tokenizers[0], str):
                # argparse nargs='+' gives a list: one item reads as the string form does
                # (one plain path: the teacher default; or comma-separated NAME=PATH)
                teacher_tokenizers = teacher_tokenizers[0]
        fields["teacher_tokenizers"] = teacher_tokenizers
    fields.update(overrides)
    try:
        return StreamConfig.from_env(environ, **fields)
    except ConfigError as exc:
        flag = {
            "student_url": "--sglang-router-ip/--sglang-router-port",
            "strategy": "--opd-top-k-strategy",
            "teachers": "--rm-url/--opd-teacher-urls",
            "teacher_key": "--opd-teacher-key",
            "request_deadline_s": "--sglang-router-request-timeout-secs",
            "cache_salt": "--opd-cache-salt",
            "student_tokenizer": "--opd-student-tokenizer",
            "teacher_tokenizers": "--opd-teacher-tokenizers",
            "top_k": "--opd-log-prob-top-k",
            "divergence": "--opd-divergence",
            "jsd_beta": "--opd-jsd-beta",
            "weight_mode": "--opd-reward-weight-mode",
            "engine": "--opd-engine",
            "server_engines": "--opd-server-engines",
            "vllm_max_logprobs": "--opd-vllm-max-logprobs",
        }
        named = str(exc).split(":", 1)[0].replace(" (from", ",").split(", ")
        hints = [flag[name.strip()] for name in named if name.strip() in flag]
        hint = ", ".join(hints)
        raise ConfigError(f"{exc}" + (f" (Miles flags: {hint})" if hint else "")) from None
