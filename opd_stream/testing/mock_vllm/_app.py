"""The aiohttp application of the mock vLLM server, and :class:`VllmMockServer` that runs it.

Routes (vLLM 0.34.0 names): ``POST /inference/v1/generate`` and
``POST /inference/v1/abort_requests`` (``vllm serve --enable-scale-out``; without it the
generate path answers vLLM's 403), ``POST /v1/completions``, ``GET /health``,
``GET /v1/models``, ``GET /version``; other paths answer FastAPI's 404 / 405; mock-only,
never authenticated: ``/mock/stats``, ``/mock/options``, ``/mock/reset_stats``. The model,
options, stats, capacity, latency, prefix cache, faults and replay cache are the SGLang
mock's, shared, not copied (its :class:`GenerateEndpoint` machinery, driven from here).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from ..mock_sglang import ByteModel, MockOptions, Role
from ..mock_sglang._server import ServerBase
from ._answer import (
    ItemResult,
    aborted_generate_body,
    completions_body,
    generate_body,
    score_item,
)
from ._errors import SCALE_OUT_DISABLED, VllmError, error_body
from ._options import VllmMockOptions
from ._request import Limits, VllmItem, parse_completions, parse_generate

__all__ = ("VLLM_VERSION", "VllmMockServer")

VLLM_VERSION = "0.34.0"
_encoder = msgspec.json.Encoder()
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_GUARDED = ("/v1/", "/inference/")  # vLLM's --api-key guards these prefixes
_INJECTED = {
    500: "Internal server error (injected).",
    503: "Service unavailable (injected).",
    429: "Too many requests (injected).",
}


class VllmMockServer(ServerBase[VllmMockOptions]):
    """One mock vLLM server (see the module docstring).

    Args:
        role, seed, options, host, port, replica_index, byte_model: as for the SGLang mock's
            :class:`~opd_stream.testing.mock_sglang.MockServer` (``options``: a
            :class:`VllmMockOptions`, or a :class:`MockOptions` given vLLM's defaults for
            the rest).
        scale_out: ``vllm serve --enable-scale-out``: ``/inference/v1/generate`` is served
            (else it answers 403 with vLLM's message).
    """

    options_type = VllmMockOptions

    def __init__(
        self,
        role: Role = "teacher",
        seed: int = 0,
        options: MockOptions | None = None,
        *,
        scale_out: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        replica_index: int = 0,
        byte_model: ByteModel | None = None,
    ) -> None:
        self.scale_out = scale_out
        super().__init__(
            role,
            seed,
            options,
            host=host,
            port=port,
            replica_index=replica_index,
            byte_model=byte_model,
        )

    @property
    def model_name(self) -> str:
        """The served model name (``/v1/models``, the answers' ``model``)."""
        return f"mock-{self.role}"

    def build_app(self) -> web.Application:
        """A fresh aiohttp application bound to this server's state."""
        app = web.Application(middlewares=[self._middleware], client_max_size=1 << 31)
        r = app.router
        if self.scale_out:
            r.add_post("/inference/v1/generate", self._generate)
            r.add_post("/inference/v1/abort_requests", self._abort)
        else:
            r.add_post("/inference/v1/generate", self._scale_out_disabled)
        r.add_post("/v1/completions", self._completions)
        r.add_get("/health", self._health)
        r.add_get("/v1/models", self._models)
        r.add_get("/version", self._version)
        r.add_get("/mock/stats", self._mock_stats)
        r.add_post("/mock/options", self._mock_options)
        r.add_post("/mock/reset_stats", self._mock_reset_stats)
        return app

    def _limits(self) -> Limits:
        o = self.options
        return Limits(o.vocab_size, o.context_length, o.effective_max_logprobs(), self.model_name)

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def _middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        st = self.stats
        st.requests += 1
        path = request.path
        st.by_endpoint[path] = st.by_endpoint.get(path, 0) + 1
        key = self.options.api_key
        if key is not None and path.startswith(_GUARDED):
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
                st.auth_failures += 1
                return self.respond(_encoder.encode({"error": "Unauthorized"}), 401)
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return self.respond(_encoder.encode({"detail": "Not Found"}), 404)
        except web.HTTPMethodNotAllowed:
            return self.respond(_encoder.encode({"detail": "Method Not Allowed"}), 405)

    # ------------------------------------------------------------------ simple endpoints

    async def _version(self, request: web.Request) -> web.Response:
        return self.respond(_encoder.encode({"version": VLLM_VERSION}))

    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        card = {
            "id": self.model_name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": f"/nonexistent/opd-stream-mock-{self.role}",
            "parent": None,
            "max_model_len": self.options.context_length,
            "permission": [
                {
                    "id": f"modelperm-mock-{self.role}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return self.respond(_encoder.encode({"object": "list", "data": [card]}))

    async def _scale_out_disabled(self, request: web.Request) -> web.Response:
        await request.read()
        return self.respond(error_body(SCALE_OUT_DISABLED, 403, "PermissionDeniedError"), 403)

    async def _abort(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            return self.respond(error_body(f"JSON decode error: {exc}", 400), 400)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(ids, list):
            return self.respond(error_body("request_ids: Field required", 400, "Bad Request"), 400)
        in_flight = self._endpoint._in_flight_rids
        for rid in ids:
            for name in (rid, f"generate-tokens-{rid}"):
                if isinstance(rid, str) and name in in_flight:
                    self._endpoint._aborted_rids.add(name)
        return self.respond(b"")

    # ------------------------------------------------------------------ scoring endpoints

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_request(request, scale_out=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_request(request, scale_out=False)

    async def _serve_request(self, request: web.Request, *, scale_out: bool) -> web.StreamResponse:
        st = self.stats
        st.generate_requests += 1
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            return await self._serve_inner(request, scale_out)
        except asyncio.CancelledError:
            st.disconnects += 1
            raise
        finally:
            st.in_flight -= 1

    async def _serve_inner(self, request: web.Request, scale_out: bool) -> web.StreamResponse:
        st = self.stats
        eng = self._endpoint
        raw = await request.read()
        st.bytes_received += len(raw)
        o = self.options
        if self.starting():
            return self.respond(error_body("The server is starting.", 503), 503)
        faults_on = any(o.fault_rates().values())
        if o.replay_cache_bytes > 0 and not faults_on:
            hit = eng._replay.get(raw)
            if hit is not None:
                return await eng._replay_hit(hit)
        header_rid = request.headers.get("X-Request-Id")
        flags: dict[str, Any] = {}
        try:
            if scale_out:
                item, _ = parse_generate(raw, self._limits(), header_request_id=header_rid)
                items = [item]
            else:
                items, flags = parse_completions(raw, self._limits(), header_request_id=header_rid)
        except VllmError as exc:
            if exc.status < 500:
                st.rejected_invalid += 1
            return self.respond(exc.body, exc.status)
        fault = eng._draw_fault()
        if fault in ("http_500", "http_503", "http_429"):
            status = int(fault[5:])
            st.count_fault(fault)
            return self.respond(error_body(_INJECTED[status], status), status)
        if fault == "hang":
            st.count_fault(fault)
            await asyncio.Event().wait()  # until the client disconnects
        rids = [it.request_id for it in items]
        eng._in_flight_rids.update(rids)
        try:
            if not await eng._acquire_slot():
                st.rejected_queue_full += 1
                return self.respond(error_body("The request queue is full.", 503), 503)
            try:
                body = await self._answer(items, flags, fault, rids, scale_out)
            finally:
                st.running -= 1
                await eng._notify_one()
        finally:
            eng._in_flight_rids.difference_update(rids)
            eng._aborted_rids.difference_update(rids)
        replayable = (
            o.replay_cache_bytes > 0 and fault is None and all(it.max_tokens == 1 for it in items)
        )
        if replayable:
            tokens = sum(int(it.token_ids.size) + it.max_tokens for it in items)
            eng._remember(raw, body, tokens, len(items))
        if fault in ("reset", "truncated", "malformed", "oversized", "slow_drip"):
            st.count_fault(fault)
            return await eng._faulty_body(request, body, fault)
        return self.respond(body)

    async def _answer(
        self,
        items: list[VllmItem],
        flags: dict[str, Any],
        fault: str | None,
        rids: list[str],
        scale_out: bool,
    ) -> bytes:
        eng = self._endpoint
        st = self.stats
        o = self.options
        epoch = eng._abort_all_epoch
        tokens = sum(int(it.token_ids.size) + it.max_tokens for it in items)
        delay = eng._latency(tokens)
        if delay > 0:
            await asyncio.sleep(delay)
        details = o.prompt_tokens_details
        aborted = (
            fault == "abort"
            or epoch != eng._abort_all_epoch
            or any(r in eng._aborted_rids for r in rids)
        )
        if aborted:
            if fault == "abort":
                st.count_fault("abort")
            st.aborted += 1
            if scale_out:
                return _encoder.encode(
                    aborted_generate_body(items[0], self.model_name, details=details)
                )
            aborted_results = [
                ItemResult(
                    it,
                    token_ids=[],
                    finish_reason="abort",
                    stop_reason=None,
                    prompt_logprobs=None,
                    id_logprobs=None,
                    cached_tokens=0,
                    weight_version="",
                )
                for it in items
            ]
            return _encoder.encode(
                completions_body(aborted_results, flags, self.model_name, details=details)
            )
        cached = await eng._compute(items)
        item_fault = fault if fault in ("misaligned", "missing_rows") else None
        results: list[ItemResult] = []
        for it, hit in zip(items, cached, strict=True):
            if it.salt is not None:
                st.record_salt(it.salt)
            eng._request_counter += 1
            seed_key = (
                [self.seed, 1, it.seed]
                if it.seed is not None
                else [self.seed, 2, self.replica_index, eng._request_counter]
            )
            results.append(
                score_item(
                    self.model,
                    it,
                    rng=np.random.default_rng(seed_key),
                    cached_tokens=hit,
                    weight_version=eng._signal.weight_version(o.weight_version, o.weight_versions),
                    shift=eng._signal.shift(it, o.logprob_offset, o.warm_drift),
                    byte_model=self.byte_model,
                    fault=item_fault,
                )
            )
        st.generate_items += len(items)
        if item_fault is not None:
            st.count_fault(item_fault)
        if scale_out:
            return _encoder.encode(generate_body(results[0], self.model_name, details=details))
        return _encoder.encode(completions_body(results, flags, self.model_name, details=details))
