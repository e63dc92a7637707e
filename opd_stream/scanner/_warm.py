"""The compiling process of :mod:`opd_stream.scanner._loader`: compiles every kernel into numba's
on-disk cache and exits; the process that started it then loads them from there.

Started as ``python -c`` with this package's folder (never the host's ``__main__``), output
to nowhere. Processes that start at once compile one at a time (a lock file per package
folder and cache directory, in the temporary directory): the next finds the cache warm.
A Ctrl-C ends it quietly.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from collections.abc import Iterator

__all__ = ("compiling", "main")


def _lock_path() -> str:
    """The lock file of this package folder and numba cache directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    key = hashlib.sha256(f"{here}\0{os.environ.get('NUMBA_CACHE_DIR', '')}".encode()).hexdigest()
    return os.path.join(tempfile.gettempdir(), f"opd_stream-kernels-{key[:16]}.lock")


@contextlib.contextmanager
def _one_at_a_time() -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(_lock_path(), "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def compiling() -> bool:
    """Whether a compiling process holds the lock now (another process started it): the
    kernels are on their way into the cache. False where there is no lock to look at."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        with open(_lock_path(), "rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock file: nobody compiles
        return False
    return False


def main() -> None:
    """Compile (or find in the cache) every kernel; exit 0, or 1 when numba cannot."""
    try:
        with _one_at_a_time():
            from opd_stream.scanner import _calls

            _calls.warm()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
