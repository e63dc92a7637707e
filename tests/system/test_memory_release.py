"""Freed heap memory goes back to the operating system once a stream idles and as it
closes, never between the samples of a busy stream (``release_memory_after_s``): pages given
back cost a fault each when the next samples touch them again."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import anyio
import msgspec
import numpy as np
import pytest
from support.config import stream_config

from opd_stream import AsyncioTransport, OPDStream, Sample, ScoredSample, _memory
from opd_stream._memory import IdleRelease
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.testing.mock_sglang import serve_mock

T = "http://teacher:1"
_cfg = partial(stream_config, T)


@pytest.fixture
def releases(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The calls of ``release_freed_memory`` (counted, not made)."""
    calls: list[int] = []
    monkeypatch.setattr(_memory, "release_freed_memory", lambda: calls.append(1))
    return calls


class _Gate:
    """A stand-in for ``anyio.sleep``: each sleep waits until the test opens it."""

    def __init__(self) -> None:
        self.sleeping = 0  # sleeps begun
        self._open = anyio.Event()

    async def __call__(self, seconds: float) -> None:
        self.sleeping += 1
        await self._open.wait()
        self._open = anyio.Event()

    def open(self) -> None:
        self._open.set()


async def _until(cond: Callable[[], bool]) -> None:
    with anyio.fail_after(30):
        while not cond():  # noqa: ASYNC110 (a state of the code under test, not an event)
            await anyio.sleep(0.001)


async def _went_idle(keeper: IdleRelease, gate: _Gate, sleeps: int) -> None:
    """``keeper`` told its stream went idle; returns once its ``sleeps``-th interval began."""
    keeper.went_idle()
    await _until(lambda: gate.sleeping == sleeps)


async def _interval_ends_in_a_release(gate: _Gate, releases: list[int]) -> None:
    gate.open()
    await _until(lambda: bool(releases))


def _keeper(in_flight: list[int], spent: list[float]) -> tuple[IdleRelease, _Gate]:
    gate = _Gate()
    keeper = IdleRelease(5.0, lambda: in_flight[0], spent.append, sleep=gate)
    return keeper, gate


async def test_memory_goes_back_once_nothing_has_been_in_flight_for_the_interval(
    releases: list[int],
) -> None:
    spent: list[float] = []
    keeper, gate = _keeper([0], spent)
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        await _went_idle(keeper, gate, 1)
        assert releases == []  # not before the interval has passed
        gate.open()
        await _until(lambda: bool(spent))  # its CPU, for stats().cpu_s.setup
        assert releases == [1] and spent[0] >= 0.0
        tg.cancel_scope.cancel()
    assert releases == [1]


async def test_a_sample_in_flight_at_the_intervals_end_keeps_the_memory(
    releases: list[int],
) -> None:
    in_flight = [0]
    keeper, gate = _keeper(in_flight, [])
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        await _went_idle(keeper, gate, 1)
        in_flight[0] = 1  # a sample admitted meanwhile, still in flight
        gate.open()
        await _until(lambda: gate.sleeping == 1 and keeper.waiting_for_idle)
        assert releases == []
        in_flight[0] = 0
        await _went_idle(keeper, gate, 2)  # it finished: the interval starts again
        assert releases == []
        await _interval_ends_in_a_release(gate, releases)
        tg.cancel_scope.cancel()
    assert releases == [1]


async def test_a_run_that_went_idle_again_during_the_interval_starts_it_again(
    releases: list[int],
) -> None:
    keeper, gate = _keeper([0], [])
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        await _went_idle(keeper, gate, 1)
        keeper.went_idle()  # a sample came and went within the interval
        gate.open()
        await _until(lambda: gate.sleeping == 2)  # a whole interval again
        assert releases == []
        await _interval_ends_in_a_release(gate, releases)
        tg.cancel_scope.cancel()
    assert releases == [1]


async def test_close_gives_back_what_was_freed_since_the_last_release(
    releases: list[int],
) -> None:
    keeper, _ = _keeper([0], [])
    await keeper.close()
    assert releases == []  # nothing ran: nothing to give back
    keeper.went_idle()
    await keeper.close()
    assert releases == [1]
    await keeper.close()
    assert releases == [1]  # nothing ran since


async def test_close_gives_memory_back_even_when_its_caller_is_cancelled(
    releases: list[int],
) -> None:
    keeper, _ = _keeper([0], [])
    keeper.went_idle()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await keeper.close()
    assert releases == [1]


async def test_what_the_stream_kept_for_reuse_is_dropped_just_before_each_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []
    monkeypatch.setattr(_memory, "release_freed_memory", lambda: order.append("release"))
    gate = _Gate()
    spent: list[float] = []
    drop = partial(order.append, "drop")
    keeper = IdleRelease(5.0, lambda: 0, spent.append, drop=drop, sleep=gate)
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        await _went_idle(keeper, gate, 1)
        assert order == []  # not before the interval has passed
        gate.open()
        await _until(lambda: len(order) == 2)
        tg.cancel_scope.cancel()
    assert order == ["drop", "release"]
    keeper.went_idle()
    await keeper.close()
    assert order == ["drop", "release"] * 2
    await keeper.close()  # nothing ran since: neither
    assert order == ["drop", "release"] * 2


def _samples(n: int, r: int = 32) -> list[Sample]:
    rng = np.random.default_rng(3)
    return [Sample(rng.integers(0, 5000, 16 + r).tolist(), r) for _ in range(n)]


async def _score(stream: OPDStream, n: int) -> None:
    async with stream.run(_samples(n)) as results:
        assert all([isinstance(r, ScoredSample) async for r in results])


async def test_a_stream_keeps_freed_memory_between_runs_and_gives_it_back_as_it_closes(
    releases: list[int],
) -> None:
    transport = mock_transport({T: InProcessSGLang("teacher", 1)})
    async with OPDStream(_cfg(top_k=0, release_memory_after_s=3600), transport=transport) as s:
        for _ in range(3):
            await _score(s, 4)
        await anyio.sleep(0.05)
        assert releases == []  # three runs ended; the stream stayed open
    assert releases == [1]


async def test_a_stream_idle_for_the_interval_gives_freed_memory_back(
    releases: list[int],
) -> None:
    transport = mock_transport({T: InProcessSGLang("teacher", 1)})
    async with OPDStream(_cfg(top_k=0, release_memory_after_s=0.01), transport=transport) as s:
        await _score(s, 4)
        await _until(lambda: bool(releases))  # while the stream is open
        assert s.stats().in_flight == 0
        first = len(releases)
        await _score(s, 4)
        await _until(lambda: len(releases) > first)  # idle again after the second run


async def test_calls_that_idle_between_them_keep_the_memory_while_they_come(
    releases: list[int],
) -> None:
    # one sample at a time (OPDStream.score): nothing in flight between two calls
    transport = mock_transport({T: InProcessSGLang("teacher", 1)})
    async with OPDStream(_cfg(top_k=0, release_memory_after_s=3600), transport=transport) as s:
        for sample in _samples(6):
            assert isinstance(await s.score(sample), ScoredSample)
        assert releases == []
    assert releases == [1]


async def test_no_stream_gives_memory_back_while_another_has_samples_in_flight(
    releases: list[int],
) -> None:
    # malloc_trim is process-wide: the busy stream's next allocations would fault
    busy = [1]
    other, other_gate = _keeper(busy, [])
    keeper, gate = _keeper([0], [])
    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        tg.start_soon(other.run)
        await _went_idle(keeper, gate, 1)
        gate.open()
        await _until(lambda: keeper.waiting_for_idle)
        assert releases == []  # idle for the interval, but the other stream is busy
        await keeper.close()
        assert releases == []  # nor as it closes
        busy[0] = 0
        await _went_idle(other, other_gate, 1)  # the busy one idles in turn: it gives back
        await _interval_ends_in_a_release(other_gate, releases)
        tg.cancel_scope.cancel()
    await other.close()
    assert releases == [1]


async def test_a_closed_stream_no_longer_holds_the_others_back(releases: list[int]) -> None:
    busy = [1]
    other, _ = _keeper(busy, [])
    await other.close()  # closed with samples in flight (a cancelled run's, say)
    keeper, _ = _keeper([0], [])
    keeper.went_idle()
    await keeper.close()
    assert releases == [1]


async def test_a_stream_whose_count_cannot_be_read_now_counts_as_busy(
    releases: list[int],
) -> None:
    # another thread's stream, its runs' set resized while it was read
    def changing() -> int:
        raise RuntimeError("Set changed size during iteration")

    other, _ = _keeper([0], [])
    other._in_flight = changing
    keeper, _ = _keeper([0], [])
    keeper.went_idle()
    await keeper.close()
    assert releases == []
    await other.close()


async def test_the_open_streams_changing_while_they_are_read_count_as_busy(
    releases: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # another thread's stream opened or closed during the read
    class Changing:
        def __iter__(self) -> Iterator[IdleRelease]:
            raise RuntimeError("Set changed size during iteration")

        def discard(self, keeper: IdleRelease) -> None:
            pass

    keeper, _ = _keeper([0], [])
    monkeypatch.setattr(_memory, "_OPEN", Changing())
    keeper.went_idle()
    await keeper.close()
    assert releases == []


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the asyncio transport, a real server
async def test_a_stream_drops_its_big_answers_buffers_as_it_idles(releases: list[int]) -> None:
    # R = 1024, the student's top-256 asked of the teacher: answers of ~6 MB, read into
    # buffers the transport keeps
    r, k = 1024, 256
    ids = (np.arange(k)[None, :] * 7 + np.arange(r)[:, None]) % 5000  # distinct in a row
    lps = np.sort(-np.random.default_rng(5).random((r, k)), axis=1)[:, ::-1].astype(np.float32)
    samples = [
        msgspec.structs.replace(s, student_top_logprobs=(ids, lps)) for s in _samples(2, r=r)
    ]
    async with serve_mock("teacher", 1) as server:
        transport = AsyncioTransport()
        cfg = stream_config(server.url, top_k=k, release_memory_after_s=3600)
        async with OPDStream(cfg, transport=transport) as s:
            for _ in range(2):
                async with s.run(samples) as results:
                    assert all([isinstance(r, ScoredSample) async for r in results])
            bodies = transport._bodies
            assert bodies.reused >= 1 and bodies.held_bytes > 0  # kept between the runs
            assert releases == []
        assert bodies.held_bytes == 0 and releases == [1]  # dropped as it closed
        cfg = cfg.evolve(release_memory_after_s=0.01)
        transport = AsyncioTransport()
        async with OPDStream(cfg, transport=transport) as s:
            async with s.run(samples) as results:
                assert all([isinstance(r, ScoredSample) async for r in results])
            await _until(lambda: len(releases) == 2)  # idle: dropped, while it stays open
            assert transport._bodies.held_bytes == 0
