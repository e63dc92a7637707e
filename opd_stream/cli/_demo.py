"""``opd-stream demo``: score real rollouts against embedded mock SGLang or vLLM servers.

Starts mock teacher servers (one per teacher name; SGLang, or vLLM with ``--engine vllm`` /
``vllm-completions``) and a mock SGLang student server as subprocesses, generates rollouts
from the student (``/generate`` with ``max_new_tokens > 0``), streams them through
:class:`OPDStream` while they are still being generated, checks a sample of the results
against the mock's closed-form model and prints a summary. The stream detects each
server's engine (``engine="auto"``, whatever ``OPD_STREAM_ENGINE`` says); a mode the
teachers' engine cannot serve is refused before any server starts, with the stream's own
sentence (:func:`~opd_stream.wire._vllm.engine_problem`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import numpy as np

from .._logging import LOG_LEVELS
from .._sample import Sample, SampleFailure, ScoredSample
from .._stream import OPDStream
from ..config._settings import StreamConfig
from ..fleet._routing import generate_url, normalize_server_url
from ..kl._names import STRATEGIES, WEIGHT_MODES
from ..kl._plan import STRATEGY_NEEDS
from ..wire._decode_generate import decode_generate_response
from ..wire._payloads import build_generate_payload
from ..wire._request import Engine
from ..wire._vllm import engine_problem
from ._parser_notice import scanner_notice
from ._progress import Progress

if TYPE_CHECKING:
    import aiohttp

__all__ = ("add_demo_arguments", "run_demo")

_TEACHER_NAMES = ("math", "code", "chat", "science")
_DEMO_ENGINES = ("sglang", "vllm", "vllm-completions")
_MOCK_NAMES = {
    "sglang": "",
    "vllm": " (mock vLLM subprocesses, vllm serve --enable-scale-out)",
    "vllm-completions": " (mock vLLM subprocesses without --enable-scale-out: /v1/completions)",
}


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # NaN included
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--samples", type=_at_least(1), default=128, help="rollouts to score (default 128)"
    )
    p.add_argument("--prompt-len", type=_at_least(1), default=128)
    p.add_argument("--response-len", type=_at_least(1), default=256)
    p.add_argument(
        "--top-k", type=_at_least(0), default=8, help="0 = sampled-token mode (default 8)"
    )
    p.add_argument(
        "--strategy",
        default=None,
        choices=STRATEGIES,
        help="default union (only-teacher with --engine vllm-completions)",
    )
    p.add_argument("--weight-mode", default="student_p", choices=WEIGHT_MODES)
    p.add_argument(
        "--teachers",
        type=_at_least(1),
        default=2,
        help=f"number of teacher servers (1-{len(_TEACHER_NAMES)})",
    )
    p.add_argument(
        "--engine",
        default="sglang",
        choices=_DEMO_ENGINES,
        help="the teacher servers' engine: sglang (default), vllm (vLLM's scale-out API) or "
        "vllm-completions (vLLM's /v1/completions: sampled-token mode and only-teacher); "
        "the student stays a mock SGLang rollout engine, and the stream detects each "
        "server's engine",
    )
    p.add_argument(
        "--per-position",
        default="patched",
        choices=["patched", "unpatched"],
        help="SGLang teacher servers' support of per-position id scoring",
    )
    p.add_argument(
        "--fault-rate",
        type=_rate,
        default=0.02,
        help="rate of injected HTTP 503s on the teachers, in [0, 1] (default 0.02)",
    )
    p.add_argument("--max-inflight", type=_at_least(1), default=64)
    p.add_argument("--seed", type=_at_least(0), default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,  # keeps a value given before the sub-command
        help="structlog level, also accepted before 'demo' (default warning)",
    )


async def _rollouts(
    session: aiohttp.ClientSession,
    student_url: str,
    args: argparse.Namespace,
    names: list[str],
) -> AsyncIterator[Sample]:
    """Generate rollouts from the student in small batches, yielding each as it is ready."""
    rng = np.random.default_rng(args.seed)
    batch = 8
    for start in range(0, args.samples, batch):
        n = min(batch, args.samples - start)
        prompts = [rng.integers(0, 30000, args.prompt_len).tolist() for _ in range(n)]
        body = build_generate_payload(
            prompts,
            args.response_len,
            temperature=1.0,
            top_logprobs_num=args.top_k,
            seed=args.seed + start,
            topk_wire="b64",
        )
        async with session.post(generate_url(student_url), data=body) as resp:
            payload = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"student generation failed with HTTP {resp.status}")
        for i, (prompt, gen) in enumerate(
            zip(prompts, decode_generate_response(payload), strict=True)
        ):
            top = None
            if gen.output_top_ids is not None and gen.output_top_logprobs is not None:
                # the array form: no per-entry Python objects between the two servers
                top = (gen.output_top_ids, gen.output_top_logprobs)
            idx = start + i
            yield Sample(
                prompt + gen.output_ids.tolist(),
                int(gen.output_ids.shape[0]),
                metadata={"opd_teacher": names[idx % len(names)]},
                rollout_logprobs=gen.output_logprobs,
                student_top_logprobs=top,
                sample_id=idx,
            )


def _verify(results: list[ScoredSample], models: dict[str, Any]) -> float:
    """Max |teacher logprob - closed form| over a few results (float32 rounding expected 0)."""
    worst = 0.0
    for res in results[:16]:
        tokens = np.asarray(res.sample.tokens, dtype=np.int64)
        r = res.sample.response_length
        ref = models[res.teacher].token_logprobs(tokens, np.arange(len(tokens) - r, len(tokens)))
        got = res.teacher_logprobs.numpy().astype(np.float64)
        finite = np.isfinite(ref)
        worst = max(worst, float(np.max(np.abs(got[finite] - ref[finite]), initial=0.0)))
    return worst


async def run_demo(args: argparse.Namespace) -> int:
    from ..testing.mock_sglang import MockModel, MockOptions, MockProcess
    from ..testing.mock_vllm import VllmMockOptions, VllmMockProcess

    if not 1 <= args.teachers <= len(_TEACHER_NAMES):
        print(
            f"opd-stream demo: error: --teachers must be 1..{len(_TEACHER_NAMES)}",
            file=sys.stderr,
        )
        return 2
    names = list(_TEACHER_NAMES[: args.teachers])
    engine: Engine = args.engine
    strategy = args.strategy or ("only-teacher" if engine == "vllm-completions" else "union")
    # Validated (OPD_STREAM_* variables included) before any server starts; the real
    # URLs are known once they listen. The stream detects each server's engine ("auto").
    placeholder = "http://127.0.0.1:1"
    cfg = StreamConfig.from_env(
        teachers=dict.fromkeys(names, placeholder),
        student_url=placeholder,
        top_k=args.top_k,
        strategy=strategy if args.top_k else "only-student",
        weight_mode=args.weight_mode,
        max_inflight=args.max_inflight,
        kl_device="cpu",
        engine="auto",  # the demo's own servers: each one's engine is detected
        server_engines={},
    )
    problem = _engine_problem(engine, cfg)
    if problem is not None:
        print(f"opd-stream demo: error: {problem}", file=sys.stderr)
        return 2
    notice = scanner_notice()
    if notice is not None:
        print(f"opd-stream demo: {notice}", file=sys.stderr)
    opts = MockOptions(
        per_position=args.per_position,
        fault_http_503=args.fault_rate,
        fault_seed=args.seed,
        latency_fixed_s=0.002,
    )
    # the vLLM servers' --max-logprobs, as the stream is configured to expect
    vllm_opts = VllmMockOptions(**msgspec.structs.asdict(opts), max_logprobs=cfg.vllm_max_logprobs)
    # Real server processes, so that the event-loop lag and CPU we report are the client's.
    procs: dict[str, MockProcess] = {
        name: (
            MockProcess("teacher", args.seed + 1 + i, options=opts)
            if engine == "sglang"
            else VllmMockProcess(
                "teacher", args.seed + 1 + i, options=vllm_opts, scale_out=engine == "vllm"
            )
        )
        for i, name in enumerate(names)
    }
    student = MockProcess("student", args.seed)
    with contextlib.ExitStack() as stack:
        async with anyio.create_task_group() as tg:
            for proc in [student, *procs.values()]:
                stack.callback(proc.kill)
                tg.start_soon(anyio.to_thread.run_sync, proc.start)
        real = {n: p.url for n, p in procs.items()}
        cfg = cfg.evolve(teachers=real, student_url=student.url)
        mode = f"top-k {args.top_k} {cfg.strategy}" if args.top_k else "sampled-token"
        print(
            f"teachers: {', '.join(f'{n}={u}' for n, u in real.items())}{_MOCK_NAMES[engine]}; "
            f"student: {student.url} (mock SGLang subprocesses)"
        )
        print(
            f"mode: {mode}, weights {cfg.weight_mode}, {args.samples} rollouts of "
            f"{args.prompt_len}+{args.response_len} tokens, {args.fault_rate:.0%} injected 503s"
        )
        scored: list[ScoredSample] = []
        failed: list[SampleFailure] = []
        t0 = time.perf_counter()
        progress = Progress(sys.stderr, enabled=not args.no_progress)
        progress.set_total(args.samples)
        import aiohttp  # here, not at import: the CLI builds its parser from this module

        async with aiohttp.ClientSession() as session, OPDStream(cfg) as stream:
            async with stream.run(_rollouts(session, student.url, args, names)) as results:
                async for item in results:
                    if isinstance(item, ScoredSample):
                        scored.append(item)
                        progress.update(ok=1)
                    else:
                        failed.append(item)
                        progress.update(failed=1)
            stats = stream.stats()
        wall = time.perf_counter() - t0
        progress.close()
    models = {n: MockModel("teacher", args.seed + 1 + i) for i, n in enumerate(names)}
    worst = _verify(scored, models)
    found = _engines_line(stats, {**real, "student": student.url}, cfg.engine)
    _summary(scored, failed, stats, wall, worst, engines=found)
    return 0 if not failed else 1


def _engine_problem(engine: Engine, cfg: StreamConfig) -> str | None:
    """Why teachers of ``engine`` cannot serve the demo's mode, or ``None``."""
    if cfg.top_k == 0:
        top_k, ids = 0, False
    else:
        needs = STRATEGY_NEEDS[cfg.strategy]
        top_k, ids = (cfg.top_k if needs.teacher_topk else 0), needs.teacher_scores_student_ids
    limit = max(cfg.vllm_max_logprobs, 0)
    problem = engine_problem(engine, top_k=top_k, ids=ids, max_logprobs=limit)
    if problem is None:
        return None
    mode = f"--strategy {cfg.strategy} --top-k {cfg.top_k}" if cfg.top_k else "--top-k 0"
    if 0 < limit < top_k:  # the demo starts its servers with the configured limit
        problem += " (OPD_STREAM_VLLM_MAX_LOGPROBS sets it for the demo's servers)"
    return f"--engine {engine} cannot serve {mode}: {problem}"


def _engines_line(stats: Any, servers: dict[str, str], setting: str) -> str:
    """Each server's engine as the stream knows it after the run (``stats().endpoints``)."""
    parts = []
    for name, url in servers.items():
        ep = stats.endpoints.get(normalize_server_url(url))
        known = None if ep is None else ep.engine
        parts.append(f"{name} {known or 'not contacted'}")
    how = "detected" if setting == "auto" else f"set: {setting}"
    return f"{', '.join(parts)} ({how})"


def _summary(
    scored: list[ScoredSample],
    failed: list[SampleFailure],
    stats: Any,
    wall: float,
    worst: float,
    *,
    engines: str | None = None,
) -> None:
    tokens = sum(s.sample.response_length for s in scored)
    per_teacher: dict[str, list[float]] = defaultdict(list)
    for s in scored:
        if s.reverse_kl is not None and s.reverse_kl.numel():
            per_teacher[s.teacher].append(float(s.reverse_kl.mean()))

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{1000 * x:.1f} ms"

    print(
        f"scored {len(scored)} samples, {len(failed)} failures in {wall:.2f} s "
        f"(rollout generation and scoring overlapped)"
    )
    print(
        f"  throughput: {len(scored) / wall:.1f} samples/s, {tokens / wall:,.0f} response tokens/s"
    )
    print(
        f"  latency p50 {ms(stats.latency_p50_s)}, p99 {ms(stats.latency_p99_s)}; "
        f"event-loop lag p99 {ms(stats.loop_lag_p99_s)}, max {ms(stats.loop_lag_max_s)}"
    )
    print(
        f"  requests {stats.requests}, retries {stats.retries}, "
        f"{stats.bytes_received / 1e6:.1f} MB received"
    )
    if engines is not None:
        print(f"  engines: {engines}")
    if stats.failures:
        print(f"  failures by reason: {stats.failures}")
    for name in sorted(per_teacher):
        vals = per_teacher[name]
        print(
            f"  mean reverse KL, teacher {name}: {sum(vals) / len(vals):+.4f} ({len(vals)} samples)"
        )
    if not scored:
        print("  teacher logprobs vs the mock's closed form: no sample scored, nothing checked")
        return
    ok = "OK" if worst == 0.0 or math.isclose(worst, 0.0, abs_tol=1e-6) else "MISMATCH"
    print(f"  teacher logprobs vs the mock's closed form: max |diff| {worst:.2e} ({ok})")
