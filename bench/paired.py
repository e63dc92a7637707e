"""Two stream settings against each other in one process, burst by burst, paired.

A single ``bench.cpu_burst`` run moves by +-10% on a shared machine (a run, or one mode of
it, can land in a slow spell), so a change of a few percent cannot be told from it. Here
two streams are kept open on the same mock servers and the same samples, one with the
settings ``--a`` (default: none changed), one with ``--b``; they take turns burst by burst,
the order swapped every pair, so whatever the machine does touches both alike. What is
reported is the median over the pairs of each pair's ratio ``B / A`` of client CPU per
sample, with a distribution-free 95% interval of that median (order statistics of the
ratios), beside each side's median CPU by step (``stats().cpu_s``) and wall time. Every
sample must be scored by both streams (else the exit status is 1).

The issue 35 sizes by default (24 x (512 + 2048), top-k 16, only-student, per-position;
``--rows`` for the student's top-k as Python rows, arrays otherwise). Run::

    .venv/bin/python -m bench.paired --b '{"candidates": false}' [--seconds 120] [--rows]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opd_stream import OPDStream, Sample, ScoredSample

from .harness import ClientMeter, mocks, pid_list
from .scenarios import REPLAY, _config, _settle
from .workload import STUDENT_SEED, TEACHER_SEED, make_samples

__all__ = ("main", "median_interval")

_WARM_BURSTS = 3


def median_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float] | None:
    """A distribution-free interval of the median of ``values`` (the order statistics
    ``n/2 -+ z sqrt(n)/2``, the normal approximation of the binomial); ``None`` under 6
    values, where it says nothing."""
    n = len(values)
    if n < 6:
        return None
    ordered = sorted(values)
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return ordered[lo], ordered[hi]


@dataclass
class _Side:
    """One stream's bursts: CPU ms per sample, wall ms per burst, the steps' ms per sample."""

    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    steps: list[dict[str, float]] = field(default_factory=list)
    unscored: int = 0

    def summary(self) -> dict[str, Any]:
        med = statistics.median
        names = self.steps[0] if self.steps else {}
        return {
            "cpu_ms_per_sample_median": med(self.cpu),
            "cpu_ms_per_sample_least": min(self.cpu),
            "wall_ms_per_burst_median": med(self.wall),
            "by_step_ms_per_sample_median": {k: med(s[k] for s in self.steps) for k in names},
            "unscored": self.unscored,
        }


async def _burst(stream: OPDStream, samples: list[Sample], pids: list[int], side: _Side) -> None:
    _settle()
    n = len(samples)
    scored = 0
    with ClientMeter(pids) as meter:
        before = stream.stats().cpu_s.as_dict()  # (after the meter's own gc.collect)
        start = time.perf_counter()
        async with stream.run(samples) as results:
            async for item in results:
                scored += isinstance(item, ScoredSample)
        wall = time.perf_counter() - start
        after = stream.stats().cpu_s.as_dict()  # (before the meter's own reads)
    side.cpu.append(meter.cpu_s / n * 1e3)
    side.wall.append(wall * 1e3)
    side.steps.append({k: (after[k] - before[k]) / n * 1e3 for k in after})
    side.unscored += n - scored


async def run_pairs(args: argparse.Namespace) -> dict[str, Any]:
    """Open both streams, warm them, then run pairs until ``args.seconds`` have passed
    (``args.min_pairs`` at least)."""
    a_change, b_change = json.loads(args.a), json.loads(args.b)
    with mocks(("teacher", TEACHER_SEED, REPLAY), ("student", STUDENT_SEED, REPLAY)) as procs:
        base = _config(procs[0].url, procs[1].url, top_k=args.k, strategy="only-student")
        samples = make_samples(
            args.n, args.prompt, args.response, args.k, topk_arrays=not args.rows
        )
        pids = pid_list(procs)
        a, b = _Side(), _Side()
        async with (
            OPDStream(base.evolve(**a_change)) as sa,
            OPDStream(base.evolve(**b_change)) as sb,
        ):
            for _ in range(_WARM_BURSTS):  # imports, the kernels, the connections
                await _burst(sa, samples, pids, _Side())
                await _burst(sb, samples, pids, _Side())
            end = time.monotonic() + args.seconds
            pairs = 0
            while pairs < args.min_pairs or time.monotonic() < end:
                order = ((sa, a), (sb, b)) if pairs % 2 == 0 else ((sb, b), (sa, a))
                for stream, side in order:
                    await _burst(stream, samples, pids, side)
                pairs += 1
    ratios = [y / x for x, y in zip(a.cpu, b.cpu, strict=True)]
    interval = median_interval(ratios)
    return {
        "sizes": {
            "n": args.n,
            "prompt": args.prompt,
            "response": args.response,
            "k": args.k,
            "student_topk": "Python rows" if args.rows else "arrays",
        },
        "a": a_change,
        "b": b_change,
        "pairs": len(ratios),
        "b_over_a_median": statistics.median(ratios),
        "b_over_a_interval_95": list(interval) if interval else None,
        "a_side": a.summary(),
        "b_side": b.summary(),
    }


def _print(out: dict[str, Any]) -> None:
    s = out["sizes"]
    print(
        f"## {s['n']} x ({s['prompt']} + {s['response']}), k={s['k']}, only-student, "
        f"{s['student_topk']}; {out['pairs']} pairs\n"
    )
    iv = out["b_over_a_interval_95"]
    shown = "-" if iv is None else f"{iv[0]:.3f}-{iv[1]:.3f}"
    print(f"B / A, client CPU a sample (median of the pairs' ratios): {out['b_over_a_median']:.3f}")
    print(f"95% interval of that median: {shown}\n")
    print("| side | settings | CPU ms a sample (median / least) | wall ms a burst | unscored |")
    print("|---|---|---|---|---|")
    for key, name in (("a_side", "a"), ("b_side", "b")):
        m = out[key]
        print(
            f"| {name.upper()} | `{json.dumps(out[name])}` | "
            f"{m['cpu_ms_per_sample_median']:.3f} / {m['cpu_ms_per_sample_least']:.3f} | "
            f"{m['wall_ms_per_burst_median']:.1f} | {m['unscored']} |"
        )
    steps = out["a_side"]["by_step_ms_per_sample_median"]
    print("\n| step (median ms a sample) | A | B |")
    print("|---|---|---|")
    for k in steps:
        b = out["b_side"]["by_step_ms_per_sample_median"][k]
        print(f"| {k} | {steps[k]:.3f} | {b:.3f} |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.paired",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--a", default="{}", help="settings of stream A (JSON, StreamConfig names)")
    p.add_argument("--b", default="{}", help="settings of stream B (JSON, StreamConfig names)")
    p.add_argument("--seconds", type=float, default=120.0, help="time for the pairs")
    p.add_argument("--min-pairs", type=int, default=4)
    p.add_argument("--rows", action="store_true", help="the student's top-k as Python rows")
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=2048)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--json", help="also write every number here")
    args = p.parse_args(argv)
    out = asyncio.run(run_pairs(args))
    _print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 1 if out["a_side"]["unscored"] or out["b_side"]["unscored"] else 0


if __name__ == "__main__":
    sys.exit(main())
