"""Bench: a teacher fleet of four replicas, one 5x slower (or failing).

Scores the same samples through ``OPDStream`` against four in-process mock SGLang replicas
(real HTTP on 127.0.0.1) and reports throughput and latency percentiles for:

* ``round-robin``: no balancing (what a naive client does);
* ``balanced``: least outstanding requests, power of two choices;
* ``balanced+eject``: plus passive health (a failing replica is ejected);
* ``balanced+hedge``: plus hedging after the p90 latency;
* ``prefix+eject (default)``: the default balance (prefix locality with bounded loads: a
  slow replica holding more prompts in flight than its share takes no new ones).

Usage: ``python bench/replicas.py [--samples N] [--inflight N] [--latency S]
[--slow-factor F] [--fault slow|fail] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from opd_stream import OPDStream, Sample, ScoredSample, StreamConfig
from opd_stream.testing.mock_sglang import MockOptions, serve_mock

SCENARIOS: dict[str, dict[str, Any]] = {
    "round-robin": {"balance": "round-robin", "eject_after_failures": 0},
    "balanced": {"balance": "least-outstanding", "eject_after_failures": 0},
    "balanced+eject": {"balance": "least-outstanding", "eject_after_failures": 3},
    "balanced+hedge": {
        "balance": "least-outstanding",
        "eject_after_failures": 3,
        "hedge_after_percentile": 90.0,
        "hedge_min_s": 0.005,
    },
    "prefix+eject (default)": {"balance": "prefix", "eject_after_failures": 3},
}


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(0, 5000, 48).tolist(), 16, sample_id=i) for i in range(n)]


async def _run_one(
    urls: list[str], scenario: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    cfg = StreamConfig.from_env(
        {},
        teachers={"default": urls},
        kl_device="cpu",
        max_inflight=args.inflight,
        backoff_initial_s=0.005,
        backoff_max_s=0.05,
        **scenario,
    )
    samples = _samples(args.samples)
    start = time.perf_counter()
    async with OPDStream(cfg) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
        stats = stream.stats()
    wall = time.perf_counter() - start
    lat = np.array([r.latency_s for r in out if isinstance(r, ScoredSample)])
    slow = urls[-1]
    return {
        "ok": int(lat.size),
        "failed": len(out) - int(lat.size),
        "throughput_per_s": len(out) / wall,
        "p50_s": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_s": float(np.percentile(lat, 99)) if lat.size else None,
        "slow_replica_requests": stats.endpoints[slow].requests,
        "ejections": sum(e.ejections for e in stats.endpoints.values()),
        "hedges": sum(e.hedges for e in stats.endpoints.values()),
        "retries": stats.retries,
    }


async def _bench(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    options = MockOptions(latency_fixed_s=args.latency)
    report: dict[str, dict[str, Any]] = {}
    async with serve_mock("teacher", 1, replicas=4, options=options) as fleet:
        if args.fault == "slow":
            fleet.set_options(3, latency_fixed_s=args.latency * args.slow_factor)
        else:
            fleet.set_options(3, fault_http_503=1.0)
        for name, scenario in SCENARIOS.items():
            report[name] = await _run_one(fleet.urls, scenario, args)
    return report


def _print(report: dict[str, dict[str, Any]]) -> None:
    cols = [
        "ok",
        "failed",
        "throughput_per_s",
        "p50_s",
        "p99_s",
        "slow_replica_requests",
        "ejections",
        "hedges",
        "retries",
    ]
    print("| scenario | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in report.items():
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the replica scenarios; print a Markdown table; return the numbers."""
    parser = argparse.ArgumentParser(prog="bench/replicas.py", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.02, help="fast replicas, seconds")
    parser.add_argument("--slow-factor", type=float, default=5.0)
    parser.add_argument("--fault", choices=("slow", "fail"), default="slow")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    report = asyncio.run(_bench(args))
    _print(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": report}, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
