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

__all__ = ("main",)


@contextlib.contextmanager
def _one_at_a_time() -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    here = os.path.dirname(os.path.abspath(__file__))
    key = hashlib.sha256(f"{here}\0{os.environ.get('NUMBA_CACHE_DIR', '')}".encode()).hexdigest()
    path = os.path.join(tempfile.gettempdir(), f"opd_stream-kernels-{key[:16]}.lock")
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


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
