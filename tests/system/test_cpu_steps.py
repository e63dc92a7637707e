"""Every CPU second of a stream is in a named step of ``stats().cpu_s``: the event loop's
own share (``loop``), the stream's set-up (``setup``), the compiled kernels made ready
(``kernels``); and ``stats().decoded_bytes`` says how much each parser read."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from functools import partial
from pathlib import Path

import anyio
import numpy as np
import pytest
from support.config import stream_config

from opd_stream import OPDStream, Sample, ScoredSample
from opd_stream._loading import import_off_loop
from opd_stream._stats import StatsRecorder
from opd_stream.scanner import _loader
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.wire._codec import PARSERS

T = "http://teacher:1"
_cfg = partial(stream_config, T)


def _samples(n: int, r: int = 64) -> list[Sample]:
    rng = np.random.default_rng(5)
    return [Sample(rng.integers(0, 5000, 16 + r).tolist(), r) for _ in range(n)]


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def test_the_loop_step_is_the_loops_cpu_beyond_the_steps_that_ran_on_it() -> None:
    cfg = _cfg(top_k=0, offload_bytes=1 << 30)  # every answer decoded on the loop
    samples = _samples(8)
    start = time.thread_time()
    async with OPDStream(cfg, transport=mock_transport({T: InProcessSGLang("teacher", 1)})) as s:
        async with s.run(samples) as results:
            out = [r async for r in results]
        _burn(0.05)  # the loop busy with something else: the loop's share too
        await anyio.to_thread.run_sync(_burn, 0.05)  # a worker thread's: not the loop's
        cpu = s.stats().cpu_s.as_dict()
    spent = time.thread_time() - start
    assert all(isinstance(r, ScoredSample) for r in out)
    on_loop = cpu["loop"] + cpu["prepare"] + cpu["build"] + cpu["decode_loop"]
    assert cpu["loop"] >= 0.05
    # the loop thread's CPU while the stream was entered, each second once: never more
    # than the thread spent, and all of it but the stream's construction and exit
    assert on_loop <= spent + 1e-3
    assert on_loop >= 0.8 * spent


async def test_steps_measured_in_a_worker_thread_are_not_taken_out_of_the_loop() -> None:
    rec = StatsRecorder()
    rec.loop_clock.start()
    _burn(0.02)
    rec.spent("build", 0.01)  # measured on the loop: out of ``loop``
    await anyio.to_thread.run_sync(rec.spent, "decode_threads", 0.5)  # in a worker thread
    cpu = rec.snapshot().cpu_s.as_dict()
    rec.loop_clock.stop()
    assert cpu["build"] == 0.01 and cpu["decode_threads"] == 0.5
    assert 0.01 <= cpu["loop"] < 0.5


async def test_the_loop_clock_stops_when_the_stream_is_left() -> None:
    transport = mock_transport({T: InProcessSGLang("teacher", 1)})
    stream = OPDStream(_cfg(), transport=transport)
    async with stream:
        pass
    before = stream.stats().cpu_s.loop
    _burn(0.03)
    assert stream.stats().cpu_s.loop == before


async def test_decoded_bytes_are_the_answer_bytes_each_parser_read() -> None:
    cfg = _cfg(top_k=0, offload_bytes=1 << 30)
    async with OPDStream(cfg, transport=mock_transport({T: InProcessSGLang("teacher", 1)})) as s:
        async with s.run(_samples(5)) as results:
            assert len([r async for r in results]) == 5
        stats = s.stats()
    decoded, decoded_bytes = stats.decoded.as_dict(), stats.decoded_bytes.as_dict()
    assert tuple(decoded_bytes) == PARSERS
    assert sum(decoded.values()) == stats.requests == 5
    assert sum(decoded_bytes.values()) == stats.bytes_received > 0
    for parser in PARSERS:
        assert (decoded[parser] > 0) is (decoded_bytes[parser] > 0)


async def test_setup_is_the_cpu_of_the_imports_in_their_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"_opd_busy_import_{threading.get_ident()}"
    (tmp_path / f"{name}.py").write_text(
        "import time\nend = time.thread_time() + 0.05\nwhile time.thread_time() < end:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    loop_before = time.thread_time()
    spent = await import_off_loop((name,))
    assert spent >= 0.05  # the importing thread's CPU
    assert time.thread_time() - loop_before < 0.05  # (not the loop's)
    assert await import_off_loop((name,)) == 0.0  # imported already: nothing to pay


def test_a_compiling_process_is_counted_in_the_kernels_cpu_once_it_ends() -> None:
    busy = textwrap.dedent(
        """
        import time
        end = time.process_time() + 0.2
        while time.process_time() < end:
            pass
        """
    )
    before = _loader.cpu_seconds()
    proc = subprocess.Popen([sys.executable, "-c", busy])
    try:
        while (code := _loader._reap(proc)) is None:
            time.sleep(0.01)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    assert code == 0 and proc.returncode == 0
    assert _loader.cpu_seconds() - before >= 0.2


async def test_the_stream_that_starts_the_kernels_counts_their_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opd_stream import _stream

    spent = [10.0]
    monkeypatch.setattr(_stream, "start_kernels", lambda: True)
    monkeypatch.setattr(_stream, "kernels_cpu", lambda: spent[0])
    transport = mock_transport({T: InProcessSGLang("teacher", 1)})
    async with OPDStream(_cfg(), transport=transport) as stream:
        spent[0] = 10.75
        assert stream.stats().cpu_s.kernels == 0.75
    monkeypatch.setattr(_stream, "start_kernels", lambda: False)  # started by another
    async with OPDStream(_cfg(), transport=transport) as other:
        spent[0] = 12.0
        assert other.stats().cpu_s.kernels == 0.0
