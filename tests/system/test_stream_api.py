"""The public OPDStream API: lifecycle errors, transports per backend, decode offload,
concurrent runs, and the log events it emits."""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from support.config import stream_config

from opd_stream import (
    AiohttpTransport,
    ConfigError,
    OPDStream,
    Sample,
    ScoredSample,
)
from opd_stream._stats import ParserCounts
from opd_stream.testing import capture_events
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

T = "http://teacher:1"
S = "http://student:2"


_cfg = partial(stream_config, T)


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(0, 5000, 12).tolist(), 6) for _ in range(n)]


def _servers() -> dict[str, InProcessSGLang]:
    return {T: InProcessSGLang("teacher", 1), S: InProcessSGLang("student", 1)}


def test_a_config_that_is_not_a_stream_config_is_refused() -> None:
    with pytest.raises(TypeError, match="StreamConfig"):
        OPDStream({"teachers": T})  # type: ignore[arg-type]


async def test_run_outside_the_stream_context_is_an_error() -> None:
    stream = OPDStream(_cfg(), transport=mock_transport(_servers()))
    with pytest.raises(RuntimeError, match="outside"):
        stream.run([])


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_aiohttp_transport_says_it_needs_asyncio_under_trio() -> None:
    with pytest.raises(ConfigError, match="asyncio"):
        async with OPDStream(_cfg(), transport=AiohttpTransport()):
            pass


async def test_an_empty_input_gives_an_empty_result() -> None:
    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        async with stream.run([]) as results:
            assert [r async for r in results] == []


async def test_runs_can_share_one_stream_concurrently() -> None:
    outs: dict[int, list[Any]] = {}

    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:

        async def one(k: int) -> None:
            async with stream.run(_samples(10, seed=k)) as results:
                outs[k] = [r async for r in results]

        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(one, k)
    for k in range(3):
        assert sorted(r.index for r in outs[k]) == list(range(10))
        assert all(isinstance(r, ScoredSample) for r in outs[k])


async def test_answers_parsed_in_decode_threads_give_identical_results() -> None:
    samples = _samples(6, seed=3)
    cfg_topk = {"top_k": 4, "student_url": S, "strategy": "union"}
    async with OPDStream(_cfg(**cfg_topk), transport=mock_transport(_servers())) as stream:
        async with stream.run(samples) as results:
            inline = sorted([r async for r in results], key=lambda r: r.index)
    offload = _cfg(**cfg_topk, decode_threads=2, offload_bytes=1)
    async with OPDStream(offload, transport=mock_transport(_servers())) as stream:
        async with stream.run(samples) as results:
            pooled = sorted([r async for r in results], key=lambda r: r.index)
    for a, b in zip(inline, pooled, strict=True):
        assert isinstance(a, ScoredSample) and isinstance(b, ScoredSample)
        assert a.reverse_kl is not None and b.reverse_kl is not None
        assert a.reverse_kl.tolist() == b.reverse_kl.tolist()
        assert a.teacher_logprobs.tolist() == b.teacher_logprobs.tolist()


async def test_every_parser_gives_identical_results_and_stats_say_which_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import opd_stream.scanner._loader as jr

    samples = _samples(6, seed=4)
    cfg_topk = {"top_k": 4, "student_url": S, "strategy": "union"}

    async def run(**kw: Any) -> tuple[list[Any], ParserCounts]:
        async with OPDStream(_cfg(**cfg_topk, **kw), transport=mock_transport(_servers())) as st:
            async with st.run(samples) as results:
                out = sorted([r async for r in results], key=lambda r: r.index)
            return out, st.stats().decoded

    assert jr.prepare()
    scanned, by_scanner = await run(decode_threads=2, offload_bytes=1)
    assert by_scanner.scanner > 0
    monkeypatch.setattr(jr, "_kernel", None)
    monkeypatch.setattr(jr, "_failed", True)  # as without numba
    pooled, by_threads = await run(decode_threads=2, offload_bytes=1)
    assert by_threads.msgspec > 0 and by_threads.scanner == 0
    inline, by_msgspec = await run(offload_bytes=1 << 30)
    assert by_msgspec.msgspec > 0 and by_msgspec.scanner == 0
    for a, b, c in zip(scanned, pooled, inline, strict=True):
        assert isinstance(a, ScoredSample) and isinstance(b, ScoredSample)
        assert isinstance(c, ScoredSample)
        assert a.reverse_kl is not None and b.reverse_kl is not None and c.reverse_kl is not None
        assert a.reverse_kl.tolist() == b.reverse_kl.tolist() == c.reverse_kl.tolist()
        assert a.teacher_logprobs.tolist() == b.teacher_logprobs.tolist()
        assert a.teacher_logprobs.tolist() == c.teacher_logprobs.tolist()


async def test_capability_detection_is_logged_once_per_endpoint() -> None:
    servers = {
        T: InProcessSGLang("teacher", 1, per_position="unpatched"),
        S: InProcessSGLang("student", 1),
    }
    cfg = _cfg(top_k=3, student_url=S, strategy="only-student", max_inflight=1)
    with capture_events() as logs:
        async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
            async with stream.run(_samples(8)) as results:
                out = [r async for r in results]
    assert all(isinstance(r, ScoredSample) for r in out)
    detected = [
        e
        for e in logs
        if e["event"] == "capability_detected"
        and e["capability"] == "per_position"
        and e["url"] == T
    ]
    assert len(detected) == 1
    assert detected[0]["supported"] is False
    finished = [e for e in logs if e["event"] == "run_finished"]
    assert len(finished) == 1 and finished[0]["completed"] == 8


async def test_each_failed_sample_is_logged_once_with_its_reason() -> None:
    samples: list[Any] = [*_samples(3), Sample([1, 2], 5)]
    with capture_events() as logs:
        async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
            async with stream.run(samples) as results:
                [r async for r in results]
    failed = [e for e in logs if e["event"] == "sample_failed"]
    assert len(failed) == 1
    assert failed[0]["reason"] == "invalid_sample" and failed[0]["index"] == 3


async def test_errors_raised_in_a_decode_thread_fail_only_their_sample() -> None:
    import msgspec

    teacher = InProcessSGLang("teacher", 1)

    def misalign(n: int, body: bytes) -> Any:
        if n % 2:
            return None
        teacher.fault = None
        good = msgspec.json.decode(teacher.handle("POST", "/generate", body).body)
        teacher.fault = misalign
        teacher.requests -= 1
        good["meta_info"]["input_token_logprobs"][-1][1] += 1
        from opd_stream import Response

        return Response(200, msgspec.json.encode(good))

    teacher.fault = misalign
    cfg = _cfg(decode_threads=1, offload_bytes=1, max_inflight=1)
    async with OPDStream(cfg, transport=mock_transport({T: teacher})) as stream:
        async with stream.run(_samples(4)) as results:
            out = sorted([r async for r in results], key=lambda r: r.index)
    reasons = [getattr(r, "reason", "ok") for r in out]
    assert reasons == ["ok", "misaligned_response", "ok", "misaligned_response"]


@pytest.mark.parametrize("threaded", [False, True], ids=["on-the-loop", "in-threads"])
async def test_stats_account_the_cpu_of_each_step_where_it_ran(threaded: bool) -> None:
    threshold = 1 if threaded else 1 << 30
    cfg = _cfg(top_k=4, student_url=S, strategy="union", offload_bytes=threshold)
    async with OPDStream(cfg, transport=mock_transport(_servers())) as stream:
        async with stream.run(_samples(6)) as results:
            out = [r async for r in results]
        cpu = stream.stats().cpu_s.as_dict()
    assert all(isinstance(r, ScoredSample) for r in out)
    assert set(cpu) == {
        "prepare",
        "build",
        "decode_loop",
        "decode_threads",
        "kl",
        "align",
        "loop",
        "setup",
        "kernels",
    }
    assert all(v >= 0 for v in cpu.values())
    assert cpu["align"] == 0  # only teachers with their own tokenizer re-tokenise
    assert (cpu["decode_threads"] > 0) is threaded
    assert (cpu["decode_loop"] > 0) is not threaded
    assert cpu["prepare"] > 0 and cpu["build"] > 0 and cpu["kl"] > 0


@pytest.mark.parametrize("in_thread", [False, True], ids=["on-the-loop", "in-a-thread"])
async def test_python_topk_rows_give_the_arrays_results_on_the_loop_or_in_a_thread(
    in_thread: bool,
) -> None:
    # 2048 x 16 entries (~512 KiB of msgpack): on the loop under the default offload_bytes
    # (a thread from 1 MiB), in a worker thread under 1 MiB (from 256 KiB)
    from opd_stream.fetch._threads import WHOLE
    from opd_stream.testing.mock_sglang import MockModel
    from opd_stream.wire._student_topk import rows_convert_in_thread

    model = MockModel("student", 1)
    rng = np.random.default_rng(3)
    r, k = 2048, 16
    tokens = rng.integers(0, 30000, 64 + r)
    ids, lps = model.topk_in(model.head_rows(tokens, np.arange(64, 64 + r)), k)
    rows = [
        [[float(lp), int(i)] for lp, i in zip(lr, ir, strict=True)]
        for lr, ir in zip(lps.astype(np.float32).tolist(), ids.tolist(), strict=True)
    ]
    bad_rows = [list(row) for row in rows]
    bad_rows[1000] = [[float("nan"), 5], *rows[1000][1:]]
    as_rows = Sample(tokens.tolist(), r, student_top_logprobs=rows)
    as_arrays = Sample(tokens.tolist(), r, student_top_logprobs=(ids, lps.astype(np.float32)))
    bad = Sample(tokens.tolist(), r, student_top_logprobs=bad_rows)
    cfg = _cfg(top_k=k, **({"offload_bytes": 1 << 20} if in_thread else {}))
    threshold = cfg.offload_bytes // WHOLE
    assert rows_convert_in_thread(as_rows, k, threshold) is in_thread
    assert not rows_convert_in_thread(as_arrays, k, threshold)
    async with OPDStream(cfg, transport=mock_transport(_servers())) as stream:
        async with stream.run([as_rows, as_arrays, bad]) as results:
            out = sorted([x async for x in results], key=lambda x: x.index)
    a, b, c = out
    assert isinstance(a, ScoredSample) and isinstance(b, ScoredSample)
    assert a.reverse_kl is not None and b.reverse_kl is not None
    assert np.array_equal(a.reverse_kl.numpy(), b.reverse_kl.numpy())
    assert getattr(c, "reason", None) == "invalid_sample" and "row 1000" in c.message


@pytest.mark.parametrize("way", ["in place", "through msgpack"])
async def test_python_topk_rows_on_the_loop_are_read_a_slice_at_a_time(
    way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2048 rows: read 512 rows at a time (in place, or their msgpack written so where
    # rows are not read in place), the loop's other tasks taking turns between two slices
    # (once the kernels are ready: before, the conversion reads them itself, whole)
    import opd_stream._pipeline as pipeline
    import opd_stream.scanner._calls as kernels
    import opd_stream.scanner._loader as jit
    import opd_stream.wire._student_topk as student_topk

    assert jit.prepare(), "numba could not compile the kernels"

    ticks = 0
    seen: list[int] = []
    read_as: list[str] = []
    real = pipeline.rows_read_slices

    def spy(rows: Any, k: int, read: list[Any]) -> Any:
        for pause in real(rows, k, read):
            seen.append(ticks)
            yield pause
        seen.append(ticks)
        read_as.append(type(read[0]).__name__)

    monkeypatch.setattr(pipeline, "rows_read_slices", spy)
    monkeypatch.setattr(student_topk, "ENTRIES_PER_SLICE", 512 * 4)
    if way == "through msgpack":
        monkeypatch.setattr(kernels, "_LAYOUT", None)
    k, r = 4, 2048
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 30000, 16 + r).tolist()
    rows = [[[-0.1 * (j + 1), 100 * j + n % 50] for j in range(k)] for n in range(r)]
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with OPDStream(_cfg(top_k=k), transport=mock_transport(_servers())) as stream:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            async with stream.run([Sample(tokens, r, student_top_logprobs=rows)]) as results:
                out = [x async for x in results]
            done.set()
    assert isinstance(out[0], ScoredSample)
    # 3 pauses; between the first slice and the last the ticker had at least the turns of
    # the two rounds in between (trio runs a round's tasks in a random order)
    assert len(seen) == 4 and seen == sorted(seen) and seen[-1] - seen[0] >= 2
    assert read_as == ["tuple" if way == "in place" else "bytes"]


@pytest.mark.parametrize("threaded", [False, True], ids=["on-the-loop", "in-threads"])
async def test_blocks_sent_as_independent_requests_give_per_position_values(
    threaded: bool,
) -> None:
    samples = _samples(5, seed=4)
    common = {"top_k": 4, "student_url": S, "strategy": "union"}
    async with OPDStream(_cfg(**common), transport=mock_transport(_servers())) as stream:
        async with stream.run(samples) as results:
            want = sorted([r async for r in results], key=lambda r: r.index)
    threshold = 1 if threaded else 1 << 30
    blocks = _cfg(**common, id_scoring="blocks", id_block_size=2, offload_bytes=threshold)
    async with OPDStream(blocks, transport=mock_transport(_servers())) as stream:
        async with stream.run(samples) as results:
            got = sorted([r async for r in results], key=lambda r: r.index)
        cpu = stream.stats().cpu_s.as_dict()
    assert (cpu["decode_threads"] > 0) is threaded
    for a, b in zip(want, got, strict=True):
        assert isinstance(a, ScoredSample) and isinstance(b, ScoredSample)
        assert a.reverse_kl is not None and b.reverse_kl is not None
        assert a.reverse_kl.tolist() == b.reverse_kl.tolist()
