"""Python top-k rows read in place (CPython's own objects followed) give what their
msgpack read back gives, bit for bit, and take nothing the msgpack reader refuses; where
the interpreter is not one whose objects are known, nothing is read in place."""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import opd_stream.scanner._calls as kernels
import opd_stream.scanner._layout as layout
import opd_stream.scanner._loader as jit
import opd_stream.wire._student_topk as student_topk
from opd_stream import InvalidSampleError
from opd_stream.scanner._objects import read_object_rows
from opd_stream.wire._student_topk import RowsRead, parse_student_topk, rows_read_slices


@pytest.fixture(autouse=True, scope="module")
def _compiled() -> None:
    assert jit.prepare(), "numba could not compile the kernels"
    assert kernels.objects_readable(), "this CPython's objects should be read in place"


def _in_place(rows: Any, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    n = len(rows) * k
    lps, ids = np.full(n, 7.0), np.full(n, 7, dtype=np.int64)
    return (lps, ids) if kernels.object_rows_read(rows, 0, len(rows), k, lps, ids) else None


def _from_msgpack(rows: Any, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        body = msgspec.msgpack.encode(rows)
    except (TypeError, ValueError, OverflowError):
        return None
    return kernels.rows_read(body, len(rows), k)


def _same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return a[0].view(np.uint64).tolist() == b[0].view(np.uint64).tolist() and (
        a[1].tolist() == b[1].tolist()
    )


_LPS = (
    st.floats(max_value=0.0)
    | st.floats()
    | st.integers(-(2**62), 2**62)
    | st.sampled_from([None, -0.0, math.nan, -math.inf, 0, -(2**53), 2**53, 2**53 + 1, True])
    | st.sampled_from([np.float64(-0.5), "x"])
)
_IDS = (
    st.integers(0, 200_000)
    | st.integers(-(2**64), 2**64)
    | st.sampled_from([0, 2**30 - 1, 2**30, 2**60 - 1, 2**60, -1, -(2**30), False, 3.0])
)
_TEXT = st.sampled_from([None, "", "é" * 40, b"b", 7])
_ENTRY = st.builds(
    lambda lp, i, text, w, form: form([lp, i, text][:w]),
    _LPS,
    _IDS,
    _TEXT,
    st.sampled_from([2, 3]),
    st.sampled_from([list, tuple]),
) | st.sampled_from([None, [], [-0.5], [-0.5, 1, None, 2], {"lp": -1.0}])


@settings(max_examples=400, deadline=None)
@given(data=st.data(), r=st.integers(0, 5), k=st.integers(0, 4))
def test_what_is_read_in_place_is_what_msgpack_gives_bit_for_bit(
    data: st.DataObject, r: int, k: int
) -> None:
    width = st.just(k) | st.integers(0, k + 3)
    rows = data.draw(
        st.lists(
            width.flatmap(
                lambda w: (
                    st.lists(_ENTRY, min_size=w, max_size=w)
                    | st.lists(_ENTRY, min_size=w, max_size=w).map(tuple)
                )
            ),
            min_size=r,
            max_size=r,
        )
    )
    got = _in_place(rows, k)
    if got is not None:  # taken in place: msgpack takes it too, the same bits
        want = _from_msgpack(rows, k)
        assert want is not None and _same(got, want)


def test_every_form_of_entry_is_read_in_place() -> None:
    rows = [
        [[-0.5, 0, None], (-0.0, 2**30 - 1, "tok"), [None, 2**30], (0, 2**60 - 1)],
        ([math.nan, 1], [-math.inf, 2, ""], [-(2**53), 3], [-(2**30), 4]),
        [[math.inf, 5], [-5e-324, 6], [2**53, 7], [-1, 8, None]],
    ]
    got = _in_place(rows, 4)
    want = _from_msgpack(rows, 4)
    assert got is not None and want is not None and _same(got, want)
    assert got[1].tolist() == [0, 2**30 - 1, 2**30, 2**60 - 1, 1, 2, 3, 4, 5, 6, 7, 8]


class _Id(enum.IntEnum):
    ONE = 1


class _Row(list[Any]):
    pass


@pytest.mark.parametrize(
    ("rows", "because"),
    [
        ([[[-0.5, True]]], "a bool id"),
        ([[[-0.5, _Id.ONE]]], "an int subclass"),
        ([[[np.float64(-0.5), 1]]], "a float subclass"),
        ([_Row([[-0.5, 1]])], "a list subclass"),
        ([[[-0.5, -1]]], "a negative id among those kept"),
        ([[[-0.5, 2**60]]], "an id of three digits"),
        ([[[-(2**53) - 1, 1]]], "an integer logprob beyond 2^53"),
        ([[[-0.5, 1.0]]], "a float id"),
        ([[[-0.5, 1, b"x"]]], "bytes text"),
        ([[[-0.5, 1, None, None]]], "an entry of four"),
        ([[[-0.5]]], "an entry of one"),
        ([[None]], "a None entry"),
        ([[{"lp": -0.5}]], "a dict entry"),
        ([[]], "a short row"),
        ([[[-0.5, 1], [-1.0, 2, 3]]], "an int text beyond k"),
    ],
)
def test_anything_unusual_is_not_read_in_place(rows: Any, because: str) -> None:
    assert _in_place(rows, 1) is None, because


def test_an_entry_beyond_k_may_hold_a_negative_id() -> None:
    rows = [[[-0.5, 1], [-1.0, -5]]]
    got = _in_place(rows, 1)
    assert got is not None and got[1].tolist() == [1]


@pytest.mark.parametrize(
    "rows",
    [
        [[[np.float64(-0.5), 1]], [[-0.7, 2]]],  # a float subclass: msgpack writes it
        [[[-0.5, 2**60]], [[-0.7, 2]]],  # an id msgpack takes (then refused, named)
        (([-0.5, 1],), ([-0.7, 2],)),  # rows in a tuple: not read in place
    ],
)
def test_rows_not_read_in_place_give_the_entry_paths_outcome(
    rows: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def outcome() -> Any:
        try:
            ids, lps = parse_student_topk(rows, len(rows), 1)
        except InvalidSampleError as exc:
            return str(exc)
        return ids.tolist(), lps.tobytes()

    fast = outcome()
    monkeypatch.setattr(jit, "_kernel", None)
    assert outcome() == fast


def test_rows_past_the_lists_end_are_not_read() -> None:
    rows = [[[-0.5, 1]], [[-0.7, 2]]]
    lps, ids = np.zeros(2), np.zeros(2, dtype=np.int64)
    assert kernels.object_rows_read(rows, 1, 99, 1, lps, ids)  # (stop cut to the end)
    assert ids.tolist() == [0, 2]
    # the kernel itself refuses a stop past the list's size, and a start past its stop
    table = kernels._LAYOUT
    assert table is not None
    bits = lps.view(np.uint64)
    assert not read_object_rows(id(rows), 0, 3, 1, lps, bits, ids, table)
    assert not read_object_rows(id(rows), 2, 1, 1, lps, bits, ids, table)
    assert not read_object_rows(id((1, 2)), 0, 1, 1, lps, bits, ids, table)  # not a list


def test_the_buffers_must_fit_the_rows() -> None:
    rows = [[[-0.5, 1]], [[-0.7, 2]]]
    with pytest.raises(ValueError, match=r"float64 and int64 \[2\]"):
        kernels.object_rows_read(rows, 0, 2, 1, np.zeros(1), np.zeros(1, dtype=np.int64))
    with pytest.raises(ValueError, match="float64 and int64"):
        kernels.object_rows_read(rows, 0, 2, 1, np.zeros(2, np.float32), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.object_rows_read(rows, 0, 2, 1, np.zeros(4)[::2], np.zeros(2, dtype=np.int64))


def test_the_reader_keeps_the_gil() -> None:
    # no other thread may change the objects while they are read: the kernel is compiled
    # without nogil (every other kernel releases it)
    assert not read_object_rows.targetoptions.get("nogil", False)


def test_rows_shortened_between_two_slices_are_written_as_msgpack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(student_topk, "ENTRIES_PER_SLICE", 2)  # two rows a slice
    rows = [[[-0.1 * n, n]] for n in range(1, 7)]
    read: list[RowsRead] = []
    slices = rows_read_slices(rows, 1, read)
    next(slices)
    del rows[3:]  # the host took rows away at the pause
    for _ in slices:
        pass
    assert read == [msgspec.msgpack.encode(rows)]


@pytest.mark.parametrize(
    "change",
    ["unknown version", "free-threaded", "another header", "PyPy"],
)
def test_an_interpreter_not_known_reads_nothing_in_place(
    change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert layout.known_layout() is not None
    if change == "unknown version":
        monkeypatch.setattr(layout, "_VERSIONS", ())
    elif change == "free-threaded":
        monkeypatch.setattr(layout.sysconfig, "get_config_var", lambda name: 1)
    elif change == "another header":
        monkeypatch.setattr(layout.sys, "maxsize", 2**31 - 1)
    else:
        monkeypatch.setattr(layout.sys, "implementation", type("I", (), {"name": "pypy"}))
    assert layout.known_layout() is None


def test_a_difference_on_the_known_rows_turns_reading_in_place_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels, "_LAYOUT", kernels._LAYOUT)  # (set back afterwards)
    kernels._check_layout()
    assert kernels.objects_readable()  # the known rows read as they should
    monkeypatch.setattr(kernels, "_CHECK_IDS", (*kernels._CHECK_IDS[:-1], 5))
    kernels._check_layout()
    assert not kernels.objects_readable()
    one = np.zeros(1, dtype=np.int64)
    assert not kernels.object_rows_read([[[-0.5, 1]]], 0, 1, 1, np.zeros(1), one)
