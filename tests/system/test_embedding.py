"""A good guest in the host's process (issue 13), defect by defect, through the public API:
logging (silent unless the host configured logging), memory (nothing of a finished sample
stays referenced), torch loading (not on ``import opd_stream``), cancellation (a Miles
caller that stops waiting stops its requests), and the front door (what ``run`` accepts
and what a bad input's failure holds). The KL device resolution is in test_config.py,
torch's thread settings in test_scoring_threads.py, the trio transport in
test_transport_httpx.py, and the whole picture in test_acceptance_embedding.py."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import typing
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest
from support.config import stream_config

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample
from opd_stream.integrations import miles
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.testing.mock_sglang import MockOptions, serve_mock

T = "http://teacher:1"
S = "http://student:2"


_cfg = partial(stream_config, T)


def _servers() -> dict[str, InProcessSGLang]:
    return {T: InProcessSGLang("teacher", 1), S: InProcessSGLang("student", 1)}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


# --- 1. logging ----------------------------------------------------------------------------
_LOGGING_SCRIPT = """
import logging, sys
import anyio
from opd_stream import OPDStream, Sample, StreamConfig
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

MODE = {mode!r}
if MODE == "basic":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
elif MODE == "disabled":
    logging.basicConfig(level=logging.DEBUG)
    logging.disable(logging.CRITICAL)
elif MODE == "host-structlog":  # the host prints its own structlog events to stdout
    import structlog
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stdout))

async def main():
    url = "http://teacher:1"
    cfg = StreamConfig.from_env({{}}, teachers=url, kl_device="cpu")
    from opd_stream import Response
    def flaky(n, body):  # every other request: 503 (retried)
        return Response(503, b'{{"error": "busy"}}') if n % 2 else None
    servers = {{url: InProcessSGLang("teacher", 1, fault=flaky)}}
    samples = [Sample([1, 2, 3, 4, 5], 2) for _ in range(8)] + ["not a sample"]
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
    assert len(out) == 9 and stream.stats().retries > 0, stream.stats()

anyio.run(main)
"""


@pytest.mark.parametrize("mode", ["none", "host-structlog", "disabled"])
def test_a_host_that_configured_no_logging_sees_nothing_anywhere(mode: str) -> None:
    # events fired: stream_started, retries, a sample_failed warning, run_finished
    proc = _python(_LOGGING_SCRIPT.format(mode=mode))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == ""


def test_a_host_that_configured_logging_gets_our_events_in_its_handlers() -> None:
    proc = _python(_LOGGING_SCRIPT.format(mode="basic"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert any(line.startswith("opd_stream stream_started ") for line in lines)
    assert any(
        line.startswith("opd_stream sample_failed ") and "reason='invalid_sample'" in line
        for line in lines
    )
    assert any(line.startswith("opd_stream run_finished ") for line in lines)


def test_configure_logging_prints_to_stderr_for_applications() -> None:
    code = _LOGGING_SCRIPT.format(mode="none").replace(
        "anyio.run(main)",
        "from opd_stream import configure_logging\nconfigure_logging('info', json=True)\n"
        "anyio.run(main)",
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert '"event": "stream_started"' in proc.stderr
    assert '"event": "sample_failed"' in proc.stderr


# --- 4. torch loading ----------------------------------------------------------------------
def test_importing_the_package_and_the_cli_does_not_import_torch() -> None:
    proc = _python(
        "import sys\n"
        "import opd_stream, opd_stream.integrations.miles, opd_stream.integrations.verl\n"
        "from opd_stream.cli._main import main\n"
        "assert main(['config']) == 0\n"
        "assert opd_stream.StreamConfig.from_env({}, teachers='http://t:1').top_k == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from opd_stream.kl import topk_reverse_kl  # the KL math imports it\n"
        "assert 'torch' in sys.modules\n"
    )
    assert proc.returncode == 0, proc.stderr


# --- 2. memory -----------------------------------------------------------------------------
class _Probe:
    """Stands for a sample's memory: alive while anything references the sample."""


@pytest.mark.parametrize("order", ["completed", "input"])
@pytest.mark.parametrize("top_k", [0, 4])
async def test_nothing_of_a_finished_sample_stays_referenced_by_the_pipeline(
    order: str, top_k: int
) -> None:
    probes: list[weakref.ref[_Probe]] = []
    more = anyio.Event()
    n = 24

    def make(i: int) -> Sample:
        probe = _Probe()
        probes.append(weakref.ref(probe))
        rng = np.random.default_rng(i)
        r = 0 if i % 7 == 3 else 6  # R = 0 included
        return Sample(rng.integers(0, 5000, 12).tolist(), r, metadata={"probe": probe})

    async def samples() -> AsyncIterator[Sample]:
        for i in range(n):
            yield make(i)
        await more.wait()  # the run stays open, its workers idle, while we look

    topk: dict[str, Any] = {"top_k": top_k, "student_url": S, "strategy": "union"}
    cfg = _cfg(**(topk if top_k else {}), order=order, max_inflight=16, kl_batch_size=4)
    async with OPDStream(cfg, transport=mock_transport(_servers())) as stream:
        async with stream.run(samples()) as results:
            kinds = []
            for _ in range(n):
                item = await results.__anext__()
                kinds.append(type(item))
                del item  # the caller drops every result
            gc.collect()
            alive = [i for i, ref in enumerate(probes) if ref() is not None]
            assert alive == []
            more.set()
            assert [r async for r in results] == []
    assert kinds == [ScoredSample] * n


# --- 7. the front door ---------------------------------------------------------------------
# --- the async library, named in the stream's own tasks only -------------------------------
class _Naming:
    """A transport that notes what sniffio's context variable holds in the task that
    sends (the stream's own fetch task)."""

    def __init__(self) -> None:
        self._inner = mock_transport(_servers())
        self.named: set[str | None] = set()

    async def __aenter__(self) -> _Naming:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def send(self, request: Any) -> Any:
        import sniffio

        self.named.add(sniffio.current_async_library_cvar.get())
        return await self._inner.send(request)


async def _score_naming(transport: _Naming) -> list[Any]:
    async with OPDStream(_cfg(), transport=transport) as stream:
        async with stream.run([Sample([1, 2, 3, 4, 5], 2) for _ in range(3)]) as results:
            return [r async for r in results]


def test_under_asyncio_the_streams_tasks_name_their_library_and_the_hosts_do_not() -> None:
    # A host on asyncio.run (Miles, verl): anyio asks sniffio at each call, which sniffs
    # for asyncio unless its context variable names it. The stream names it in its own
    # tasks' contexts; the host's task sees no change.
    sniffio = pytest.importorskip("sniffio")
    cvar = sniffio.current_async_library_cvar
    transport = _Naming()

    async def host() -> tuple[list[Any], str | None]:
        out = await _score_naming(transport)
        return out, cvar.get()

    out, after = asyncio.run(host())
    assert len(out) == 3 and all(isinstance(r, ScoredSample) for r in out)
    assert transport.named == {"asyncio"}
    assert after is None


def test_under_trio_nothing_is_named_trio_names_itself() -> None:
    sniffio = pytest.importorskip("sniffio")
    trio = pytest.importorskip("trio")
    transport = _Naming()
    out = trio.run(_score_naming, transport)
    assert len(out) == 3 and all(isinstance(r, ScoredSample) for r in out)
    assert transport.named == {None}
    assert sniffio.current_async_library_cvar.get() is None


def test_run_is_typed_to_take_an_iterable_or_async_iterable_of_samples() -> None:
    hints = typing.get_type_hints(OPDStream.run)
    assert hints["samples"] == Iterable[Sample] | AsyncIterable[Sample]


async def test_an_input_that_is_not_a_sample_fails_alone_and_keeps_the_object() -> None:
    odd = {"tokens": [1, 2, 3], "response_length": 1}
    samples: list[Any] = [Sample([1, 2, 3, 4], 2), odd, Sample([5, 6, 7], 1)]
    async with OPDStream(_cfg(), transport=mock_transport(_servers())) as stream:
        async with stream.run(samples) as results:
            out = sorted([r async for r in results], key=lambda r: r.index)
    assert [type(r) for r in out] == [ScoredSample, SampleFailure, ScoredSample]
    failure = out[1]
    assert isinstance(failure, SampleFailure)
    assert failure.reason == "invalid_sample"
    assert failure.sample is odd
    assert "expected opd_stream.Sample, got dict" in failure.message


# --- 5. cancellation (Miles: reward_func calls share one stream) ---------------------------
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"debug": True})], ids=["asyncio"])
async def test_cancelling_reward_func_calls_cancels_their_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPD_STREAM_KL_DEVICE", "cpu")
    monkeypatch.setenv("OPD_STREAM_REQUEST_DEADLINE_S", "600")  # far: cancellation must act

    class _MilesSample:
        def __init__(self, i: int) -> None:
            self.tokens = [1, 2, 3, 4 + i, 5]
            self.response_length = 2
            self.metadata: dict[str, Any] = {}

    async def until(predicate: Any) -> None:
        with anyio.fail_after(30):  # generous (a busy machine): cancellation is immediate
            while not predicate():  # noqa: ASYNC110
                await anyio.sleep(0.005)

    async with serve_mock("teacher", 1, options=MockOptions(fault_hang=1.0)) as teacher:
        args = miles_args(teacher.url)
        tasks = [asyncio.create_task(miles.reward_func(args, _MilesSample(i))) for i in range(8)]
        try:
            await until(lambda: teacher.stats[0].in_flight == 8)
            engine = miles.engine_for(args)
            assert engine.stream is not None
            for task in tasks:
                task.cancel()
            await until(lambda: teacher.stats[0].disconnects == 8)
            await until(lambda: engine.stream is not None and engine.stream.stats().in_flight == 0)
            stats = engine.stream.stats()
            assert stats.endpoints[teacher.url].in_flight == 0
            assert stats.failures.get("cancelled") == 8
            for task in tasks:
                assert task.cancelled()
        finally:
            with anyio.fail_after(30):
                await miles.close()


def miles_args(url: str) -> Any:
    from argparse import Namespace

    return Namespace(use_opd=True, opd_type="sglang", rm_url=url + "/generate")
