"""The probe (``OPDStream.probe``, ``opd-stream probe``): the same scoring request to every
replica of every teacher, cold (a fresh ``cache_salt``) and warm (the same request and salt
again), the largest differences reported and the replicas beyond the tolerance named.

The faults are the mock's: ``logprob_offset`` (a replica off by a set amount),
``warm_drift`` (a replica whose answers to a repeated request move by a set amount) and
``fault_hang`` (a replica that never answers a scoring request, though its ``/health``
does); in-process, a handler that never returns.
"""

from __future__ import annotations

import json
import logging
import math
from functools import partial
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
from support.cli import run_cli
from support.config import stream_config
from support.threaded_mock import serve_mock_threaded
from trio.testing import MockClock

from opd_stream import (
    InvalidSampleError,
    MockTransport,
    OPDStream,
    ProbeReport,
    Response,
    Sample,
    ScoredSample,
)
from opd_stream.cli._main import main
from opd_stream.fleet._probe import Answer, compare, default_probe_tokens, ejectable
from opd_stream.testing import capture_events
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.testing.mock_sglang import MockOptions, serve_mock
from opd_stream.testing.mock_sglang._request import parse_generate_request

A1, A2, A3 = "http://a1:1", "http://a2:2", "http://a3:3"
B1 = "http://b1:4"
OFF = 0.5  # nats
TOL = 0.1


def _fleet(**third: Any) -> dict[str, InProcessSGLang]:
    """Teacher ``a``: three replicas (the third with ``third``'s faults); teacher ``b``: one."""
    return {
        A1: InProcessSGLang("teacher", 1),
        A2: InProcessSGLang("teacher", 1),
        A3: InProcessSGLang("teacher", 1, **third),
        B1: InProcessSGLang("teacher", 2),
    }


TEACHERS = {"a": [A1, A2, A3], "b": B1}


async def _probe(servers: dict[str, InProcessSGLang], **kw: Any) -> ProbeReport:
    async with OPDStream(stream_config(TEACHERS), transport=mock_transport(servers)) as stream:
        return await stream.probe(**kw)


def _by_url(report: ProbeReport) -> dict[str, Any]:
    return {r.url: r for r in report.replicas}


# -- the comparison (sans-IO) ---------------------------------------------------------------


def _answer(url: str, cold: list[float], warm: list[float] | None = None, t: str = "a") -> Answer:
    c = np.asarray(cold, dtype=np.float64)
    return Answer(teacher=t, url=url, cold=c, warm=c if warm is None else np.asarray(warm))


def test_compare_names_the_replica_away_from_the_median() -> None:
    report = compare(
        [
            _answer("x", [-1.0, -2.0]),
            _answer("y", [-1.0, -2.0]),
            _answer("z", [-1.0, -2.4]),
        ],
        0.1,
        2,
    )
    assert report.outliers == ("z",) and not report.failed and not report.ok
    assert report.max_replica_diff == pytest.approx(0.4)
    by = _by_url(report)
    assert by["x"].vs_replicas == 0.0 and by["z"].vs_replicas == pytest.approx(0.4)


def test_compare_with_two_replicas_names_both_when_they_disagree() -> None:
    report = compare([_answer("x", [-1.0]), _answer("y", [-1.3])], 0.1, 1)
    assert set(report.outliers) == {"x", "y"}
    assert ejectable(report) == ()  # no majority: nothing to take out


def test_compare_within_tolerance_is_ok() -> None:
    report = compare([_answer("x", [-1.0]), _answer("y", [-1.05])], 0.1, 1)
    assert report.ok and report.outliers == ()
    assert report.max_replica_diff == pytest.approx(0.05)


def test_compare_counts_a_cold_warm_drift() -> None:
    report = compare([_answer("x", [-1.0, -2.0], [-1.0, -2.3])], 0.1, 2)
    assert report.outliers == ("x",)
    assert report.max_cold_warm_diff == pytest.approx(0.3)
    assert report.max_replica_diff == 0.0  # one replica: nothing to compare with


def test_compare_minus_infinity_agrees_with_itself_only() -> None:
    inf = -math.inf
    same = compare([_answer("x", [inf, -1.0]), _answer("y", [inf, -1.0])], 0.1, 2)
    assert same.ok and same.max_replica_diff == 0.0
    differ = compare([_answer("x", [inf, -1.0]), _answer("y", [-3.0, -1.0])], 0.1, 2)
    assert differ.max_replica_diff == math.inf and set(differ.outliers) == {"x", "y"}


def test_compare_reports_a_failed_replica_without_comparing_it() -> None:
    failed = Answer(teacher="a", url="f", error="teacher_http_500")
    report = compare([_answer("x", [-1.0]), failed], 0.1, 1)
    assert report.failed == ("f",) and report.outliers == () and not report.ok
    assert _by_url(report)["f"].vs_replicas is None


def test_ejectable_takes_out_a_replica_that_did_not_answer_but_not_one_that_failed() -> None:
    hung = Answer(teacher="a", url="h", error="deadline_exceeded")
    failed = Answer(teacher="a", url="f", error="teacher_http_500")
    report = compare([_answer("x", [-1.0]), hung, failed], 0.1, 1)
    assert set(report.failed) == {"h", "f"}
    assert ejectable(report) == ("h",)  # an HTTP error is the health checks' to judge
    alone = compare([Answer(teacher="a", url="h", error="deadline_exceeded")], 0.1, 1)
    assert ejectable(alone) == ()  # a teacher's only replica stays


def test_the_default_probe_sequence_is_fixed_and_in_every_vocabulary() -> None:
    a, b = default_probe_tokens(), default_probe_tokens()
    assert a.tolist() == b.tolist() and a.shape == (64,)
    assert int(a.min()) >= 100 and int(a.max()) < 1000


# -- against mock replicas (asyncio and trio) -----------------------------------------------


async def test_a_replica_off_by_a_set_amount_is_named_with_that_amount() -> None:
    report = await _probe(_fleet(logprob_offset=-OFF))
    assert report.outliers == (A3,)
    assert report.max_replica_diff == pytest.approx(OFF, abs=1e-5)
    by = _by_url(report)
    assert by[A3].vs_replicas == pytest.approx(OFF, abs=1e-5)
    assert by[A1].vs_replicas == 0.0 and by[A2].vs_replicas == 0.0
    assert by[B1].vs_replicas == 0.0  # a teacher's only replica
    assert report.max_cold_warm_diff == 0.0
    assert {r.teacher for r in report.replicas} == {"a", "b"} and len(report.replicas) == 4
    assert all(r.weight_version == "default" and not r.ejected for r in report.replicas)


async def test_a_replica_whose_warm_answers_drift_is_named_with_the_drift() -> None:
    report = await _probe(_fleet(warm_drift=-0.3))
    assert report.outliers == (A3,)
    assert report.max_cold_warm_diff == pytest.approx(0.3, abs=1e-5)
    assert report.max_replica_diff == 0.0  # the cold answers agree
    by = _by_url(report)
    assert by[A3].cold_vs_warm == pytest.approx(0.3, abs=1e-5)
    assert by[A1].cold_vs_warm == 0.0


async def test_an_offset_within_the_tolerance_is_reported_but_not_named() -> None:
    report = await _probe(_fleet(logprob_offset=-0.05))
    assert report.ok and report.tolerance == 0.1
    assert report.max_replica_diff == pytest.approx(0.05, abs=1e-5)
    tight = await _probe(_fleet(logprob_offset=-0.05), tolerance=0.01)
    assert tight.outliers == (A3,)


async def test_cold_is_a_fresh_salt_and_warm_repeats_it_on_the_same_replica() -> None:
    servers = _fleet()
    await _probe(servers)
    salts = []
    for url in (A1, A2, A3, B1):
        bodies = servers[url].bodies
        assert len(bodies) == 2 and bodies[0] == bodies[1]  # warm: the same request
        (item,) = parse_generate_request(
            bodies[0], vocab_size=151936, context_length=1 << 20, per_position="patched"
        ).items
        assert item.cache_salt is not None and item.max_new_tokens == 0
        assert item.input_ids.tolist() == default_probe_tokens().tolist()
        salts.append(item.cache_salt)
    assert len(set(salts)) == 4  # each replica cold under its own salt


async def test_a_replica_that_fails_is_listed_as_failed() -> None:
    servers = _fleet()
    servers[A2] = InProcessSGLang(
        "teacher", 1, fault=lambda n, body: Response(500, b'{"error": {"message": "boom"}}')
    )
    report = await _probe(servers)
    assert report.failed == (A2,) and report.outliers == () and not report.ok
    assert _by_url(report)[A2].error == "teacher_http_500"


async def test_the_probe_request_can_be_a_callers_sample() -> None:
    servers = _fleet()
    tokens = list(range(200, 220))
    sample = Sample(tokens, 8, teacher_prompt_ids=[7, 8, 9])
    report = await _probe(servers, sample=sample)
    assert report.positions == 8 and report.ok
    (item,) = parse_generate_request(
        servers[A1].bodies[0], vocab_size=151936, context_length=1 << 20, per_position="patched"
    ).items
    assert item.input_ids.tolist() == [7, 8, 9, *tokens[-8:]]  # the teacher's own prompt
    async with OPDStream(stream_config(TEACHERS), transport=mock_transport(_fleet())) as stream:
        for bad in (Sample([1, 2], 5), Sample([1, 2], 0)):
            with pytest.raises(InvalidSampleError, match="response_length"):
                await stream.probe(bad)


async def test_eject_takes_the_outliers_out_of_the_streams_rotation() -> None:
    servers = _fleet(logprob_offset=-OFF)
    cfg = stream_config({"default": [A1, A2, A3]})
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        report = await stream.probe(eject=True)
        assert [r.url for r in report.replicas if r.ejected] == [A3]
        before = servers[A3].requests
        rng = np.random.default_rng(0)
        samples = [Sample(rng.integers(0, 3000, 12).tolist(), 4) for _ in range(30)]
        async with stream.run(samples) as results:
            assert all([isinstance(r, ScoredSample) async for r in results])
        stats = stream.stats()
    assert servers[A3].requests == before  # no sample went to it
    assert servers[A1].requests > 2 and servers[A2].requests > 2
    assert stats.endpoints[A3].ejected and stats.endpoints[A3].ejections == 1


async def test_eject_never_takes_out_a_teacher_with_no_good_replica() -> None:
    servers = {A1: InProcessSGLang("teacher", 1), A2: InProcessSGLang("teacher", 1)}
    servers[A2] = InProcessSGLang("teacher", 1, logprob_offset=-OFF)
    async with OPDStream(
        stream_config({"default": [A1, A2]}), transport=mock_transport(servers)
    ) as stream:
        report = await stream.probe(eject=True)
        stats = stream.stats()
    assert set(report.outliers) == {A1, A2}
    assert not any(r.ejected for r in report.replicas)
    assert not any(e.ejected for e in stats.endpoints.values())


async def test_probe_at_start_ejects_the_outliers_before_the_first_sample() -> None:
    servers = _fleet(logprob_offset=-OFF)
    cfg = stream_config({"default": [A1, A2, A3]}, probe_at_start=True)
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        assert servers[A3].requests == 2  # probed, cold and warm
        assert stream.stats().endpoints[A3].ejected
        async with stream.run([Sample(list(range(1, 13)), 4) for _ in range(10)]) as results:
            assert all([isinstance(r, ScoredSample) async for r in results])
    assert servers[A3].requests == 2


# -- a replica that hangs: the probe's own deadline ----------------------------------------

MILES_DEADLINE = 4 * 3600.0  # Miles' request deadline: what a hung probe used to wait
GUARD_S = 60.0  # far above the probe's deadline, far below the request deadline
PROBE_DEADLINE = 2.0  # far above what a good in-process or local replica takes


def _hanging_third(servers: dict[str, InProcessSGLang]) -> tuple[Any, list[str]]:
    """A transport to ``servers`` where A3's scoring requests never answer (its ``/health``
    does); the list records each hung request's start and its cancellation."""
    hung: list[str] = []

    async def handle(method: str, url: str, body: bytes) -> Response:
        if url.startswith(A3) and url.endswith("/generate"):
            hung.append("started")
            try:
                await anyio.sleep_forever()
            finally:
                hung.append("cancelled")
        base = next(u for u in servers if url.startswith(u))
        return servers[base].handle(method, url[len(base) :], body)

    return MockTransport(handle), hung


@pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock"),
    ],
)
async def test_a_hanging_replica_is_named_at_the_probe_deadline_and_ejected(
    anyio_backend_name: str,
) -> None:
    transport, hung = _hanging_third(_fleet())
    cfg = stream_config(
        {"default": [A1, A2, A3]},
        request_deadline_s=MILES_DEADLINE,
        probe_deadline_s=PROBE_DEADLINE,
    )
    with anyio.fail_after(GUARD_S):
        async with OPDStream(cfg, transport=transport) as stream:
            start = anyio.current_time()
            report = await stream.probe(eject=True)
            elapsed = anyio.current_time() - start
            stats = stream.stats()
    if anyio_backend_name == "trio":  # the virtual clock: exactly the probe's deadline
        assert elapsed == pytest.approx(PROBE_DEADLINE, abs=1e-9)
    by = _by_url(report)
    assert report.failed == (A3,) and report.outliers == ()
    assert by[A3].error == "deadline_exceeded" and by[A3].ejected
    assert not by[A1].ejected and not by[A2].ejected
    assert hung == ["started", "cancelled"]  # the cold request, cancelled at the deadline
    assert stats.endpoints[A3].ejected and stats.endpoints[A3].ejections == 1


@pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock"),
    ],
)
async def test_probe_at_start_ejects_a_hanging_replica_and_samples_avoid_it(
    anyio_backend_name: str,
) -> None:
    transport, hung = _hanging_third(_fleet())
    cfg = stream_config(
        {"default": [A1, A2, A3]},
        request_deadline_s=MILES_DEADLINE,
        probe_deadline_s=PROBE_DEADLINE,
        probe_at_start=True,
    )
    samples = [Sample(list(range(1, 13)), 4) for _ in range(10)]
    with capture_events(logging.WARNING) as events, anyio.fail_after(GUARD_S):
        start = anyio.current_time()
        async with OPDStream(cfg, transport=transport) as stream:
            started = anyio.current_time() - start
            async with stream.run(samples) as results:
                out = [r async for r in results]
    if anyio_backend_name == "trio":
        assert started == pytest.approx(PROBE_DEADLINE, abs=1e-9)
    assert all(isinstance(r, ScoredSample) for r in out)
    assert hung == ["started", "cancelled"]  # the probe's request only: no sample went there
    (ejected,) = [e for e in events if e["event"] == "replica_ejected_by_probe"]
    assert ejected["url"] == A3 and ejected["reason"] == "deadline_exceeded"
    assert ejected["deadline_s"] == PROBE_DEADLINE


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"debug": True})], ids=["asyncio"])
async def test_a_mock_server_that_hangs_is_ejected_at_start_over_http() -> None:
    """The aiohttp mock's ``fault_hang`` on one replica of three: its ``/health`` answers,
    its scoring never does."""
    async with serve_mock("teacher", 1, replicas=3) as fleet:
        fleet.set_options(2, fault_hang=1.0)
        cfg = stream_config(
            {"default": fleet.urls},
            request_deadline_s=MILES_DEADLINE,
            probe_deadline_s=PROBE_DEADLINE,
            probe_at_start=True,
        )
        with anyio.fail_after(GUARD_S):
            async with OPDStream(cfg) as stream:
                assert stream.stats().endpoints[fleet.urls[2]].ejected
                samples = [Sample(list(range(1, 13)), 4) for _ in range(10)]
                async with stream.run(samples) as results:
                    assert all([isinstance(r, ScoredSample) async for r in results])
            with anyio.fail_after(60):
                while fleet.stats[2].disconnects < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
    assert fleet.stats[2].generate_requests == 1  # the probe's cold request alone
    assert fleet.stats[0].generate_requests + fleet.stats[1].generate_requests >= 10 + 4


async def test_probe_outside_the_stream_is_an_error() -> None:
    stream = OPDStream(stream_config(A1), transport=mock_transport(_fleet()))
    with pytest.raises(RuntimeError, match="outside"):
        await stream.probe()


# -- the command, against mock servers over HTTP ---------------------------------------------


_cli = partial(run_cli, "probe")  # opd-stream probe ..., in a worker thread


async def test_the_command_prints_the_report_and_exits_1_naming_the_outlier(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPD_STREAM_TEACHERS", raising=False)
    async with (
        serve_mock_threaded("teacher", 1, replicas=2) as good,
        serve_mock_threaded("teacher", 1, options=MockOptions(logprob_offset=-OFF)) as off,
    ):
        urls = [*good.urls, off.url]
        code = await _cli("--teacher", "t=" + "|".join(urls))
        report = json.loads(capsys.readouterr().out)
        assert code == 1
        assert report["ok"] is False and report["outliers"] == [off.url]
        assert report["max_replica_diff"] == pytest.approx(OFF, abs=1e-5)
        fields = {k: v for k, v in report.items() if k != "ok"}
        assert msgspec.convert(fields, ProbeReport).outliers == (off.url,)
        argv = ["--tokens", "5,6,7,8,9", "--response-length", "3"]
        code = await _cli("--teacher", "t=" + "|".join(good.urls), *argv)
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and report["ok"] is True and report["positions"] == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--teacher is required"),
        (["--teacher", "t"], "expected NAME=URL"),
        (["--teacher", "t=http://127.0.0.1:9", "--tokens", "1,2"], "go together"),
        (["--teacher", "t=http://127.0.0.1:9", "--tolerance", "0"], "probe_tolerance"),
        (
            ["--teacher", "t=http://127.0.0.1:9", "--tokens", "a", "--response-length", "1"],
            "integer",
        ),
    ],
)
def test_the_command_exits_2_on_a_usage_error(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPD_STREAM_TEACHERS", raising=False)
    assert main(["probe", *argv]) == 2
    err = capsys.readouterr().err
    assert "opd-stream probe: error: " in err and message in err, err


def test_the_mock_drifts_only_for_a_repeated_item_under_the_same_salt() -> None:
    from opd_stream.testing.mock_sglang._signal import SignalState

    def item(salt: str | None, ids: list[int]) -> Any:
        body = {"input_ids": ids, "return_logprob": True, "cache_salt": salt}
        raw = msgspec.json.encode({k: v for k, v in body.items() if v is not None})
        return parse_generate_request(
            raw, vocab_size=1000, context_length=1 << 20, per_position="patched"
        ).items[0]

    state = SignalState()
    assert state.shift(item("s", [1, 2, 3]), -0.1, 0.3) == -0.1  # cold
    assert state.shift(item("s", [1, 2, 3]), -0.1, 0.3) == pytest.approx(0.2)  # warm
    assert state.shift(item("t", [1, 2, 3]), -0.1, 0.3) == -0.1  # another salt: cold
    assert state.shift(item(None, [1, 2, 4]), 0.0, 0.3) == 0.0
    assert state.shift(item(None, [1, 2, 4]), 0.0, 0.3) == 0.3
    versions = [state.weight_version("d", ("v1", "v2")) for _ in range(3)]
    assert versions == ["v1", "v2", "v2"]
    assert SignalState().weight_version("d", ()) == "d"


async def test_a_router_is_probed_through_its_workers() -> None:
    router = "http://router:9"
    workers = {A1: InProcessSGLang("teacher", 1), A2: InProcessSGLang("teacher", 1)}
    workers[A3] = InProcessSGLang("teacher", 1, logprob_offset=-OFF)
    listing = msgspec.json.encode(
        {
            "workers": [
                {"id": u, "url": u, "is_healthy": True, "worker_type": "regular"} for u in workers
            ],
            "total": 3,
        }
    )
    asked_router: list[str] = []

    def handle(method: str, url: str, body: bytes) -> Response:
        if url.startswith(router):
            asked_router.append(url[len(router) :])
            if url.endswith("/workers"):
                return Response(200, listing)
            return Response(500, b"{}")
        base = next(u for u in workers if url.startswith(u))
        return workers[base].handle(method, url[len(base) :], body)

    transport = MockTransport(handle, gateways=True)
    async with OPDStream(stream_config(router), transport=transport) as stream:
        report = await stream.probe()
    assert [r.url for r in report.replicas] == [A1, A2, A3]
    assert report.outliers == (A3,)
    assert asked_router == ["/workers"]  # the router itself answered no scoring request
