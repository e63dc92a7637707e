"""Heavy modules (torch and the KL code, the HTTP client) imported off the caller's event
loop, in a worker thread, with their big shared libraries loaded first without the GIL.

:func:`import_off_loop` is the async entry point (anyio: asyncio and trio).
:func:`preload_torch` loads torch's libraries with ``dlopen`` called through ctypes (the GIL
released), with the files, flags and order of ``torch/__init__.py``, so that the import finds
them loaded; where it cannot follow torch exactly (not Linux, torch imported already, the
CUDA runtime mapped, a custom build, a missing file or failed ``dlopen``) it stops and the
import does the rest as it always did. :data:`loading_lock` keeps two loads of ours (this
one, the compiled scanner's loader) from running at once. Why, step by step, and what still
holds the loop: ``docs/design-notes.md``, "opd_stream/_loading.py".
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence

import anyio.to_thread

__all__ = ("import_off_loop", "is_imported", "loading_lock", "preload_library", "preload_torch")

#: Held by a worker thread of ours while it loads shared libraries or imports modules that
#: map them (here, and the compiled scanner's loader), so that two never run at once.
loading_lock = threading.Lock()

_DLOPEN: Callable[[bytes, int], int | None] | None = None
_dlopen_lock = threading.Lock()
_looked_up = False
_torch_lock = threading.Lock()
_torch_done = False

#: The defaults of ``torch/_utils_internal.py`` that :func:`preload_torch` repeats.
_TORCH_DEFAULTS = (
    re.compile(r"^USE_GLOBAL_DEPS = True$", re.MULTILINE),
    re.compile(r"^USE_RTLD_GLOBAL_WITH_LIBTORCH = False$", re.MULTILINE),
)


def _dlopen() -> Callable[[bytes, int], int | None] | None:
    """libc's ``dlopen`` as a ctypes foreign function (which releases the GIL while it
    runs), or None where there is none to call."""
    global _DLOPEN, _looked_up
    with _dlopen_lock:
        if not _looked_up:
            _looked_up = True
            try:
                function = ctypes.CDLL(None).dlopen
            except (OSError, AttributeError):  # no dlopen in the process's namespace
                return None
            function.restype = ctypes.c_void_p
            function.argtypes = [ctypes.c_char_p, ctypes.c_int]
            _DLOPEN = function
    return _DLOPEN


def preload_library(path: str, mode: int) -> bool:
    """``dlopen(path, mode)`` with the GIL released; whether the library is loaded.

    Blocking (a worker thread's work). Linux only (elsewhere: False, nothing done). The
    handle is never closed: the library stays loaded, as the import that follows keeps it.
    """
    if not sys.platform.startswith("linux") or not os.path.isfile(path):
        return False
    dlopen = _dlopen()
    if dlopen is None:
        return False
    return bool(dlopen(os.fsencode(path), mode))


def is_imported(name: str) -> bool:
    """Whether module ``name`` is imported and done (not still being imported)."""
    module = sys.modules.get(name)
    if module is None:
        return False
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def _torch_dir() -> str | None:
    try:
        spec = importlib.util.find_spec("torch")  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(spec.submodule_search_locations[0])


def _torch_loads_as_expected(torch_dir: str) -> bool:
    if os.environ.get("TORCH_USE_RTLD_GLOBAL"):
        return False
    try:
        with open(os.path.join(torch_dir, "_utils_internal.py"), encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return False
    return all(rule.search(text) for rule in _TORCH_DEFAULTS)


def _cuda_runtime_mapped() -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return "libcudart.so" in f.read()
    except OSError:
        return True  # cannot tell: leave the rest to torch


def preload_torch() -> None:
    """Load torch's shared libraries with the GIL released, as ``import torch`` would load
    them (see the module docstring); blocking, a worker thread's work. Once per process;
    nothing when torch is imported (or being imported) already."""
    global _torch_done
    with _torch_lock:
        if _torch_done or "torch" in sys.modules or not sys.platform.startswith("linux"):
            return
        _torch_done = True
        torch_dir = _torch_dir()
        if torch_dir is None or not _torch_loads_as_expected(torch_dir):
            return
        global_deps = os.path.join(torch_dir, "lib", "libtorch_global_deps.so")
        if not preload_library(global_deps, os.RTLD_NOW | os.RTLD_GLOBAL):
            return
        if _cuda_runtime_mapped():
            return
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            extension = os.path.join(torch_dir, "_C" + suffix)
            if os.path.isfile(extension):
                preload_library(extension, sys.getdlopenflags())
                return


def _import_all(names: Sequence[str], optional: Sequence[str]) -> None:
    with loading_lock:
        if "torch" in names:
            preload_torch()
        for name in names:
            importlib.import_module(name)
        for name in optional:
            # (one not installed: the caller says what is missing, where it needs it)
            with contextlib.suppress(ImportError):
                importlib.import_module(name)


async def import_off_loop(names: Sequence[str], optional: Sequence[str] = ()) -> float:
    """Import the modules ``names``, then those of ``optional`` that are installed, in a
    worker thread (torch's libraries preloaded first when ``"torch"`` is among them); at
    once when all are imported already. Returns the CPU seconds of the thread that
    imported them (0 when nothing was left to import).

    Raises:
        ImportError: a module of ``names`` cannot be imported.
    """
    todo = [name for name in names if not is_imported(name)]
    maybe = [name for name in optional if not is_imported(name)]
    if not (todo or maybe):
        return 0.0

    def timed() -> float:
        start = time.thread_time()
        _import_all(todo, maybe)
        return time.thread_time() - start

    return await anyio.to_thread.run_sync(timed)
