"""The benchmark scenarios (see bench/README.md). Each is ``async def sN(sizes) -> dict``.

Every scenario runs the mock SGLang servers as subprocesses and both clients (the baseline
of :mod:`bench.baseline` and ``opd_stream``) in this process, one after the other, on the same
servers and the same samples; client CPU is this process's CPU time (plus any decode worker
threads included), never the mocks'.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import numpy as np

from opd_stream import Sample, StreamConfig
from opd_stream.kl._names import Strategy
from opd_stream.kl._plan import STRATEGY_NEEDS
from opd_stream.scanner._loader import prepare
from opd_stream.testing.mock_sglang import MockOptions
from opd_stream.wire._codec import decode_score_response, parser_for
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest, auto_block_size
from opd_stream.wire._student_topk import parse_student_topk

from .baseline import baseline_score
from .harness import (
    ClientMeter,
    LagTicker,
    Measurement,
    compare,
    kl_stage_summary,
    mocks,
    pid_list,
    run_opd,
)
from .locality import s9_locality
from .workload import STUDENT_SEED, TEACHER_SEED, iter_samples, make_samples

__all__ = ("SCENARIOS", "Sizes", "sizes_for")

Progress = Callable[[str], None]

#: Mocks replay repeated scoring answers from memory, so after an unmeasured warm pass of
#: each client the measured pass costs the (Python) mock almost no CPU: on 2 cores the mock
#: would otherwise compete with the client it serves.
REPLAY = MockOptions(replay_cache_bytes=3 * 2**30)
#: Scenario 1's mode whose rollouts give opd_stream the student top-k as ``(ids, logprobs)``
#: arrays (the baseline gets the same values as Python rows, the reference's input).
ARRAY_ROWS = "top-k 16 only-student, array rows"
#: Scenario 3's run with every answer decoded with msgspec on the event loop.
ON_LOOP = "opd_stream (no decode threads: everything on the event loop)"


class Sizes(msgspec.Struct, kw_only=True):
    """Workload sizes of every scenario (full sizes by default; ``quick()`` for 2 cores)."""

    s1_n: int = 256
    s1_prompt: int = 512
    s1_response: int = 4096
    s1_floor_samples: int = 32
    s2_n: int = 256
    s2_rate: float = 16.0
    s2_response: int = 4096
    s3_n: int = 16
    s3_response: int = 16384
    s3_k: int = 64
    s4_prompt: int = 512
    s4_lengths: tuple[int, ...] = (16, 1024, 4096)
    s4_flat_max_bytes: int = 128 * 2**20
    s5_capacity: int = 8
    s5_latency_s: float = 0.2
    s5_n: int = 400
    s5_inflight: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    s6_n: int = 20000
    s6_checkpoint: int = 2000
    s7_n: int = 8
    s7_prompt: int = 512
    s7_lengths: tuple[int, ...] = (256, 2048)
    s7_cap_s: float = 120.0
    s7_flat_max_bytes: int = 512 * 2**20
    s8_n: int = 16
    s8_prompt: int = 512
    s8_response: int = 1024
    s9_prompts: int = 64
    s9_per_prompt: int = 8
    s9_prompt: int = 2048
    s9_response: int = 1024
    s9_teacher_prompt: int = 8192
    s9_replicas: int = 4
    s9_per_token_s: float = 60e-6
    s9_cache_tokens: int = 1 << 20
    s9_window: int = 32
    s9_spread: float = 4.0
    s9_block: int = 64
    s9_topk: int = 4
    s9_clients: int = 4
    s9_client_inflight: int = 4
    s9_gateway_per_client: bool = True  # N clients: also each through an smg of its own
    s9_variants: str = ""  # "|"-separated variant names to run (empty: all)
    quick: bool = False


def sizes_for(quick: bool) -> Sizes:
    if not quick:
        return Sizes()
    return Sizes(
        s1_n=32,
        s1_prompt=256,
        s1_response=1024,
        s1_floor_samples=16,
        s2_n=48,
        s2_rate=24.0,
        s2_response=1024,
        s3_n=6,
        s3_response=4096,
        s3_k=64,
        s4_prompt=256,
        s4_lengths=(16, 256, 1024),
        s4_flat_max_bytes=64 * 2**20,
        s5_n=120,
        s5_inflight=(1, 2, 4, 8, 16, 32),
        s6_n=4000,
        s6_checkpoint=400,
        s7_n=3,
        s7_prompt=256,
        s7_lengths=(256, 1024),
        s7_cap_s=30.0,
        s7_flat_max_bytes=128 * 2**20,
        s8_n=6,
        s8_prompt=256,
        s8_response=1024,
        s9_prompts=16,
        s9_per_prompt=8,
        s9_prompt=512,
        s9_response=256,
        s9_teacher_prompt=2048,
        s9_per_token_s=200e-6,
        s9_cache_tokens=1 << 18,
        s9_window=16,
        s9_block=32,
        s9_gateway_per_client=False,
        quick=True,
    )


def _config(teacher: str, student: str | None = None, **kw: Any) -> StreamConfig:
    return StreamConfig.from_env(
        teachers=teacher, student_url=student, request_deadline_s=600, **kw
    )


def _tokens(samples: list[Sample]) -> int:
    return sum(s.response_length for s in samples)


def _settle() -> None:
    gc.collect()
    time.sleep(0.2)


# ---------------------------------------------------------------- decode floor


async def _fetch_bodies(
    samples: list[Sample], teacher: str, student: str | None, top_k: int, strategy: Strategy
) -> list[tuple[bytes, ScoreRequest]]:
    """The answers opd_stream asks for (per-position, prompt start, b64 top-k), raw."""
    out: list[tuple[bytes, ScoreRequest]] = []
    needs = STRATEGY_NEEDS[strategy]
    async with aiohttp.ClientSession() as session:

        async def post(url: str, req: ScoreRequest) -> bytes:
            async with session.post(url + "/generate", data=build_score_payload(req)) as r:
                body = await r.read()
                assert r.status == 200, body[:200]
                return body

        for s in samples:
            tokens = np.asarray(s.tokens, dtype=np.int64)
            r = s.response_length
            s_ids = None
            if top_k > 0 and needs.teacher_scores_student_ids:
                s_ids, _ = parse_student_topk(s.student_top_logprobs, r, top_k)
            t_topk = top_k if top_k > 0 and needs.teacher_topk else 0
            treq = ScoreRequest(
                tokens=tokens, response_length=r, top_k=t_topk, ids=s_ids, topk_wire="b64"
            )
            tbody = await post(teacher, treq)
            out.append((tbody, treq))
            if student is not None and top_k > 0 and needs.student_scores_teacher_ids:
                rows = decode_score_response(tbody, treq)
                sreq = ScoreRequest(tokens=tokens, response_length=r, ids=rows.top_ids)
                out.append((await post(student, sreq), sreq))
    return out


def _best_cpu(fn: Callable[[], Any], *, gc_off: bool, reps: int = 3) -> float:
    """The least CPU seconds (this process, all threads) of ``reps`` runs of ``fn``."""
    best = math.inf
    for _ in range(reps):
        was = gc.isenabled()
        if gc_off:
            gc.disable()
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
        if gc_off and was:
            gc.enable()
    return best


def _arrow_read(body: bytes) -> Any:
    """pyarrow's JSON reader on one answer, inferred schema, one thread, into arrays (a
    reference outside this project for the parsing floor only: opd_stream does not use
    pyarrow; the ``bench`` extra installs it)."""
    import pyarrow as pa
    import pyarrow.json as pj

    data = b'{"i":' + body + b"}" if body.lstrip()[:1] == b"[" else body
    table = pj.read_json(
        pa.py_buffer(data),
        read_options=pj.ReadOptions(use_threads=False, block_size=len(data) + 1),
        parse_options=pj.ParseOptions(newlines_in_values=True),
    )
    return table.column(0).chunk(0)


_FLOOR_REPS = 7


def floor_parsers(bodies: list[tuple[bytes, ScoreRequest]]) -> dict[str, float]:
    """CPU seconds of the two libraries that make the parsing floor, each the least of
    ``_FLOOR_REPS`` runs (more than the rest: the floor's noise only ever lowers it)."""

    each = functools.partial(_each, bodies)
    return {
        "msgspec.json.decode, untyped, gc off": _best_cpu(
            each(lambda b, _: msgspec.json.decode(b)), gc_off=True, reps=_FLOOR_REPS
        ),
        "pyarrow.json.read_json": _best_cpu(
            each(lambda b, _: _arrow_read(b)), gc_off=False, reps=_FLOOR_REPS
        ),
    }


def _each(
    bodies: list[tuple[bytes, ScoreRequest]], fn: Callable[[bytes, ScoreRequest], Any]
) -> Callable[[], Any]:
    """A call that runs ``fn`` over every ``(body, request)``."""
    return lambda: [fn(body, req) for body, req in bodies]


def decode_floor(bodies: list[tuple[bytes, ScoreRequest]]) -> dict[str, float]:
    """CPU seconds to parse ``bodies`` alone, per parser, and the threads' wall times.

    The parsing floor is the fastest of two libraries outside this project on the same
    bytes: msgspec's untyped decode with the GC off, and pyarrow's JSON reader. Beside them:
    opd_stream's two decoders, each with every check (msgspec, the fallback; the compiled
    scanner, used wherever it is ready), and the
    threaded decoder's wall time with 1 and 2 threads (how decode throughput scales with
    cores when the GIL is released).
    """
    from concurrent.futures import ThreadPoolExecutor

    each = functools.partial(_each, bodies)
    prepare()  # compiles the scanner if it can (blocking: a benchmark waits for it)
    threaded = parser_for()
    res = {
        **floor_parsers(bodies),
        "opd_stream msgspec decoder": _best_cpu(
            each(lambda b, r: decode_score_response(b, r)), gc_off=False
        ),
    }
    if threaded == "scanner":
        res["opd_stream compiled scanner"] = _best_cpu(
            each(lambda b, r: decode_score_response(b, r, parser="scanner")), gc_off=False
        )
    work = bodies * max(1, 8 // max(len(bodies), 1))
    for threads in (1, 2):
        with ThreadPoolExecutor(threads) as pool:
            best = math.inf
            for _ in range(3):
                t = time.perf_counter()
                list(pool.map(lambda br: decode_score_response(*br, parser=threaded), work))
                best = min(best, time.perf_counter() - t)
        res[f"{THREAD_WALL} {threads} thread(s)"] = best
    return res


#: The threaded decoder's wall time (the scanner where numba runs, else msgspec).
THREAD_WALL = "threaded decoder wall,"


FLOOR_PARSERS = ("msgspec.json.decode, untyped, gc off", "pyarrow.json.read_json")


def cpu_by_step(stats: Any, tokens: int, cpu_s: float) -> dict[str, float]:
    """``stats().cpu_s`` in us per response token, with ``other`` = the rest of the CPU."""
    steps = {step: v / tokens * 1e6 for step, v in stats.cpu_s.as_dict().items()}
    steps["other"] = cpu_s / tokens * 1e6 - sum(steps.values())
    return steps


# ---------------------------------------------------------------- scenario 1


async def s1_rollout_tail(sz: Sizes, progress: Progress) -> dict[str, Any]:
    modes = [
        ("sampled-token", 0, "only-student"),
        ("top-k 16 only-student", 16, "only-student"),
        ("top-k 16 union", 16, "union"),
        (ARRAY_ROWS, 16, "only-student"),
    ]
    out: dict[str, Any] = {
        "sizes": {"n": sz.s1_n, "prompt": sz.s1_prompt, "response": sz.s1_response},
        "modes": {},
        "_latencies": {},
    }
    with mocks(("teacher", TEACHER_SEED, REPLAY), ("student", STUDENT_SEED, REPLAY)) as procs:
        teacher, student = procs[0].url, procs[1].url
        pids = pid_list(procs)
        for label, k, strategy in modes:
            progress(f"s1 {label}: samples")
            samples = make_samples(sz.s1_n, sz.s1_prompt, sz.s1_response, k)
            # the array-rows mode: the same rollouts, the top-k as arrays for opd_stream (the
            # baseline, like the reference, takes Python rows)
            opd_samples = samples
            if label == ARRAY_ROWS:
                opd_samples = make_samples(
                    sz.s1_n, sz.s1_prompt, sz.s1_response, k, topk_arrays=True
                )
            toks = _tokens(samples)
            cfg = _config(teacher, student, top_k=k, strategy=strategy)
            # unmeasured warm pass of both clients (imports, the mocks' replay caches)
            progress(f"s1 {label}: warm pass")
            await run_opd(cfg, opd_samples)
            await baseline_score(
                samples,
                teacher,
                student_url=student,
                top_k=k,
                strategy=strategy,
                id_form="per-position",
            )
            # the floor, measured right before and right after opd_stream's run (the least
            # of both: this machine's speed drifts over minutes)
            floor_samples = samples[: sz.s1_floor_samples]
            bodies = await _fetch_bodies(floor_samples, teacher, student, k, strategy)
            floor_before = floor_parsers(bodies)
            _settle()
            progress(f"s1 {label}: baseline")
            with ClientMeter(pids) as mb:
                t0 = time.perf_counter()
                base = await baseline_score(
                    samples,
                    teacher,
                    student_url=student,
                    top_k=k,
                    strategy=strategy,
                    id_form="per-position",
                )
            bm = Measurement.metered(
                "baseline",
                mb,
                len(samples),
                toks,
                base.bytes_received,
                [base.done_at - t0] * len(samples),
            )
            _settle()
            progress(f"s1 {label}: opd_stream")
            with ClientMeter(pids) as mo:
                t0 = time.perf_counter()
                opd = await run_opd(cfg, opd_samples)
            om = Measurement.metered(
                "opd_stream",
                mo,
                len(samples),
                toks,
                opd.stats.bytes_received,
                [t - t0 for t in opd.done_at.values()],
            )
            check = compare(opd, base)
            check["failures"] = len(opd.failures)
            progress(f"s1 {label}: decode floor")
            floors = decode_floor(bodies)
            for name, before in floor_before.items():
                floors[name] = min(floors[name], before)
            del bodies
            floor_tok = _tokens(floor_samples)
            floor_per_1m = min(floors[p] for p in FLOOR_PARSERS) / floor_tok * 1e6
            o, b = om.as_dict(), bm.as_dict()
            out["modes"][label] = {
                "opd_stream": o,
                "baseline": b,
                "equality": check,
                "decode_floor_cpu_s_per_1m_tokens": floor_per_1m,
                "decode_floor_detail_s": floors,
                "decode_floor_per_1m_tokens": {
                    name: v / floor_tok * 1e6
                    for name, v in floors.items()
                    if not name.startswith(THREAD_WALL)
                },
                "decode_threads_speedup": floors[f"{THREAD_WALL} 1 thread(s)"]
                / floors[f"{THREAD_WALL} 2 thread(s)"],
                "cpu_us_per_token_by_step": cpu_by_step(opd.stats, toks, mo.cpu_s),
                "cpu_ratio_baseline_over_opd": b["cpu_s_per_1m_tokens"] / o["cpu_s_per_1m_tokens"],
                "wall_ratio_baseline_over_opd": b["wall_s"] / o["wall_s"],
                "opd_cpu_over_floor": o["cpu_s_per_1m_tokens"] / floor_per_1m,
                "kl_stage": kl_stage_summary(opd.stats),
            }
            out["_latencies"][f"{label} opd_stream"] = list(om.latencies_s)
            out["_latencies"][f"{label} baseline"] = list(bm.latencies_s)
            del samples, opd_samples, opd
    return out


# ---------------------------------------------------------------- scenario 2


async def _poisson(
    samples: list[Sample], rate: float, arrivals: list[float]
) -> AsyncIterator[Sample]:
    rng = np.random.default_rng(7)
    for s in samples:
        await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        arrivals.append(time.perf_counter())
        yield s


async def s2_streaming(sz: Sizes, progress: Progress) -> dict[str, Any]:
    k, strategy = 16, "only-student"
    out: dict[str, Any] = {
        "sizes": {
            "n": sz.s2_n,
            "rate_per_s": sz.s2_rate,
            "response": sz.s2_response,
            "mode": "top-k 16 only-student",
        }
    }
    with mocks(("teacher", TEACHER_SEED, REPLAY)) as procs:
        teacher = procs[0].url
        pids = pid_list(procs)
        samples = make_samples(sz.s2_n, 256, sz.s2_response, k)
        toks = _tokens(samples)
        cfg = _config(teacher, top_k=k, strategy=strategy)
        progress("s2 warm pass")
        await run_opd(cfg, samples)
        await baseline_score(samples, teacher, top_k=k, strategy=strategy, id_form="per-position")
        _settle()
        progress("s2 baseline")
        arr_b: list[float] = []
        with ClientMeter(pids) as mb:
            base = await baseline_score(
                _poisson(samples, sz.s2_rate, arr_b),
                teacher,
                top_k=k,
                strategy=strategy,
                id_form="per-position",
            )
        b_last = base.done_at - arr_b[-1]
        bm = Measurement.metered(
            "baseline",
            mb,
            len(samples),
            toks,
            base.bytes_received,
            [base.done_at - a for a in arr_b],
            extra={"last_arrival_to_its_result_s": b_last, "last_arrival_to_all_results_s": b_last},
        )
        _settle()
        progress("s2 opd_stream")
        arr_o: list[float] = []
        with ClientMeter(pids) as mo:
            opd = await run_opd(cfg, _poisson(samples, sz.s2_rate, arr_o))
        last = len(samples) - 1
        om = Measurement.metered(
            "opd_stream",
            mo,
            len(samples),
            toks,
            opd.stats.bytes_received,
            [opd.done_at[i] - arr_o[i] for i in opd.done_at],
            extra={
                "last_arrival_to_its_result_s": opd.done_at[last] - arr_o[-1],
                "last_arrival_to_all_results_s": max(opd.done_at.values()) - arr_o[-1],
            },
        )
        check = compare(opd, base)
    o, b = om.as_dict(), bm.as_dict()
    out["_latencies"] = {"opd_stream": list(om.latencies_s), "baseline": list(bm.latencies_s)}
    out.update(
        {
            "opd_stream": o,
            "baseline": b,
            "equality": check,
            "tail_ratio_baseline_over_opd": b["last_arrival_to_its_result_s"]
            / o["last_arrival_to_its_result_s"],
        }
    )
    return out


# ---------------------------------------------------------------- scenario 3


async def s3_long(sz: Sizes, progress: Progress) -> dict[str, Any]:
    k, strategy = sz.s3_k, "only-teacher"
    out: dict[str, Any] = {
        "sizes": {
            "n": sz.s3_n,
            "response": sz.s3_response,
            "k": k,
            "mode": f"top-k {k} only-teacher",
        },
        "runs": {},
    }
    with mocks(("teacher", TEACHER_SEED, REPLAY), ("student", STUDENT_SEED, REPLAY)) as procs:
        teacher, student = procs[0].url, procs[1].url
        pids = pid_list(procs)
        samples = make_samples(sz.s3_n, 512, sz.s3_response, 0)
        toks = _tokens(samples)
        progress("s3 warm pass")
        await run_opd(_config(teacher, student, top_k=k, strategy=strategy), samples)
        runs: list[tuple[str, StreamConfig | None]] = [
            ("baseline", None),
            ("opd_stream (defaults)", _config(teacher, student, top_k=k, strategy=strategy)),
            (
                ON_LOOP,
                _config(teacher, student, top_k=k, strategy=strategy, offload_bytes=2**40),
            ),
        ]
        base = None
        for name, cfg in runs:
            _settle()
            progress(f"s3 {name}")
            t0 = time.perf_counter()
            with ClientMeter(pids) as m:
                async with LagTicker() as lag:
                    if cfg is None:
                        base = await baseline_score(
                            samples,
                            teacher,
                            student_url=student,
                            top_k=k,
                            strategy=strategy,
                            id_form="per-position",
                        )
                        done = [base.done_at] * len(samples)
                        nbytes = base.bytes_received
                        check = None
                    else:
                        opd = await run_opd(cfg, samples)
                        done = list(opd.done_at.values())
                        nbytes = opd.stats.bytes_received
                        assert base is not None
                        check = compare(opd, base)
                        check["failures"] = len(opd.failures)
            meas = Measurement.metered(
                name,
                m,
                len(samples),
                toks,
                nbytes,
                [d - t0 for d in done],
                lag.summary(),
            )
            out["runs"][name] = {**meas.as_dict(), "equality": check}
            if cfg is not None:
                out["runs"][name]["kl_stage"] = kl_stage_summary(opd.stats)
    return out


# ---------------------------------------------------------------- scenario 4


async def s4_wire(sz: Sizes, progress: Progress) -> dict[str, Any]:
    k = 16
    rows: list[dict[str, Any]] = []
    unpatched = MockOptions(per_position="unpatched")
    with mocks(("teacher", TEACHER_SEED, None), ("teacher", TEACHER_SEED, unpatched)) as procs:
        patched_url, unpatched_url = procs[0].url, procs[1].url
        async with aiohttp.ClientSession() as session:

            async def size_of(url: str, req: ScoreRequest) -> tuple[int, int]:
                payload = build_score_payload(req)
                async with session.post(url + "/generate", data=payload) as r:
                    body = await r.read()
                    assert r.status == 200, body[:300]
                decode_score_response(body, req)  # it must also be a valid answer
                return len(body), len(payload)

            for r in sz.s4_lengths:
                progress(f"s4 R={r}")
                s = make_samples(1, sz.s4_prompt, r, k)[0]
                tokens = np.asarray(s.tokens, dtype=np.int64)
                ids, _ = parse_student_topk(s.student_top_logprobs, r, k)
                union = np.unique(ids).size
                base = {"tokens": tokens, "response_length": r}
                row: dict[str, Any] = {"response_length": r, "k": k, "flat_union_size": union}
                plain, _ = await size_of(patched_url, ScoreRequest(**base))
                pp, pp_req = await size_of(patched_url, ScoreRequest(**base, ids=ids))
                row["per_position"] = pp / r
                row["per_position_request"] = pp_req / r
                default_b = StreamConfig.from_env({}, teachers="http://t").id_block_size
                if default_b == 0:  # auto: what the pipeline resolves for this sample
                    default_b = auto_block_size(tokens, r, ids, top_k=0)
                for bsz in sorted({1, 2, 4, 8, default_b}):
                    blk, blk_req = await size_of(
                        unpatched_url,
                        ScoreRequest(**base, ids=ids, id_form="blocked", block_size=bsz),
                    )
                    row[f"blocked_B{bsz}"] = blk / r
                    row[f"blocked_B{bsz}_request"] = blk_req / r
                row["blocked_default"] = row[f"blocked_B{default_b}"]
                row["blocked_default_request"] = row[f"blocked_B{default_b}_request"]
                row["default_block_size"] = int(default_b)
                b64, _ = await size_of(patched_url, ScoreRequest(**base, top_k=k, topk_wire="b64"))
                js, _ = await size_of(patched_url, ScoreRequest(**base, top_k=k, topk_wire="json"))
                row["b64_topk"] = b64 / r
                row["b64_topk_per_candidate"] = (b64 - plain) / (r * k)
                row["b64_topk_per_candidate_whole_body"] = b64 / (r * k)
                row["json_topk"] = js / r
                est = (r + 1) * union * 33.0
                if est <= sz.s4_flat_max_bytes:
                    fl, _ = await size_of(
                        patched_url, ScoreRequest(**base, ids=ids, id_form="flat")
                    )
                    row["flat_union"] = fl / r
                    row["flat_union_estimated"] = False
                else:
                    row["flat_union"] = est / r
                    row["flat_union_estimated"] = True
                row["per_position_target"] = 1.05 * (k + 1) * 34
                rows.append(row)
    return {"rows": rows, "k": k, "prompt": sz.s4_prompt}


# ---------------------------------------------------------------- scenario 5


async def s5_concurrency(sz: Sizes, progress: Progress) -> dict[str, Any]:
    import psutil

    cap, lat = sz.s5_capacity, sz.s5_latency_s
    opts = MockOptions(max_running=cap, latency_fixed_s=lat)
    points: list[dict[str, Any]] = []
    with mocks(("teacher", TEACHER_SEED, opts)) as procs:
        teacher = procs[0].url
        pids = pid_list(procs)
        samples = make_samples(sz.s5_n, 64, 64, 0)
        toks = _tokens(samples)
        await run_opd(_config(teacher), samples[:4])
        for mi in sz.s5_inflight:
            _settle()
            progress(f"s5 max_inflight={mi}")
            cfg = _config(teacher, max_inflight=mi, max_inflight_per_endpoint=max(mi, 1))
            batch = samples[: min(len(samples), max(16, 6 * mi))]
            psutil.cpu_percent()
            with ClientMeter(pids) as m:
                t0 = time.perf_counter()
                opd = await run_opd(cfg, batch)
            busy = psutil.cpu_percent()
            meas = Measurement.metered(
                f"opd_stream max_inflight={mi}",
                m,
                len(batch),
                _tokens(batch),
                opd.stats.bytes_received,
                [t - t0 for t in opd.done_at.values()],
            )
            d = meas.as_dict()
            d["max_inflight"] = mi
            d["client_cpu_fraction"] = m.cpu_s / m.wall_s
            d["system_cpu_percent"] = busy
            # CPU bound: the client saturates a core, or the machine (client, mock and
            # whatever else runs on it) is saturated.
            d["cpu_bound"] = d["client_cpu_fraction"] > 0.9 or busy > 90
            d["ideal_samples_per_s"] = min(mi, cap) / lat
            points.append(d)
        _settle()
        progress("s5 baseline")
        with ClientMeter(pids) as m:
            t0 = time.perf_counter()
            base = await baseline_score(samples, teacher)
        bm = Measurement.metered(
            "baseline (unbounded)",
            m,
            len(samples),
            toks,
            base.bytes_received,
            [t - t0 for t in base.answered_at.values()],
        ).as_dict()
    return {
        "capacity": cap,
        "latency_s": lat,
        "c_over_l": cap / lat,
        "points": points,
        "baseline": bm,
    }


# ---------------------------------------------------------------- scenario 6


async def s6_soak(sz: Sizes, progress: Progress) -> dict[str, Any]:
    import psutil

    proc = psutil.Process()
    curve: list[tuple[int, float, float]] = []
    every = max(sz.s6_n // 50, 1)
    with mocks(("teacher", TEACHER_SEED, None)) as procs:
        teacher = procs[0].url
        pids = pid_list(procs)
        cfg = _config(teacher)
        count = 0
        t0 = time.perf_counter()

        def on_result(_: Any) -> None:
            nonlocal count
            count += 1
            if count % every == 0 or count == sz.s6_checkpoint:
                curve.append((count, time.perf_counter() - t0, proc.memory_info().rss / 2**20))
                if count % (every * 5) == 0:
                    progress(f"s6 {count}/{sz.s6_n}")

        with ClientMeter(pids) as m:
            opd = await run_opd(
                cfg, iter_samples(sz.s6_n, 64, 64, 0), keep=False, on_result=on_result
            )
    at = {c: rss for c, _, rss in curve}
    rss_check = at.get(sz.s6_checkpoint)
    rss_end = curve[-1][2] if curve else None
    meas = Measurement.metered(
        "opd_stream soak",
        m,
        sz.s6_n,
        sz.s6_n * 64,
        opd.stats.bytes_received,
        extra={"failures": len(opd.failures)},
    ).as_dict()
    return {
        "opd_stream": meas,
        "curve": curve,
        "rss_at_checkpoint_mb": rss_check,
        "rss_at_end_mb": rss_end,
        "checkpoint": sz.s6_checkpoint,
        "rss_ratio": (rss_end / rss_check) if rss_check and rss_end else None,
    }


# ---------------------------------------------------------------- scenario 7


async def s7_unpatched(sz: Sizes, progress: Progress) -> dict[str, Any]:
    k, strategy = 16, "only-student"
    rows: list[dict[str, Any]] = []
    for r in sz.s7_lengths:
        replay_unpatched = msgspec.structs.replace(REPLAY, per_position="unpatched")
        with mocks(
            ("teacher", TEACHER_SEED, REPLAY), ("teacher", TEACHER_SEED, replay_unpatched)
        ) as procs:
            patched_url, unpatched_url = procs[0].url, procs[1].url
            pids = pid_list(procs)
            progress(f"s7 R={r}: samples")
            samples = make_samples(sz.s7_n, sz.s7_prompt, r, k)
            row: dict[str, Any] = {"response_length": r, "n": len(samples)}
            res: dict[str, Any] = {}
            for name, url in (
                ("opd_stream patched (per-position)", patched_url),
                ("opd_stream unpatched (auto -> blocked)", unpatched_url),
            ):
                cfg = _config(url, top_k=k, strategy=strategy)
                progress(f"s7 R={r}: {name}")
                res[name], row[name] = await _warm_then_measure(name, cfg, samples, pids)
            # The baseline's flat union, on the unpatched server, capped.
            unions = [
                np.unique([e[1] for rr in s.student_top_logprobs for e in rr]).size for s in samples
            ]
            est = (sz.s7_prompt + r) * max(unions) * 33.0
            row["baseline_flat_estimated_bytes_per_answer"] = est
            if est > sz.s7_flat_max_bytes:
                row["baseline flat union"] = {
                    "skipped": True,
                    "reason": f"estimated {est / 2**20:.0f} MiB per answer (> "
                    f"{sz.s7_flat_max_bytes / 2**20:.0f} MiB): quadratic in R",
                }
            else:
                _settle()
                progress(f"s7 R={r}: baseline flat (cap {sz.s7_cap_s:.0f} s)")
                with ClientMeter(pids) as m:
                    base = await baseline_score(
                        samples,
                        unpatched_url,
                        top_k=k,
                        strategy=strategy,
                        id_form="flat",
                        cap_s=sz.s7_cap_s,
                    )
                d = Measurement.metered(
                    "baseline flat union",
                    m,
                    base.finished,
                    sum(s.response_length for i, s in enumerate(samples) if i in base.results),
                    base.bytes_received,
                ).as_dict()
                d["timed_out"] = base.timed_out
                d["finished"] = base.finished
                d["cpu_s_per_sample"] = m.cpu_s / max(base.finished, 1)
                d["equality"] = compare(res["opd_stream unpatched (auto -> blocked)"], base)
                row["baseline flat union"] = d
            p = row["opd_stream patched (per-position)"]["cpu_s_per_sample"]
            u = row["opd_stream unpatched (auto -> blocked)"]["cpu_s_per_sample"]
            row["unpatched_over_patched_cpu"] = u / p
            rows.append(row)
    return {"rows": rows, "k": k}


async def _warm_then_measure(
    name: str, cfg: StreamConfig, samples: list[Sample], pids: list[int]
) -> tuple[Any, dict[str, Any]]:
    """An unmeasured warm pass (replay caches, capability detection, discovery), then the
    measured one: the outcome and its row (CPU per sample, requests and failures added)."""
    await run_opd(cfg, samples)
    _settle()
    with ClientMeter(pids) as m:
        t0 = time.perf_counter()
        opd = await run_opd(cfg, samples)
    d = Measurement.metered(
        name,
        m,
        len(samples),
        _tokens(samples),
        opd.stats.bytes_received,
        [t - t0 for t in opd.done_at.values()],
    ).as_dict()
    d["cpu_s_per_sample"] = m.cpu_s / len(samples)
    d["requests"] = opd.stats.requests
    d["failures"] = len(opd.failures)
    return opd, d


# ---------------------------------------------------------------- scenario 8

ROUTER_RUNS = (
    "direct (client-side replicas)",
    "through sglang-router, discovery on",
    "through sglang-router, discovery off (blocks)",
    "through smg, discovery on",
    "through smg, discovery off (per-position passes)",
    "through smg, discovery off, unpatched workers (blocks)",
)


async def s8_router(sz: Sizes, progress: Progress) -> dict[str, Any]:
    """A teacher fleet behind a gateway: the same two mock replicas scored as client-side
    replicas, through sglang-router 0.3.2 with discovery (its workers addressed directly)
    and without it (blocks as independent requests), and through smg 1.13 with and
    without discovery (per-position ids pass it; unpatched workers behind it get blocks
    as independent requests, after its 422 to the blocked batch)."""
    from opd_stream.testing.router import SGLangRouter, SMGGateway

    k, strategy, r = 16, "only-student", sz.s8_response
    opts = msgspec.structs.replace(REPLAY, info_endpoints=False)
    out: dict[str, Any] = {
        "sizes": {"n": sz.s8_n, "prompt": sz.s8_prompt, "response": r, "k": k},
        "runs": {},
    }
    with mocks(("teacher", TEACHER_SEED, opts), ("teacher", TEACHER_SEED, opts)) as procs:
        workers = [p.url for p in procs]
        with SGLangRouter(workers) as router_url:
            pids = pid_list(procs) + _router_pids()
            samples = make_samples(sz.s8_n, sz.s8_prompt, r, k)
            configs = {
                ROUTER_RUNS[0]: _config({"default": workers}, top_k=k, strategy=strategy),
                ROUTER_RUNS[1]: _config(router_url, top_k=k, strategy=strategy),
                ROUTER_RUNS[2]: _config(
                    router_url, top_k=k, strategy=strategy, gateway_discovery="off"
                ),
            }
            results = {}
            for name, cfg in configs.items():
                progress(f"s8 {name}")
                opd, d = await _warm_then_measure(name, cfg, samples, pids)
                results[name] = opd
                d["fleets"] = {
                    u: {"kind": f.kind, "direct": f.direct, "workers": len(f.workers)}
                    for u, f in opd.stats.fleets.items()
                }
                out["runs"][name] = d
    # smg registers only workers that answer /server_info: mocks with their info endpoints
    smg_runs = (
        (ROUTER_RUNS[3], REPLAY, {}),
        (ROUTER_RUNS[4], REPLAY, {"gateway_discovery": "off"}),
        (
            ROUTER_RUNS[5],
            msgspec.structs.replace(REPLAY, per_position="unpatched"),
            {"gateway_discovery": "off"},
        ),
    )
    for name, opts_smg, kw in smg_runs:
        with mocks(
            ("teacher", TEACHER_SEED, opts_smg), ("teacher", TEACHER_SEED, opts_smg)
        ) as procs:
            workers = [p.url for p in procs]
            with SMGGateway(workers) as smg_url:
                pids = pid_list(procs) + _router_pids()
                cfg = _config(smg_url, top_k=k, strategy=strategy, **kw)
                progress(f"s8 {name}")
                opd, d = await _warm_then_measure(name, cfg, samples, pids)
                results[name] = opd
                d["fleets"] = {
                    u: {"kind": f.kind, "direct": f.direct, "workers": len(f.workers)}
                    for u, f in opd.stats.fleets.items()
                }
                out["runs"][name] = d
    base = out["runs"][ROUTER_RUNS[0]]
    for name in ROUTER_RUNS[1:]:
        run = out["runs"][name]
        run["cpu_over_direct"] = run["cpu_s_per_1m_tokens"] / base["cpu_s_per_1m_tokens"]
        run["bytes_over_direct"] = run["bytes_per_token"] / base["bytes_per_token"]
    direct = results[ROUTER_RUNS[0]].results
    out["equal_to_direct"] = all(
        np.array_equal(direct[i].reverse_kl, other.results[i].reverse_kl)
        and np.array_equal(direct[i].teacher_logprobs, other.results[i].teacher_logprobs)
        for other in results.values()
        for i in direct
    ) and all(len(o.results) == len(samples) for o in results.values())
    return out


def _router_pids() -> list[int]:
    """This process's gateway children, sglang-router or smg (server side: never the
    client's CPU)."""
    import psutil

    return [
        p.pid
        for p in psutil.Process().children(recursive=True)
        if any(name in " ".join(p.cmdline()) for name in ("sglang_router", "smg.launch_router"))
    ]


SCENARIOS: dict[int, tuple[str, Callable[[Sizes, Progress], Any]]] = {
    1: ("rollout tail", s1_rollout_tail),
    2: ("streaming arrivals", s2_streaming),
    3: ("long responses", s3_long),
    4: ("wire size", s4_wire),
    5: ("concurrency sweep", s5_concurrency),
    6: ("soak", s6_soak),
    7: ("unpatched server", s7_unpatched),
    8: ("fleet behind a gateway (sglang-router, smg)", s8_router),
    9: ("prefix locality on a GPU-bound fleet", s9_locality),
}
