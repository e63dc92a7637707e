"""Client CPU of one burst, around the parse (issue 35), in one run.

The issue's sizes by default: 24 samples, prompt 512, response 2048, top-k 16, only-student,
per-position ids, the student's top-k as Python rows (as Miles hands them over) and as
``(ids, logprobs)`` arrays. Mock SGLang servers run as subprocesses (replaying their
answers, so they cost the client's cores little); the client's CPU is this process's (all
threads, ``ClientMeter``). In one run, interleaved over ``--reps`` repeats (the least of
each is kept: noise on a shared machine only ever adds):

* the baseline (``bench.baseline``: Miles' way, per-position ids on a patched server);
* Miles' own scorer (``bench.miles_scorer``: ``reward_func`` and ``post_process_rewards``
  from radixark/miles, where its source is at hand), its signal checked against
  ``opd_stream``'s: what the baseline stands in for, measured beside it;
* ``opd_stream``, a stream opened per burst, with its CPU by step (``stats().cpu_s``) and
  the remainder no step names;
* the same bursts through the aiohttp transport (the default before 1.x's asyncio
  transport: the transport's share, before and after, in one run);
* the same bursts through a stream kept open (a rollout loop's other choice), four
  streams taking turns: the default, as before session 19 (``offload_bytes`` = 1 MiB:
  answers from 1 MiB parsed in decode threads, and, as before session 20, Python top-k
  rows converted in a worker thread), with every answer, body and sample on the event
  loop (``offload_bytes`` above every answer), and the default with the signal alone
  (``candidates=False``, what the Miles adapter asks for), each with its CPU by step, the
  wall time of a burst and the loop's lag (the trade ``offload_bytes`` makes);
* the parse of the very answers alone: msgspec's untyped decode (GC off) and
  ``opd_stream``'s compiled scanner with every check (both modes parse the same answers:
  each floor is the least of its two measurements);
* the same work with no pipeline around it (``bench.bare_client``: one sample after
  another, each step the fastest known way), its signal checked equal to ``opd_stream``'s;
* short runs, each in a fresh process: a cold one (numba's cache empty: the kernels are
  compiled by a process of their own), and an 8-sample one with the cache filled; each
  says which parser decoded how many bytes, and what the background work cost.

Run::

    .venv/bin/python -m bench.cpu_burst [--n 24] [--response 2048] [--reps 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from opd_stream import AiohttpTransport, OPDStream, Sample
from opd_stream.scanner._loader import prepare
from opd_stream.wire._codec import decode_score_response

from .bare_client import bare_reverse_kl
from .baseline import baseline_score
from .harness import ClientMeter, LagTicker, mocks, pid_list
from .miles_scorer import load_miles_scorer
from .scenarios import REPLAY, _best_cpu, _config, _each, _fetch_bodies, _settle
from .workload import STUDENT_SEED, TEACHER_SEED, make_samples

__all__ = ("main",)

_MODES = (("Python rows", False), ("array rows", True))
_ABOVE_EVERY_ANSWER = 1 << 40  # offload_bytes: no answer is parsed in a decode thread
_THREADS_BEFORE = 1 << 20  # offload_bytes before session 19: answers from 1 MiB in threads
# (and this sample's Python rows too, ~512 KiB of msgpack: in a thread from 256 KiB)


async def _opd_burst(
    cfg: Any, samples: list[Sample], pids: list[int], *, aiohttp: bool = False
) -> tuple[float, dict[str, float]]:
    """One burst through a stream of its own: client CPU, and ``stats().cpu_s``
    (``aiohttp``: through :class:`AiohttpTransport`, not the default transport)."""
    transport = AiohttpTransport() if aiohttp else None
    with ClientMeter(pids) as meter:
        async with OPDStream(cfg, transport=transport) as stream, stream.run(samples) as results:
            async for _ in results:
                pass
    return meter.cpu_s, stream.stats().cpu_s.as_dict()  # (read once the stream is left)


async def _opd_reverse_kl(cfg: Any, samples: list[Sample]) -> list[npt.NDArray[np.float32]]:
    """``opd_stream``'s reverse KL of each sample, in input order (what the other clients'
    signals are checked against)."""
    async with OPDStream(cfg) as stream, stream.run(samples) as results:
        ours = {r.index: r.reverse_kl.numpy() async for r in results}  # type: ignore[union-attr]
    return [ours[i] for i in range(len(samples))]


def _max_diff(ours: list[npt.NDArray[np.float32]], theirs: list[npt.NDArray[np.float32]]) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs, strict=True))


def _bare_burst(samples: list[Sample], teacher: str, k: int, pids: list[int]) -> float:
    with ClientMeter(pids) as meter:
        bare_reverse_kl(samples, teacher, k)
    return meter.cpu_s


@dataclass
class _Kept:
    """What :func:`_kept_bursts` measured: the least client CPU of a burst (s), that
    burst's ``stats().cpu_s``, the least page faults of this process in a burst, the least
    wall time of a burst (s), and the event loop's lag in one more burst (ms)."""

    cpu: float
    steps: dict[str, float]
    faults: float
    wall: float
    lag: dict[str, float | None]


async def _kept_bursts(
    cfgs: list[Any], samples: list[Sample], pids: list[int], reps: int
) -> list[_Kept]:
    """Bursts through one stream per config, each kept open across ``reps`` and the configs
    taking turns burst by burst, the first of a round another each round (a drift of the
    machine touches them alike; the first round warms the streams' connections and is not
    counted). Each burst's meter runs on
    for 50 ms after its last result (idle: the stream's own work after a run, e.g. a
    release of freed memory with ``release_memory_after_s=0``, is counted with the run).
    One burst more each, not metered, measures the loop's lag (``LagTicker``: its 1 ms
    wake-ups would cost CPU of their own)."""
    best = [float("inf")] * len(cfgs)
    steps: list[dict[str, float]] = [{} for _ in cfgs]
    faults = [float("inf")] * len(cfgs)
    wall = [float("inf")] * len(cfgs)
    lags: list[dict[str, float | None]] = []
    async with contextlib.AsyncExitStack() as streams:
        opened = [await streams.enter_async_context(OPDStream(cfg)) for cfg in cfgs]

        async def burst(stream: OPDStream) -> float:
            start = time.perf_counter()
            async with stream.run(samples) as results:
                async for _ in results:
                    pass
            return time.perf_counter() - start

        for rep in range(reps + 1):
            # each stream takes each place in the turn in turn: the place costs something
            # of its own (with array rows the default, always first, read 3-9% above the
            # stream on the loop, the same work for these answers, in five runs of six)
            turn = rep % len(opened)
            for n in [*range(turn, len(opened)), *range(turn)]:
                stream = opened[n]
                _settle()
                with ClientMeter(pids) as meter:
                    before = stream.stats().cpu_s.as_dict()  # (after the meter's gc.collect)
                    faults_at = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    took = await burst(stream)
                    await asyncio.sleep(0.05)
                    after = stream.stats().cpu_s.as_dict()  # (before the meter's own reads)
                    if rep:
                        faults[n] = min(
                            faults[n],
                            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_at,
                        )
                if rep:
                    wall[n] = min(wall[n], took)
                    if meter.cpu_s < best[n]:
                        best[n], steps[n] = meter.cpu_s, {k: after[k] - before[k] for k in after}
        for stream in opened:
            _settle()
            async with LagTicker() as ticker:
                await burst(stream)
            lags.append(ticker.summary())
    return [_Kept(*got) for got in zip(best, steps, faults, wall, lags, strict=True)]


async def _baseline(samples: list[Sample], teacher: str, student: str, k: int) -> None:
    await baseline_score(
        samples, teacher, student_url=student, top_k=k, strategy="only-student",
        id_form="per-position",
    )  # fmt: skip


def _ms(seconds: float, n: int) -> float:
    return seconds / n * 1e3


async def _burst_table(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with mocks(("teacher", TEACHER_SEED, REPLAY), ("student", STUDENT_SEED, REPLAY)) as procs:
        teacher, student = procs[0].url, procs[1].url
        pids = pid_list(procs)
        cfg = _config(teacher, student, top_k=args.k, strategy="only-student")
        scorer = load_miles_scorer(teacher, args.k)
        for label, arrays in _MODES:
            rows = make_samples(args.n, args.prompt, args.response, args.k)
            ours = make_samples(args.n, args.prompt, args.response, args.k, topk_arrays=arrays)
            theirs = [] if scorer is None else scorer.samples(rows)
            await _opd_burst(cfg, ours, pids)  # warm: imports, the mocks' replay caches
            await _baseline(rows, teacher, student, args.k)
            await _opd_burst(cfg, ours, pids, aiohttp=True)
            signal = await _opd_reverse_kl(cfg, ours)
            bare_diff = _max_diff(signal, bare_reverse_kl(ours, teacher, args.k))
            miles_diff = None  # (without Miles' source)
            if scorer is not None:  # (warms it too)
                miles_diff = _max_diff(signal, await scorer.score(theirs))
            base = opd = aio = bare = miles = float("inf")
            steps: dict[str, float] = {}
            aio_steps: dict[str, float] = {}
            for _ in range(args.reps):  # interleaved: the machine's drift hits both
                _settle()
                with ClientMeter(pids) as meter:
                    await _baseline(rows, teacher, student, args.k)
                base = min(base, meter.cpu_s)
                if scorer is not None:
                    _settle()
                    with ClientMeter(pids) as meter:
                        await scorer.score(theirs)
                    miles = min(miles, meter.cpu_s)
                _settle()
                cpu, cpu_s = await _opd_burst(cfg, ours, pids)
                if cpu < opd:
                    opd, steps = cpu, cpu_s
                _settle()
                cpu, cpu_s = await _opd_burst(cfg, ours, pids, aiohttp=True)
                if cpu < aio:
                    aio, aio_steps = cpu, cpu_s
                _settle()
                bare = min(bare, _bare_burst(ours, teacher, args.k, pids))
            # the default; answers of 1 MiB and more parsed in decode threads, Python rows
            # converted in a thread (the default before sessions 19 and 20: the other side
            # of offload_bytes' trade, CPU against the loop's lag); everything on the loop
            # and the signal alone (candidates=False: what the Miles adapter asks for)
            kept, threads, on_loop, signal_only = await _kept_bursts(
                [
                    cfg,
                    cfg.evolve(offload_bytes=_THREADS_BEFORE),
                    cfg.evolve(offload_bytes=_ABOVE_EVERY_ANSWER),
                    cfg.evolve(candidates=False),
                ],
                ours,
                pids,
                args.reps,
            )
            # (the same answers in both modes: the requests are built from the same samples)
            bodies = await _fetch_bodies(rows, teacher, None, args.k, "only-student")
            untyped = _best_cpu(
                _each(bodies, lambda b, _: msgspec.json.decode(b)), gc_off=True, reps=7
            )
            scanner = _best_cpu(
                _each(bodies, lambda b, r: decode_score_response(b, r, parser="scanner")),
                gc_off=False,
                reps=7,
            )
            n = args.n
            by_step = _by_step(steps, opd, n)
            out[label] = {
                "baseline_ms_per_sample": _ms(base, n),
                "opd_ms_per_sample": _ms(opd, n),
                "opd_kept_stream_ms_per_sample": _ms(kept.cpu, n),
                "opd_kept_stream_threads_ms_per_sample": _ms(threads.cpu, n),
                "opd_kept_stream_on_loop_ms_per_sample": _ms(on_loop.cpu, n),
                "opd_kept_stream_signal_ms_per_sample": _ms(signal_only.cpu, n),
                "kept_stream_page_faults_per_sample": kept.faults / n,
                "kept_stream_threads_page_faults_per_sample": threads.faults / n,
                "kept_stream_on_loop_page_faults_per_sample": on_loop.faults / n,
                "kept_stream_signal_page_faults_per_sample": signal_only.faults / n,
                "baseline_over_opd_kept_stream": base / kept.cpu,
                "baseline_over_opd_kept_stream_on_loop": base / on_loop.cpu,
                "baseline_over_opd_kept_stream_threads": base / threads.cpu,
                "baseline_over_opd_kept_stream_signal": base / signal_only.cpu,
                "kept_stream_by_step_ms_per_sample": _by_step(kept.steps, kept.cpu, n),
                "kept_stream_threads_by_step_ms_per_sample": _by_step(
                    threads.steps, threads.cpu, n
                ),
                "kept_stream_on_loop_by_step_ms_per_sample": _by_step(
                    on_loop.steps, on_loop.cpu, n
                ),
                "kept_stream_signal_by_step_ms_per_sample": _by_step(
                    signal_only.steps, signal_only.cpu, n
                ),
                "kept_stream_wall_ms_per_burst": kept.wall * 1e3,
                "kept_stream_on_loop_wall_ms_per_burst": on_loop.wall * 1e3,
                "kept_stream_threads_wall_ms_per_burst": threads.wall * 1e3,
                "kept_stream_signal_wall_ms_per_burst": signal_only.wall * 1e3,
                "kept_stream_lag_ms": kept.lag,
                "kept_stream_on_loop_lag_ms": on_loop.lag,
                "kept_stream_threads_lag_ms": threads.lag,
                "kept_stream_signal_lag_ms": signal_only.lag,
                "opd_aiohttp_ms_per_sample": _ms(aio, n),
                "baseline_over_opd_aiohttp": base / aio,
                "aiohttp_loop_ms_per_sample": _ms(aio_steps.get("loop", 0.0), n),
                "msgspec_untyped_ms_per_sample_this_mode": _ms(untyped, n),
                "scanner_ms_per_sample_this_mode": _ms(scanner, n),
                "baseline_over_opd": base / opd,
                "miles_own_ms_per_sample": None if scorer is None else _ms(miles, n),
                "miles_own_max_abs_diff": miles_diff,
                "miles_own_over_opd_kept_stream": None if scorer is None else miles / kept.cpu,
                "miles_own_over_opd_kept_stream_on_loop": (
                    None if scorer is None else miles / on_loop.cpu
                ),
                "miles_own_over_opd_kept_stream_threads": (
                    None if scorer is None else miles / threads.cpu
                ),
                "miles_own_over_opd_kept_stream_signal": (
                    None if scorer is None else miles / signal_only.cpu
                ),
                "bare_ms_per_sample": _ms(bare, n),
                "bare_max_abs_diff": bare_diff,
                "unnamed_share": (opd - sum(steps.values())) / opd,
                "by_step_ms_per_sample": by_step,
            }
            del rows, ours, bodies, theirs
    return _over_the_floors(out)


def _by_step(steps: dict[str, float], cpu: float, n: int) -> dict[str, float]:
    """``stats().cpu_s`` of a burst in ms per sample, with ``unnamed``: what of the burst's
    client CPU (``cpu``) no step names."""
    out = {step: _ms(v, n) for step, v in steps.items()}
    out["unnamed"] = _ms(cpu - sum(steps.values()), n)
    return out


def _over_the_floors(out: dict[str, Any]) -> dict[str, Any]:
    """Each mode's ratios to the parse floors. Both modes parse the very same answers (the
    requests are the same), so each floor is the least of its two measurements: noise on a
    shared machine only ever adds."""
    untyped = min(m["msgspec_untyped_ms_per_sample_this_mode"] for m in out.values())
    scanner = min(m["scanner_ms_per_sample_this_mode"] for m in out.values())
    for m in out.values():
        opd, kept, bare = (
            m["opd_ms_per_sample"],
            m["opd_kept_stream_ms_per_sample"],
            m["bare_ms_per_sample"],
        )
        m.update(
            msgspec_untyped_ms_per_sample=untyped,
            scanner_ms_per_sample=scanner,
            opd_over_msgspec_untyped=opd / untyped,
            opd_over_scanner=opd / scanner,
            opd_kept_stream_over_scanner=kept / scanner,
            opd_kept_stream_over_msgspec_untyped=kept / untyped,
            bare_over_scanner=bare / scanner,
            opd_over_bare=opd / bare,
            opd_kept_stream_over_bare=kept / bare,
            opd_kept_stream_on_loop_over_scanner=m["opd_kept_stream_on_loop_ms_per_sample"]
            / scanner,
            opd_kept_stream_threads_over_scanner=m["opd_kept_stream_threads_ms_per_sample"]
            / scanner,
            opd_kept_stream_signal_over_scanner=m["opd_kept_stream_signal_ms_per_sample"] / scanner,
        )
    return out


_CHILD = """
import asyncio, json, resource, sys, time
t0 = time.process_time()
from bench.workload import make_samples
from opd_stream import OPDStream, StreamConfig
from opd_stream.scanner import _loader
import msgspec  # (loaded by opd_stream already)

async def main(teacher, student, n, prompt, response, k):
    samples = make_samples(n, prompt, response, k)
    cfg = StreamConfig(teachers=teacher, student_url=student, top_k=k, strategy="only-student")
    start = time.process_time()
    async with OPDStream(cfg) as stream:
        async with stream.run(samples) as results:
            async for _ in results:
                pass
        run = time.process_time() - start
        stats = stream.stats()
    return run, stats

run, stats = asyncio.run(main(*sys.argv[1:3], *map(int, sys.argv[3:7])))
at_exit = _loader.cpu_seconds() if hasattr(_loader, "cpu_seconds") else None
thread = _loader._thread
if thread is not None:
    thread.join()  # a benchmark waits for the background work, to count it
print(json.dumps({
    "run_cpu_s": run,
    "cpu_s": msgspec.to_builtins(stats.cpu_s),
    "decoded": msgspec.to_builtins(stats.decoded),
    "decoded_bytes": msgspec.to_builtins(getattr(stats, "decoded_bytes", {})),
    "kernels_cpu_s_by_the_end_of_the_run": at_exit,
    "kernels_cpu_s_all": _loader.cpu_seconds() if at_exit is not None else None,
}))
"""


def _short_runs(args: argparse.Namespace) -> dict[str, Any]:
    """A cold process and a warm-cache process, each scoring ``--short`` samples."""
    out: dict[str, Any] = {}
    with mocks(("teacher", TEACHER_SEED, REPLAY), ("student", STUDENT_SEED, REPLAY)) as procs:
        urls = [procs[0].url, procs[1].url]
        sizes = [str(v) for v in (args.short, args.prompt, args.response, args.k)]
        for label, cold in (("cold (numba cache empty)", True), ("warm cache", False)):
            env = dict(os.environ)
            with tempfile.TemporaryDirectory() as cache:
                if cold:
                    env["NUMBA_CACHE_DIR"] = cache
                got = subprocess.run(
                    [sys.executable, "-c", _CHILD, *urls, *sizes],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                )
            out[label] = json.loads(got.stdout.strip().splitlines()[-1])
    return out


def _print(burst: dict[str, Any], short: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"## {args.n} x ({args.prompt} + {args.response}), k={args.k}, only-student, "
        "per-position; client CPU ms per sample (least of the repeats)\n"
    )
    print(
        "| student top-k | baseline (Miles) | opd_stream | ratio | kept stream "
        "| msgspec untyped | x | scanner | x | unnamed | through aiohttp | ratio | its loop |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, m in burst.items():
        print(
            f"| {label} | {m['baseline_ms_per_sample']:.1f} | {m['opd_ms_per_sample']:.2f} "
            f"| {m['baseline_over_opd']:.1f}x | {m['opd_kept_stream_ms_per_sample']:.2f} "
            f"| {m['msgspec_untyped_ms_per_sample']:.2f} | {m['opd_over_msgspec_untyped']:.2f}x "
            f"| {m['scanner_ms_per_sample']:.2f} | {m['opd_over_scanner']:.2f}x "
            f"| {m['unnamed_share']:.1%} | {m['opd_aiohttp_ms_per_sample']:.2f} "
            f"| {m['baseline_over_opd_aiohttp']:.1f}x | {m['aiohttp_loop_ms_per_sample']:.2f} |"
        )
    print(
        "\nMiles' own scorer (radixark/miles' `reward_func` and `post_process_rewards`, "
        "where its source is at hand) beside the baseline that stands in for it, and the "
        "kept stream's ratio to each (max |diff|: Miles' reverse KL against opd_stream's):\n"
    )
    print(
        "| student top-k | baseline | Miles' own | kept stream | ratio to the baseline "
        "| ratio to Miles' own | before (answers from 1 MiB and rows in threads): ratio to "
        "Miles' own | the signal alone (`candidates=False`, as the Miles adapter asks): "
        "ratio to Miles' own | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, m in burst.items():
        print(
            f"| {label} | {m['baseline_ms_per_sample']:.1f} "
            f"| {_opt(m['miles_own_ms_per_sample'], '.1f')} "
            f"| {m['opd_kept_stream_ms_per_sample']:.2f} "
            f"| {m['baseline_over_opd_kept_stream']:.1f}x "
            f"| {_opt(m['miles_own_over_opd_kept_stream'], '.1f')}x "
            f"| {_opt(m['miles_own_over_opd_kept_stream_threads'], '.1f')}x "
            f"| {_opt(m['miles_own_over_opd_kept_stream_signal'], '.1f')}x "
            f"| {_opt(m['miles_own_max_abs_diff'], '.1e')} |"
        )
    print(
        "\nThe same work with no pipeline (`bench.bare_client`: one sample after another, "
        "nothing overlapped; its reverse KL equals opd_stream's within the max |diff|):\n"
    )
    print("| student top-k | bare client | x scanner | opd_stream / bare | max abs diff |")
    print("|---|---|---|---|---|")
    for label, m in burst.items():
        print(
            f"| {label} | {m['bare_ms_per_sample']:.2f} | {m['bare_over_scanner']:.2f}x "
            f"| {m['opd_over_bare']:.2f}x | {m['bare_max_abs_diff']:.1e} |"
        )
    print(
        "\nOne stream kept open across the bursts, four at once taking turns: the default "
        "(answers below `offload_bytes` = 4 MiB read on the event loop by the scanner, 1 MiB "
        "at a time), as before sessions 19 and 20 (`offload_bytes` = 1 MiB: answers from 1 MiB "
        "parsed in decode threads, Python rows converted in a thread), and with every answer, "
        "body and sample on the loop (`offload_bytes` "
        "above every answer), and the default with the signal alone (`candidates=False`: "
        "no per-candidate arrays, what the Miles adapter asks for): client CPU, the burst's "
        "wall time and the loop's lag (1 ms "
        "ticker, one burst more):\n"
    )
    print(
        "| student top-k | answers parsed | kept stream | ratio to the baseline | x msgspec "
        "untyped | x scanner | x bare client | wall per burst (ms) | loop lag p99 / max (ms) "
        "| page faults per sample |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, m in burst.items():
        for which, key in (
            ("default", "kept_stream"),
            ("1 MiB and more, rows, in threads (before)", "kept_stream_threads"),
            ("all on the loop", "kept_stream_on_loop"),
            ("the signal alone", "kept_stream_signal"),
        ):
            cpu, lag = m[f"opd_{key}_ms_per_sample"], m[f"{key}_lag_ms"]
            print(
                f"| {label} | {which} | {cpu:.2f} | {m['baseline_ms_per_sample'] / cpu:.1f}x "
                f"| {cpu / m['msgspec_untyped_ms_per_sample']:.2f}x "
                f"| {cpu / m['scanner_ms_per_sample']:.2f}x "
                f"| {cpu / m['bare_ms_per_sample']:.2f}x "
                f"| {m[f'{key}_wall_ms_per_burst']:.1f} "
                f"| {_opt(lag['lag_p99_ms'])} / {_opt(lag['lag_max_ms'])} "
                f"| {m[f'{key}_page_faults_per_sample']:.0f} |"
            )
    steps = list(next(iter(burst.values()))["by_step_ms_per_sample"])
    print("\n### opd_stream by step (`stats().cpu_s`), ms per sample\n")
    print("| student top-k | stream | " + " | ".join(steps) + " |")
    print("|---|---|" + "---|" * len(steps))
    for label, m in burst.items():
        for which, key in (
            ("one per burst", "by_step_ms_per_sample"),
            ("kept", "kept_stream_by_step_ms_per_sample"),
            (
                "kept, 1 MiB and more, rows, in threads (before)",
                "kept_stream_threads_by_step_ms_per_sample",
            ),
            ("kept, all on the loop", "kept_stream_on_loop_by_step_ms_per_sample"),
            ("kept, the signal alone", "kept_stream_signal_by_step_ms_per_sample"),
        ):
            vals = " | ".join(f"{v:.2f}" for v in m[key].values())
            print(f"| {label} | {which} | {vals} |")
    if short:
        print(f"\n### Short runs, {args.short} samples, each in a fresh process (CPU s)\n")
        print(
            "| process | the run | setup | kernels (by the run's end) | kernels (all) "
            "| decoded by scanner / msgspec | bytes by scanner / msgspec |"
        )
        print("|---|---|---|---|---|---|---|")
        for label, s in short.items():
            c, d, b = s["cpu_s"], s["decoded"], s["decoded_bytes"]
            k0, k1 = s["kernels_cpu_s_by_the_end_of_the_run"], s["kernels_cpu_s_all"]
            mb = f"{b['scanner'] / 1e6:.1f} / {b['msgspec'] / 1e6:.1f} MB" if b else "-"
            print(
                f"| {label} | {s['run_cpu_s']:.2f} | {_opt(c.get('setup'))} | {_opt(k0)} "
                f"| {_opt(k1)} | {d['scanner']} / {d['msgspec']} | {mb} |"
            )


def _opt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_burst", description=__doc__)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=2048)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--short", type=int, default=8, help="samples of the short runs (0: none)")
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args(argv)
    prepare()  # the kernels, before anything is measured
    started = time.perf_counter()
    burst = asyncio.run(_burst_table(args))
    short = _short_runs(args) if args.short else {}
    _print(burst, short, args)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"burst": burst, "short": short, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
