"""The compiled kernels as typed calls (:func:`opd_stream.scanner._loader.compiled` gives this
module,
as :class:`opd_stream.scanner._types.Kernels`, which mypy checks it against): buffers sized for any
input, the kernels' constants, and :func:`warm`, which compiles every kernel with the
argument types it is always called with.

Importing it imports numba and compiles (or loads from numba's cache): only
:func:`opd_stream.scanner._loader.prepare` does, in a worker thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._checks import FAULTS, pick_id_rows, request_id_fault, topk_faults
from ._ids import _write_positions, positions_json
from ._layout import known_layout
from ._lists import read_ids, read_logprobs
from ._objects import read_object_rows
from ._rows import read_rows
from ._scan import (
    B64,
    ENTRIES,
    MAX_DEPTH,
    OK,
    PAUSED,
    R_END,
    R_ENT0,
    R_ENT1,
    R_ITEM,
    R_KEY,
    R_ROW0,
    R_ROW1,
    R_START,
    ROWS,
    S_I,
    S_SIZE,
    UNUSUAL,
    scan,
)
from ._types import Body, Scan, ScanSchema, scan_schema

__all__ = (
    "OK",
    "R_END",
    "R_ENT0",
    "R_ENT1",
    "R_ITEM",
    "R_KEY",
    "R_ROW0",
    "R_ROW1",
    "R_START",
    "KERNELS",
    "SlicedScan",
    "sliced_scan",
    "UNUSUAL",
    "id_fault",
    "ids_read",
    "logprobs_read",
    "object_rows_read",
    "objects_readable",
    "pick_rows",
    "positions_json",
    "rows_read",
    "topk_check",
    "run_scan",
    "scan_buffers",
    "warm",
)


#: The kernels called from Python, each compiled (and cached) for the argument types of
#: :func:`warm`: when numba's cache holds them all, a process loads rather than compiles
#: (:mod:`opd_stream.scanner._loader`).
KERNELS = (
    scan,
    read_rows,
    read_object_rows,
    read_ids,
    read_logprobs,
    _write_positions,
    request_id_fault,
    pick_id_rows,
    topk_faults,
)


def rows_read(
    body: bytes, r: int, k: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]] | None:
    """The msgpack of a rollout's ``r`` Python top-k rows into ``(lps float64 [r * k],
    ids int64 [r * k])``, each row's first ``k`` entries (a ``nil`` logprob is ``-inf``),
    or ``None`` for anything :func:`opd_stream.scanner._rows.read_rows` does not take (a
    negative id among them included)."""
    b = np.frombuffer(body, dtype=np.uint8)
    lps = np.empty(r * k, dtype=np.float64)
    ids = np.empty(r * k, dtype=np.int64)
    if not read_rows(b, r, k, lps, lps.view(np.uint64), ids):
        return None
    return lps, ids


#: This interpreter's layout array (:mod:`opd_stream.scanner._layout`), ``None`` where the
#: rows are not read in place: an interpreter not known there, or :func:`warm`'s reading
#: of known rows found a difference.
_LAYOUT = known_layout()


def objects_readable() -> bool:
    """Whether :func:`object_rows_read` reads rows here (else it always answers False)."""
    return _LAYOUT is not None


def object_rows_read(
    rows: list[Any],
    start: int,
    stop: int,
    k: int,
    lps: npt.NDArray[np.float64],
    ids: npt.NDArray[np.int64],
) -> bool:
    """Rows ``start`` to ``stop`` of a rollout's Python top-k rows (a list) read in place
    (:func:`opd_stream.scanner._objects.read_object_rows`, the GIL held) into ``lps``
    (float64) and ``ids`` (int64), each ``[len(rows) * k]``, from ``start * k``: whether
    it took them (a ``nil`` logprob is ``-inf``). False for anything unusual, a negative
    id among the first ``k`` of a row included, and where rows are not read in place."""
    layout = _LAYOUT
    if layout is None or type(rows) is not list:
        return False
    size = len(rows) * k
    if not (
        lps.dtype == np.float64 and ids.dtype == np.int64 and lps.shape == ids.shape == (size,)
    ):
        raise ValueError(f"object_rows_read: lps and ids must be float64 and int64 [{size}]")
    if not (lps.flags.c_contiguous and ids.flags.c_contiguous):
        raise ValueError("object_rows_read: lps and ids must be contiguous")
    start, stop = max(0, start), min(stop, len(rows))
    return bool(read_object_rows(id(rows), start, stop, k, lps, lps.view(np.uint64), ids, layout))


def ids_read(body: bytes, n: int, max_id: int) -> npt.NDArray[np.int64] | None:
    """The msgpack of a list of ``n`` token ids as int64 ``[n]``, or ``None`` for anything
    :func:`opd_stream.scanner._lists.read_ids` does not take (an id outside ``[0,
    max_id]`` included)."""
    out = np.empty(n, dtype=np.int64)
    return out if read_ids(np.frombuffer(body, dtype=np.uint8), out, max_id) else None


def logprobs_read(body: bytes, n: int, tolerance: float) -> npt.NDArray[np.float64] | None:
    """The msgpack of a list of ``n`` logprobs as float64 ``[n]``, or ``None`` for anything
    :func:`opd_stream.scanner._lists.read_logprobs` does not take (a value that is not a
    finite float at most ``tolerance`` included)."""
    out = np.empty(n, dtype=np.float64)
    b = np.frombuffer(body, dtype=np.uint8)
    return out if read_logprobs(b, out, out.view(np.uint64), tolerance) else None


def topk_check(
    ids: npt.NDArray[np.int64],
    lps: npt.NDArray[np.floating[Any]],
    pad_id: int,
    max_id: int,
    tolerance: float,
) -> tuple[npt.NDArray[np.float32], dict[str, int]]:
    """A student top-k's checks in one compiled pass (:func:`opd_stream.scanner._checks.
    topk_faults`): ``(logprobs as float32 [R, k], {fault: first row})``, the faults
    named as in :data:`opd_stream.scanner._checks.FAULTS`, only those found."""
    ids, lps = np.ascontiguousarray(ids), np.ascontiguousarray(lps)  # (as they come, mostly)
    out = np.empty(ids.shape, dtype=np.float32)
    first = topk_faults(ids, lps, pad_id, max_id, tolerance, out)
    return out, {name: int(row) for name, row in zip(FAULTS, first, strict=True) if row >= 0}


def id_fault(ids: npt.NDArray[np.int64], max_id: int) -> tuple[int, int]:
    """A request's ids (int64 ``[R, k]``, contiguous) checked in one pass
    (:func:`opd_stream.scanner._checks.request_id_fault`): ``(1, -1)`` for an id outside
    ``[0, max_id)``, ``(2, row)`` for the first row holding an id twice, else ``(0, -1)``."""
    fault, row = request_id_fault(ids, max_id)
    return int(fault), int(row)


def pick_rows(
    e_ids: npt.NDArray[np.int64],
    e_lps: npt.NDArray[np.float64],
    entry_off: npt.NDArray[np.intp],
    row_width: npt.NDArray[np.intp],
    row_null: npt.NDArray[np.bool_],
    first_row: int,
    expect: npt.NDArray[np.int64],
    out: npt.NDArray[np.float32],
) -> tuple[bool, float]:
    """One answer's per-position id rows checked and picked into ``out``
    (:func:`opd_stream.scanner._checks.pick_id_rows`): ``(ok, largest logprob)``."""
    ok, top = pick_id_rows(e_ids, e_lps, entry_off, row_width, row_null, first_row, expect, out)
    return bool(ok), float(top)


def run_scan(body: Body, batch: bool, schema: ScanSchema) -> Scan:
    """:func:`scan` over ``body`` (:func:`scan_buffers`), its buffers cut to what it
    wrote."""
    got, lps, ids, widths, nulls, raw, records = scan_buffers(body, batch, schema)
    return _cut(got, lps, ids, widths, nulls, raw, records)


def _cut(got: Any, lps: Any, ids: Any, widths: Any, nulls: Any, raw: Any, records: Any) -> Scan:
    status, n_rec, n_items, n_ent, n_rows = got
    return Scan(
        int(status),
        int(n_items),
        records[:n_rec],
        lps[:n_ent],
        ids[:n_ent],
        widths[:n_rows],
        nulls[:n_rows],
        raw,
    )


def scan_buffers(body: Body, batch: bool, schema: ScanSchema) -> tuple[Any, ...]:
    """:func:`scan` over ``body`` with buffers big enough for any body of its size:
    ``((status, n_records, n_items, n_entries, n_rows), lps, ids, widths, nulls, raw,
    records)``, the buffers whole. Allocated with ``np.empty``: pages a scan does not touch
    cost nothing."""
    run = _Buffers(body, batch, schema)
    got = run.scan_to(len(body) + 1)
    return got, run.lps, run.ids, run.widths, run.nulls, run.raw, run.records


class _Buffers:
    """One scan's input, output buffers and saved state."""

    __slots__ = ("args", "b", "batch", "ids", "lps", "nulls", "raw", "records", "state", "widths")

    def __init__(self, body: Body, batch: bool, schema: ScanSchema) -> None:
        n = len(body)
        b = np.frombuffer(body, dtype=np.uint8)
        if b.flags.writeable:  # one compiled variant: read-only bytes
            b = b.view()
            b.flags.writeable = False
        entries = n // 6 + 1  # the shortest entry, "[0,0]," is 6 bytes
        rows = n // 3 + 1  # the shortest row, "[],", 3
        self.b, self.batch = b, batch
        self.lps = np.empty(entries, dtype=np.float64)
        self.ids = np.empty(entries, dtype=np.int64)
        self.widths = np.empty(rows, dtype=np.int32)
        self.nulls = np.empty(rows, dtype=np.uint8)
        self.raw = np.empty(n * 3 // 4 + 4, dtype=np.uint8)
        self.records = np.empty((n // 8 + 8, 8), dtype=np.int64)
        self.state = np.zeros(S_SIZE, dtype=np.int64)
        self.args = (
            schema.key_bytes,
            schema.key_starts,
            schema.kind_codes,
            schema.envelope_bytes,
            self.lps,
            self.ids,
            self.widths,
            self.nulls,
            self.raw,
            self.records,
            np.empty(MAX_DEPTH + 1, dtype=np.uint8),
            np.empty(schema.kind_codes.shape[0], dtype=np.int64),
            self.state,
        )

    def scan_to(self, stop: int) -> Any:
        return scan(self.b, self.batch, *self.args, stop)


def sliced_scan(body: Body, batch: bool, schema: ScanSchema) -> SlicedScan:
    """A :class:`SlicedScan` of ``body``: :func:`run_scan` a slice at a time."""
    return SlicedScan(body, batch, schema)


class SlicedScan:
    """:func:`run_scan` in slices, for a caller that wants its thread back between them
    (the event loop): each :meth:`step` scans about ``nbytes`` more of the body (from one
    value of the body, or one row of a rows list, to the first that starts ``nbytes``
    later; a value of another kind is scanned whole), the GIL released meanwhile."""

    __slots__ = ("_done", "_run")

    def __init__(self, body: Body, batch: bool, schema: ScanSchema) -> None:
        self._run = _Buffers(body, batch, schema)
        self._done: Scan | None = None

    def step(self, nbytes: int) -> Scan | None:
        """Scan on for ``nbytes`` (at least 1; a rest of the body shorter than a quarter of
        it with them): the :class:`Scan` once the scan has ended (as :func:`run_scan` gives
        it), else ``None``."""
        if self._done is None:
            run = self._run
            stop = int(run.state[S_I]) + max(nbytes, 1)
            if len(run.b) - stop < nbytes // 4:
                stop = len(run.b) + 1  # (a last slice of a few rows costs a turn of its own)
            got = run.scan_to(stop)
            if got[0] != PAUSED:
                self._done = _cut(
                    got, run.lps, run.ids, run.widths, run.nulls, run.raw, run.records
                )
        return self._done


#: A tiny answer that makes numba compile every path of the scan once, with a schema of
#: each kind (compiling depends on the arguments' types only).
_WARM_SCHEMA = scan_schema(
    (
        ("input_token_logprobs", ENTRIES),
        ("input_token_ids_logprobs", ROWS),
        ("input_top_logprobs", ROWS),
        ("output_token_ids_logprobs", ROWS),
        ("input_top_logprobs_val_flat_b64", B64),
        ("input_top_logprobs_idx_flat_b64", B64),
    ),
    "meta_info",
)
_WARM_BODY = (
    b'{"text":"","meta_info":{"finish_reason":{"type":"length"},"input_token_logprobs":'
    b'[[null,1,null],[-0.5,2]],"input_token_ids_logprobs":[null,[[-1.25e-3,3,null]]],'
    b'"input_top_logprobs":[null,[]],"output_token_ids_logprobs":[[[-2.0,4]]],'
    b'"input_top_logprobs_val_flat_b64":"AAAAAA==","input_top_logprobs_idx_flat_b64":"AQID"}}'
)


#: Two rows in every form :func:`rows_read` takes (msgspec.msgpack of
#: ``[[[-0.5, 1, None], [None, -2, "a"]], [[0, 2**40]]]``, written out so that warming
#: needs no msgspec).
_WARM_ROWS = bytes.fromhex("929293cbbfe000000000000001c093c0fea161919200cf0000010000000000")

#: msgspec.msgpack of ``[1, 200, 300, 2**31]`` (every form :func:`ids_read` takes) and
#: of ``[-0.5]``.
_WARM_IDS = bytes.fromhex("9401ccc8cd012cce80000000")
_WARM_LOGPROBS = bytes.fromhex("91cbbfe0000000000000")


#: Rows in every form :func:`object_rows_read` takes (``k = 2``: the third row's third
#: entry, beyond ``k``, may hold a negative id), and what it must read from them: where
#: reading them gives anything else, rows are not read in place in this process.
_CHECK_ROWS = [
    [[-0.5, 1, None], (-0.0, 2**30, "a")],
    ([None, 2**40 + 5], [float("nan"), 0]),
    [(3, 7), [-(2**53), 2**60 - 1], [float("inf"), -5, "b"]],
]
_CHECK_LPS = (-0.5, -0.0, -np.inf, np.nan, 3.0, -(2.0**53))
_CHECK_IDS = (1, 2**30, 2**40 + 5, 0, 7, 2**60 - 1)
#: Rows it must not take: a bool id, a negative id kept, an id of three digits, a float
#: subclass, a short row, an entry of 4.
_CHECK_REFUSED = (
    [[[-0.5, True], [-1.0, 2]]],
    [[[-0.5, -1], [-1.0, 2]]],
    [[[-0.5, 2**60], [-1.0, 2]]],
    [[[np.float64(-0.5), 1], [-1.0, 2]]],
    [[[-0.5, 1]]],
    [[[-0.5, 1, None, None], [-1.0, 2]]],
)


def _check_layout() -> None:
    """Read :data:`_CHECK_ROWS` in place and compare; on any difference, read no rows in
    place in this process."""
    global _LAYOUT
    if _LAYOUT is None:
        return
    lps, ids = np.empty(6), np.empty(6, dtype=np.int64)
    took = object_rows_read(_CHECK_ROWS, 0, 3, 2, lps, ids)
    want = np.array(_CHECK_LPS).view(np.uint64)
    read = took and np.array_equal(lps.view(np.uint64), want) and ids.tolist() == [*_CHECK_IDS]
    for rows in _CHECK_REFUSED:
        size = 2 * len(rows)
        read = read and not object_rows_read(
            rows, 0, len(rows), 2, np.empty(size), np.empty(size, dtype=np.int64)
        )
    if not read:
        _LAYOUT = None


def warm() -> None:
    """Compile (or load from numba's cache) every kernel, with the argument types they
    are always called with, and check the in-place reading of rows."""
    run_scan(_WARM_BODY, False, _WARM_SCHEMA)
    run_scan(bytearray(b"[" + _WARM_BODY + b"]"), True, _WARM_SCHEMA)
    rows_read(_WARM_ROWS, 2, 1)
    _check_layout()
    ids_read(_WARM_IDS, 4, 1 << 31)
    logprobs_read(_WARM_LOGPROBS, 1, 1e-4)
    positions_json(np.zeros((1, 1), dtype=np.int64), 1)
    ids = np.zeros((1, 1), dtype=np.int64)
    id_fault(ids, 1)
    one = np.zeros(1, dtype=np.intp)
    out = np.empty((1, 1), dtype=np.float32)
    pick_rows(np.zeros(1, np.int64), np.zeros(1), one, one + 1, one.astype(bool), 0, ids, out)
    for dtype in (np.float64, np.float32):
        topk_check(ids, np.zeros((1, 1), dtype=dtype), -1, 1, 1e-4)
