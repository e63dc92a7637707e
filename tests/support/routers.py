"""SGLang's gateways (sglang-router 0.3.2, smg) in front of mock SGLang worker subprocesses,
and what the gateway tests share.

:func:`launch_sglang_router` / :func:`launch_smg` start a gateway on 127.0.0.1 (yield its
URL); a missing install FAILS in CI (``CI`` set) and where the package is installed, and
skips, with the reason, only where the tool is truly absent. :func:`gateway_fleet` is the
body of a module fixture: ``n`` mock workers behind one gateway, yielding
``(gateway URL, worker URLs)``, the workers killed afterwards. The workers are teacher
``MockModel(seed=1)`` (:data:`TEACHER`); :func:`gateway_samples` draws samples with the
rollout of :data:`STUDENT`, :func:`check_scored` checks every result against the
independent reference, :func:`score_all` runs a stream over samples.
"""

from __future__ import annotations

import importlib.util
import os
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import aiohttp
import anyio
import msgspec
import numpy as np
import pytest

from opd_stream import OPDStream, Sample, StreamConfig
from opd_stream.testing.mock_sglang import MockModel, MockOptions, MockProcess
from opd_stream.testing.router import RouterUnavailable, SGLangRouter, SMGGateway
from support.pipeline_reference import assert_all_scored, rollout_topk_rows

__all__ = (
    "STUDENT",
    "TEACHER",
    "check_scored",
    "generate_counts",
    "gateway_api",
    "gateway_fleet",
    "gateway_samples",
    "launch_sglang_router",
    "launch_smg",
    "mock_stats",
    "mock_workers",
    "samples_until_routed",
    "score_all",
)

TEACHER = MockModel("teacher", 1)
STUDENT = MockModel("student", 1)


@contextmanager
def _launched(
    gateway: Callable[..., AbstractContextManager[str]], package: str, name: str, **kw: Any
) -> Iterator[str]:
    try:
        with gateway(**kw) as url:
            yield url
    except RouterUnavailable as exc:
        # Skipped only where the tool is truly absent, never in CI (the test extra has it)
        if importlib.util.find_spec(package) is None and not os.environ.get("CI"):
            pytest.skip(f"{name} is not installed (the test extra has it on Linux)")
        pytest.fail(f"{exc}: run `scripts/dev.sh setup`")


def launch_sglang_router(urls: list[str]) -> AbstractContextManager[str]:
    """sglang-router on 127.0.0.1 in front of ``urls`` (round robin); yields its URL."""
    return _launched(SGLangRouter, "sglang_router", "sglang-router", workers=urls)


def launch_smg(urls: list[str], **kw: Any) -> AbstractContextManager[str]:
    """smg on 127.0.0.1 in front of ``urls`` (``kw``: :class:`SMGGateway`'s); yields its URL."""
    return _launched(SMGGateway, "smg", "smg", workers=urls, **kw)


def gateway_api(url: str, method: str, path: str, body: Any = None) -> bytes:
    """``METHOD url+path`` with ``body`` as JSON (the gateways' worker API); the raw answer."""
    data = None if body is None else msgspec.json.encode(body)
    req = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return bytes(resp.read())


def mock_workers(n: int, **options: Any) -> list[MockProcess]:
    """``n`` mock teacher subprocesses (seed 1) with :class:`MockOptions` ``options``."""
    return [MockProcess("teacher", 1, options=MockOptions(**options)) for _ in range(n)]


@contextmanager
def gateway_fleet(
    launch: Callable[[list[str]], AbstractContextManager[str]], n: int = 2, **options: Any
) -> Iterator[tuple[str, list[str]]]:
    """``n`` mock workers behind the gateway ``launch`` starts: (gateway URL, worker URLs)."""
    workers = mock_workers(n, **options)
    try:
        urls = [w.start() for w in workers]
        with launch(urls) as url:
            yield url, urls
    finally:
        for w in workers:
            w.kill()


def gateway_samples(n: int, *, top_k: int, seed: int = 0) -> list[Sample]:
    """``n`` samples (prompts 3-9, responses 1-8 tokens) with :data:`STUDENT`'s rollout
    logprobs and, when ``top_k``, its top-k rows."""
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


async def score_all(cfg: StreamConfig, samples: Any) -> tuple[list[Any], Any]:
    """Every result of one run over ``samples`` (by index), and the stream's stats."""
    async with OPDStream(cfg) as stream:
        async with stream.run(samples) as results:
            out = sorted([r async for r in results], key=lambda r: r.index)
        return out, stream.stats()


async def mock_stats(workers: list[str]) -> list[dict[str, Any]]:
    """Each mock worker's ``/mock/stats``."""
    async with aiohttp.ClientSession() as session:
        out = []
        for w in workers:
            async with session.get(w + "/mock/stats") as resp:
                out.append(msgspec.json.decode(await resp.read()))
        return out


def check_scored(out: list[Any], *, top_k: int, strategy: str = "only-student") -> None:
    """Every item is scored, equal to the reference of :data:`TEACHER` and :data:`STUDENT`."""
    assert_all_scored(out, TEACHER, STUDENT, top_k=top_k, strategy=strategy)


async def samples_until_routed(
    stream: OPDStream, pool: list[Sample], gateway: str, worker: str, add: Callable[[], Any]
) -> AsyncIterator[Sample]:
    """``pool``'s samples, one per 50 ms; after the fifth, ``add()`` registers ``worker``
    with the gateway; the feed ends once ``stream``'s fleet behind ``gateway`` has listed
    the worker for 10 samples and the worker has served a ``/generate`` (on a busy machine
    its first request can come later than that), or when the pool runs out."""
    seen_at = None
    for n, sample in enumerate(pool):
        if n == 5:
            add()
        fleet = stream.stats().fleets.get(gateway)
        if seen_at is None and fleet and worker in fleet.workers:
            seen_at = n
        if seen_at is not None and n >= seen_at + 10 and (await generate_counts([worker]))[0]:
            return
        yield sample
        await anyio.sleep(0.05)


async def generate_counts(workers: list[str]) -> list[int]:
    """Each mock worker's count of ``/generate`` requests served."""
    return [int(s["generate_requests"]) for s in await mock_stats(workers)]
