"""``OPDStream``: the public entry point, and ``Results``, the handle of one run::

    async with OPDStream(StreamConfig.from_env()) as stream:
        async with stream.run(samples) as results:
            async for item in results:      # ScoredSample | SampleFailure, each input once
                ...
        result = await stream.score(sample)     # or one sample at a time, from any task

The stream owns one task group, one transport and the per-endpoint state (handed to each
run as :class:`~opd_stream._pipeline.StreamParts`); leaving ``results`` early or cancelling
the caller cancels the run, leaving no request or task behind. Entering it imports torch,
the KL code and the HTTP client in a worker thread (:mod:`opd_stream._loading`).
"""

from __future__ import annotations

import sys
import types
from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Self

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._async_library import name_async_library
from ._errors import ConfigError, OPDStreamError
from ._loading import import_off_loop, is_imported
from ._logging import get_logger
from ._memory import IdleRelease
from ._pipeline import Call, Result, RunState, StreamParts, TeacherRows, run_pipeline
from ._sample import Sample, SampleFailure, ScoredSample, prepare_sample
from ._stats import StatsRecorder, StreamStats
from .config._settings import StreamConfig, resolve_decode_threads, resolve_kl_device
from .fetch._fetcher import SampleFetcher
from .fleet._fleet import Fleet
from .fleet._probe import PROBE_RESPONSE_LENGTH, ProbeReport, default_probe_tokens, ejectable
from .fleet._probe_requests import run_probe
from .fleet._routing import TeacherRouting, replica_groups
from .scanner._loader import cpu_seconds as kernels_cpu
from .scanner._loader import start as start_kernels
from .transport._legacy import as_transport
from .transport._transports import Transport
from .wire._answers import ScoreRows
from .xtok._tokenizers import CrossTokenizers

if TYPE_CHECKING:
    import torch

__all__ = ("OPDStream", "Results", "default_transport")

log = get_logger()

_LAG_INTERVAL_S = 0.01
_CLOSE_GRACE_S = 10.0


def _on_asyncio() -> bool:
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _default_transport_modules() -> tuple[str, ...]:
    """The modules :func:`default_transport` imports, for the running backend."""
    if _on_asyncio():
        return (f"{__package__}.transport._native",)
    return (f"{__package__}.transport._httpx",)


def _kl_device_now(config: StreamConfig) -> str | None:
    """``kl_device`` resolved in the calling thread where that is cheap and needed there, or
    None: resolved when the stream loads (:meth:`OPDStream.load`, in a worker thread).

    ``cpu`` is ``cpu``. ``auto`` and ``cuda`` mean the calling thread's current CUDA device
    (:func:`~opd_stream.config._device.resolve_kl_device`), which can differ from a new
    thread's only once CUDA is initialized in the process (``torch.cuda.set_device``
    initializes it): then it is read here, at once. Before that, every thread's current
    device is the same, and torch need not be imported here (nor CUDA started) to read it.
    """
    if config.kl_device.strip().lower() == "cpu":
        return "cpu"
    torch = sys.modules.get("torch")
    if torch is not None and is_imported("torch") and torch.cuda.is_initialized():
        return resolve_kl_device(config)
    return None


def default_transport(config: StreamConfig) -> Transport:
    """The transport a stream uses when none is given, for the running backend: pooled
    HTTP/1.1 on asyncio's buffered protocols (:class:`~opd_stream.AsyncioTransport`)
    under asyncio, pooled httpx (the ``httpx`` extra) under trio.

    Raises:
        ConfigError: under trio without httpx installed.
    """
    api_key = config.api_key.get_secret_value() if config.api_key else None
    if _on_asyncio():
        from .transport._native import AsyncioTransport

        return AsyncioTransport(api_key=api_key, connect_timeout_s=config.connect_timeout_s)
    try:
        from .transport._httpx import HttpxTransport
    except ImportError:
        raise ConfigError(
            "under trio the default transport needs httpx: pip install 'opd-stream[httpx]' "
            "(or pass a transport)"
        ) from None
    return HttpxTransport(api_key=api_key, connect_timeout_s=config.connect_timeout_s)


def build_fleet(config: StreamConfig, transport: Transport) -> Fleet:
    """The stream's :class:`~opd_stream.fleet._fleet.Fleet`, from its settings."""
    return Fleet(
        transport,
        balance=config.balance,
        load_factor=config.balance_load_factor,
        limit=config.max_inflight_per_endpoint,
        eject_after=config.eject_after_failures,
        cooldown_s=config.eject_cooldown_s,
        unreachable_after_s=config.unreachable_after_s,
        id_scoring=config.id_scoring,
        topk_wire=config.topk_wire,
        discovery=config.gateway_discovery == "auto",
        engine=config.engine,
        server_engines=config.server_engines,
        max_logprobs=config.vllm_max_logprobs,
        secret=config.api_key.get_secret_value() if config.api_key else None,
    )


class Results:
    """The results of one :meth:`OPDStream.run`: an async iterator and context manager.

    Iteration yields each input sample exactly once, as a :class:`ScoredSample` or a
    :class:`SampleFailure`. A pipeline-level error (for instance the caller's own
    iterable raising) is re-raised from the iteration. Closing (leaving the ``async with``
    block or calling :meth:`aclose`) stops the run and waits for its tasks to end.
    """

    def __init__(
        self,
        receive: MemoryObjectReceiveStream[Result],
        state: RunState,
        stats: StatsRecorder,
        runs: set[Results] | None = None,
    ) -> None:
        self._receive = receive
        self._state = state
        self._stats = stats
        self._runs = runs

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Result:
        try:
            item = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            await self._state.done.wait()
            err, self._state.error = self._state.error, None
            if err is not None:
                raise err from None
            raise StopAsyncIteration from None
        self._stats.take("output")
        return item

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.aclose()

    def close_receiver(self) -> None:
        """Close the receiving end (no await): for the stream's exit."""
        self._receive.close()

    async def aclose(self) -> None:
        """Stop the run (if still going) and wait until all of its tasks have ended."""
        self._receive.close()
        if self._runs is not None:
            self._runs.discard(self)
        self._state.scope.cancel()
        with anyio.move_on_after(_CLOSE_GRACE_S, shield=True):
            await self._state.done.wait()


class OPDStream(anyio.AsyncContextManagerMixin):
    """Streaming teacher scoring for on-policy distillation.

    Building one is cheap and may be done on the event loop: torch is loaded as the stream
    is entered (:meth:`load`), off the loop. Until then ``stats().kl.device`` is
    ``kl_device`` as configured (``"auto"``) unless it could be resolved at once.

    Args:
        config: the validated configuration (see :class:`StreamConfig`).
        transport: the HTTP transport; by default (see :func:`default_transport`) a pooled
            :class:`AsyncioTransport` under asyncio and a pooled ``HttpxTransport`` under
            trio (the ``httpx`` extra). Pass a ``MockTransport`` to run without sockets.
            One with only the ``post`` / ``get`` of the releases before
            :class:`~opd_stream.Request` is wrapped (a ``DeprecationWarning``, here).

    Raises:
        TypeError: ``config`` is not a :class:`StreamConfig`; ``transport`` has neither
            ``send`` nor ``post``.
    """

    def __init__(
        self,
        config: StreamConfig,
        *,
        transport: Transport | None = None,
    ) -> None:
        if not isinstance(config, StreamConfig):
            raise TypeError(f"config must be a StreamConfig, got {type(config).__name__}")
        self.config = config
        self._routing = TeacherRouting(config.teachers, config.teacher_key)
        # Nothing slow here (the caller may be on its event loop): torch and the KL code
        # are loaded by load(), off the loop; kl_device is resolved here only where it must
        # be read in the caller's thread (see _kl_device_now), else there.
        self._device_name = _kl_device_now(config)
        self._device: torch.device | None = None
        # a transport with the old post()/get() is wrapped here, once (DeprecationWarning)
        self._transport = None if transport is None else as_transport(transport)
        self._stats = StatsRecorder()
        self._stats.kl_device = self._device_name or config.kl_device
        self._tg: anyio.abc.TaskGroup | None = None
        self._parts: StreamParts | None = None  # what every run shares (set on entry)
        self._fleet: Fleet | None = None  # the servers and all known of them (set on entry)
        self._in_use: Transport | None = None
        self._decode_limiter = anyio.CapacityLimiter(resolve_decode_threads(config))
        # open run handles: a dropped one is closed at the stream's exit
        self._runs: set[Results] = set()
        self._kernels_from: float | None = None  # kernels_cpu() as this stream started them
        # the per-call samples' run (started by the first call) and the calls waiting
        self._calls: MemoryObjectSendStream[Call] | None = None
        self._waiting: set[Call] = set()
        self._busy: anyio.Event  # (made as the stream is entered: it needs the event loop)

    def __repr__(self) -> str:
        return f"OPDStream(teachers={sorted(self.config.teachers)}, top_k={self.config.top_k})"

    async def load(self) -> None:
        """Load what scoring needs, off the event loop, and resolve ``kl_device``: torch
        and the KL code are imported in a worker thread (torch's shared libraries loaded
        first without holding the GIL: :mod:`opd_stream._loading`), so that the caller's
        loop keeps running meanwhile (asyncio or trio).

        Entering the stream does this first; call it before to have the loading done (and
        a ``kl_device`` error raised) earlier. Once done, it returns at once.

        Raises:
            ConfigError: ``kl_device`` asks for CUDA that is not there.
        """
        if self._device is not None:
            return
        self._stats.cpu.setup += await import_off_loop(("torch", f"{__package__}._scoring"))
        name = self._device_name
        if name is None:
            name = await anyio.to_thread.run_sync(resolve_kl_device, self.config)
            self._device_name = name
            self._stats.kl_device = name
        import torch  # (imported by now: a look-up)

        self._device = torch.device(name)

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Self]:
        clock = self._stats.loop_clock
        clock.start()  # the loop's CPU, from here until the stream is left (cpu_s.loop)
        try:
            async with self._entered() as stream:
                yield stream
        finally:
            clock.stop()

    @asynccontextmanager
    async def _entered(self) -> AsyncGenerator[Self]:
        await self.load()
        # teachers with their own tokenizer: loaded once, off the loop (a ConfigError here
        # names the setting and the file)
        xtok = None
        if self.config.teacher_tokenizers:
            cfg = self.config
            load = partial(
                CrossTokenizers.load,
                cfg.student_tokenizer,
                cfg.teacher_tokenizers,
                return_alignment=cfg.return_alignment,
                top_k=cfg.top_k > 0,
            )
            xtok = await anyio.to_thread.run_sync(load)
        # freed heap memory, given back once the stream idles and as it closes (_memory)
        release = IdleRelease(
            self.config.release_memory_after_s,
            lambda: self._stats.in_flight,
            self._stats.spent_releasing,
            drop=self._drop_body_buffers,
        )
        try:
            transport = self._transport
            if transport is None:
                self._stats.cpu.setup += await import_off_loop(
                    (), optional=_default_transport_modules()
                )
                transport = default_transport(self.config)
            assert self._device is not None
            async with transport, anyio.create_task_group() as tg:
                fleet = self._fleet = build_fleet(self.config, transport)
                fetcher = SampleFetcher(
                    self.config,
                    fleet,
                    transport,
                    self._stats,
                    threads=self._decode_limiter,
                    xtok=xtok,
                )
                self._parts = StreamParts(
                    config=self.config,
                    fetcher=fetcher,
                    routing=self._routing,
                    stats=self._stats,
                    kl_device=self._device,
                    kl_limiter=anyio.CapacityLimiter(1),
                    went_busy=self._went_busy,
                    went_idle=release.went_idle,
                )
                self._in_use = transport
                self._tg = tg
                self._busy = anyio.Event()  # set as a sample is admitted (_lag_ticker)
                tg.start_soon(self._lag_ticker, name="opd_stream.loop_lag")
                tg.start_soon(release.run, name="opd_stream.release_memory")
                # the compiled kernels, once per process, in the background; never waited for
                # (msgspec decodes until they are ready), and never holding the process (_jit)
                if start_kernels():  # this stream counts their CPU (cpu_s.kernels)
                    self._kernels_from = kernels_cpu()
                log.info("stream_started", **self.config.to_log_dict())
                try:
                    if self.config.probe_at_start:
                        await self.probe(eject=True)
                    yield self
                finally:
                    self._tg = None
                    tg.cancel_scope.cancel()
                    for results in list(self._runs):
                        results.close_receiver()  # handles the caller never closed
        finally:
            await release.close()
            if xtok is not None:  # the tokenizers' processes, stopped off the loop
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(xtok.close)

    def _drop_body_buffers(self) -> None:
        """The transport's buffers of big answers, kept for reuse: dropped as the stream
        idles (before it gives freed memory back)."""
        drop = getattr(self._in_use, "_drop_body_buffers", None)  # (AsyncioTransport's)
        if drop is not None:
            drop()

    def _went_busy(self) -> None:
        self._busy.set()

    async def _lag_ticker(self) -> None:
        """The event loop's lag, sampled every ``_LAG_INTERVAL_S`` while samples are in
        flight (an idle stream does not wake its host's loop)."""
        name_async_library()
        while True:
            if self._stats.in_flight == 0:
                await self._busy.wait()
                self._busy = anyio.Event()
            start = anyio.current_time()
            await anyio.sleep(_LAG_INTERVAL_S)
            self._stats.record_lag(max(0.0, anyio.current_time() - start - _LAG_INTERVAL_S))

    def run(self, samples: Iterable[Sample] | AsyncIterable[Sample]) -> Results:
        """Start scoring ``samples`` (an iterable or async iterable of :class:`Sample`).

        Returns a :class:`Results` handle; use it as ``async with stream.run(xs) as r:``
        and iterate it. Several runs may share one stream (and its connection pool). An
        item that is not a :class:`Sample` fails alone (``invalid_sample``); its
        :class:`SampleFailure` holds the object as given.
        """
        tg, parts = self._tg, self._parts
        if tg is None or parts is None:
            raise RuntimeError("OPDStream.run() called outside 'async with OPDStream(...)'")
        send, receive = anyio.create_memory_object_stream[Result](self.config.channel_capacity)
        state = RunState()
        tg.start_soon(run_pipeline, parts, samples, send, state, name="opd_stream.run")
        results = Results(receive, state, self._stats, self._runs)
        self._runs.add(results)
        return results

    async def probe(
        self,
        sample: Sample | None = None,
        *,
        tolerance: float | None = None,
        eject: bool = False,
    ) -> ProbeReport:
        """Ask every replica of every teacher the same scoring request, cold and warm, and
        report how far their logprobs are apart (:class:`ProbeReport`).

        Cold: with a fresh random ``cache_salt`` (nothing cached is reused); warm: the
        same request again under the same salt (the cold request's prefix is cached).
        A replica is named when its cold answer is more than ``tolerance`` nats from its
        teacher's median replica at some position (with two replicas: from the other
        one), or its warm answer from its cold one. Gateways are expanded to their workers
        (``gateway_discovery``). Each replica's two requests share ``probe_deadline_s``;
        a failed one is reported (``failed``), not retried; one with no answer by then has
        error ``deadline_exceeded``.

        Args:
            sample: the request to send (its tokens, its teacher prompt when it has one,
                its response positions scored); default: a fixed 64-token sequence of ids
                in ``[100, 1000)``, its last 32 positions scored. A real sample probes
                with the numbers training will see.
            tolerance: in nats; default ``probe_tolerance``.
            eject: take the named replicas (outliers, and replicas with no answer within
                ``probe_deadline_s``) out of this stream's rotation for its life (never a
                teacher's last good one). ``probe_at_start`` does this as the
                stream starts.

        Raises:
            InvalidSampleError: ``sample`` is not a valid sample.
        """
        fleet, transport = self._fleet, self._in_use
        if self._parts is None or fleet is None or transport is None:
            raise RuntimeError("OPDStream.probe() called outside 'async with OPDStream(...)'")
        if sample is None:
            tokens, r = default_probe_tokens(), PROBE_RESPONSE_LENGTH
        else:
            prepared = prepare_sample(sample, 0, teacher="probe", top_k=0)
            tokens = prepared.tokens
            if prepared.teacher_tokens is not None:
                tokens = prepared.teacher_tokens
            r = prepared.response_length
        cfg = self.config
        report = await run_probe(
            transport,
            fleet.gateways,
            replica_groups(cfg.teachers),
            tokens,
            r,
            tolerance=cfg.probe_tolerance if tolerance is None else tolerance,
            start=cfg.logprob_start,
            deadline_s=cfg.probe_deadline_s,
            max_bytes=cfg.max_response_bytes,
            secret=cfg.api_key.get_secret_value() if cfg.api_key else None,
            engines=fleet.engines,
            others=() if cfg.student_url is None else (cfg.student_url,),
        )
        log.info(
            "probe",
            max_replica_diff=report.max_replica_diff,
            max_cold_warm_diff=report.max_cold_warm_diff,
            outliers=len(report.outliers),
            failed=len(report.failed),
        )
        if not eject:
            return report
        out = set(ejectable(report))
        for replica in report.replicas:
            if replica.url in out:
                fleet.eject_for_good(replica.url)
                log.warning(
                    "replica_ejected_by_probe",
                    teacher=replica.teacher,
                    url=replica.url,
                    reason="outlier" if replica.outlier else replica.error,
                    tolerance=report.tolerance,
                    deadline_s=cfg.probe_deadline_s,
                )
        return msgspec.structs.replace(
            report,
            replicas=tuple(
                msgspec.structs.replace(r, ejected=True) if r.url in out else r
                for r in report.replicas
            ),
        )

    def stats(self) -> StreamStats:
        """A snapshot: channel depths and high-water marks, stage activity, in flight,
        retries, failures by reason, bytes received, latency and loop-lag percentiles,
        and per-endpoint load and detected capabilities."""
        if self._kernels_from is not None:
            self._stats.cpu.kernels = kernels_cpu() - self._kernels_from
        snap = self._stats.snapshot()
        if self._fleet is None:
            return snap
        return msgspec.structs.replace(
            snap, endpoints=self._fleet.endpoint_stats(), fleets=self._fleet.gateway_stats()
        )

    # one sample at a time ------------------------------------------------------------
    async def score(self, sample: Sample) -> ScoredSample | SampleFailure:
        """Score one sample; its :class:`ScoredSample`, or the :class:`SampleFailure` that
        says why not (the same result :meth:`run` would give it).

        The per-call entry point, for a host that awaits one sample per task (a rollout's
        ``reward_func``): concurrent calls, from any tasks of the stream's event loop, share
        one run of the pipeline, so they share its bounds (``max_inflight`` samples
        admitted at once, the per-endpoint limits, the byte budget) and its KL batches,
        and are counted in :meth:`stats` like a run's samples. The results come as they
        are ready (``order`` applies to :meth:`run` only); ``index`` is the call's number
        among this stream's calls.

        Cancelling the caller cancels the sample: its requests in flight are cancelled at
        once (or never sent), it is counted as failed with reason ``cancelled``, and the
        cancellation propagates to the caller.

        Raises:
            OPDStreamError: the stream closed before the sample's result was ready.
            RuntimeError: called outside ``async with OPDStream(...)``.
        """
        item = await self._call(Call(sample))
        assert not isinstance(item, TeacherRows)
        return item

    async def teacher_rows(self, sample: Sample) -> ScoreRows:
        """The teacher's answer alone for one sample's response positions: its logprob of
        each response token and, when ``top_k`` > 0, its top-k (best first), whatever the
        ``strategy``; nothing is asked of the student and no KL is computed (what verl's
        teacher manager needs).

        Like :meth:`score`: one call shares the stream's run of calls, its bounds and its
        stats (a sample counted completed or failed), and cancelling the caller cancels
        its requests.

        Returns:
            :class:`~opd_stream.wire.ScoreRows`: ``token_logprobs`` float32 ``[R]``;
            ``top_ids`` int64 / ``top_logprobs`` float32 ``[R, top_k]`` (None when
            ``top_k`` is 0). ``R = 0``: empty rows, nothing asked.

        Raises:
            OPDStreamError: the error that failed the sample (the one behind its
                ``SampleFailure``: :class:`InvalidSampleError` for an invalid sample or a
                teacher with its own tokenizer, :class:`DeadlineExceeded` after
                ``request_deadline_s``, :class:`ServerHTTPError`, ...), or the stream
                closed first.
            RuntimeError: called outside ``async with OPDStream(...)``.
        """
        call = Call(sample, teacher_only=True)
        item = await self._call(call)
        if isinstance(item, TeacherRows):
            return item.rows
        assert isinstance(item, SampleFailure)
        if call.error is not None:
            raise call.error
        error = OPDStreamError(f"{item.reason}: {item.message}")
        error.reason = item.reason
        raise error

    async def _call(self, call: Call) -> ScoredSample | SampleFailure | TeacherRows:
        """Send ``call`` into the calls' run (started by the first call) and wait for its
        outcome; a caller that stops waiting cancels its sample."""
        send = self._calls
        if send is None:
            tg, parts = self._tg, self._parts
            if tg is None or parts is None:
                raise RuntimeError("OPDStream.score() called outside 'async with OPDStream(...)'")
            send, receive = anyio.create_memory_object_stream[Call](self.config.channel_capacity)
            self._calls = send
            tg.start_soon(self._serve_calls, parts, send, receive, name="opd_stream.calls")
        self._waiting.add(call)
        try:
            await send.send(call)
            await call.done.wait()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise OPDStreamError("the stream closed before the sample was scored") from None
        finally:
            self._waiting.discard(call)
            if not call.done.is_set():  # the caller stopped waiting: its requests stop too
                call.scope.cancel()
        if call.item is None:
            assert call.error is not None
            raise call.error
        return call.item

    async def _serve_calls(
        self,
        parts: StreamParts,
        send: MemoryObjectSendStream[Call],
        receive: MemoryObjectReceiveStream[Call],
    ) -> None:
        """The run of the per-call samples, in the stream's task group, until it exits."""
        state = RunState()
        out, unused = anyio.create_memory_object_stream[Result](0)  # (calls are handed over)
        try:
            with unused:
                await run_pipeline(parts, receive, out, state, order="completed")
        finally:
            receive.close()  # a call waiting to be sent is told at once
            send.close()
            if self._calls is send:
                self._calls = None  # (after an error, the next call starts a new run)
            error = OPDStreamError(
                "the stream closed before the sample was scored"
                if state.error is None
                else f"the stream's run of calls failed: {type(state.error).__name__}"
            )
            for call in list(self._waiting):
                call.fail(error)
