"""``StreamConfig``: every knob of ``opd_stream``, validated once at construction.

Precedence is explicit arguments, then ``OPD_STREAM_<FIELD>`` environment variables, then
the defaults. Every problem raises :class:`ConfigError` (a ``ValueError``) whose message
names the field, and the environment variable when the value came from one. An unknown
``OPD_STREAM_*`` variable is an error (a typo must not be silently ignored).

Validation lives in ``StreamConfig.__post_init__``, so a direct ``StreamConfig(...)`` call
validates too (msgspec Structs only type-check on decode); so do
``msgspec.structs.replace`` and :meth:`StreamConfig.evolve`.

The API key is held in a :class:`Secret` and never appears in ``repr``/``str``, in
:meth:`StreamConfig.to_log_dict` or in error messages.
"""

from __future__ import annotations

import difflib
import math
import operator
import os
import re
from collections.abc import Mapping
from typing import Any, Final, Literal, NamedTuple, TypeAlias, get_args

import msgspec

from ._balance import Balance
from ._errors import ConfigError
from ._router import normalize_server_url, normalize_teachers

__all__ = (
    "Balance",
    "CONFIG_FIELDS",
    "ENV_PREFIX",
    "ConfigField",
    "IdScoring",
    "KL_DEVICE_PATTERN",
    "LogprobStart",
    "MAX_TOP_K",
    "Order",
    "Secret",
    "Strategy",
    "StreamConfig",
    "TopkWire",
    "WeightMode",
    "render_config_table",
    "resolve_kl_device",
)

ENV_PREFIX: Final = "OPD_STREAM_"
"""Prefix of every configuration environment variable: ``OPD_STREAM_<FIELD upper-cased>``."""

MAX_TOP_K: Final = 1024
"""Largest accepted ``top_k``. SGLang takes any ``top_logprobs_num``, but every top-k row
costs O(k) response bytes per position; 1024 bounds a configuration mistake, not a server
limit."""

KL_DEVICE_PATTERN: Final = re.compile(r"auto|cpu|cuda|cuda:\d+")
"""Accepted spellings of ``kl_device`` (matched in full, after lower-casing)."""

Strategy: TypeAlias = Literal["only-student", "only-teacher", "intersection", "union", "xor"]
WeightMode: TypeAlias = Literal["student_p", "teacher_p", "none"]
RouterDiscovery: TypeAlias = Literal["auto", "off"]
IdScoring: TypeAlias = Literal["per-position", "flat", "blocked", "blocks", "auto"]
LogprobStart: TypeAlias = Literal["prompt", "zero"]
TopkWire: TypeAlias = Literal["b64", "json", "auto"]
Order: TypeAlias = Literal["completed", "input"]

_KIB: Final = 1024
_MIB: Final = 1024 * _KIB
_GIB: Final = 1024 * _MIB

# Strategies that need the student server to score the teacher's top-k ids (spec §4).
_NEEDS_STUDENT_SERVER: Final = frozenset({"only-teacher", "union", "xor"})


class Secret:
    """A string that never shows itself: ``repr`` is ``Secret('***')``, ``str`` is ``***``.

    Args:
        value: the secret text.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"Secret takes a str, got {type(value).__name__}")
        self._value = value

    def get_secret_value(self) -> str:
        """Return the secret text (for the one place that must send it)."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    def __str__(self) -> str:
        return "***"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return self._value == other._value

    def __hash__(self) -> int:
        return hash((Secret, self._value))


class ConfigField(NamedTuple):
    """One row of the configuration table (see :data:`CONFIG_FIELDS`)."""

    field: str
    env_var: str
    default: str
    meaning: str


class _Invalid(Exception):
    """Internal: one configuration problem, before it is phrased as a ConfigError."""

    def __init__(self, fields: str | tuple[str, ...], problem: str) -> None:
        super().__init__(problem)
        self.fields = (fields,) if isinstance(fields, str) else fields
        self.problem = problem

    def message(self, sources: Mapping[str, str] | None = None) -> str:
        """Phrase the problem, naming each field and the env variable it came from."""
        names = []
        for name in self.fields:
            var = None if sources is None else sources.get(name)
            names.append(f"{name} (from {var})" if var else name)
        return f"{', '.join(names)}: {self.problem}"


# Meanings of every field, in declaration order; the README table is generated from these.
_MEANINGS: Final[dict[str, str]] = {
    "teachers": (
        "teacher name -> base URL or list of replica URLs; a plain URL means the single "
        "teacher 'default'. Env: comma-separated NAME=URL entries, replicas joined with '|'"
    ),
    "teacher_key": "sample metadata key whose value (as a string) names the sample's teacher",
    "student_url": (
        "student scoring server; needed by only-teacher/union/xor and to fetch missing "
        "student top-k"
    ),
    "top_k": f"0 = sampled-token mode; > 0 = top-k mode with k candidates (0..{MAX_TOP_K})",
    "strategy": (
        "top-k candidate set: only-student, only-teacher, intersection, union, xor "
        "(top-k mode only)"
    ),
    "weight_mode": "candidate weights: student_p, teacher_p or none",
    "tail": (
        "top-k: add a tail bucket holding the mass outside the candidates, so r_t is the "
        "reverse KL over |C| + 1 outcomes (never negative, a lower bound of the full one); "
        "needs weight_mode student_p. Env: 1/0/true/false"
    ),
    "id_scoring": (
        "how ids are scored: per-position, flat (one union for all positions), blocked (one "
        "batch body), blocks (the same blocks as independent requests), auto (per-position "
        "where the server supports it, else blocked, else blocks)"
    ),
    "logprob_start": (
        "prompt (ask only from the last prompt position on) or zero (the reference behaviour)"
    ),
    "topk_wire": "top-k answer encoding asked of the server: b64, json or auto",
    "request_deadline_s": (
        "whole budget of one logical request, retries included, in seconds (finite, > 0)"
    ),
    "max_attempts": "attempts per request, the first included (>= 1)",
    "max_inflight": "samples inside the pipeline at once (>= 1)",
    "max_inflight_per_endpoint": "concurrent HTTP requests per server URL (>= 1)",
    "max_response_bytes": "cap on one response body, in bytes (>= 1024)",
    "max_inflight_response_bytes": (
        "budget for the response bodies held at once by one stream, all requests together, "
        "in bytes (>= 1024); a reader that would exceed it waits (one answer always proceeds)"
    ),
    "kl_device": "KL device: auto (the creating thread's current CUDA device when available, "
    "else cpu), cpu, cuda (the same, cuda:N) or cuda:N",
    "order": "result order: completed (as they finish) or input (bounded reorder buffer)",
    "api_key": "sent as 'Authorization: Bearer'; never printed by repr, logs or errors",
    "channel_capacity": "capacity of each bounded channel between pipeline stages (>= 1)",
    "id_block_size": (
        "response positions per block in blocked id scoring; 0 = auto (per sample, the size "
        "that minimises request + answer bytes)"
    ),
    "kl_batch_size": "most samples in one KL batch (>= 1)",
    "kl_batch_wait_s": "how long the KL stage waits to fill a batch, in seconds (>= 0)",
    "backoff_initial_s": "first retry backoff ceiling, in seconds (> 0); doubles per attempt",
    "backoff_max_s": "largest retry backoff ceiling, in seconds (>= backoff_initial_s)",
    "connect_timeout_s": "TCP connect timeout per HTTP request, in seconds (finite, > 0)",
    "decode_threads": (
        "threads that parse large answers with pyarrow (GIL released, side by side); "
        "0 = auto: one per CPU this process may run on, at most 8"
    ),
    "decode_thread_bytes": (
        "answers at least this big are parsed in a decode thread; smaller ones with msgspec "
        "on the event loop (cheaper in CPU; each holds the loop ~8 ms per MiB)"
    ),
    "max_reorder": "bound of the input-order reorder buffer, in samples (>= 1)",
    "balance": (
        "replica choice within a teacher: least-outstanding (power of two choices) or round-robin"
    ),
    "eject_after_failures": (
        "consecutive retryable failures that eject a replica for eject_cooldown_s (0 = never eject)"
    ),
    "eject_cooldown_s": (
        "how long an ejected replica stays out before a /health probe may re-admit it, "
        "in seconds (> 0)"
    ),
    "hedge_after_percentile": (
        "0 = no hedging; p in (0, 100) = after the p-th percentile of recent latencies "
        "(at least hedge_min_s), send a duplicate to another replica; first answer wins"
    ),
    "hedge_min_s": "smallest hedging delay, in seconds (>= 0)",
    "attempt_timeout_s": (
        "0 = off; > 0 = an attempt with no answer after this long is abandoned and "
        "retried (on another replica when there is one), within request_deadline_s"
    ),
    "router_discovery": (
        "auto = a server URL that is an sglang-router is replaced by its workers reachable "
        "from here (listed again every 5 s); off = always send through the configured URL"
    ),
}


class StreamConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Configuration of an ``OPDStream``; see :data:`CONFIG_FIELDS` for every field.

    Build it with :meth:`from_env` (``StreamConfig.from_env(teachers="http://h:30000",
    top_k=16)``; pass ``environ={}`` to ignore the process environment) or directly. Both
    validate everything once and normalise:

    * ``teachers`` to ``{name: (replica base URLs, ...)}``;
    * ``student_url`` to its base URL;
    * ``kl_device`` to lower case;
    * ``api_key`` to a :class:`Secret`;
    * float fields to ``float``.

    The field annotations are the normalised types, which is what readers of a config see.
    At runtime the constructor also takes every ``teachers`` spelling accepted by
    :func:`opd_stream._router.normalize_teachers` (a URL, ``NAME=URL`` entries, a mapping
    of name to URL or URL list) and a plain ``str`` ``api_key``; a type checker only
    accepts those through :meth:`from_env` / :meth:`evolve` (``**overrides: Any``).

    Raises:
        ConfigError: any invalid field or combination; the message names the field(s).
    """

    teachers: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)
    teacher_key: str = "opd_teacher"
    student_url: str | None = None
    top_k: int = 0
    strategy: Strategy = "only-student"
    weight_mode: WeightMode = "student_p"
    tail: bool = False
    id_scoring: IdScoring = "auto"
    logprob_start: LogprobStart = "prompt"
    topk_wire: TopkWire = "auto"
    request_deadline_s: float = 60.0
    max_attempts: int = 4
    max_inflight: int = 256
    max_inflight_per_endpoint: int = 64
    max_response_bytes: int = _GIB
    max_inflight_response_bytes: int = 2 * _GIB
    kl_device: str = "auto"
    order: Order = "completed"
    api_key: Secret | None = None
    channel_capacity: int = 64
    id_block_size: int = 0
    kl_batch_size: int = 32
    kl_batch_wait_s: float = 0.002
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    connect_timeout_s: float = 10.0
    decode_threads: int = 0
    decode_thread_bytes: int = 1 * _MIB
    max_reorder: int = 1024
    balance: Balance = "least-outstanding"
    eject_after_failures: int = 5
    eject_cooldown_s: float = 10.0
    hedge_after_percentile: float = 0.0
    hedge_min_s: float = 0.05
    attempt_timeout_s: float = 0.0
    router_discovery: RouterDiscovery = "auto"

    def __post_init__(self) -> None:
        values = {name: getattr(self, name) for name in self.__struct_fields__}
        try:
            normalised = _validate(values)
        except _Invalid as problem:
            raise ConfigError(problem.message()) from None
        for name, value in normalised.items():
            if value is not values[name]:
                msgspec.structs.force_setattr(self, name, value)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> StreamConfig:
        """Build a configuration from ``OPD_STREAM_*`` variables and explicit overrides.

        Each field ``f`` is read from ``OPD_STREAM_<F>`` (``f`` upper-cased). Values are
        stripped of surrounding whitespace; numbers are coerced with
        ``msgspec.convert(..., strict=False)``; an empty ``OPD_STREAM_STUDENT_URL`` or
        ``OPD_STREAM_API_KEY`` means unset. ``OPD_STREAM_TEACHERS`` holds comma-separated
        ``NAME=URL`` entries (replicas joined with ``|``) or a plain URL.

        Args:
            environ: the variables to read; ``None`` reads ``os.environ``.
            **overrides: field values that win over the environment.

        Raises:
            ConfigError: an unknown ``OPD_STREAM_*`` variable or override name, a value
                that does not parse, or any validation failure; the message names the
                field and, when the value came from the environment, the variable.
        """
        env = os.environ if environ is None else environ
        fields = cls.__struct_fields__
        by_var = {ENV_PREFIX + name.upper(): name for name in fields}
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for var in sorted(env):
            if not var.startswith(ENV_PREFIX):
                continue
            name = by_var.get(var)
            if name is None:
                raise ConfigError(f"unknown environment variable {var}{_did_you_mean(var, by_var)}")
            values[name] = _parse_env(name, var, env[var])
            sources[name] = var
        for name, value in overrides.items():
            if name not in fields:
                raise ConfigError(
                    f"unknown StreamConfig field {name!r}{_did_you_mean(name, fields)}"
                )
            values[name] = value
            sources.pop(name, None)
        if "teachers" not in values:
            raise ConfigError(f"teachers: required (set {ENV_PREFIX}TEACHERS or pass teachers=...)")
        try:
            _validate({**_defaults(), **values})
        except _Invalid as problem:
            raise ConfigError(problem.message(sources)) from None
        return cls(**values)

    def evolve(self, **changes: Any) -> StreamConfig:
        """Return a copy with ``changes`` applied, validated like a new configuration.

        Raises:
            ConfigError: an unknown field name or an invalid result.
        """
        for name in changes:
            if name not in self.__struct_fields__:
                raise ConfigError(
                    f"unknown StreamConfig field {name!r}"
                    f"{_did_you_mean(name, self.__struct_fields__)}"
                )
        values = {name: getattr(self, name) for name in self.__struct_fields__}
        values.update(changes)
        return type(self)(**values)

    @classmethod
    def describe(cls) -> list[ConfigField]:
        """Return the configuration table: (field, env_var, default, meaning) per field."""
        return list(CONFIG_FIELDS)

    def to_log_dict(self) -> dict[str, Any]:
        """Return a plain dict safe for logs: ``api_key`` masked as ``"***"``, URLs kept.

        (URLs cannot hold credentials: those are rejected at construction.)
        """
        out: dict[str, Any] = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name == "teachers":
                value = {teacher: list(urls) for teacher, urls in value.items()}
            elif name == "api_key":
                value = None if value is None else "***"
            out[name] = value
        return out

    redacted = to_log_dict


def _defaults() -> dict[str, Any]:
    """Field name -> default value (``teachers`` excluded: it is required)."""
    out: dict[str, Any] = {}
    for info in msgspec.structs.fields(StreamConfig):
        if info.default is not msgspec.NODEFAULT:
            out[info.name] = info.default
    return out


def _did_you_mean(name: str, candidates: Any) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


_ENV_COERCED: Final[dict[str, type]] = {}
"""Field name -> int/float/bool for fields whose env text msgspec coerces; filled below."""


def _parse_env(name: str, var: str, raw: str) -> Any:
    """Turn the text of one env variable into a value for field ``name``."""
    text = raw.strip()
    if name in ("student_url", "api_key"):
        return text or None
    target = _ENV_COERCED.get(name)
    if target is None:
        return text
    try:
        return msgspec.convert(text, target, strict=False)
    except msgspec.ValidationError:
        kind = {int: "an integer", float: "a number", bool: "one of 1/0/true/false"}[target]
        raise ConfigError(f"{name} (from {var}): expected {kind}, got {text!r}") from None


def _as_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool):
        raise _Invalid(name, "expected an integer, got bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise _Invalid(name, f"expected an integer, got {type(value).__name__}") from None
    if number < low or (high is not None and number > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise _Invalid(name, f"must be {bound}, got {number}")
    return number


def _as_float(name: str, value: Any, *, low: float, strict_low: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(name, f"expected a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise _Invalid(name, f"must be finite, got {number}")
    if number < low or (strict_low and number == low):
        raise _Invalid(name, f"must be {'>' if strict_low else '>='} {low:g}, got {number:g}")
    return number


def _as_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices or not isinstance(value, str):
        raise _Invalid(name, f"must be one of {', '.join(choices)}; got {value!r}")
    return value


def _validate(values: dict[str, Any]) -> dict[str, Any]:
    """Check every field and combination; return the normalised values.

    Raises:
        _Invalid: the first problem found (field checks first, in declaration order).
    """
    out = dict(values)
    try:
        teachers = normalize_teachers(values["teachers"])
    except ConfigError as exc:
        raise _Invalid("teachers", str(exc)) from None
    out["teachers"] = teachers  # always a fresh dict: the caller's one may change later

    key = values["teacher_key"]
    if not isinstance(key, str) or not key:
        raise _Invalid("teacher_key", "must be a non-empty string")

    student = values["student_url"]
    if student is not None:
        try:
            normalised_student = normalize_server_url(student)
        except ConfigError as exc:
            raise _Invalid("student_url", str(exc)) from None
        if normalised_student != student:
            out["student_url"] = normalised_student

    for name in _CHOICES:
        _as_choice(name, values[name], _CHOICES[name])

    for name, low, high in _INT_BOUNDS:
        number = _as_int(name, values[name], low, high)
        if number is not values[name]:
            out[name] = number
    for name, floor, strict_floor in _FLOAT_BOUNDS:
        real = _as_float(name, values[name], low=floor, strict_low=strict_floor)
        if real is not values[name]:
            out[name] = real

    device = values["kl_device"]
    if not isinstance(device, str) or not KL_DEVICE_PATTERN.fullmatch(device.strip().lower()):
        raise _Invalid("kl_device", f"must be auto, cpu, cuda or cuda:N; got {device!r}")
    if device.strip().lower() != device:
        out["kl_device"] = device.strip().lower()

    api_key = values["api_key"]
    if api_key is not None:
        secret = api_key if isinstance(api_key, Secret) else None
        if secret is None:
            if not isinstance(api_key, str):
                raise _Invalid("api_key", f"expected a string, got {type(api_key).__name__}")
            secret = Secret(api_key)
            out["api_key"] = secret
        text = secret.get_secret_value()
        if not text or any(ch.isspace() or not ch.isprintable() for ch in text):
            # The key goes into an HTTP header; never echo it.
            raise _Invalid("api_key", "must be non-empty printable text without whitespace")

    if not isinstance(values["tail"], bool):
        raise _Invalid("tail", f"expected a bool, got {type(values['tail']).__name__}")
    if out["tail"] and out["top_k"] == 0:
        raise _Invalid(("tail", "top_k"), "the tail bucket applies to top-k mode; set top_k > 0")
    if out["tail"] and out["weight_mode"] != "student_p":
        raise _Invalid(
            ("tail", "weight_mode"),
            "the tail bucket weighs candidates by the student's probabilities; "
            f"set weight_mode student_p (got {out['weight_mode']})",
        )
    if out["strategy"] != "only-student" and out["top_k"] == 0:
        raise _Invalid(("strategy", "top_k"), "strategy applies to top-k mode; set top_k > 0")
    if out["strategy"] in _NEEDS_STUDENT_SERVER and out["student_url"] is None:
        raise _Invalid(
            ("strategy", "student_url"),
            f"strategy {out['strategy']} needs the student server to score the teacher's "
            "top-k ids; set student_url",
        )
    if out["hedge_after_percentile"] >= 100.0:
        raise _Invalid(
            "hedge_after_percentile",
            f"must be 0 (off) or below 100, got {out['hedge_after_percentile']:g}",
        )
    if out["backoff_max_s"] < out["backoff_initial_s"]:
        raise _Invalid(
            ("backoff_max_s", "backoff_initial_s"),
            f"backoff_max_s ({out['backoff_max_s']:g}) must be >= backoff_initial_s "
            f"({out['backoff_initial_s']:g})",
        )
    return out


_CHOICES: Final[dict[str, tuple[str, ...]]] = {
    "strategy": get_args(Strategy),
    "weight_mode": get_args(WeightMode),
    "id_scoring": get_args(IdScoring),
    "logprob_start": get_args(LogprobStart),
    "topk_wire": get_args(TopkWire),
    "order": get_args(Order),
    "balance": get_args(Balance),
    "router_discovery": get_args(RouterDiscovery),
}

# (field, lowest, highest or None)
_INT_BOUNDS: Final[tuple[tuple[str, int, int | None], ...]] = (
    ("top_k", 0, MAX_TOP_K),
    ("max_attempts", 1, None),
    ("max_inflight", 1, None),
    ("max_inflight_per_endpoint", 1, None),
    ("max_response_bytes", _KIB, None),
    ("max_inflight_response_bytes", _KIB, None),
    ("channel_capacity", 1, None),
    ("id_block_size", 0, None),
    ("kl_batch_size", 1, None),
    ("decode_threads", 0, None),
    ("decode_thread_bytes", 0, None),
    ("max_reorder", 1, None),
    ("eject_after_failures", 0, None),
)

# (field, lowest, lowest excluded); every float field must also be finite.
_FLOAT_BOUNDS: Final[tuple[tuple[str, float, bool], ...]] = (
    ("request_deadline_s", 0.0, True),
    ("kl_batch_wait_s", 0.0, False),
    ("backoff_initial_s", 0.0, True),
    ("backoff_max_s", 0.0, True),
    ("connect_timeout_s", 0.0, True),
    ("eject_cooldown_s", 0.0, True),
    ("hedge_after_percentile", 0.0, False),
    ("hedge_min_s", 0.0, False),
    ("attempt_timeout_s", 0.0, False),
)

_ENV_COERCED.update({name: int for name, _, _ in _INT_BOUNDS})
_ENV_COERCED.update({name: float for name, _, _ in _FLOAT_BOUNDS})
_ENV_COERCED["tail"] = bool


def _show_default(name: str, value: Any) -> str:
    if name == "teachers":
        return "required"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and not isinstance(value, bool) and name.endswith("_bytes"):
        for unit, size in (("GiB", _GIB), ("MiB", _MIB), ("KiB", _KIB)):
            if value >= size and value % size == 0:
                return f"{value // size} {unit}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _build_table() -> tuple[ConfigField, ...]:
    defaults = _defaults()
    return tuple(
        ConfigField(
            field=name,
            env_var=ENV_PREFIX + name.upper(),
            default=_show_default(name, defaults.get(name)),
            meaning=_MEANINGS[name],
        )
        for name in StreamConfig.__struct_fields__
    )


CONFIG_FIELDS: Final[tuple[ConfigField, ...]] = _build_table()
"""The configuration table, one row per StreamConfig field, in declaration order."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_config_table() -> str:
    """Return :data:`CONFIG_FIELDS` as a Markdown table (the README's configuration table)."""
    lines = ["| field | env variable | default | meaning |", "|---|---|---|---|"]
    lines.extend(
        f"| `{row.field}` | `{row.env_var}` | {row.default} | {_cell(row.meaning)} |"
        for row in CONFIG_FIELDS
    )
    return "\n".join(lines) + "\n"


_AUTO_DECODE_THREADS_MAX: Final = 8


def resolve_decode_threads(cfg: StreamConfig) -> int:
    """``decode_threads``, or for 0 (auto) the CPUs this process may run on, at most 8.

    Eight threads parse ~8 answers at once (about 1.6 GB/s of JSON on a modern core each
    ~200 MB/s); more rarely pays, as the event loop and the KL stage need cores too.
    """
    if cfg.decode_threads > 0:
        return cfg.decode_threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_AUTO_DECODE_THREADS_MAX, cpus))


def resolve_kl_device(cfg: StreamConfig | str) -> str:
    """Resolve ``kl_device`` to a concrete torch device string, in the calling thread.

    ``auto`` gives the calling thread's current CUDA device, ``"cuda:N"`` with ``N =
    torch.cuda.current_device()``, when CUDA is available, else ``"cpu"``; ``cuda`` gives
    the same ``"cuda:N"``; ``cuda:N`` is returned as it is once checked; ``cpu`` is always
    ``"cpu"``. torch's current device is a per-thread setting (a new thread starts on device
    0), and the KL runs in a worker thread: a bare ``"cuda"`` there would mean GPU 0 on every
    rank of a job whose ranks called ``torch.cuda.set_device(local_rank)``. So
    :class:`~opd_stream.OPDStream` calls this in its constructor, in the caller's thread,
    and the KL thread uses the explicit index. torch is imported only when CUDA has to be
    probed.

    Args:
        cfg: a configuration, or a ``kl_device`` string.

    Returns:
        ``"cpu"`` or ``"cuda:N"``.

    Raises:
        ConfigError: an invalid spelling; CUDA asked for but unavailable; ``cuda:N`` with
            N not below the number of visible CUDA devices.
    """
    device = (cfg.kl_device if isinstance(cfg, StreamConfig) else cfg).strip().lower()
    if not KL_DEVICE_PATTERN.fullmatch(device):
        raise ConfigError(f"kl_device: must be auto, cpu, cuda or cuda:N; got {device!r}")
    if device == "cpu":
        return "cpu"
    import torch

    available = bool(torch.cuda.is_available())
    if device == "auto" and not available:
        return "cpu"
    if not available:
        raise ConfigError(f"kl_device: {device!r} was requested but CUDA is not available")
    if device in ("auto", "cuda"):
        return f"cuda:{int(torch.cuda.current_device())}"
    index = int(device.removeprefix("cuda:"))
    count = int(torch.cuda.device_count())
    if index >= count:
        raise ConfigError(
            f"kl_device: {device!r} was requested but only {count} CUDA device(s) are visible"
        )
    return device
