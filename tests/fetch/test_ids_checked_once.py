"""A sample's own top-k ids are checked once: when the sample is prepared (range, duplicates,
padding). The teacher request made from them says so (``ScoreRequest.ids_checked``), and
its layout checks their shape, not every id again. Ids from anywhere else (a server's top-k,
a union of them, a caller's own request) are checked in full.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.config import stream_config

import opd_stream.wire._request as request_mod
from opd_stream import InvalidSampleError, OPDStream, Sample, ScoredSample
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.wire._request import ScoreRequest, layout

T = "http://teacher:1"
ST = "http://student:2"
P, R, K = 6, 5, 3


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 3000, P + R).astype(np.int64)


def _ids() -> np.ndarray:
    return np.arange(R * K, dtype=np.int64).reshape(R, K) + 10


def test_an_unchecked_request_has_every_id_checked() -> None:
    ids = _ids()
    ids[2, 1] = ids[2, 0]
    with pytest.raises(InvalidSampleError, match="duplicate id in the row of response position 2"):
        layout(ScoreRequest(tokens=_tokens(), response_length=R, ids=ids))


def test_checked_ids_skip_the_id_scan_but_not_the_shape_and_type_checks() -> None:
    ids = _ids()
    ids[2, 1] = ids[2, 0]  # the flag is a promise: it is not checked again
    layout(ScoreRequest(tokens=_tokens(), response_length=R, ids=ids, ids_checked=True))
    with pytest.raises(InvalidSampleError, match="shape"):
        layout(ScoreRequest(tokens=_tokens(), response_length=R, ids=ids[:2], ids_checked=True))
    with pytest.raises(InvalidSampleError, match="integer"):
        layout(
            ScoreRequest(
                tokens=_tokens(), response_length=R, ids=ids.astype(np.float64), ids_checked=True
            )
        )


def _samples(with_topk: bool) -> list[Sample]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(3):
        kw: dict[str, Any] = {}
        if with_topk:
            ids = np.stack([rng.choice(3000, K, replace=False) for _ in range(R)]).astype(np.int64)
            ids[1, -1] = -1  # a short row's padding: filled before it is sent
            lps = np.sort(-rng.random((R, K)), axis=1)[:, ::-1].astype(np.float32)
            kw["student_top_logprobs"] = (ids, lps)
        out.append(
            Sample(
                tokens=rng.integers(0, 3000, P + R).tolist(),
                response_length=R,
                **kw,
            )
        )
    return out


async def _scan_calls(monkeypatch: pytest.MonkeyPatch, with_topk: bool) -> int:
    calls = 0
    scan = request_mod._id_fault

    def counted(ids: Any) -> str | None:
        nonlocal calls
        calls += 1
        return scan(ids)

    monkeypatch.setattr(request_mod, "_id_fault", counted)
    servers = {T: InProcessSGLang("teacher", 1), ST: InProcessSGLang("student", 2)}
    cfg = stream_config(T, student_url=ST, top_k=K, strategy="only-student")
    got: list[object] = []
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(_samples(with_topk)) as results:
            got = [r async for r in results]
    assert len(got) == 3 and all(isinstance(r, ScoredSample) for r in got)
    return calls


async def test_the_samples_own_top_k_ids_are_not_scanned_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert await _scan_calls(monkeypatch, with_topk=True) == 0


async def test_ids_from_the_students_server_are_scanned(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rollout top-k: the student server's top-k ids go to the teacher, checked there."""
    assert await _scan_calls(monkeypatch, with_topk=False) == 3
