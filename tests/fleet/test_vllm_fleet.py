"""vLLM servers in a fleet (issue 33, part 1): each server's engine, set (``engine``,
``server_engines``) or detected once under ``auto`` (SGLang pays nothing), the path each
engine is spoken to on, ``--max-logprobs`` (rows split, or a refusal naming the flag), and
what an engine cannot serve refused clearly (at construction when set; per sample when
detected).

The vLLM servers are :mod:`support.fake_vllm` (written from vLLM's source, on the SGLang
mock's model): the same tokens give the same float32 values as the SGLang mock, so a vLLM
fleet's results must equal an SGLang fleet's exactly.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest
from support.config import FAST_BACKOFF, stream_config
from support.fake_vllm import FakeVLLM, route

from opd_stream import ConfigError, OPDStream, Sample, SampleFailure, ScoredSample
from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.transport._transports import MockTransport, Response

T = "http://teacher:1"
ST = "http://student:2"
K = 3
P, R = 6, 5

_cfg = partial(stream_config, T, **FAST_BACKOFF)


def _samples(n: int = 3) -> list[Sample]:
    rng = np.random.default_rng(5)
    return [
        Sample(rng.integers(0, 3000, P + R).tolist(), R, rollout_logprobs=[-1.0] * R)
        for _ in range(n)
    ]


async def _run(cfg: Any, servers: dict[str, Any], samples: list[Sample]) -> tuple[list[Any], Any]:
    """Each sample's result, one after the other, and the stream's stats at the end."""
    transport = MockTransport(route(servers))
    async with OPDStream(cfg, transport=transport) as stream:
        out = [await stream.score(s) for s in samples]
        return out, stream.stats()


async def _score(cfg: Any, servers: dict[str, Any], samples: list[Sample]) -> list[Any]:
    return (await _run(cfg, servers, samples))[0]


def _same(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b, strict=True):
        assert isinstance(x, ScoredSample), x
        assert isinstance(y, ScoredSample), y
        assert np.array_equal(x.teacher_logprobs.numpy(), y.teacher_logprobs.numpy())
        assert x.reverse_kl is not None and y.reverse_kl is not None
        assert np.array_equal(x.reverse_kl.numpy(), y.reverse_kl.numpy())


# -- settings ------------------------------------------------------------------------------


def test_server_engines_parse_from_env_normalised() -> None:
    cfg = stream_config(
        {"a": ["http://a:1", "http://b:1"]},
        server_engines="HTTP://A:1/generate=vllm , http://b:1=VLLM-completions",
    )
    assert cfg.server_engines == {"http://a:1": "vllm", "http://b:1": "vllm-completions"}
    env = {"OPD_STREAM_TEACHERS": "http://a:1", "OPD_STREAM_SERVER_ENGINES": "http://a:1=sglang"}
    assert StreamConfigFromEnv(env).server_engines == {"http://a:1": "sglang"}


def StreamConfigFromEnv(env: dict[str, str]) -> Any:
    from opd_stream import StreamConfig

    return StreamConfig.from_env(env, kl_device="cpu")


def test_a_completions_teacher_refuses_a_strategy_that_needs_ids_naming_server_and_fix() -> None:
    with pytest.raises(ConfigError) as info:
        _cfg(top_k=K, strategy="only-student", engine="vllm-completions")
    text = str(info.value)
    assert "teacher 'default' at http://teacher:1 (vllm-completions)" in text
    assert "strategy only-student" in text and "--enable-scale-out" in text


def test_a_teacher_top_k_beyond_max_logprobs_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--max-logprobs 32 or more"):
        _cfg(top_k=32, strategy="intersection", engine="vllm", student_url=ST)
    # the ids a strategy asks are split instead: no refusal
    _cfg(top_k=32, strategy="only-student", engine="vllm")
    _cfg(top_k=32, strategy="intersection", engine="vllm", vllm_max_logprobs=-1, student_url=ST)


def test_the_student_on_completions_refuses_a_strategy_where_it_scores_teacher_ids() -> None:
    with pytest.raises(ConfigError, match="the student at http://student:2"):
        _cfg(top_k=K, strategy="union", student_url=ST, server_engines={ST: "vllm-completions"})
    _cfg(top_k=K, strategy="intersection", student_url=ST, server_engines={ST: "vllm-completions"})


def test_sampled_token_mode_runs_on_every_engine_and_auto_is_never_refused() -> None:
    for engine in ("auto", "sglang", "vllm", "vllm-completions"):
        _cfg(engine=engine)
    _cfg(top_k=K, strategy="union", student_url=ST)  # auto: found per server, checked then


# -- the path each engine is spoken to on --------------------------------------------------


@pytest.mark.anyio
async def test_a_configured_vllm_teacher_is_asked_on_scale_out_only_and_equals_sglang() -> None:
    vllm = FakeVLLM()
    got, stats = await _run(_cfg(engine="vllm"), {T: vllm}, _samples())
    assert set(vllm.paths) == {"/inference/v1/generate"}  # no /generate, no detection
    assert len(vllm.paths) == 3
    assert stats.endpoints[T].engine == "vllm"
    _same(got, await _score(_cfg(), {T: InProcessSGLang("teacher", 1)}, _samples()))


@pytest.mark.anyio
async def test_server_engines_speak_per_server_in_one_pool() -> None:
    a, b = "http://a:1", "http://b:1"
    vllm, comp = FakeVLLM(), FakeVLLM(scale_out=False)
    cfg = stream_config(
        {"default": [a, b]},
        **FAST_BACKOFF,
        server_engines={a: "vllm", b: "vllm-completions"},
        balance="round-robin",
    )
    got = await _score(cfg, {a: vllm, b: comp}, _samples(4))
    assert set(vllm.paths) == {"/inference/v1/generate"}
    assert set(comp.paths) == {"/v1/completions"}
    _same(got, await _score(_cfg(), {T: InProcessSGLang("teacher", 1)}, _samples(4)))


@pytest.mark.anyio
async def test_workers_found_behind_a_gateway_speak_the_gateways_engine() -> None:
    gateway, worker = "http://gateway:1", "http://w1:2"
    vllm = FakeVLLM()
    listing = {"workers": [{"url": worker, "is_healthy": True, "worker_type": "regular"}]}

    async def handler(method: str, url: str, body: bytes) -> Response:
        if url == f"{gateway}/workers":
            return Response(200, json.dumps(listing).encode())
        if url.startswith(gateway):
            return Response(502, b'{"error": {"message": "not through the gateway"}}')
        return await route({worker: vllm})(method, url, body)

    cfg = stream_config(gateway, **FAST_BACKOFF, server_engines={gateway: "vllm"})
    async with OPDStream(cfg, transport=MockTransport(handler, gateways=True)) as stream:
        got = [await stream.score(s) for s in _samples(2)]
    assert all(isinstance(r, ScoredSample) for r in got)
    assert vllm.paths.count("/inference/v1/generate") == 2
    assert "/generate" not in vllm.paths


# -- detection (auto) ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_sglang_fleet_pays_nothing_for_auto() -> None:
    sglang = InProcessSGLang("teacher", 1)
    _, stats = await _run(_cfg(), {T: sglang}, _samples())
    assert sglang.requests == 3
    assert stats.endpoints[T].engine == "sglang"


@pytest.mark.anyio
async def test_auto_detects_scale_out_once_and_the_404_is_no_failure() -> None:
    vllm = FakeVLLM()
    got, stats = await _run(_cfg(max_attempts=1), {T: vllm}, _samples())
    assert vllm.paths[:3] == ["/generate", "/inference/v1/generate", "/inference/v1/generate"]
    assert vllm.paths.count("/generate") == 1  # known from then on
    assert stats.endpoints[T].engine == "vllm"
    assert stats.endpoints[T].errors == 0
    assert stats.endpoints[T].ejections == 0
    # max_attempts=1, yet the first sample asks again after the 404: not a failed attempt
    assert [r.attempts for r in got] == [2, 1, 1]
    _same(got, await _score(_cfg(), {T: InProcessSGLang("teacher", 1)}, _samples()))


@pytest.mark.anyio
async def test_auto_falls_to_completions_when_scale_out_is_off() -> None:
    comp = FakeVLLM(scale_out=False)
    got, stats = await _run(_cfg(), {T: comp}, _samples())
    assert comp.paths[:3] == ["/generate", "/inference/v1/generate", "/v1/completions"]
    assert stats.endpoints[T].engine == "vllm-completions"
    _same(got, await _score(_cfg(), {T: InProcessSGLang("teacher", 1)}, _samples()))


@pytest.mark.anyio
async def test_no_scoring_api_fails_each_sample_naming_every_path_and_the_fix() -> None:
    none = FakeVLLM(scale_out=False, completions=False)
    got = await _score(_cfg(), {T: none}, _samples(2))
    assert all(isinstance(r, SampleFailure) and r.reason == "capability" for r in got)
    text = got[0].message
    for part in (
        "http://teacher:1",
        "POST /generate answered 404",
        "POST /inference/v1/generate answered 403",
        "--enable-scale-out",
        "POST /v1/completions answered 404",
    ):
        assert part in text, text
    assert none.paths.count("/inference/v1/generate") == 1  # found once, kept


@pytest.mark.anyio
async def test_concurrent_requests_wait_for_one_detection() -> None:
    vllm = FakeVLLM(checkpoints=3)
    transport = MockTransport(route({T: vllm}))
    samples = _samples(12)
    got: list[Any] = []
    async with OPDStream(_cfg(), transport=transport) as stream:

        async def one(s: Sample) -> None:
            got.append(await stream.score(s))

        async with anyio.create_task_group() as tg:
            for s in samples:
                tg.start_soon(one, s)
    assert all(isinstance(r, ScoredSample) for r in got)
    probes = [b for b in vllm.bodies if len(b["token_ids"]) == 2]  # probe_body: 2 tokens
    assert len(probes) == 1
    assert vllm.paths.count("/generate") > 1  # they did arrive together


@pytest.mark.anyio
async def test_a_cancelled_detection_leaves_the_engine_unknown() -> None:
    from opd_stream.fleet._endpoints import Endpoints
    from opd_stream.fleet._engines import EngineDirectory

    vllm = FakeVLLM()
    release = anyio.Event()

    async def handler(method: str, url: str, body: bytes) -> Any:
        if not release.is_set():
            await anyio.sleep_forever()
        return await route({T: vllm})(method, url, body)

    engines = EngineDirectory(Endpoints(), MockTransport(handler))
    with anyio.move_on_after(0):  # cancelled while its probe is in flight
        await engines.detect("teacher", T, 404)
    assert engines.known(T) is None
    release.set()
    assert await engines.detect("teacher", T, 404) == "vllm"
    assert engines.known(T) == "vllm"


@pytest.mark.anyio
async def test_a_503_during_detection_is_retried_and_leaves_the_engine_to_find() -> None:
    vllm = FakeVLLM()
    busy = [1]

    async def handler(method: str, url: str, body: bytes) -> Response:
        if url.endswith("/inference/v1/generate") and busy:
            busy.pop()
            return Response(503, b'{"error": {"message": "overloaded"}}')
        return await route({T: vllm})(method, url, body)

    async with OPDStream(_cfg(), transport=MockTransport(handler)) as stream:
        got = await stream.score(_samples(1)[0])
        engine = stream.stats().endpoints[T].engine
    assert isinstance(got, ScoredSample), got
    assert engine == "vllm"
    assert got.attempts == 3  # the 404, the 503 (a failed attempt), the answer


# -- max_logprobs ---------------------------------------------------------------------------


def _topk_samples(student: InProcessSGLang, n: int = 2) -> list[Sample]:
    out = []
    for s in _samples(n):
        ids, lps = student.model.topk(np.asarray(s.tokens), np.arange(P, P + R), K + 2)
        rows = [
            [[float(lp), int(i)] for lp, i in zip(lps[t], ids[t], strict=True)] for t in range(R)
        ]
        out.append(Sample(s.tokens, R, student_top_logprobs=rows))
    return out


@pytest.mark.anyio
async def test_ids_beyond_max_logprobs_are_split_and_equal_sglang() -> None:
    student = InProcessSGLang("student", 1)
    vllm = FakeVLLM(max_logprobs=2)
    cfg = _cfg(top_k=K + 2, engine="vllm", vllm_max_logprobs=2)  # 1 + 5 columns: 3 bodies
    got = await _score(cfg, {T: vllm}, _topk_samples(student))
    assert len(vllm.bodies) == 2 * 3
    assert {len(b["sampling_params"]["prompt_logprob_token_ids"][0]) for b in vllm.bodies} == {2}
    sglang = await _score(
        _cfg(top_k=K + 2), {T: InProcessSGLang("teacher", 1)}, _topk_samples(student)
    )
    _same(got, sglang)


@pytest.mark.anyio
async def test_a_server_with_fewer_max_logprobs_than_configured_fails_naming_the_flag() -> None:
    student = InProcessSGLang("student", 1)
    vllm = FakeVLLM(max_logprobs=4)
    got = await _score(_cfg(top_k=K + 2, engine="vllm"), {T: vllm}, _topk_samples(student, 1))
    (failure,) = got
    assert isinstance(failure, SampleFailure) and failure.reason == "capability"
    assert "--max-logprobs 6 or more" in failure.message
    assert "OPD_STREAM_VLLM_MAX_LOGPROBS" in failure.message
    assert len(vllm.bodies) == 1  # not retried


@pytest.mark.anyio
async def test_a_detected_completions_server_fails_an_ids_strategy_per_sample() -> None:
    student = InProcessSGLang("student", 1)
    comp = FakeVLLM(scale_out=False)
    got = await _score(_cfg(top_k=K + 2), {T: comp}, _topk_samples(student))
    for r in got:
        assert isinstance(r, SampleFailure) and r.reason == "capability"
        assert "--enable-scale-out" in r.message
    assert "/v1/completions" in comp.paths  # detected, then refused without asking


def test_the_refusal_read_is_vllms_own_wording() -> None:
    from pathlib import Path

    from opd_stream.fleet._engines import max_logprobs_problem

    src = (Path(__file__).parents[2] / ".cache/vllm/src/vllm/sampling_params.py").read_text()
    assert "token ids per row in " in src
    for wording in ("which is greater than max allowed: ", "Set max_logprobs (--max-logprobs)"):
        assert wording in src
    message = (
        "Requested 21 token ids per row in prompt_logprob_token_ids, which is greater than "
        "max allowed: 20. Set max_logprobs (--max-logprobs) to at least 21."
    )
    problem = max_logprobs_problem("vllm", 400, message)
    assert problem is not None and "--max-logprobs 21 or more" in problem
    assert max_logprobs_problem("vllm", 400, "prompt_logprob_token_ids must be...") is None
    assert max_logprobs_problem("sglang", 400, message) is None


# -- the probe ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_probe_at_start_finds_every_servers_engine_and_a_mixed_pool_agrees() -> None:
    a, b = "http://a:1", "http://b:1"
    servers = {a: InProcessSGLang("teacher", 1), b: FakeVLLM(), ST: FakeVLLM("student", 1)}
    cfg = stream_config({"default": [a, b]}, student_url=ST, probe_at_start=True)
    async with OPDStream(cfg, transport=MockTransport(route(servers))) as stream:
        found = {url: ep.engine for url, ep in stream.stats().endpoints.items()}
        assert found == {a: "sglang", b: "vllm", ST: "vllm"}  # at start, the student too
        report = await stream.probe()
    assert {r.url: r.engine for r in report.replicas} == {a: "sglang", b: "vllm"}
    assert report.servers == {a: "sglang", b: "vllm", ST: "vllm"}
    assert report.ok, report  # the same model: SGLang and vLLM give the same numbers
