"""Pipeline behaviour on asyncio and trio, through the in-process mock transport.

Exactly-once accounting, ordering, routing, retries, non-retryable failures, validation
failures, cancellation and backpressure. (Real-HTTP end-to-end checks live in
test_pipeline_http.py.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from support.config import FAST_BACKOFF, stream_config
from support.pipeline_reference import assert_matches, expected_result

from opd_stream import (
    MockTransport,
    OPDStream,
    Response,
    Sample,
    SampleFailure,
    ScoredSample,
)
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

T1 = "http://teacher-a:1"
T2 = "http://teacher-b:2"
ST = "http://student:3"


_cfg = partial(stream_config, T1, **FAST_BACKOFF)


def _samples(n: int, *, seed: int = 0, p: int = 6, r: int = 5) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(0, 3000, p + r).tolist(), r, sample_id=i) for i in range(n)]


async def _collect(stream: OPDStream, samples: Any) -> list[ScoredSample | SampleFailure]:
    async with stream.run(samples) as results:
        return [r async for r in results]


def _servers(**teacher_kw: Any) -> dict[str, InProcessSGLang]:
    return {
        T1: InProcessSGLang("teacher", 1, **teacher_kw),
        T2: InProcessSGLang("teacher", 2),
        ST: InProcessSGLang("student", 1),
    }


async def test_every_sample_comes_out_exactly_once_with_invalid_ones_failing_alone() -> None:
    samples: list[Any] = _samples(20)
    samples[3] = Sample([1, 2, 3], 5)  # response_length out of range
    samples[7] = Sample([1, -4, 3], 1)  # negative id
    samples[11] = "not a sample"
    samples[15] = Sample([1, 2, 3, 4], 2, rollout_logprobs=[0.1, float("nan")])
    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        out = await _collect(stream, samples)
        stats = stream.stats()
    assert sorted(r.index for r in out) == list(range(20))
    failed = {r.index: r for r in out if isinstance(r, SampleFailure)}
    assert set(failed) == {3, 7, 11, 15}
    assert {f.reason for f in failed.values()} == {"invalid_sample"}
    assert "response_length" in failed[3].message
    assert "tokens" in failed[7].message
    assert "rollout_logprobs" in failed[15].message
    assert stats.admitted == 20 and stats.completed == 16 and stats.failed == 4
    assert stats.failures == {"invalid_sample": 4}
    assert stats.in_flight == 0


async def test_results_match_the_closed_form_in_sampled_token_mode() -> None:
    servers = _servers()
    samples = _samples(8, seed=4)
    async with OPDStream(_cfg(), transport=mock_transport(servers)) as stream:
        out = await _collect(stream, samples)
    for res in out:
        assert isinstance(res, ScoredSample)
        smp = samples[res.index]
        exp = expected_result(
            tokens=smp.tokens,
            response_length=smp.response_length,
            teacher=servers[T1].model,
            student=servers[ST].model,
            top_k=0,
            strategy="only-student",
            weight_mode="student_p",
        )
        assert_matches(res, exp)


async def test_input_order_is_restored_when_requested() -> None:
    servers = _servers()
    delays = iter(np.random.default_rng(0).uniform(0, 0.02, 1000).tolist())

    async def handler(method: str, url: str, body: bytes) -> Response:
        await anyio.sleep(next(delays))
        return servers[T1].handle(method, "/generate", body)

    async with OPDStream(
        _cfg(order="input", max_inflight=8), transport=MockTransport(handler)
    ) as stream:
        out = await _collect(stream, _samples(40))
    assert [r.index for r in out] == list(range(40))


async def test_completed_order_does_not_wait_for_slow_samples() -> None:
    servers = _servers()
    others_out = anyio.Event()

    async def handler(method: str, url: str, body: bytes) -> Response:
        if servers[T1].requests == 0:
            servers[T1].requests += 1
            await others_out.wait()  # answered only once every other sample is out
        return servers[T1].handle(method, "/generate", body)

    out: list[Any] = []
    async with OPDStream(_cfg(max_inflight=4), transport=MockTransport(handler)) as stream:
        with anyio.fail_after(60):  # a stream that waited for the slow sample never ends
            async with stream.run(_samples(6)) as results:
                async for item in results:
                    out.append(item)
                    if len(out) == 5:
                        others_out.set()
    assert sorted(r.index for r in out) == list(range(6))
    assert out[-1].index == 0


async def test_samples_route_to_their_teacher_and_unknown_names_to_default() -> None:
    servers = _servers()
    cfg = _cfg(teachers={"math": T1, "default": T2})
    samples = _samples(6)
    for i, name in enumerate(["math", "code", None, "math", 7, "math"]):
        if name is not None:
            samples[i] = Sample(
                samples[i].tokens, samples[i].response_length, metadata={"opd_teacher": name}
            )
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        out = sorted(await _collect(stream, samples), key=lambda r: r.index)
    assert [r.teacher for r in out if isinstance(r, ScoredSample)] == [
        "math",
        "default",
        "default",
        "math",
        "default",
        "math",
    ]
    assert servers[T1].requests == 3 and servers[T2].requests == 3


async def test_unknown_teacher_without_default_fails_that_sample_with_routing() -> None:
    cfg = _cfg(teachers={"math": T1, "code": T2})
    samples = [
        Sample([1, 2, 3], 1, metadata={"opd_teacher": "poetry"}),
        Sample([1, 2, 3], 1, metadata={"opd_teacher": "code"}),
    ]
    async with OPDStream(cfg, transport=mock_transport(_servers())) as stream:
        out = sorted(await _collect(stream, samples), key=lambda r: r.index)
    assert isinstance(out[0], SampleFailure) and out[0].reason == "routing"
    assert "opd_teacher" in out[0].message and "poetry" not in out[0].message  # not echoed
    assert "code" in out[0].message and "math" in out[0].message
    assert isinstance(out[1], ScoredSample)


def _fail_first(n: int, status: int, body: bytes = b'{"error": {"message": "busy"}}') -> Any:
    def fault(count: int, _body: bytes) -> Response | None:
        return Response(status, body) if count <= n else None

    return fault


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
async def test_retryable_statuses_are_retried_and_counted(status: int) -> None:
    servers = _servers(fault=_fail_first(2, status))
    async with OPDStream(_cfg(max_inflight=1), transport=mock_transport(servers)) as stream:
        out = await _collect(stream, _samples(1))
        stats = stream.stats()
    assert isinstance(out[0], ScoredSample)
    assert out[0].attempts == 3
    assert stats.retries == 2


async def test_abort_on_http_200_is_retried() -> None:
    servers = _servers()
    abort = {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": "x",
            "finish_reason": {
                "type": "abort",
                "message": "Abort request.",
                "status_code": None,
                "err_type": None,
            },
        },
    }
    import msgspec

    servers[T1].fault = lambda n, b: Response(200, msgspec.json.encode(abort)) if n == 1 else None
    async with OPDStream(_cfg(), transport=mock_transport(servers)) as stream:
        out = await _collect(stream, _samples(1))
    assert isinstance(out[0], ScoredSample) and out[0].attempts == 2


async def test_non_retryable_answer_fails_at_once_with_the_server_message() -> None:
    servers = _servers(fault=_fail_first(99, 400, b'{"error": {"message": "input too long"}}'))
    async with OPDStream(_cfg(), transport=mock_transport(servers)) as stream:
        out = await _collect(stream, _samples(2))
    for f in out:
        assert isinstance(f, SampleFailure)
        assert f.reason == "teacher_http_400"
        assert "input too long" in f.message
        assert f.attempts == 1


async def test_exhausted_retries_fail_with_the_last_reason() -> None:
    servers = _servers(fault=_fail_first(99, 503))
    async with OPDStream(_cfg(max_attempts=3), transport=mock_transport(servers)) as stream:
        out = await _collect(stream, _samples(1))
        stats = stream.stats()
    assert isinstance(out[0], SampleFailure)
    assert out[0].reason == "teacher_http_503" and out[0].attempts == 3
    assert stats.retries == 2 and stats.failures == {"teacher_http_503": 1}


async def test_misaligned_answer_is_never_scored() -> None:
    servers = _servers()
    inner = servers[T1]

    def shifted(n: int, body: bytes) -> Response | None:
        import msgspec

        inner.fault = None
        good = msgspec.json.decode(inner.handle("POST", "/generate", body).body)
        inner.fault = shifted
        rows = good["meta_info"]["input_token_logprobs"]
        rows[-1][1] = rows[-1][1] + 1  # wrong token id in the last row
        return Response(200, msgspec.json.encode(good))

    inner.fault = shifted
    async with OPDStream(_cfg(), transport=mock_transport(servers)) as stream:
        out = await _collect(stream, _samples(3))
    assert all(isinstance(f, SampleFailure) and f.reason == "misaligned_response" for f in out)


async def test_malformed_json_is_retried_then_fails() -> None:
    servers = _servers(fault=_fail_first(99, 200, b'{"text": "", "meta_info": {'))
    async with OPDStream(_cfg(max_attempts=2), transport=mock_transport(servers)) as stream:
        out = await _collect(stream, _samples(1))
    assert isinstance(out[0], SampleFailure)
    assert out[0].reason == "malformed_response" and out[0].attempts == 2


async def test_zero_length_response_gives_empty_arrays_without_a_request() -> None:
    servers = _servers()
    async with OPDStream(_cfg(top_k=3, student_url=ST), transport=mock_transport(servers)) as s:
        out = await _collect(s, [Sample([5, 6, 7], 0)])
    res = out[0]
    assert isinstance(res, ScoredSample)
    assert res.teacher_logprobs.shape == (0,) and res.reverse_kl is not None
    assert res.candidates is not None and res.candidates.ids.shape == (0, 3)
    assert servers[T1].requests == 0


async def test_async_iterable_input_is_accepted() -> None:
    async def gen() -> AsyncIterator[Sample]:
        for s in _samples(5):
            await anyio.lowlevel.checkpoint()
            yield s

    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        out = await _collect(stream, gen())
    assert sorted(r.index for r in out) == list(range(5))


async def test_an_error_in_the_callers_iterable_surfaces_from_the_iteration() -> None:
    def gen() -> Iterator[Sample]:
        yield from _samples(3)
        raise RuntimeError("rollout source broke")

    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        seen = []
        with pytest.raises(RuntimeError, match="rollout source broke"):
            async with stream.run(gen()) as results:
                async for r in results:
                    seen.append(r)
        assert len(seen) <= 3


async def test_missing_student_topk_is_fetched_from_the_student_server() -> None:
    servers = _servers()
    samples = _samples(4, seed=9)
    cfg = _cfg(top_k=4, student_url=ST, strategy="only-student")
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        out = await _collect(stream, samples)
    assert servers[ST].requests == 4
    for res in out:
        assert isinstance(res, ScoredSample)
        smp = samples[res.index]
        assert_matches(
            res,
            expected_result(
                tokens=smp.tokens,
                response_length=smp.response_length,
                teacher=servers[T1].model,
                student=servers[ST].model,
                top_k=4,
                strategy="only-student",
                weight_mode="student_p",
            ),
        )


async def test_replicas_share_the_load() -> None:
    servers = {T1: InProcessSGLang("teacher", 1), T2: InProcessSGLang("teacher", 1)}

    async def handler(method: str, url: str, body: bytes) -> Response:
        await anyio.sleep(0.005)
        base = T1 if url.startswith(T1) else T2
        return servers[base].handle(method, "/generate", body)

    cfg = _cfg(teachers={"default": [T1, T2]})
    async with OPDStream(cfg, transport=MockTransport(handler)) as stream:
        out = await _collect(stream, _samples(20))
    assert all(isinstance(r, ScoredSample) for r in out)
    assert servers[T1].requests > 0 and servers[T2].requests > 0


async def test_forced_per_position_on_an_unpatched_server_fails_with_capability() -> None:
    servers = _servers(per_position="unpatched")
    cfg = _cfg(top_k=2, student_url=ST, id_scoring="per-position")
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        out = await _collect(stream, _samples(2))
    assert all(isinstance(f, SampleFailure) and f.reason == "capability" for f in out)


async def test_breaking_out_early_stops_the_run_and_cancels_requests() -> None:
    servers = _servers()
    live = 0

    async def handler(method: str, url: str, body: bytes) -> Response:
        nonlocal live
        live += 1
        try:
            await anyio.sleep(0.01)
            return servers[T1].handle(method, "/generate", body)
        finally:
            live -= 1

    async with OPDStream(_cfg(max_inflight=8), transport=MockTransport(handler)) as stream:
        async with stream.run(_samples(500)) as results:
            async for _ in results:
                break
        assert live == 0
        assert servers[T1].requests < 500
        # the stream is still usable for another run
        out = await _collect(stream, _samples(3))
        assert len(out) == 3


async def test_slow_consumer_stops_intake_and_channels_stay_bounded() -> None:
    servers = _servers()
    cfg = _cfg(max_inflight=4, channel_capacity=2)
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(_samples(40)) as results:
            n = 0
            async for _ in results:
                n += 1
                await anyio.sleep(0.01)
                st = stream.stats()
                assert st.in_flight <= 4
                # in the pipeline (4 slots) + handed over but not yet taken (capacity 2)
                assert servers[T1].requests <= n + 4 + 2
        stats = stream.stats()
    assert n == 40
    for name, ch in stats.channels.as_dict().items():
        assert ch.high_water <= ch.capacity, name


async def test_stats_report_bytes_latency_and_loop_lag() -> None:
    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        await _collect(stream, _samples(10))
        await anyio.sleep(0.03)
        st = stream.stats()
    assert st.bytes_received > 0 and st.requests == 10
    assert st.latency_p50_s is not None and st.latency_p99_s is not None
    assert st.loop_lag_p99_s is not None
    assert T1 in st.endpoints and st.endpoints[T1].requests == 10


async def test_an_idle_stream_does_not_wake_its_hosts_loop() -> None:
    # the loop-lag ticker runs while samples are in flight only
    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        await anyio.sleep(0.1)
        assert stream.stats().loop_lag_p99_s is None  # no tick while nothing was in flight
        await _collect(stream, _samples(4))
        await anyio.sleep(0.03)
        assert stream.stats().loop_lag_p99_s is not None


async def test_stats_report_the_kl_stage_device_batches_and_time() -> None:
    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        before = stream.stats().kl
        await _collect(stream, _samples(10))
        st = stream.stats().kl
    assert before.batches == 0 and before.batch_p50_s is None
    assert st.device == "cpu"
    assert 1 <= st.batches <= 10 and st.samples == 10
    assert st.seconds > 0
    assert st.batch_p50_s is not None and st.batch_p99_s is not None
    assert 0 < st.batch_p50_s <= st.batch_p99_s <= st.seconds


async def test_independent_requests_run_concurrently() -> None:
    servers = _servers()
    live = peak = 0

    async def handler(method: str, url: str, body: bytes) -> Response:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        try:
            await anyio.sleep(0.05)
            base = ST if url.startswith(ST) else T1
            return servers[base].handle(method, "/generate", body)
        finally:
            live -= 1

    # intersection without the rollout's top-k: student top-k and teacher top-k are independent
    cfg = _cfg(top_k=3, student_url=ST, strategy="intersection", max_inflight=1)
    async with OPDStream(cfg, transport=MockTransport(handler)) as stream:
        out = await _collect(stream, _samples(3))
    assert all(isinstance(r, ScoredSample) for r in out)
    assert peak == 2


async def test_a_failing_independent_request_fails_the_sample_and_cancels_the_other() -> None:
    servers = _servers()
    cancelled = 0

    async def handler(method: str, url: str, body: bytes) -> Response:
        nonlocal cancelled
        if url.startswith(ST):
            return Response(400, b'{"error": {"message": "bad student request"}}')
        try:
            await anyio.sleep(10)
        except anyio.get_cancelled_exc_class():
            cancelled += 1
            raise
        return servers[T1].handle(method, "/generate", body)

    cfg = _cfg(top_k=3, student_url=ST, strategy="intersection")
    async with OPDStream(cfg, transport=MockTransport(handler)) as stream:
        out = await _collect(stream, _samples(2))
    assert all(isinstance(f, SampleFailure) and f.reason == "student_http_400" for f in out)
    assert cancelled == 2


async def test_an_unexpected_error_fails_only_its_sample_with_internal_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opd_stream.wire import _codec

    servers = _servers()
    real = _codec._decode_laid

    def decode(body: bytes, lay: Any, *args: Any) -> Any:
        if lay.tokens[0] == 7:  # a decoder bug that strikes one sample
            raise KeyError("boom")
        return real(body, lay, *args)

    # (every decode of an SGLang answer goes through it, whole or in slices, on the loop
    # or in a thread)
    monkeypatch.setattr(_codec, "_decode_laid", decode)
    samples = _samples(4)
    samples[2] = Sample([7, *samples[2].tokens[1:]], samples[2].response_length)
    async with OPDStream(_cfg(), transport=mock_transport(servers)) as stream:
        out = sorted(await _collect(stream, samples), key=lambda r: r.index)
    assert [type(r).__name__ for r in out] == [
        "ScoredSample",
        "ScoredSample",
        "SampleFailure",
        "ScoredSample",
    ]
    failure = out[2]
    assert isinstance(failure, SampleFailure)
    assert failure.reason == "internal_error" and "KeyError" in failure.message


async def test_the_kernels_are_compiled_as_a_stream_starts_so_loop_decodes_use_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # small answers are decoded on the loop, where nothing would otherwise compile the
    # kernels (only a decode thread did): the stream compiles them as it starts
    import opd_stream.scanner._loader as jit

    assert jit.prepare()
    monkeypatch.setattr(jit, "_kernel", None)
    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        for _ in range(6000):  # the compile thread's work: at most a minute
            if jit.available():
                break
            await anyio.sleep(0.01)
        assert jit.available()
        await _collect(stream, _samples(3))
        stats = stream.stats()
    assert stats.decoded.scanner == 3 and stats.decoded.msgspec == 0
    assert stats.cpu_s.decode_threads == 0.0  # all on the loop


class _FakeGroup:
    def __init__(self) -> None:
        self.started = 0

    def start_soon(self, *args: Any) -> None:
        self.started += 1
        for end in args[1:]:
            end.close()  # the clones a worker would own


def _crew(limit: int) -> tuple[Any, _FakeGroup]:
    from opd_stream._pipeline import _Crew

    tg = _FakeGroup()
    send, recv = anyio.create_memory_object_stream[Any](1)
    ends = (recv, send, send.clone())
    return _Crew(tg, None, ends, limit), tg  # type: ignore[arg-type]


def test_a_fetch_worker_starts_only_for_a_job_no_idle_worker_would_take() -> None:
    crew, tg = _crew(limit=8)
    for _ in range(3):  # three jobs queued at once: three workers
        crew.before_send()
    assert tg.started == 3
    for _ in range(3):  # all three take theirs and finish
        crew.queued -= 1
    crew.before_send()  # an idle worker is there for the next job
    assert tg.started == 3
    crew.queued -= 1
    crew.busy = 3  # all busy: the next job needs a new one
    crew.before_send()
    assert tg.started == 4
    crew.close()


def test_fetch_workers_never_exceed_the_limit() -> None:
    crew, tg = _crew(limit=2)
    for _ in range(5):
        crew.before_send()
    assert tg.started == 2
    crew.close()


async def test_a_run_of_one_sample_starts_one_fetch_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from opd_stream import _pipeline

    crews: list[Any] = []
    real = _pipeline._Crew

    def spy(*args: Any) -> Any:
        crews.append(real(*args))
        return crews[-1]

    monkeypatch.setattr(_pipeline, "_Crew", spy)
    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        out = await _collect(stream, _samples(1))
    assert [type(r).__name__ for r in out] == ["ScoredSample"]
    assert crews[0].started == 1 and crews[0].busy == 0 and crews[0].queued == 0
