"""The compiled kernels as plain calls (:func:`opd_stream._jit.compiled` gives this module):
buffers sized for any input, the kernels' constants, and :func:`warm`, which compiles
every kernel with the argument types it is always called with.

Importing it imports numba and compiles (or loads from numba's cache): only
:func:`opd_stream._jit.prepare` does, in a worker thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._jit_ids import id_rows_json
from ._jit_kernel import (
    KEYS,
    N_LISTS,
    OK,
    R_END,
    R_ENT0,
    R_ENT1,
    R_ITEM,
    R_KEY,
    R_ROW0,
    R_ROW1,
    R_START,
    UNUSUAL,
    scan,
    scan_rows,
)

__all__ = (
    "KEYS",
    "N_LISTS",
    "OK",
    "R_END",
    "R_ENT0",
    "R_ENT1",
    "R_ITEM",
    "R_KEY",
    "R_ROW0",
    "R_ROW1",
    "R_START",
    "UNUSUAL",
    "id_rows_json",
    "rows_scan",
    "run_scan",
    "warm",
)


def rows_scan(body: bytes) -> tuple[Any, ...] | None:
    """A JSON list of rows of ``[logprob, id(, null)]`` entries (what ``msgspec.json``
    writes for a rollout's Python top-k rows) into ``(lps, ids, widths, nulls)`` (per
    entry, per row; a null logprob is NaN), or ``None`` for anything else."""
    n = len(body)
    b = np.frombuffer(body, dtype=np.uint8)
    lps = np.empty(n // 6 + 1, dtype=np.float64)
    ids = np.empty(n // 6 + 1, dtype=np.int64)
    widths = np.empty(n // 3 + 1, dtype=np.int32)
    nulls = np.empty(n // 3 + 1, dtype=np.uint8)
    status, ne, nr = scan_rows(b, lps, ids, widths, nulls)
    if status != OK:
        return None
    return lps[:ne], ids[:ne], widths[:nr], nulls[:nr]


def run_scan(body: bytes | bytearray, batch: bool) -> tuple[Any, ...]:
    """:func:`scan` over ``body`` with buffers big enough for any body of its size:
    ``((status, n_records, n_items, n_entries, n_rows), lps, ids, widths, nulls, raw,
    records)``. Allocated with ``np.empty``: pages a scan does not touch cost nothing."""
    n = len(body)
    b = np.frombuffer(body, dtype=np.uint8)
    if b.flags.writeable:  # one compiled variant: read-only bytes
        b = b.view()
        b.flags.writeable = False
    entries = n // 6 + 1  # the shortest entry, "[0,0]," is 6 bytes
    rows = n // 3 + 1  # the shortest row, "[],", 3
    lps = np.empty(entries, dtype=np.float64)
    ids = np.empty(entries, dtype=np.int64)
    widths = np.empty(rows, dtype=np.int32)
    nulls = np.empty(rows, dtype=np.uint8)
    raw = np.empty(n * 3 // 4 + 4, dtype=np.uint8)
    records = np.empty((n // 8 + 8, 8), dtype=np.int64)
    got = scan(b, batch, lps, ids, widths, nulls, raw, records)
    return got, lps, ids, widths, nulls, raw, records


#: A tiny answer that makes numba compile every path of the scan once.
_WARM_BODY = (
    b'{"text":"","meta_info":{"finish_reason":{"type":"length"},"input_token_logprobs":'
    b'[[null,1,null],[-0.5,2]],"input_token_ids_logprobs":[null,[[-1.25e-3,3,null]]],'
    b'"input_top_logprobs":[null,[]],"output_token_ids_logprobs":[[[-2.0,4]]],'
    b'"input_top_logprobs_val_flat_b64":"AAAAAA==","input_top_logprobs_idx_flat_b64":"AQID"}}'
)


def warm() -> None:
    """Compile (or load from numba's cache) every kernel, with the argument types they
    are always called with."""
    run_scan(_WARM_BODY, False)
    run_scan(bytearray(b"[" + _WARM_BODY + b"]"), True)
    rows_scan(b"[[[-0.5,1,null]],null]")
    id_rows_json(np.zeros((1, 1), dtype=np.int64))
