"""One run of the streaming pipeline: stages joined by bounded channels.

intake (validate + route) -> fetch workers (payload, teacher and student fetch, decode) ->
KL stage (batched, worker thread) -> emitter (order, accounting) -> the caller's ``async
for``; invalid samples and fetch failures go straight to the emitter. Every admitted sample
holds one of ``max_inflight`` slots until its result is handed over, so memory is bounded
and a slow consumer stops intake. The stage tasks live in one task group per run, inside
the stream's (the drawing: ``docs/internals.md``). :class:`StreamParts` is what a run
borrows from its stream; :meth:`OPDStream.score` and :meth:`OPDStream.teacher_rows` feed one
long-lived run of :class:`Call` items, each with its caller's cancel scope and its outcome
handed to it (:meth:`Call.outcome`). In full: ``docs/design-notes.md``, "opd_stream/_pipeline.py".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Callable, Coroutine, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.lowlevel
import msgspec
import numpy as np
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._async_library import name_async_library
from ._errors import InvalidSampleError, OPDStreamError, RoutingError
from ._logging import get_logger
from ._redact import redact
from ._sample import Fetched, PreparedSample, SampleFailure, ScoredSample, prepare_sample
from ._stats import CHANNELS, ChannelName, StatsRecorder
from .config._settings import StreamConfig
from .fetch._fetcher import SampleFetcher, ScoreAttemptError
from .fetch._threads import WHOLE
from .fleet._routing import TeacherRouting
from .kl._plan import STRATEGY_NEEDS
from .wire._answers import ScoreRows
from .wire._student_topk import (
    ROWS_PER_SLICE,
    RowsRead,
    rows_convert_in_thread,
    rows_read_slices,
)

if TYPE_CHECKING:
    import torch

__all__ = ("Call", "Result", "RunState", "StreamParts", "TeacherRows", "run_pipeline")

log = get_logger()

Result = ScoredSample | SampleFailure

_READ = object()  # (the end of rows_read_slices)


# What a sample that the KL stage does not score ends as: a SampleFailure whose message is
# redacted (a server may echo the Authorization header in an error body, an abort message
# or a malformed header line, possibly cut by a cap).


def sample_failure(
    sample: Any, index: int, exc: OPDStreamError, attempts: int, secret: str | None
) -> SampleFailure:
    """``exc`` as the failure of ``sample`` (the caller's object as given, a Sample or not:
    invalid_sample), its message redacted."""
    message = redact(str(exc), secret)
    return SampleFailure(
        sample=sample, index=index, reason=exc.reason, message=message, attempts=attempts
    )


def internal_failure(
    prepared: PreparedSample, exc: Exception, attempts: int, secret: str | None
) -> SampleFailure:
    """An unexpected error (a bug) as the failure of its sample (reason ``internal_error``),
    logged with its traceback."""
    log.error("internal_error", index=prepared.index, error=type(exc).__name__, exc_info=exc)
    message = f"internal error ({type(exc).__name__}); please report it: {exc}"
    return SampleFailure(
        sample=prepared.sample,
        index=prepared.index,
        reason="internal_error",
        message=redact(message, secret)[:500],
        attempts=attempts,
    )


class StreamParts(msgspec.Struct, frozen=True, kw_only=True):
    """What every run of a stream shares, owned by the :class:`~opd_stream.OPDStream`: its
    configuration, its fetcher (replica pool, limits, capability state, byte budget), its
    teacher routing, its stats, the KL device and the KL stage's thread limiter;
    ``went_busy``, called as a sample is admitted (the stream's loop-lag ticker runs while
    samples are in flight), and ``went_idle``, when a run has nothing left in flight, or
    ends (the stream gives freed heap memory back once nothing has been in flight for a
    while)."""

    config: StreamConfig
    fetcher: SampleFetcher
    routing: TeacherRouting
    stats: StatsRecorder
    kl_device: torch.device
    kl_limiter: anyio.CapacityLimiter
    went_busy: Callable[[], None]
    went_idle: Callable[[], None]


class TeacherRows(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of a teacher-rows call: the teacher's answer for one sample's response
    positions (``rows``: R rows, its top-k when the stream's ``top_k`` > 0)."""

    index: int
    rows: ScoreRows
    attempts: int
    latency_s: float


_Item = Result | TeacherRows  # what the emitter hands over


class Call:
    """One per-call input (:meth:`OPDStream.score`, :meth:`OPDStream.teacher_rows`).

    Cancelling ``scope`` cancels the sample's requests in flight, or skips them if they
    have not started; its outcome is then a ``SampleFailure`` with reason ``cancelled``.
    The run hands the outcome to the call (``done`` is set) instead of its output channel.
    """

    __slots__ = ("done", "error", "item", "sample", "scope", "teacher_only")

    def __init__(self, sample: Any, *, teacher_only: bool = False) -> None:
        self.sample = sample
        self.teacher_only = teacher_only
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.item: _Item | None = None
        self.error: BaseException | None = None  # the exception behind a failure, if any

    def deliver(self, item: _Item) -> None:
        self.item = item
        self.done.set()

    def fail(self, error: BaseException) -> None:
        """No outcome will come (the run ended): the call raises ``error``."""
        if not self.done.is_set():
            self.error = error
            self.done.set()


class RunState:
    """Shared between a run's supervisor task and its :class:`Results` handle."""

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.error: BaseException | None = None


class _Job(msgspec.Struct, frozen=True):
    """What intake hands the fetch workers."""

    prepared: PreparedSample
    admitted_at: float
    call: Call | None  # a per-call input: its cancel scope, its mode


_Ends = tuple[
    MemoryObjectReceiveStream[_Job],
    MemoryObjectSendStream[Fetched],
    MemoryObjectSendStream[_Item],
]


class _Crew:
    """The fetch workers, started as work arrives: one for each job sent when no worker is
    idle for it, at most ``limit`` (``min(max_inflight, 1024)``, set in :meth:`_Pipeline.run`).
    A run of a few samples starts a few tasks, not ``max_inflight`` of them (each costs the
    loop ~0.1 ms to start and to end).

    It holds spare ends of the channels, cloned for each new worker, until :meth:`close`
    (the intake's end: no job comes after it, so no worker is needed after it either).
    A worker hands each job to ``fetch_one(job, kl, emit)``.
    """

    def __init__(
        self,
        tg: TaskGroup,
        fetch_one: Callable[
            [_Job, MemoryObjectSendStream[Fetched], MemoryObjectSendStream[_Item]],
            Coroutine[Any, Any, None],
        ],
        ends: _Ends,
        limit: int,
    ) -> None:
        self._tg = tg
        self._fetch_one = fetch_one
        self._ends = ends
        self._limit = limit
        self.started = 0
        self.busy = 0  # taken a job, not yet done with it
        self.queued = 0  # jobs sent (or being sent), not yet taken

    def before_send(self) -> None:
        """A job is about to be sent: start a worker if none would be idle for it."""
        if self.started - self.busy <= self.queued and self.started < self._limit:
            work, kl, emit = self._ends
            self._tg.start_soon(self._worker, work.clone(), kl.clone(), emit.clone())
            self.started += 1
        self.queued += 1

    async def _worker(
        self,
        work: MemoryObjectReceiveStream[_Job],
        kl: MemoryObjectSendStream[Fetched],
        emit: MemoryObjectSendStream[_Item],
    ) -> None:
        async with work, kl, emit:
            async for job in work:
                self.queued -= 1
                self.busy += 1
                try:
                    await self._fetch_one(job, kl, emit)
                finally:
                    self.busy -= 1  # done with it, and idle again
                # Nothing of a finished sample stays referenced while this worker waits for
                # the next one (up to 1024 workers: that would be GBs at long R).
                del job

    def close(self) -> None:
        for end in self._ends:
            end.close()


class _Pipeline:
    def __init__(self, parts: StreamParts, order: Literal["completed", "input"]) -> None:
        config = parts.config
        self.cfg = config
        self.fetcher = parts.fetcher
        self.routing = parts.routing
        self.stats = parts.stats
        self.kl_device = parts.kl_device
        self.kl_limiter = parts.kl_limiter
        self.went_busy = parts.went_busy
        self.went_idle = parts.went_idle
        self.order = order
        # In input order, results wait in the reorder buffer while holding their slot,
        # so bounding the slots bounds the buffer too.
        slots = config.max_inflight
        if order == "input":
            slots = min(slots, config.max_reorder)
        self.slots = anyio.Semaphore(slots)
        # admitted, result not yet handed over: the one count (the stream's is their sum)
        self.in_flight = 0
        self.calls: dict[int, Call] = {}  # admitted calls by index, until handed over
        self.secret = None if config.api_key is None else config.api_key.get_secret_value()
        # only-teacher never reads a sample's student top-k: not converted, not checked
        self.reads_student_topk = STRATEGY_NEEDS[config.strategy].student_topk
        cap = config.channel_capacity
        for name in CHANNELS:
            self.stats.channel(name, cap)

    # stage 1: intake ---------------------------------------------------------------
    def _prepare(
        self, sample: Any, index: int, teacher_only: bool, rows_read: RowsRead | None = None
    ) -> PreparedSample:
        start = time.thread_time()
        try:
            return self._prepare_timed(sample, index, teacher_only, rows_read)
        finally:
            self.stats.spent("prepare", time.thread_time() - start)

    async def _rows_read(self, sample: Any) -> RowsRead | None:
        """The sample's Python top-k rows read on the loop a slice at a time, the loop
        taking its turn between two (``rows_read_slices``); ``None`` where the conversion
        reads them itself (few rows, another form, the kernels not ready)."""
        rows = getattr(sample, "student_top_logprobs", None)
        if not isinstance(rows, list) or len(rows) <= ROWS_PER_SLICE:
            return None
        read: list[RowsRead] = []
        slices = rows_read_slices(rows, self.cfg.top_k, read)
        while True:
            start = time.thread_time()
            paused = next(slices, _READ) is not _READ
            self.stats.spent("prepare", time.thread_time() - start)
            if not paused:
                return read[0] if read else None
            await anyio.lowlevel.checkpoint()

    def _prepare_timed(
        self, sample: Any, index: int, teacher_only: bool, rows_read: RowsRead | None
    ) -> PreparedSample:
        prepared = prepare_sample(
            sample,
            index,
            teacher="",
            top_k=self.cfg.top_k,
            student_topk=self.reads_student_topk,
            rows_read=rows_read,
        )
        if (
            not teacher_only
            and self.cfg.student_url is None
            and prepared.response_length > 0
            and self.fetcher.plan(prepared).needs_student_server
        ):
            raise InvalidSampleError(
                "student_top_logprobs",
                f"required: strategy {self.cfg.strategy!r} needs the student's top-k and no "
                "student_url is configured to fetch it",
            )
        teacher = self.routing.resolve(prepared.sample.metadata)
        prepared = msgspec.structs.replace(prepared, teacher=teacher)
        xtok = self.fetcher.xtok
        if xtok is not None and teacher_only and xtok.teacher(teacher) is not None:
            raise InvalidSampleError(
                "metadata",
                f"teacher {teacher!r} has its own tokenizer: its rows are in its own ids, not "
                "at the sample's response positions; use OPDStream.score for it",
            )
        if xtok is not None:  # a teacher with its own tokenizer needs its prompt
            xtok.check_prompt(prepared.teacher, prepared.teacher_tokens)
        return prepared

    async def intake(
        self,
        samples: Iterable[Any] | AsyncIterable[Any],
        work: MemoryObjectSendStream[_Job],
        emit: MemoryObjectSendStream[_Item],
        crew: _Crew,
    ) -> None:
        # anyio starts every task it is given (a cancelled one runs to its first
        # checkpoint), so this block is always entered and the crew always closed
        async with work, emit:
            try:
                await self._intake(samples, work, emit, crew)
            finally:
                crew.close()  # no job after this one: no worker needed either

    async def _intake(
        self,
        samples: Iterable[Any] | AsyncIterable[Any],
        work: MemoryObjectSendStream[_Job],
        emit: MemoryObjectSendStream[_Item],
        crew: _Crew,
    ) -> None:
        if isinstance(samples, AsyncIterable):
            iterator = aiter(samples)
            try:
                index = 0
                async for sample in iterator:
                    await self._admit(sample, index, work, emit, crew)
                    index += 1
                    del sample  # not held while waiting for the next one
            finally:
                # We consumed the caller's async generator; close it here, in its task,
                # rather than leaving it to the garbage collector.
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()
        else:
            for index, sample in enumerate(samples):
                await self._admit(sample, index, work, emit, crew)
                del sample

    async def _admit(
        self,
        sample: Any,
        index: int,
        work: MemoryObjectSendStream[_Job],
        emit: MemoryObjectSendStream[_Item],
        crew: _Crew,
    ) -> None:
        call = None
        if isinstance(sample, Call):
            call, sample = sample, sample.sample
        await self.slots.acquire()
        self.stats.admitted += 1
        self.in_flight += 1
        self.went_busy()
        if call is not None:
            self.calls[index] = call
        admitted_at = time.monotonic()
        teacher_only = call is not None and call.teacher_only
        try:
            prepare = partial(self._prepare, sample, index, teacher_only)
            # Python rows, converted if the strategy reads them: big ones in a thread, the
            # others on the loop, read a slice at a time first
            reads_rows = self.reads_student_topk and self.cfg.top_k > 0
            if reads_rows and rows_convert_in_thread(
                sample, self.cfg.top_k, self.cfg.offload_bytes // WHOLE
            ):
                prepared = await anyio.to_thread.run_sync(prepare)
            else:
                prepared = prepare(await self._rows_read(sample) if reads_rows else None)
        except (InvalidSampleError, RoutingError) as exc:
            if call is not None:
                call.error = exc
            await self._emit(emit, sample_failure(sample, index, exc, 0, self.secret))
        else:
            crew.before_send()
            await self._send("intake", work, _Job(prepared, admitted_at, call))

    async def _send(
        self, channel: ChannelName, stream: MemoryObjectSendStream[Any], item: Any
    ) -> None:
        """Send, then count the item as sitting in ``channel`` (for depth/high-water stats)."""
        await stream.send(item)
        self.stats.put(channel)

    async def _emit(self, emit: MemoryObjectSendStream[_Item], item: _Item) -> None:
        """An outcome for the emitter. A call's outcome (a calls' run is in completed
        order) is handed to its caller here, at once, by :meth:`_deliver`, as
        :meth:`_hand_over` would: without the hop through the ``emit`` channel and the
        emitter's task (an event-loop round per sample). Anything else goes through the
        channel."""
        if item.index in self.calls:
            self.stats.put("emit")  # counted as passing through it, as before
            self.stats.take("emit")
            self._deliver(item)
            return
        await self._send("emit", emit, item)

    # stage 2: fetch workers --------------------------------------------------------
    def _empty_result(self, job: _Job) -> _Item:
        """R = 0: nothing to ask; an empty result of the right shapes."""
        prepared, cfg = job.prepared, self.cfg
        if job.call is not None and job.call.teacher_only:
            k = cfg.top_k
            top = (np.empty((0, k), np.int64), np.empty((0, k), np.float32)) if k else None
            rows = ScoreRows(
                token_ids=np.empty(0, np.int64),
                token_logprobs=np.empty(0, np.float32),
                top_ids=None if top is None else top[0],
                top_logprobs=None if top is None else top[1],
                id_logprobs=None,
                used_b64=False,
                weight_version=None,
            )
            return TeacherRows(index=prepared.index, rows=rows, attempts=0, latency_s=0.0)

        from ._scoring import empty_scored_sample  # torch: loaded by OPDStream already

        xtok = self.fetcher.xtok
        return empty_scored_sample(
            prepared,
            job.admitted_at,
            cfg.top_k,
            cfg.strategy,
            cfg.tail,
            cfg.divergence,
            aligned=xtok is not None and xtok.aligns(prepared.teacher),
            candidates=cfg.candidates,
        )

    async def fetch_one(
        self, job: _Job, kl: MemoryObjectSendStream[Fetched], emit: MemoryObjectSendStream[_Item]
    ) -> None:
        """A fetch worker's job (see :class:`_Crew`)."""
        self.stats.take("intake")
        prepared, call = job.prepared, job.call
        if prepared.response_length == 0:
            await self._emit(emit, self._empty_result(job))
            return
        teacher_only = call is not None and call.teacher_only
        fetched: Fetched | None = None
        try:
            if call is None:
                fetched = await self._fetch(prepared, job.admitted_at, teacher_only)
            else:
                with call.scope:  # cancelled by the caller: its requests stop, at once
                    fetched = await self._fetch(prepared, job.admitted_at, teacher_only)
        except ScoreAttemptError as exc:
            if call is not None:
                call.error = exc.error
            failure = sample_failure(
                prepared.sample, prepared.index, exc.error, exc.attempts, self.secret
            )
            await self._emit(emit, failure)
            return
        except Exception as exc:  # a bug: fail this sample, keep the others going
            await self._emit(emit, internal_failure(prepared, exc, 0, self.secret))
            return
        if fetched is None:
            cancelled = SampleFailure(
                sample=prepared.sample,
                index=prepared.index,
                reason="cancelled",
                message="cancelled by its caller",
                attempts=0,
            )
            await self._emit(emit, cancelled)
            return
        if teacher_only:  # nothing for the KL stage: the teacher's rows are the outcome
            rows = TeacherRows(
                index=prepared.index,
                rows=fetched.teacher_rows,
                attempts=fetched.attempts,
                latency_s=time.monotonic() - job.admitted_at,
            )
            await self._emit(emit, rows)
            return
        await self._send("kl", kl, fetched)

    async def _fetch(
        self, prepared: PreparedSample, admitted_at: float, teacher_only: bool
    ) -> Fetched:
        teacher = self.routing.teacher(prepared.teacher)
        return await self.fetcher.fetch(prepared, teacher, admitted_at, teacher_only=teacher_only)

    # stage 3: KL -------------------------------------------------------------------
    async def _next_batch(self, kl: MemoryObjectReceiveStream[Fetched]) -> list[Fetched]:
        """Up to ``kl_batch_size`` items: what is ready now, topped up for a short wait."""
        try:
            batch = [await kl.receive()]
        except anyio.EndOfStream:
            return []
        self.stats.take("kl")
        limit = self.cfg.kl_batch_size
        try:
            while len(batch) < limit:
                try:
                    batch.append(kl.receive_nowait())
                except anyio.WouldBlock:
                    break
                self.stats.take("kl")
            if len(batch) < limit and self.cfg.kl_batch_wait_s > 0:
                with anyio.move_on_after(self.cfg.kl_batch_wait_s):
                    while len(batch) < limit:
                        batch.append(await kl.receive())
                        self.stats.take("kl")
        except anyio.EndOfStream:
            pass
        return batch

    async def kl_stage(
        self, kl: MemoryObjectReceiveStream[Fetched], emit: MemoryObjectSendStream[_Item]
    ) -> None:
        async with kl, emit:
            while batch := await self._next_batch(kl):
                await self._score_batch(batch, emit)
                del batch  # not held while waiting for the next batch

    async def _score_batch(self, batch: list[Fetched], emit: MemoryObjectSendStream[_Item]) -> None:
        self.stats.stage_active["kl"] += 1
        from ._scoring import timed_score_batch  # torch: loaded by OPDStream already
        from .kl._threads import one_intraop_thread

        results: list[Any]
        try:
            score = partial(timed_score_batch, batch, self.cfg, self.kl_device)
            results, seconds, cpu = await anyio.to_thread.run_sync(
                one_intraop_thread, score, limiter=self.kl_limiter
            )
            self.stats.record_kl_batch(len(batch), seconds)
            self.stats.cpu.kl += cpu
        except Exception as bug:  # a bug: fail this batch's samples, keep going
            results = [internal_failure(f.prepared, bug, f.attempts, self.secret) for f in batch]
        finally:
            self.stats.stage_active["kl"] -= 1
        batch.clear()  # the fetched answers: not kept while the results wait to be sent
        for res in results:
            item: Result
            if isinstance(res, ScoredSample | SampleFailure):
                item = res
            else:
                fetched, exc = res
                p = fetched.prepared
                item = sample_failure(p.sample, p.index, exc, fetched.attempts, self.secret)
            await self._emit(emit, item)
        # The worker thread may still hold the list it returned for a moment (trio's thread
        # cache keeps its result until its delivery returns): leave it empty.
        results.clear()

    # stage 4: emit -----------------------------------------------------------------
    def _account(self, item: _Item) -> None:
        self.in_flight -= 1
        if isinstance(item, ScoredSample | TeacherRows):
            self.stats.completed += 1
            self.stats.record_latency(item.latency_s)
        else:
            self.stats.record_failure(item.reason)
            # a sample its caller cancelled is not a problem to warn about
            (log.debug if item.reason == "cancelled" else log.warning)(
                "sample_failed",
                index=item.index,
                reason=item.reason,
                attempts=item.attempts,
                message=item.message,
            )

    async def _hand_over(self, item: _Item, out: MemoryObjectSendStream[Result]) -> None:
        if item.index in self.calls:
            self._deliver(item)
            return
        self._account(item)
        assert not isinstance(item, TeacherRows)  # (only a call asks for them)
        await self._send("output", out, item)
        self._released()

    def _deliver(self, item: _Item) -> None:
        """A call's outcome to its caller (who waits for it, not the output channel)."""
        self._account(item)
        self.calls.pop(item.index).deliver(item)
        self._released()

    def _released(self) -> None:
        """An outcome handed over: its slot is free."""
        self.slots.release()
        if self.in_flight == 0:
            self.went_idle()

    async def emitter(
        self, emit: MemoryObjectReceiveStream[_Item], out: MemoryObjectSendStream[Result]
    ) -> None:
        async with emit, out:
            pending: dict[int, _Item] = {}
            next_index = 0
            async for item in emit:
                self.stats.take("emit")
                if self.order == "completed":
                    await self._hand_over(item, out)
                else:
                    pending[item.index] = item
                    while next_index in pending:
                        await self._hand_over(pending.pop(next_index), out)
                        next_index += 1
                del item  # handed over: not held while waiting for the next one

    async def run(
        self, samples: Iterable[Any] | AsyncIterable[Any], out: MemoryObjectSendStream[Result]
    ) -> None:
        """The stages, in one task group; returns when every one has ended."""
        cap = self.cfg.channel_capacity
        workers = min(self.cfg.max_inflight, 1024)
        work_send, work_recv = anyio.create_memory_object_stream[_Job](cap)
        kl_send, kl_recv = anyio.create_memory_object_stream[Fetched](cap)
        emit_send, emit_recv = anyio.create_memory_object_stream[_Item](cap)
        async with anyio.create_task_group() as tg:
            with work_send, work_recv, kl_send, kl_recv, emit_send, emit_recv:
                ends = (work_recv.clone(), kl_send.clone(), emit_send.clone())
                crew = _Crew(tg, self.fetch_one, ends, workers)
                tg.start_soon(self.intake, samples, work_send.clone(), emit_send.clone(), crew)
                tg.start_soon(self.kl_stage, kl_recv.clone(), emit_send.clone())
                tg.start_soon(self.emitter, emit_recv.clone(), out.clone())


async def run_pipeline(
    parts: StreamParts,
    samples: Iterable[Any] | AsyncIterable[Any],
    out: MemoryObjectSendStream[Result],
    state: RunState,
    *,
    order: Literal["completed", "input"] | None = None,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Supervise one run: start the stages, record a pipeline-level error, close ``out``.

    ``order``: the result order (default: the configuration's ``order``).
    """
    name_async_library()  # (for every task of the run: each anyio call finds it faster)
    pipe = _Pipeline(parts, order or parts.config.order)
    stats = parts.stats
    stats.runs.add(pipe)
    try:
        with state.scope, out:
            task_status.started()
            await pipe.run(samples, out)
    except anyio.BrokenResourceError:
        pass  # the consumer closed its end: nothing left to deliver
    except Exception as exc:
        err: BaseException = exc
        while isinstance(err, BaseExceptionGroup) and len(err.exceptions) == 1:
            err = err.exceptions[0]  # the one error of a task group
        if not isinstance(err, anyio.BrokenResourceError):
            state.error = err
    finally:
        # a cancelled run leaves samples that will never come out: they leave the count
        # of samples in flight with the run
        stats.runs.discard(pipe)
        parts.went_idle()
        state.done.set()
        log.info(
            "run_finished",
            admitted=stats.admitted,
            completed=stats.completed,
            failed=stats.failed,
            retries=stats.retries,
            error=type(state.error).__name__ if state.error is not None else None,
        )
