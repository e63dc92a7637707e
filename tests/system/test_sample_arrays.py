"""The array form of ``Sample.student_top_logprobs``: ``(ids [R, >=k], logprobs [R, >=k])``."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from support.config import stream_config

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

T = "http://teacher:1"
K = 3
R = 4
TOKENS = [11, 12, 13, 14, 15, 16, 17]


_cfg = partial(stream_config, T, top_k=K)


def _arrays() -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([[5, 9, 2, 7], [1, 2, 3, 4], [8, 6, 4, 2], [10, 20, 30, 40]])
    lps = np.log(np.array([[0.5, 0.2, 0.1, 0.05]] * R))
    return ids, lps.astype(np.float32)


async def _score(samples: list[Sample]) -> list[Any]:
    servers = {T: InProcessSGLang("teacher", 2)}
    async with OPDStream(_cfg(), transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            return sorted([r async for r in results], key=lambda r: r.index)


async def test_arrays_and_rows_give_identical_results() -> None:
    ids, lps = _arrays()
    rows = [
        [[float(lp), int(i)] for lp, i in zip(lr, ir, strict=True)]
        for lr, ir in zip(lps.tolist(), ids.tolist(), strict=True)
    ]
    out = await _score(
        [
            Sample(TOKENS, R, student_top_logprobs=rows),
            Sample(TOKENS, R, student_top_logprobs=(ids, lps)),
            Sample(TOKENS, R, student_top_logprobs=(torch.from_numpy(ids), torch.from_numpy(lps))),
        ]
    )
    assert all(isinstance(r, ScoredSample) for r in out)
    ref = out[0]
    for other in out[1:]:
        assert ref.reverse_kl is not None and other.reverse_kl is not None
        assert torch.equal(ref.reverse_kl, other.reverse_kl)
        assert ref.candidates is not None and other.candidates is not None
        assert torch.equal(ref.candidates.ids, other.candidates.ids)


def _bad(mutate: Any) -> tuple[Any, Any]:
    ids, lps = _arrays()
    return mutate(ids.copy(), lps.copy())


def _set(arr: np.ndarray, value: Any) -> np.ndarray:
    arr[2, 1] = value
    return arr


@pytest.mark.parametrize(
    ("pair", "words"),
    [
        pytest.param(_bad(lambda i, p: (i.astype(np.float64), p)), "integer", id="float-ids"),
        pytest.param(_bad(lambda i, p: (i, p.astype(np.int64))), "float", id="int-logprobs"),
        pytest.param(_bad(lambda i, p: (i[:3], p[:3])), "shape", id="row-count"),
        pytest.param(_bad(lambda i, p: (i[:, :2], p[:, :2])), "shape", id="too-narrow"),
        pytest.param(_bad(lambda i, p: (i, p[:, :3])), "shape", id="shapes-differ"),
        pytest.param(_bad(lambda i, p: (_set(i, -2), p)), "row 2 holds a negative", id="neg-id"),
        pytest.param(
            _bad(lambda i, p: (_set(i, -1), p)), "row 2 holds padding (id -1) before", id="mid-pad"
        ),
        pytest.param(
            _bad(lambda i, p: (_set(i, 2**40), p)), "row 2 holds a token id above", id="huge-id"
        ),
        pytest.param(_bad(lambda i, p: (i, _set(p, np.nan))), "row 2 holds a NaN", id="nan"),
        pytest.param(_bad(lambda i, p: (i, _set(p, np.inf))), "row 2 holds a +inf", id="inf"),
        pytest.param(
            _bad(lambda i, p: (i, _set(p, 0.5))), "row 2 holds a value > 0", id="positive"
        ),
        pytest.param(_bad(lambda i, p: (_set(i, 8), p)), "row 2 holds a duplicate", id="dup"),
    ],
)
async def test_bad_arrays_fail_the_sample_naming_the_field(pair: Any, words: str) -> None:
    out = await _score(
        [
            Sample(TOKENS, R, student_top_logprobs=pair),
            Sample(TOKENS, R, student_top_logprobs=_arrays()),
        ]
    )
    failure = out[0]
    assert isinstance(failure, SampleFailure)
    assert failure.reason == "invalid_sample"
    assert failure.message.startswith("student_top_logprobs:")
    assert words in failure.message
    assert isinstance(out[1], ScoredSample)  # the bad sample failed alone


async def test_minus_inf_logprobs_are_allowed_in_arrays() -> None:
    ids, lps = _arrays()
    lps[1, 2] = -np.inf
    out = await _score([Sample(TOKENS, R, student_top_logprobs=(ids, lps))])
    assert isinstance(out[0], ScoredSample)
    assert out[0].reverse_kl is not None and torch.isfinite(out[0].reverse_kl).all()


async def test_missing_student_topk_without_a_student_server_fails_that_sample_alone() -> None:
    out = await _score([Sample(TOKENS, R), Sample(TOKENS, R, student_top_logprobs=_arrays())])
    assert isinstance(out[0], SampleFailure)
    assert out[0].reason == "invalid_sample"
    assert out[0].message.startswith("student_top_logprobs: required")
    assert "student_url" in out[0].message
    assert isinstance(out[1], ScoredSample)
