"""The KL stage runs torch's ops on one intra-op thread in its own thread only (its many
short ops otherwise wake torch's OpenMP pool, whose waiting costs ~20x the work on CPU),
and leaves every thread's setting as it was."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial

import numpy as np
import pytest
import torch
from support.config import stream_config

from opd_stream import OPDStream, Sample, ScoredSample, _scoring
from opd_stream.kl import _threads
from opd_stream.kl._threads import one_intraop_thread
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

T, S = "http://teacher:1", "http://student:2"


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch set to two intra-op threads (the default on a 2-core machine), as it was after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    if _threads._openmp() is None:
        torch.set_num_threads(before)
        pytest.skip("torch has no OpenMP runtime here")
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _in_a_thread(fn: partial[int] | object) -> object:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()))  # type: ignore[operator]
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.usefixtures("two_threads")
def test_the_function_sees_one_thread_and_the_thread_its_setting_again() -> None:
    def run() -> tuple[int, int]:
        inside = one_intraop_thread(torch.get_num_threads)
        return inside, torch.get_num_threads()

    assert _in_a_thread(run) == (1, 2)
    assert torch.get_num_threads() == 2  # nor is any other thread's changed


@pytest.mark.usefixtures("two_threads")
def test_another_thread_keeps_its_threads_meanwhile() -> None:
    inside, seen = threading.Event(), []

    def hold() -> int:
        inside.set()
        done.wait(10)
        return torch.get_num_threads()

    done = threading.Event()
    worker = threading.Thread(target=lambda: seen.append(one_intraop_thread(hold)))
    worker.start()
    assert inside.wait(10)
    other = _in_a_thread(torch.get_num_threads)
    done.set()
    worker.join()
    assert seen == [1] and other == 2


@pytest.mark.usefixtures("two_threads")
def test_an_error_in_the_function_still_gives_the_setting_back() -> None:
    def run() -> int:
        with pytest.raises(ZeroDivisionError):
            one_intraop_thread(lambda: 1 // 0)
        return torch.get_num_threads()

    assert _in_a_thread(run) == 2


@pytest.mark.usefixtures("two_threads")
async def test_the_kl_stage_scores_on_one_intraop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    score = _scoring.score_batch

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return score(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_scoring, "score_batch", recording)
    rng = np.random.default_rng(2)
    samples = [Sample(rng.integers(0, 5000, 40).tolist(), 24) for _ in range(3)]
    cfg = stream_config(T, student_url=S, top_k=4, strategy="union")
    servers = {T: InProcessSGLang("teacher", 1), S: InProcessSGLang("student", 1)}
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
    assert all(isinstance(r, ScoredSample) for r in out)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
