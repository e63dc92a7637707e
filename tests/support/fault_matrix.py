"""The fault matrix: opd_stream against mock SGLang servers that misbehave, over real HTTP.

One function, :func:`run_fault_mode`, runs one fault mode of the mock (:data:`MODES`) on a
mixed workload and returns a :class:`FaultRun` (its :class:`MatrixRow` plus the raw results
for deeper checks); :func:`run_matrix` runs every mode. The project's
``tests/system/test_fault_matrix.py`` asserts on the rows, and ``python -m bench.reliability``
renders them as the table in ``docs/reliability.md``.

The workload (every mode): two ``OPDStream`` s running at once, each with its own
``AiohttpTransport``, against three mock servers: teacher ``math`` (two replicas),
teacher ``default`` (one replica) and a student.

* stream A, top-k mode: ``top_k=4``, ``strategy="union"`` (student top-k fetched from the
  student, teacher top-k + scoring of the student ids, student scoring of the teacher
  ids: three logical requests per sample), samples alternating between the two teachers;
* stream B, sampled-token mode, with rollout logprobs, same routing.

Faults are injected by the mock on every server at the mode's rate (``fault_seed`` fixed).
"restart" is different: the ``math`` replicas are real subprocesses (``MockProcess``) and one
of them is killed mid-run and started again on its port. Runs on asyncio only (the mock
servers and the aiohttp transport need it).

``engine="vllm"``: the same workload against the mock vLLM servers (``mock_vllm``, scale-out,
the streams set to ``engine="vllm"``), in the modes of :data:`VLLM_MODES`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import msgspec
import numpy as np

from opd_stream import (
    AiohttpTransport,
    OPDStream,
    Sample,
    SampleFailure,
    ScoredSample,
    StreamConfig,
)
from opd_stream.testing.mock_sglang import MockModel, MockOptions, MockProcess, serve_mock
from opd_stream.testing.mock_vllm import VllmMockOptions, VllmMockProcess, serve_vllm_mock
from opd_stream.testing.tasks import pending_tasks

__all__ = (
    "DEADLINE_S",
    "DEFAULT_N",
    "HANG_DEADLINE_S",
    "MAX_INFLIGHT",
    "MAX_RESPONSE_BYTES",
    "MODES",
    "TOP_K",
    "VLLM_MODES",
    "FaultMode",
    "FaultRun",
    "MatrixRow",
    "Workload",
    "closed_form_ok",
    "deadline_budget",
    "make_workload",
    "run_fault_mode",
    "run_matrix",
    "teacher_model",
)

Expect = Literal["recover", "fail", "deadline", "clean", "capability", "restart"]
Engine = Literal["sglang", "vllm"]

TOP_K = 4
SEEDS = {"math": 11, "default": 12, "student": 13}
TEACHER_KEY = "opd_teacher"
#: Every logical request gets this budget (retries and backoff included): far beyond what a
#: healthy request takes even on a busy machine, so that only a hang reaches it.
DEADLINE_S = 30.0
#: The budget of the *hang* row, where every hung request runs to it: short, to keep the row
#: quick, yet still many times what a request that is not hung takes on a busy machine.
HANG_DEADLINE_S = 8.0
#: The attempt watchdog of the *hang_watchdog* row: a hung attempt is abandoned after it; a
#: healthy attempt stays far below it even on a busy machine.
WATCHDOG_S = 4.0
MAX_INFLIGHT = 64
#: The CPU part of a run's wall-time budget (see :func:`deadline_budget`): a 240-sample run
#: takes about 1 s of CPU on a quiet machine, and several times that on a busy one.
BUDGET_ALLOWANCE_S = 30.0
#: Connection set-up on 127.0.0.1: instant, but the loop must get to it on a busy machine.
CONNECT_TIMEOUT_S = 10.0
#: The logical requests of one sample, at most (stream A: student top-k, teacher, student ids).
REQUESTS_PER_SAMPLE = 3
MAX_RESPONSE_BYTES = 256 * 1024
#: Samples per stream (two streams: ``2 * DEFAULT_N`` samples per mode); the tests use it too.
DEFAULT_N = 120
_TOKEN_LO, _TOKEN_HI = 100_000, 150_000  # distinctive ids: easy to spot if one leaks


@dataclass(frozen=True)
class FaultMode:
    """One row of the matrix.

    Attributes:
        key: short id (``http_500``, ``hang``, ``restart`` ...).
        title: what the server does, for the table.
        rate: probability per ``/generate`` request (1.0 for a server-wide property).
        options: :class:`MockOptions` changes applied to every mock server.
        expect: the class of outcome (see ``tests/system/test_fault_matrix.py``).
        reasons: the failure reasons this fault may produce (when attempts run out, or
            at once for a non-retryable fault).
        fault_kind: the mock's counter in ``MockStats.faults`` (None: not counted there).
        client: StreamConfig changes for this row (e.g. ``attempt_timeout_s``, or a
            ``request_deadline_s`` other than :data:`DEADLINE_S`).
    """

    key: str
    title: str
    rate: float
    options: dict[str, Any]
    expect: Expect
    reasons: frozenset[str] = frozenset()
    fault_kind: str | None = None
    client: dict[str, Any] = field(default_factory=dict)


def _rate(kind: str, rate: float = 0.1, **extra: Any) -> dict[str, Any]:
    return {f"fault_{kind}": rate, "fault_seed": 2024, **extra}


def _http(side_reason: str) -> frozenset[str]:
    return frozenset({f"teacher_{side_reason}", f"student_{side_reason}"})


MODES: tuple[FaultMode, ...] = (
    FaultMode("none", "no fault (baseline)", 0.0, {}, "clean"),
    FaultMode(
        "http_500", "HTTP 500", 0.1, _rate("http_500"), "recover", _http("http_500"), "http_500"
    ),
    FaultMode(
        "http_503", "HTTP 503", 0.1, _rate("http_503"), "recover", _http("http_503"), "http_503"
    ),
    FaultMode(
        "http_429", "HTTP 429", 0.1, _rate("http_429"), "recover", _http("http_429"), "http_429"
    ),
    FaultMode(
        "abort",
        "abort on HTTP 200",
        0.1,
        _rate("abort"),
        "recover",
        frozenset({"aborted"}),
        "abort",
    ),
    FaultMode(
        "hang",
        "hang beyond the deadline",
        0.1,
        _rate("hang"),
        "deadline",
        frozenset({"deadline_exceeded"}),
        "hang",
        client={"request_deadline_s": HANG_DEADLINE_S},
    ),
    FaultMode(
        "hang_watchdog",
        f"hang, with attempt_timeout_s={WATCHDOG_S:g} (the watchdog)",
        0.1,
        _rate("hang"),
        "recover",
        frozenset({"connection_error", "deadline_exceeded"}),
        "hang",
        client={"attempt_timeout_s": WATCHDOG_S},
    ),
    FaultMode(
        "reset",
        "connection reset mid-body",
        0.1,
        _rate("reset"),
        "recover",
        frozenset({"connection_error", "malformed_response"}),
        "reset",
    ),
    FaultMode(
        "truncated",
        "truncated body (FIN before Content-Length)",
        0.1,
        _rate("truncated"),
        "recover",
        frozenset({"connection_error", "malformed_response"}),
        "truncated",
    ),
    FaultMode(
        "malformed",
        "malformed JSON",
        0.1,
        _rate("malformed"),
        "recover",
        frozenset({"malformed_response"}),
        "malformed",
    ),
    FaultMode(
        "misaligned",
        "misaligned token ids",
        0.1,
        _rate("misaligned"),
        "fail",
        frozenset({"misaligned_response"}),
        "misaligned",
    ),
    FaultMode(
        "missing_rows",
        "missing rows",
        0.1,
        _rate("missing_rows"),
        "fail",
        frozenset({"misaligned_response"}),
        "missing_rows",
    ),
    FaultMode(
        "unpatched",
        "per-position field ignored (every server)",
        1.0,
        {"per_position": "unpatched"},
        "capability",
    ),
    FaultMode(
        "oversized",
        "oversized body (1 MiB over a 256 KiB cap)",
        0.1,
        _rate("oversized", oversized_bytes=1 << 20),
        "fail",
        frozenset({"response_too_large"}),
        "oversized",
    ),
    FaultMode(
        "slow_drip",
        "slow-drip body (256 B every 10 ms)",
        0.1,
        _rate("slow_drip", drip_chunk_bytes=256, drip_delay_s=0.01),
        "clean",
        fault_kind="slow_drip",
    ),
    FaultMode(
        "restart",
        "server killed and restarted mid-run (subprocess)",
        1.0,
        {},
        "restart",
        frozenset({"connection_error"}),
    ),
)


#: The modes that apply to vLLM servers (``per_position`` is SGLang's: no "unpatched" row).
VLLM_MODES: tuple[FaultMode, ...] = tuple(m for m in MODES if m.key != "unpatched")


class MatrixRow(msgspec.Struct, kw_only=True):
    """The outcome of one fault mode (one table row)."""

    fault: str
    key: str
    rate: float
    samples_in: int
    samples_out: int
    unique_out: int
    scored: int
    wrong: int
    retries: int
    injected: int
    failures: dict[str, int]
    wall_s: float
    budget_s: float
    max_latency_s: float
    disconnects: int
    pending_tasks: int
    pool_idle: bool
    high_water_ok: bool


@dataclass
class Workload:
    """The samples of both streams and the closed-form models that score them."""

    topk_samples: list[Sample]
    sampled_samples: list[Sample]
    models: dict[str, MockModel]


@dataclass
class FaultRun:
    """A :class:`MatrixRow` and everything behind it."""

    mode: FaultMode
    row: MatrixRow
    workload: Workload
    topk_results: list[ScoredSample | SampleFailure]
    sampled_results: list[ScoredSample | SampleFailure]
    stats: list[Any] = field(default_factory=list)
    endpoint_caps: dict[str, tuple[bool | None, bool | None]] = field(default_factory=dict)
    restarted_served: int = 0


def make_workload(n: int, seed: int = 0) -> Workload:
    """``n`` samples per stream: tiny prompts (3-8) and responses (2-6), alternating teachers."""
    models = {
        "math": MockModel("teacher", SEEDS["math"]),
        "default": MockModel("teacher", SEEDS["default"]),
        "student": MockModel("student", SEEDS["student"]),
    }
    rng = np.random.default_rng(seed)

    def one(i: int, *, rollout: bool) -> Sample:
        p, r = int(rng.integers(3, 9)), int(rng.integers(2, 7))
        tokens = rng.integers(_TOKEN_LO, _TOKEN_HI, p + r).tolist()
        name = "math" if i % 2 == 0 else "code"  # "code" is unknown: routes to default
        lps = None
        if rollout:
            lp = models["student"].token_logprobs(np.asarray(tokens), np.arange(p, p + r))
            lps = [float(np.float32(x)) for x in lp]
        return Sample(
            tokens, r, metadata={TEACHER_KEY: name}, rollout_logprobs=lps, sample_id=f"s{i}"
        )

    return Workload(
        topk_samples=[one(i, rollout=False) for i in range(n)],
        sampled_samples=[one(i, rollout=True) for i in range(n)],
        models=models,
    )


def teacher_model(workload: Workload, sample: Sample) -> MockModel:
    """The closed-form model of the teacher ``sample`` is routed to (``math`` or ``default``)."""
    name = "math" if sample.metadata.get(TEACHER_KEY) == "math" else "default"
    return workload.models[name]


def closed_form_ok(workload: Workload, res: ScoredSample) -> bool:
    """Teacher logprobs (and the sampled-token reverse KL) equal the mock's closed form."""
    smp = res.sample
    tok = np.asarray(smp.tokens, dtype=np.int64)
    p = len(tok) - smp.response_length
    want = teacher_model(workload, smp).token_logprobs(tok, np.arange(p, len(tok)))
    want32 = want.astype(np.float32)
    got = res.teacher_logprobs.numpy()
    if got.shape != want32.shape or not np.array_equal(got, want32):
        return False
    if smp.rollout_logprobs is not None:
        assert res.reverse_kl is not None
        ref = np.asarray(smp.rollout_logprobs, dtype=np.float64) - np.maximum(want32, -1e4)
        if not np.allclose(res.reverse_kl.numpy(), ref, atol=1e-5, rtol=0):
            return False
    return True


def _config(
    teachers: dict[str, Any], student: str, *, top_k: int, engine: Engine, **client: Any
) -> StreamConfig:
    extra: dict[str, Any] = (
        {"top_k": top_k, "strategy": "union", "student_url": student} if top_k else {}
    )
    settings: dict[str, Any] = {
        "teachers": teachers,
        "teacher_key": TEACHER_KEY,
        "request_deadline_s": DEADLINE_S,
        "max_attempts": 4,
        "max_inflight": MAX_INFLIGHT,
        "channel_capacity": 16,
        "max_response_bytes": MAX_RESPONSE_BYTES,
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.05,
        "connect_timeout_s": CONNECT_TIMEOUT_S,
        "kl_device": "cpu",
        "engine": "auto" if engine == "sglang" else engine,  # vLLM: set, never detected
        **extra,
        **_balance_options(),
        **client,  # the row's own settings win
    }
    return StreamConfig.from_env({}, **settings)


EJECT_COOLDOWN_S = 0.5
"""The runs' ejection cool-down: short, so that a restarted replica is re-admitted mid-run."""


def _balance_options() -> dict[str, Any]:
    """A short ejection cool-down (:data:`EJECT_COOLDOWN_S`)."""
    if "eject_cooldown_s" in StreamConfig.__struct_fields__:
        return {"eject_cooldown_s": EJECT_COOLDOWN_S}
    return {}


def deadline_budget(n: int, deadline_s: float = DEADLINE_S) -> float:
    """Worst case wall time of ``n`` samples per stream if every request ran to its deadline.

    Each sample holds one of ``MAX_INFLIGHT`` slots for at most ``REQUESTS_PER_SAMPLE``
    deadlines, so the run takes at most ``ceil(n / MAX_INFLIGHT)`` such waves; plus a fixed
    allowance of :data:`BUDGET_ALLOWANCE_S` for start-up, decode and KL on a busy machine.
    """
    return math.ceil(n / MAX_INFLIGHT) * REQUESTS_PER_SAMPLE * deadline_s + BUDGET_ALLOWANCE_S


async def _drain(
    stream: OPDStream,
    samples: list[Sample] | AsyncIterator[Sample],
    out: list[ScoredSample | SampleFailure],
) -> None:
    """Collect the results of one run into ``out``."""
    async with stream.run(samples) as results:
        out.extend([item async for item in results])


async def _settled_tasks(before: set[asyncio.Task[Any]], wait_s: float = 1.0) -> int:
    """How many tasks started during the run are still pending (waits up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        extra = pending_tasks() - before
        if not extra or time.monotonic() > deadline:
            return len(extra)
        await asyncio.sleep(0.02)


async def run_fault_mode(
    mode: FaultMode, n: int = DEFAULT_N, *, seed: int = 0, engine: Engine = "sglang"
) -> FaultRun:
    """Run ``n`` samples per stream (``2 n`` in all) under ``mode``; return the row.

    ``engine``: the servers' (``"vllm"``: the mock vLLM servers, a mode of
    :data:`VLLM_MODES`). Must run on asyncio (the mock servers and the aiohttp transport
    need it).
    """
    workload = make_workload(n, seed)
    vllm = engine == "vllm"
    opts_type = VllmMockOptions if vllm else MockOptions
    options = opts_type(**mode.options)
    serve = serve_vllm_mock if vllm else serve_mock
    procs: list[MockProcess] = []
    async with (
        serve("teacher", SEEDS["math"], replicas=2, options=options) as math_srv,
        serve("teacher", SEEDS["default"], options=options) as default_srv,
        serve("student", SEEDS["student"], options=options) as student_srv,
    ):
        math_urls = list(math_srv.urls)
        if mode.expect == "restart":
            # a little latency, so that requests are in flight on it when it is killed
            slow = opts_type(latency_fixed_s=0.1)
            process = VllmMockProcess if vllm else MockProcess
            procs = [process("teacher", SEEDS["math"], options=slow)]
            math_urls[0] = await anyio.to_thread.run_sync(procs[0].start)
        try:
            run = await _run_streams(
                mode, workload, math_urls, default_srv.url, student_srv.url, procs, engine
            )
        finally:
            for proc in procs:
                proc.kill()
        clusters = [math_srv, default_srv, student_srv]
        await anyio.sleep(0.05)  # let the servers see the last disconnects
        injected = 0
        disconnects = 0
        for cluster in clusters:
            for st in cluster.stats:
                if mode.fault_kind is not None:
                    injected += st.faults.get(mode.fault_kind, 0)
                disconnects += st.disconnects
        run.row.injected = injected
        run.row.disconnects = disconnects
    return run


async def _restart_mid_run(proc: MockProcess, restarted: anyio.Event) -> None:
    """Kill ``proc`` while it certainly holds one of the run's requests, start it again,
    then set ``restarted``.

    The replica is first told to hang every request it gets (``fault_hang=1.0``: held
    until its client goes away, counted as a hang), and is killed as soon as it holds one:
    that request can only end by the kill, so the kill always costs a retry. (Killing when
    its in-flight gauge showed requests raced them on a loaded machine: they could finish
    before the kill landed, and nothing was retried.) The restarted process has its
    original options again. ``restarted`` is set one ejection cool-down after the
    restart, so that the second half finds the replica ready to be re-admitted.
    """
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(proc.url + "/mock/options", json={"fault_hang": 1.0}) as r:
            r.raise_for_status()
        while True:  # poll the server's own counter; the caller's deadline bounds the wait
            if await _hangs(session, proc.url):
                break
            await anyio.sleep(0.005)
    await anyio.to_thread.run_sync(proc.restart)
    # Every ejection of the replica began before it was up again: at the kill, or at a
    # re-admission probe that found it down while it restarted. Past one cool-down from
    # now, the second half's first request to it probes a live server and re-admits it.
    # (Released at once, a fast second half could end inside the cool-down of a probe
    # that failed just before the restart, and the replica would serve nothing.)
    await anyio.sleep(EJECT_COOLDOWN_S + 0.1)
    restarted.set()


async def _hangs(session: Any, url: str) -> int:
    async with session.get(url + "/mock/stats") as resp:
        stats = msgspec.json.decode(await resp.read())
    return int(stats["faults"].get("hang", 0))


async def _gated(samples: list[Sample], half: int, gate: anyio.Event) -> AsyncIterator[Sample]:
    """The samples, holding back the second half until ``gate`` is set."""
    for i, smp in enumerate(samples):
        if i == half:
            await gate.wait()
        yield smp


async def _served_since_start(url: str) -> int:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(url + "/mock/stats") as resp:
        stats = msgspec.json.decode(await resp.read())
    return int(stats["generate_requests"])


async def _run_streams(
    mode: FaultMode,
    workload: Workload,
    math_urls: list[str],
    default_url: str,
    student_url: str,
    procs: list[MockProcess],
    engine: Engine,
) -> FaultRun:
    teachers = {"math": math_urls, "default": default_url}
    cfg_a = _config(teachers, student_url, top_k=TOP_K, engine=engine, **mode.client)
    cfg_b = _config(teachers, student_url, top_k=0, engine=engine, **mode.client)
    tr_a, tr_b = (
        AiohttpTransport(connect_timeout_s=CONNECT_TIMEOUT_S),
        AiohttpTransport(connect_timeout_s=CONNECT_TIMEOUT_S),
    )
    out_a: list[ScoredSample | SampleFailure] = []
    out_b: list[ScoredSample | SampleFailure] = []
    before = pending_tasks()
    start = time.monotonic()
    async with OPDStream(cfg_a, transport=tr_a) as sa, OPDStream(cfg_b, transport=tr_b) as sb:
        async with anyio.create_task_group() as tg:
            a: list[Sample] | AsyncIterator[Sample] = workload.topk_samples
            b: list[Sample] | AsyncIterator[Sample] = workload.sampled_samples
            if procs:
                # kill while it holds a request; the second half waits for the restart,
                # so the restarted replica can be seen taking work again
                restarted = anyio.Event()
                n = len(workload.topk_samples)
                a = _gated(workload.topk_samples, n // 2, restarted)
                b = _gated(workload.sampled_samples, n // 2, restarted)
                tg.start_soon(_restart_mid_run, procs[0], restarted)
            tg.start_soon(_drain, sa, a, out_a)
            tg.start_soon(_drain, sb, b, out_b)
        wall = time.monotonic() - start
        stats = [sa.stats(), sb.stats()]
        idle = tr_a.idle and tr_b.idle
    pending = await _settled_tasks(before)
    restarted_served = await _served_since_start(procs[0].url) if procs else 0

    n_in = len(workload.topk_samples) + len(workload.sampled_samples)
    results = out_a + out_b
    failures: dict[str, int] = {}
    wrong = 0
    max_lat = 0.0
    for item in results:
        if isinstance(item, SampleFailure):
            failures[item.reason] = failures.get(item.reason, 0) + 1
        else:
            max_lat = max(max_lat, item.latency_s)
            wrong += not closed_form_ok(workload, item)
    high_ok = all(
        ch.high_water <= ch.capacity for st in stats for ch in st.channels.as_dict().values()
    ) and all(st.in_flight == 0 for st in stats)
    unique = len({(0, r.index) for r in out_a} | {(1, r.index) for r in out_b})
    row = MatrixRow(
        fault=mode.title,
        key=mode.key,
        rate=mode.rate,
        samples_in=n_in,
        samples_out=len(results),
        unique_out=unique,
        scored=sum(isinstance(r, ScoredSample) for r in results),
        wrong=wrong,
        retries=sum(st.retries for st in stats),
        injected=0,
        failures=dict(sorted(failures.items())),
        wall_s=round(wall, 2),
        budget_s=deadline_budget(len(workload.topk_samples), cfg_a.request_deadline_s),
        max_latency_s=round(max_lat, 3),
        disconnects=0,
        pending_tasks=pending,
        pool_idle=idle,
        high_water_ok=high_ok,
    )
    caps = {url: (ep.per_position, ep.b64_topk) for st in stats for url, ep in st.endpoints.items()}
    return FaultRun(
        mode=mode,
        row=row,
        workload=workload,
        topk_results=out_a,
        sampled_results=out_b,
        stats=stats,
        endpoint_caps=caps,
        restarted_served=restarted_served,
    )


async def run_matrix(
    n: int = DEFAULT_N, keys: Sequence[str] | None = None, *, engine: Engine = "sglang"
) -> list[MatrixRow]:
    """Every mode of ``engine`` (or those in ``keys``), one after the other."""
    rows = []
    for mode in VLLM_MODES if engine == "vllm" else MODES:
        if keys and mode.key not in keys:
            continue
        rows.append((await run_fault_mode(mode, n, engine=engine)).row)
    return rows
