"""``serve_mock_threaded``: the aiohttp mock SGLang servers in their own asyncio loop, in a
thread, so that a test on any anyio backend (trio included) can talk to them over HTTP."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from opd_stream.testing.mock_sglang import MockCluster, MockOptions, serve_mock

__all__ = ("serve_mock_threaded",)


@asynccontextmanager
async def serve_mock_threaded(
    role: Any = "teacher",
    seed: int = 0,
    *,
    replicas: int = 1,
    options: MockOptions | None = None,
) -> AsyncIterator[MockCluster]:
    """:func:`serve_mock` in a thread with its own asyncio loop; stopped on exit."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def serve() -> None:
        async def main() -> None:
            stop = asyncio.Event()
            try:
                async with serve_mock(role, seed, replicas=replicas, options=options) as cluster:
                    box.update(cluster=cluster, loop=asyncio.get_running_loop(), stop=stop)
                    ready.set()
                    await stop.wait()
            except BaseException as exc:
                box["error"] = exc
                raise
            finally:
                ready.set()

        asyncio.run(main())

    thread = threading.Thread(target=serve, name="mock-sglang", daemon=True)
    thread.start()
    await anyio.to_thread.run_sync(ready.wait)
    if "cluster" not in box:
        await anyio.to_thread.run_sync(thread.join)
        raise RuntimeError(f"the mock server did not start: {box.get('error')!r}")
    try:
        yield box["cluster"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        await anyio.to_thread.run_sync(thread.join)
