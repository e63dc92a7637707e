"""The KL stage's torch ops on one intra-op thread, for the calling thread only.

On CPU, torch runs an op over more elements than its grain size, and some smaller ones, in
its OpenMP pool: each such op wakes the pool's threads, which wait at its end. The KL's ops
are many and short, so the waiting costs far more than the work: an only-student batch of
8 x 2048 positions (k = 16) took 24-48 ms of the process's CPU with torch's default two
threads on the 2-core box, 1.4 ms with one (``python -m bench.cpu_burst`` shows it in a
run). The number of threads is the host's setting (``torch.set_num_threads`` is in part
process-wide), so it is left alone: :func:`one_intraop_thread` sets OpenMP's
``nthreads-var`` of the calling thread only (``omp_set_num_threads``, a per-thread value in
the OpenMP runtime torch loaded; torch reads it as ``torch.get_num_threads()`` in that
thread), runs the function and sets it back, so no other thread, and no later work of the
host's on the same worker thread, sees a difference.

Where torch has no OpenMP runtime this module can find (another threading backend, no
``/proc/self/maps``, several runtimes loaded from outside torch's folder), or setting it has
no effect on ``torch.get_num_threads()``, the function runs as it is.
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
