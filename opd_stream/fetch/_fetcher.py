"""Fetching one sample's logprobs: its request plan, and each logical request's deadline,
retries and capability fallbacks.

This is the async part of the per-sample work (stages route -> build payload -> teacher
fetch -> student fetch -> decode). Single attempts (hedging, health, decode) are in
``_attempts``, capability state in ``_capabilities``; the pure pieces live in ``_plan``,
``_wire`` and ``_retry``.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

import anyio
import numpy as np
import numpy.typing as npt

from .._errors import (
    CapabilityError,
    ConnectionFailed,
    DeadlineExceeded,
    OPDStreamError,
    ServerHTTPError,
    WeightVersionChanged,
)
from .._logging import get_logger
from .._sample import CrossSample, Fetched, PreparedSample, cross_sample, request_ids
from .._stats import StatsRecorder
from ..config._settings import StreamConfig
from ..fleet._balance import Route, prefix_key, routing_tokens
from ..fleet._capabilities import Side
from ..fleet._engines import EngineUnknown
from ..fleet._ensemble import Ensemble
from ..fleet._fleet import Fleet
from ..fleet._routing import Teacher
from ..kl._plan import RequestPlan, plan_requests
from ..transport._transports import Transport
from ..wire._answers import ScoreRows
from ..wire._request import ScoreRequest, auto_block_size
from ..xtok._tokenizers import (
    THREAD_TOKENS,
    CrossTokenizers,
    empty_rows,
    topk_candidates,
    topk_rows,
)
from ._attempts import AttemptSender, Counter, Failed
from ._mixture import member_error, mix_logprobs, mixed_rows, mixture_topk, present, union_ids
from ._retry import RetryPolicy

__all__ = ("SampleFetcher", "ScoreAttemptError")

log = get_logger()


def _host(url: str) -> str:
    """``host:port`` of a server URL, for a message (never its credentials or path)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{parts.hostname}:{port}" if port is not None else str(parts.hostname)


class ScoreAttemptError(Exception):
    """Wraps the final error of a sample together with the attempts it used."""

    def __init__(self, error: OPDStreamError, attempts: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.attempts = attempts


class SampleFetcher:
    """Runs a sample's request plan against the configured servers.

    One instance serves a whole stream; it asks the stream's :class:`Fleet` (replicas,
    health, capabilities, each server's engine) and owns the attempt sender (per-endpoint
    limits) of that stream.
    """

    def __init__(
        self,
        config: StreamConfig,
        fleet: Fleet,
        transport: Transport,
        stats: StatsRecorder,
        *,
        threads: anyio.CapacityLimiter | None = None,
        rng: random.Random | None = None,
        xtok: CrossTokenizers | None = None,
    ) -> None:
        self._cfg = config
        self.xtok = xtok  # teachers with their own tokenizer (None: every teacher shares it)
        self._threads = threads
        self._stats = stats
        self._rng = rng or random.Random()
        self._policy = RetryPolicy(
            max_attempts=config.max_attempts,
            initial_s=config.backoff_initial_s,
            max_s=config.backoff_max_s,
            rng=self._rng,
        )
        self._fleet = fleet
        self._pool = fleet.pool
        self._caps = fleet.capabilities
        self._sender = AttemptSender(
            config,
            transport,
            stats,
            fleet.endpoints,
            fleet.pool,
            fleet.capabilities,
            fleet.engines,
            threads=threads,
        )

    # one logical request -------------------------------------------------------------
    async def _request(
        self,
        side: Side,
        urls: tuple[str, ...],
        make: Callable[[str], ScoreRequest],
        counter: Counter,
        key: Route | None = None,
    ) -> ScoreRows:
        """One logical request: retries, hedges and capability fallbacks within one deadline.

        ``key`` (the prompt's :class:`~opd_stream.fleet._balance.Route`, under the ``prefix``
        balance: :meth:`_key`) places every attempt: first choice, then the next replica.
        A retry after a 429/503 waits at least its ``Retry-After`` (within the deadline).

        Every HTTP request sent (a hedge included) is an attempt; a capability probe
        (an answer that shows a missing feature, retried in the fallback form at once) is
        not counted against ``max_attempts``. Nothing outlives the deadline: the probes,
        the hedges and the backoff sleeps all run inside its cancel scope.
        """
        deadline = self._sender.now() + self._cfg.request_deadline_s
        tries = Counter()
        last: OPDStreamError | None = None
        failed_url: tuple[str, ...] = ()  # a retry goes elsewhere when a replica is left
        configured = urls
        with anyio.move_on_at(deadline):
            while True:
                urls = await self._fleet.expand(configured)  # routers -> their workers
                self._check_reachable(side, urls, let_through=True)
                await self._sender.maybe_probe(side, urls)
                url = self._pool.pick(urls, failed_url, key) or self._pool.pick(urls, key=key)
                assert url is not None  # urls is never empty and nothing is excluded
                try:
                    return await self._sender.send(side, urls, url, make, counter, tries, key)
                except Failed as failed:
                    exc = failed.error
                    if isinstance(exc, EngineUnknown):
                        # /generate answered 404/405 (auto): find the engine, ask again; not
                        # an attempt (like a capability probe)
                        try:
                            await self._fleet.engines.detect(side, failed.url, exc.status)
                        except OPDStreamError as found:
                            exc = found
                        else:
                            tries.attempts -= 1
                            continue
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
                    if isinstance(exc, ConnectionFailed) and exc.refused:
                        self._check_reachable(side, urls, let_through=False)
                    wait = exc.retry_after if isinstance(exc, ServerHTTPError) else None
                    delay = (
                        self._policy.delay(tries.attempts, self._sender.now(), deadline, wait)
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

    def _check_reachable(self, side: Side, urls: tuple[str, ...], *, let_through: bool) -> None:
        """Fail at once when every replica of ``urls`` has refused connections for
        ``unreachable_after_s`` (see ``EndpointPool.unreachable``), unless ``let_through``
        and this request is the one let through to see whether they are back."""
        now = self._sender.now()
        refusing = self._pool.unreachable(urls, now)
        if refusing is None:
            return
        if let_through:
            first = not self._pool.known_unreachable(urls)
            if self._pool.let_through(urls, now):
                (log.warning if first else log.debug)(
                    "replicas_unreachable", side=side, replicas=len(urls), refusing_s=refusing
                )
                return
        window = self._cfg.unreachable_after_s
        hosts = ", ".join(_host(url) for url in urls[:3]) + (", ..." if len(urls) > 3 else "")
        raise ConnectionFailed(
            f"{side} unreachable: every replica ({hosts}) has refused connections for "
            f"{refusing:.3g} s with no answer since (unreachable_after_s={window:g}); failed "
            f"without retrying (one request per {window:g} s still goes ahead)",
            side=side,
            refused=True,
            retryable=False,
        )

    # a whole sample ------------------------------------------------------------------
    @staticmethod
    async def _together(jobs: Sequence[Callable[[], Awaitable[ScoreRows]]]) -> list[ScoreRows]:
        """Independent logical requests at once, in this task's task group (nothing
        outlives the call); the first failure cancels the others and is raised."""
        rows: dict[int, ScoreRows] = {}
        errors: list[OPDStreamError] = []

        async def one(i: int) -> None:
            try:
                rows[i] = await jobs[i]()
            except OPDStreamError as exc:
                errors.append(exc)
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for i in range(len(jobs)):
                tg.start_soon(one, i)
        if errors:
            raise errors[0]
        return [rows[i] for i in range(len(jobs))]

    async def _teacher(
        self,
        teacher: Teacher,
        make: Callable[[int, npt.NDArray[np.int64] | None], Callable[[str], ScoreRequest]],
        ids: npt.NDArray[np.int64] | None,
        top_k: int,
        counter: Counter,
        key: Route | None = None,
    ) -> ScoreRows:
        """The teacher's answer: one logical request, or an ensemble's mixture.

        ``make(top_k, ids)`` builds the teacher request's factory. An ensemble's members
        are asked at once (the same request each); with a top-k and two members or more,
        each then scores every id of the union of their top-k, and the mixture's top-k is
        chosen there (:mod:`opd_stream.fetch._mixture`). A member that fails (after its
        retries) fails the whole answer, the member named in the error.

        One set of weights per member: a member's two answers (its top-k, then the union's
        ids) must report one ``weight_version`` (members may differ from each other), else
        :class:`WeightVersionChanged` naming the member (:meth:`fetch` asks again, once).
        """
        if not isinstance(teacher, Ensemble):
            return await self._request("teacher", teacher, make(top_k, ids), counter, key)
        answers = await self._members(teacher, lambda i: make(top_k, ids), counter, key)
        top = None
        if top_k > 0:
            tops = [present(a.top_ids, "top_ids") for a in answers]
            if len(answers) == 1:
                top = (tops[0], present(answers[0].top_logprobs, "top_logprobs"))
            else:
                union = union_ids(tops)
                sent = request_ids(union)
                scored = await self._members(teacher, lambda i: make(0, sent), counter, key)
                for i, pair in enumerate(zip(answers, scored, strict=True)):
                    same_weights(pair, "teacher", member=teacher.member_name(i))
                parts = [present(a.id_logprobs, "id_logprobs") for a in scored]
                top = mixture_topk(union, mix_logprobs(parts, teacher.weights), top_k)
        return mixed_rows(teacher, answers, top)

    async def _members(
        self,
        ensemble: Ensemble,
        make: Callable[[int], Callable[[str], ScoreRequest]],
        counter: Counter,
        key: Route | None = None,
    ) -> list[ScoreRows]:
        """Every member's answer to its request ``make(i)``, asked at once."""

        def job(i: int) -> Callable[[], Awaitable[ScoreRows]]:
            async def ask() -> ScoreRows:
                try:
                    return await self._request(
                        "teacher", ensemble.members[i], make(i), counter, key
                    )
                except OPDStreamError as exc:
                    raise member_error(exc, ensemble.member_name(i)) from None

            return ask

        return await self._together([job(i) for i in range(len(ensemble.members))])

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
        salt: str | None = None,
        ids_checked: bool = False,
    ) -> ScoreRequest:
        # A teacher request sends the sample's teacher prompt + response when it has one
        # (the response, its length and so every row's meaning stay the student's).
        tokens = prepared.tokens
        if teacher and prepared.teacher_tokens is not None:
            tokens = prepared.teacher_tokens
        engine = self._fleet.engine(url)
        if engine != "sglang":  # vLLM: ids per position, from the response start, always
            return ScoreRequest(
                tokens=tokens,
                response_length=prepared.response_length,
                top_k=top_k,
                ids=ids,
                cache_salt=new_salt() if self._cfg.cache_salt == "per-request" else salt,
                salt_each_item=self._cfg.cache_salt == "per-request",
                engine=engine,
                max_ids=self._fleet.engines.max_ids,
                ids_checked=ids_checked,
            )
        id_form = self._caps.id_form(url)
        block_size = self._cfg.id_block_size
        if block_size == 0 and id_form in ("blocked", "blocks") and ids is not None:
            # resolved once here, not by every later user of the request
            block_size = auto_block_size(tokens, prepared.response_length, ids, top_k=top_k)
        per_request = self._cfg.cache_salt == "per-request"
        if per_request:
            salt = new_salt()  # every attempt (a retry, a hedge) its own
        elif self._cfg.cache_salt == "weight-version":
            salt = self._fleet.endpoints(url).weight_version  # None until it has answered
        return ScoreRequest(
            tokens=tokens,
            response_length=prepared.response_length,
            top_k=top_k,
            ids=ids,
            id_form=id_form,
            start=self._cfg.logprob_start,
            topk_wire=self._caps.topk_wire(url) if top_k > 0 else "json",
            block_size=block_size,
            cache_salt=salt,
            salt_each_item=per_request,
            ids_checked=ids_checked,
        )

    def _key(self, tokens: npt.NDArray[np.int64], response_length: int) -> Route | None:
        """A request's routing key under the ``prefix`` balance: its prompt's hash (so a
        sample's and its group's requests meet on a replica) and sizes; ``None`` otherwise."""
        if self._cfg.balance != "prefix":
            return None
        key = prefix_key(tokens, response_length)
        prompt = len(tokens) - response_length
        return Route(key, prompt, response_length, routing_tokens(tokens[:prompt]))

    def _sample_salt(self) -> str | None:
        """The salt of all of one sample's requests (``cache_salt="per-sample"``), drawn
        once per sample: a re-ask after ``weight_version_changed`` keeps it, so it can reuse
        the sample's own prefix."""
        return new_salt() if self._cfg.cache_salt == "per-sample" else None

    async def _cross(self, prepared: PreparedSample, xtok: CrossTokenizers) -> CrossSample:
        """Re-tokenise the response for its teacher (in a decode thread when it is long, or
        when the teacher's encoder runs in a process of its own: never a pipe on the loop)."""

        def timed() -> CrossSample:
            start = time.thread_time()
            try:
                return cross_sample(xtok, prepared)
            finally:
                self._stats.spent("align", time.thread_time() - start)

        try:
            if xtok.encodes_apart or prepared.response_length >= THREAD_TOKENS:
                return await anyio.to_thread.run_sync(timed, limiter=self._threads)
            return timed()
        except OPDStreamError as exc:  # a bad sample; the tokenizer's process gone (EncoderError)
            raise ScoreAttemptError(exc, 0) from None

    async def _fetch_cross(
        self,
        prepared: PreparedSample,
        xtok: CrossTokenizers,
        teacher_urls: tuple[str, ...],
        admitted_at: float,
    ) -> Fetched:
        """A teacher with its own tokenizer: one request, in its ids (top-k: only-student,
        the student's candidates asked by their bytes' teacher ids at one-to-one spans)."""
        cross = await self._cross(prepared, xtok)
        side = cross.teacher_prepared
        counter = Counter()
        rows = empty_rows()
        k = self._cfg.top_k
        s_ids, s_lps = prepared.student_top_ids, prepared.student_top_logprobs
        kept = asked = None
        salt = self._sample_salt()
        s_key = self._key(prepared.tokens, prepared.response_length)
        try:
            if k > 0 and s_ids is None:  # the student's top-k, from the student server
                student_urls: tuple[str, ...] = (
                    (self._cfg.student_url,) if self._cfg.student_url is not None else ()
                )
                fetched = await self._request(
                    "student",
                    student_urls,
                    lambda url: self._score_request(prepared, url, top_k=k, ids=None, salt=salt),
                    counter,
                    s_key,
                )
                s_ids, s_lps = fetched.top_ids, fetched.top_logprobs
            if k > 0:
                assert s_ids is not None
                kept, asked = topk_candidates(xtok, prepared.teacher, cross.alignment, s_ids)
            if side.response_length > 0:  # else only textless tokens: nothing to ask
                ids = None if asked is None else request_ids(asked)
                rows = await self._request(
                    "teacher",
                    teacher_urls,
                    lambda url: self._score_request(side, url, top_k=0, ids=ids, salt=salt),
                    counter,
                    self._key(side.tokens, side.response_length),
                )
        except OPDStreamError as exc:
            raise ScoreAttemptError(exc, counter.attempts) from None
        raw = rows.token_logprobs
        if kept is not None:  # top-k: the answer as the KL stage reads one, on student rows
            rows = topk_rows(cross.alignment, rows, kept)
        return Fetched(
            prepared=prepared,
            teacher_rows=rows,
            student_ids=kept,
            student_lps=s_lps if kept is not None else None,
            student_rows=None,
            attempts=counter.attempts,
            admitted_at=admitted_at,
            alignment=cross.alignment,
            return_alignment=xtok.return_alignment,
            teacher_token_logprobs=raw,
        )

    async def fetch(
        self,
        prepared: PreparedSample,
        teacher: Teacher,
        admitted_at: float,
        *,
        teacher_only: bool = False,
    ) -> Fetched:
        """Run the sample's plan against ``teacher`` (its replica URLs, or an ensemble).
        Raises :class:`ScoreAttemptError` on failure.

        ``teacher_only``: ask the teacher alone, its top-k when ``top_k`` > 0 (its
        sampled-token logprobs always), whatever the strategy; nothing of the student.

        One side's answers for the sample must all report the same
        ``meta_info.weight_version`` (the items of one answer, the student's requests of
        one sample together, and an ensemble member's requests together: per member).
        When they do not, that side's requests are asked once more (and the teacher's too
        when it scored the student's ids), then the sample fails with
        :class:`WeightVersionChanged`.
        """
        if self.xtok is not None and self.xtok.teacher(prepared.teacher) is not None:
            # (config rule: a teacher with its own tokenizer is never an ensemble; the
            # pipeline refuses a teacher-only call for it)
            assert not isinstance(teacher, Ensemble)
            assert not teacher_only
            return await self._fetch_cross(prepared, self.xtok, teacher, admitted_at)
        plan = (
            RequestPlan(teacher_topk=self._cfg.top_k > 0) if teacher_only else self.plan(prepared)
        )
        counter = Counter()
        got = _Progress()
        args = (prepared, teacher, admitted_at, plan, counter, got, self._sample_salt())
        try:
            try:
                return await self._fetch_once(*args)
            except WeightVersionChanged as exc:
                self._stats.retries += 1
                log.info("weight_version_changed", side=exc.side, member=exc.member, retry=True)
                got.forget(exc.side, plan)
                return await self._fetch_once(*args)
        except OPDStreamError as exc:
            raise ScoreAttemptError(exc, counter.attempts) from None

    async def _fetch_once(
        self,
        prepared: PreparedSample,
        teacher: Teacher,
        admitted_at: float,
        plan: RequestPlan,
        counter: Counter,
        got: _Progress,
        salt: str | None,
    ) -> Fetched:
        """The plan's requests, those already in ``got`` skipped (kept from a first pass);
        ``salt``: the sample's ``cache_salt`` (the same on both passes)."""
        k = self._cfg.top_k
        student_urls: tuple[str, ...] = (
            (self._cfg.student_url,) if self._cfg.student_url is not None else ()
        )
        s_ids, s_lps = prepared.student_top_ids, prepared.student_top_logprobs
        student_rows: ScoreRows | None = None
        # prefix locality: the teacher's key is over its own prompt when it has one
        s_key = self._key(prepared.tokens, prepared.response_length)
        teacher_tokens = prepared.teacher_tokens
        t_key = (
            s_key
            if teacher_tokens is None or s_key is None
            else self._key(teacher_tokens, prepared.response_length)
        )

        def student_topk(url: str) -> ScoreRequest:
            return self._score_request(prepared, url, top_k=k, ids=None, salt=salt)

        own_ids: npt.NDArray[np.int64] | None = None  # made from the sample's checked top-k

        def teacher_request(
            top: int, ids: npt.NDArray[np.int64] | None
        ) -> Callable[[str], ScoreRequest]:
            checked = ids is not None and ids is own_ids
            return lambda url: self._score_request(
                prepared, url, top_k=top, ids=ids, teacher=True, salt=salt, ids_checked=checked
            )

        teacher_top = k if plan.teacher_topk else 0

        if plan.fetch_student_topk and not plan.teacher_scores_student_ids:
            # independent requests (intersection without the rollout's top-k): together
            if got.student_topk is None and got.teacher is None:
                got.student_topk, got.teacher = await self._together(
                    [
                        lambda: self._request(
                            "student", student_urls, student_topk, counter, s_key
                        ),
                        lambda: self._teacher(
                            teacher, teacher_request, None, teacher_top, counter, t_key
                        ),
                    ]
                )
            elif got.student_topk is None:
                got.student_topk = await self._request(
                    "student", student_urls, student_topk, counter, s_key
                )
            elif got.teacher is None:
                got.teacher = await self._teacher(
                    teacher, teacher_request, None, teacher_top, counter, t_key
                )
            s_ids, s_lps = got.student_topk.top_ids, got.student_topk.top_logprobs
        else:
            if plan.fetch_student_topk:
                if got.student_topk is None:
                    got.student_topk = await self._request(
                        "student", student_urls, student_topk, counter, s_key
                    )
                s_ids, s_lps = got.student_topk.top_ids, got.student_topk.top_logprobs
            # Short rows' padding (-1) never goes out: filler ids take its slots, and
            # the KL stage reads s_ids, where padding is never a candidate.
            teacher_ids = (
                request_ids(s_ids)
                if plan.teacher_scores_student_ids and s_ids is not None
                else None
            )
            if s_ids is prepared.student_top_ids:  # checked by prepare_sample: not again
                own_ids = teacher_ids
            if got.teacher is None:
                got.teacher = await self._teacher(
                    teacher, teacher_request, teacher_ids, teacher_top, counter, t_key
                )
        teacher_rows = got.teacher
        assert teacher_rows is not None
        if plan.student_scores_teacher_ids:
            t_ids = teacher_rows.top_ids
            if t_ids is not None:
                t_ids = request_ids(t_ids)  # (a server's top-k rows are full)
            student_rows = await self._request(
                "student",
                student_urls,
                lambda url: self._score_request(prepared, url, top_k=0, ids=t_ids, salt=salt),
                counter,
                s_key,
            )
            if got.student_topk is not None:
                same_weights((got.student_topk, student_rows), "student")
        return Fetched(
            prepared=prepared,
            teacher_rows=teacher_rows,
            student_ids=s_ids,
            student_lps=s_lps,
            student_rows=student_rows,
            attempts=counter.attempts,
            admitted_at=admitted_at,
        )


def new_salt() -> str:
    """A fresh random ``cache_salt`` (never derived from a payload)."""
    return secrets.token_hex(8)


class _Progress:
    """What one pass over a sample's plan has fetched (kept for a second pass)."""

    __slots__ = ("student_topk", "teacher")

    def __init__(self) -> None:
        self.student_topk: ScoreRows | None = None
        self.teacher: ScoreRows | None = None

    def forget(self, side: str, plan: RequestPlan) -> None:
        """Drop ``side``'s answers (and the teacher's when it scored the student's ids)."""
        if side == "student":
            self.student_topk = None
            if plan.fetch_student_topk and plan.teacher_scores_student_ids:
                self.teacher = None
        else:
            self.teacher = None


def same_weights(answers: tuple[ScoreRows, ...], side: Side, *, member: str | None = None) -> None:
    """Check that ``answers`` (one side's, for one sample; ``member``: of that ensemble
    member, named in the error) report one weight version.

    Raises:
        WeightVersionChanged: they do not.
    """
    versions = [rows.weight_version for rows in answers]
    if any(v != versions[0] for v in versions):
        raise WeightVersionChanged(
            tuple(dict.fromkeys(versions)),
            side=side,
            where="the requests for one sample",
            member=member,
        )
