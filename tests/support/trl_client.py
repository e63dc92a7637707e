"""TRL 1.16.0's own client and trainer (from :mod:`opd_stream.testing._trl_source`, which
``bench/trl_teacher.py`` uses too), and mock servers for synchronous callers.

* :func:`mock_in_thread`: mock servers (any of the ``serve_*`` async context managers) in an
  asyncio loop of their own thread, for tests whose client blocks the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, contextmanager
from typing import Any

from opd_stream.testing._trl_source import (
    TRL_CLIENT,
    TRL_SERVER_TRAINER,
    load_server_distillation_trainer,
    load_trl_client_module,
    trl_client,
)
from support.threaded_mock import servers_in_thread

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

    async def start(stack: AsyncExitStack) -> Any:
        return await stack.enter_async_context(serve())

    with servers_in_thread(start) as cluster:
        yield cluster
