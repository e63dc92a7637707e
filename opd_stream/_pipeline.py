"""One run of the streaming pipeline: stages joined by bounded channels.

::

    intake (validate + route) --[intake]--> fetch workers (payload, teacher fetch,
    student fetch, decode) --[kl]--> KL stage (batched, worker thread) --[emit]-->
    emitter (order, accounting) --[output]--> the caller's ``async for``

Invalid samples and fetch failures go straight to ``emit``. Every admitted sample holds one
of ``max_inflight`` slots until its result is handed over, so memory is bounded by the
configured capacities and a slow consumer stops intake. The stage tasks live in one task
group per run, inside the stream's (the drawing with modules: ``docs/internals.md``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import msgspec
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._config import StreamConfig
from ._errors import InvalidSampleError, RoutingError
from ._failures import internal_failure, sample_failure
from ._logging import get_logger
from ._memory import maybe_release_freed_memory, release_freed_memory
from ._router import TeacherRouter
from ._sample import Fetched, PreparedSample, SampleFailure, ScoredSample, prepare_sample
from ._scorer import SampleScorer, ScoreAttemptError
from ._stats import StatsRecorder
from ._student_topk import rows_convert_in_thread

if TYPE_CHECKING:
    import torch

__all__ = ("Result", "RunState", "Submission", "run_pipeline")

log = get_logger()

Result = ScoredSample | SampleFailure


class Submission(NamedTuple):
    """An input item that carries its own cancel scope (the integrations' per-call input):
    cancelling ``scope`` cancels the sample's requests in flight, or skips them if they have
    not started; its result is then a ``SampleFailure`` with reason ``cancelled``."""

    sample: Any
    scope: anyio.CancelScope


# What intake hands the fetch workers: the sample, its admission time, its cancel scope.
_Work = tuple[PreparedSample, float, "anyio.CancelScope | None"]


class RunState:
    """Shared between a run's supervisor task and its :class:`Results` handle."""

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.error: BaseException | None = None


class _Crew:
    """The fetch workers, started as work arrives: one for each job sent when no worker is
    idle for it, at most ``limit`` (``max_inflight``). A run of a few samples starts a few
    tasks, not ``max_inflight`` of them (each costs the loop ~0.1 ms to start and to end).

    It holds spare ends of the channels, cloned for each new worker, until :meth:`close`
    (the intake's end: no job comes after it, so no worker is needed after it either).
    """

    def __init__(
        self,
        tg: TaskGroup,
        worker: Any,
        ends: tuple[
            MemoryObjectReceiveStream[_Work],
            MemoryObjectSendStream[Fetched],
            MemoryObjectSendStream[Result],
        ],
        limit: int,
    ) -> None:
        self._tg = tg
        self._worker = worker
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

    def took(self) -> None:
        """A worker took a job."""
        self.queued -= 1
        self.busy += 1

    def finished(self) -> None:
        """A worker is done with its job (and idle again)."""
        self.busy -= 1

    def close(self) -> None:
        for end in self._ends:
            end.close()


class _Pipeline:
    def __init__(
        self,
        config: StreamConfig,
        scorer: SampleScorer,
        router: TeacherRouter,
        stats: StatsRecorder,
        kl_device: torch.device,
        kl_limiter: anyio.CapacityLimiter,
    ) -> None:
        self.cfg = config
        self.scorer = scorer
        self.router = router
        self.stats = stats
        self.kl_device = kl_device
        self.kl_limiter = kl_limiter
        # In input order, results wait in the reorder buffer while holding their slot,
        # so bounding the slots bounds the buffer too.
        slots = config.max_inflight
        if config.order == "input":
            slots = min(slots, config.max_reorder)
        self.slots = anyio.Semaphore(slots)
        self.outstanding = 0  # admitted, result not yet handed over (for stats on cancel)
        self.crew: _Crew | None = None  # set by run_pipeline before the intake starts
        self.secret = None if config.api_key is None else config.api_key.get_secret_value()
        cap = config.channel_capacity
        for name in ("intake", "kl", "emit", "output"):
            stats.channel(name, cap)

    # stage 1: intake ---------------------------------------------------------------
    def _prepare(self, sample: Any, index: int) -> PreparedSample:
        start = time.thread_time()
        try:
            return self._prepare_timed(sample, index)
        finally:
            self.stats.cpu.prepare += time.thread_time() - start

    def _prepare_timed(self, sample: Any, index: int) -> PreparedSample:
        prepared = prepare_sample(sample, index, teacher="", top_k=self.cfg.top_k)
        if (
            self.cfg.student_url is None
            and prepared.response_length > 0
            and self.scorer.plan(prepared).needs_student_server
        ):
            raise InvalidSampleError(
                "student_top_logprobs",
                f"required: strategy {self.cfg.strategy!r} needs the student's top-k and no "
                "student_url is configured to fetch it",
            )
        teacher = self.router.resolve(prepared.sample.metadata)
        prepared = msgspec.structs.replace(prepared, teacher=teacher)
        if self.scorer.xtok is not None:  # a teacher with its own tokenizer needs its prompt
            self.scorer.xtok.check_prompt(prepared)
        return prepared

    async def intake(
        self,
        samples: Iterable[Any] | AsyncIterable[Any],
        work: MemoryObjectSendStream[_Work],
        emit: MemoryObjectSendStream[Result],
    ) -> None:
        async with work, emit:
            try:
                await self._intake(samples, work, emit)
            finally:
                if self.crew is not None:
                    self.crew.close()  # no job after this one: no worker needed either

    async def _intake(
        self,
        samples: Iterable[Any] | AsyncIterable[Any],
        work: MemoryObjectSendStream[_Work],
        emit: MemoryObjectSendStream[Result],
    ) -> None:
        if isinstance(samples, AsyncIterable):
            iterator = aiter(samples)
            try:
                index = 0
                async for sample in iterator:
                    await self._admit(sample, index, work, emit)
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
                await self._admit(sample, index, work, emit)
                del sample

    async def _admit(
        self,
        sample: Any,
        index: int,
        work: MemoryObjectSendStream[_Work],
        emit: MemoryObjectSendStream[Result],
    ) -> None:
        scope = None
        if isinstance(sample, Submission):
            sample, scope = sample.sample, sample.scope
        await self.slots.acquire()
        self.stats.admitted += 1
        self.stats.in_flight += 1
        self.outstanding += 1
        admitted_at = time.monotonic()
        try:
            prepare = partial(self._prepare, sample, index)  # big Python rows: in a thread
            in_thread = rows_convert_in_thread(sample, self.cfg.top_k)
            prepared = await anyio.to_thread.run_sync(prepare) if in_thread else prepare()
        except (InvalidSampleError, RoutingError) as exc:
            await self._send("emit", emit, sample_failure(sample, index, exc, 0, self.secret))
        else:
            if self.crew is not None:
                self.crew.before_send()
            await self._send("intake", work, (prepared, admitted_at, scope))

    async def _send(self, channel: str, stream: MemoryObjectSendStream[Any], item: Any) -> None:
        """Send, then count the item as sitting in ``channel`` (for depth/high-water stats)."""
        await stream.send(item)
        self.stats.put(channel)

    # stage 2: fetch workers --------------------------------------------------------
    def _empty_result(self, prepared: PreparedSample, admitted_at: float) -> ScoredSample:
        """R = 0: nothing to ask; an empty result of the right shapes."""
        from ._klstage import empty_result  # torch: loaded by OPDStream already

        cfg = self.cfg
        return empty_result(
            prepared, admitted_at, cfg.top_k, cfg.strategy, cfg.tail, cfg.divergence
        )

    async def worker(
        self,
        work: MemoryObjectReceiveStream[_Work],
        kl: MemoryObjectSendStream[Fetched],
        emit: MemoryObjectSendStream[Result],
    ) -> None:
        async with work, kl, emit:
            async for job in work:
                self.stats.take("intake")
                crew = self.crew
                if crew is not None:
                    crew.took()
                try:
                    await self._fetch_one(job, kl, emit)
                finally:
                    if crew is not None:
                        crew.finished()
                # Nothing of a finished sample stays referenced while this worker waits for
                # the next one (up to max_inflight workers: that would be GBs at long R).
                del job

    async def _fetch_one(
        self, job: _Work, kl: MemoryObjectSendStream[Fetched], emit: MemoryObjectSendStream[Result]
    ) -> None:
        prepared, admitted_at, scope = job
        if prepared.response_length == 0:
            await self._send("emit", emit, self._empty_result(prepared, admitted_at))
            return
        fetched: Fetched | None = None
        try:
            if scope is None:
                fetched = await self._fetch(prepared, admitted_at)
            else:
                with scope:  # cancelled by the caller: its requests stop, at once
                    fetched = await self._fetch(prepared, admitted_at)
        except ScoreAttemptError as exc:
            failure = sample_failure(
                prepared.sample, prepared.index, exc.error, exc.attempts, self.secret
            )
            await self._send("emit", emit, failure)
            return
        except Exception as exc:  # a bug: fail this sample, keep the others going
            await self._send("emit", emit, internal_failure(prepared, exc, 0, self.secret))
            return
        if fetched is None:
            cancelled = SampleFailure(
                sample=prepared.sample,
                index=prepared.index,
                reason="cancelled",
                message="cancelled by its caller",
                attempts=0,
            )
            await self._send("emit", emit, cancelled)
            return
        await self._send("kl", kl, fetched)

    async def _fetch(self, prepared: PreparedSample, admitted_at: float) -> Fetched:
        return await self.scorer.fetch(prepared, self.router.teacher(prepared.teacher), admitted_at)

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
        self, kl: MemoryObjectReceiveStream[Fetched], emit: MemoryObjectSendStream[Result]
    ) -> None:
        async with kl, emit:
            while batch := await self._next_batch(kl):
                await self._score_batch(batch, emit)
                del batch  # not held while waiting for the next batch

    async def _score_batch(
        self, batch: list[Fetched], emit: MemoryObjectSendStream[Result]
    ) -> None:
        self.stats.stage_active["kl"] += 1
        from ._klstage import timed_score_batch  # torch: loaded by OPDStream already

        results: list[Any]
        try:
            results, seconds, cpu = await anyio.to_thread.run_sync(
                partial(timed_score_batch, batch, self.cfg, self.kl_device),
                limiter=self.kl_limiter,
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
            await self._send("emit", emit, item)
        # The worker thread may still hold the list it returned for a moment (trio's thread
        # cache keeps its result until its delivery returns): leave it empty.
        results.clear()

    # stage 4: emit -----------------------------------------------------------------
    def _account(self, item: Result) -> None:
        self.stats.in_flight -= 1
        self.outstanding -= 1
        if isinstance(item, ScoredSample):
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

    async def _hand_over(self, item: Result, out: MemoryObjectSendStream[Result]) -> None:
        self._account(item)
        await self._send("output", out, item)
        self.slots.release()
        if self.outstanding == 0:  # nothing in flight: give freed heap memory back
            maybe_release_freed_memory()

    async def emitter(
        self, emit: MemoryObjectReceiveStream[Result], out: MemoryObjectSendStream[Result]
    ) -> None:
        async with emit, out:
            pending: dict[int, Result] = {}
            next_index = 0
            async for item in emit:
                self.stats.take("emit")
                if self.cfg.order == "completed":
                    await self._hand_over(item, out)
                else:
                    pending[item.index] = item
                    while next_index in pending:
                        await self._hand_over(pending.pop(next_index), out)
                        next_index += 1
                del item  # handed over: not held while waiting for the next one


async def run_pipeline(
    pipeline_args: tuple[
        StreamConfig,
        SampleScorer,
        TeacherRouter,
        StatsRecorder,
        torch.device,
        anyio.CapacityLimiter,
    ],
    samples: Iterable[Any] | AsyncIterable[Any],
    out: MemoryObjectSendStream[Result],
    state: RunState,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Supervise one run: start the stages, record a pipeline-level error, close ``out``."""
    pipe = _Pipeline(*pipeline_args)
    cap = pipe.cfg.channel_capacity
    workers = min(pipe.cfg.max_inflight, 1024)
    try:
        with state.scope, out:
            task_status.started()
            work_send, work_recv = anyio.create_memory_object_stream[_Work](cap)
            kl_send, kl_recv = anyio.create_memory_object_stream[Fetched](cap)
            emit_send, emit_recv = anyio.create_memory_object_stream[Result](cap)
            async with anyio.create_task_group() as tg:
                with work_send, work_recv, kl_send, kl_recv, emit_send, emit_recv:
                    ends = (work_recv.clone(), kl_send.clone(), emit_send.clone())
                    pipe.crew = _Crew(tg, pipe.worker, ends, workers)
                    tg.start_soon(pipe.intake, samples, work_send.clone(), emit_send.clone())
                    tg.start_soon(pipe.kl_stage, kl_recv.clone(), emit_send.clone())
                    tg.start_soon(pipe.emitter, emit_recv.clone(), out.clone())
    except anyio.BrokenResourceError:
        pass  # the consumer closed its end: nothing left to deliver
    except Exception as exc:
        err: BaseException = exc
        while isinstance(err, BaseExceptionGroup) and len(err.exceptions) == 1:
            err = err.exceptions[0]  # the one error of a task group
        if not isinstance(err, anyio.BrokenResourceError):
            state.error = err
    finally:
        if pipe.crew is not None:
            pipe.crew.close()  # (the intake's end does, unless it never ran)
        # a cancelled run leaves samples that will never come out: not in flight any more
        pipe.stats.in_flight -= pipe.outstanding
        pipe.outstanding = 0
        release_freed_memory()  # see _memory: glibc keeps large freed blocks otherwise
        state.done.set()
        st = pipe.stats
        log.info(
            "run_finished",
            admitted=st.admitted,
            completed=st.completed,
            failed=st.failed,
            retries=st.retries,
            error=type(state.error).__name__ if state.error is not None else None,
        )
