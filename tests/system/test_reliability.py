"""Backpressure and bounded memory: a slow consumer, and a short RSS soak.

The long soak lives in bench/; this one runs a few thousand samples through one stream
(in-process mock transport) and bounds the resident set's growth after warm-up.
"""

from __future__ import annotations

import gc
from typing import Any

import anyio
import numpy as np
import psutil
import pytest
from support.config import stream_config

from opd_stream import OPDStream, Sample, ScoredSample
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.testing.mock_sglang import MockOptions, serve_mock

T = "http://teacher:1"
S = "http://student:2"


def _samples(n: int, *, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(3, 8)), int(rng.integers(1, 6))
        out.append(Sample(rng.integers(0, 5000, p + r).tolist(), r, sample_id=i))
    return out


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"debug": True})])
async def test_a_slow_consumer_over_http_keeps_every_bound() -> None:
    opts = MockOptions(latency_fixed_s=0.002)
    async with (
        serve_mock("teacher", 1, options=opts) as teacher,
        serve_mock("student", 1, options=opts) as student,
    ):
        cfg = stream_config(
            teacher.url,
            student_url=student.url,
            top_k=3,
            strategy="union",
            max_inflight=5,
            max_inflight_per_endpoint=2,
            channel_capacity=3,
            kl_batch_size=4,
        )
        n = 0
        async with OPDStream(cfg) as stream, stream.run(_samples(60)) as results:
            async for res in results:
                assert isinstance(res, ScoredSample)
                n += 1
                await anyio.sleep(0.02)
                st = stream.stats()
                assert st.in_flight <= 5
                for name, ch in st.channels.as_dict().items():
                    assert ch.depth <= ch.capacity and ch.high_water <= ch.capacity, name
                # intake stops: admitted <= taken + slots + the output channel
                assert st.admitted <= n + 5 + 3
        stats = stream.stats()
    assert n == 60
    assert {ch.high_water for ch in stats.channels.as_dict().values()} != {0}
    for cluster in (teacher, student):
        assert cluster.stats[0].max_in_flight <= 2  # max_inflight_per_endpoint


async def _kernels_ready() -> None:
    """Wait until the compiled kernels are ready (a stream compiles them, or loads them from
    numba's cache, in a background thread as it starts): their one-time memory must not land
    between the soak's two readings, as it would when a busy machine slows that thread."""
    from opd_stream.scanner import _loader

    with anyio.fail_after(600):  # a cold compile on a busy machine: minutes at most
        while not (_loader.available() or await anyio.to_thread.run_sync(_loader.prepare)):
            if getattr(_loader, "_failed", False):
                return  # no kernels here: nothing will arrive
            await anyio.sleep(0.1)


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_a_soak_of_thousands_of_samples_keeps_rss_bounded() -> None:
    servers = {T: InProcessSGLang("teacher", 1), S: InProcessSGLang("student", 1)}
    cfg = stream_config(T, student_url=S, top_k=2, max_inflight=32)
    total = 3000
    proc = psutil.Process()
    rss: dict[int, int] = {}

    def samples() -> Any:
        rng = np.random.default_rng(7)
        for i in range(total):
            if i in (total // 5, total - 1):
                gc.collect()
                rss[i] = proc.memory_info().rss
            p, r = int(rng.integers(3, 8)), int(rng.integers(1, 6))
            yield Sample(rng.integers(0, 5000, p + r).tolist(), r, sample_id=i)

    await _kernels_ready()
    n = 0
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples()) as results:
            async for res in results:
                assert isinstance(res, ScoredSample)
                n += 1
        stats = stream.stats()
    assert n == total and stats.in_flight == 0
    early, late = rss[total // 5], rss[total - 1]
    assert late <= 1.2 * early + 16 * 2**20, (early, late)
