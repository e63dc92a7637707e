"""Miles / slime drop-in: ``reward_func`` and ``post_process_rewards`` backed by one shared
:class:`~opd_stream.OPDStream`.

Point Miles at this module instead of ``miles.rollout.on_policy_distillation``::

    --use-opd --opd-type sglang --rm-url http://teacher:30000/generate \\
    --custom-rm-path opd_stream.integrations.miles.reward_func \\
    --custom-reward-post-process-path opd_stream.integrations.miles.post_process_rewards

The reference flags (``--opd-log-prob-top-k``, ``--opd-top-k-strategy``,
``--opd-reward-weight-mode``, ``--opd-topk-per-position``, ``--opd-teacher-urls``,
``--opd-teacher-key``, ``--rm-url``, ``--sglang-router-ip/--sglang-router-port``,
``--sglang-router-request-timeout-secs``) keep their meaning; every other
:class:`~opd_stream.StreamConfig` field comes from its ``OPD_STREAM_*`` variable (the flags
win where both speak); see :func:`config_from_miles_args`.

How it runs: Miles' rollout loop calls ``reward_func(args, sample)`` once per sample,
concurrently, on one asyncio loop. The first call starts a :class:`MilesEngine` for that
loop and configuration: one background task that feeds an anyio memory channel into a
single ``stream.run()`` and resolves each caller's future when its result comes out, so
every call shares one connection pool, the per-endpoint limits, the replica balancing and
the batched KL stage. The engine lives until :func:`close` (or :meth:`MilesEngine.aclose`);
call it when training ends. A caller that is cancelled (a ``reward_func`` call cancelled by
its rollout) cancels its sample: the sample's requests in flight are cancelled at once (or
never sent), and the rest of the stream goes on.

Results equal the reference's (spec opd-semantics §2-§3), merged multi-turn samples
included (an empty student top-k row, ``[]``, on an observation span contributes what the
reference gives it: nothing under only-student, the teacher's top-k under union):
``reward_func`` returns a dict holding ``teacher_log_probs`` (float32 ``[R]``,
sampled-token mode) or ``opd_reverse_kl`` (float32 ``[R]``, top-k mode), and
``post_process_rewards`` sets those attributes on each sample and returns
``(rewards, rewards)`` of zeros, like the reference (pure OPD). ``rollout_log_probs`` is
never read (the reference does not use it either).

Errors keep the reference's families: a bad flag or teacher configuration raises a
``ValueError`` (:class:`~opd_stream.ConfigError`), a sample whose teacher key is missing or
unknown (and no ``default`` teacher) :class:`MilesRoutingError` (a ``ValueError``), an
invalid sample :class:`MilesInvalidSampleError` (a ``ValueError``), a deadline
:class:`MilesTimeoutError` (a ``TimeoutError``), anything else (HTTP errors, bad answers)
:class:`OPDSampleError`; the reference's wording is kept where it has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._config import StreamConfig
from .._errors import ConfigError, OPDStreamError
from .._pipeline import Submission
from .._router import DEFAULT_TEACHER, _show_value, parse_teacher_urls
from .._sample import Sample, SampleFailure, ScoredSample
from .._stream import OPDStream
from .._transport import Transport

if TYPE_CHECKING:
    import torch

__all__ = (
    "MilesEngine",
    "MilesInvalidSampleError",
    "MilesRoutingError",
    "MilesTimeoutError",
    "OPDSampleError",
    "TEACHER_PROMPT_KEY",
    "close",
    "config_from_miles_args",
    "engine_for",
    "sample_error",
    "post_process_rewards",
    "reward_func",
)

_STRATEGIES: Final = ("only-student", "only-teacher", "intersection", "union", "xor")
_WEIGHT_MODES: Final = ("student_p", "teacher_p", "none")
_TOP_KEY: Final = "opd_student_top_logprobs"
TEACHER_PROMPT_KEY: Final = "opd_teacher_prompt_ids"
"""The sample metadata key of the teacher's own prompt (token ids), for a teacher that sees
another context than the student (privileged context, self-distillation): when present (not
None), teacher requests send it + the response (``Sample.teacher_prompt_ids``)."""
_RESULT_KEY: Final = "opd_stream"

# Flag attribute -> the value that means "not set" (argparse defaults of the reference).
_OPD_FLAG_DEFAULTS: Final[dict[str, Any]] = {
    "opd_type": None,
    "opd_log_prob_top_k": 0,
    "opd_top_k_strategy": "only-student",
    "opd_reward_weight_mode": "student_p",
    "opd_topk_per_position": False,
    "opd_teacher_urls": None,
    "opd_teacher_key": "opd_teacher",
}


class OPDSampleError(OPDStreamError):
    """A sample could not be scored; ``reason`` is the :class:`SampleFailure` reason.

    Raised as one of its subclasses where the reference raises a ``ValueError`` or a
    ``TimeoutError`` (see :func:`sample_error`).
    """

    def __init__(self, failure: SampleFailure, message: str | None = None) -> None:
        super().__init__(message or f"OPD scoring failed ({failure.reason}): {failure.message}")
        self.reason = failure.reason
        self.attempts = failure.attempts


class MilesRoutingError(OPDSampleError, ValueError):
    """The sample's teacher key is missing or names no teacher, and there is no ``default``
    teacher (the reference raises ``ValueError`` with the same wording)."""


class MilesInvalidSampleError(OPDSampleError, ValueError):
    """The sample itself is invalid (``invalid_sample``), or a selected candidate has no
    logprob (``missing_logprob``): the reference raises ``ValueError`` for both."""


class MilesTimeoutError(OPDSampleError, TimeoutError):
    """A request did not finish within ``request_deadline_s`` (``deadline_exceeded``); the
    reference's aiohttp timeout is a ``TimeoutError`` too."""


_VALUE_ERROR_REASONS: Final = frozenset({"invalid_sample", "missing_logprob"})


def sample_error(failure: SampleFailure) -> OPDSampleError:
    """The exception :func:`reward_func` raises for ``failure``, in the reference's family:
    :class:`MilesRoutingError` (``routing``), :class:`MilesInvalidSampleError`
    (``invalid_sample``, ``missing_logprob``), :class:`MilesTimeoutError`
    (``deadline_exceeded``), else :class:`OPDSampleError`."""
    if failure.reason == "routing":
        return MilesRoutingError(failure, failure.message)
    if failure.reason in _VALUE_ERROR_REASONS:
        return MilesInvalidSampleError(failure)
    if failure.reason == "deadline_exceeded":
        return MilesTimeoutError(failure)
    return OPDSampleError(failure)


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

    Mapping (spec opd-semantics §7):

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
    if strategy not in _STRATEGIES:
        raise ConfigError(
            f"Unknown OPD top-k strategy: {strategy} "
            f"(--opd-top-k-strategy must be one of {', '.join(_STRATEGIES)})"
        )
    weight_mode = get("opd_reward_weight_mode", "student_p") or "student_p"
    if weight_mode not in _WEIGHT_MODES:
        raise ConfigError(
            f"Unknown OPD reward weight mode: {weight_mode} "
            f"(--opd-reward-weight-mode must be one of {', '.join(_WEIGHT_MODES)})"
        )

    fields: dict[str, Any] = {
        "teachers": teachers,
        "teacher_key": get("opd_teacher_key") or "opd_teacher",
        "top_k": top_k,
        "strategy": strategy if top_k > 0 else "only-student",
        "weight_mode": weight_mode,
    }
    if get("opd_topk_per_position", False):
        fields["id_scoring"] = "per-position"
    ip, port = get("sglang_router_ip"), get("sglang_router_port")
    if ip and port:
        host = f"[{ip}]" if ":" in str(ip) else str(ip)
        fields["student_url"] = f"http://{host}:{int(port)}"
    timeout = get("sglang_router_request_timeout_secs")
    if timeout is not None and not isinstance(timeout, bool) and timeout > 0:
        if not math.isfinite(float(timeout)):
            raise ConfigError("--sglang-router-request-timeout-secs must be finite")
        fields["request_deadline_s"] = float(timeout)
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
        }
        named = str(exc).split(":", 1)[0].replace(" (from", ",").split(", ")
        hints = [flag[name.strip()] for name in named if name.strip() in flag]
        hint = ", ".join(hints)
        raise ConfigError(f"{exc}" + (f" (Miles flags: {hint})" if hint else "")) from None


def _to_sample(sample: Any, key: int, config: StreamConfig) -> Sample:
    """A :class:`Sample` from a duck-typed Miles sample (tokens, response_length, metadata).

    Only what the reference reads is taken: the student top-k rows
    (``metadata["opd_student_top_logprobs"]``, its last R rows) when the strategy reads the
    student's top-k, never ``rollout_log_probs`` (the reference does not use them: a
    merged multi-turn sample's 0.0 on observation spans, or any other value there, must not
    fail the sample). Rows may be short or empty (``[]``), and hold ``None`` entries. The
    teacher's own prompt, when the sample has one, is ``metadata[TEACHER_PROMPT_KEY]``.
    """
    response_length = int(sample.response_length)
    metadata = getattr(sample, "metadata", None)
    metadata = metadata if isinstance(metadata, Mapping) else {}
    top = None
    if config.top_k > 0 and config.strategy != "only-teacher":
        top = metadata.get(_TOP_KEY)
        if top is not None:
            top = list(top)[-response_length:] if response_length > 0 else []
    return Sample(
        list(sample.tokens),
        response_length,
        metadata=metadata,
        student_top_logprobs=top,
        sample_id=key,
        teacher_prompt_ids=metadata.get(TEACHER_PROMPT_KEY),
    )


def _route_error(config: StreamConfig, metadata: Mapping[str, Any]) -> str | None:
    """The reference's message when the sample's teacher key is missing or unknown and no
    ``default`` teacher is configured, else None (the same rule as the stream's router)."""
    teachers = config.teachers
    if DEFAULT_TEACHER in teachers:
        return None
    key = config.teacher_key
    name = metadata.get(key)
    if name is not None and str(name) in teachers:
        return None
    if name is not None:
        return (
            f"Sample metadata[{key!r}]={_show_value(name)} matches no teacher name configured "
            f"by --opd-teacher-urls (known: {sorted(teachers)}) and no 'default' entry is "
            "configured."
        )
    return (
        f"Sample metadata is missing teacher key {key!r} and no 'default' teacher entry "
        "is configured."
    )


class MilesEngine:
    """One long-lived ``stream.run()`` shared by concurrent :meth:`score` calls.

    Bound to the asyncio loop of its first :meth:`score` call. Not reusable after
    :meth:`aclose`.

    Args:
        config: the stream configuration.
        transport: passed to :class:`OPDStream` (default: pooled aiohttp).
    """

    def __init__(self, config: StreamConfig, *, transport: Transport | None = None) -> None:
        self.config = config
        self._transport = transport
        self._keys = itertools.count()
        self._pending: dict[int, asyncio.Future[ScoredSample | SampleFailure]] = {}
        self._send: MemoryObjectSendStream[Submission] | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._closed = False
        self.stream: OPDStream | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the engine runs on (``None`` before the first call)."""
        return self._loop

    def _start(self) -> MemoryObjectSendStream[Submission]:
        if self._closed:
            raise RuntimeError("MilesEngine is closed")
        if self._error is not None:
            raise OPDStreamError(
                f"the shared OPD stream stopped: {type(self._error).__name__}: {self._error}"
            )
        loop = asyncio.get_running_loop()
        if self._send is not None:
            if loop is not self._loop:
                raise RuntimeError("MilesEngine used from a different event loop")
            return self._send
        send, receive = anyio.create_memory_object_stream[Submission](self.config.max_inflight)
        self._send, self._loop = send, loop
        self._task = loop.create_task(self._serve(receive), name="opd_stream.miles")
        return send

    async def _serve(self, receive: MemoryObjectReceiveStream[Submission]) -> None:
        # Each item carries its caller's cancel scope (the pipeline's Submission).
        samples = cast(AsyncIterable[Sample], receive)
        try:
            async with OPDStream(self.config, transport=self._transport) as stream:
                self.stream = stream
                async with receive, stream.run(samples) as results:
                    async for item in results:
                        future = self._pending.pop(item.sample.sample_id, None)
                        if future is not None and not future.done():
                            future.set_result(item)
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self.stream = None
            error = self._error or OPDStreamError("the shared OPD stream ended")
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(error)
            self._pending.clear()

    async def score(self, sample: Any) -> ScoredSample | SampleFailure:
        """Score one duck-typed sample through the shared stream; wait for its result."""
        key = next(self._keys)
        prepared = _to_sample(sample, key, self.config)
        message = _route_error(self.config, prepared.metadata)
        if message is not None:  # before the stream, in the reference's words
            failure = SampleFailure(
                sample=prepared, index=-1, reason="routing", message=message, attempts=0
            )
            raise MilesRoutingError(failure, message)
        send = self._start()
        assert self._loop is not None
        future: asyncio.Future[ScoredSample | SampleFailure] = self._loop.create_future()
        self._pending[key] = future
        scope = anyio.CancelScope()
        try:
            await send.send(Submission(prepared, scope))
            return await future
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise OPDStreamError("the shared OPD stream is not running") from None
        finally:
            self._pending.pop(key, None)
            # No result: the caller stopped waiting (asyncio cancels the awaited future with
            # the task) or the stream failed. Its requests in flight stop too.
            if not future.done() or future.cancelled():
                scope.cancel()

    async def aclose(self) -> None:
        """End the input, let samples already sent finish, and wait for the background task."""
        self._closed = True
        send, self._send = self._send, None
        task, self._task = self._task, None
        if send is not None:
            await send.aclose()
        if task is not None:
            with contextlib.suppress(Exception):  # already delivered to the callers
                await task


_ENGINES: dict[tuple[int, bytes], MilesEngine] = {}


def _config_key(config: StreamConfig) -> bytes:
    values = config.to_log_dict()
    if config.api_key is not None:
        values["api_key"] = config.api_key.get_secret_value()  # in-memory key only
    return msgspec.json.encode(values)


def engine_for(args: Any, *, transport: Transport | None = None) -> MilesEngine:
    """The shared engine for ``args`` on the running loop (created on first use).

    Args:
        args: Miles' arguments (see :func:`config_from_miles_args`).
        transport: used only when the engine is created here (tests pass a fake one).
    """
    loop = asyncio.get_running_loop()
    for stale in [k for k, e in _ENGINES.items() if e.loop is not None and e.loop.is_closed()]:
        del _ENGINES[stale]
    config = config_from_miles_args(args)
    key = (id(loop), _config_key(config))
    engine = _ENGINES.get(key)
    if engine is None or engine.loop not in (None, loop):
        engine = _ENGINES[key] = MilesEngine(config, transport=transport)
    return engine


async def close() -> None:
    """Close every engine of the running loop (call once when rollouts are over)."""
    loop = asyncio.get_running_loop()
    for key in [k for k in _ENGINES if k[0] == id(loop)]:
        await _ENGINES.pop(key).aclose()


def _as_float32(values: torch.Tensor) -> torch.Tensor:
    import torch

    return values.detach().to(device="cpu", dtype=torch.float32)


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> dict[str, Any]:
    """Score one sample (Miles' ``reward_func`` signature).

    Returns:
        ``{"teacher_log_probs": float32 [R]}`` in sampled-token mode, or
        ``{"opd_reverse_kl": float32 [R]}`` in top-k mode, plus ``"opd_stream"``: the
        teacher name, attempts and latency.

    Raises:
        MilesRoutingError: (a ``ValueError``) the sample's teacher key is missing or
            unknown and there is no ``default`` teacher; the reference's wording.
        MilesInvalidSampleError: (a ``ValueError``) the sample is invalid, or a selected
            candidate has no logprob.
        MilesTimeoutError: (a ``TimeoutError``) a request ran past its deadline.
        OPDSampleError: any other failure (its ``reason`` says why: ``teacher_http_503``,
            ``misaligned_response``, ...); the reference raises on any failed request too.
        ConfigError: (a ``ValueError``) the flags or ``OPD_STREAM_*`` variables are invalid.
    """
    del kwargs
    engine = engine_for(args)
    result = await engine.score(sample)
    if isinstance(result, SampleFailure):
        raise sample_error(result)
    out: dict[str, Any] = {
        _RESULT_KEY: {
            "teacher": result.teacher,
            "attempts": result.attempts,
            "latency_s": result.latency_s,
        }
    }
    if engine.config.top_k > 0:
        assert result.reverse_kl is not None
        out["opd_reverse_kl"] = _as_float32(result.reverse_kl)
    else:
        out["teacher_log_probs"] = _as_float32(result.teacher_logprobs)
    return out


def _reward_of(args: Any, sample: Any) -> Mapping[str, Any]:
    getter = getattr(sample, "get_reward_value", None)
    value = getter(args) if callable(getter) else getattr(sample, "reward", None)
    if not (isinstance(value, Mapping) and _RESULT_KEY in value):
        value = getattr(sample, "reward", None)
    if not (isinstance(value, Mapping) and _RESULT_KEY in value):
        raise ValueError(
            "post_process_rewards: a sample's reward is not an opd_stream reward_func "
            "result (set --custom-rm-path opd_stream.integrations.miles.reward_func)"
        )
    return value


def post_process_rewards(
    args: Any, samples: Sequence[Any], **kwargs: Any
) -> tuple[list[float], list[float]]:
    """Attach the OPD signal to each sample (Miles' ``post_process_rewards`` signature).

    Sets ``sample.opd_reverse_kl`` (top-k mode) or ``sample.teacher_log_probs``
    (sampled-token mode), float32 ``[R]``, from the dict :func:`reward_func` returned
    (read with ``sample.get_reward_value(args)`` when the sample has it, else
    ``sample.reward``). Returns ``(raw, processed)`` scalar rewards: zeros, as the
    reference (pure OPD).

    Raises:
        ValueError: a sample's reward is not a :func:`reward_func` result, or its signal
            length is not the sample's ``response_length``.
    """
    del kwargs
    for sample in samples:
        reward = _reward_of(args, sample)
        name = "opd_reverse_kl" if "opd_reverse_kl" in reward else "teacher_log_probs"
        values = reward[name]
        if int(values.shape[0]) != int(sample.response_length):
            raise ValueError(
                f"post_process_rewards: {name} has {int(values.shape[0])} values for a "
                f"response of {int(sample.response_length)} tokens"
            )
        setattr(sample, name, values)
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
