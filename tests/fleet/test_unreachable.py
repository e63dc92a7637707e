"""A teacher whose every replica refuses connections: after ``unreachable_after_s`` its
samples fail at once, saying so, instead of each being retried; one request per interval
still goes ahead, and a teacher that answers again is used again (issue 24, section 3).

The sans-IO rule of ``EndpointPool`` first, then the stream against in-process replicas
that refuse connections (asyncio, and trio on a virtual clock), and the real transports'
refusal.
"""

from __future__ import annotations

import contextlib
import random
import socket
from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest
from support.config import one_pool, stream_config
from trio.testing import MockClock

from opd_stream import (
    AiohttpTransport,
    ConnectionFailed,
    MockTransport,
    OPDStream,
    Response,
    Sample,
    SampleFailure,
    ScoredSample,
    StreamConfig,
)
from opd_stream.fleet._balance import EndpointPool
from opd_stream.fleet._endpoints import Endpoints
from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.transport._httpx import HttpxTransport

A, B = "http://replica-a:1", "http://replica-b:1"


# --- sans-IO: EndpointPool ------------------------------------------------------------------
def _pool(window: float = 5.0) -> EndpointPool:
    return EndpointPool(Endpoints(), unreachable_after_s=window, rng=random.Random(0))


def test_a_set_is_unreachable_once_every_replica_has_refused_for_the_window() -> None:
    pool = _pool(5)
    pool.record_refused(A, now=0)
    assert pool.unreachable((A, B), now=100) is None  # B never refused
    pool.record_refused(B, now=2)
    pool.record_refused(A, now=3)  # A refusing since 0: a later refusal does not move it
    assert pool.unreachable((A, B), now=6.9) is None  # all refusing since 2 only
    assert pool.unreachable((A, B), now=7) == 5
    assert pool.unreachable((A,), now=5) == 5


def test_any_answer_makes_the_set_reachable_again() -> None:
    pool = _pool(5)
    for url in (A, B):
        pool.record_refused(url, now=0)
    pool.record_reached(B)  # an error status is an answer too
    assert pool.unreachable((A, B), now=50) is None
    pool.record_refused(B, now=50)
    assert pool.unreachable((A, B), now=54) is None
    assert pool.unreachable((A, B), now=55) == 5
    pool.record_success(A, (A, B), latency_s=0.1)
    assert pool.unreachable((A, B), now=99) is None


def test_one_request_per_window_is_let_through_while_unreachable() -> None:
    pool = _pool(5)
    pool.record_refused(A, now=0)
    assert not pool.known_unreachable((A,))
    assert pool.let_through((A,), now=5)  # the first request once unreachable
    assert pool.known_unreachable((A,))
    assert not pool.let_through((A,), now=5)
    assert not pool.let_through((A,), now=9.99)
    assert pool.let_through((A,), now=10)
    assert not pool.let_through((A,), now=10)
    pool.record_reached(A)  # back: the next time it is unreachable is news again
    assert pool.unreachable((A,), now=11) is None
    assert not pool.known_unreachable((A,))


def test_a_window_of_zero_never_gives_up() -> None:
    pool = _pool(0)
    pool.record_refused(A, now=0)
    assert pool.unreachable((A,), now=1e9) is None


def test_an_empty_set_is_never_unreachable() -> None:
    assert _pool(5).unreachable((), now=1e9) is None


def test_the_setting_is_declared_once_with_its_variable() -> None:
    assert StreamConfig.from_env({}, teachers=A).unreachable_after_s == 5.0
    env = {"OPD_STREAM_UNREACHABLE_AFTER_S": "0.5"}
    assert StreamConfig.from_env(env, teachers=A).unreachable_after_s == 0.5
    with pytest.raises(ValueError, match="unreachable_after_s"):
        StreamConfig.from_env({}, teachers=A, unreachable_after_s=-1)


# --- the stream -----------------------------------------------------------------------------
@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


class _Refusing:
    """In-process replicas that refuse every connection while ``down``."""

    def __init__(self, urls: tuple[str, ...], *, up: tuple[str, ...] = ()) -> None:
        self.servers = {u: InProcessSGLang("teacher", 1) for u in urls}
        self.down = True
        self.up = up  # never down
        self.refused = 0
        self.transport = MockTransport(self.handle)

    def handle(self, method: str, url: str, body: bytes) -> Response:
        base = next(b for b in self.servers if url.startswith(b))
        if self.down and base not in self.up:
            self.refused += 1
            raise ConnectionFailed("cannot connect: Connection refused", url=url, refused=True)
        return self.servers[base].handle(method, url[len(base) :], body)


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(0, 3000, 9).tolist(), 4, sample_id=i) for i in range(n)]


_cfg = partial(
    stream_config, max_attempts=3, backoff_initial_s=0.01, backoff_max_s=0.02, max_inflight=4
)  # teachers: one_pool(urls), unreachable_after_s=window


async def _run(stream: OPDStream, samples: list[Sample]) -> list[ScoredSample | SampleFailure]:
    async with stream.run(samples) as results:
        out = [r async for r in results]
    assert sorted(r.index for r in out) == list(range(len(samples)))  # each one out once
    return out


async def _refuse_for(stream: OPDStream, seconds: float) -> list[ScoredSample | SampleFailure]:
    """Samples that every replica refuses (retried, all failing), then ``seconds`` with no
    answer: the replicas have refused for at least that long."""
    out = await _run(stream, _samples(4, seed=100))
    await anyio.sleep(seconds)
    return out


async def test_every_replica_refusing_makes_the_remaining_samples_fail_at_once() -> None:
    urls = (A, B)
    fleet = _Refusing(urls)
    window = 0.5
    async with OPDStream(
        _cfg(one_pool(urls), unreachable_after_s=window), transport=fleet.transport
    ) as stream:
        early = await _refuse_for(stream, window)
        before, start = fleet.refused, anyio.current_time()
        late = await _run(stream, _samples(40))
        windows = (anyio.current_time() - start) / window
    for item in early:  # retried: max_attempts each, or cut short once unreachable
        assert isinstance(item, SampleFailure) and item.reason == "connection_error"
    assert all(isinstance(r, SampleFailure) for r in late)
    fast = [r for r in late if isinstance(r, SampleFailure) and r.attempts == 0]
    # one request per window goes ahead (a single attempt); the others make none
    let_through = fleet.refused - before
    assert let_through <= 1 + windows and len(fast) == len(late) - let_through
    for item in late:
        assert item.reason == "connection_error"
        assert "teacher unreachable" in item.message
        assert "replica-a:1, replica-b:1" in item.message
        assert f"unreachable_after_s={window:g}" in item.message


async def test_a_teacher_that_answers_again_is_used_again() -> None:
    urls = (A,)
    fleet = _Refusing(urls)
    window = 0.5
    async with OPDStream(
        _cfg(one_pool(urls), unreachable_after_s=window), transport=fleet.transport
    ) as stream:
        await _refuse_for(stream, window)
        down = await _run(stream, _samples(10))
        assert all(isinstance(r, SampleFailure) for r in down)
        assert sum(r.attempts == 0 for r in down) >= len(down) - 1
        fleet.down = False
        await anyio.sleep(window)  # the next request is let through, and is answered
        probe = await _run(stream, _samples(1, seed=1))
        back = await _run(stream, _samples(20, seed=2))
    assert isinstance(probe[0], ScoredSample)
    assert all(isinstance(r, ScoredSample) for r in back)


async def test_only_the_refusing_teachers_samples_fail() -> None:
    fleet = _Refusing((A, B), up=(B,))
    cfg = _cfg(one_pool((A,)), unreachable_after_s=0.5).evolve(teachers={"math": A, "code": B})
    samples = [
        Sample(s.tokens, s.response_length, sample_id=i, metadata={"opd_teacher": name})
        for i, (s, name) in enumerate(zip(_samples(40), ["math", "code"] * 20, strict=True))
    ]
    async with OPDStream(cfg, transport=fleet.transport) as stream:
        await _run(stream, [x for x in samples[:2] if x.metadata["opd_teacher"] == "math"])
        await anyio.sleep(0.5)  # "math" has refused for the window
        before, start = fleet.refused, anyio.current_time()
        out = await _run(stream, samples)
        windows = (anyio.current_time() - start) / 0.5
    for item in out:
        if item.sample.metadata["opd_teacher"] == "code":
            assert isinstance(item, ScoredSample)
        else:
            assert isinstance(item, SampleFailure) and item.reason == "connection_error"
            assert item.message.startswith("teacher unreachable: every replica (replica-a:1)")
    let_through = fleet.refused - before  # one per window, a single attempt each
    assert let_through <= 1 + windows
    assert sum(isinstance(r, SampleFailure) and r.attempts == 0 for r in out) == 20 - let_through


async def test_a_window_of_zero_retries_every_sample() -> None:
    urls = (A,)
    fleet = _Refusing(urls)
    async with OPDStream(
        _cfg(one_pool(urls), unreachable_after_s=0.0), transport=fleet.transport
    ) as stream:
        await _refuse_for(stream, 0.2)
        out = await _run(stream, _samples(6))
    assert all(isinstance(r, SampleFailure) and r.attempts == 3 for r in out)


# --- the real transports: a refused connection -------------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed on exit: connecting is refused


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("transport", [AiohttpTransport, HttpxTransport])
async def test_a_refused_connection_names_host_port_and_reason_only(transport: Any) -> None:
    port = _closed_port()
    async with transport() as t:
        with pytest.raises(ConnectionFailed) as info:
            await t.post(f"http://127.0.0.1:{port}/generate", b"{}", max_bytes=1024)
    assert info.value.refused and info.value.retryable
    assert str(info.value) == f"cannot connect to 127.0.0.1:{port}: Connection refused"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("transport", [AiohttpTransport, HttpxTransport])
async def test_a_connect_that_times_out_is_not_reaching_the_server_either(transport: Any) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)  # never accepted: once its queue is full, a connect gets no answer
        port = int(server.getsockname()[1])
        queued = [socket.socket() for _ in range(3)]
        try:
            for sock in queued:
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):  # connecting, in the queue
                    sock.connect(("127.0.0.1", port))
            async with transport(connect_timeout_s=0.2) as t:
                with pytest.raises(ConnectionFailed) as info:
                    await t.post(f"http://127.0.0.1:{port}/generate", b"{}", max_bytes=1024)
        finally:
            for sock in queued:
                sock.close()
    assert info.value.refused and info.value.retryable
    assert str(info.value) in (
        f"cannot connect to 127.0.0.1:{port}: no connection within connect_timeout_s=0.2 s",
        f"cannot connect to 127.0.0.1:{port}: Connection refused",  # a kernel that refuses
    )
