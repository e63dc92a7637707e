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

from ._config import StreamConfig
from ._errors import (
    CapabilityError,
    DeadlineExceeded,
    OPDStreamError,
    ServerError,
    ServerHTTPError,
)
from ._plan import RequestPlan, plan_requests
from ._retry import RetryPolicy
from ._router import generate_url
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
        rng: random.Random | None = None,
    ) -> None:
        self._cfg = config
        self._transport = transport
        self._stats = stats
        self._limiters: dict[str, anyio.CapacityLimiter] = {}
        self._policy = RetryPolicy(
            max_attempts=config.max_attempts,
            initial_s=config.backoff_initial_s,
            max_s=config.backoff_max_s,
            rng=rng or random.Random(),
        )
        self._decode = decode
        self._rr = 0

    # replicas and capabilities ------------------------------------------------------
    def _pick(self, urls: tuple[str, ...]) -> str:
        """Least outstanding requests; ties broken round-robin."""
        if len(urls) == 1:
            return urls[0]
        self._rr += 1
        n = len(urls)
        order = [urls[(self._rr + i) % n] for i in range(n)]
        return min(order, key=lambda u: self._stats.endpoint(u).in_flight)

    def _limiter(self, url: str) -> anyio.CapacityLimiter:
        lim = self._limiters.get(url)
        if lim is None:
            lim = self._limiters[url] = anyio.CapacityLimiter(self._cfg.max_inflight_per_endpoint)
        return lim

    def _id_form(self, url: str) -> Literal["per-position", "flat", "blocked"]:
        mode = self._cfg.id_scoring
        if mode != "auto":
            return mode
        return "blocked" if self._stats.endpoint(url).per_position is False else "per-position"

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
        """One logical request: retries and capability fallbacks within one deadline."""
        deadline = anyio.current_time() + self._cfg.request_deadline_s
        tries = 0
        last: OPDStreamError | None = None
        with anyio.move_on_at(deadline):
            while True:
                url = self._pick(urls)
                req = make(url)
                tries += 1
                counter.attempts += 1
                try:
                    return await self._attempt(side, url, req)
                except CapabilityError as exc:
                    if not self._fallback(side, url, req, exc):
                        raise
                    tries -= 1  # a capability probe is not a failed attempt
                    continue
                except OPDStreamError as exc:
                    last = exc
                    self._stats.endpoint(url).errors += 1
                    delay = (
                        self._policy.delay(tries, anyio.current_time(), deadline)
                        if exc.retryable
                        else None
                    )
                    if delay is None:
                        raise
                    self._stats.retries += 1
                    log.debug("retry", side=side, reason=exc.reason, attempt=tries, delay_s=delay)
                    await anyio.sleep(delay)
        detail = f" (last error: {last.reason})" if last is not None else ""
        raise DeadlineExceeded(
            f"{side} request did not finish within {self._cfg.request_deadline_s} s "
            f"after {tries} attempt(s){detail}"
        )

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
        body = build_score_payload(req)
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

    async def _decode_body(self, body: bytes, req: ScoreRequest) -> ScoreRows:
        if self._decode is not None:
            result = self._decode(body, req)
            if not isinstance(result, ScoreRows):
                result = await result
            assert isinstance(result, ScoreRows)
            return result
        return decode_score_response(body, req)

    # a whole sample ------------------------------------------------------------------
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
        try:
            if plan.fetch_student_topk:
                fetched = await self._request(
                    "student",
                    student_urls,
                    lambda url: self._score_request(prepared, url, top_k=k, ids=None),
                    counter,
                )
                s_ids, s_lps = fetched.top_ids, fetched.top_logprobs
            teacher_ids = s_ids if plan.teacher_scores_student_ids else None
            teacher_rows = await self._request(
                "teacher",
                teacher_urls,
                lambda url: self._score_request(
                    prepared, url, top_k=k if plan.teacher_topk else 0, ids=teacher_ids
                ),
                counter,
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
