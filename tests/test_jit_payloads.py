"""Per-position payloads written by the compiled kernel are the bytes msgspec writes."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import opd_stream._jit as jit
from opd_stream._payloads import build_score_payload
from opd_stream._wire import ScoreRequest


@pytest.fixture(autouse=True, scope="module")
def _compiled() -> None:
    assert jit.prepare(), "numba could not compile the kernels"


@settings(max_examples=200, deadline=None)
@given(
    ids=hnp.arrays(
        np.int64,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=9),
        elements=st.integers(0, 2**62 - 1),
    )
)
def test_id_rows_are_written_as_msgspec_writes_them(ids: np.ndarray) -> None:
    kernel = jit.compiled()
    assert kernel is not None
    assert kernel.id_rows_json(ids) == msgspec.json.encode(ids.tolist())[1:-1]


def test_a_negative_or_huge_id_is_left_to_msgspec() -> None:
    kernel = jit.compiled()
    assert kernel is not None
    assert kernel.id_rows_json(np.array([[3, -1]])) is None
    assert kernel.id_rows_json(np.array([[2**62]])) is None


@pytest.mark.parametrize(("r", "k"), [(1, 1), (7, 3), (300, 16)])
def test_per_position_payloads_are_the_same_bytes_with_and_without_the_kernel(
    r: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(r * k)
    tokens = rng.integers(0, 150_000, 11 + r, dtype=np.int64)
    ids = np.stack([rng.choice(150_000, k, replace=False) for _ in range(r)]).astype(np.int64)
    req = ScoreRequest(tokens=tokens, response_length=r, ids=ids, id_form="per-position")
    fast = build_score_payload(req)
    monkeypatch.setattr(jit, "_kernel", None)
    assert build_score_payload(req) == fast
