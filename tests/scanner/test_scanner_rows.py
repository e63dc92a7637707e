"""A rollout's Python top-k rows read through the compiled scanner give what the entry-by-
entry conversion gives: the same arrays, or the same error."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import opd_stream.scanner._calls as kernels
import opd_stream.scanner._loader as jit
import opd_stream.wire._student_topk as student_topk
from opd_stream import InvalidSampleError
from opd_stream.wire._student_topk import (
    ROWS_PER_SLICE,
    RowsRead,
    joined_rows_msgpack,
    parse_student_topk,
    rows_msgpack_slices,
    rows_read_slices,
    student_topk_arrays,
)


@pytest.fixture(autouse=True, scope="module")
def _compiled() -> None:
    assert jit.prepare(), "numba could not compile the kernels"


def _outcome(rows: Any, r: int, k: int, read: RowsRead | None = None) -> Any:
    try:
        ids, lps = parse_student_topk(rows, r, k, read=read)
    except InvalidSampleError as exc:
        return ("error", str(exc))
    return ("ok", ids.tobytes(), ids.shape, lps.tobytes(), lps.shape)


def _written_in_slices(rows: Any) -> tuple[bytes | None, int]:
    """The rows' msgpack as the loop writes it, a slice at a time, and its pauses."""
    parts: list[bytes | memoryview] = []
    pauses = sum(1 for _ in rows_msgpack_slices(rows, parts))
    return joined_rows_msgpack(parts), pauses


def _read_in_slices(rows: Any, k: int) -> tuple[RowsRead | None, int]:
    """The rows as the loop reads them, a slice at a time, and its pauses."""
    read: list[RowsRead] = []
    pauses = sum(1 for _ in rows_read_slices(rows, k, read))
    return (read[0] if read else None), pauses


def _both(rows: Any, r: int, k: int) -> Any:
    """The outcome of every path, checked equal: rows read in place (whole, then a slice
    at a time first), through their msgpack (the same two ways), entry by entry."""
    fast = _outcome(rows, r, k)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(student_topk, "ENTRIES_PER_SLICE", 2 * k)  # two rows a slice
        assert _outcome(rows, r, k, _read_in_slices(rows, k)[0]) == fast
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels, "_LAYOUT", None)  # not read in place: through msgpack
        assert _outcome(rows, r, k) == fast
        m.setattr(student_topk, "ROWS_PER_SLICE", 2)  # written a slice at a time first
        assert _outcome(rows, r, k, _written_in_slices(rows)[0]) == fast
        assert _outcome(rows, r, k, _read_in_slices(rows, k)[0]) == fast
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
_IDS = (
    st.integers(0, 200_000)
    | st.integers(-(2**63), 2**63 - 1)  # every msgpack integer width, signed and unsigned
    | st.sampled_from([-1, -7, -129, 2**40, 2**63, 2**64, 3.0, False])
)
_TEXT = st.sampled_from([None, None, "", "a", "é" * 40, "x" * 300, 7, b"b"])
_ENTRY = st.builds(
    lambda lp, i, text, w: [lp, i, text][:w], _LPS, _IDS, _TEXT, st.sampled_from([2, 3, 3])
) | st.sampled_from([None, [], [-0.5], [-0.5, 1, None, 2], (-0.5, 2), {"lp": -1.0}])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), r=st.integers(0, 6), k=st.integers(1, 4))
def test_any_rows_give_the_same_arrays_or_error(data: st.DataObject, r: int, k: int) -> None:
    width = st.just(k) | st.integers(0, k + 3)
    rows = data.draw(
        st.lists(
            width.flatmap(lambda w: st.lists(_ENTRY, min_size=w, max_size=w)),
            min_size=r,
            max_size=r,
        )
    )
    _both(rows, r, k)


def _rows_read_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each call of the compiled readers: which (``place``: in place, ``msgpack``)
    and whether it took its rows (``place+``) or not (``place-``)."""
    calls: list[str] = []
    kernel = jit.compiled()
    assert kernel is not None
    in_place, from_msgpack = kernel.object_rows_read, kernel.rows_read

    def place(*args: Any) -> bool:
        took = in_place(*args)
        calls.append("place+" if took else "place-")
        return took

    def msgpack(body: bytes, r: int, k: int) -> Any:
        got = from_msgpack(body, r, k)
        calls.append("msgpack+" if got is not None else "msgpack-")
        return got

    monkeypatch.setattr(kernel, "object_rows_read", place)
    monkeypatch.setattr(kernel, "rows_read", msgpack)
    return calls


@pytest.mark.parametrize("values", ["float32", "float64"])
def test_miles_rows_take_the_reader_and_match(values: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    lps = -rng.random((300, 10)) * 9
    if values == "float32":
        lps = lps.astype(np.float32).astype(np.float64)
    rows = [
        [[float(lp), int(i), None] for lp, i in zip(lr, rng.choice(9000, 10, False), strict=True)]
        for lr in lps
    ]
    rows[3][2][0] = None  # a -inf logprob
    rows[4][1][2] = "tok"  # SGLang's text element
    rows[5][0][0] = -0.0
    calls = _rows_read_calls(monkeypatch)
    assert _both(rows, 300, 8)[0] == "ok"  # 10 entries a row, the first 8 kept
    # in place whole, then two rows a slice; then through msgpack: written whole, a
    # slice at a time, and so again by the loop's reading (not in place)
    assert calls == ["place+"] * 151 + ["msgpack+"] * 3


def test_the_reader_gives_every_logprob_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    lps = np.array([-0.0, -1e-300, -5e-324, -1.0000000000000002, -(2.0**-149), -3e38, -1e39])
    rows = [[[float(lp), n]] for n, lp in enumerate(lps)]
    calls = _rows_read_calls(monkeypatch)
    _, lp32 = parse_student_topk(rows, len(rows), 1)
    assert calls == ["place+"]
    with monkeypatch.context() as m:
        m.setattr(kernels, "_LAYOUT", None)
        _, lp32_msgpack = parse_student_topk(rows, len(rows), 1)
    assert calls == ["place+", "msgpack+"] and lp32_msgpack.tobytes() == lp32.tobytes()
    with np.errstate(over="ignore"):  # -1e39 is -inf in float32
        want = lps.astype(np.float32).reshape(-1, 1)
    assert lp32.tobytes() == want.tobytes()


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


def _array_outcome(ids: Any, lps: Any, r: int, k: int) -> Any:
    try:
        got_ids, got_lps = student_topk_arrays(ids, lps, r, k)
    except InvalidSampleError as exc:
        return ("error", str(exc))
    return ("ok", got_ids.tobytes(), got_ids.shape, got_lps.tobytes(), got_lps.dtype)


_ARRAY_IDS = st.sampled_from([0, 1, 2, 3, 70_000, 2**31 - 1, 2**31, -1, -1, -2])
_ARRAY_LPS = st.sampled_from([-0.5, -0.0, 0.0, 5e-5, 2e-4, -np.inf, np.inf, np.nan, -1e39, -3.0])


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    r=st.integers(0, 5),
    k=st.integers(1, 4) | st.just(40),
    extra=st.integers(0, 2),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_the_compiled_array_checks_match_the_vectorised_ones(
    data: st.DataObject, r: int, k: int, extra: int, dtype: Any
) -> None:
    width = k + extra
    flat_ids = data.draw(st.lists(_ARRAY_IDS, min_size=r * width, max_size=r * width))
    flat_lps = data.draw(st.lists(_ARRAY_LPS, min_size=r * width, max_size=r * width))
    ids = np.array(flat_ids, dtype=np.int64).reshape(r, width)
    with np.errstate(over="ignore"):
        lps = np.array(flat_lps, dtype=np.float64).astype(dtype).reshape(r, width)
    if data.draw(st.booleans()):  # mostly valid: distinct ids, padding at the end
        ids = np.tile(np.arange(width, dtype=np.int64), (r, 1))
        ids[:, width - data.draw(st.integers(0, width)) :] = -1
        lps = np.where(np.isnan(lps) | (lps > 0), -1.0, lps).astype(dtype)
    fast = _array_outcome(ids, lps, r, k)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jit, "_kernel", None)
        slow = _array_outcome(ids, lps, r, k)
    assert fast == slow


@pytest.mark.parametrize(
    "fault",
    [
        "none",
        "duplicate",
        "lp_nan",
        "lp_above",
        "id_above",
        "negative_id",
        "padding",
        "pad_before_id",
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_full_rows_at_a_rollouts_size_are_checked_as_the_vectorised_checks_do(
    fault: str, dtype: Any
) -> None:
    # 2048 x 16 full rows (the kernel's one-pass path when nothing is wrong), one fault
    # put at row 1500: the same float32 logprobs, or the same error naming that row
    rng = np.random.default_rng(7)
    r, k = 2048, 16
    ids = np.stack([rng.choice(150_000, size=k, replace=False) for _ in range(r)])
    lps = -rng.exponential(3.0, size=(r, k)).astype(dtype)
    row = 1500
    if fault == "duplicate":
        ids[row, 9] = ids[row, 4]
    elif fault == "lp_nan":
        lps[row, 3] = np.nan
    elif fault == "lp_above":
        lps[row, 3] = 0.5
    elif fault == "id_above":
        ids[row, 3] = student_topk.MAX_TOKEN_ID + 1
    elif fault == "negative_id":
        ids[row, 3] = student_topk.PAD_ID - 1
    elif fault in ("padding", "pad_before_id"):
        ids[row, 12:] = student_topk.PAD_ID
        lps[row, 12:] = -1.0  # (ignored: -inf under padding)
        if fault == "pad_before_id":
            ids[row, 15] = 7
    fast = _array_outcome(ids, lps, r, k)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jit, "_kernel", None)
        slow = _array_outcome(ids, lps, r, k)
    assert fast == slow
    if fault in ("none", "padding"):
        assert fast[0] == "ok"
    else:
        assert fast[0] == "error" and f"row {row} " in fast[1]


def test_an_id_beyond_int32_is_named_alike_in_both_row_paths() -> None:
    rows = [[[-0.5, 1, None], [-1.0, 2, None]], [[-0.7, 2**31, None], [-2.0, 4, None]]]
    kind, text = _both(rows, 2, 2)[:2]
    assert kind == "error" and "row 1 holds a token id above 2147483647" in text


@pytest.mark.parametrize("n", [0, 1, 15, 16, ROWS_PER_SLICE, ROWS_PER_SLICE + 1, 2048, 70_000])
def test_rows_written_a_slice_at_a_time_are_msgspecs_bytes(n: int) -> None:
    rng = np.random.default_rng(n)
    rows = [[[float(-rng.random()), int(rng.integers(0, 2**20)), None]] * 2 for _ in range(n)]
    body, pauses = _written_in_slices(rows)
    assert body == msgspec.msgpack.encode(rows)  # the array header of any length, then rows
    assert pauses == max(0, -(-n // ROWS_PER_SLICE) - 1)  # between two slices


def test_rows_msgpack_cannot_write_are_left_to_the_conversion() -> None:
    rows: list[Any] = [[[-0.5, 1]]] * (ROWS_PER_SLICE + 5)
    rows[ROWS_PER_SLICE + 2] = [[-0.5, object()]]  # in the second slice
    assert _written_in_slices(rows) == (None, 1)
    assert _written_in_slices(tuple(rows)) == (None, 0)  # not a list: not written
    with pytest.raises(InvalidSampleError, match=f"row {ROWS_PER_SLICE + 2}"):
        parse_student_topk(rows, len(rows), 1)  # the slow path names it


@pytest.mark.parametrize(
    ("n_rows", "k", "threshold", "in_thread"),
    [
        (2048, 16, 1 << 20, False),  # 512 KiB of msgpack, estimated: under the default's 1 MiB
        (4096, 16, 1 << 20, True),  # 1 MiB: from the threshold on
        (4095, 16, 1 << 20, False),
        (2048, 16, 1 << 18, True),  # offload_bytes 1 MiB: a quarter of it
        (1, 1, 0, True),  # offload_bytes 0: everything in a thread
        (0, 16, 1, False),
    ],
)
def test_python_rows_go_to_a_thread_from_their_estimated_msgpack_size(
    n_rows: int, k: int, threshold: int, in_thread: bool
) -> None:
    from opd_stream import Sample
    from opd_stream.wire._student_topk import ROW_ENTRY_BYTES, rows_convert_in_thread

    assert ROW_ENTRY_BYTES == 16
    rows = [[[-0.5, 1]] * k] * n_rows
    sample = Sample([1] * (n_rows + 1), max(n_rows, 1), student_top_logprobs=rows)
    assert rows_convert_in_thread(sample, k, threshold) is in_thread
    arrays = (np.zeros((n_rows, k), np.int64), np.zeros((n_rows, k), np.float32))
    as_arrays = Sample([1] * (n_rows + 1), max(n_rows, 1), student_top_logprobs=arrays)
    assert not rows_convert_in_thread(as_arrays, k, threshold)  # arrays stay on the loop


def test_python_rows_go_to_a_thread_from_2_15_entries_until_the_kernels_are_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the entry-by-entry conversion (~13 ms for 2048 x 16) is not done on the loop
    from opd_stream import Sample
    from opd_stream.wire._student_topk import rows_convert_in_thread

    def sample(n_rows: int) -> Sample:
        rows = [[[-0.5, 1]] * 16] * n_rows
        return Sample([1] * (n_rows + 1), n_rows, student_top_logprobs=rows)

    assert not rows_convert_in_thread(sample(2048), 16, 1 << 20)  # the kernels: on the loop
    monkeypatch.setattr(jit, "_kernel", None)
    assert rows_convert_in_thread(sample(2048), 16, 1 << 20)
    assert not rows_convert_in_thread(sample(2047), 16, 1 << 20)
    assert rows_convert_in_thread(sample(1), 16, 0)  # offload_bytes 0: a thread all the same
