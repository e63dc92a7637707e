"""The compiled kernels' start-up: cold compile and warm load, CPU and memory, and how
long a process takes to exit while they compile (``opd_stream.scanner._loader``).

Every number comes from a fresh process with numba's cache pointed at a folder of its own
(``NUMBA_CACHE_DIR``): empty for a cold start, then the same folder for a warm one. Beside
them, numba's own floor: importing it and compiling a trivial function.

    .venv/bin/python -m bench.jit_startup [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: One measured start: CPU seconds and resident memory (MB) before and after, as JSON.
_PROBE = """
import json, sys, time
import numpy, psutil
import opd_stream  # the host has it already: not counted
def rss(): return psutil.Process().memory_info().rss / 2**20
what = sys.argv[1]
r0, c0 = rss(), time.process_time()
if what == "kernels":
    from opd_stream.scanner import _loader
    assert _loader.prepare()
    from opd_stream.scanner._calls import KERNELS
    hits = sum(sum(k.stats.cache_hits.values()) for k in KERNELS)
else:
    import numba
    c1 = time.process_time()
    @numba.njit
    def f(x):
        return x + 1
    f(1)
    hits = 0
print(json.dumps({"cpu_s": time.process_time() - c0, "rss_mb": rss() - r0,
                  "import_numba_cpu_s": (c1 - c0) if what != "kernels" else None,
                  "cache_hits": hits}))
"""

#: A host whose work is done after a second: it starts the kernels (cold) and ends; the
#: time from its last line to its exit is what the kernels cost it. ``numba``: a host that
#: only imports numba, the floor of that exit (numba's own teardown).
_HOST = """
import sys, time
from opd_stream.scanner import _loader
if sys.argv[1] == "numba":
    import numba
else:
    _loader.start()
time.sleep(1.0)
print(time.time(), _loader.available(), flush=True)
"""


def _run(code: str, cache: Path, *args: str) -> tuple[str, float]:
    """``code``'s output and when it ended; whatever it left running is then ended."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        out, _ = proc.communicate()
        ended = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode:
        raise RuntimeError(f"exit {proc.returncode}")
    return out, ended


def _child_cpu(cache: Path) -> float:
    """CPU seconds of the compiling process alone (what a cold start costs the machine)."""
    from opd_stream.scanner import _loader

    before = os.times()
    _run(_loader._CHILD, cache, str(ROOT))
    after = os.times()
    return (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )


def measure(reps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        out.setdefault(name, []).append(round(value, 3))

    for _ in range(reps):
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp)
            floor = json.loads(_run(_PROBE, cache / "floor", "trivial")[0])
            add("numba import, CPU s", floor["import_numba_cpu_s"])
            add("numba import + trivial njit, CPU s", floor["cpu_s"])
            add("numba import + trivial njit, RSS MB", floor["rss_mb"])
            cold = json.loads(_run(_PROBE, cache / "a", "kernels")[0])
            add("cold in-process compile, CPU s", cold["cpu_s"])
            add("cold in-process compile, RSS MB", cold["rss_mb"])
            warm = json.loads(_run(_PROBE, cache / "a", "kernels")[0])
            add("warm load, CPU s", warm["cpu_s"])
            add("warm load, RSS MB", warm["rss_mb"])
            add("warm load, kernels from the cache", warm["cache_hits"])
            add("cold compile in its own process, CPU s", _child_cpu(cache / "b"))
            line, ended = _run(_HOST, cache / "c", "kernels")
            printed, ready = line.split()
            add("host exit after its work, cold compile running, s", ended - float(printed))
            add("host saw the kernels ready (1 = yes)", float(ready == "True"))
            line, ended = _run(_HOST, cache / "d", "numba")
            add("floor: exit of a host that imported numba, s", ended - float(line.split()[0]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    for name, values in measure(args.reps).items():
        print(f"{name:55s} {' '.join(f'{v:8.3f}' for v in values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
