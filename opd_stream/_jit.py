"""The compiled kernels (:mod:`opd_stream._jit_kernel`, :mod:`opd_stream._jit_ids`, numba,
called through :mod:`opd_stream._jit_calls`): compiled once per process,
off the event loop, or never.

numba is optional (the ``jit`` extra). :func:`prepare` imports it and compiles the kernels
(about 10-15 s of CPU on a 2-core machine the first time; about 0.4 s in later processes,
from numba's on-disk cache next to the module or in the user's cache directory). It is
called, blocking, in a decode thread as each stream starts (and by any worker thread that
builds a payload or decodes an answer before it is done);
while it runs, and after a failure (numba missing, too old for this numpy, or
``NUMBA_DISABLE_JIT`` set, under which the kernels would run as Python byte by byte, or
a big-endian machine),
:func:`compiled` gives ``None`` and the callers use their other paths. A failure is logged
once at DEBUG and never retried. Compiling allocates heavily, so it may set off one full
garbage collection of the host's heap (a one-time pause of the loop, ~35-50 ms measured).
"""

from __future__ import annotations

import logging
import sys
import threading
from types import ModuleType

__all__ = ("available", "compiled", "prepare", "unavailable_reason")

_log = logging.getLogger("opd_stream")
_lock = threading.Lock()
_kernel: ModuleType | None = None
_failed = False


def compiled() -> ModuleType | None:
    """The compiled kernels' module, or ``None`` (not compiled yet, or unavailable)."""
    return _kernel


def available() -> bool:
    """Whether the kernels are compiled and ready."""
    return _kernel is not None


def prepare() -> bool:
    """Compile (or load from numba's cache) the kernels, blocking; whether they are usable.

    Thread-safe: while one thread compiles, another caller gets ``False`` at once (its
    work takes another path). Never call it on the event loop.
    """
    global _kernel, _failed
    if _kernel is not None:
        return True
    if _failed or not _lock.acquire(blocking=False):
        return False
    try:
        if _kernel is None and not _failed:
            import numba

            if getattr(numba.config, "DISABLE_JIT", False):  # it would run as Python
                raise RuntimeError("NUMBA_DISABLE_JIT is set")
            if sys.byteorder != "little":  # the scan reads 8 bytes as a little-endian word
                raise RuntimeError("a big-endian machine")
            from . import _jit_calls

            _jit_calls.warm()
            _kernel = _jit_calls
    except Exception as exc:  # numba absent or unusable here: the other paths remain
        _failed = True
        _log.debug("opd_stream: compiled kernels unavailable: %s", type(exc).__name__)
    finally:
        _lock.release()
    return _kernel is not None


def unavailable_reason() -> str | None:
    """Why the compiled scanner cannot run in this process, or ``None`` when it can (or
    may: the compile itself can still fail, e.g. numba too old for this numpy). Cheap:
    numba is looked up, not imported; nothing is compiled."""
    import importlib.util
    import os

    if _kernel is not None:
        return None
    if _failed:
        return "numba failed to load or compile the kernels in this process"
    if importlib.util.find_spec("numba") is None:
        return "numba is not installed"
    if os.environ.get("NUMBA_DISABLE_JIT", "0").strip() not in ("", "0"):
        return "NUMBA_DISABLE_JIT is set"
    if sys.byteorder != "little":
        return "a big-endian machine"
    return None
