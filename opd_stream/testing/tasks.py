"""Which asyncio tasks a test started and left behind.

:func:`pending_tasks` is the set of pending tasks of the running loop other than the
in-process mock servers' own connection handlers (aiohttp's ``RequestHandler``): take it
before a run and again after it; what the second set holds beyond the first was left
running by the code under test::

    before = pending_tasks()
    ...  # run the stream
    assert not (pending_tasks() - before)
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ("pending_tasks",)


def pending_tasks() -> set[asyncio.Task[Any]]:
    """Pending asyncio tasks that are not the mock servers' own connection handlers.

    Must be called from a coroutine on the asyncio loop whose tasks are wanted.
    """
    tasks = set()
    for task in asyncio.all_tasks():
        if task.done():
            continue
        coro = task.get_coro()
        qual = getattr(coro, "__qualname__", "")
        mod = getattr(getattr(coro, "cr_code", None), "co_filename", "")
        if "aiohttp/web_protocol" in mod or qual.startswith("RequestHandler."):
            continue  # server side of the in-process mocks
        tasks.add(task)
    return tasks
