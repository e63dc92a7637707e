"""Counters, gauges and bounded samples behind ``OPDStream.stats()``.

Everything here is plain synchronous bookkeeping, updated from the event loop thread
only; ``snapshot()`` copies it into a :class:`StreamStats` value. Memory is bounded: the
latency and loop-lag samples are ring buffers.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import ClassVar, Final, Literal, Protocol, get_args

import msgspec
import numpy as np

from ._deprecated import DictRead
from .fleet._records import EndpointStats, FleetState
from .wire._codec import PARSERS, Parser

__all__ = (
    "CHANNELS",
    "CPU_STEPS",
    "STAGES",
    "ChannelName",
    "ChannelStats",
    "CpuSeconds",
    "KLStageStats",
    "LoopClock",
    "ParserCounts",
    "PipelineChannels",
    "StageActivity",
    "StageName",
    "StatsRecorder",
    "Step",
    "StreamStats",
)

_RING = 4096


class ChannelStats(msgspec.Struct, frozen=True, kw_only=True):
    """One bounded channel between stages: current depth, high-water mark, capacity."""

    depth: int
    high_water: int
    capacity: int


#: The pipeline's bounded channels: the fields of :class:`PipelineChannels`.
ChannelName = Literal["intake", "kl", "emit", "output"]
CHANNELS: Final[tuple[ChannelName, ...]] = get_args(ChannelName)

#: The stages whose running tasks are counted: the fields of :class:`StageActivity`.
StageName = Literal["teacher_fetch", "student_fetch", "decode", "kl"]
STAGES: Final[tuple[StageName, ...]] = get_args(StageName)


class PipelineChannels(DictRead, msgspec.Struct, frozen=True, kw_only=True):
    """The pipeline's bounded channels (``stats().channels``), one :class:`ChannelStats`
    each; their capacity is ``channel_capacity``. (Reading it like a ``dict``, as it was
    before 1.0, still works for one release, with a ``DeprecationWarning``.)

    Attributes:
        intake: admitted samples waiting for a fetch worker.
        kl: fetched samples waiting for the KL stage.
        emit: scored samples and failures waiting to be put in order and handed on.
        output: results waiting for the caller to take them.
    """

    intake: ChannelStats
    kl: ChannelStats
    emit: ChannelStats
    output: ChannelStats


class StageActivity(DictRead, msgspec.Struct, frozen=True, kw_only=True):
    """Tasks of each stage running now (``stats().stages``). (Reading it like a ``dict``,
    as it was before 1.0, still works for one release, with a ``DeprecationWarning``.)

    Attributes:
        teacher_fetch: teacher requests in flight (retries and hedges included).
        student_fetch: student requests in flight (only without the student's own top-k).
        decode: answers being decoded (on the event loop or in a decode thread).
        kl: KL batches being scored.
    """

    teacher_fetch: int = 0
    student_fetch: int = 0
    decode: int = 0
    kl: int = 0


class ParserCounts(DictRead, msgspec.Struct, frozen=True, kw_only=True):
    """A count per answer parser (``stats().decoded``: answers, ``stats().decoded_bytes``:
    their bytes). (Reading it like a ``dict``, as it was before 1.0, still works for one
    release, with a ``DeprecationWarning``; so does the old key ``"jit"``, for
    ``scanner``.)

    Attributes:
        scanner: by the compiled scanner, once it is ready.
        msgspec: by msgspec: until the scanner is ready, where numba cannot run, and every
            answer the scanner handed on.
    """

    old_keys: ClassVar[dict[str, str]] = {"jit": "scanner"}

    scanner: int = 0
    msgspec: int = 0


class KLStageStats(msgspec.Struct, frozen=True, kw_only=True):
    """The KL stage, apart from the network: where it runs and what its batches cost.

    Attributes:
        device: the torch device the KL math runs on (``"cpu"``, ``"cuda:0"``, ...); before
            the stream has loaded (:meth:`OPDStream.load`), ``kl_device`` as configured.
        batches: KL batches scored.
        samples: samples in those batches.
        seconds: total time inside the KL function (padding, transfer to the device,
            the math, and the copy of the results back to the CPU), summed over batches.
        batch_p50_s, batch_p99_s: per-batch time percentiles (recent batches; None before
            the first batch).
    """

    device: str
    batches: int
    samples: int
    seconds: float
    batch_p50_s: float | None
    batch_p99_s: float | None


class StreamStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of a stream's state (see ``OPDStream.stats``)."""

    channels: PipelineChannels
    """Each bounded channel between the stages: depth now, high-water mark, capacity."""
    stages: StageActivity
    """Tasks of each stage running now."""
    in_flight: int
    admitted: int
    completed: int
    failed: int
    retries: int
    failures: dict[str, int]
    bytes_received: int
    requests: int
    latency_p50_s: float | None
    latency_p99_s: float | None
    loop_lag_p99_s: float | None
    loop_lag_max_s: float
    endpoints: dict[str, EndpointStats]
    kl: KLStageStats
    cpu_s: CpuSeconds
    """CPU seconds of each step, measured in the thread that ran it: ``prepare`` (sample
    checks, top-k rows into arrays), ``build`` (request payloads), ``decode_loop``
    (answers decoded on the event loop), ``decode_threads`` (answers parsed in decode
    threads), ``kl`` (KL batches), ``align`` (responses re-tokenised for a teacher with its
    own tokenizer), ``loop`` (the event loop thread's CPU while the stream is entered,
    beyond the steps above that ran on it: HTTP, i.e. the client's socket reads and writes
    and the copy of each answer into one buffer, the pipeline's tasks and channels, the
    loop's own scheduling; and whatever else the host runs on that loop meanwhile),
    ``setup`` (the stream's upkeep in worker threads: at its entry torch, the KL code and
    the HTTP client imported, the first time in a process; freed heap memory given back
    once it idles and as it closes, ``release_memory_after_s``), ``kernels`` (the compiled
    scanner made ready, for the stream that started it: its load from numba's cache in a
    background thread, and the CPU of the process that compiled it when the cache lacked
    it). What the process spent beyond their sum is the worker threads' own hand-offs (and
    anything else the host runs in its threads)."""
    decoded: ParserCounts = msgspec.field(default_factory=ParserCounts)
    """Scoring answers decoded by each parser: ``scanner`` (the compiled scanner, once it
    is ready), ``msgspec`` (until then, where numba cannot run, and every answer the
    scanner handed on)."""
    decoded_bytes: ParserCounts = msgspec.field(default_factory=ParserCounts)
    """The bytes of those answers, by parser (the fields of ``decoded``): what each parser
    read. A short run in a fresh process decodes with msgspec until the scanner is ready."""
    fleets: dict[str, FleetState] = msgspec.field(default_factory=dict)
    """Each configured server URL asked so far: an sglang-router (and its workers, used
    directly when reachable from here) or a server (``gateway_discovery``)."""


class CpuSeconds(DictRead, msgspec.Struct, kw_only=True):
    """CPU seconds of each synchronous step so far (:attr:`StreamStats.cpu_s` is a copy,
    whose fields are documented there). (Reading it like a ``dict``, as ``cpu_s`` was
    before 1.0, still works for one release, with a ``DeprecationWarning``.)

    One field per step, so a misspelt step is an ``AttributeError`` (and a mypy error),
    never a new key."""

    prepare: float = 0.0
    build: float = 0.0
    decode_loop: float = 0.0
    decode_threads: float = 0.0
    kl: float = 0.0
    align: float = 0.0
    loop: float = 0.0
    setup: float = 0.0
    kernels: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Step -> seconds, in field order (the shape of :attr:`StreamStats.cpu_s`)."""
        return {step: float(getattr(self, step)) for step in CPU_STEPS}


#: The steps of :attr:`StreamStats.cpu_s`: the fields of :class:`CpuSeconds`.
CPU_STEPS: Final[tuple[str, ...]] = CpuSeconds.__struct_fields__

#: The steps measured in the thread that ran them, on the loop or in a worker thread
#: (:meth:`StatsRecorder.spent`); ``loop``, ``setup`` and ``kernels`` are measured apart.
Step = Literal["prepare", "build", "decode_loop", "decode_threads", "kl", "align"]


class LoopClock:
    """The CPU clock of the thread that runs the stream's event loop, read from any thread
    (``time.pthread_getcpuclockid``): started as the stream is entered, stopped as it is
    left; :meth:`seconds` is the CPU that thread spent in between."""

    def __init__(self) -> None:
        self.ident: int | None = None  # the loop's thread while it runs
        self._clock: int | None = None
        self._start = 0.0
        self._spent = 0.0

    def start(self) -> None:
        """In the event loop's thread, as the stream is entered."""
        self.ident = threading.get_ident()
        try:
            self._clock = time.pthread_getcpuclockid(self.ident)
            self._start = time.clock_gettime(self._clock)
        except (AttributeError, OSError):  # no per-thread clock here: the loop stays 0
            self._clock = None

    def stop(self) -> None:
        """In the event loop's thread, as the stream is left."""
        self._spent = self.seconds()
        self._clock = None
        self.ident = None

    def seconds(self) -> float:
        clock = self._clock
        if clock is None:
            return self._spent
        try:
            return self._spent + time.clock_gettime(clock) - self._start
        except OSError:  # (the thread is gone)
            return self._spent


class CountsInFlight(Protocol):
    """A run of the pipeline: it counts its own samples in flight (admitted, result not
    yet handed over)."""

    in_flight: int


class StatsRecorder:
    """Mutable bookkeeping for one stream.

    Samples in flight are counted in one place, by each run (``CountsInFlight``); a run
    is registered in :attr:`runs` while it goes on, and :attr:`in_flight` is their sum (a
    cancelled run's samples, which never come out, leave with it).
    """

    def __init__(self) -> None:
        self.channel_capacity: dict[ChannelName, int] = dict.fromkeys(CHANNELS, 0)
        self._depth: Counter[ChannelName] = Counter()
        self._high: Counter[ChannelName] = Counter()
        self.stage_active: Counter[StageName] = Counter()
        self.runs: set[CountsInFlight] = set()
        self.admitted = 0
        self.completed = 0
        self.failed = 0
        self.retries = 0
        self.requests = 0
        self.bytes_received = 0
        self.failures: Counter[str] = Counter()
        self._latency: deque[float] = deque(maxlen=_RING)
        self._lag: deque[float] = deque(maxlen=_RING)
        self.lag_max = 0.0
        self.kl_device = "cpu"
        self.kl_batches = 0
        self.kl_samples = 0
        self.kl_seconds = 0.0
        self._kl_batch: deque[float] = deque(maxlen=_RING)
        self.cpu = CpuSeconds()
        self.loop_clock = LoopClock()
        self._on_loop = 0.0  # of the steps in ``cpu``, what ran on the loop's thread
        self.decoded: dict[Parser, int] = dict.fromkeys(PARSERS, 0)
        self.decoded_bytes: dict[Parser, int] = dict.fromkeys(PARSERS, 0)

    def spent(self, step: Step, seconds: float) -> None:
        """Add ``seconds`` of CPU, measured in the calling thread, to ``step`` (called in the
        thread that ran it: on the loop's thread, they are taken out of ``loop``)."""
        setattr(self.cpu, step, getattr(self.cpu, step) + seconds)
        if threading.get_ident() == self.loop_clock.ident:
            self._on_loop += seconds

    def spent_releasing(self, seconds: float) -> None:
        """CPU seconds a worker thread took to give freed heap memory back (``setup``)."""
        self.cpu.setup += seconds

    def record_decode(self, parser: Parser, size: int) -> None:
        """An answer of ``size`` bytes decoded by ``parser``."""
        self.decoded[parser] += 1
        self.decoded_bytes[parser] += size

    def cpu_seconds(self) -> CpuSeconds:
        """A copy of ``cpu`` with ``loop`` read now: the loop thread's CPU beyond the steps
        that ran on it."""
        loop = max(0.0, self.loop_clock.seconds() - self._on_loop)
        return msgspec.structs.replace(self.cpu, loop=loop)

    @property
    def in_flight(self) -> int:
        """Samples admitted by the runs going on whose result is not handed over yet."""
        return sum(run.in_flight for run in self.runs)

    # channels ---------------------------------------------------------------------
    def channel(self, name: ChannelName, capacity: int) -> None:
        self.channel_capacity[name] = capacity

    def put(self, name: ChannelName) -> None:
        self._depth[name] += 1
        if self._depth[name] > self._high[name]:
            self._high[name] = self._depth[name]

    def take(self, name: ChannelName) -> None:
        self._depth[name] -= 1

    def record_latency(self, seconds: float) -> None:
        self._latency.append(seconds)

    def record_lag(self, seconds: float) -> None:
        self._lag.append(seconds)
        self.lag_max = max(self.lag_max, seconds)

    def record_kl_batch(self, samples: int, seconds: float) -> None:
        self.kl_batches += 1
        self.kl_samples += samples
        self.kl_seconds += seconds
        self._kl_batch.append(seconds)

    def record_failure(self, reason: str) -> None:
        self.failed += 1
        self.failures[reason] += 1

    def snapshot(self) -> StreamStats:
        lat = np.fromiter(self._latency, dtype=np.float64)
        lag = np.fromiter(self._lag, dtype=np.float64)
        klb = np.fromiter(self._kl_batch, dtype=np.float64)
        return StreamStats(
            channels=PipelineChannels(
                **{
                    name: ChannelStats(
                        depth=self._depth[name], high_water=self._high[name], capacity=cap
                    )
                    for name, cap in self.channel_capacity.items()
                }
            ),
            stages=StageActivity(**{name: self.stage_active[name] for name in STAGES}),
            in_flight=self.in_flight,
            admitted=self.admitted,
            completed=self.completed,
            failed=self.failed,
            retries=self.retries,
            failures=dict(self.failures),
            bytes_received=self.bytes_received,
            requests=self.requests,
            latency_p50_s=float(np.percentile(lat, 50)) if lat.size else None,
            latency_p99_s=float(np.percentile(lat, 99)) if lat.size else None,
            loop_lag_p99_s=float(np.percentile(lag, 99)) if lag.size else None,
            loop_lag_max_s=self.lag_max,
            endpoints={},  # filled by the stream from its Endpoints
            kl=KLStageStats(
                device=self.kl_device,
                batches=self.kl_batches,
                samples=self.kl_samples,
                seconds=self.kl_seconds,
                batch_p50_s=float(np.percentile(klb, 50)) if klb.size else None,
                batch_p99_s=float(np.percentile(klb, 99)) if klb.size else None,
            ),
            cpu_s=self.cpu_seconds(),
            decoded=ParserCounts(**self.decoded),
            decoded_bytes=ParserCounts(**self.decoded_bytes),
        )
