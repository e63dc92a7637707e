"""The aiohttp application of the mock SGLang server, and :class:`MockServer` that runs it.

Routes (SGLang 0.5.23 names): ``POST|PUT /generate``, ``GET /health``, ``GET /health_generate``,
``GET /ready``, ``GET /model_info`` (+ ``/get_model_info``), ``GET /server_info``
(+ ``/get_server_info``), ``GET|POST /flush_cache``, ``POST /abort_request``.
Mock-only (never authenticated): ``GET /mock/stats``, ``POST /mock/options`` (a JSON object of
:class:`MockOptions` fields to change), ``POST /mock/reset_stats``.

The server runs with aiohttp's handler cancellation on, so a client that disconnects cancels
its request (like SGLang's abort on disconnect); that is counted in ``stats.disconnects``.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from ._model import MockModel, Role
from ._options import FAULT_KINDS, FaultKind, MockOptions
from ._protocol import (
    GenerateItem,
    RequestError,
    abort_response,
    build_item_response,
    error_response_body,
    parse_generate_request,
)
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
    ) -> None:
        self.role: Role = role
        self.seed = seed
        self.host = host
        self.port = port
        self.replica_index = replica_index
        self.options = options if options is not None else MockOptions()
        self.stats = MockStats()
        self.model = self._build_model(self.options)
        self._fault_rng = self._make_fault_rng(self.options)
        self._started_at = time.monotonic()
        self._healthy = True
        self._runner: web.AppRunner | None = None
        self._in_flight_rids: set[str] = set()
        self._aborted_rids: set[str] = set()
        self._abort_all_epoch = 0
        self._cond: asyncio.Condition | None = None
        self._request_counter = 0
        self._pad_cache: bytes = b""
        self._replay: dict[bytes, tuple[bytes, int, int]] = {}
        self._replay_bytes = 0

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
        r.add_post("/generate", self._generate)
        r.add_put("/generate", self._generate)
        for path in ("/health", "/health_generate", "/ready"):
            r.add_get(path, self._health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self._server_info)
        r.add_get("/flush_cache", self._flush_cache)
        r.add_post("/flush_cache", self._flush_cache)
        r.add_post("/abort_request", self._abort_request)
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
        self._cond = asyncio.Condition()
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
            self._fault_rng = self._make_fault_rng(new)
        self.options = new
        if self._cond is not None:
            asyncio.get_running_loop().create_task(self._notify_all())
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

    def _make_fault_rng(self, o: MockOptions) -> random.Random:
        base = self.seed if o.fault_seed is None else o.fault_seed
        return random.Random(base * 1_000_003 + self.replica_index * 7919 + 17)

    async def _notify_all(self) -> None:
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()

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
                return self._respond(_encoder.encode({"error": "Unauthorized"}), 401)
        return await handler(request)

    def _respond(
        self, body: bytes, status: int = 200, content_type: str = "application/json"
    ) -> web.Response:
        self.stats.count_status(status)
        self.stats.bytes_sent += len(body)
        return web.Response(body=body, status=status, content_type=content_type)

    def _starting(self) -> bool:
        return time.monotonic() - self._started_at < self.options.startup_delay_s

    # ------------------------------------------------------------------ simple endpoints

    async def _health(self, request: web.Request) -> web.Response:
        ok = self._healthy and not self._starting()
        return self._respond(b"", 200 if ok else 503, content_type="text/plain")

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
        return self._respond(_encoder.encode(info))

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
            "status": "ready" if not self._starting() else "starting",
            "max_total_num_tokens": o.context_length * 64,
            "max_req_input_len": o.context_length - 1,
            "internal_states": [
                {"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": o.max_running}
            ],
            "version": "0.5.23",
            "frontend": "python",
            "mock": {"role": self.role, "seed": self.seed, "vocab_size": o.vocab_size},
        }
        return self._respond(_encoder.encode(info))

    async def _flush_cache(self, request: web.Request) -> web.Response:
        return self._respond(_FLUSH_TEXT.encode(), content_type="text/plain")

    async def _abort_request(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            body = {}
        if isinstance(body, dict):
            if body.get("abort_all"):
                self._abort_all_epoch += 1
            rid = body.get("rid")
            if isinstance(rid, str) and rid in self._in_flight_rids:
                self._aborted_rids.add(rid)
        return self._respond(b"", content_type="text/plain")

    async def _mock_stats(self, request: web.Request) -> web.Response:
        return self._respond(_encoder.encode(self.stats.snapshot()))

    async def _mock_options(self, request: web.Request) -> web.Response:
        try:
            changes = msgspec.json.decode(await request.read())
            if not isinstance(changes, dict):
                raise TypeError("expected a JSON object")
            merged = {**msgspec.to_builtins(self.options), **changes}
            new = self.set_options(msgspec.convert(merged, MockOptions))
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError) as exc:
            return self._respond(_encoder.encode({"error": {"message": str(exc)}}), 400)
        return self._respond(_encoder.encode(msgspec.to_builtins(new)))

    async def _mock_reset_stats(self, request: web.Request) -> web.Response:
        self.stats.reset()
        return self._respond(b"", content_type="text/plain")

    # ------------------------------------------------------------------ /generate

    def _draw_fault(self) -> FaultKind | None:
        rates = self.options.fault_rates()
        if not any(rates.values()):
            return None
        u = self._fault_rng.random()
        acc = 0.0
        for kind in FAULT_KINDS:
            acc += rates[kind]
            if u < acc:
                return kind
        return None

    def _latency(self, tokens: int) -> float:
        o = self.options
        lat = o.latency_fixed_s + o.latency_per_token_s * tokens
        if o.latency_tail_scale_s > 0.0:
            tail = o.latency_tail_scale_s * (
                self._fault_rng.paretovariate(o.latency_tail_alpha) - 1
            )
            lat += min(o.latency_tail_cap_s, tail)
        return max(lat, 0.0)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        st = self.stats
        st.generate_requests += 1
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            return await self._generate_inner(request)
        except asyncio.CancelledError:
            st.disconnects += 1
            raise
        finally:
            st.in_flight -= 1

    async def _generate_inner(self, request: web.Request) -> web.StreamResponse:
        st = self.stats
        raw = await request.read()
        st.bytes_received += len(raw)
        o = self.options
        if self._starting():
            return self._respond(error_response_body("The server is starting.", 503), 503)
        if o.replay_cache_bytes > 0 and not any(o.fault_rates().values()):
            hit = self._replay.get(raw)
            if hit is not None:
                return await self._replay_hit(hit)
        try:
            spec = parse_generate_request(
                raw,
                vocab_size=o.vocab_size,
                context_length=o.context_length,
                per_position=o.per_position,
            )
            dup = [it.rid for it in spec.items if it.rid in self._in_flight_rids]
            if dup:
                exc = RequestError("value", f"Duplicate request ID detected: {dup[0]}")
                exc.in_stream = spec.stream
                raise exc
        except RequestError as exc:
            if exc.error_status < 500:
                st.rejected_invalid += 1
            return self._respond(exc.body, exc.status, content_type=exc.content_type)
        fault = self._draw_fault()
        if fault in ("http_500", "http_503", "http_429"):
            status = int(fault[5:])
            st.count_fault(fault)
            msg = {
                500: "Internal server error (injected).",
                503: "Service unavailable (injected).",
                429: "Too many requests (injected).",
            }[status]
            return self._respond(error_response_body(msg, status), status)
        if fault == "hang":
            st.count_fault(fault)
            await asyncio.Event().wait()  # until the client disconnects (handler cancelled)
        rids = [it.rid for it in spec.items]
        self._in_flight_rids.update(rids)
        try:
            if not await self._acquire_slot():
                st.rejected_queue_full += 1
                body = error_response_body("The request queue is full.", 503)
                return self._respond(body, 503)
            try:
                return await self._serve(request, spec, fault, rids, raw)
            finally:
                st.running -= 1
                await self._notify_one()
        finally:
            self._in_flight_rids.difference_update(rids)
            self._aborted_rids.difference_update(rids)

    async def _acquire_slot(self) -> bool:
        st = self.stats
        cond = self._cond
        assert cond is not None
        if not self.options.max_running or st.running < self.options.max_running:
            st.running += 1
            return True
        mq = self.options.max_queued
        if mq >= 0 and st.queued >= mq:
            return False
        st.queued += 1
        try:
            async with cond:
                while self.options.max_running and st.running >= self.options.max_running:
                    await cond.wait()
        finally:
            st.queued -= 1
        st.running += 1
        return True

    async def _notify_one(self) -> None:
        if self._cond is not None:
            async with self._cond:
                self._cond.notify(1)

    async def _serve(
        self,
        request: web.Request,
        spec: Any,
        fault: FaultKind | None,
        rids: list[str],
        raw: bytes = b"",
    ) -> web.StreamResponse:
        st = self.stats
        o = self.options
        t0 = time.monotonic()
        epoch = self._abort_all_epoch
        tokens = sum(int(it.input_ids.size) + it.max_new_tokens for it in spec.items)
        delay = self._latency(tokens)
        if delay > 0:
            await asyncio.sleep(delay)
        replayable = (
            o.replay_cache_bytes > 0
            and fault is None
            and not spec.stream
            and all(it.max_new_tokens == 0 for it in spec.items)
        )

        aborted = (
            fault == "abort"
            or epoch != self._abort_all_epoch
            or any(r in self._aborted_rids for r in rids)
        )
        objs: list[dict[str, Any]] = []
        items: list[GenerateItem] = spec.items
        if aborted:
            if fault == "abort":
                st.count_fault("abort")
            st.aborted += 1
            objs = [abort_response(it, o.weight_version, "Abort request.") for it in items]
        else:
            item_fault = fault if fault in ("misaligned", "missing_rows") else None
            gc_was_enabled = gc.isenabled()
            gc.disable()  # building ~10^5 small tuples: generational GC passes are pure overhead
            try:
                objs = [self._build(it, spec, item_fault, t0) for it in items]
            finally:
                if gc_was_enabled:
                    gc.enable()
            st.generate_items += len(items)
            if item_fault is not None:
                st.count_fault(item_fault)
        if spec.stream:
            return await self._stream(request, objs, spec.is_batch)
        body = _encoder.encode(objs if spec.is_batch else objs[0])
        if replayable and not aborted:
            self._remember(raw, body, tokens, len(spec.items))
        if fault in ("reset", "truncated", "malformed", "oversized", "slow_drip"):
            st.count_fault(fault)
            return await self._faulty_body(request, body, fault)
        return self._respond(body)

    def _build(self, it: GenerateItem, spec: Any, item_fault: Any, t0: float) -> dict[str, Any]:
        self._request_counter += 1
        seed_key = (
            [self.seed, 1, it.sampling_seed]
            if it.sampling_seed is not None
            else [self.seed, 2, self.replica_index, self._request_counter]
        )
        return build_item_response(
            self.model,
            it,
            rng=np.random.default_rng(seed_key),
            weight_version=self.options.weight_version,
            flat_input=spec.flat_input,
            flat_output=spec.flat_output,
            b64=spec.b64,
            fault=item_fault,
            e2e_latency=time.monotonic() - t0,
            sent_ts=time.time(),
        )

    async def _stream(
        self, request: web.Request, objs: list[dict[str, Any]], is_batch: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.stats.count_status(200)
        for i, obj in enumerate(objs):
            if is_batch:
                obj = {**obj, "index": i}
            chunk = b"data: " + _encoder.encode(obj) + b"\n\n"
            await resp.write(chunk)
            self.stats.bytes_sent += len(chunk)
        await resp.write(b"data: [DONE]\n\n")
        self.stats.bytes_sent += 14
        await resp.write_eof()
        return resp

    def _remember(self, raw: bytes, body: bytes, tokens: int, items: int) -> None:
        limit = self.options.replay_cache_bytes
        size = len(raw) + len(body)
        if size > limit:
            return
        while self._replay and self._replay_bytes + size > limit:
            old_raw = next(iter(self._replay))
            self._replay_bytes -= len(old_raw) + len(self._replay.pop(old_raw)[0])
        self._replay[raw] = (body, tokens, items)
        self._replay_bytes += size

    async def _replay_hit(self, hit: tuple[bytes, int, int]) -> web.Response:
        """Answer a repeated scoring request from the replay cache (capacity and latency
        still apply; parsing and building are skipped)."""
        st = self.stats
        body, tokens, items = hit
        if not await self._acquire_slot():
            st.rejected_queue_full += 1
            return self._respond(error_response_body("The request queue is full.", 503), 503)
        try:
            delay = self._latency(tokens)
            if delay > 0:
                await asyncio.sleep(delay)
            st.generate_items += items
            return self._respond(body)
        finally:
            st.running -= 1
            await self._notify_one()

    def _padding(self, n: int) -> bytes:
        if len(self._pad_cache) != n:
            self._pad_cache = b"x" * n
        return self._pad_cache

    async def _faulty_body(
        self, request: web.Request, body: bytes, fault: FaultKind
    ) -> web.StreamResponse:
        st = self.stats
        if fault == "malformed":
            return self._respond(body[: max(len(body) // 2, 1)])
        if fault == "oversized":
            pad = b'{"mock_padding":"' + self._padding(self.options.oversized_bytes) + b'",'
            big = b"[" + pad + body[2:] if body.startswith(b"[") else pad + body[1:]
            return self._respond(big)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        st.count_status(200)
        transport = request.transport
        if fault == "slow_drip":
            step = max(self.options.drip_chunk_bytes, 1)
            for i in range(0, len(body), step):
                chunk = body[i : i + step]
                await resp.write(chunk)
                st.bytes_sent += len(chunk)
                await asyncio.sleep(self.options.drip_delay_s)
            await resp.write_eof()
            return resp
        part = body[: len(body) // 2] if fault == "reset" else body[: (len(body) * 3) // 4]
        await resp.write(part)
        st.bytes_sent += len(part)
        await asyncio.sleep(0.02)  # let the partial body reach the client
        if transport is not None:
            if fault == "reset":
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.abort()
            else:
                transport.close()
        return resp
