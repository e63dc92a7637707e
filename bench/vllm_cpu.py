"""Client CPU per response token against a vLLM scale-out teacher and an SGLang teacher, on
the same sizes and the same answers' content, in one run (issue 33).

``python -m bench.vllm_cpu [--quick] [--n N] [--prompt P] [--response R] [--top-k K]
[--repeats M] [--out DIR]`` (full size: 24 x (512 + 2048), k = 16, 7 repeats; ``--quick``:
8 x (256 + 1024), 3 repeats).

Two mock teachers run as subprocesses (their CPU is not the client's) on one model and seed,
so the same tokens get the same values from either: a mock SGLang server
(:class:`~opd_stream.testing.mock_sglang.MockProcess`, per-position ids patched in) and a
mock vLLM 0.34 server (:class:`~opd_stream.testing.mock_vllm.VllmMockProcess`,
``--enable-scale-out``, ``--max-logprobs`` 20). Each stream is set to its engine (no
detection in the measured runs). Modes, each on its own samples (the student's top-k as
``(ids, logprobs)`` arrays, the same for both engines):

* ``sampled-token``: the sampled token's logprob per position (SGLang: JSON
  ``input_token_logprobs``; vLLM: a one-column ``.npy``);
* ``top-k K only-student``: the teacher scores the student's K ids per position (SGLang:
  per-position JSON ``input_token_ids_logprobs``; vLLM: ``prompt_logprob_token_ids``, a
  binary ``.npy`` ``[R, K + 1]``);
* ``top-k K intersection``: the teacher's own top-K (SGLang: b64 flat top-k arrays; vLLM:
  ``prompt_logprobs``, a JSON dict per position).

Per mode, the two engines' runs alternate (SGLang first in even repeats, vLLM first in odd
ones), each stream first warmed up by three whole unmeasured runs. Reported per engine:
client CPU per response token (``ClientMeter``: this process, all threads, decode threads
included; the least of the repeats, as the other micro-benchmarks, the median, and each),
response bytes per response token (``stats().bytes_received``), and the CPU by step
(``stats().cpu_s``, summed over the repeats; ``other`` = the rest: the event loop, HTTP),
and vLLM / SGLang ratios. The two engines' results are checked to agree (teacher logprobs
and per-position signal, float32-exact from the same model). ``prepare()`` compiles the
answer scanner first, so SGLang's JSON is read by it where numba runs (the ``parser`` field
says which parser ran).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from opd_stream import OPDStream, Sample, ScoredSample, StreamConfig
from opd_stream.testing.mock_sglang import MockOptions, MockProcess
from opd_stream.testing.mock_vllm import VllmMockOptions, VllmMockProcess
from opd_stream.wire._request import Engine, ScoreRequest

from .harness import ClientMeter, pid_list
from .workload import TEACHER_SEED, make_samples

__all__ = ("ENGINES", "main", "run")

ENGINES: tuple[Engine, ...] = ("sglang", "vllm")
#: the vLLM servers' --max-logprobs (vLLM's default)
MAX_LOGPROBS = 20
#: unmeasured runs per stream before the measured ones
WARMUP_RUNS = 3


def modes(top_k: int) -> list[tuple[str, int, str]]:
    """(name, top_k, strategy) of each mode."""
    return [
        ("sampled-token", 0, "only-student"),
        (f"top-k {top_k} only-student", top_k, "only-student"),
        (f"top-k {top_k} intersection", top_k, "intersection"),
    ]


class _Run:
    """One engine's stream in one mode, and what its measured runs cost."""

    def __init__(self, stream: OPDStream, pids: list[int], tokens: int) -> None:
        self.stream = stream
        self.pids = pids
        self.tokens = tokens
        self.cpu_s: list[float] = []
        self.wall_s: list[float] = []
        self.bytes = 0
        self.steps: dict[str, float] = {}
        self.results: dict[int, ScoredSample] = {}

    async def _score(self, samples: list[Sample]) -> dict[int, ScoredSample]:
        out: dict[int, ScoredSample] = {}
        async with self.stream.run(samples) as results:
            async for item in results:
                if not isinstance(item, ScoredSample):
                    raise RuntimeError(f"sample {item.index} failed: {item.message}")
                out[item.index] = item
        return out

    async def warm_up(self, samples: list[Sample]) -> None:
        """One whole unmeasured run (connections, first touch of answers this size)."""
        await self._score(samples)

    async def measure(self, samples: list[Sample]) -> None:
        before = self.stream.stats()
        with ClientMeter(self.pids) as meter:
            self.results = await self._score(samples)
        after = self.stream.stats()
        self.cpu_s.append(meter.cpu_s)
        self.wall_s.append(meter.wall_s)
        self.bytes += after.bytes_received - before.bytes_received
        was = before.cpu_s.as_dict()
        for step, v in after.cpu_s.as_dict().items():
            self.steps[step] = self.steps.get(step, 0.0) + v - was[step]

    def summary(self) -> dict[str, Any]:
        per = [c / self.tokens * 1e6 for c in self.cpu_s]
        runs = len(self.cpu_s)
        steps = {k: v / (self.tokens * runs) * 1e6 for k, v in self.steps.items()}
        steps["other"] = sum(self.cpu_s) / (self.tokens * runs) * 1e6 - sum(steps.values())
        return {
            "cpu_us_per_token": min(per),
            "cpu_us_per_token_median": statistics.median(per),
            "cpu_us_per_token_runs": per,
            "bytes_per_token": self.bytes / (self.tokens * runs),
            "wall_s_runs": self.wall_s,
            "cpu_us_per_token_by_step": steps,
        }


def _requests(
    samples: list[Sample], k: int, strategy: str, engine: Engine, limit: int
) -> list[ScoreRequest]:
    """The scoring requests a stream of ``engine`` sends for ``samples`` in this mode."""
    out = []
    for x in samples:
        ids = None
        if k and strategy == "only-student":
            top = x.student_top_logprobs
            assert isinstance(top, tuple)
            ids = np.asarray(top[0], dtype=np.int64)
        out.append(
            ScoreRequest(
                tokens=np.asarray(x.tokens, dtype=np.int64),
                response_length=x.response_length,
                top_k=k if strategy == "intersection" else 0,
                ids=ids,
                topk_wire="b64",
                engine=engine,
                max_ids=limit if engine != "sglang" else 0,
            )
        )
    return out


async def decode_alone(
    url: str, samples: list[Sample], k: int, strategy: str, engine: Engine, limit: int
) -> dict[str, float]:
    """The decode of the very answers a stream gets in this mode, alone, in this thread
    (least of 5, us per response token): opd_stream's decoder, every check
    (``decoder``; SGLang's: the compiled scanner where it runs), and msgspec's untyped JSON
    parse of the same bodies (``json_untyped``: a floor for the JSON; base64 strings stay
    strings)."""
    import aiohttp
    import msgspec

    from opd_stream.fetch._threads import timed_build
    from opd_stream.wire._codec import decode
    from opd_stream.wire._payloads import build_block_payloads
    from opd_stream.wire._request import multi_body
    from opd_stream.wire._vllm import ENGINE_PATHS

    reqs = _requests(samples, k, strategy, engine, limit)
    # one body per request, or (ids beyond --max-logprobs) one per chunk of id columns
    bodies = [build_block_payloads(r) if multi_body(r) else [timed_build(r)[0]] for r in reqs]
    answers: list[Any] = []
    async with aiohttp.ClientSession() as session:
        for parts in bodies:
            got = []
            for body in parts:
                async with session.post(f"{url}/{ENGINE_PATHS[engine]}", data=body) as resp:
                    got.append(await resp.read())
                    if resp.status != 200:
                        raise RuntimeError(f"{engine} answered {resp.status}: {got[-1][:200]!r}")
            answers.append(got if multi_body(reqs[len(answers)]) else got[0])
    tokens = sum(r.response_length for r in reqs)

    def least(fn: Any) -> float:
        best = float("inf")
        gc.disable()
        try:
            for _ in range(5):
                t = time.thread_time()
                fn()
                best = min(best, time.thread_time() - t)
        finally:
            gc.enable()
        return best / tokens * 1e6

    pairs = list(zip(answers, reqs, strict=True))
    flat = [b for a in answers for b in (a if isinstance(a, list) else [a])]
    return {
        "decoder": least(lambda: [decode(a, r) for a, r in pairs]),
        "json_untyped": least(lambda: [msgspec.json.decode(b) for b in flat]),
    }


def _agreement(a: dict[int, ScoredSample], b: dict[int, ScoredSample]) -> dict[str, Any]:
    """Largest difference between two engines' results of the same samples."""
    lp = kl = 0.0
    for i, x in a.items():
        y = b[i]
        lp = max(lp, _maxdiff(x.teacher_logprobs.numpy(), y.teacher_logprobs.numpy()))
        if x.reverse_kl is not None and y.reverse_kl is not None:
            kl = max(kl, _maxdiff(x.reverse_kl.numpy(), y.reverse_kl.numpy()))
    return {
        "compared": len(a),
        "same_samples": sorted(a) == sorted(b),
        "teacher_logprobs_max_diff": lp,
        "signal_max_diff": kl,
    }


def _maxdiff(x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> float:
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    if x64.shape != y64.shape or not np.array_equal(np.isfinite(x64), np.isfinite(y64)):
        return float("inf")
    finite = np.isfinite(x64)
    return float(np.max(np.abs(x64[finite] - y64[finite]), initial=0.0))


async def run(
    n: int, prompt: int, response: int, top_k: int, repeats: int, max_logprobs: int | None = None
) -> dict[str, Any]:
    """Every mode, both engines interleaved; the numbers (see the module docstring).

    ``max_logprobs``: the vLLM server's ``--max-logprobs`` (and ``vllm_max_logprobs``);
    default: vLLM's 20, or ``top_k + 1`` when larger (one body per request). Below
    ``top_k + 1``, the ids go as several requests (column chunks), and a teacher top-k
    beyond it is not measured (``skipped``)."""
    from opd_stream.cli._parser_notice import parser_line

    limit = max(MAX_LOGPROBS, top_k + 1) if max_logprobs is None else max_logprobs
    skipped: list[str] = []
    procs: dict[str, MockProcess] = {
        "sglang": MockProcess("teacher", TEACHER_SEED, options=MockOptions()),
        "vllm": VllmMockProcess(
            "teacher", TEACHER_SEED, options=VllmMockOptions(max_logprobs=limit)
        ),
    }
    tokens = n * response
    out: dict[str, Any] = {}
    try:
        with ThreadPoolExecutor(len(procs)) as pool:  # both start at once
            list(pool.map(lambda p: p.start(), procs.values()))
        pids = pid_list(list(procs.values()))
        for name, k, strategy in modes(top_k):
            if strategy == "intersection" and k > limit:
                skipped.append(name)  # vLLM refuses a top-k beyond --max-logprobs
                continue
            samples = make_samples(n, prompt, response, k, topk_arrays=True)
            runs: dict[str, _Run] = {}
            async with contextlib.AsyncExitStack() as stack:  # streams closed in LIFO order
                for engine in ENGINES:
                    cfg = StreamConfig.from_env(
                        {},
                        teachers=procs[engine].url,
                        engine=engine,
                        top_k=k,
                        strategy=strategy,
                        topk_wire="b64",
                        vllm_max_logprobs=limit,
                        kl_device="cpu",
                    )
                    stream = await stack.enter_async_context(OPDStream(cfg))
                    runs[engine] = _Run(stream, pids, tokens)
                # the first runs of a process in a mode cost up to 3x (the KL stage's
                # first batches of a shape, among others): not measured
                for _ in range(WARMUP_RUNS):
                    for r in runs.values():
                        await r.warm_up(samples)
                for rep in range(repeats):
                    order = ENGINES if rep % 2 == 0 else ENGINES[::-1]
                    for engine in order:
                        await runs[engine].measure(samples)
            row = {engine: r.summary() for engine, r in runs.items()}
            s, v = row["sglang"], row["vllm"]
            row["cpu_ratio_vllm_over_sglang"] = v["cpu_us_per_token"] / s["cpu_us_per_token"]
            row["cpu_ratio_of_medians"] = (
                v["cpu_us_per_token_median"] / s["cpu_us_per_token_median"]
            )
            row["bytes_ratio_vllm_over_sglang"] = v["bytes_per_token"] / s["bytes_per_token"]
            row["agreement"] = _agreement(runs["sglang"].results, runs["vllm"].results)
            for engine in ENGINES:
                row[engine]["decode_alone_us_per_token"] = await decode_alone(
                    procs[engine].url, samples, k, strategy, engine, limit
                )
            out[name] = row
    finally:
        for p in procs.values():
            p.kill()
    return {
        "sizes": {"n": n, "prompt": prompt, "response": response, "top_k": top_k},
        "repeats": repeats,
        "vllm_max_logprobs": limit,
        "skipped": skipped,
        "parser": parser_line(),
        # torch's OpenMP threads spin after each parallel region unless PASSIVE: on the
        # CPU KL, that spinning is client CPU too (up to 2x in the top-k modes)
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "modes": out,
    }


def agrees(result: dict[str, Any], tol: float = 1e-6) -> bool:
    """Both engines scored every sample and their values agree within ``tol``."""
    for row in result["modes"].values():
        a = row["agreement"]
        if not a["same_samples"] or a["teacher_logprobs_max_diff"] > tol:
            return False
        if a["signal_max_diff"] > tol:
            return False
    return True


def render(result: dict[str, Any]) -> str:
    """The results as a Markdown table (and the CPU by step)."""
    lines = [
        "| mode | engine | client CPU us / token: least (median) | bytes / token | "
        "CPU vLLM / SGLang | bytes vLLM / SGLang |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in result["modes"].items():
        for engine in ENGINES:
            e = row[engine]
            ratio = (
                (
                    f"**{row['cpu_ratio_vllm_over_sglang']:.2f}x** "
                    f"({row['cpu_ratio_of_medians']:.2f}x)",
                    f"{row['bytes_ratio_vllm_over_sglang']:.2f}x",
                )
                if engine == "vllm"
                else ("", "")
            )
            label = "SGLang" if engine == "sglang" else "vLLM scale-out"
            lines.append(
                f"| {name} | {label} | {e['cpu_us_per_token']:.2f} "
                f"({e['cpu_us_per_token_median']:.2f}) | "
                f"{e['bytes_per_token']:,.1f} | {ratio[0]} | {ratio[1]} |"
            )
    steps = list(next(iter(result["modes"].values()))["sglang"]["cpu_us_per_token_by_step"])
    lines += [
        "",
        "CPU by step, us per response token (`stats().cpu_s`, all repeats; `other`: the "
        "event loop, HTTP, the rest):",
        "",
        "| mode | engine | " + " | ".join(steps) + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    for name, row in result["modes"].items():
        for engine in ENGINES:
            by = row[engine]["cpu_us_per_token_by_step"]
            lines.append(
                f"| {name} | {engine} | " + " | ".join(f"{by[s]:.2f}" for s in steps) + " |"
            )
    lines += [
        "",
        "The decode of the same answers alone, us per response token (least of 5, one "
        "thread): opd_stream's decoder with every check, and msgspec's untyped JSON parse:",
        "",
        "| mode | engine | decoder | msgspec untyped |",
        "|---|---|---|---|",
    ]
    for name, row in result["modes"].items():
        for engine in ENGINES:
            d = row[engine]["decode_alone_us_per_token"]
            lines.append(f"| {name} | {engine} | {d['decoder']:.2f} | {d['json_untyped']:.2f} |")
    worst = max(
        max(r["agreement"]["teacher_logprobs_max_diff"], r["agreement"]["signal_max_diff"])
        for r in result["modes"].values()
    )
    lines += ["", f"vLLM and SGLang results agree: max |diff| {worst:.2e}; {result['parser']}"]
    lines.append(
        f"vLLM --max-logprobs {result['vllm_max_logprobs']}; "
        f"OMP_WAIT_POLICY {result['omp_wait_policy'] or 'unset'}"
    )
    if result["skipped"]:
        lines.append(f"not measured (a top-k beyond it): {', '.join(result['skipped'])}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_cpu", description=__doc__)
    p.add_argument("--quick", action="store_true", help="8 x (256 + 1024), 3 repeats")
    p.add_argument("--n", type=int, default=None, help="samples per run (default 24)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512)")
    p.add_argument("--response", type=int, default=None, help="response tokens (default 2048)")
    p.add_argument("--top-k", type=int, default=16, help="k of the top-k modes (default 16)")
    p.add_argument("--repeats", type=int, default=None, help="runs per engine (default 7)")
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=None,
        help="the vLLM server's --max-logprobs (default 20, or top-k + 1 when larger); "
        "below top-k + 1 the ids per position go as several requests",
    )
    p.add_argument("--out", default="bench-out", help="writes OUT/vllm_cpu.json")
    args = p.parse_args(argv)
    n = args.n or (8 if args.quick else 24)
    prompt = args.prompt or (256 if args.quick else 512)
    response = args.response or (1024 if args.quick else 2048)
    repeats = args.repeats or (3 if args.quick else 7)
    # The compiled kernels once, before anything is measured (as bench.run does).
    from opd_stream.scanner._loader import prepare

    prepare()
    result = asyncio.run(run(n, prompt, response, args.top_k, repeats, args.max_logprobs))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))
    print(f"wrote {out / 'vllm_cpu.json'}", file=sys.stderr)
    return 0 if agrees(result) else 1


if __name__ == "__main__":
    raise SystemExit(main())
