"""The aiohttp application of the mock SGLang server, and :class:`MockServer` that runs it.

The server's lifecycle, options, authentication and simple endpoints are here; ``/generate``
and ``/abort_request`` are :class:`~._generate.GenerateEndpoint`'s.

Routes (SGLang 0.5.23 names): ``POST|PUT /generate``, ``GET /health``, ``GET /health_generate``,
``GET /ready``, ``GET /model_info`` (+ ``/get_model_info``), ``GET /server_info``
(+ ``/get_server_info``), ``GET|POST /flush_cache``, ``POST /abort_request``.
Mock-only (never authenticated): ``GET /mock/stats``, ``POST /mock/options`` (a JSON object of
:class:`MockOptions` fields to change), ``POST /mock/reset_stats``.

The server runs with aiohttp's handler cancellation on, so a client that disconnects cancels
its request (like SGLang's abort on disconnect); that is counted in ``stats.disconnects``.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from ._bytemodel import ByteModel
from ._generate import GenerateEndpoint
from ._model import MockModel, Role
from ._options import MockOptions
from ._stats import MockStats

__all__ = ("MockServer",)

_OPEN_PATHS = frozenset({"/health", "/health_generate", "/ready", "/metrics"})
_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
_encoder = msgspec.json.Encoder()
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class MockServer:
    """One mock SGLang server: a :class:`MockModel`, options, stats and an aiohttp app.

    Args:
        role: ``"teacher"`` or ``"student"``.
        seed: model seed (replicas of one logical server must share it).
        options: initial :class:`MockOptions`.
        host: interface to bind (keep it on loopback).
        port: port to bind; 0 picks a free one (kept across :meth:`restart`).
        replica_index: mixed into the fault/latency RNG seed so replicas differ.
        byte_model: when set, the sampled tokens' logprobs come from this model over
            bytes (cross-tokenizer tests; see :class:`~._bytemodel.ByteModel`).
    """

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
        self.options = options if options is not None else MockOptions()
        self.stats = MockStats()
        self.model = self._build_model(self.options)
        self._started_at = time.monotonic()
        self._healthy = True
        self._runner: web.AppRunner | None = None
        self._generate = GenerateEndpoint(self)

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT`` (the port is known once started)."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server is currently listening."""
        return self._runner is not None

    def build_app(self) -> web.Application:
        """A fresh aiohttp application bound to this server's state."""
        app = web.Application(middlewares=[self._middleware], client_max_size=1 << 31)
        r = app.router
        r.add_post("/generate", self._generate.handle)
        r.add_put("/generate", self._generate.handle)
        for path in ("/health", "/health_generate", "/ready"):
            r.add_get(path, self._health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self._server_info)
        r.add_get("/flush_cache", self._flush_cache)
        r.add_post("/flush_cache", self._flush_cache)
        r.add_post("/abort_request", self._generate.abort_request)
        r.add_get("/mock/stats", self._mock_stats)
        r.add_post("/mock/options", self._mock_options)
        r.add_post("/mock/reset_stats", self._mock_reset_stats)
        return app

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
        addrs = runner.addresses
        self.port = int(addrs[0][1])
        self._runner = runner
        self._started_at = time.monotonic()
        self._generate.started()
        return self.url

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

    def set_options(self, options: MockOptions | None = None, **changes: Any) -> MockOptions:
        """Replace options (a full :class:`MockOptions` and/or field changes); returns the new.

        Changing a model knob rebuilds the model; changing ``fault_seed`` reseeds the faults.
        """
        base = options if options is not None else self.options
        new = msgspec.structs.replace(base, **changes) if changes else base
        new = msgspec.convert(msgspec.to_builtins(new), MockOptions)  # runs validation
        model_keys = ("vocab_size", "head_size", "divergence", "masked_ids")
        if any(getattr(new, k) != getattr(self.options, k) for k in model_keys):
            self.model = self._build_model(new)
        if new.fault_seed != self.options.fault_seed:
            self._generate.reseed(new)
        self.options = new
        self._generate.options_changed()
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

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def _middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        st = self.stats
        st.requests += 1
        path = request.path
        st.by_endpoint[path] = st.by_endpoint.get(path, 0) + 1
        key = self.options.api_key
        if key is not None and path not in _OPEN_PATHS and not path.startswith("/mock/"):
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
                st.auth_failures += 1
                return self.respond(_encoder.encode({"error": "Unauthorized"}), 401)
        return await handler(request)

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

    # ------------------------------------------------------------------ simple endpoints

    async def _health(self, request: web.Request) -> web.Response:
        ok = self._healthy and not self.starting()
        return self.respond(b"", 200 if ok else 503, content_type="text/plain")

    async def _model_info(self, request: web.Request) -> web.Response:
        if not self.options.info_endpoints:
            raise web.HTTPNotFound()
        info = {
            "model_path": f"/nonexistent/opd-stream-mock-{self.role}",
            "served_model_name": f"mock-{self.role}",
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.options.weight_version,
            "load_format": "dummy",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "opd_stream_mock",
            "architectures": ["MockForCausalLM"],
        }
        return self.respond(_encoder.encode(info))

    async def _server_info(self, request: web.Request) -> web.Response:
        if not self.options.info_endpoints:
            raise web.HTTPNotFound()
        o = self.options
        info = {
            "model_path": f"/nonexistent/opd-stream-mock-{self.role}",
            "tokenizer_path": None,
            "host": self.host,
            "port": self.port,
            "context_length": o.context_length,
            "dp_size": 1,
            "tp_size": 1,
            "skip_tokenizer_init": True,
            "max_running_requests": o.max_running or None,
            "max_queued_requests": None if o.max_queued < 0 else o.max_queued,
            "launch_command": "python -m opd_stream.testing.mock_sglang",
            "status": "ready" if not self.starting() else "starting",
            "max_total_num_tokens": o.context_length * 64,
            "max_req_input_len": o.context_length - 1,
            "internal_states": [
                {"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": o.max_running}
            ],
            "version": "0.5.23",
            "frontend": "python",
            "mock": {"role": self.role, "seed": self.seed, "vocab_size": o.vocab_size},
        }
        return self.respond(_encoder.encode(info))

    async def _flush_cache(self, request: web.Request) -> web.Response:
        self._generate.flush_cache()
        return self.respond(_FLUSH_TEXT.encode(), content_type="text/plain")

    async def _mock_stats(self, request: web.Request) -> web.Response:
        return self.respond(_encoder.encode(self.stats.snapshot()))

    async def _mock_options(self, request: web.Request) -> web.Response:
        try:
            changes = msgspec.json.decode(await request.read())
            if not isinstance(changes, dict):
                raise TypeError("expected a JSON object")
            merged = {**msgspec.to_builtins(self.options), **changes}
            new = self.set_options(msgspec.convert(merged, MockOptions))
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError) as exc:
            return self.respond(_encoder.encode({"error": {"message": str(exc)}}), 400)
        return self.respond(_encoder.encode(msgspec.to_builtins(new)))

    async def _mock_reset_stats(self, request: web.Request) -> web.Response:
        self.stats.reset()
        return self.respond(b"", content_type="text/plain")
