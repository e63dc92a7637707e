"""``spread``: ``np.repeat`` without holding the GIL for long results, the same values."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_stream.wire._checks import spread


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 3000), width=st.integers(0, 60), seed=st.integers(0, 2**32 - 1))
def test_spread_is_np_repeat(n: int, width: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.integers(-(2**40), 2**40, n)
    counts = rng.integers(0, width + 1, n)
    assert np.array_equal(spread(values, counts), np.repeat(values, counts))
