"""The aiohttp application of the mock SGLang server, and :class:`MockServer` that runs it.

Lifecycle, options, authentication and simple endpoints are here; ``/generate`` and
``/abort_request`` are :class:`~._generate.GenerateEndpoint`'s. Routes (SGLang 0.5.23
names): ``POST|PUT /generate``, ``GET /health``, ``GET /health_generate``, ``GET /ready``,
``GET /model_info`` (+ ``/get_model_info``), ``GET /server_info`` (+ ``/get_server_info``),
``GET|POST /flush_cache``, ``POST /abort_request``; mock-only, never authenticated:
``GET /mock/stats``, ``POST /mock/options``, ``POST /mock/reset_stats``. Handler
cancellation is on: a client that disconnects cancels its request (``stats.disconnects``).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from ._options import MockOptions
from ._server import ServerBase

__all__ = ("MockServer",)

_OPEN_PATHS = frozenset({"/health", "/health_generate", "/ready", "/metrics"})
_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
_encoder = msgspec.json.Encoder()
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class MockServer(ServerBase[MockOptions]):
    """One mock SGLang server: a :class:`MockModel`, options, stats and an aiohttp app.

    Args: as :class:`~._server.ServerBase` (``options``: a :class:`MockOptions`).
    """

    health_content_type = "text/plain"

    def build_app(self) -> web.Application:
        """A fresh aiohttp application bound to this server's state."""
        app = web.Application(middlewares=[self._middleware], client_max_size=1 << 31)
        r = app.router
        r.add_post("/generate", self._endpoint.handle)
        r.add_put("/generate", self._endpoint.handle)
        for path in ("/health", "/health_generate", "/ready"):
            r.add_get(path, self._health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self._server_info)
        r.add_get("/flush_cache", self._flush_cache)
        r.add_post("/flush_cache", self._flush_cache)
        r.add_post("/abort_request", self._endpoint.abort_request)
        r.add_get("/mock/stats", self._mock_stats)
        r.add_post("/mock/options", self._mock_options)
        r.add_post("/mock/reset_stats", self._mock_reset_stats)
        return app

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

    # ------------------------------------------------------------------ simple endpoints

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
        self._endpoint.flush_cache()
        return self.respond(_FLUSH_TEXT.encode(), content_type="text/plain")
