"""Cancellation: leaving early, cancelling the caller, closing while requests hang.

Over real HTTP (asyncio) against a mock whose requests hang: the run stops at once (far
before any deadline), no task is left pending, the connection pool is idle, and the mock
observes every hanging request's disconnect. Tests run with warnings as errors and asyncio
in debug mode. A trio variant cancels the caller's scope over the in-process transport.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest
from support.config import stream_config

from opd_stream import (
    AiohttpTransport,
    MockTransport,
    OPDStream,
    Response,
    Sample,
)
from opd_stream.testing.mock_sglang import MockCluster, MockOptions, serve_mock
from opd_stream.testing.tasks import pending_tasks

DEADLINE_S = 60.0  # far away: everything below must end long before it
PROMPTLY_S = 20.0  # "at once", on a busy machine: still far below the deadline


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


def _samples(n: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    return [Sample(rng.integers(0, 5000, 8).tolist(), 3) for _ in range(n)]


_cfg = partial(stream_config, request_deadline_s=DEADLINE_S, max_inflight=6)


async def _until(predicate: Any, limit_s: float = PROMPTLY_S) -> None:
    """Poll ``predicate`` (the mock's counters have no events to wait on)."""
    with anyio.fail_after(limit_s):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def _assert_clean(teacher: MockCluster, before: set[asyncio.Task[Any]], hanging: int) -> None:
    await _until(lambda: teacher.stats[0].disconnects >= hanging)
    assert teacher.stats[0].disconnects == hanging
    await _until(lambda: teacher.stats[0].in_flight == 0)
    await _until(lambda: not (pending_tasks() - before))


async def test_breaking_out_of_results_cancels_the_hanging_requests() -> None:
    async with serve_mock("teacher", 1, options=MockOptions(fault_hang=0.5, fault_seed=1)) as t:
        before = pending_tasks()
        transport = AiohttpTransport()
        start = anyio.current_time()
        async with OPDStream(_cfg(t.url), transport=transport) as stream:
            async with stream.run(_samples(50)) as results:
                async for _ in results:
                    await _until(lambda: t.stats[0].in_flight > 0)
                    hanging = t.stats[0].in_flight
                    break
            assert transport.idle
            assert stream.stats().in_flight == 0
        assert anyio.current_time() - start < PROMPTLY_S
        await _assert_clean(t, before, t.stats[0].faults["hang"])
        assert hanging > 0


async def test_cancelling_the_callers_scope_cancels_the_hanging_requests() -> None:
    async with serve_mock("teacher", 1, options=MockOptions(fault_hang=1.0)) as t:
        before = pending_tasks()
        transport = AiohttpTransport()
        got: list[Any] = []
        async with OPDStream(_cfg(t.url), transport=transport) as stream:
            with anyio.CancelScope() as scope:
                async with stream.run(_samples(20)) as results:
                    await _until(lambda: t.stats[0].in_flight == 6)
                    scope.cancel()
                    got.extend([r async for r in results])
            assert scope.cancelled_caught
            assert got == []
            assert transport.idle
        await _assert_clean(t, before, 6)
        assert t.stats[0].generate_requests == 6  # intake stopped at max_inflight


async def test_closing_the_stream_while_requests_hang_ends_them() -> None:
    async with serve_mock("teacher", 1, options=MockOptions(fault_hang=1.0)) as t:
        before = pending_tasks()
        start = anyio.current_time()
        async with OPDStream(_cfg(t.url)) as stream:
            results = stream.run(_samples(20))
            await _until(lambda: t.stats[0].in_flight == 6)
            await results.aclose()
            # a second close, and the stream's own exit, are harmless
            await results.aclose()
        assert anyio.current_time() - start < PROMPTLY_S
        await _assert_clean(t, before, 6)


async def test_leaving_the_stream_with_a_run_never_iterated_cancels_it() -> None:
    async with serve_mock("teacher", 1, options=MockOptions(fault_hang=1.0)) as t:
        before = pending_tasks()
        async with OPDStream(_cfg(t.url)) as stream:
            stream.run(_samples(20))  # the handle is dropped; the stream's exit ends it
            await _until(lambda: t.stats[0].in_flight == 6)
        await _assert_clean(t, before, 6)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_cancelling_the_caller_ends_in_process_requests_on_any_backend() -> None:
    live = 0
    started = anyio.Event()

    async def hang(method: str, url: str, body: bytes) -> Response:
        nonlocal live
        live += 1
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            live -= 1
        raise AssertionError("unreachable")

    cfg = _cfg("http://teacher:1")
    async with OPDStream(cfg, transport=MockTransport(hang)) as stream:
        with anyio.move_on_after(PROMPTLY_S) as outer:
            with anyio.CancelScope() as scope:
                async with stream.run(_samples(10)) as results:
                    await started.wait()
                    await _until(lambda: live == 6)
                    scope.cancel()
                    async for _ in results:
                        pass
        assert not outer.cancelled_caught
        assert live == 0
        assert stream.stats().in_flight == 0
