"""Deadlines and retry backoff, on asyncio (real clock) and trio (virtual clock).

A logical request has one budget, ``request_deadline_s``, that covers all its attempts
and backoff sleeps; it never runs past it.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import anyio
import pytest
from support.config import stream_config
from trio.testing import MockClock

from opd_stream import MockTransport, OPDStream, Response, Sample, SampleFailure, StreamConfig
from opd_stream.testing.inprocess import InProcessSGLang

T = "http://teacher:1"


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


_cfg = partial(stream_config, T)


async def _run(cfg: StreamConfig, handler: Any, n: int = 3) -> list[Any]:
    samples = [Sample([1, 2, 3, 4, 5], 2) for _ in range(n)]
    async with OPDStream(cfg, transport=MockTransport(handler)) as stream:
        async with stream.run(samples) as results:
            return [r async for r in results]


def _slack(backend: str) -> float:
    """Scheduling slack: exact on trio's virtual clock, generous on a loaded real machine.

    The bounds that matter are the virtual clock's; on asyncio's real clock a busy machine may
    add seconds, and what can go wrong there (a request that never ends) ends far later.
    """
    return 0.05 if backend == "trio" else 10.0


def _scale(backend: str) -> float:
    """Durations are stretched on the real clock (asyncio), so that a busy machine's delays
    stay small beside them; on trio's virtual clock they cost nothing and are exact."""
    return 1.0 if backend == "trio" else 5.0


async def test_a_hanging_server_fails_the_sample_at_its_deadline(anyio_backend_name: str) -> None:
    async def hang(method: str, url: str, body: bytes) -> Response:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    start = anyio.current_time()
    out = await _run(_cfg(request_deadline_s=0.5), hang)
    elapsed = anyio.current_time() - start
    assert all(isinstance(f, SampleFailure) and f.reason == "deadline_exceeded" for f in out)
    assert "0.5 s" in out[0].message
    assert 0.5 <= elapsed <= 0.5 + _slack(anyio_backend_name)


async def test_the_deadline_covers_retries_and_backoff(anyio_backend_name: str) -> None:
    calls = 0
    x = _scale(anyio_backend_name)

    async def always_503(method: str, url: str, body: bytes) -> Response:
        nonlocal calls
        calls += 1
        await anyio.sleep(0.2 * x)
        return Response(503, b'{"object": "error", "message": "queue full", "code": 503}')

    cfg = _cfg(
        request_deadline_s=1.0 * x,
        max_attempts=100,
        backoff_initial_s=0.1 * x,
        backoff_max_s=0.2 * x,
    )
    start = anyio.current_time()
    out = await _run(cfg, always_503, n=1)
    elapsed = anyio.current_time() - start
    assert isinstance(out[0], SampleFailure)
    # either the budget ran out mid-attempt, or no backoff fitted before it: never past it
    assert out[0].reason in ("deadline_exceeded", "teacher_http_503")
    assert elapsed <= 1.0 * x + _slack(anyio_backend_name)
    assert 2 <= calls <= 5  # each attempt takes 0.2 of the 1.0 budget


async def test_backoff_waits_between_attempts(anyio_backend_name: str) -> None:
    times: list[float] = []
    server = InProcessSGLang("teacher", 1)

    def handler(method: str, url: str, body: bytes) -> Response:
        times.append(anyio.current_time())
        if len(times) < 4:
            return Response(429, b'{"error": "slow down"}')
        return server.handle(method, "/generate", body)

    cfg = _cfg(max_attempts=4, backoff_initial_s=0.2, backoff_max_s=0.2)
    out = await _run(cfg, handler, n=1)
    assert out[0].attempts == 4
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) == 3
    # full jitter: each sleep lies in [0, 0.2]; in sum they are bounded by 3 x 0.2
    assert all(g <= 0.2 + _slack(anyio_backend_name) for g in gaps)
    assert sum(gaps) <= 0.6 + _slack(anyio_backend_name)
    if anyio_backend_name == "trio":
        # Virtual clock: nothing but the backoff sleeps moves it, so each gap is one sleep,
        # drawn anew (three independent uniform draws: never all zero, never equal).
        assert all(g <= 0.2 + 1e-9 for g in gaps)
        assert sum(gaps) > 0
        assert len(set(gaps)) == 3


async def test_a_slow_first_request_does_not_consume_the_next_ones_budget(
    anyio_backend_name: str,
) -> None:
    server = InProcessSGLang("teacher", 1)
    n = 0
    x = _scale(anyio_backend_name)

    async def handler(method: str, url: str, body: bytes) -> Response:
        nonlocal n
        n += 1
        await anyio.sleep(0.3 * x)  # each request takes 0.3 of a 0.5 budget
        return server.handle(method, "/generate", body)

    cfg = _cfg(request_deadline_s=0.5 * x, max_inflight=1)
    out = await _run(cfg, handler, n=3)
    assert [type(r).__name__ for r in out] == ["ScoredSample"] * 3


async def test_the_attempt_watchdog_retries_a_hung_attempt_within_the_deadline(
    anyio_backend_name: str,
) -> None:
    server = InProcessSGLang("teacher", 1)
    calls = 0
    x = _scale(anyio_backend_name)

    async def hang_once(method: str, url: str, body: bytes) -> Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            await anyio.sleep_forever()
        return server.handle(method, "/generate", body)

    cfg = _cfg(request_deadline_s=5.0 * x, attempt_timeout_s=0.3 * x, backoff_initial_s=0.01)
    out = await _run(cfg, hang_once, n=1)
    # without the watchdog the hung first attempt would have used the whole 5 s budget
    assert type(out[0]).__name__ == "ScoredSample"
    assert out[0].attempts == 2


async def test_without_the_watchdog_a_hung_attempt_uses_the_whole_budget() -> None:
    async def hang(method: str, url: str, body: bytes) -> Response:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    out = await _run(_cfg(request_deadline_s=0.4), hang, n=1)
    assert isinstance(out[0], SampleFailure)
    assert out[0].reason == "deadline_exceeded" and out[0].attempts == 1
