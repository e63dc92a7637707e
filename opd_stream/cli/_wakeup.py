"""A Ctrl-C wakes the command's event loop, wherever it lands.

Python runs a signal's handler in the main thread, between two bytecodes. asyncio's
``Runner`` (under ``anyio.run``) installs its SIGINT handler with no wakeup fd, so the
handler waits for the loop's next wake-up when the signal lands in another thread (the
kernel may pick any thread that does not block it), or in the main thread just before it
enters ``epoll_wait``: a command waiting on a quiet socket, or on a long timer, would hang
there (a pure-asyncio script does, 1 run in 200 on a loaded machine). The command owns its
process, so it sets a wakeup fd that the loop watches (:func:`signal_wakeup`); the library
never does (it is a guest in its host's process).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

__all__ = ("run_woken_by_signals", "signal_wakeup")

T = TypeVar("T")
A = TypeVar("A")


async def run_woken_by_signals(func: Callable[[A], Awaitable[T]], arg: A) -> T:
    """``await func(arg)`` under :func:`signal_wakeup`."""
    with signal_wakeup():
        return await func(arg)


@contextlib.contextmanager
def signal_wakeup() -> Iterator[None]:
    """While inside: a signal with a Python handler wakes the running asyncio loop.

    The C-level handler writes a byte to a socket that the loop reads (and drops); the
    loop's wake-up then runs the Python handler at once. Does nothing outside the main
    thread, without a running asyncio loop (trio sets its own), or where a wakeup fd is
    already set (its owner keeps it). The previous state is restored on the way out.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        yield
        return
    read, write = socket.socketpair()
    with read, write:
        read.setblocking(False)
        write.setblocking(False)
        previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        if previous != -1:  # someone else's: put it back, leave it be
            signal.set_wakeup_fd(previous)
            yield
            return
        loop.add_reader(read.fileno(), _drain, read)
        try:
            yield
        finally:
            loop.remove_reader(read.fileno())
            current = signal.set_wakeup_fd(-1)
            if current not in (-1, write.fileno()):  # set by someone since: theirs stays
                signal.set_wakeup_fd(current)


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while sock.recv(4096):
            pass
