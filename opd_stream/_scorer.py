"""Fetching one sample's logprobs: build payloads, pick a replica, send with deadline and
retries, decode, and fall back when a server lacks a capability.

This is the async part of the per-sample work (stages route -> build payload -> teacher
fetch -> student fetch -> decode); the pure pieces live in ``_plan``, ``_wire`` and
``_retry``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Literal

import anyio
import msgspec
import numpy as np
import numpy.typing as npt
import structlog

from ._balance import EndpointPool
from ._config import StreamConfig
from ._errors import (
    CapabilityError,
    ConnectionFailed,
    DeadlineExceeded,
    OPDStreamError,
    ServerError,
    ServerHTTPError,
)
from ._plan import RequestPlan, plan_requests
from ._retry import RetryPolicy
from ._router import endpoint_url, generate_url
from ._sample import PreparedSample
from ._stats import StatsRecorder
from ._transport import Transport
from ._wire import (
    ScoreRequest,
    ScoreRows,
    build_score_payload,
    decode_score_response,
    parse_error_message,
)

__all__ = ("Fetched", "SampleScorer", "ScoreAttemptError")

log: structlog.typing.FilteringBoundLogger = structlog.get_logger("opd_stream")

Side = Literal["teacher", "student"]


class Fetched(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the KL stage needs for one sample."""

    prepared: PreparedSample
    teacher_rows: ScoreRows
    student_ids: npt.NDArray[np.int64] | None
    student_lps: npt.NDArray[np.float32] | None
    student_rows: ScoreRows | None
    attempts: int
    admitted_at: float


class ScoreAttemptError(Exception):
    """Wraps the final error of a sample together with the attempts it used."""

    def __init__(self, error: OPDStreamError, attempts: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.attempts = attempts


class _Counter:
    __slots__ = ("attempts",)

    def __init__(self) -> None:
        self.attempts = 0


class _Failed(Exception):
    """Internal: one attempt failed with ``error``; ``url`` and ``req`` say which one."""

    def __init__(self, error: OPDStreamError, url: str, req: ScoreRequest) -> None:
        super().__init__(error.reason)
        self.error = error
        self.url = url
        self.req = req


_PROBE_TIMEOUT_S = 2.0
"""Longest wait for a re-admission probe's ``/health`` answer."""

_PROBE_MAX_BYTES = 64 * 1024


class SampleScorer:
    """Runs a sample's request plan against the configured servers.

    One instance serves a whole stream; it holds the per-endpoint concurrency limiters
    and the capability state detected per endpoint (logged once per endpoint).
    """

    def __init__(
        self,
        config: StreamConfig,
        transport: Transport,
        stats: StatsRecorder,
        *,
        decode: Callable[[bytes, ScoreRequest], Any] | None = None,
        build: Callable[[ScoreRequest], Any] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._cfg = config
        self._transport = transport
        self._stats = stats
        self._limiters: dict[str, anyio.CapacityLimiter] = {}
        self._rng = rng or random.Random()
        self._policy = RetryPolicy(
            max_attempts=config.max_attempts,
            initial_s=config.backoff_initial_s,
            max_s=config.backoff_max_s,
            rng=self._rng,
        )
        self._decode = decode
        self._build = build
        self._pool = EndpointPool(
            lambda url: self._stats.endpoint(url).in_flight,
            balance=config.balance,
            eject_after=config.eject_after_failures,
            cooldown_s=config.eject_cooldown_s,
            rng=self._rng,
        )

    # replicas and capabilities ------------------------------------------------------
    def _pick(self, urls: tuple[str, ...], exclude: tuple[str, ...] = ()) -> str | None:
        """The replica for the next attempt (see :class:`EndpointPool`)."""
        return self._pool.pick(urls, exclude)

    def _limiter(self, url: str) -> anyio.CapacityLimiter:
        lim = self._limiters.get(url)
        if lim is None:
            lim = self._limiters[url] = anyio.CapacityLimiter(self._cfg.max_inflight_per_endpoint)
        return lim

    def _id_form(self, url: str) -> Literal["per-position", "flat", "blocked"]:
        mode = self._cfg.id_scoring
        if mode != "auto":
            return mode
        ep = self._stats.endpoint(url)
        if ep.per_position is not False:
            return "per-position"
        # sglang-router 0.3.2 rejects a batch with per-item logprob_start_len (HTTP 422):
        # the flat form is then the one left that it forwards.
        return "flat" if ep.blocked_batch is False else "blocked"

    def _topk_wire(self, url: str) -> Literal["b64", "json"]:
        wire = self._cfg.topk_wire
        if wire != "auto":
            return wire
        return "json" if self._stats.endpoint(url).b64_topk is False else "b64"

    def _note_capability(self, url: str, side: Side, name: str, supported: bool) -> None:
        ep = self._stats.endpoint(url)
        current = ep.per_position if name == "per_position" else ep.b64_topk
        if current is supported:
            return
        if name == "per_position":
            ep.per_position = supported
        else:
            ep.b64_topk = supported
        log.info("capability_detected", side=side, url=url, capability=name, supported=supported)

    # one logical request -------------------------------------------------------------
    async def _request(
        self,
        side: Side,
        urls: tuple[str, ...],
        make: Callable[[str], ScoreRequest],
        counter: _Counter,
    ) -> ScoreRows:
        """One logical request: retries, hedges and capability fallbacks within one deadline.

        Every HTTP request sent (a hedge included) is an attempt; a capability probe
        (an answer that shows a missing feature, retried in the fallback form at once) is
        not counted against ``max_attempts``. Nothing outlives the deadline: the probes,
        the hedges and the backoff sleeps all run inside its cancel scope.
        """
        deadline = anyio.current_time() + self._cfg.request_deadline_s
        tries = _Counter()
        last: OPDStreamError | None = None
        failed_url: tuple[str, ...] = ()  # a retry goes elsewhere when a replica is left
        with anyio.move_on_at(deadline):
            while True:
                await self._maybe_probe(side, urls)
                url = self._pick(urls, failed_url) or self._pick(urls)
                assert url is not None  # urls is never empty and nothing is excluded
                try:
                    return await self._send(side, urls, url, make, counter, tries)
                except _Failed as failed:
                    exc = failed.error
                    if isinstance(exc, CapabilityError):
                        if not self._fallback(side, failed.url, failed.req, exc):
                            raise exc from None
                        tries.attempts -= 1  # a capability probe is not a failed attempt
                        continue
                    if self._batch_rejected(side, failed):
                        tries.attempts -= 1  # like a capability probe: not a failed attempt
                        continue
                    last = exc
                    failed_url = (failed.url,)
                    delay = (
                        self._policy.delay(tries.attempts, anyio.current_time(), deadline)
                        if exc.retryable
                        else None
                    )
                    if delay is None:
                        raise exc from None
                    self._stats.retries += 1
                    log.debug(
                        "retry", side=side, reason=exc.reason, attempt=tries.attempts, delay_s=delay
                    )
                    await anyio.sleep(delay)
        detail = f" (last error: {last.reason})" if last is not None else ""
        raise DeadlineExceeded(
            f"{side} request did not finish within {self._cfg.request_deadline_s} s "
            f"after {tries.attempts} attempt(s){detail}"
        )

    async def _send(
        self,
        side: Side,
        urls: tuple[str, ...],
        url: str,
        make: Callable[[str], ScoreRequest],
        counter: _Counter,
        tries: _Counter,
    ) -> ScoreRows:
        """One attempt to ``url``, hedged to another replica of ``urls`` when it is slow.

        Raises:
            _Failed: the attempt failed (when hedged: every launched copy failed; the
                error reported is a capability error if any, else the first attempt's).
        """
        req = make(url)
        tries.attempts += 1
        counter.attempts += 1
        delay = self._pool.hedge_delay(
            urls, self._cfg.hedge_after_percentile, self._cfg.hedge_min_s
        )
        if delay is None or tries.attempts >= self._cfg.max_attempts:
            return await self._one(side, urls, url, req)

        winner: list[ScoreRows] = []
        won_by: list[str] = []
        failures: list[_Failed] = []
        racing: list[str] = [url]
        finished = 0
        settled = anyio.Event()
        changed = [anyio.Event()]  # set when any racing attempt ends

        async def run(target: str, request: ScoreRequest) -> None:
            nonlocal finished
            try:
                rows = await self._one(side, urls, target, request)
            except _Failed as failed:
                failures.append(failed)
            else:
                if not winner:
                    winner.append(rows)
                    won_by.append(target)
                    if target != url:
                        self._stats.endpoint(target).hedge_wins += 1
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
                other = self._pick(urls, exclude=tuple(racing))
                if other is None or tries.attempts >= self._cfg.max_attempts:
                    await settled.wait()
                    break
                tries.attempts += 1
                counter.attempts += 1
                self._stats.endpoint(other).hedges += 1
                racing.append(other)
                log.debug("hedge", side=side, after_s=delay)
                tg.start_soon(run, other, make(other))
                # Wait for the outcome, or for this hedge to fail (then hedge again).
                while not settled.is_set() and all(f.url != other for f in failures):
                    changed[0] = anyio.Event()
                    await changed[0].wait()
            for target in racing:
                if target not in won_by and all(f.url != target for f in failures):
                    self._stats.endpoint(target).cancelled += 1  # the loser, cancelled now
            tg.cancel_scope.cancel()
        if winner:
            return winner[0]
        for failed in failures:
            if isinstance(failed.error, CapabilityError):
                raise failed
        first = [f for f in failures if f.url == url]
        raise (first or failures)[0]

    async def _one(
        self, side: Side, urls: tuple[str, ...], url: str, req: ScoreRequest
    ) -> ScoreRows:
        """One HTTP attempt, with its outcome recorded for passive health and hedging."""
        start = anyio.current_time()
        try:
            rows = await self._watched_attempt(side, url, req)
        except OPDStreamError as exc:
            if not isinstance(exc, CapabilityError):
                self._stats.endpoint(url).errors += 1
            if exc.retryable and isinstance(exc, ServerError):
                self._note_failure(side, url, urls)
            raise _Failed(exc, url, req) from None
        self._pool.record_success(url, urls, anyio.current_time() - start)
        return rows

    async def _watched_attempt(self, side: Side, url: str, req: ScoreRequest) -> ScoreRows:
        """``_attempt`` under the optional per-attempt watchdog (``attempt_timeout_s``).

        A hung server would otherwise use up the whole ``request_deadline_s`` of the
        logical request; with the watchdog the attempt is abandoned (its connection is
        closed) and becomes a retryable :class:`ConnectionFailed`.
        """
        limit = self._cfg.attempt_timeout_s
        if limit <= 0:
            return await self._attempt(side, url, req)
        with anyio.move_on_after(limit):
            return await self._attempt(side, url, req)
        raise ConnectionFailed(
            f"no answer within attempt_timeout_s={limit:g} s", side=side, url=url
        )

    def _note_failure(self, side: Side, url: str, urls: tuple[str, ...]) -> None:
        if self._pool.record_failure(url, urls, anyio.current_time()):
            ep = self._stats.endpoint(url)
            ep.ejected = True
            ep.ejections += 1
            log.warning(
                "endpoint_ejected",
                side=side,
                url=url,
                after_failures=self._cfg.eject_after_failures,
                cooldown_s=self._cfg.eject_cooldown_s,
            )

    async def _maybe_probe(self, side: Side, urls: tuple[str, ...]) -> None:
        """Probe ``/health`` of one ejected replica whose cool-down is over, if any.

        Done lazily, in the requesting task (so no task outlives the stream), bounded by
        :data:`_PROBE_TIMEOUT_S` and the request's deadline. A 200 re-admits the replica;
        anything else ejects it for another cool-down.
        """
        url = self._pool.claim_probe(urls, anyio.current_time())
        if url is None:
            return
        healthy: bool | None = None
        try:
            with anyio.move_on_after(_PROBE_TIMEOUT_S):
                try:
                    resp = await self._transport.get(
                        endpoint_url(url, "health"), max_bytes=_PROBE_MAX_BYTES
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
                self._pool.probe_result(url, healthy, anyio.current_time())
                ep = self._stats.endpoint(url)
                if healthy:
                    ep.ejected = False
                    ep.readmissions += 1
                else:
                    ep.ejections += 1
                log.info("endpoint_probed", side=side, url=url, healthy=healthy)

    def _batch_rejected(self, side: Side, failed: _Failed) -> bool:
        """True when ``auto`` id scoring should retry a rejected blocked request as flat.

        A proxy in front of SGLang (sglang-router 0.3.2) answers 422 to a batch whose
        ``logprob_start_len`` is a list, which the blocked form sends; SGLang itself takes
        it. The endpoint then uses the flat form (logged once).
        """
        exc = failed.error
        if not (
            isinstance(exc, ServerHTTPError)
            and exc.status == 422
            and failed.req.id_form == "blocked"
            and self._cfg.id_scoring == "auto"
        ):
            return False
        ep = self._stats.endpoint(failed.url)
        if ep.blocked_batch is False:
            return True  # detected by a concurrent request already: retry as flat
        ep.blocked_batch = False
        log.info(
            "capability_detected",
            side=side,
            url=failed.url,
            capability="blocked_batch",
            supported=False,
        )
        return True

    def _fallback(self, side: Side, url: str, req: ScoreRequest, exc: CapabilityError) -> bool:
        """Record a missing capability; True when an ``auto`` setting can fall back."""
        if exc.capability == "per_position" and req.id_form == "per-position":
            self._note_capability(url, side, "per_position", False)
            return self._cfg.id_scoring == "auto"
        if exc.capability == "b64_topk":
            self._note_capability(url, side, "b64_topk", False)
            return self._cfg.topk_wire == "auto"
        return False

    async def _attempt(self, side: Side, url: str, req: ScoreRequest) -> ScoreRows:
        body = await self._build_body(req)
        ep = self._stats.endpoint(url)
        self._stats.stage_active[f"{side}_fetch"] += 1
        ep.in_flight += 1
        try:
            async with self._limiter(url):
                ep.requests += 1
                self._stats.requests += 1
                resp = await self._transport.post(
                    generate_url(url), body, max_bytes=self._cfg.max_response_bytes
                )
        except ServerError as exc:
            exc.side = side
            raise
        finally:
            ep.in_flight -= 1
            self._stats.stage_active[f"{side}_fetch"] -= 1
        self._stats.bytes_received += len(resp.body)
        if resp.status != 200:
            raise ServerHTTPError(resp.status, parse_error_message(resp.body), side=side, url=url)
        self._stats.stage_active["decode"] += 1
        try:
            rows = await self._decode_body(resp.body, req)
        except ServerError as exc:
            exc.side = side
            exc.url = url
            raise
        finally:
            self._stats.stage_active["decode"] -= 1
        if req.top_k > 0:
            self._after_topk(side, url, req, rows)
        if req.ids is not None and req.id_form == "per-position":
            self._note_capability(url, side, "per_position", True)
        if req.ids is not None and req.id_form == "blocked":
            ep.blocked_batch = True
        return rows

    def _after_topk(self, side: Side, url: str, req: ScoreRequest, rows: ScoreRows) -> None:
        if req.topk_wire != "b64":
            return
        if rows.used_b64:
            self._note_capability(url, side, "b64_topk", True)
            return
        # The server ignored the b64 flags (an SGLang release older than 0.5.23).
        self._note_capability(url, side, "b64_topk", False)
        if self._cfg.topk_wire == "b64":
            raise CapabilityError(
                "b64_topk",
                "topk_wire='b64' but the server answered nested JSON top-k "
                "(it does not support return_flat_raw_top_logprobs_b64)",
                side=side,
                url=url,
            )

    async def _build_body(self, req: ScoreRequest) -> bytes:
        if self._build is None:
            return build_score_payload(req)
        body = self._build(req)
        if not isinstance(body, bytes):
            body = await body
        assert isinstance(body, bytes)
        return body

    async def _decode_body(self, body: bytes, req: ScoreRequest) -> ScoreRows:
        if self._decode is not None:
            result = self._decode(body, req)
            if not isinstance(result, ScoreRows):
                result = await result
            assert isinstance(result, ScoreRows)
            return result
        return decode_score_response(body, req)

    # a whole sample ------------------------------------------------------------------
    async def _both(
        self,
        first: tuple[Side, tuple[str, ...], Callable[[str], ScoreRequest]],
        second: tuple[Side, tuple[str, ...], Callable[[str], ScoreRequest]],
        counter: _Counter,
    ) -> tuple[ScoreRows, ScoreRows]:
        """Two independent logical requests at once; the first failure cancels the other."""
        rows: dict[int, ScoreRows] = {}
        errors: list[OPDStreamError] = []

        async def one(
            i: int, spec: tuple[Side, tuple[str, ...], Callable[[str], ScoreRequest]]
        ) -> None:
            try:
                rows[i] = await self._request(spec[0], spec[1], spec[2], counter)
            except OPDStreamError as exc:
                errors.append(exc)
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0, first)
            tg.start_soon(one, 1, second)
        if errors:
            raise errors[0]
        return rows[0], rows[1]

    def plan(self, prepared: PreparedSample) -> RequestPlan:
        return plan_requests(
            self._cfg.top_k,
            self._cfg.strategy,
            have_student_topk=prepared.student_top_ids is not None,
        )

    def _score_request(
        self,
        prepared: PreparedSample,
        url: str,
        *,
        top_k: int,
        ids: npt.NDArray[np.int64] | None,
    ) -> ScoreRequest:
        return ScoreRequest(
            tokens=prepared.tokens,
            response_length=prepared.response_length,
            top_k=top_k,
            ids=ids,
            id_form=self._id_form(url),
            start=self._cfg.logprob_start,
            topk_wire=self._topk_wire(url) if top_k > 0 else "json",
            block_size=self._cfg.id_block_size,
        )

    async def fetch(
        self, prepared: PreparedSample, teacher_urls: tuple[str, ...], admitted_at: float
    ) -> Fetched:
        """Run the sample's plan. Raises :class:`ScoreAttemptError` on failure."""
        plan = self.plan(prepared)
        counter = _Counter()
        k = self._cfg.top_k
        student_urls: tuple[str, ...] = (
            (self._cfg.student_url,) if self._cfg.student_url is not None else ()
        )
        s_ids, s_lps = prepared.student_top_ids, prepared.student_top_logprobs
        student_rows: ScoreRows | None = None

        def student_topk(url: str) -> ScoreRequest:
            return self._score_request(prepared, url, top_k=k, ids=None)

        def teacher_request(ids: npt.NDArray[np.int64] | None) -> Callable[[str], ScoreRequest]:
            top = k if plan.teacher_topk else 0
            return lambda url: self._score_request(prepared, url, top_k=top, ids=ids)

        try:
            if plan.fetch_student_topk and not plan.teacher_scores_student_ids:
                # independent requests (intersection without the rollout's top-k): together
                fetched, teacher_rows = await self._both(
                    ("student", student_urls, student_topk),
                    ("teacher", teacher_urls, teacher_request(None)),
                    counter,
                )
                s_ids, s_lps = fetched.top_ids, fetched.top_logprobs
            else:
                if plan.fetch_student_topk:
                    fetched = await self._request("student", student_urls, student_topk, counter)
                    s_ids, s_lps = fetched.top_ids, fetched.top_logprobs
                teacher_ids = s_ids if plan.teacher_scores_student_ids else None
                teacher_rows = await self._request(
                    "teacher", teacher_urls, teacher_request(teacher_ids), counter
                )
            if plan.student_scores_teacher_ids:
                t_ids = teacher_rows.top_ids
                student_rows = await self._request(
                    "student",
                    student_urls,
                    lambda url: self._score_request(prepared, url, top_k=0, ids=t_ids),
                    counter,
                )
        except OPDStreamError as exc:
            raise ScoreAttemptError(exc, counter.attempts) from None
        return Fetched(
            prepared=prepared,
            teacher_rows=teacher_rows,
            student_ids=s_ids,
            student_lps=s_lps,
            student_rows=student_rows,
            attempts=counter.attempts,
            admitted_at=admitted_at,
        )
