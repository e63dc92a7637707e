"""(async) :class:`LoopThread`: an asyncio event loop in a thread of its own, for a
synchronous host (TRL's training step) to run coroutines on and wait for them.

The thread is not a daemon: :meth:`LoopThread.close` stops the loop and joins it. A host
that never closes it does not hang at exit: the loop watches the main thread and stops by
itself once the interpreter is shutting down (``threading.main_thread()`` ended), after
running the ``on_exit`` coroutine (which closes what runs on the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, TypeVar

__all__ = ("LoopThread",)

T = TypeVar("T")

MAIN_THREAD_POLL_S: Final = 0.25
"""How often the loop looks whether the main thread has ended (the interpreter exiting)."""


class LoopThread:
    """An asyncio loop running in its own (non-daemon) thread until :meth:`close`.

    Args:
        name: the thread's name.
        on_exit: awaited on the loop before it stops, whether by :meth:`close` or because
            the main thread ended.
    """

    def __init__(self, name: str, on_exit: Callable[[], Awaitable[None]]) -> None:
        self._on_exit = on_exit
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)
        self._thread.start()
        self._started.wait()

    @property
    def thread(self) -> threading.Thread:
        """The loop's thread."""
        return self._thread

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main())
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_default_executor())
            asyncio.set_event_loop(None)
            loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._started.set()
        main = threading.main_thread()
        try:
            while main.is_alive():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), MAIN_THREAD_POLL_S)
                if self._stop.is_set():
                    break
        finally:
            with self._lock:  # from now on, a new call is refused (nothing would run it)
                self._closed = True
            await self._on_exit()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result in the calling thread.

        If the caller is interrupted while waiting (``KeyboardInterrupt``), the coroutine is
        cancelled.

        Raises:
            RuntimeError: the loop is closed, or the call comes from the loop's own thread
                (it would wait for itself).
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking call from the client's own event-loop thread")
        with self._lock:
            if self._closed or self._loop.is_closed():
                coro.close()
                raise RuntimeError("the client is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Run ``on_exit`` on the loop, stop it and join its thread. Idempotent; waits for
        nothing when called from the loop's own thread (the loop stops after the call)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                stop = self._stop
                if stop is not None and not self._loop.is_closed():
                    with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                        self._loop.call_soon_threadsafe(stop.set)
        if threading.current_thread() is not self._thread:
            self._thread.join()
