"""What every mock server shares, whatever wire it speaks: :class:`ServerBase` (the model,
options, stats, the request machinery of :class:`~._generate.GenerateEndpoint`, its
lifecycle on aiohttp, ``/health`` and the mock-only ``/mock/*`` endpoints).

The SGLang mock (:class:`~._app.MockServer`) and the vLLM mock
(:class:`~opd_stream.testing.mock_vllm.VllmMockServer`) add their routes (``build_app``).
"""

from __future__ import annotations

import asyncio
import signal
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

import msgspec
from aiohttp import web

from ._bytemodel import ByteModel
from ._generate import GenerateEndpoint
from ._model import MockModel, Role
from ._options import MockOptions
from ._stats import MockStats

__all__ = ("ServerBase",)

_encoder = msgspec.json.Encoder()
OptionsT = TypeVar("OptionsT", bound=MockOptions)
_MODEL_KEYS = ("vocab_size", "head_size", "divergence", "masked_ids")


class ServerBase(ABC, Generic[OptionsT]):
    """One mock server's state and lifecycle (see the module docstring).

    Args:
        role: ``"teacher"`` or ``"student"``.
        seed: model seed (replicas of one logical server must share it).
        options: initial options (:attr:`options_type`, or a :class:`MockOptions` that
            :meth:`coerce_options` turns into one).
        host: interface to bind (keep it on loopback).
        port: port to bind; 0 picks a free one (kept across :meth:`restart`).
        replica_index: mixed into the fault/latency RNG seed so replicas differ.
        byte_model: when set, the sampled tokens' logprobs come from this model over
            bytes (cross-tokenizer tests; see :class:`~._bytemodel.ByteModel`).
    """

    options_type: ClassVar[type[MockOptions]] = MockOptions
    #: the ``/health`` answer's content type
    health_content_type: ClassVar[str] = "application/json"

    def __init__(
        self,
        role: Role = "teacher",
        seed: int = 0,
        options: MockOptions | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        replica_index: int = 0,
        byte_model: ByteModel | None = None,
    ) -> None:
        self.role: Role = role
        self.byte_model = byte_model
        self.seed = seed
        self.host = host
        self.port = port
        self.replica_index = replica_index
        self.options: OptionsT = self.coerce_options(options)
        self.stats = MockStats()
        self.model = self._build_model(self.options)
        self._started_at = time.monotonic()
        self._healthy = True
        self._runner: web.AppRunner | None = None
        self._endpoint = GenerateEndpoint(self)  # capacity, faults, latency, cache, compute

    def coerce_options(self, options: MockOptions | None) -> OptionsT:
        """``options`` as this server's options type (the defaults for ``None``)."""
        kind = self.options_type
        if options is None:
            options = kind()
        elif not isinstance(options, kind):
            options = msgspec.convert(msgspec.to_builtins(options), kind)
        return options  # type: ignore[return-value]

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT`` (the port is known once started)."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server is currently listening."""
        return self._runner is not None

    @abstractmethod
    def build_app(self) -> web.Application:
        """A fresh aiohttp application bound to this server's state (its wire's routes)."""

    async def start(self) -> str:
        """Start listening (on ``port``, or a free port the first time) and return the URL."""
        if self._runner is not None:
            return self.url
        runner = web.AppRunner(
            self.build_app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = int(runner.addresses[0][1])
        self._runner = runner
        self._started_at = time.monotonic()
        self._endpoint.started()
        return self.url

    async def serve_until_signalled(self) -> None:
        """The command line's life: start, print ``listening on URL`` (the line a parent
        process waits for), serve until SIGTERM or SIGINT, stop."""
        url = await self.start()
        print(f"listening on {url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop listening; in-flight requests are cancelled (their clients see a reset)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def restart(self) -> str:
        """Stop, then start again on the same port (stats are kept)."""
        await self.stop()
        return await self.start()

    def set_healthy(self, healthy: bool) -> None:
        """Make ``/health`` answer 200 (True) or 503 (False)."""
        self._healthy = healthy

    def set_options(self, options: MockOptions | None = None, **changes: Any) -> OptionsT:
        """Replace options (a full options Struct and/or field changes); returns the new.

        Changing a model knob rebuilds the model; changing ``fault_seed`` reseeds the faults.
        """
        base = self.coerce_options(options) if options is not None else self.options
        new = msgspec.structs.replace(base, **changes) if changes else base
        new = msgspec.convert(msgspec.to_builtins(new), type(base))  # runs validation
        if any(getattr(new, k) != getattr(self.options, k) for k in _MODEL_KEYS):
            self.model = self._build_model(new)
        if new.fault_seed != self.options.fault_seed:
            self._endpoint.reseed(new)
        self.options = new
        self._endpoint.options_changed()
        return new

    def _build_model(self, o: MockOptions) -> MockModel:
        return MockModel(
            self.role,
            self.seed,
            o.vocab_size,
            head_size=o.head_size,
            divergence=o.divergence,
            masked_ids=o.masked_ids,
        )

    def respond(
        self, body: bytes, status: int = 200, content_type: str = "application/json"
    ) -> web.Response:
        """An answer, counted in :attr:`stats` (status and bytes sent)."""
        self.stats.count_status(status)
        self.stats.bytes_sent += len(body)
        return web.Response(body=body, status=status, content_type=content_type)

    def starting(self) -> bool:
        """Whether the server is still in its ``startup_delay_s`` (``/health`` answers 503)."""
        return time.monotonic() - self._started_at < self.options.startup_delay_s

    # ------------------------------------------------------------------ shared endpoints

    async def _health(self, request: web.Request) -> web.Response:
        ok = self._healthy and not self.starting()
        return self.respond(b"", 200 if ok else 503, content_type=self.health_content_type)

    async def _mock_stats(self, request: web.Request) -> web.Response:
        return self.respond(_encoder.encode(self.stats.snapshot()))

    async def _mock_options(self, request: web.Request) -> web.Response:
        try:
            changes = msgspec.json.decode(await request.read())
            if not isinstance(changes, dict):
                raise TypeError("expected a JSON object")
            merged = {**msgspec.to_builtins(self.options), **changes}
            new = self.set_options(msgspec.convert(merged, self.options_type))
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError) as exc:
            return self.respond(_encoder.encode({"error": {"message": str(exc)}}), 400)
        return self.respond(_encoder.encode(msgspec.to_builtins(new)))

    async def _mock_reset_stats(self, request: web.Request) -> web.Response:
        self.stats.reset()
        return self.respond(b"", content_type="text/plain")
