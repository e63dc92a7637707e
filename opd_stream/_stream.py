"""``OPDStream``: the public entry point, and ``Results``, the handle of one run.

::

    async with OPDStream(StreamConfig.from_env()) as stream:
        async with stream.run(samples) as results:
            async for item in results:      # ScoredSample | SampleFailure, each input once
                ...

The stream owns one task group (the pipeline runs and a loop-lag ticker), one transport
(a pooled aiohttp session by default, created inside the running loop), and the per
endpoint state (concurrency limiters, detected capabilities). Leaving ``results`` early,
or cancelling the caller, cancels the run: in-flight HTTP requests are cancelled and no
task is left behind.
"""

from __future__ import annotations

import types
from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from contextlib import asynccontextmanager
from typing import Self

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream

from ._config import StreamConfig, resolve_decode_threads, resolve_kl_device
from ._errors import ConfigError
from ._jit import available, prepare
from ._logging import get_logger
from ._pipeline import Result, RunState, run_pipeline
from ._probe import PROBE_RESPONSE_LENGTH, ProbeReport, default_probe_tokens, ejectable
from ._probe_requests import run_probe
from ._router import TeacherRouter, replica_groups
from ._sample import Sample, prepare_sample
from ._scorer import SampleScorer
from ._stats import StatsRecorder, StreamStats
from ._transport import AiohttpTransport, Transport
from ._xtok import CrossTokenizers

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


def default_transport(config: StreamConfig) -> Transport:
    """The transport a stream uses when none is given, for the running backend: pooled
    aiohttp under asyncio, pooled httpx (the ``httpx`` extra) under trio.

    Raises:
        ConfigError: under trio without httpx installed.
    """
    api_key = config.api_key.get_secret_value() if config.api_key else None
    if _on_asyncio():
        return AiohttpTransport(api_key=api_key, connect_timeout_s=config.connect_timeout_s)
    try:
        from ._transport_httpx import HttpxTransport
    except ImportError:
        raise ConfigError(
            "under trio the default transport needs httpx: pip install 'opd-stream[httpx]' "
            "(or pass a transport)"
        ) from None
    return HttpxTransport(api_key=api_key, connect_timeout_s=config.connect_timeout_s)


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

    Args:
        config: the validated configuration (see :class:`StreamConfig`).
        transport: the HTTP transport; by default (see :func:`default_transport`) a pooled
            :class:`AiohttpTransport` under asyncio and a pooled ``HttpxTransport`` under
            trio (the ``httpx`` extra). Pass a ``MockTransport`` to run without sockets.
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
        self._router = TeacherRouter(config.teachers, config.teacher_key)
        # torch is loaded here, where the stream will make tensors (not by importing
        # opd_stream), and the KL device is resolved in the caller's thread: "auto" and
        # "cuda" become the caller's current CUDA device, cuda:N (see resolve_kl_device).
        import torch

        from . import _klstage  # noqa: F401  (the KL code, loaded now, not in the first batch)

        self._device = torch.device(resolve_kl_device(config))
        self._transport = transport
        self._stats = StatsRecorder()
        self._stats.kl_device = str(self._device)
        self._tg: anyio.abc.TaskGroup | None = None
        self._scorer: SampleScorer | None = None
        self._in_use: Transport | None = None
        self._decode_limiter = anyio.CapacityLimiter(resolve_decode_threads(config))
        # open run handles: a dropped one is closed at the stream's exit
        self._runs: set[Results] = set()

    def __repr__(self) -> str:
        return f"OPDStream(teachers={sorted(self.config.teachers)}, top_k={self.config.top_k})"

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Self]:
        # teachers with their own tokenizer: loaded once, off the loop (a ConfigError here
        # names the setting and the file)
        xtok = None
        if self.config.teacher_tokenizers:
            xtok = await anyio.to_thread.run_sync(CrossTokenizers.load, self.config)
        transport = self._transport or default_transport(self.config)
        async with transport, anyio.create_task_group() as tg:
            self._scorer = SampleScorer(
                self.config,
                transport,
                self._stats,
                threads=self._decode_limiter,
                xtok=xtok,
            )
            self._kl_limiter = anyio.CapacityLimiter(1)
            self._in_use = transport
            self._tg = tg
            tg.start_soon(self._lag_ticker, name="opd_stream.loop_lag")
            tg.start_soon(self._compile_kernels, name="opd_stream.kernels")
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

    async def _compile_kernels(self) -> None:
        """Compile the kernels (``_jit.prepare``; numba's disk cache makes it ~0.4 s of CPU
        after the first time) in a decode thread as the stream starts, so that answers
        small enough to be decoded on the loop, and small samples' top-k rows, take them
        too; without this only the first decode in a thread would. Left at the stream's
        exit, the thread finishes the compile (once per process), as a decode thread
        finishes its parse."""
        if available():
            return
        await anyio.to_thread.run_sync(
            prepare, limiter=self._decode_limiter, abandon_on_cancel=True
        )

    async def _lag_ticker(self) -> None:
        while True:
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
        tg, scorer = self._tg, self._scorer
        if tg is None or scorer is None:
            raise RuntimeError("OPDStream.run() called outside 'async with OPDStream(...)'")
        send, receive = anyio.create_memory_object_stream[Result](self.config.channel_capacity)
        state = RunState()
        args = (self.config, scorer, self._router, self._stats, self._device, self._kl_limiter)
        tg.start_soon(run_pipeline, args, samples, send, state, name="opd_stream.run")
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
        one), or its warm answer from its cold one. Routers are expanded to their workers
        (``router_discovery``). Each replica's two requests share ``request_deadline_s``;
        a failed one is reported (``failed``), not retried.

        Args:
            sample: the request to send (its tokens, its teacher prompt when it has one,
                its response positions scored); default: a fixed 64-token sequence of ids
                in ``[100, 1000)``, its last 32 positions scored. A real sample probes
                with the numbers training will see.
            tolerance: in nats; default ``probe_tolerance``.
            eject: take the named replicas out of this stream's rotation for its life
                (never a teacher's last good one). ``probe_at_start`` does this as the
                stream starts.

        Raises:
            InvalidSampleError: ``sample`` is not a valid sample.
        """
        scorer, transport = self._scorer, self._in_use
        if scorer is None or transport is None:
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
            scorer.fleets,
            replica_groups(cfg.teachers),
            tokens,
            r,
            tolerance=cfg.probe_tolerance if tolerance is None else tolerance,
            start=cfg.logprob_start,
            deadline_s=cfg.request_deadline_s,
            max_bytes=cfg.max_response_bytes,
            secret=cfg.api_key.get_secret_value() if cfg.api_key else None,
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
        for url in out:
            scorer.eject_for_good(url)
            log.warning("replica_ejected_by_probe", url=url, tolerance=report.tolerance)
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
        snap = self._stats.snapshot()
        if self._scorer is None:
            return snap
        return msgspec.structs.replace(
            snap,
            endpoints=self._scorer.endpoints.snapshot(),
            fleets=self._scorer.fleets.snapshot(),
        )
