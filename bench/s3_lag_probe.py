"""Probe: event-loop lag while scoring scenario 3's long answers, outside the bench process.

Scenario 3 measures lag inside the full bench process (after its baseline run); this runs
the same scoring (R = 16384, top-k 64, only-teacher, 16 samples, mock servers) in a fresh
process and prints lag p99 / max, the garbage collections that happened while measuring
and which parser decoded the answers. ``--parser arrow`` hides the compiled scanner (as
without numba). Used to tell the pipeline's own loop holds from the bench process's.

    .venv/bin/python -m bench.s3_lag_probe [--parser jit|arrow] [--samples 16]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from typing import Any

from opd_stream import _jit

from .harness import LagTicker, mocks, run_opd
from .scenarios import REPLAY, STUDENT_SEED, TEACHER_SEED, _config
from .workload import make_samples

__all__ = ("main",)


async def _run(parser: str, n: int) -> None:
    if parser == "arrow":
        _jit._failed = True  # as without numba: pyarrow in the decode threads
    pauses: list[tuple[int, float]] = []
    started: dict[str, float] = {}
    measuring = False

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if not measuring:
            return
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            pauses.append((info["generation"], (time.perf_counter() - started["t"]) * 1000))

    gc.callbacks.append(on_gc)
    try:
        with mocks(("teacher", TEACHER_SEED, REPLAY), ("student", STUDENT_SEED, REPLAY)) as procs:
            cfg = _config(procs[0].url, procs[1].url, top_k=64, strategy="only-teacher")
            samples = make_samples(n, 512, 16384, 0)
            await run_opd(cfg, samples[:4])  # warm: imports, compile, the mocks' caches
            gc.collect()
            measuring = True
            async with LagTicker() as lag:
                out = await run_opd(cfg, samples)
            measuring = False
    finally:
        gc.callbacks.remove(on_gc)
    long = [(g, round(ms, 1)) for g, ms in pauses if ms > 10]
    print(f"parser {parser}: lag {lag.summary()}, decoded {out.stats.decoded}")
    print(f"collections while measuring: {len(pauses)}, over 10 ms: {long}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parser", choices=("jit", "arrow"), default="jit")
    ap.add_argument("--samples", type=int, default=16)
    a = ap.parse_args()
    asyncio.run(_run(a.parser, a.samples))


if __name__ == "__main__":
    main()
