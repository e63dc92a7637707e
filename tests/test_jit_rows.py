"""A rollout's Python top-k rows read through the compiled scanner give what the entry-by-
entry conversion gives: the same arrays, or the same error."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import opd_stream._jit as jit
from opd_stream import InvalidSampleError
from opd_stream._student_topk import parse_student_topk


@pytest.fixture(autouse=True, scope="module")
def _compiled() -> None:
    assert jit.prepare(), "numba could not compile the kernels"


def _outcome(rows: Any, r: int, k: int) -> Any:
    try:
        ids, lps = parse_student_topk(rows, r, k)
    except InvalidSampleError as exc:
        return ("error", str(exc))
    return ("ok", ids.tobytes(), ids.shape, lps.tobytes(), lps.shape)


def _both(rows: Any, r: int, k: int) -> Any:
    fast = _outcome(rows, r, k)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jit, "_kernel", None)
        slow = _outcome(rows, r, k)
    assert fast == slow
    return fast


_LPS = (
    st.floats(max_value=0.0, allow_nan=False)
    | st.floats(width=32, max_value=0.0, allow_nan=False)
    | st.sampled_from([None, -math.inf, math.inf, math.nan, 0, -3, 5e-5, 1e-3, True])
)
_IDS = st.integers(0, 200_000) | st.sampled_from([-1, -7, 2**40, 2**64, 3.0, False])
_ENTRY = st.builds(lambda lp, i, w: [lp, i, None][:w], _LPS, _IDS, st.sampled_from([2, 3, 3]))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), r=st.integers(0, 6), k=st.integers(1, 4))
def test_any_rows_give_the_same_arrays_or_error(data: st.DataObject, r: int, k: int) -> None:
    width = st.just(k) | st.integers(0, k + 1)
    rows = data.draw(
        st.lists(
            width.flatmap(lambda w: st.lists(_ENTRY, min_size=w, max_size=w)),
            min_size=r,
            max_size=r,
        )
    )
    _both(rows, r, k)


def test_miles_rows_take_the_scanner_and_match(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    rows = [
        [[float(np.float32(-rng.random() * 9)), int(i), None] for i in rng.choice(9000, 8, False)]
        for _ in range(300)
    ]
    rows[3][2][0] = None  # a -inf logprob
    calls = []
    kernel = jit.compiled()
    assert kernel is not None
    real = kernel.rows_scan
    monkeypatch.setattr(kernel, "rows_scan", lambda body: calls.append(1) or real(body))
    assert _both(rows, 300, 8)[0] == "ok"
    assert calls  # the scanner read them


@pytest.mark.parametrize(
    ("lp", "message"),
    [(math.nan, "NaN logprob"), (math.inf, "+inf logprob"), (0.5, "not a logprob")],
)
def test_a_bad_logprob_is_named_alike(
    lp: float, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [[[-0.5, 1, None], [-1.0, 2, None]], [[lp, 3, None], [-2.0, 4, None]]]
    kind, text = _both(rows, 2, 2)[:2]
    assert kind == "error" and message in text and "row 1" in text
