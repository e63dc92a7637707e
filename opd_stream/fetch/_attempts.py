"""One HTTP attempt at a time: send to a replica (hedged to another when it is slow),
check the status, decode, and keep per-endpoint health; re-admission probes.

An attempt is one path, :meth:`AttemptSender._attempt`: a lease of the stream's byte
budget, the body built and sent (under ``attempt_timeout_s``), the answer read and its
status classified, decoded, and its outcome recorded.

The retry loop and the request plan live in ``_fetcher``; replica choice and health
bookkeeping (sans-IO) in ``_balance``; capability state in ``_capabilities``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel

from .._errors import (
    CapabilityError,
    ConnectionFailed,
    OPDStreamError,
    ServerError,
    ServerHTTPError,
    WeightVersionChanged,
)
from .._logging import get_logger
from .._stats import StageName, StatsRecorder
from ..config._settings import StreamConfig
from ..fleet._balance import ROUTING_KEY_HEADER, ROUTING_TOKENS_HEADER, EndpointPool, Route
from ..fleet._capabilities import Capabilities, Side
from ..fleet._endpoints import Endpoints
from ..fleet._engines import DETECT_STATUSES, EngineDirectory, EngineUnknown, max_logprobs_problem
from ..fleet._routing import endpoint_url
from ..transport._budget import BudgetLease, ByteBudget
from ..transport._transports import Request, Transport
from ..wire._answers import Body, ScoreRows
from ..wire._codec import Answer, Parser, answer_size, decode, decode_in_slices
from ..wire._error_body import parse_error_message
from ..wire._payloads import build_block_payloads
from ..wire._request import Layout, ScoreRequest, layout, multi_body
from ..wire._vllm import ENGINE_PATHS
from ._retry import retry_after_s
from ._threads import (
    SLICE_BYTES,
    build_in_thread,
    decode_in_thread,
    read_in_slices,
    sliced_on_loop,
    timed_build,
    timed_decode,
)

__all__ = ("AttemptSender", "Counter", "Failed", "loop_clock")

log = get_logger()

_PROBE_TIMEOUT_S = 2.0
"""Longest wait for a re-admission probe's ``/health`` answer."""

_PROBE_MAX_BYTES = 64 * 1024

_NO_WATCHDOG = contextlib.nullcontext()
"""An attempt's watchdog under ``attempt_timeout_s=0`` (reusable: it holds nothing)."""


def loop_clock() -> Callable[[], float]:
    """The running event loop's clock, the one ``anyio.current_time()`` reads, looked up
    once (anyio finds the backend anew at each call, through sniffio: ~8 calls each).

    On asyncio, the loop's ``time``; elsewhere (trio, and its ``MockClock`` in tests), or
    with no loop running, ``anyio.current_time`` itself. A trio run hosted on an asyncio
    loop (guest mode) keeps anyio's: its clock is not the loop's (trio's has an offset).
    """
    try:
        now = asyncio.get_running_loop().time
    except RuntimeError:
        return anyio.current_time
    try:
        same = abs(anyio.current_time() - now()) < 1.0
    except Exception:  # (no backend anyio can find: keep its own lookup)
        same = False
    return now if same else anyio.current_time


class Counter:
    """Attempts made (a mutable count shared by the requests of one sample)."""

    __slots__ = ("attempts",)

    def __init__(self) -> None:
        self.attempts = 0


class Failed(Exception):
    """One attempt failed with ``error``; ``url`` and ``req`` say which one."""

    def __init__(self, error: OPDStreamError, url: str, req: ScoreRequest) -> None:
        super().__init__(error.reason)
        self.error = error
        self.url = url
        self.req = req


class AttemptSender:
    """Sends attempts for one stream: per-endpoint concurrency limits, hedging, health."""

    def __init__(
        self,
        config: StreamConfig,
        transport: Transport,
        stats: StatsRecorder,
        endpoints: Endpoints,
        pool: EndpointPool,
        capabilities: Capabilities,
        engines: EngineDirectory,
        *,
        threads: anyio.CapacityLimiter | None = None,
    ) -> None:
        self._cfg = config
        self._transport = transport
        self._stats = stats
        self._endpoints = endpoints
        self._pool = pool
        self._caps = capabilities
        self._engines = engines
        self._threads = threads
        self._body_budget = ByteBudget(config.max_inflight_response_bytes)
        self._secret = config.api_key.get_secret_value() if config.api_key else None
        self._limiters: dict[str, anyio.CapacityLimiter] = {}
        # one answer parsed on the loop at a time: a turn of the loop gives parsing one
        # slice at most, however many answers have arrived together
        self._parsing = anyio.Lock(fast_acquire=True)
        self.now = loop_clock()  # anyio.current_time, looked up once (made on the loop)

    def _pick(
        self, urls: tuple[str, ...], exclude: tuple[str, ...] = (), key: Route | None = None
    ) -> str | None:
        """The replica for the next attempt (see :class:`EndpointPool`)."""
        return self._pool.pick(urls, exclude, key)

    def _limiter(self, url: str) -> anyio.CapacityLimiter:
        lim = self._limiters.get(url)
        if lim is None:
            lim = self._limiters[url] = anyio.CapacityLimiter(self._cfg.max_inflight_per_endpoint)
        return lim

    async def send(
        self,
        side: Side,
        urls: tuple[str, ...],
        url: str,
        make: Callable[[str], ScoreRequest],
        counter: Counter,
        tries: Counter,
        key: Route | None = None,
    ) -> ScoreRows:
        """One attempt to ``url``, hedged to another replica of ``urls`` when it is slow.

        ``key`` (the request's :class:`~opd_stream.fleet._balance.Route`) places a hedge on
        the next replica of the key's order, charges the replica its work, and goes out as
        ``X-SMG-Routing-Key`` and ``X-SMG-Routing-Tokens``.

        Raises:
            Failed: the attempt failed (when hedged: every launched copy failed; the
                error reported is a capability error if any, else the first attempt's).
        """
        req = make(url)
        tries.attempts += 1
        counter.attempts += 1
        delay = self._pool.hedge_delay(
            urls, self._cfg.hedge_after_percentile, self._cfg.hedge_min_s
        )
        if delay is None or tries.attempts >= self._cfg.max_attempts:
            return await self._attempt(side, urls, url, req, key)

        winner: list[ScoreRows] = []
        won_by: list[str] = []
        failures: list[Failed] = []
        racing: list[str] = [url]
        finished = 0
        settled = anyio.Event()
        changed = [anyio.Event()]  # set when any racing attempt ends

        async def run(target: str, request: ScoreRequest) -> None:
            nonlocal finished
            try:
                rows = await self._attempt(side, urls, target, request, key)
            except Failed as failed:
                failures.append(failed)
            else:
                if not winner:
                    winner.append(rows)
                    won_by.append(target)
                    if target != url:
                        self._endpoints(target).traffic.hedge_wins += 1
            finished += 1
            changed[0].set()
            if winner or finished == len(racing):
                settled.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, url, req)
            with anyio.move_on_after(delay):
                await settled.wait()
            # Hedge to a replica not yet racing; when a hedge fails while an earlier
            # attempt is still running, hedge again (within max_attempts).
            while not settled.is_set():
                other = self._pick(urls, exclude=tuple(racing), key=key)
                if other is None or tries.attempts >= self._cfg.max_attempts:
                    await settled.wait()
                    break
                tries.attempts += 1
                counter.attempts += 1
                self._endpoints(other).traffic.hedges += 1
                racing.append(other)
                log.debug("hedge", side=side, after_s=delay)
                tg.start_soon(run, other, make(other))
                # Wait for the outcome, or for this hedge to fail (then hedge again).
                while not settled.is_set() and all(f.url != other for f in failures):
                    changed[0] = anyio.Event()
                    await changed[0].wait()
            for target in racing:
                if target not in won_by and all(f.url != target for f in failures):
                    self._endpoints(target).traffic.cancelled += 1  # the loser, cancelled now
            tg.cancel_scope.cancel()
        if winner:
            return winner[0]
        for failed in failures:
            if isinstance(failed.error, CapabilityError):
                raise failed
        first = [f for f in failures if f.url == url]
        raise (first or failures)[0]

    async def _attempt(
        self,
        side: Side,
        urls: tuple[str, ...],
        url: str,
        req: ScoreRequest,
        key: Route | None = None,
    ) -> ScoreRows:
        """One HTTP attempt: lease -> build -> post -> read -> classify -> decode, with its
        outcome recorded for passive health and hedging.

        The answer is charged to the stream's byte budget while it is read (the lease goes
        to the transport in the :class:`Request`) and held until it is decoded (released on
        any exit: success, error, cancel, lost hedge). Under ``attempt_timeout_s`` (> 0) an
        attempt with no answer by then is abandoned (its connection closed) and becomes a
        retryable :class:`ConnectionFailed`: a hung server would otherwise use up the whole
        ``request_deadline_s`` of the logical request.

        Raises:
            Failed: the attempt failed.
        """
        start = self.now()
        limit = self._cfg.attempt_timeout_s
        watchdog = anyio.move_on_after(limit) if limit > 0 else _NO_WATCHDOG
        rows: ScoreRows | None = None
        lay: Layout | None = None
        try:
            with watchdog, self._body_budget.lease() as lease:
                answer: Answer
                try:
                    if multi_body(req):
                        answer = await self._post_blocks(side, url, req, lease, key)
                    else:
                        body, lay = await self._build_body(req)
                        answer = await self._post(
                            side, url, body, lease, key, ENGINE_PATHS[req.engine]
                        )
                except ServerHTTPError as exc:
                    raise self._refusal(side, url, req, exc) from None
                except CapabilityError as exc:  # the engine cannot answer the request (the build)
                    raise _named(exc, side, url) from None
                self._stats.stage_active["decode"] += 1
                try:
                    rows = await self._decode_body(answer, req, lay)
                except ServerError as exc:
                    exc.side = side
                    exc.url = url
                    if isinstance(exc, WeightVersionChanged):  # the server's weights are the last
                        self._endpoints(url).weight_version = exc.versions[-1]
                    raise
                finally:
                    self._stats.stage_active["decode"] -= 1
                self._learn(side, url, req, rows, lay, key)
            if rows is None:  # the watchdog fired
                raise ConnectionFailed(
                    f"no answer within attempt_timeout_s={limit:g} s", side=side, url=url
                )
        except OPDStreamError as exc:
            self._record_failure(side, urls, url, exc)
            raise Failed(exc, url, req) from None
        self._pool.record_success(url, urls, self.now() - start)
        return rows

    def _record_failure(
        self, side: Side, urls: tuple[str, ...], url: str, exc: OPDStreamError
    ) -> None:
        """A failed attempt's outcome, for passive health."""
        if not isinstance(exc, CapabilityError):
            self._endpoints(url).traffic.errors += 1
        if exc.retryable and isinstance(exc, ServerError):
            self._note_failure(side, url, urls)
        if isinstance(exc, ConnectionFailed):
            if exc.refused:  # not reached (a reset or a timeout says nothing either way)
                self._pool.record_refused(url, self.now())
        elif isinstance(exc, ServerError):  # it answered
            self._pool.record_reached(url)

    def _note_failure(self, side: Side, url: str, urls: tuple[str, ...]) -> None:
        if self._pool.record_failure(url, urls, self.now()):  # ejected it
            log.warning(
                "endpoint_ejected",
                side=side,
                url=url,
                after_failures=self._cfg.eject_after_failures,
                cooldown_s=self._cfg.eject_cooldown_s,
            )

    async def maybe_probe(self, side: Side, urls: tuple[str, ...]) -> None:
        """Probe ``/health`` of one ejected replica whose cool-down is over, if any.

        Done lazily, in the requesting task (so no task outlives the stream), bounded by
        :data:`_PROBE_TIMEOUT_S` and the request's deadline. A 200 re-admits the replica;
        anything else ejects it for another cool-down.
        """
        url = self._pool.claim_probe(urls, self.now())
        if url is None:
            return
        healthy: bool | None = None
        try:
            with anyio.move_on_after(_PROBE_TIMEOUT_S):
                try:
                    resp = await self._transport.send(
                        Request(
                            url=endpoint_url(url, "health"),
                            max_bytes=_PROBE_MAX_BYTES,
                            method="GET",
                        )
                    )
                except OPDStreamError:
                    healthy = False
                else:
                    healthy = resp.status == 200
            if healthy is None:
                healthy = False  # the probe timed out
        finally:
            if healthy is None:
                self._pool.release_probe(url)  # cancelled from outside: no verdict
            else:
                self._pool.probe_result(url, healthy, self.now())
                log.info("endpoint_probed", side=side, url=url, healthy=healthy)

    def _learn(
        self,
        side: Side,
        url: str,
        req: ScoreRequest,
        rows: ScoreRows,
        lay: Layout | None,
        key: Route | None,
    ) -> None:
        """What an answer says of its server: tokens, cache, weights, engine, capabilities.

        Raises:
            CapabilityError: ``topk_wire="b64"`` and the server ignored it.
        """
        ep = self._endpoints(url)
        ep.traffic.prompt_tokens += sum(seg.length for seg in (lay or layout(req)).segments)
        if rows.cached_tokens is not None:
            ep.traffic.cached_tokens += rows.cached_tokens
            self._pool.record_cached(url, key, rows.cached_tokens)
        if rows.weight_version is not None:
            ep.weight_version = rows.weight_version  # cache_salt="weight-version" reads it
        self._engines.answered(url, req.engine)
        if req.engine != "sglang":
            return  # SGLang's capabilities (per_position, b64_topk, blocked_batch) only
        if req.top_k > 0:
            self._after_topk(side, url, req, rows)
        if req.ids is not None and req.id_form == "per-position":
            self._caps.note(url, side, "per_position", True)
        if req.ids is not None and req.id_form == "blocked":
            self._endpoints(url).blocked_batch = True

    def _refusal(
        self, side: Side, url: str, req: ScoreRequest, exc: ServerHTTPError
    ) -> OPDStreamError:
        """What an HTTP error means: a 404/405 on ``/generate`` of a URL of unknown engine
        (detect it: :class:`EngineUnknown`), vLLM refusing more logprobs per row than its
        ``--max-logprobs`` (a :class:`CapabilityError` naming the flag), else itself."""
        if (
            req.engine == "sglang"
            and exc.status in DETECT_STATUSES
            and self._engines.known(url) != "sglang"
        ):
            # unknown: detect it; or detected meanwhile (a request sent before): ask again
            return EngineUnknown(exc.status, side=side, url=url)
        problem = max_logprobs_problem(req.engine, exc.status, exc.server_message)
        if problem is not None:
            return _named(CapabilityError("max_logprobs", problem), side, url)
        return exc

    async def _post(
        self,
        side: Side,
        url: str,
        body: bytes,
        lease: BudgetLease,
        key: Route | None = None,
        path: str = ENGINE_PATHS["sglang"],
        *,
        track: bool = True,
    ) -> Body:
        """One HTTP request under the endpoint's limit; the 200 answer's body, charged to
        ``lease`` by the transport as it reads it. ``track``: count it in the replica's
        load (off for a block: its attempt is counted once)."""
        stage: StageName = "teacher_fetch" if side == "teacher" else "student_fetch"
        self._stats.stage_active[stage] += 1
        work = self._pool.begin(url, key) if track else 0
        ep = self._endpoints(url)
        headers: dict[str, str] | None = None
        if key is not None:
            headers = {ROUTING_KEY_HEADER: f"{key.key:016x}"}
            if key.head:
                headers[ROUTING_TOKENS_HEADER] = key.head
        request = Request(
            url=endpoint_url(url, path),
            max_bytes=self._cfg.max_response_bytes,
            body=body,
            headers=headers,
            lease=lease,
        )
        try:
            async with self._limiter(url):
                ep.traffic.requests += 1
                self._stats.requests += 1
                resp = await self._transport.send(request)
        except ServerError as exc:
            exc.side = side
            raise
        finally:
            if track:
                self._pool.end(url, key, work)
            self._stats.stage_active[stage] -= 1
        self._stats.bytes_received += len(resp.body)
        kept = resp.headers
        if kept:
            worker = kept.get("x-smg-routed-worker-id")
            if worker is not None:  # which worker of a gateway answered
                ep.note_worker(worker)
        if resp.status != 200:
            message = parse_error_message(resp.body, secret=self._secret)
            error = ServerHTTPError(resp.status, message, side=side, url=url)
            if kept and resp.status in (429, 503):
                error.retry_after = retry_after_s(kept.get("retry-after"))
            raise error
        return resp.body

    async def _post_blocks(
        self, side: Side, url: str, req: ScoreRequest, lease: BudgetLease, key: Route | None = None
    ) -> list[Body]:
        """A multi-body request (:func:`~opd_stream.wire._request.multi_body`: SGLang's
        ``"blocks"`` id form, or a vLLM request split by ``max_ids``): each body an
        independent request (concurrent, within the endpoint's limit); the first failure
        fails the attempt and cancels the rest."""
        path = ENGINE_PATHS[req.engine]
        start = time.thread_time()
        bodies = build_block_payloads(req)
        self._stats.spent("build", time.thread_time() - start)
        answers: list[Body] = [b""] * len(bodies)

        async def one(n: int) -> None:
            answers[n] = await self._post(side, url, bodies[n], lease, key, path, track=False)

        # one request of the prompt in the replica's load, however many blocks it has:
        # each block carries the prompt, computed once there (the next blocks reuse it)
        work = self._pool.begin(url, key)
        try:
            async with anyio.create_task_group() as tg:
                for n in range(len(bodies)):
                    tg.start_soon(one, n)
        finally:
            self._pool.end(url, key, work)
        return answers

    def _after_topk(self, side: Side, url: str, req: ScoreRequest, rows: ScoreRows) -> None:
        if req.topk_wire != "b64":
            return
        if rows.used_b64:
            self._caps.note(url, side, "b64_topk", True)
            return
        # The server ignored the b64 flags (an SGLang release older than 0.5.23).
        self._caps.note(url, side, "b64_topk", False)
        if self._cfg.topk_wire == "b64":
            raise CapabilityError(
                "b64_topk",
                "topk_wire='b64' but the server answered nested JSON top-k "
                "(it does not support return_flat_raw_top_logprobs_b64)",
                side=side,
                url=url,
            )

    async def _build_body(self, req: ScoreRequest) -> tuple[bytes, Layout]:
        """The request body and its layout; a large one is built in a worker thread (the
        GIL released while the ids are written). Where: ``_threads``."""
        if self._threads is None or not build_in_thread(req, self._cfg.offload_bytes):
            body, lay, cpu = timed_build(req)
            self._stats.spent("build", cpu)  # (on the loop)
            return body, lay
        body, lay, cpu = await anyio.to_thread.run_sync(
            functools.partial(timed_build, req),
            limiter=self._threads,
            abandon_on_cancel=True,
        )
        self._stats.cpu.build += cpu  # (a worker thread's)
        return body, lay

    async def _decode_body(self, body: Answer, req: ScoreRequest, lay: Layout | None) -> ScoreRows:
        """The answer decoded (``_codec``): a large one in one of the decode threads (the GIL
        released while it parses), a smaller one on the loop, the scanner's a slice at a
        time from ``SLICED_FROM`` on. Where: ``_threads``."""
        size = answer_size(body)
        sliced = sliced_on_loop(body, req)
        if self._threads is None or not decode_in_thread(size, self._cfg.offload_bytes, sliced):
            if read_in_slices(size, sliced):
                rows, parser = await self._decode_on_loop(body, req, lay)
            else:
                start = time.thread_time()
                try:
                    rows, parser = decode(body, req, lay=lay)
                finally:
                    self._stats.spent("decode_loop", time.thread_time() - start)
            self._stats.record_decode(parser, size)
            return rows
        # A cancelled caller returns at once; the thread finishes the parse it is in (one
        # answer: ~1.5-3 ns per byte with the scanner, ~0.1 s for a 36 MB answer; msgspec
        # ~4-10, ~0.15-0.4 s: docs/performance.md, "Parsing answers") and its result is dropped.
        got, cpu = await anyio.to_thread.run_sync(
            functools.partial(timed_decode, body, req, lay),
            limiter=self._threads,
            abandon_on_cancel=True,
        )
        self._stats.cpu.decode_threads += cpu
        if isinstance(got, BaseException):
            raise got
        rows, parser = got
        self._stats.record_decode(parser, size)
        return rows

    async def _decode_on_loop(
        self, body: Answer, req: ScoreRequest, lay: Layout | None
    ) -> tuple[ScoreRows, Parser]:
        """Decode on the loop, one answer at a time (:meth:`_read_in_slices`), and one more
        turn of the loop after the answer's last slice before the next answer's read
        starts: answers that arrive together give parsing one slice a turn of the loop."""
        async with self._parsing:
            got = await self._read_in_slices(body, req, lay)
            await anyio.lowlevel.checkpoint()
        return got

    async def _read_in_slices(
        self, body: Answer, req: ScoreRequest, lay: Layout | None
    ) -> tuple[ScoreRows, Parser]:
        """The scanner's read :data:`SLICE_BYTES` at a time, the loop's turn between two
        slices (``decode_in_slices``). Only the steps' own CPU is counted (not that of the
        tasks that ran in between)."""
        spent = 0.0
        steps = decode_in_slices(body, req, SLICE_BYTES, lay=lay)
        try:
            while True:
                start = time.thread_time()
                try:
                    next(steps)
                except StopIteration as done:
                    got: tuple[ScoreRows, Parser] = done.value
                    return got
                finally:
                    spent += time.thread_time() - start
                await anyio.lowlevel.checkpoint()
        finally:
            steps.close()
            self._stats.spent("decode_loop", spent)


def _named(exc: CapabilityError, side: Side, url: str) -> CapabilityError:
    """A vLLM server's refusal, its message naming the side and the server (a sample's
    failure message is the error's: it must say which server lacks what)."""
    return CapabilityError(exc.capability, f"the {side} at {url}: {exc}", side=side, url=url)
