"""The fetcher's clock (deadlines, latencies, health): the one ``anyio.current_time()``
reads, looked up once per stream instead of at every read (issues 33, 35)."""

from __future__ import annotations

import asyncio

import anyio

from opd_stream.fetch._attempts import loop_clock


async def test_the_clock_is_the_event_loops_own(anyio_backend_name: str) -> None:
    clock = loop_clock()
    if anyio_backend_name == "asyncio":
        assert clock == asyncio.get_running_loop().time
    else:  # trio (and its MockClock): anyio's own lookup
        assert clock is anyio.current_time
    assert abs(clock() - anyio.current_time()) < 0.5


def test_with_no_loop_running_the_clock_is_anyios() -> None:
    assert loop_clock() is anyio.current_time
