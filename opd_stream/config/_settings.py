"""``StreamConfig``: every knob of ``opd_stream``, declared once, validated once.

Each field is declared once on :class:`StreamConfig` (type, default, bounds, description);
the checks and ``OPD_STREAM_<FIELD>`` parsing (:mod:`opd_stream.config._fields`), the rules
between fields (:mod:`opd_stream.config._rules`), ``opd-stream config`` and the table of
``docs/configuration.md`` derive from it. Precedence: explicit arguments, then
``OPD_STREAM_<FIELD>`` variables, then defaults; an unknown ``OPD_STREAM_*`` variable is an
error. Every problem raises :class:`ConfigError` naming the field (and the variable).
Validation runs in ``__post_init__``, so direct construction, ``msgspec.structs.replace``,
:meth:`StreamConfig.evolve` and :meth:`StreamConfig.from_env` all validate. The API key is a
:class:`Secret`: never in ``repr``/``str``, :meth:`StreamConfig.to_log_dict` or a message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, TypeAlias

import msgspec

from .._deprecated import warn_renamed
from .._errors import ConfigError
from ..fleet._balance import Balance
from ..fleet._engines import EngineSetting, normalize_server_engines
from ..fleet._ensemble import Ensemble
from ..fleet._routing import Teacher, normalize_server_url, normalize_teachers
from ..kl._names import Divergence, Strategy, WeightMode
from ..wire._request import Engine, IdForm
from ..xtok._vocab import normalize_teacher_tokenizers, normalize_tokenizer_path
from ._device import KL_DEVICE_PATTERN, resolve_decode_threads, resolve_kl_device
from ._fields import (
    REQUIRED,
    ConfigField,
    FieldSpec,
    Invalid,
    Normalise,
    did_you_mean,
    field_specs,
    read_env,
)
from ._rules import check_values
from ._secret import Secret, as_secret

__all__ = (
    "CONFIG_FIELDS",
    "ENV_PREFIX",
    "MAX_TOP_K",
    "RENAMED_SETTINGS",
    "CacheSalt",
    "ConfigField",
    "IdScoring",
    "Secret",
    "StreamConfig",
    "check_settings",
    "render_config_table",
    "resolve_decode_threads",
    "resolve_kl_device",
)

ENV_PREFIX: Final = "OPD_STREAM_"
"""Prefix of every configuration environment variable: ``OPD_STREAM_<FIELD upper-cased>``."""

MAX_TOP_K: Final = 1024
"""Largest accepted ``top_k``. SGLang takes any ``top_logprobs_num``, but every top-k row
costs O(k) response bytes per position; 1024 bounds a configuration mistake, not a server
limit."""

#: The id forms of the wire (:data:`~opd_stream.wire._request.IdForm`), or ``auto``.
IdScoring: TypeAlias = Literal[IdForm, "auto"]
CacheSalt: TypeAlias = Literal["none", "weight-version", "per-sample", "per-request"]

_MIB: Final = 1024 * 1024
_GIB: Final = 1024 * _MIB


def _doc(description: str, *, advanced: bool = False, **constraints: Any) -> msgspec.Meta:
    """A field's ``Meta``: its description, bounds, and in ``extra`` the ``advanced`` flag
    and the custom ``problem``/``above`` phrases (see
    :class:`~opd_stream.config._fields.FieldSpec`)."""
    extra: dict[str, Any] = {
        key: constraints.pop(key) for key in ("problem", "above") if key in constraints
    }
    if advanced:
        extra["advanced"] = True
    return msgspec.Meta(description=description, extra=extra or None, **constraints)


def _device_spelling(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


RENAMED_SETTINGS: Final[Mapping[str, str]] = MappingProxyType(
    {"decode_thread_bytes": "offload_bytes", "router_discovery": "gateway_discovery"}
)
"""Settings renamed before 1.0, old name -> new. The old name is still read for one release
(a keyword of ``StreamConfig(...)``, ``from_env``, ``evolve``; its ``OPD_STREAM_*``
variable; the attribute), each use a ``DeprecationWarning``."""


def renamed_settings(values: Mapping[str, Any], *, stacklevel: int) -> dict[str, Any]:
    """``values`` with each old setting name (:data:`RENAMED_SETTINGS`) replaced by its new
    one, with a ``DeprecationWarning`` (``stacklevel``: the caller's line, counted from the
    function that calls this one, as 2).

    Raises:
        ConfigError: both the old and the new name are given.
    """
    out = dict(values)
    for old, new in RENAMED_SETTINGS.items():
        if old in out:
            if new in out:
                raise ConfigError(f"{new}: given twice, also as {old} (its old name)")
            warn_renamed(f"the setting {old}", new, stacklevel=stacklevel + 2)
            out[new] = out.pop(old)
    return out


if TYPE_CHECKING:
    from msgspec import StructMeta as _StructMeta
else:  # (msgspec.StructMeta is public from msgspec 0.20 on)
    _StructMeta = type(msgspec.Struct)


class _RenamedKeywords(_StructMeta):
    """``StreamConfig(old_name=...)`` works for one release (msgspec Structs take no
    ``__init__``): the old names of :data:`RENAMED_SETTINGS` become the new ones."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not RENAMED_SETTINGS.keys() & kwargs.keys():
            return super().__call__(*args, **kwargs)
        return super().__call__(*args, **renamed_settings(kwargs, stacklevel=2))


class StreamConfig(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    metaclass=_RenamedKeywords,
):
    """Configuration of an ``OPDStream``; see :data:`CONFIG_FIELDS` for every field.

    Build it with :meth:`from_env` (``StreamConfig.from_env(teachers="http://h:30000",
    top_k=16)``; pass ``environ={}`` to ignore the process environment) or directly. Both
    validate everything once and normalise:

    * ``teachers`` to ``{name: (replica base URLs, ...)}`` (``{name: Ensemble}`` for a
      weighted ensemble of member teachers);
    * ``student_url`` to its base URL;
    * ``kl_device`` to lower case;
    * ``api_key`` to a :class:`Secret`;
    * float fields to ``float``.

    The field annotations are the normalised types, which is what readers of a config see.
    At runtime the constructor also takes every ``teachers`` spelling accepted by
    :func:`opd_stream.fleet._routing.normalize_teachers` (a URL, ``NAME=URL`` entries, a mapping
    of name to URL or URL list) and a plain ``str`` ``api_key``; a type checker only
    accepts those through :meth:`from_env` / :meth:`evolve` (``**overrides: Any``).

    Raises:
        ConfigError: any invalid field or combination; the message names the field(s).
    """

    teachers: Annotated[
        dict[str, Teacher],
        Normalise(normalize_teachers),
        REQUIRED,
        _doc(
            "teacher name -> base URL or list of replica URLs, or a weighted ensemble; a plain "
            "URL means the single teacher 'default'. Env: comma-separated NAME=URL entries, "
            "replicas joined with '|'; an ensemble is NAME=W*URLS;W*URLS (weights summing to 1)"
        ),
    ] = msgspec.field(default_factory=dict)
    teacher_key: Annotated[
        str,
        _doc(
            "sample metadata key whose value (as a string) names the sample's teacher",
            min_length=1,
            problem="must be a non-empty string",
        ),
    ] = "opd_teacher"
    student_url: Annotated[
        str | None,
        Normalise(normalize_server_url),
        _doc(
            "student scoring server; needed by only-teacher/union/xor and to fetch missing "
            "student top-k"
        ),
    ] = None
    top_k: Annotated[
        int,
        _doc(
            f"0 = sampled-token mode; > 0 = top-k mode with k candidates (0..{MAX_TOP_K})",
            ge=0,
            le=MAX_TOP_K,
        ),
    ] = 0
    strategy: Annotated[
        Strategy,
        _doc(
            "top-k candidate set: only-student, only-teacher, intersection, union, xor "
            "(top-k mode only)"
        ),
    ] = "only-student"
    weight_mode: Annotated[WeightMode, _doc("candidate weights: student_p, teacher_p or none")] = (
        "student_p"
    )
    tail: Annotated[
        bool,
        _doc(
            "top-k: add a tail bucket holding the mass outside the candidates, so r_t is the "
            "divergence over |C| + 1 outcomes (never negative, a lower bound of the full one); "
            "reverse_kl needs weight_mode student_p with it. Env: 1/0/true/false"
        ),
    ] = False
    candidates: Annotated[
        bool,
        _doc(
            "top-k: return each sample's per-candidate arrays (ScoredSample.candidates); "
            "false: the signal alone, without ~680 KB of copies and memory a 2048-token "
            "sample at k = 16 (the Miles adapter reads only the signal). Env: 1/0/true/false"
        ),
    ] = True
    divergence: Annotated[
        Divergence,
        _doc(
            "top-k signal: reverse_kl (the reference's), forward_kl (needs weight_mode "
            "teacher_p) or jsd (TRL's generalized JSD with jsd_beta; weight_mode left at "
            "student_p); sampled-token mode is reverse_kl only"
        ),
    ] = "reverse_kl"
    jsd_beta: Annotated[
        float,
        _doc(
            "beta of divergence jsd, in (0, 1): beta KL(teacher || M) + (1 - beta) "
            "KL(student || M), M = beta teacher + (1 - beta) student (TRL's GKD convention)",
            gt=0.0,
            lt=1.0,
        ),
    ] = 0.5
    id_scoring: Annotated[
        IdScoring,
        _doc(
            "how ids are scored: per-position, flat (one union for all positions), blocked (one "
            "batch body), blocks (the same blocks as independent requests), auto (per-position "
            "where the server supports it, else blocked, else blocks)"
        ),
    ] = "auto"
    logprob_start: Annotated[
        Literal["prompt", "zero"],
        _doc(
            "prompt (ask only from the last prompt position on) or zero (the reference behaviour)",
            advanced=True,
        ),
    ] = "prompt"
    topk_wire: Annotated[
        Literal["b64", "json", "auto"],
        _doc("top-k answer encoding asked of the server: b64, json or auto", advanced=True),
    ] = "auto"
    request_deadline_s: Annotated[
        float,
        _doc(
            "whole budget of one logical request, retries included, in seconds (finite, > 0)",
            gt=0.0,
        ),
    ] = 60.0
    max_attempts: Annotated[int, _doc("attempts per request, the first included (>= 1)", ge=1)] = 4
    max_inflight: Annotated[int, _doc("samples inside the pipeline at once (>= 1)", ge=1)] = 256
    max_inflight_per_endpoint: Annotated[
        int, _doc("concurrent HTTP requests per server URL (>= 1)", ge=1)
    ] = 64
    max_response_bytes: Annotated[
        int, _doc("cap on one response body, in bytes (>= 1024)", ge=1024)
    ] = _GIB
    max_inflight_response_bytes: Annotated[
        int,
        _doc(
            "budget for the response bodies held at once by one stream, all requests together, "
            "in bytes (>= 1024); a reader that would exceed it waits (one answer always proceeds)",
            ge=1024,
        ),
    ] = 2 * _GIB
    kl_device: Annotated[
        str,
        Normalise(_device_spelling),
        _doc(
            "KL device: auto (the creating thread's current CUDA device when available, else "
            "cpu), cpu, cuda (the same, cuda:N) or cuda:N",
            pattern=rf"^(?:{KL_DEVICE_PATTERN.pattern})$",
            problem="must be auto, cpu, cuda or cuda:N; got {value!r}",
        ),
    ] = "auto"
    order: Annotated[
        Literal["completed", "input"],
        _doc("result order: completed (as they finish) or input (bounded reorder buffer)"),
    ] = "completed"
    api_key: Annotated[
        Secret | None,
        Normalise(as_secret),
        _doc("sent as 'Authorization: Bearer'; never printed by repr, logs or errors"),
    ] = None
    channel_capacity: Annotated[
        int,
        _doc(
            "capacity of each bounded channel between pipeline stages (>= 1)", ge=1, advanced=True
        ),
    ] = 64
    id_block_size: Annotated[
        int,
        _doc(
            "response positions per block in blocked id scoring; 0 = auto (per sample, the size "
            "that minimises request + answer bytes)",
            ge=0,
            advanced=True,
        ),
    ] = 0
    kl_batch_size: Annotated[int, _doc("most samples in one KL batch (>= 1)", ge=1)] = 32
    kl_batch_wait_s: Annotated[
        float,
        _doc(
            "how long the KL stage waits to fill a batch, in seconds (>= 0)", ge=0.0, advanced=True
        ),
    ] = 0.002
    backoff_initial_s: Annotated[
        float, _doc("first retry backoff ceiling, in seconds (> 0); doubles per attempt", gt=0.0)
    ] = 0.05
    backoff_max_s: Annotated[
        float, _doc("largest retry backoff ceiling, in seconds (>= backoff_initial_s)", gt=0.0)
    ] = 2.0
    connect_timeout_s: Annotated[
        float, _doc("TCP connect timeout per HTTP request, in seconds (finite, > 0)", gt=0.0)
    ] = 10.0
    decode_threads: Annotated[
        int,
        _doc(
            "threads that build large request bodies and parse large answers (offload_bytes; "
            "GIL released, side by side); "
            "0 = auto: one per CPU this process may run on, at most 8",
            ge=0,
            advanced=True,
        ),
    ] = 0
    offload_bytes: Annotated[
        int,
        _doc(
            "answers at least this big are parsed in a decode thread; smaller ones on the "
            "event loop by the compiled scanner, whole below 1 MiB (~1.5-3 ms per MiB), from "
            "1 MiB on 1 MiB at a time and one answer at a time (the loop's turn between two "
            "slices and after an answer's last, a rest under 256 KiB read with the slice "
            "before; ~0.25 ms per MiB more for its columns); what the loop "
            "does whole, a request body's build, a parse by msgspec (~4-10 ms per MiB, "
            "before the scanner is ready) and a sample's Python top-k rows (~3-5 ms per MiB "
            "of their msgpack, 16 bytes an entry), goes to a thread from a quarter of it; "
            "formerly decode_thread_bytes",
            ge=0,
            advanced=True,
        ),
    ] = 4 * _MIB
    max_reorder: Annotated[
        int, _doc("bound of the input-order reorder buffer, in samples (>= 1)", ge=1)
    ] = 1024
    release_memory_after_s: Annotated[
        float,
        _doc(
            "the heap memory freed by scoring (answers, decoded rows) is given back to the "
            "operating system once the stream has had nothing in flight for this long, in "
            "seconds, and when it closes, unless another stream of the process has samples in "
            "flight (glibc's malloc_trim, process-wide; elsewhere nothing); until then "
            "the next samples reuse it: pages given back cost ~1 ms of CPU per sample of "
            "512 + 2048 tokens at top-k 16 in faults when they are touched again (0 = as soon "
            "as nothing is in flight)",
            ge=0.0,
            advanced=True,
        ),
    ] = 60.0
    balance: Annotated[
        Balance,
        _doc(
            "replica choice within a teacher: prefix (requests that share a prompt go to one "
            "replica, loads bounded by balance_load_factor; the key is also sent as "
            "X-SMG-Routing-Key), least-outstanding (power of two choices) or round-robin"
        ),
    ] = "prefix"
    balance_load_factor: Annotated[
        float,
        _doc(
            "prefix balance: a replica takes no request while its work in flight (uncached "
            "tokens) is this many times the mean work (plus 3 prompts where the request's "
            "prompt is cached; while the stream has at most 2 requests per replica in flight, "
            "one holding the prompt takes it anyway while it holds at most 2 above its share) "
            "(>= 1; lower spreads more, higher reuses more)",
            ge=1.0,
            advanced=True,
        ),
    ] = 1.25
    eject_after_failures: Annotated[
        int,
        _doc(
            "consecutive retryable failures that eject a replica for eject_cooldown_s "
            "(0 = never eject)",
            ge=0,
        ),
    ] = 5
    eject_cooldown_s: Annotated[
        float,
        _doc(
            "how long an ejected replica stays out before a /health probe may re-admit it, "
            "in seconds (> 0)",
            gt=0.0,
        ),
    ] = 10.0
    unreachable_after_s: Annotated[
        float,
        _doc(
            "when every replica of a teacher (or the student) has refused connections for this "
            "long, in seconds, with no answer since, its requests fail at once "
            "(connection_error) instead of being retried; one request per this interval still "
            "goes ahead, and any answer makes it reachable again (0 = always retry)",
            ge=0.0,
        ),
    ] = 5.0
    hedge_after_percentile: Annotated[
        float,
        _doc(
            "0 = no hedging; p in (0, 100) = after the p-th percentile of recent latencies "
            "(at least hedge_min_s), send a duplicate to another replica; first answer wins",
            ge=0.0,
            lt=100.0,
            above="must be 0 (off) or below {limit:g}, got {value:g}",
        ),
    ] = 0.0
    hedge_min_s: Annotated[float, _doc("smallest hedging delay, in seconds (>= 0)", ge=0.0)] = 0.05
    attempt_timeout_s: Annotated[
        float,
        _doc(
            "0 = off; > 0 = an attempt with no answer after this long is abandoned and "
            "retried (on another replica when there is one), within request_deadline_s",
            ge=0.0,
        ),
    ] = 0.0
    gateway_discovery: Annotated[
        Literal["auto", "off"],
        _doc(
            "auto = a server URL that is a gateway (smg, sglang-router) is replaced by its "
            "workers reachable from here (listed again every 5 s); off = always send through "
            "the configured URL; formerly router_discovery"
        ),
    ] = "auto"
    cache_salt: Annotated[
        CacheSalt,
        _doc(
            "SGLang cache_salt on scoring requests (never from the payload): none; "
            "weight-version (a request's salt is the weight_version its server last "
            "reported: a side whose weights change gets a fresh cache, a frozen one keeps "
            "its cache); per-sample (one random salt for all of a sample's requests, a "
            "re-ask included: no prefix reuse across samples, so a GRPO group's shared "
            "prompt is computed once per sample; debugging only); per-request (a fresh "
            "salt for every HTTP request and block: no prefix reuse at all, every request "
            "pays its whole prefill; debugging only)"
        ),
    ] = "none"
    probe_tolerance: Annotated[
        float,
        _doc(
            "largest logprob difference, in nats, the probe accepts between a replica and its "
            "teacher's median replica and between a replica's cold and warm answers (> 0)",
            gt=0.0,
        ),
    ] = 0.1
    probe_deadline_s: Annotated[
        float,
        _doc(
            "how long the probe waits for each replica's two answers (cold, then warm), in "
            "seconds (finite, > 0); a replica with no answer by then is named (failed: "
            "deadline_exceeded) and, like an outlier, ejected by probe_at_start",
            gt=0.0,
        ),
    ] = 10.0
    probe_at_start: Annotated[
        bool,
        _doc(
            "run the probe (OPDStream.probe) as the stream starts and eject, for the stream's "
            "life, the replicas it names: beyond probe_tolerance, or no answer within "
            "probe_deadline_s (never a teacher's last good one). Env: 1/0/true/false"
        ),
    ] = False
    student_tokenizer: Annotated[
        str | None,
        Normalise(normalize_tokenizer_path),
        _doc(
            "the student's tokenizer: a local tokenizer.json or a model directory holding one "
            "(never downloaded); needed with teacher_tokenizers"
        ),
    ] = None
    teacher_tokenizers: Annotated[
        dict[str, str] | None,
        Normalise(normalize_teacher_tokenizers),
        _doc(
            "teacher name -> its own tokenizer (tokenizer.json or a directory holding one) for a "
            "teacher with another vocabulary (sampled-token mode, or top-k only-student); a "
            "teacher not listed shares the student's. Env: comma-separated NAME=PATH entries, or "
            "one path for the teacher 'default'"
        ),
    ] = None
    return_alignment: Annotated[
        bool,
        _doc(
            "results of a teacher with its own tokenizer carry the span alignment "
            "(ScoredSample.alignment). Env: 1/0/true/false"
        ),
    ] = False
    engine: Annotated[
        EngineSetting,
        _doc(
            "the servers' dialect: auto (each server spoken to as SGLang until its /generate "
            "answers 404/405, then detected once: vLLM scale-out, else vLLM /v1/completions), "
            "sglang, vllm (vLLM's POST /inference/v1/generate, vllm serve --enable-scale-out: "
            "every strategy) or vllm-completions (POST /v1/completions, any vLLM: sampled-token "
            "mode and the teacher's top-k only; every prompt row recomputed and sent back, no "
            "prefix reuse); server_engines wins per server"
        ),
    ] = "auto"
    server_engines: Annotated[
        dict[str, Engine],
        Normalise(normalize_server_engines),
        _doc(
            "server base URL (a teacher replica, an ensemble member's replica, the student) -> "
            "its engine (sglang, vllm, vllm-completions), where servers differ; the others "
            "follow engine. Env: comma-separated URL=ENGINE entries"
        ),
    ] = {}
    vllm_max_logprobs: Annotated[
        int,
        _doc(
            "the vLLM servers' --max-logprobs (vLLM's default 20; -1 = unbounded): ids per "
            "position beyond it go as several requests (the prefix cache makes the repeats "
            "cheap); a teacher top-k beyond it is refused",
            ge=-1,
            problem="must be -1 (unbounded) or >= 1, got {value!r}",
        ),
    ] = 20

    @property
    def decode_thread_bytes(self) -> int:
        """Deprecated: :attr:`offload_bytes`."""
        warn_renamed("StreamConfig.decode_thread_bytes", "StreamConfig.offload_bytes")
        return self.offload_bytes

    @property
    def router_discovery(self) -> Literal["auto", "off"]:
        """Deprecated: :attr:`gateway_discovery`."""
        warn_renamed("StreamConfig.router_discovery", "StreamConfig.gateway_discovery")
        return self.gateway_discovery

    def __post_init__(self) -> None:
        values = {name: getattr(self, name) for name in _SPECS}
        try:
            normalised = check_values(_SPECS, values)
        except Invalid as problem:
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
        ``NAME=URL`` entries (replicas joined with ``|``; an ensemble ``NAME=W*URLS;W*URLS``)
        or a plain URL.

        Args:
            environ: the variables to read; ``None`` reads ``os.environ``.
            **overrides: field values that win over the environment.

        Raises:
            ConfigError: an unknown ``OPD_STREAM_*`` variable or override name, a value
                that does not parse, or any validation failure; the message names the
                field and, when the value came from the environment, the variable.
        """
        values, sources = read_env(
            _SPECS, os.environ if environ is None else environ, ENV_PREFIX, RENAMED_SETTINGS
        )
        overrides = renamed_settings(overrides, stacklevel=2)
        _check_names(overrides)
        values.update(overrides)
        for name in overrides:
            sources.pop(name, None)
        if "teachers" not in values:
            raise ConfigError(f"teachers: required (set {ENV_PREFIX}TEACHERS or pass teachers=...)")
        try:
            return cls(**values)
        except ConfigError:
            if not sources:
                raise
        # A bad value: the same check again, to name the variable it came from (only on
        # this path: a valid configuration is checked once).
        given = {
            f.name: f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
            for f in msgspec.structs.fields(cls)
        }
        try:
            check_values(_SPECS, {name: given[name] for name in _SPECS} | values)
        except Invalid as problem:
            raise ConfigError(problem.message(sources)) from None
        raise AssertionError("a configuration refused once is refused again")  # pragma: no cover

    def evolve(self, **changes: Any) -> StreamConfig:
        """Return a copy with ``changes`` applied, validated like a new configuration.

        Raises:
            ConfigError: an unknown field name or an invalid result.
        """
        changes = renamed_settings(changes, stacklevel=2)
        _check_names(changes)
        return type(self)(**{name: getattr(self, name) for name in _SPECS} | changes)

    def to_log_dict(self) -> dict[str, Any]:
        """Return a plain dict safe for logs: ``api_key`` masked as ``"***"``, URLs kept.

        (URLs cannot hold credentials: those are rejected at construction.)
        """
        out: dict[str, Any] = {}
        for name in _SPECS:
            value = getattr(self, name)
            if name == "teachers":
                value = {
                    teacher: urls.spec() if isinstance(urls, Ensemble) else list(urls)
                    for teacher, urls in value.items()
                }
            elif name == "server_engines":
                value = dict(value)
            elif name == "api_key":
                value = None if value is None else "***"
            out[name] = value
        return out


_SPECS: Final[dict[str, FieldSpec]] = field_specs(StreamConfig)
"""Field name -> what its declaration says, in declaration order."""


def _check_names(values: Mapping[str, Any]) -> None:
    for name in values:
        if name not in _SPECS:
            raise ConfigError(f"unknown StreamConfig field {name!r}{did_you_mean(name, _SPECS)}")


def check_settings(**values: Any) -> dict[str, Any]:
    """Check some :class:`StreamConfig` fields, and the rules between them, on their own.

    For an object that takes a few settings directly (``RetryPolicy``): the same
    declaration, the same messages as a whole configuration.

    Returns:
        The normalised values.

    Raises:
        ConfigError: an invalid value or combination; the message names the field(s).
    """
    values = renamed_settings(values, stacklevel=2)
    _check_names(values)
    try:
        return check_values(_SPECS, values)
    except Invalid as problem:
        raise ConfigError(problem.message()) from None


CONFIG_FIELDS: Final[tuple[ConfigField, ...]] = tuple(
    spec.row(ENV_PREFIX) for spec in _SPECS.values()
)
"""The configuration table, one row per StreamConfig field, in declaration order."""


def render_config_table() -> str:
    """Return :data:`CONFIG_FIELDS` as a Markdown table (``docs/configuration.md``'s table)."""
    lines = ["| field | env variable | default | meaning |", "|---|---|---|---|"]
    for row in CONFIG_FIELDS:
        meaning = row.meaning.replace("|", "\\|")
        lines.append(f"| `{row.field}` | `{row.env_var}` | {row.default} | {meaning} |")
    return "\n".join(lines) + "\n"
