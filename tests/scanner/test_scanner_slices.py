"""The answer scan a slice at a time (``SlicedScan``) gives what the whole scan gives, and
pauses only where it can go on: before a value of the body, or before a row of a rows
list."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import fake_generate as wf
from support.fuzz_corpus import REQUESTS, VALID

import opd_stream.scanner._loader as jit
from opd_stream.scanner._types import Scan
from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.wire._decode_score import B64
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest, layout
from opd_stream.wire._scan_reader import _SCHEMA


@pytest.fixture(autouse=True, scope="module")
def _compiled() -> None:
    assert jit.prepare(), "numba could not compile the kernels"


def _kernel() -> Any:
    kernel = jit.compiled()
    assert kernel is not None
    return kernel


def _in_slices(body: bytes, batch: bool, nbytes: int) -> tuple[Scan, int]:
    """The scan run to its end ``nbytes`` at a time, and how many steps paused."""
    sliced = _kernel().sliced_scan(body, batch, _SCHEMA)
    pauses = 0
    while (got := sliced.step(nbytes)) is None:
        pauses += 1
    return got, pauses


def _assert_same_scan(a: Scan, b: Scan) -> None:
    assert (a.status, a.n_items) == (b.status, b.n_items)
    for name in ("records", "lps", "ids", "widths", "nulls"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
    k = _kernel()
    for key, start, end in a.records[:, [k.R_KEY, k.R_ENT0, k.R_ENT1]].tolist():
        if _SCHEMA.kinds[key] == B64:  # its bytes in raw
            assert a.raw[start:end].tobytes() == b.raw[start:end].tobytes()


def _answer(r: int, batch_blocks: int = 0) -> tuple[bytes, bool]:
    rng = np.random.default_rng(r)
    tokens = rng.integers(0, 30000, 40 + r, dtype=np.int64)
    ids = np.stack([rng.choice(150000, 5, replace=False) for _ in range(r)]).astype(np.int64)
    form = "blocked" if batch_blocks else "per-position"
    req = ScoreRequest(
        tokens=tokens, response_length=r, ids=ids, id_form=form, block_size=batch_blocks
    )
    body = InProcessSGLang("teacher", 1).handle("POST", "/generate", build_score_payload(req))
    return body.body, layout(req).batch


@pytest.mark.parametrize("blocks", [0, 7], ids=["one-answer", "a-batch"])
def test_a_scan_in_slices_pauses_between_rows_and_ends_as_the_whole_scan(blocks: int) -> None:
    body, batch = _answer(300, blocks)
    whole = _kernel().run_scan(body, batch, _SCHEMA)
    assert whole.status == _kernel().OK
    got, pauses = _in_slices(body, batch, 1)
    _assert_same_scan(whole, got)
    assert pauses >= 300  # a pause before each row of the per-position rows, at least
    got, pauses = _in_slices(body, batch, len(body) // 3)
    _assert_same_scan(whole, got)
    assert 1 <= pauses <= 3
    got, pauses = _in_slices(body, batch, len(body) + 1)
    _assert_same_scan(whole, got)
    assert pauses == 0


def test_a_rest_shorter_than_a_quarter_of_a_slice_is_read_with_the_slice_before_it() -> None:
    body, batch = _answer(300)
    whole = _kernel().run_scan(body, batch, _SCHEMA)
    got, pauses = _in_slices(body, batch, len(body) * 85 // 100)  # a rest of 15%: with it
    _assert_same_scan(whole, got)
    assert pauses == 0
    got, pauses = _in_slices(body, batch, len(body) * 75 // 100)  # a rest of 25%: its own
    _assert_same_scan(whole, got)
    assert pauses == 1


def test_a_finished_scan_gives_its_scan_again() -> None:
    body, batch = _answer(20)
    sliced = _kernel().sliced_scan(body, batch, _SCHEMA)
    while (got := sliced.step(64)) is None:
        pass
    assert sliced.step(64) is got


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(REQUESTS)),
    data=st.data(),
    nbytes=st.integers(1, 300),
)
def test_any_body_any_slices_give_the_whole_scans_outcome(
    name: str, data: st.DataObject, nbytes: int
) -> None:
    body = wf.encode(VALID[name])
    cut = data.draw(st.integers(min_value=0, max_value=len(body)))
    tail = data.draw(st.sampled_from([b"", b"]", b"}", b'"', b",[1]", b"\\u0041"]))
    body = body[:cut] + tail if data.draw(st.booleans()) else body
    batch = layout(REQUESTS[name]).batch
    whole = _kernel().run_scan(body, batch, _SCHEMA)
    got, _ = _in_slices(body, batch, nbytes)
    if whole.status == _kernel().OK:
        _assert_same_scan(whole, got)
    else:  # handed back either way (where it stopped may differ: msgspec decides then)
        assert got.status == whole.status
