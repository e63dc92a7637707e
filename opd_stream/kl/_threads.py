"""The KL stage's torch ops on one intra-op thread, for the calling thread only.

:func:`one_intraop_thread` sets OpenMP's ``nthreads-var`` of the calling thread only
(``omp_set_num_threads`` in the OpenMP runtime torch loaded), runs the function and sets it
back: the KL's many short ops never wake torch's OpenMP pool, and no other thread (nor later
host work on the same thread) sees a difference; ``torch.set_num_threads``, in part
process-wide, is the host's and left alone. Where no such runtime is found, or setting it
has no effect on ``torch.get_num_threads()``, the function runs as it is. Why (the
measurement): ``docs/design-notes.md``, "opd_stream/kl/_threads.py".
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ("one_intraop_thread",)

T = TypeVar("T")

_RUNTIME = re.compile(r"/lib(gomp|omp|iomp5)[^/]*\.so[.\d]*$")
_lock = threading.Lock()
_looked = False
_calls: tuple[Callable[[], int], Callable[[int], Any]] | None = None


def _runtime_path(torch_dir: str) -> str | None:
    """The OpenMP runtime mapped into this process that torch uses: the one in torch's own
    folder, else the only one mapped; ``None`` when there is none, or no way to tell."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if _RUNTIME.search(line.rstrip())}
    except OSError:
        return None
    own = sorted(p for p in paths if p.startswith(torch_dir + os.sep))
    if own:
        return own[0]
    return paths.pop() if len(paths) == 1 else None


def _openmp() -> tuple[Callable[[], int], Callable[[int], Any]] | None:
    """``omp_get_max_threads`` and ``omp_set_num_threads`` of torch's OpenMP runtime."""
    global _looked, _calls
    with _lock:
        if not _looked:
            _looked = True
            import torch

            path = _runtime_path(os.path.dirname(os.path.abspath(torch.__file__)))
            if path is not None:
                try:
                    lib = ctypes.CDLL(path)
                    get, put = lib.omp_get_max_threads, lib.omp_set_num_threads
                except (OSError, AttributeError):
                    return None
                get.argtypes, get.restype = [], ctypes.c_int
                put.argtypes, put.restype = [ctypes.c_int], None
                _calls = (get, put)
    return _calls


def one_intraop_thread(fn: Callable[[], T]) -> T:
    """``fn()`` with torch's intra-op ops on one thread in this thread (see the module
    docstring); the thread's setting is as it was afterwards."""
    global _calls
    calls = _openmp()
    if calls is None:
        return fn()
    import torch

    torch.get_num_threads()  # (torch's first look in a thread sets its value: before ours)
    get, put = calls
    before = get()
    if before <= 1:
        return fn()
    put(1)
    try:
        if torch.get_num_threads() != 1:  # not the runtime torch reads: never again
            _calls = None
        return fn()
    finally:
        put(before)
