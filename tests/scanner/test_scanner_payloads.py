"""Per-position payloads written by the compiled kernel are the bytes msgspec writes."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import opd_stream.scanner._loader as jit
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest
from opd_stream.wire._rows_json import ids_json


@pytest.fixture(autouse=True, scope="module")
def _compiled() -> None:
    assert jit.prepare(), "numba could not compile the kernels"


@settings(max_examples=200, deadline=None)
@given(
    ids=hnp.arrays(
        np.int64,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=9),
        elements=st.integers(0, 2**62 - 1),
    ),
    empty=st.integers(0, 3),
)
def test_id_rows_are_written_as_msgspec_writes_them(ids: np.ndarray, empty: int) -> None:
    kernel = jit.compiled()
    assert kernel is not None
    want = msgspec.json.encode([[]] * empty + ids.tolist())
    assert bytes(kernel.positions_json(ids, empty)) == want


@settings(max_examples=200, deadline=None)
@given(
    ids=hnp.arrays(
        np.int64,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=9),
        elements=st.integers(0, 10**8 + 5),
    ),
)
def test_token_sized_ids_are_written_as_msgspec_writes_them(ids: np.ndarray) -> None:
    kernel = jit.compiled()
    assert kernel is not None
    assert bytes(kernel.positions_json(ids, 1)) == msgspec.json.encode([[], *ids.tolist()])


@pytest.mark.parametrize("shape", [(2048, 16), (3, 2000), (700, 3)])
def test_a_rollouts_ids_with_a_few_long_ones_are_written_as_msgspec_writes_them(
    shape: tuple[int, int],
) -> None:
    # ~1,000 ids at a time: chunks of token ids (one word each) and chunks holding an id of
    # 8 or more digits (written id by id) in one answer
    kernel = jit.compiled()
    assert kernel is not None
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 150_000, size=shape)
    assert bytes(kernel.positions_json(ids, 5)) == msgspec.json.encode([[]] * 5 + ids.tolist())
    flat = ids.reshape(-1)
    flat[flat.size // 2] = 10**7 + 3
    flat[-1] = 2**40
    assert bytes(kernel.positions_json(ids, 0)) == msgspec.json.encode(ids.tolist())
    flat[0] = -4
    assert kernel.positions_json(ids, 0) is None


def test_ids_at_every_digit_count_boundary_are_written_as_msgspec_writes_them() -> None:
    kernel = jit.compiled()
    assert kernel is not None
    edges = [v for n in range(11) for v in (10**n - 1, 10**n, 10**n + 1, 5 * 10**n)]
    ids = np.array(edges, dtype=np.int64).reshape(-1, 4)
    assert bytes(kernel.positions_json(ids, 0)) == msgspec.json.encode(ids.tolist())
    column = ids.reshape(-1, 1)  # each id last in its row, then first in the next
    assert bytes(kernel.positions_json(column, 0)) == msgspec.json.encode(column.tolist())


def test_a_negative_or_huge_id_is_left_to_msgspec() -> None:
    kernel = jit.compiled()
    assert kernel is not None
    assert kernel.positions_json(np.array([[3, -1]]), 2) is None
    assert kernel.positions_json(np.array([[2**62]]), 0) is None
    top = 2**62 - 1
    assert bytes(kernel.positions_json(np.array([[top, 0]]), 0)) == b"[[%d,0]]" % top


@settings(max_examples=200, deadline=None)
@given(
    tokens=hnp.arrays(
        st.sampled_from([np.int64, np.int32, np.uint64]),
        hnp.array_shapes(min_dims=1, max_dims=1, min_side=0, max_side=40),
    )
)
def test_a_requests_input_ids_are_written_as_msgspec_writes_them(tokens: np.ndarray) -> None:
    # (negative ids, ids from 2^62 and uint64 beyond int64 are left to msgspec)
    assert bytes(ids_json(tokens)) == msgspec.json.encode(tokens.tolist())


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


@settings(max_examples=300, deadline=None)
@given(
    ids=hnp.arrays(
        st.sampled_from([np.int64, np.uint64, np.uint32]),
        st.tuples(st.integers(1, 6), st.sampled_from([1, 2, 5, 33, 40])),
        elements=st.integers(0, 6) | st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]),
    )
    | hnp.arrays(
        np.int64, st.tuples(st.integers(1, 4), st.integers(1, 5)), elements=st.integers(-3, 6)
    ),
)
def test_a_request_id_fault_is_found_alike_with_and_without_the_kernel(ids: np.ndarray) -> None:
    from opd_stream.wire._request import _id_fault

    fast = _id_fault(ids)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jit, "_kernel", None)
        assert _id_fault(ids) == fast
    values = ids.astype(object)
    rows = [r for r in range(ids.shape[0]) if len(set(values[r].tolist())) < ids.shape[1]]
    if any(not 0 <= v < 2**31 for v in values.flat):
        assert fast == "an id is outside [0, 2147483648)"
    elif rows:
        assert fast == f"duplicate id in the row of response position {rows[0]}"
    else:
        assert fast is None
