"""The per-call entry points, ``OPDStream.score`` and ``OPDStream.teacher_rows``: one sample
in, its result (or the teacher's rows) out, on asyncio and trio; failures; a cancelled
caller stops its requests; every call counted in ``stats()``."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from support.config import stream_config
from support.pipeline_reference import assert_matches, expected_result

from opd_stream import (
    InvalidSampleError,
    MockTransport,
    OPDStream,
    OPDStreamError,
    Response,
    Sample,
    SampleFailure,
    ScoredSample,
    ServerHTTPError,
)
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

T = "http://teacher:1"
S = "http://student:2"


_cfg = partial(stream_config, T, student_url=S)


def _servers() -> dict[str, InProcessSGLang]:
    return {T: InProcessSGLang("teacher", 1), S: InProcessSGLang("student", 2)}


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(0, 5000, 12).tolist(), 6, sample_id=i) for i in range(n)]


def _refuse(method: str, url: str, body: bytes) -> Response:
    return Response(400, b'{"error": {"message": "bad input"}}')


async def test_score_outside_the_stream_context_is_an_error() -> None:
    stream = OPDStream(_cfg(), transport=mock_transport(_servers()))
    with pytest.raises(RuntimeError, match="outside"):
        await stream.score(_samples(1)[0])
    with pytest.raises(RuntimeError, match="outside"):
        await stream.teacher_rows(_samples(1)[0])


@pytest.mark.parametrize("top_k", [0, 3])
async def test_concurrent_score_calls_give_the_reference_results_and_are_counted(
    top_k: int,
) -> None:
    servers = _servers()
    samples = _samples(12)
    out: dict[int, Any] = {}
    strategy = "union" if top_k else "only-student"
    cfg = _cfg(top_k=top_k, strategy=strategy) if top_k else _cfg()
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:

        async def one(sample: Sample) -> None:
            out[sample.sample_id] = await stream.score(sample)

        async with anyio.create_task_group() as tg:
            for sample in samples:
                tg.start_soon(one, sample)
        stats = stream.stats()
    assert stats.admitted == stats.completed == len(samples)
    assert stats.failed == 0 and stats.in_flight == 0
    for sample in samples:
        result = out[sample.sample_id]
        assert isinstance(result, ScoredSample)
        assert result.sample is sample  # the input, unchanged
        want = expected_result(
            tokens=sample.tokens,
            response_length=sample.response_length,
            teacher=servers[T].model,
            student=servers[S].model,
            top_k=top_k,
            strategy=strategy,
            weight_mode="student_p",
        )
        assert_matches(result, want)


async def test_an_invalid_sample_and_a_refusing_server_are_failures_counted_in_stats() -> None:
    async with OPDStream(_cfg(), transport=MockTransport(_refuse)) as stream:
        bad = await stream.score(Sample([1, 2, 3], 3))  # R must be < len(tokens)
        refused = await stream.score(Sample([1, 2, 3], 1))
        stats = stream.stats()
    assert isinstance(bad, SampleFailure) and bad.reason == "invalid_sample"
    assert isinstance(refused, SampleFailure) and refused.reason == "teacher_http_400"
    assert stats.admitted == 2 and stats.failed == 2 and stats.completed == 0
    assert stats.failures == {"invalid_sample": 1, "teacher_http_400": 1}


@pytest.mark.parametrize("top_k", [0, 4])
async def test_teacher_rows_are_the_teachers_answer_alone(top_k: int) -> None:
    servers = _servers()
    sample = _samples(1, seed=3)[0]
    # only-teacher would need the student: the teacher's rows never do
    cfg = _cfg(top_k=top_k, strategy="only-teacher") if top_k else _cfg()
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        rows = await stream.teacher_rows(sample)
        stats = stream.stats()
    assert servers[S].requests == 0 and servers[T].requests == 1
    assert stats.admitted == stats.completed == 1 and stats.in_flight == 0
    tok = np.asarray(sample.tokens)
    pos = np.arange(len(tok) - sample.response_length, len(tok))
    model = servers[T].model
    assert rows.token_ids.tolist() == tok[pos].tolist()
    want = [float(np.float32(x)) for x in model.token_logprobs(tok, pos)]
    assert rows.token_logprobs.tolist() == want
    if top_k == 0:
        assert rows.top_ids is None and rows.top_logprobs is None
        return
    ids, lps = model.topk(tok, pos, top_k)
    assert rows.top_ids is not None and rows.top_logprobs is not None
    assert rows.top_ids.tolist() == ids.tolist()
    for got, exp in zip(rows.top_logprobs.ravel().tolist(), lps.ravel().tolist(), strict=True):
        assert got == float(np.float32(exp)) or (math.isinf(got) and math.isinf(exp))


async def test_teacher_rows_of_an_empty_response_ask_nothing() -> None:
    servers = _servers()
    async with OPDStream(_cfg(top_k=2), transport=mock_transport(servers)) as stream:
        rows = await stream.teacher_rows(Sample([5, 6, 7], 0))
    assert servers[T].requests == 0
    assert rows.token_logprobs.shape == (0,)
    assert rows.top_ids is not None and rows.top_ids.shape == (0, 2)


async def test_teacher_rows_raise_the_error_that_failed_the_sample() -> None:
    async with OPDStream(_cfg(), transport=MockTransport(_refuse)) as stream:
        with pytest.raises(ServerHTTPError, match="bad input") as info:
            await stream.teacher_rows(Sample([1, 2, 3], 1))
        with pytest.raises(InvalidSampleError):
            await stream.teacher_rows(Sample([1, 2, 3], 3))
        stats = stream.stats()
    assert info.value.reason == "teacher_http_400"
    assert stats.failures == {"teacher_http_400": 1, "invalid_sample": 1}


class _Hanging:
    """A teacher whose answers never come; counts the requests started and cancelled."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0

    async def __call__(self, method: str, url: str, body: bytes) -> Response:
        self.started += 1
        try:
            await anyio.sleep_forever()
        finally:
            self.cancelled += 1
        raise AssertionError("unreachable")


@pytest.mark.parametrize("teacher_only", [False, True], ids=["score", "teacher_rows"])
async def test_a_cancelled_caller_stops_its_requests_and_counts_as_cancelled(
    teacher_only: bool,
) -> None:
    hanging = _Hanging()
    cfg = _cfg(request_deadline_s=600.0)  # far: cancellation must act
    async with OPDStream(cfg, transport=MockTransport(hanging)) as stream:
        call = stream.teacher_rows if teacher_only else stream.score
        async with anyio.create_task_group() as tg:
            for sample in _samples(3):
                tg.start_soon(call, sample)
            with anyio.fail_after(10):  # generous: no timing is measured
                while hanging.started < 3:  # noqa: ASYNC110
                    await anyio.sleep(0.001)
            assert stream.stats().in_flight == 3
            tg.cancel_scope.cancel()
        with anyio.fail_after(10):
            while stream.stats().failures.get("cancelled", 0) < 3:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        stats = stream.stats()
        assert hanging.cancelled == 3  # by the callers, not by the stream's exit
    assert stats.admitted == 3 and stats.failures == {"cancelled": 3}
    assert stats.in_flight == 0


async def test_a_call_waiting_when_the_stream_closes_is_told() -> None:
    hanging = _Hanging()
    errors: list[BaseException] = []

    async def caller(stream: OPDStream) -> None:
        try:
            await stream.score(_samples(1)[0])
        except OPDStreamError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as outer:
        async with OPDStream(_cfg(), transport=MockTransport(hanging)) as stream:
            outer.start_soon(caller, stream)  # a task outside the stream's
            with anyio.fail_after(10):
                while hanging.started < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.001)
    assert hanging.cancelled == 1
    assert len(errors) == 1 and "closed" in str(errors[0])


async def test_score_and_run_share_the_stream_and_its_stats() -> None:
    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        async with stream.run(_samples(4)) as results:
            ran = [r async for r in results]
        scored = await stream.score(_samples(1)[0])
        stats = stream.stats()
    assert all(isinstance(r, ScoredSample) for r in ran)
    assert isinstance(scored, ScoredSample)
    assert stats.admitted == stats.completed == 5


async def test_a_calls_outcome_reaches_its_caller_without_the_emit_channels_hop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each hop through a channel costs the event loop a round per sample (issues 33, 35):
    # a call's outcome (rows, a result, a failure) is handed to its caller by the stage
    # that has it, and still counted as passing the emit channel.
    from opd_stream._pipeline import _Pipeline

    sent: list[str] = []
    send = _Pipeline._send

    async def spy(self: Any, channel: Any, stream: Any, item: Any) -> None:
        sent.append(channel)
        await send(self, channel, stream, item)

    monkeypatch.setattr(_Pipeline, "_send", spy)
    samples = _samples(3, seed=4)
    async with OPDStream(_cfg(top_k=2), transport=mock_transport(_servers())) as stream:
        rows = await stream.teacher_rows(samples[0])
        scored = await stream.score(samples[1])
        invalid = await stream.score(Sample([1, 2], 5))
        stats = stream.stats()
    assert rows.token_logprobs.shape == (6,) and isinstance(scored, ScoredSample)
    assert isinstance(invalid, SampleFailure) and invalid.reason == "invalid_sample"
    assert "emit" not in sent and sent.count("intake") == 2 and sent.count("kl") == 1
    assert stats.completed == 2 and stats.failed == 1 and stats.in_flight == 0
    assert stats.channels.emit.depth == 0 and stats.channels.emit.high_water == 1


async def test_a_call_costs_the_event_loop_seven_rounds_when_nothing_waits() -> None:
    # Counted by a task that takes every round the loop gives it (no clock): a call's hops
    # (its channel, intake, a fetch worker) and its request's, its outcome handed over by
    # the worker: 7 (trio's scheduling moves it by a few tenths); 9 through the emitter.
    rounds = 0

    async def count_rounds() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await anyio.lowlevel.checkpoint()

    samples = _samples(21, seed=5)
    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        await stream.teacher_rows(samples[0])  # the calls' run started
        async with anyio.create_task_group() as tg:
            tg.start_soon(count_rounds)
            await anyio.lowlevel.checkpoint()
            before = rounds
            for sample in samples[1:]:
                await stream.teacher_rows(sample)
            per_call = (rounds - before) / 20
            tg.cancel_scope.cancel()
    assert per_call < 8
