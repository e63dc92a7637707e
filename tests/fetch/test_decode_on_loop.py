"""Where an answer is parsed (``fetch._threads``): below ``offload_bytes`` on the event loop,
from ``SLICED_FROM`` on the scanner's read a slice at a time with the loop's turn between two
slices, one answer at a time, a turn between two answers; from ``offload_bytes`` on in a
decode thread; what the loop would do whole (a body's build, a parse by msgspec) from a
quarter of it."""

from __future__ import annotations

from collections.abc import Callable, Generator
from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest
from support.config import stream_config

import opd_stream.scanner._loader as jit
from opd_stream import OPDStream, Sample, ScoredSample
from opd_stream.fetch import _attempts, _threads
from opd_stream.fetch._threads import (
    SLICED_FROM,
    WHOLE,
    build_in_thread,
    decode_in_thread,
    read_in_slices,
)
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.wire._payloads import payload_size_hint
from opd_stream.wire._request import ScoreRequest

T = "http://teacher:1"
_cfg = partial(stream_config, T, top_k=4, strategy="only-student")


@pytest.fixture(autouse=True, scope="module")
def _compiled() -> None:
    assert jit.prepare(), "numba could not compile the kernels"


def _samples(n: int) -> list[Sample]:
    """Samples with their student top-k: the teacher's answers hold per-position id rows
    (a rows list, where the scan pauses between rows)."""
    rng = np.random.default_rng(5)
    out = []
    for _ in range(n):
        ids = np.stack([rng.choice(5000, 4, replace=False) for _ in range(40)])
        lps = np.log(rng.dirichlet(np.ones(4), 40)).astype(np.float32)
        top = (ids.astype(np.int64), lps)
        out.append(Sample(rng.integers(0, 5000, 60).tolist(), 40, student_top_logprobs=top))
    return out


class _Reads:
    """A spy on the fetch stage's sliced reads: how many ran, how many at once at most, how
    often they paused, and how many were closed; ``spans``: each read's first and last
    step, as ``clock()`` read them (default: none)."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        pause_event_after: int = 0,
        clock: Callable[[], int] = lambda: 0,
    ) -> None:
        self.started = self.closed = self.pauses = self.active = self.peak = 0
        self.spans: list[tuple[int, int]] = []
        self.paused = anyio.Event()
        self._after = pause_event_after
        real = _attempts.decode_in_slices

        def spy(*args: Any, **kwargs: Any) -> Generator[None, None, Any]:
            inner = real(*args, **kwargs)
            self.started += 1
            self.active += 1
            self.peak = max(self.peak, self.active)
            first = clock()
            try:
                while True:
                    try:
                        next(inner)
                    except StopIteration as done:
                        self.spans.append((first, clock()))
                        return done.value
                    self.pauses += 1
                    if self._after and self.pauses >= self._after:
                        self.paused.set()
                    yield
            finally:
                inner.close()
                self.active -= 1
                self.closed += 1

        monkeypatch.setattr(_attempts, "decode_in_slices", spy)


def test_an_answer_the_scanner_reads_in_slices_stays_on_the_loop_below_offload_bytes() -> None:
    limit = 4 << 20
    assert not decode_in_thread(limit - 1, limit, sliced=True)
    assert decode_in_thread(limit, limit, sliced=True)
    # what the loop does whole: from a quarter of it
    assert not decode_in_thread(limit // WHOLE - 1, limit, sliced=False)
    assert decode_in_thread(limit // WHOLE, limit, sliced=False)
    assert decode_in_thread(0, 0, sliced=True) and decode_in_thread(0, 0, sliced=False)


def test_the_loop_reads_an_answer_in_slices_from_sliced_from_on() -> None:
    assert not read_in_slices(SLICED_FROM - 1, sliced=True)  # whole, as it arrives
    assert read_in_slices(SLICED_FROM, sliced=True)
    assert not read_in_slices(SLICED_FROM * 100, sliced=False)  # msgspec: whole


def test_a_body_is_built_in_a_thread_from_a_quarter_of_offload_bytes() -> None:
    ids = np.arange(2000, dtype=np.int64).reshape(200, 10)
    req = ScoreRequest(tokens=np.arange(300, dtype=np.int64), response_length=200, ids=ids)
    hint = payload_size_hint(req)
    assert build_in_thread(req, WHOLE * hint)
    assert not build_in_thread(req, WHOLE * (hint + 1))


async def test_answers_are_read_on_the_loop_a_slice_at_a_time_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    samples = _samples(6)
    # the same samples with every answer parsed in a decode thread
    threaded = _cfg(offload_bytes=0, decode_threads=2)
    async with OPDStream(
        threaded, transport=mock_transport({T: InProcessSGLang("teacher", 1)})
    ) as s:
        async with s.run(samples) as results:
            want = sorted([r async for r in results], key=lambda r: r.index)
        assert s.stats().cpu_s.decode_loop == 0
    monkeypatch.setattr(_attempts, "SLICE_BYTES", 64)
    monkeypatch.setattr(_threads, "SLICED_FROM", 0)  # (answers of a few KB)
    reads = _Reads(monkeypatch)
    async with OPDStream(_cfg(), transport=mock_transport({T: InProcessSGLang("teacher", 1)})) as s:
        async with s.run(samples) as results:
            got = sorted([r async for r in results], key=lambda r: r.index)
        cpu = s.stats().cpu_s
    assert reads.started == len(samples) == reads.closed
    assert reads.pauses >= 10 * len(samples)  # answers of a few KB, 64 bytes a slice
    assert reads.peak == 1  # one answer at a time
    assert cpu.decode_threads == 0 and cpu.decode_loop > 0
    for a, b in zip(want, got, strict=True):
        assert isinstance(a, ScoredSample) and isinstance(b, ScoredSample)
        assert a.reverse_kl is not None and b.reverse_kl is not None
        assert a.reverse_kl.tolist() == b.reverse_kl.tolist()
        assert a.teacher_logprobs.tolist() == b.teacher_logprobs.tolist()


# asyncio runs the ready tasks of a turn in order, so a task that counts turns sees each;
# trio runs them in a random order, where a count can miss the turn between two reads
@pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"debug": True}), id="asyncio")]
)
async def test_answers_that_arrive_together_are_read_a_turn_of_the_loop_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_attempts, "SLICE_BYTES", 1 << 30)  # each answer in one slice
    monkeypatch.setattr(_threads, "SLICED_FROM", 0)
    turns = 0
    reads = _Reads(monkeypatch, clock=lambda: turns)
    async with OPDStream(_cfg(), transport=mock_transport({T: InProcessSGLang("teacher", 1)})) as s:
        async with anyio.create_task_group() as tg:

            async def tick() -> None:  # counts the loop's turns
                nonlocal turns
                while True:
                    turns += 1
                    await anyio.lowlevel.checkpoint()

            tg.start_soon(tick)
            async with s.run(_samples(8)) as results:
                got = [r async for r in results]
            tg.cancel_scope.cancel()
    assert len(got) == 8 and all(isinstance(r, ScoredSample) for r in got)
    assert reads.pauses == 0 and len(reads.spans) == 8
    # the next read starts a turn (at least) after the last one ended, never in the same
    for (_, end), (start, _) in zip(reads.spans, reads.spans[1:], strict=False):
        assert start > end


async def test_a_cancelled_caller_stops_a_read_between_two_slices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_attempts, "SLICE_BYTES", 1)
    monkeypatch.setattr(_threads, "SLICED_FROM", 0)
    reads = _Reads(monkeypatch, pause_event_after=5)
    got: list[Any] = []
    async with OPDStream(_cfg(), transport=mock_transport({T: InProcessSGLang("teacher", 1)})) as s:
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                async with s.run(_samples(4)) as results:
                    async for r in results:
                        got.append(r)

            tg.start_soon(consume)
            await reads.paused.wait()  # a read is between two slices
            tg.cancel_scope.cancel()
    assert reads.started >= 1
    assert reads.closed == reads.started and reads.active == 0
    assert len(got) < 4
