"""``serve_mock_threaded``: the aiohttp mock SGLang servers in their own asyncio loop, in a
thread, so that a test on any anyio backend (trio included) can talk to them over HTTP;
``servers_in_thread``: any set of mock servers (SGLang's, vLLM's) started that way, from a
plain (module-scoped) fixture."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import Any, TypeVar

import anyio

from opd_stream.testing.mock_sglang import MockCluster, MockOptions, serve_mock

__all__ = ("serve_mock_threaded", "servers_in_thread")

_T = TypeVar("_T")


@asynccontextmanager
async def serve_mock_threaded(
    role: Any = "teacher",
    seed: int = 0,
    *,
    replicas: int = 1,
    options: MockOptions | None = None,
) -> AsyncIterator[MockCluster]:
    """:func:`serve_mock` in a thread with its own asyncio loop; stopped on exit."""

    async def start(stack: AsyncExitStack) -> MockCluster:
        return await stack.enter_async_context(
            serve_mock(role, seed, replicas=replicas, options=options)
        )

    servers = servers_in_thread(start)
    cluster = await anyio.to_thread.run_sync(servers.__enter__)
    try:
        yield cluster
    finally:
        await anyio.to_thread.run_sync(servers.__exit__, None, None, None)


@contextmanager
def servers_in_thread(start: Callable[[AsyncExitStack], Awaitable[_T]]) -> Iterator[_T]:
    """Run ``start(stack)`` in a thread's own asyncio loop (it enters the servers' context
    managers on ``stack`` and returns what the tests need); yield its result; stop them all
    on exit. For module-scoped fixtures: the servers outlive any one test's event loop."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def serve() -> None:
        async def main() -> None:
            stop = asyncio.Event()
            try:
                async with AsyncExitStack() as stack:
                    box.update(value=await start(stack), loop=asyncio.get_running_loop())
                    box["stop"] = stop
                    ready.set()
                    await stop.wait()
            except BaseException as exc:
                box["error"] = exc
                raise
            finally:
                ready.set()

        asyncio.run(main())

    thread = threading.Thread(target=serve, name="mock-servers", daemon=True)
    thread.start()
    ready.wait()
    if "value" not in box:
        thread.join()
        raise RuntimeError(f"the mock servers did not start: {box.get('error')!r}")
    try:
        yield box["value"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join()
