"""The ``/generate`` endpoint of the mock SGLang server (and ``/abort_request``, its aborts).

One :class:`GenerateEndpoint` per :class:`~._app.MockServer` holds what answering
``/generate`` needs across requests: the request ids in flight and those asked to abort, the
capacity (``max_running`` running, ``max_queued`` waiting), the fault and latency RNG, the
replay cache, the prefix cache and the simulated GPU (``_prefix_cache``). A request is
parsed (:mod:`._request`), may draw an injected fault, waits for capacity and latency (and
its compute time), and is answered (:mod:`._answer`), whole or as an event stream.
"""

from __future__ import annotations

import asyncio
import gc
import random
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
from aiohttp import web

from ._answer import abort_response, build_item_response
from ._bytemodel import ByteModel
from ._errors import RequestError, error_response_body
from ._model import MockModel
from ._options import FAULT_KINDS, FaultKind, MockOptions
from ._prefix_cache import CacheItem, PrefixCache, reusable_limit
from ._request import GenerateItem, parse_generate_request
from ._signal import SignalState
from ._stats import MockStats

__all__ = ("GenerateEndpoint", "Host")

_encoder = msgspec.json.Encoder()


class Host(Protocol):
    """What the endpoint reads of its server (:class:`~._app.MockServer`)."""

    seed: int
    replica_index: int
    stats: MockStats
    model: MockModel
    byte_model: ByteModel | None

    @property
    def options(self) -> MockOptions: ...

    def respond(
        self, body: bytes, status: int = 200, content_type: str = "application/json"
    ) -> web.Response: ...

    def starting(self) -> bool: ...


class GenerateEndpoint:
    """``/generate`` and ``/abort_request`` of one server (see the module docstring).

    Args:
        server: the server whose options, stats and model are used (read on each request).
    """

    def __init__(self, server: Host) -> None:
        self._server = server
        self._fault_rng = self._make_fault_rng(server.options)
        self._in_flight_rids: set[str] = set()
        self._aborted_rids: set[str] = set()
        self._abort_all_epoch = 0
        self._cond: asyncio.Condition | None = None
        self._request_counter = 0
        self._pad_cache: bytes = b""
        self._replay: dict[bytes, tuple[bytes, int, int]] = {}
        self._replay_bytes = 0
        self._prefix: PrefixCache | None = None
        self._gpu: asyncio.Lock | None = None
        self._signal = SignalState()

    def started(self) -> None:
        """The server (re)started listening: a fresh capacity condition and GPU on its loop."""
        self._cond = asyncio.Condition()
        self._gpu = asyncio.Lock()

    def flush_cache(self) -> None:
        """``/flush_cache``: the prefix cache forgets everything."""
        if self._prefix is not None:
            self._prefix.clear()

    def _prefix_cache(self, o: MockOptions) -> PrefixCache | None:
        """The replica's prefix cache (rebuilt empty when its size options change)."""
        cache = self._prefix
        if o.prefix_cache_tokens <= 0:
            self._prefix = None
            return None
        if (
            cache is None
            or cache.page_size != o.prefix_cache_page
            or cache.capacity_pages != o.prefix_cache_tokens // o.prefix_cache_page
        ):
            cache = self._prefix = PrefixCache(o.prefix_cache_tokens, o.prefix_cache_page)
        return cache

    async def _compute(self, items: Sequence[CacheItem]) -> list[int]:
        """Each item's ``cached_tokens``; under the compute model the replica's GPU is held
        for the time the uncached tokens take. The items' inputs are cached afterwards."""
        o = self._server.options
        st = self._server.stats
        cache = self._prefix_cache(o)
        timed = o.compute_fixed_s > 0 or o.compute_per_token_s > 0
        gpu = self._gpu if timed else None
        if gpu is not None:
            await gpu.acquire()
        try:
            cached: list[int] = []
            computed = 0
            for it in items:
                length = int(it.input_ids.size)
                hit = 0
                if cache is not None:
                    limit = reusable_limit(length, it.return_logprob, it.logprob_start_len)
                    hit = cache.match(it.input_ids, limit, it.cache_salt)
                    cache.insert(it.input_ids, it.cache_salt)  # the next item may reuse it
                cached.append(hit)
                computed += length - hit + it.max_new_tokens
            if timed:
                seconds = o.compute_fixed_s + o.compute_per_token_s * computed
                await asyncio.sleep(seconds)
                st.compute_s += seconds
        finally:
            if gpu is not None:
                gpu.release()
        st.prompt_tokens += sum(int(it.input_ids.size) for it in items)
        st.cached_tokens += sum(cached)
        st.computed_tokens += computed
        return cached

    def reseed(self, options: MockOptions) -> None:
        """``fault_seed`` changed: a fresh fault and latency RNG."""
        self._fault_rng = self._make_fault_rng(options)

    def options_changed(self) -> None:
        """Wake every request waiting for capacity (``max_running`` may have grown)."""
        if self._cond is not None:
            asyncio.get_running_loop().create_task(self._notify_all())

    def _make_fault_rng(self, o: MockOptions) -> random.Random:
        base = self._server.seed if o.fault_seed is None else o.fault_seed
        return random.Random(base * 1_000_003 + self._server.replica_index * 7919 + 17)

    async def _notify_all(self) -> None:
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()

    async def abort_request(self, request: web.Request) -> web.Response:
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
        return self._server.respond(b"", content_type="text/plain")

    def _draw_fault(self) -> FaultKind | None:
        rates = self._server.options.fault_rates()
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
        o = self._server.options
        lat = o.latency_fixed_s + o.latency_per_token_s * tokens
        if o.latency_tail_scale_s > 0.0:
            tail = o.latency_tail_scale_s * (
                self._fault_rng.paretovariate(o.latency_tail_alpha) - 1
            )
            lat += min(o.latency_tail_cap_s, tail)
        return max(lat, 0.0)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """``POST|PUT /generate``."""
        st = self._server.stats
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
        st = self._server.stats
        raw = await request.read()
        st.bytes_received += len(raw)
        o = self._server.options
        if self._server.starting():
            return self._server.respond(error_response_body("The server is starting.", 503), 503)
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
            return self._server.respond(exc.body, exc.status, content_type=exc.content_type)
        fault = self._draw_fault()
        if fault in ("http_500", "http_503", "http_429"):
            status = int(fault[5:])
            st.count_fault(fault)
            msg = {
                500: "Internal server error (injected).",
                503: "Service unavailable (injected).",
                429: "Too many requests (injected).",
            }[status]
            return self._server.respond(error_response_body(msg, status), status)
        if fault == "hang":
            st.count_fault(fault)
            await asyncio.Event().wait()  # until the client disconnects (handler cancelled)
        rids = [it.rid for it in spec.items]
        self._in_flight_rids.update(rids)
        try:
            if not await self._acquire_slot():
                st.rejected_queue_full += 1
                body = error_response_body("The request queue is full.", 503)
                return self._server.respond(body, 503)
            try:
                return await self._serve(request, spec, fault, rids, raw)
            finally:
                st.running -= 1
                await self._notify_one()
        finally:
            self._in_flight_rids.difference_update(rids)
            self._aborted_rids.difference_update(rids)

    async def _acquire_slot(self) -> bool:
        st = self._server.stats
        cond = self._cond
        assert cond is not None
        if not self._server.options.max_running or st.running < self._server.options.max_running:
            st.running += 1
            return True
        mq = self._server.options.max_queued
        if mq >= 0 and st.queued >= mq:
            return False
        st.queued += 1
        try:
            async with cond:
                while (
                    self._server.options.max_running
                    and st.running >= self._server.options.max_running
                ):
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
        st = self._server.stats
        o = self._server.options
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
            cached = await self._compute(items)
            item_fault = fault if fault in ("misaligned", "missing_rows") else None
            gc_was_enabled = gc.isenabled()
            gc.disable()  # building ~10^5 small tuples: generational GC passes are pure overhead
            try:
                objs = [
                    self._build(it, spec, item_fault, t0, hit)
                    for it, hit in zip(items, cached, strict=True)
                ]
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
        return self._server.respond(body)

    def _build(
        self, it: GenerateItem, spec: Any, item_fault: Any, t0: float, cached: int = 0
    ) -> dict[str, Any]:
        self._request_counter += 1
        o = self._server.options
        if it.cache_salt is not None:
            self._server.stats.record_salt(it.cache_salt)
        seed_key = (
            [self._server.seed, 1, it.sampling_seed]
            if it.sampling_seed is not None
            else [self._server.seed, 2, self._server.replica_index, self._request_counter]
        )
        return build_item_response(
            self._server.model,
            it,
            rng=np.random.default_rng(seed_key),
            weight_version=self._signal.weight_version(o.weight_version, o.weight_versions),
            flat_input=spec.flat_input,
            flat_output=spec.flat_output,
            b64=spec.b64,
            fault=item_fault,
            e2e_latency=time.monotonic() - t0,
            sent_ts=time.time(),
            cached_tokens=cached,
            shift=self._signal.shift(it, o.logprob_offset, o.warm_drift),
            byte_model=self._server.byte_model,
        )

    async def _stream(
        self, request: web.Request, objs: list[dict[str, Any]], is_batch: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self._server.stats.count_status(200)
        for i, obj in enumerate(objs):
            if is_batch:
                obj = {**obj, "index": i}
            chunk = b"data: " + _encoder.encode(obj) + b"\n\n"
            await resp.write(chunk)
            self._server.stats.bytes_sent += len(chunk)
        await resp.write(b"data: [DONE]\n\n")
        self._server.stats.bytes_sent += 14
        await resp.write_eof()
        return resp

    def _remember(self, raw: bytes, body: bytes, tokens: int, items: int) -> None:
        limit = self._server.options.replay_cache_bytes
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
        st = self._server.stats
        body, tokens, items = hit
        if not await self._acquire_slot():
            st.rejected_queue_full += 1
            return self._server.respond(error_response_body("The request queue is full.", 503), 503)
        try:
            delay = self._latency(tokens)
            if delay > 0:
                await asyncio.sleep(delay)
            st.generate_items += items
            return self._server.respond(body)
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
        st = self._server.stats
        if fault == "malformed":
            return self._server.respond(body[: max(len(body) // 2, 1)])
        if fault == "oversized":
            pad = b'{"mock_padding":"' + self._padding(self._server.options.oversized_bytes) + b'",'
            big = b"[" + pad + body[2:] if body.startswith(b"[") else pad + body[1:]
            return self._server.respond(big)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        st.count_status(200)
        transport = request.transport
        if fault == "slow_drip":
            step = max(self._server.options.drip_chunk_bytes, 1)
            for i in range(0, len(body), step):
                chunk = body[i : i + step]
                await resp.write(chunk)
                st.bytes_sent += len(chunk)
                await asyncio.sleep(self._server.options.drip_delay_s)
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
