"""How the event loop reads answers of 1-4 MiB, before and after session 21, in one run.

Before: the compiled scanner read an answer from ``SLICED_FROM`` (1 MiB) on 256 KiB at a
time, one answer at a time, the loop's turn between two slices; the next answer's read
could start in the turn the last one ended. Now: 1 MiB at a time (a rest under a quarter of
it with the slice before, so an answer of 1-1.25 MiB is read in one slice), and one more
turn of the loop after an answer's last slice before the next answer's read starts
(``fetch._attempts.AttemptSender._decode_on_loop``).

One stream is kept open and the two policies take turns burst by burst (the policy is put
in place between two bursts; the order of the two alternates every round, so a drift of
the machine touches both alike). For each: the client CPU of a burst per sample (median,
the mean of the cheaper half, the least), the loop's lag (a 1 ms ticker over a few bursts
more: p50, p99, max), and a check that both score every sample alike. Mock SGLang servers
run as subprocesses, as in ``bench.cpu_burst`` (the issue's sizes by default: 24 x (512 +
2048), top-k 16, only-student, per-position; ~1.1 MB answers).

Run::

    .venv/bin/python -m bench.loop_slices [--rounds 24] [--arrays | --rows] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from opd_stream import OPDStream, Sample, ScoredSample
from opd_stream.fetch import _attempts, _threads
from opd_stream.wire._codec import Parser

from .harness import ClientMeter, LagTicker, mocks, pid_list
from .scenarios import REPLAY, _config, _settle
from .workload import STUDENT_SEED, TEACHER_SEED, make_samples

__all__ = ("main",)

_BEFORE_SLICE = 256 * 1024


async def _read_before(self: Any, body: Any, req: Any, lay: Any) -> tuple[Any, Parser]:
    """The loop's read as it was before session 21: the slices (256 KiB while the policy is
    in place), no turn after the last (the scan's rule for a short rest, under a quarter of
    a slice, is today's for both)."""
    async with self._parsing:
        got: tuple[Any, Parser] = await self._read_in_slices(body, req, lay)
    return got


@contextmanager
def _policy(before: bool) -> Iterator[None]:
    """The loop's read of answers of 1-4 MiB as before session 21 (``before``) or as now."""
    now, slices = _attempts.AttemptSender._decode_on_loop, _attempts.SLICE_BYTES
    if before:
        _attempts.AttemptSender._decode_on_loop = _read_before  # type: ignore[method-assign]
        _attempts.SLICE_BYTES = _BEFORE_SLICE
    try:
        yield
    finally:
        _attempts.AttemptSender._decode_on_loop = now  # type: ignore[method-assign]
        _attempts.SLICE_BYTES = slices


async def _burst(stream: OPDStream, samples: list[Sample]) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    async with stream.run(samples) as results:
        async for r in results:
            if not isinstance(r, ScoredSample) or r.reverse_kl is None:
                raise RuntimeError(f"sample {r.index} was not scored: {r}")
            out[r.index] = r.reverse_kl.numpy()
    return out


def _summary(cpu: list[float], lags: list[float]) -> dict[str, float]:
    low = sorted(cpu)[: max(1, len(cpu) // 2)]
    a = np.asarray(lags) * 1e3
    return {
        "cpu_ms_per_sample_median": statistics.median(cpu),
        "cpu_ms_per_sample_cheaper_half": statistics.mean(low),
        "cpu_ms_per_sample_least": min(cpu),
        "lag_p50_ms": float(np.percentile(a, 50)) if a.size else float("nan"),
        "lag_p99_ms": float(np.percentile(a, 99)) if a.size else float("nan"),
        "lag_max_ms": float(a.max()) if a.size else float("nan"),
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    if args.sliced_from is not None:  # (a smoke test's small answers through the same path)
        _threads.SLICED_FROM = args.sliced_from
    with mocks(("teacher", TEACHER_SEED, REPLAY), ("student", STUDENT_SEED, REPLAY)) as procs:
        pids = pid_list(procs)
        cfg = _config(procs[0].url, procs[1].url, top_k=args.k, strategy="only-student")
        samples = make_samples(args.n, args.prompt, args.response, args.k, topk_arrays=args.arrays)
        cpu: dict[bool, list[float]] = {True: [], False: []}
        lags: dict[bool, list[float]] = {True: [], False: []}
        signal: dict[bool, dict[int, np.ndarray]] = {}
        async with OPDStream(cfg) as stream:
            for before in (True, False):  # warm: imports, connections, the mocks' caches
                with _policy(before):
                    signal[before] = await _burst(stream, samples)
            await asyncio.sleep(args.warm_s)  # the kernels (a background thread)
            for rnd in range(args.rounds):
                for before in (True, False) if rnd % 2 == 0 else (False, True):
                    with _policy(before):
                        _settle()
                        with ClientMeter(pids) as meter:
                            await _burst(stream, samples)
                    cpu[before].append(meter.cpu_s / len(samples) * 1e3)
            for before in (True, False):
                with _policy(before):
                    _settle()
                    for _ in range(args.lag_bursts):
                        async with LagTicker() as ticker:
                            await _burst(stream, samples)
                        lags[before] += ticker.lags
    diff = max(
        float(np.abs(signal[True][i] - signal[False][i]).max(initial=0.0)) for i in signal[True]
    )
    out = {
        "sizes": {k: getattr(args, k) for k in ("n", "prompt", "response", "k", "rounds")},
        "student_topk": "arrays" if args.arrays else "Python rows",
        "before": _summary(cpu[True], lags[True]),
        "now": _summary(cpu[False], lags[False]),
        "max_abs_diff": diff,
    }
    b, a = out["before"], out["now"]
    out["now_over_before"] = {k: a[k] / b[k] for k in b if k.startswith("cpu_") and b[k] > 0}
    return out


def _print(out: dict[str, Any]) -> None:
    s = out["sizes"]
    print(
        f"## {s['n']} x ({s['prompt']} + {s['response']}), k={s['k']}, only-student, "
        f"student top-k as {out['student_topk']}, {s['rounds']} rounds; client CPU ms a "
        "sample, the loop's lag (1 ms ticker)\n"
    )
    print("| the loop's read | median | cheaper half | least | lag p50 | lag p99 | lag max |")
    print("|---|---|---|---|---|---|---|")
    for name, label in (
        ("before", "256 KiB slices (before)"),
        ("now", "1 MiB slices, a turn after"),
    ):
        r = out[name]
        print(
            f"| {label} | {r['cpu_ms_per_sample_median']:.3f} "
            f"| {r['cpu_ms_per_sample_cheaper_half']:.3f} | {r['cpu_ms_per_sample_least']:.3f} "
            f"| {r['lag_p50_ms']:.2f} | {r['lag_p99_ms']:.2f} | {r['lag_max_ms']:.2f} |"
        )
    ratio = out["now_over_before"]
    print(
        f"\nnow / before: median {ratio['cpu_ms_per_sample_median']:.3f}, cheaper half "
        f"{ratio['cpu_ms_per_sample_cheaper_half']:.3f}, least "
        f"{ratio['cpu_ms_per_sample_least']:.3f}; the signal's max |diff| "
        f"{out['max_abs_diff']:.1e}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.loop_slices", description=__doc__.split("\n")[0]
    )
    p.add_argument("--n", type=int, default=24, help="samples a burst")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=2048)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--rounds", type=int, default=24, help="bursts of each policy")
    p.add_argument("--lag-bursts", type=int, default=8, help="bursts of each with the ticker")
    p.add_argument("--warm-s", type=float, default=5.0, help="wait for the kernels (s)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--arrays", dest="arrays", action="store_true", default=True)
    form.add_argument("--rows", dest="arrays", action="store_false", help="Python top-k rows")
    p.add_argument(
        "--sliced-from",
        type=int,
        default=None,
        help="read answers in slices from this many bytes on (default: the library's 1 MiB)",
    )
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args(argv)
    out = asyncio.run(_run(args))
    _print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if out["max_abs_diff"] <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
