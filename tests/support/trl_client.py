"""TRL 1.16.0's own client and trainer (from :mod:`opd_stream.testing._trl_source`, which
``bench/trl_teacher.py`` uses too), and mock servers for synchronous callers.

* :func:`mock_in_thread`: mock servers (any of the ``serve_*`` async context managers) in an
  asyncio loop of their own thread, for tests whose client blocks the calling thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any

from opd_stream.testing._trl_source import (
    TRL_CLIENT,
    TRL_SERVER_TRAINER,
    load_server_distillation_trainer,
    load_trl_client_module,
    trl_client,
)

__all__ = (
    "TRL_CLIENT",
    "TRL_SERVER_TRAINER",
    "load_server_distillation_trainer",
    "load_trl_client_module",
    "mock_in_thread",
    "trl_client",
)


@contextmanager
def mock_in_thread(
    serve: Callable[[], AbstractAsyncContextManager[Any]],
) -> Iterator[Any]:
    """``async with serve() as cluster`` run in a thread's own asyncio loop; yields the
    cluster and stops the servers on exit."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        async def main() -> None:
            stop = asyncio.Event()
            try:
                async with serve() as cluster:
                    box.update(cluster=cluster, loop=asyncio.get_running_loop(), stop=stop)
                    ready.set()
                    await stop.wait()
            except BaseException as exc:
                box["error"] = exc
                raise
            finally:
                ready.set()

        asyncio.run(main())

    thread = threading.Thread(target=run, name="mock-servers", daemon=True)
    thread.start()
    ready.wait()
    if "cluster" not in box:
        thread.join()
        raise RuntimeError(f"the mock servers did not start: {box.get('error')!r}")
    try:
        yield box["cluster"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join()
