"""Which dialect each server speaks (SGLang, vLLM scale-out, vLLM completions): the engine
settings per server URL, the rules of detection, and the detection itself (issue 33).

Settings: ``engine`` (``auto`` or one engine for every server) and ``server_engines`` (per
URL, wins). Under ``auto`` a URL is SGLang until its ``/generate`` answers 404 or 405; then,
once per URL, ``/inference/v1/generate`` (``"vllm"``), else ``/v1/completions``
(``"vllm-completions"``), else a kept :class:`~opd_stream.CapabilityError`
(``capability="engine"``). A 5xx, 429 or connection failure leaves the engine unknown. The
result is kept on the URL's :class:`~opd_stream.fleet._endpoints.Endpoint` (``engine``).
:func:`normalize_server_engines`, :func:`configured_engine`, :func:`verdict` and
:func:`max_logprobs_problem` are sans-IO; :class:`EngineDirectory` is the async shell. In
full: ``docs/design-notes.md``, "opd_stream/fleet/_engines.py".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Final, Literal

import anyio

from .._errors import (
    RETRYABLE_STATUSES,
    CapabilityError,
    ConfigError,
    ServerError,
    ServerHTTPError,
)
from .._logging import get_logger
from ..transport._transports import Request, Transport
from ..wire._error_body import parse_error_message
from ..wire._payloads import probe_body
from ..wire._request import ENGINES, Engine
from ..wire._vllm import ENGINE_PATHS
from ._endpoints import Endpoints
from ._routing import endpoint_url, normalize_server_url

__all__ = (
    "DETECT_STATUSES",
    "ENGINE_SETTINGS",
    "UNKNOWN_ENGINE",
    "EngineDirectory",
    "EngineSetting",
    "EngineUnknown",
    "configured_engine",
    "max_logprobs_problem",
    "normalize_server_engines",
    "verdict",
)

log = get_logger()

EngineSetting = Literal["auto", "sglang", "vllm", "vllm-completions"]
"""``StreamConfig.engine``: ``auto`` (detected per URL) or one :data:`Engine`."""
ENGINE_SETTINGS: Final[tuple[EngineSetting, ...]] = ("auto", *ENGINES)

DETECT_STATUSES: Final = frozenset({404, 405})
"""What SGLang's ``/generate`` path answers on a server that is not SGLang (vLLM: 404)."""

UNKNOWN_ENGINE: Final = "engine_unknown"
"""``CapabilityError.capability`` of an attempt answered 404/405 on ``/generate`` by a URL
whose engine is still to detect: the fetcher detects it and asks again (not a failure)."""

_PROBE_MAX_BYTES: Final = 1024 * 1024
_SHOWN_MESSAGE: Final = 160

_HINTS: Final[Mapping[Engine, Mapping[int, str]]] = {
    "sglang": {},
    "vllm": {
        403: "vLLM's scale-out API is off: start vLLM with --enable-scale-out",
        404: "no scale-out API: vLLM 0.34 or later with --enable-scale-out has it",
    },
    "vllm-completions": {},
}


def normalize_server_engines(
    spec: str | Mapping[str, str] | Iterable[str],
) -> dict[str, Engine]:
    """``server_engines`` as given (``"URL=vllm,URL2=sglang"``, a mapping of URL to engine,
    or ``URL=ENGINE`` entries) -> ``{normalised base URL: engine}``.

    Raises:
        ConfigError: an entry without ``=``, an unknown engine, a bad URL, a URL twice.
    """
    if isinstance(spec, str):
        entries = [_entry(part) for part in spec.split(",") if part.strip()]
    elif isinstance(spec, Mapping):
        entries = [(str(url), value) for url, value in spec.items()]
    else:
        try:
            entries = [_entry(item) for item in spec]
        except TypeError:
            raise ConfigError(
                "must be URL=ENGINE entries or a mapping of URL to engine, "
                f"got {type(spec).__name__}"
            ) from None
    out: dict[str, Engine] = {}
    for url, value in entries:
        base = normalize_server_url(url)
        engine = value.strip().lower() if isinstance(value, str) else value
        if engine not in ENGINES:
            raise ConfigError(f"unknown engine {value!r} for {base}; one of {', '.join(ENGINES)}")
        if base in out:
            raise ConfigError(f"{base} is given twice")
        out[base] = engine
    return out


def _entry(item: object) -> tuple[str, str]:
    if not isinstance(item, str):
        raise TypeError
    # the URL holds '=' only in a query string; the engine never does: split at the last
    url, sep, engine = item.strip().rpartition("=")
    if not sep or not url:
        raise ConfigError(f"expected URL=ENGINE, got {item.strip()!r}")
    return url, engine


def configured_engine(
    url: str, setting: EngineSetting, server_engines: Mapping[str, Engine]
) -> Engine | None:
    """The engine set for ``url`` (``server_engines``, else ``engine``); ``None`` = auto."""
    engine = server_engines.get(url)
    if engine is not None:
        return engine
    return None if setting == "auto" else setting


def verdict(url: str, tried: list[tuple[str, int, str]]) -> Engine | None:
    """Detection's decision from the answers so far (``(path, status, server message)`` in
    the order tried): the engine found, ``None`` to try the next path.

    Raises:
        CapabilityError: ``"engine"``: every path tried and none scores; the message names
            the URL, each path and its answer, and what to change.
    """
    path, status, _ = tried[-1]
    if status == 200:
        return next(e for e, p in ENGINE_PATHS.items() if p == path.lstrip("/"))
    if len(tried) < 1 + len(_DETECTED):
        return None
    parts = []
    for p, s, message in tried:
        engine = next(e for e, q in ENGINE_PATHS.items() if q == p.lstrip("/"))
        hint = _HINTS[engine].get(s)
        shown = f" ({hint})" if hint else (f" ({message})" if message else "")
        parts.append(f"POST /{p.lstrip('/')} answered {s}{shown}")
    raise CapabilityError(
        "engine",
        f"no scoring API found at {url}: {'; '.join(parts)}. Serve the model with SGLang, "
        "or with vLLM (0.34 or later with --enable-scale-out for every strategy; "
        "/v1/completions serves sampled-token mode and the teacher's top-k only), or set "
        "engine / server_engines to the server's engine",
        url=url,
    )


_DETECTED: Final[tuple[Engine, ...]] = ("vllm", "vllm-completions")
"""The engines detection tries, in order (after SGLang's ``/generate``)."""

_MAX_LOGPROBS = re.compile(r"greater than max allowed: (-?\d+)")
_REQUESTED = re.compile(r"(?:Requested|of) (\d+)")


def max_logprobs_problem(engine: Engine, status: int, message: str) -> str | None:
    """A vLLM 400 that refuses more logprobs per row than its ``--max-logprobs``: the
    sentence to fail with (what to raise), else ``None``."""
    if engine == "sglang" or status != 400:
        return None
    found = _MAX_LOGPROBS.search(message)
    if found is None:
        return None
    allowed = int(found.group(1))
    asked = _REQUESTED.search(message)
    need = f"--max-logprobs {asked.group(1)} or more" if asked else "a larger --max-logprobs"
    return (
        f"vLLM refused the request: it allows {allowed} logprobs per row (its "
        f"--max-logprobs); start vLLM with {need}, or set vllm_max_logprobs "
        f"(OPD_STREAM_VLLM_MAX_LOGPROBS) to {allowed} so the ids per row are split into "
        "several requests (a top-k asked of the server, the teacher's or the student's, "
        "cannot be split)"
    )


class EngineUnknown(CapabilityError):
    """An attempt answered ``status`` (404/405) on ``/generate`` by a URL whose engine is
    still to detect (``engine="auto"``): the fetcher detects it (:meth:`EngineDirectory.
    detect`) and asks again; never a sample's failure, nor an endpoint's."""

    def __init__(self, status: int, *, side: str, url: str) -> None:
        super().__init__(
            UNKNOWN_ENGINE,
            f"/generate answered {status}: not SGLang; its engine is detected",
            side=side,
            url=url,
        )
        self.status = status


class _Detection:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.error: ServerError | None = None


class EngineDirectory:
    """The engine of every URL of one stream: configured, or detected once (``auto``).

    What is known lives on each URL's :class:`~opd_stream.fleet._endpoints.Endpoint`
    (``engine``; ``engine_problem`` once detection found nothing)."""

    def __init__(
        self,
        endpoints: Endpoints,
        transport: Transport,
        *,
        setting: EngineSetting = "auto",
        server_engines: Mapping[str, Engine] | None = None,
        max_logprobs: int = 20,
        secret: str | None = None,
        gateway_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self._endpoints = endpoints
        self._transport = transport
        self._setting = setting
        self._server_engines = dict(server_engines or {})
        self._running: dict[str, _Detection] = {}
        self._secret = secret
        self._gateway_of = gateway_of  # a discovered worker's gateway (its engine setting)
        self.max_ids = max(max_logprobs, 0)
        """``ScoreRequest.max_ids`` of a vLLM request (``vllm_max_logprobs``; -1 -> 0)."""

    def engine(self, url: str) -> Engine:
        """The engine to speak to ``url`` now: the configured or detected one, else (auto,
        not known yet) SGLang's."""
        ep = self._endpoints(url)
        if ep.engine is None:
            ep.engine = configured_engine(url, self._setting, self._server_engines)
            gateway = None if self._gateway_of is None else self._gateway_of(url)
            if gateway is not None and url not in self._server_engines:
                # a worker found behind a gateway speaks what the gateway was set to
                ep.engine = configured_engine(gateway, self._setting, self._server_engines)
        return "sglang" if ep.engine is None else ep.engine

    def known(self, url: str) -> Engine | None:
        """The engine of ``url`` where configured or detected, else ``None``."""
        self.engine(url)
        return self._endpoints(url).engine

    def detects(self, url: str) -> bool:
        """A 404/405 from ``url``'s ``/generate`` means: ask again in its engine, detected
        now (auto, unknown) or already (a request sent as SGLang's while a concurrent one
        detected it); not for a URL known or set to be SGLang."""
        return self.known(url) != "sglang"

    def answered(self, url: str, engine: Engine) -> None:
        """``url`` answered a request of ``engine`` (200): under auto, its engine is known."""
        ep = self._endpoints(url)
        if ep.engine is None:
            ep.engine = engine

    async def detect(self, side: str, url: str, status: int) -> Engine:
        """The engine of ``url``, whose ``/generate`` answered ``status`` (404/405): the
        known one, or detected now (once: concurrent callers wait for one detection).

        Raises:
            CapabilityError: ``"engine"``: no scoring API there (kept for later callers).
            ServerError: a 5xx/429 answer or a connection failure while probing (the
                engine stays unknown).
        """
        ep = self._endpoints(url)
        while True:
            if ep.engine_problem is not None:
                raise CapabilityError("engine", ep.engine_problem, side=side, url=url)
            known = self.known(url)
            if known is not None:
                return known
            running = self._running.get(url)
            if running is not None:
                await running.done.wait()
                if running.error is not None:
                    raise running.error
                continue  # found, refused for good, or cancelled: look again
            mine = self._running[url] = _Detection()
            try:
                ep.engine = await self._probe(side, url, status)
            except CapabilityError as exc:
                ep.engine_problem = str(exc)
                log.warning("engine_not_found", side=side, url=url)
                raise
            except ServerError as exc:
                mine.error = exc
                raise
            finally:
                del self._running[url]
                mine.done.set()
            log.info("engine_detected", side=side, url=url, engine=ep.engine)

    async def discover(self, side: str, url: str) -> Engine:
        """The engine of ``url``: the known one, or (auto) found now with a tiny scoring
        request to ``/generate`` (200: SGLang), then :meth:`detect` on a 404/405 (what
        ``probe_at_start`` does for a server it has no other request for: the student).

        Raises:
            CapabilityError: ``"engine"``: no scoring API there.
            ServerError: another answer or a connection failure (the engine stays unknown).
        """
        known = self.known(url)
        if known is not None:
            return known
        status, message = await self._ask(side, url, ENGINE_PATHS["sglang"], probe_body("sglang"))
        if status == 200:
            self.answered(url, "sglang")
            return "sglang"
        if status in DETECT_STATUSES:
            return await self.detect(side, url, status)
        raise ServerHTTPError(status, message, side=side, url=url)

    async def _probe(self, side: str, url: str, status: int) -> Engine:
        tried: list[tuple[str, int, str]] = [(ENGINE_PATHS["sglang"], status, "")]
        for engine in _DETECTED:
            path = ENGINE_PATHS[engine]
            got = await self._ask(side, url, path, probe_body(engine))
            tried.append((path, *got))
            found = verdict(url, tried)
            if found is not None:
                return found
        raise AssertionError("verdict decides by the last path")  # pragma: no cover

    async def _ask(self, side: str, url: str, path: str, body: bytes) -> tuple[int, str]:
        """One detection request: its status and the server's message (cut short); a
        status that says nothing about the engine (5xx, 429) is raised."""
        try:
            resp = await self._transport.send(
                Request(url=endpoint_url(url, path), max_bytes=_PROBE_MAX_BYTES, body=body)
            )
        except ServerError as exc:
            exc.side, exc.url = side, url
            raise
        if resp.status == 200:
            return 200, ""
        message = parse_error_message(resp.body, secret=self._secret)
        if resp.status in RETRYABLE_STATUSES or resp.status >= 500:
            raise ServerHTTPError(resp.status, message, side=side, url=url)
        return resp.status, message[:_SHOWN_MESSAGE]
