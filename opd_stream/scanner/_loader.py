"""The compiled kernels (:mod:`opd_stream.scanner._scan`, :mod:`opd_stream.scanner._ids`, numba,
called through :mod:`opd_stream.scanner._calls`): made ready once per process, in the
background, never waited for.

:func:`start` returns at once; a daemon thread loads the kernels from numba's cache, having
them compiled first by a process of its own where the cache lacks them. Until they are
ready, and after a failure (logged once at DEBUG, never retried), :func:`compiled` gives
``None`` and callers use msgspec and numpy; then :class:`~opd_stream.scanner._types.Kernels`.
A command about to exit calls :func:`settle`; nothing is printed (the CLI asks for its line
with :func:`announce_compile`). The thread holds the loop no more than 50 ms. Costs and
how: ``docs/design-notes.md``, "opd_stream/scanner/_loader.py".
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from . import _warm
from ._types import Kernels

__all__ = (
    "announce_compile",
    "available",
    "compiled",
    "cpu_seconds",
    "prepare",
    "settle",
    "start",
    "unavailable_reason",
)


_log = logging.getLogger("opd_stream")
_start_lock = threading.Lock()
_compile_lock = threading.Lock()
_kernel: Kernels | None = None
_failed = False
_thread: threading.Thread | None = None
_notice: Callable[[], None] | None = None
_exiting = threading.Event()  # settle(): the command exits, the thread loads nothing more
_compiling: subprocess.Popen[bytes] | None = None  # the compiling process, once started
_spent = 0.0  # CPU seconds of the threads of start() that ended, and of compiling processes
_clock: int | None = None  # the CPU clock of the thread of start() while it runs

#: What the compiling process runs (``sys.argv[1]``: the folder that holds this package, so
#: that it compiles these very files).
_CHILD = (
    "import sys; sys.path.insert(0, sys.argv[1]); from opd_stream.scanner._warm import main; main()"
)


def compiled() -> Kernels | None:
    """The compiled kernels, or ``None`` (not ready yet, or unavailable)."""
    return _kernel


def available() -> bool:
    """Whether the kernels are compiled and ready."""
    return _kernel is not None


def announce_compile(notice: Callable[[], None] | None) -> None:
    """Have ``notice`` called (from the background thread) when the kernels must be compiled
    rather than loaded from the cache, and no other process is compiling them already (it
    said so): the CLI's one line. Library use sets none."""
    global _notice
    _notice = notice


def settle() -> None:
    """For a command about to exit (the CLI; never a library): return once the background
    thread has ended. A thread importing numba or loading the kernels is waited for (a
    fraction of a second; a compile in this process, where none can run apart, for all of
    it); one waiting for the compiling process stops waiting (that process fills the cache
    on its own) and loads nothing.

    Python must not run in that daemon thread while the interpreter shuts down: a garbage
    collection there that frees a tensor made by ``torch.from_numpy`` re-takes the GIL in
    torch's C++, the finalising interpreter ends the thread there, and the process aborts
    ("terminate called without an active exception", exit 134).
    """
    thread = _thread
    if thread is None or thread is threading.current_thread():
        return
    _exiting.set()
    try:
        thread.join()
    finally:
        _exiting.clear()


def start() -> bool:
    """Make the kernels ready in the background (see the module docstring); returns at once:
    whether this call started the thread that does it.

    Does nothing when they are ready, unavailable, or already on their way.
    """
    global _thread
    with _start_lock:
        if _kernel is not None or _failed or (_thread is not None and _thread.is_alive()):
            return False
        _thread = threading.Thread(target=_background, name="opd_stream.kernels", daemon=True)
        _thread.start()
        return True


def cpu_seconds() -> float:
    """The CPU seconds spent making the kernels ready in this process so far: the threads
    of :func:`start` (numba's import, the load from its cache, or a compile here) and the
    processes that compiled them into the cache (counted once each has ended)."""
    clock = _clock
    live = 0.0
    if clock is not None:
        try:
            live = time.clock_gettime(clock)
        except OSError:  # (the thread has just ended: counted in _spent)
            live = 0.0
    return _spent + live


def prepare() -> bool:
    """Compile (or load from numba's cache) the kernels in this thread, blocking; whether
    they are usable. Thread-safe (a second caller waits for the first). The background
    thread of :func:`start` calls it; so do tests and benchmarks. Never on the event loop.
    """
    global _kernel, _failed
    if _kernel is not None:
        return True
    with _compile_lock:
        if _kernel is None and not _failed:
            try:
                _check_usable()
                from . import _calls

                _calls.warm()
                _kernel = _calls
            except Exception as exc:  # numba absent or unusable here: msgspec remains
                _failed = True
                _log.debug("opd_stream: compiled kernels unavailable: %s", type(exc).__name__)
    return _kernel is not None


def unavailable_reason() -> str | None:
    """Why the compiled scanner cannot run in this process, or ``None`` when it can (or
    may: the compile itself can still fail, e.g. numba too old for this numpy). Cheap:
    numba is looked up, not imported; nothing is compiled."""
    import importlib.util

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


def _check_usable() -> None:
    import numba

    if getattr(numba.config, "DISABLE_JIT", False):  # it would run as Python
        raise RuntimeError("NUMBA_DISABLE_JIT is set")
    if sys.byteorder != "little":  # the scan reads 8 bytes as a little-endian word
        raise RuntimeError("a big-endian machine")


def _preload_llvm() -> None:
    """llvmlite's shared library, loaded with the GIL released before llvmlite loads it
    (see the module docstring): ``ctypes.CDLL(path)``'s flags, ``RTLD_NOW | RTLD_LOCAL``."""
    import importlib.util

    from .._loading import preload_library

    if "llvmlite.binding.ffi" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("llvmlite")
    except (ImportError, ValueError):
        return
    if spec is not None and spec.submodule_search_locations:
        folder = spec.submodule_search_locations[0]
        preload_library(
            os.path.join(folder, "binding", "libllvmlite.so"), os.RTLD_NOW | os.RTLD_LOCAL
        )


def _background() -> None:
    """The daemon thread of :func:`start`, its CPU counted (:func:`cpu_seconds`)."""
    global _clock, _spent
    try:
        _clock = time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        _clock = None
    try:
        _make_ready()
    finally:
        _spent += time.thread_time()  # (the thread's CPU since it started)
        _clock = None


def _make_ready() -> None:
    """What the thread of :func:`start` does; what it loads in this process, it loads under
    :data:`opd_stream._loading.loading_lock` (never at once with torch's loading)."""
    from .._loading import loading_lock

    state = "none"
    with loading_lock:
        try:
            _preload_llvm()
        except Exception as exc:  # (the import loads it then)
            _log.debug("opd_stream: llvmlite not preloaded: %s", type(exc).__name__)
        try:
            state = _cache_state()
        except Exception as exc:
            _log.debug("opd_stream: kernel cache not read: %s", type(exc).__name__)
    try:
        if state == "cold" and not _exiting.is_set():
            if _notice is not None and not _warm.compiling():  # (else the compiling one did)
                _notice()
            if not _compile_elsewhere():
                return  # the command exits, or the compile was interrupted: load nothing
    except Exception as exc:  # then compile here, below
        _log.debug("opd_stream: kernels not compiled apart: %s", type(exc).__name__)
    if _exiting.is_set():
        return  # the command exits (settle): load nothing
    if _cache_state() == "warm":  # loaded from the cache: ~0.4 s
        with loading_lock:
            prepare()
    else:  # compiled here: seconds, not keeping a stream from loading torch meanwhile
        prepare()


def _cache_state() -> str:
    """``"warm"`` when numba's cache holds every kernel for these sources (a cheap look at
    its index files; a wrong guess costs only a compile in this process), ``"cold"`` when
    it lacks one, ``"none"`` when there is no cache to fill (numba unusable, or no
    writable place for it: then :func:`prepare` says why, or compiles here)."""
    try:
        _check_usable()
    except Exception:
        return "none"
    try:
        from . import _calls

        files = [k._cache._cache_file for k in _calls.KERNELS]
    except Exception:  # no cache (numba compiled them uncached), or another numba
        return "none"
    try:
        return "warm" if all(f._load_index() for f in files) else "cold"
    except Exception:  # an unreadable index: the other process rewrites it
        return "cold"


def _compile_elsewhere() -> bool:
    """Compile the kernels into numba's cache in a process of its own, and wait for it;
    False when :func:`settle` stopped the wait or the process was interrupted (a Ctrl-C
    in the terminal: the next stream to start tries again)."""
    global _compiling
    if not sys.executable:
        raise RuntimeError("no interpreter to start")
    # the directory that holds the package: opd_stream/scanner/_loader.py, three up
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # one that a settle stopped waiting for, and that still runs, is waited for again (a
    # second would only wait for its lock, and the first's Popen would be dropped running)
    proc = _compiling
    if proc is None or _reap(proc) is not None:
        proc = _compiling = subprocess.Popen(
            [sys.executable, "-c", _CHILD, here],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    while (code := _reap(proc)) is None:
        if _exiting.wait(0.1):
            return False
    return code >= 0 and code != 130  # (_warm: Ctrl-C)


def _reap(proc: subprocess.Popen[bytes]) -> int | None:
    """``proc``'s exit code once it has ended, its CPU added to :func:`cpu_seconds` (reaped
    here with ``wait4``, which tells it), else ``None``."""
    global _spent
    if proc.returncode is not None:
        return proc.returncode
    try:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere: its CPU is not known here
        return proc.poll()
    if pid == 0:
        return None
    _spent += usage.ru_utime + usage.ru_stime
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode


def _after_fork() -> None:
    global _thread
    _thread = None  # the thread did not survive the fork: start() may start another


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
