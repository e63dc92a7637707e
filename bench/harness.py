"""Measurement plumbing shared by the scenarios: mock servers as subprocesses, client CPU,
RSS, event-loop lag, running ``opd_stream`` and the baseline, and checking they agree."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
from collections.abc import AsyncIterable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample, StreamConfig
from opd_stream.testing.mock_sglang import MockOptions, MockProcess

from .baseline import BaselineOutcome

__all__ = (
    "ClientMeter",
    "LagTicker",
    "Measurement",
    "OpdOutcome",
    "compare",
    "mocks",
    "run_opd",
)


@contextlib.contextmanager
def mocks(*specs: tuple[str, int, MockOptions | None]) -> Iterator[list[MockProcess]]:
    """Start mock SGLang servers as subprocesses (so their CPU is not the client's)."""
    procs = [MockProcess(role, seed, options=opts) for role, seed, opts in specs]  # type: ignore[arg-type]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.kill()


class ClientMeter:
    """Client CPU (this process, all threads, plus its non-mock child processes; not the
    meter's own sampling thread), wall time and peak RSS (sampled every 20 ms) over a
    ``with`` block."""

    def __init__(self, exclude_pids: Iterable[int] = ()) -> None:
        self._me = psutil.Process()
        self._exclude = set(exclude_pids)
        self.cpu_s = 0.0
        self.wall_s = 0.0
        self.peak_rss = 0
        self.rss_start = 0
        self._own_cpu = 0.0
        self._kids: list[psutil.Process] = []
        self._kids_at = -1e9
        self._stop = threading.Event()

    def _children_cpu(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for ch in self._me.children(recursive=True):
            if ch.pid in self._exclude:
                continue
            with contextlib.suppress(psutil.Error):
                t = ch.cpu_times()
                out[ch.pid] = t.user + t.system
        return out

    def _rss(self) -> int:
        # Listing children walks all of /proc (milliseconds, with the GIL held, which the
        # measured event loop would feel as lag): the list is refreshed once a second.
        now = time.monotonic()
        if now - self._kids_at >= 1.0:
            self._kids_at = now
            self._kids = [
                ch for ch in self._me.children(recursive=True) if ch.pid not in self._exclude
            ]
        total = self._me.memory_info().rss
        for ch in self._kids:
            with contextlib.suppress(psutil.Error):
                total += ch.memory_info().rss
        return total

    def _sample(self) -> None:
        # the sampler's own CPU (reading /proc) is not the client's: it is subtracted
        start = time.thread_time()
        while not self._stop.wait(0.02):
            self.peak_rss = max(self.peak_rss, self._rss())
        self._own_cpu = time.thread_time() - start

    def __enter__(self) -> ClientMeter:
        gc.collect()
        self.rss_start = self.peak_rss = self._rss()
        self._kids0 = self._children_cpu()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._wall0
        cpu = time.process_time() - self._cpu0
        kids = self._children_cpu()
        cpu += sum(v - self._kids0.get(pid, 0.0) for pid, v in kids.items())
        self._stop.set()
        self._thread.join()
        self.cpu_s = max(0.0, cpu - self._own_cpu)
        self.peak_rss = max(self.peak_rss, self._rss())


class LagTicker:
    """Event-loop lag: a task in the measured loop sleeps 1 ms and records how late it woke."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval)
            self.lags.append(max(0.0, loop.time() - t - self.interval))

    async def __aenter__(self) -> LagTicker:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def summary(self) -> dict[str, float | None]:
        if not self.lags:
            return {"lag_p99_ms": None, "lag_max_ms": None}
        a = np.asarray(self.lags) * 1000
        return {"lag_p99_ms": float(np.percentile(a, 99)), "lag_max_ms": float(a.max())}


@dataclass
class OpdOutcome:
    results: dict[int, ScoredSample] = field(default_factory=dict)
    failures: list[SampleFailure] = field(default_factory=list)
    done_at: dict[int, float] = field(default_factory=dict)
    stats: Any = None


async def run_opd(
    config: StreamConfig,
    samples: Iterable[Sample] | AsyncIterable[Sample],
    *,
    keep: bool = True,
    on_result: Any = None,
) -> OpdOutcome:
    """Score ``samples`` with one :class:`OPDStream`; record when each result arrived."""
    out = OpdOutcome()
    async with OPDStream(config) as stream:
        async with stream.run(samples) as results:
            async for item in results:
                now = time.perf_counter()
                if isinstance(item, ScoredSample):
                    out.done_at[item.index] = now
                    if keep:
                        out.results[item.index] = item
                else:
                    out.failures.append(item)
                if on_result is not None:
                    on_result(item)
        out.stats = stream.stats()
    return out


def kl_stage_summary(stats: Any) -> dict[str, Any]:
    """The KL stage's device and cost per batch, from ``OPDStream.stats().kl``."""
    kl = stats.kl

    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1000

    return {
        "device": kl.device,
        "batches": kl.batches,
        "samples_per_batch": kl.samples / kl.batches if kl.batches else None,
        "total_s": kl.seconds,
        "ms_per_batch_p50": ms(kl.batch_p50_s),
        "ms_per_batch_p99": ms(kl.batch_p99_s),
    }


def compare(opd: OpdOutcome, base: BaselineOutcome, tol: float = 1e-5) -> dict[str, Any]:
    """Max |difference| of teacher logprobs and reverse KL over the samples both finished."""
    worst_t = worst_k = 0.0
    n = 0
    for i, b in base.results.items():
        o = opd.results.get(i)
        if o is None:
            continue
        n += 1
        t = np.asarray(b.teacher_logprobs, dtype=np.float64)
        got = o.teacher_logprobs.numpy().astype(np.float64)
        fin = np.isfinite(t)
        worst_t = max(worst_t, float(np.max(np.abs(got[fin] - t[fin]), initial=0.0)))
        if b.reverse_kl is not None and o.reverse_kl is not None:
            k = np.asarray(b.reverse_kl, dtype=np.float64)
            worst_k = max(worst_k, float(np.max(np.abs(o.reverse_kl.numpy() - k), initial=0.0)))
    ok = n > 0 and worst_t <= tol and worst_k <= tol
    return {
        "compared": n,
        "max_abs_diff_teacher_lp": worst_t,
        "max_abs_diff_reverse_kl": worst_k,
        "equal_within_1e-5": ok,
    }


@dataclass
class Measurement:
    """The per-run numbers every scenario reports."""

    name: str
    samples: int
    response_tokens: int
    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    bytes_received: int
    latencies_s: Sequence[float] = ()
    lag: dict[str, float | None] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def metered(
        cls,
        name: str,
        meter: ClientMeter,
        samples: int,
        response_tokens: int,
        bytes_received: int,
        latencies_s: Sequence[float] = (),
        lag: dict[str, float | None] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Measurement:
        """A run's numbers, with wall, CPU and peak RSS read from its :class:`ClientMeter`."""
        return cls(
            name,
            samples,
            response_tokens,
            meter.wall_s,
            meter.cpu_s,
            meter.peak_rss / 2**20,
            bytes_received,
            latencies_s,
            lag or {},
            extra or {},
        )

    def as_dict(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies_s, dtype=np.float64)
        toks = max(self.response_tokens, 1)
        return {
            "name": self.name,
            "samples": self.samples,
            "response_tokens": self.response_tokens,
            "wall_s": self.wall_s,
            "samples_per_s": self.samples / self.wall_s if self.wall_s else None,
            "tokens_per_s": self.response_tokens / self.wall_s if self.wall_s else None,
            "client_cpu_s": self.cpu_s,
            "cpu_s_per_1m_tokens": self.cpu_s / toks * 1e6,
            "bytes_per_token": self.bytes_received / toks,
            "peak_rss_mb": self.peak_rss_mb,
            "latency_p50_s": float(np.percentile(lat, 50)) if lat.size else None,
            "latency_p99_s": float(np.percentile(lat, 99)) if lat.size else None,
            **self.lag,
            **self.extra,
        }


def pid_list(procs: Sequence[MockProcess]) -> list[int]:
    return [p.proc.pid for p in procs if p.proc is not None]


def cpu_count() -> int:
    return os.cpu_count() or 1
