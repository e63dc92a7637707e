"""sglang-router 0.3.2 (SGLang's Rust load balancer, PyPI ``sglang-router``) in front of mock
replicas: scoring through it in sampled-token and top-k modes, and detection of the fields
it drops (``token_ids_logprob_positions``) or rejects (a batch with per-item
``logprob_start_len``, HTTP 422) with the ``auto`` fallback.

The router runs as ``python -m sglang_router.launch_router`` on 127.0.0.1 with
``--policy round_robin``; the workers are mock SGLang subprocesses. Their info endpoints are
off (404), so the router registers them as model "unknown" and never looks for a tokenizer
on a model hub: nothing leaves 127.0.0.1. The set-up step installs the router
(``scripts/dev.sh setup``); a missing install fails these tests.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from pipeline_reference import assert_matches, expected_result, rollout_topk_rows

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample, StreamConfig
from opd_stream.testing.mock_sglang import MockModel, MockOptions, MockProcess

TEACHER = MockModel("teacher", 1)
STUDENT = MockModel("student", 1)
K = 3


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            pytest.fail(f"sglang-router exited with {proc.returncode}: {out[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail(f"sglang-router did not answer /health within {timeout} s")


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[str, list[str]]]:
    """A router on 127.0.0.1 in front of two mock teacher replicas: (router URL, workers)."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        pytest.fail("sglang-router is not installed: run `scripts/dev.sh setup`")
    workers = [MockProcess("teacher", 1, options=MockOptions(info_endpoints=False)) for _ in "ab"]
    proc: subprocess.Popen[bytes] | None = None
    try:
        urls = [w.start() for w in workers]
        port = _free_port()
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "NO_PROXY": "*",
        }
        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--policy",
            "round_robin",
            "--log-level",
            "warn",
        ]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        yield url, urls
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        for w in workers:
            w.kill()


def _samples(n: int, *, top_k: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(3, 10)), int(rng.integers(1, 9))
        tokens = rng.integers(0, 5000, p + r).tolist()
        rollout = STUDENT.token_logprobs(np.asarray(tokens), np.arange(p, p + r))
        rows = rollout_topk_rows(STUDENT, tokens, p, top_k) if top_k else None
        out.append(
            Sample(
                tokens,
                r,
                rollout_logprobs=[float(np.float32(x)) for x in rollout],
                student_top_logprobs=rows,
                sample_id=i,
            )
        )
    return out


async def _score(cfg: StreamConfig, samples: list[Sample]) -> tuple[list[Any], Any]:
    async with OPDStream(cfg) as stream:
        async with stream.run(samples) as results:
            out = sorted([r async for r in results], key=lambda r: r.index)
        return out, stream.stats()


async def _generate_counts(workers: list[str]) -> list[int]:
    async with aiohttp.ClientSession() as session:
        counts = []
        for w in workers:
            async with session.get(w + "/mock/stats") as resp:
                counts.append(int(msgspec.json.decode(await resp.read())["generate_requests"]))
        return counts


def _check(out: list[Any], *, top_k: int, strategy: str = "only-student") -> None:
    for item in out:
        assert isinstance(item, ScoredSample), (item.reason, item.message)
        exp = expected_result(
            tokens=list(item.sample.tokens),
            response_length=item.sample.response_length,
            teacher=TEACHER,
            student=STUDENT,
            top_k=top_k,
            strategy=strategy,
            weight_mode="student_p",
            rollout_logprobs=list(item.sample.rollout_logprobs),
        )
        assert_matches(item, exp)


async def test_sampled_token_scoring_through_the_router_reaches_both_replicas(
    router: tuple[str, list[str]],
) -> None:
    url, workers = router
    before = await _generate_counts(workers)
    cfg = StreamConfig.from_env({}, teachers=url, kl_device="cpu")
    out, _ = await _score(cfg, _samples(10, top_k=0))
    _check(out, top_k=0)
    after = await _generate_counts(workers)
    assert [a - b for a, b in zip(after, before, strict=True)] == [5, 5]  # round robin


async def test_per_position_dropped_by_the_router_is_detected_and_falls_back_under_auto(
    router: tuple[str, list[str]],
) -> None:
    url, _ = router
    cfg = StreamConfig.from_env({}, teachers=url, kl_device="cpu", top_k=K, id_scoring="auto")
    out, stats = await _score(cfg, _samples(8, top_k=K, seed=1))
    _check(out, top_k=K)
    ep = stats.endpoints[url]
    assert ep.per_position is False
    # The router also rejects the blocked form's batch (per-item logprob_start_len): 422,
    # after which the endpoint uses the flat form.
    assert ep.blocked_batch is False
    assert stats.failed == 0


async def test_top_k_intersection_through_the_router_matches_the_reference(
    router: tuple[str, list[str]],
) -> None:
    url, _ = router
    cfg = StreamConfig.from_env({}, teachers=url, kl_device="cpu", top_k=K, strategy="intersection")
    out, stats = await _score(cfg, _samples(8, top_k=K, seed=2))
    _check(out, top_k=K, strategy="intersection")
    assert stats.endpoints[url].b64_topk is not None


async def test_strict_per_position_through_the_router_fails_loudly(
    router: tuple[str, list[str]],
) -> None:
    url, _ = router
    cfg = StreamConfig.from_env(
        {}, teachers=url, kl_device="cpu", top_k=K, id_scoring="per-position"
    )
    out, _ = await _score(cfg, _samples(2, top_k=K, seed=3))
    assert all(isinstance(r, SampleFailure) and r.reason == "capability" for r in out)
