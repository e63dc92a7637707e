"""Fetching one sample's logprobs: its request plan, and each logical request's deadline,
retries and capability fallbacks.

This is the async part of the per-sample work (stages route -> build payload -> teacher
fetch -> student fetch -> decode). Single attempts (hedging, health, decode) are in
``_attempts``, capability state in ``_capabilities``; the pure pieces live in ``_plan``,
``_wire`` and ``_retry``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeAlias

import anyio
import numpy as np
import numpy.typing as npt

from ._answers import ScoreRows
from ._attempts import AttemptSender, Counter, Failed
from ._balance import EndpointPool, prefix_key
from ._capabilities import Capabilities, Side
from ._config import StreamConfig
from ._discovery import FleetDirectory
from ._endpoints import Endpoints
from ._errors import CapabilityError, DeadlineExceeded, OPDStreamError
from ._logging import get_logger
from ._plan import RequestPlan, plan_requests
from ._retry import RetryPolicy
from ._sample import Fetched, PreparedSample, request_ids
from ._stats import StatsRecorder
from ._transport import Transport
from ._wire import ScoreRequest, auto_block_size

__all__ = ("SampleScorer", "ScoreAttemptError")

log = get_logger()


_Spec: TypeAlias = tuple[Side, tuple[str, ...], Callable[[str], ScoreRequest], int | None]
"""One logical request of a sample: side, configured URLs, request maker, routing key."""


class ScoreAttemptError(Exception):
    """Wraps the final error of a sample together with the attempts it used."""

    def __init__(self, error: OPDStreamError, attempts: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.attempts = attempts


class SampleScorer:
    """Runs a sample's request plan against the configured servers.

    One instance serves a whole stream; it owns the replica pool (balancing, health), the
    capability state and the attempt sender (per-endpoint limits) of that stream.
    """

    def __init__(
        self,
        config: StreamConfig,
        transport: Transport,
        stats: StatsRecorder,
        *,
        threads: anyio.CapacityLimiter | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._cfg = config
        self._stats = stats
        self._rng = rng or random.Random()
        self._policy = RetryPolicy(
            max_attempts=config.max_attempts,
            initial_s=config.backoff_initial_s,
            max_s=config.backoff_max_s,
            rng=self._rng,
        )
        self.endpoints = Endpoints()  # every URL's load, health and capabilities
        self._pool = EndpointPool(
            self.endpoints,
            balance=config.balance,
            load_factor=config.balance_load_factor,
            limit=config.max_inflight_per_endpoint,
            eject_after=config.eject_after_failures,
            cooldown_s=config.eject_cooldown_s,
            rng=self._rng,
        )
        self._caps = Capabilities(config, self.endpoints)
        self.fleets = FleetDirectory(transport, enabled=config.router_discovery == "auto")
        self._sender = AttemptSender(
            config,
            transport,
            stats,
            self.endpoints,
            self._pool,
            self._caps,
            threads=threads,
        )

    # one logical request -------------------------------------------------------------
    async def _request(
        self,
        side: Side,
        urls: tuple[str, ...],
        make: Callable[[str], ScoreRequest],
        counter: Counter,
        key: int | None = None,
    ) -> ScoreRows:
        """One logical request: retries, hedges and capability fallbacks within one deadline.

        ``key`` (the prompt's :func:`~opd_stream._balance.prefix_key`, under the ``prefix``
        balance) places every attempt: first choice, then the next replica of its order.

        Every HTTP request sent (a hedge included) is an attempt; a capability probe
        (an answer that shows a missing feature, retried in the fallback form at once) is
        not counted against ``max_attempts``. Nothing outlives the deadline: the probes,
        the hedges and the backoff sleeps all run inside its cancel scope.
        """
        deadline = anyio.current_time() + self._cfg.request_deadline_s
        tries = Counter()
        last: OPDStreamError | None = None
        failed_url: tuple[str, ...] = ()  # a retry goes elsewhere when a replica is left
        configured = urls
        with anyio.move_on_at(deadline):
            while True:
                urls = await self.fleets.expand(configured)  # routers -> their workers
                await self._sender.maybe_probe(side, urls)
                url = self._pool.pick(urls, failed_url, key) or self._pool.pick(urls, key=key)
                assert url is not None  # urls is never empty and nothing is excluded
                try:
                    return await self._sender.send(side, urls, url, make, counter, tries, key)
                except Failed as failed:
                    exc = failed.error
                    if isinstance(exc, CapabilityError):
                        if not self._caps.fallback(side, failed.url, failed.req, exc):
                            raise exc from None
                        tries.attempts -= 1  # a capability probe is not a failed attempt
                        continue
                    if self._caps.batch_rejected(side, failed.url, failed.req, exc):
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

    # a whole sample ------------------------------------------------------------------
    async def _both(
        self,
        first: _Spec,
        second: _Spec,
        counter: Counter,
    ) -> tuple[ScoreRows, ScoreRows]:
        """Two independent logical requests at once; the first failure cancels the other."""
        rows: dict[int, ScoreRows] = {}
        errors: list[OPDStreamError] = []

        async def one(i: int, spec: _Spec) -> None:
            try:
                rows[i] = await self._request(spec[0], spec[1], spec[2], counter, spec[3])
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
        teacher: bool = False,
    ) -> ScoreRequest:
        # A teacher request sends the sample's teacher prompt + response when it has one
        # (the response, its length and so every row's meaning stay the student's).
        tokens = prepared.tokens
        if teacher and prepared.teacher_tokens is not None:
            tokens = prepared.teacher_tokens
        id_form = self._caps.id_form(url)
        block_size = self._cfg.id_block_size
        if block_size == 0 and id_form in ("blocked", "blocks") and ids is not None:
            # resolved once here, not by every later user of the request
            block_size = auto_block_size(tokens, prepared.response_length, ids, top_k=top_k)
        return ScoreRequest(
            tokens=tokens,
            response_length=prepared.response_length,
            top_k=top_k,
            ids=ids,
            id_form=id_form,
            start=self._cfg.logprob_start,
            topk_wire=self._caps.topk_wire(url) if top_k > 0 else "json",
            block_size=block_size,
        )

    async def fetch(
        self, prepared: PreparedSample, teacher_urls: tuple[str, ...], admitted_at: float
    ) -> Fetched:
        """Run the sample's plan. Raises :class:`ScoreAttemptError` on failure."""
        plan = self.plan(prepared)
        counter = Counter()
        k = self._cfg.top_k
        student_urls: tuple[str, ...] = (
            (self._cfg.student_url,) if self._cfg.student_url is not None else ()
        )
        s_ids, s_lps = prepared.student_top_ids, prepared.student_top_logprobs
        student_rows: ScoreRows | None = None
        # prefix locality: a request's key is its prompt's hash (the teacher's own prompt
        # for teacher requests), so a sample's and its group's requests meet on a replica
        s_key = t_key = None
        if self._cfg.balance == "prefix":
            r = prepared.response_length
            s_key = prefix_key(prepared.tokens, r)
            teacher_tokens = prepared.teacher_tokens
            t_key = s_key if teacher_tokens is None else prefix_key(teacher_tokens, r)

        def student_topk(url: str) -> ScoreRequest:
            return self._score_request(prepared, url, top_k=k, ids=None)

        def teacher_request(ids: npt.NDArray[np.int64] | None) -> Callable[[str], ScoreRequest]:
            top = k if plan.teacher_topk else 0
            return lambda url: self._score_request(prepared, url, top_k=top, ids=ids, teacher=True)

        try:
            if plan.fetch_student_topk and not plan.teacher_scores_student_ids:
                # independent requests (intersection without the rollout's top-k): together
                fetched, teacher_rows = await self._both(
                    ("student", student_urls, student_topk, s_key),
                    ("teacher", teacher_urls, teacher_request(None), t_key),
                    counter,
                )
                s_ids, s_lps = fetched.top_ids, fetched.top_logprobs
            else:
                if plan.fetch_student_topk:
                    fetched = await self._request(
                        "student", student_urls, student_topk, counter, s_key
                    )
                    s_ids, s_lps = fetched.top_ids, fetched.top_logprobs
                # Short rows' padding (-1) never goes out: filler ids take its slots, and
                # the KL stage reads s_ids, where padding is never a candidate.
                teacher_ids = (
                    request_ids(s_ids)
                    if plan.teacher_scores_student_ids and s_ids is not None
                    else None
                )
                teacher_rows = await self._request(
                    "teacher", teacher_urls, teacher_request(teacher_ids), counter, t_key
                )
            if plan.student_scores_teacher_ids:
                t_ids = teacher_rows.top_ids
                if t_ids is not None:
                    t_ids = request_ids(t_ids)  # (a server's top-k rows are full)
                student_rows = await self._request(
                    "student",
                    student_urls,
                    lambda url: self._score_request(prepared, url, top_k=0, ids=t_ids),
                    counter,
                    s_key,
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
