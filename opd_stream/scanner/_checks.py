"""The compiled checks of a student top-k (numba, ``nogil``): every fault the vectorised
checks of :mod:`opd_stream.wire._student_topk` look for, in one pass over ``[R, k]`` arrays
instead of a dozen (duplicates found by hashing each row's ids, not by sorting them),
with the float32 logprobs written on the way; and the per-position id rows of an answer,
checked and picked (:func:`pick_id_rows`).

Its own module: it calls no function of another file (numba's disk cache keys a compiled
function on its own file only); it takes the decorators of :mod:`opd_stream.scanner._shared`,
whose digest it carries as ``SHARED_DIGEST`` (``tests/scanner/test_scanner_cache.py``).
"""

from __future__ import annotations

import numpy as np

from ._shared import njit_cached, njit_leaf

__all__ = ("FAULTS", "SHARED_DIGEST", "pick_id_rows", "request_id_fault", "topk_faults")

#: :func:`opd_stream.scanner._shared.digest` of the file this one's kernels take code from
#: (an edit there must edit this file too, or numba serves its stale cache).
SHARED_DIGEST = "818ed0a9f5e24213"

#: The faults, in the order of what :func:`topk_faults` returns.
FAULTS = (
    "negative_id",  # below the padding id
    "id_above",  # above ``max_id``
    "lp_nan",
    "lp_posinf",
    "lp_above",  # above ``tolerance`` (+inf included)
    "pad_before_id",  # a padding id before a token id in the row
    "duplicate",  # a token id twice in the row (padding ignored)
)
NEGATIVE_ID, ID_ABOVE, LP_NAN, LP_POSINF, LP_ABOVE, PAD_BEFORE_ID, DUPLICATE = range(7)
N_FAULTS = len(FAULTS)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing's multiplier


@njit_leaf
def _table_bits(k):  # type: ignore[no-untyped-def]
    """The size of an id table for rows of ``k`` ids, as a power of two: at least ``32 k``
    (2^12 at most, and at least ``4 k``). A probe finds its slot taken ~1.5% of the time
    for k = 16, so the branch on it is predicted right: with ``4 k`` (12%) the
    mispredictions tripled the search on a rollout's rows (77 against 24 us for 2048 x 16;
    the same rows over and over hide it: the predictor learns them)."""
    bits = 4
    while (1 << bits) < 4 * k or ((1 << bits) < 32 * k and bits < 12):
        bits += 1
    return bits


@njit_cached
def _first_duplicate_row(ids, pad_id):  # type: ignore[no-untyped-def]
    """The first row of ``ids`` that holds an id other than ``pad_id`` twice, or -1. Each
    id is put in an open-addressing table (:func:`_table_bits`), where a second one finds
    the first; a slot is this row's when its stamp is ``row``, so nothing is cleared
    between rows. The table is the function's own: given it as arguments, the compiler
    must assume that its stores may change ``ids``, and the search took twice as long."""
    bits = _table_bits(ids.shape[1])
    tab = np.empty(1 << bits, dtype=np.int64)
    stamps = np.full(1 << bits, -1, dtype=np.int64)
    shift = np.uint64(64 - bits)
    mask = (1 << bits) - 1
    for row in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            d = ids[row, j]
            if d == pad_id:
                continue
            slot = np.int64((np.uint64(d) * _GOLDEN) >> shift)
            while stamps[slot] == row:
                if tab[slot] == d:
                    return row
                slot = (slot + 1) & mask
            stamps[slot] = row
            tab[slot] = d
    return -1


@njit_cached
def request_id_fault(ids, max_id):  # type: ignore[no-untyped-def]
    """A request's ids (int64 ``[R, k]``) checked in one pass: ``(1, -1)`` when an id
    lies outside ``[0, max_id)`` (anywhere: that fault comes first), ``(2, row)`` for the
    first row that holds an id twice, else ``(0, -1)``."""
    outside = np.int64(0)
    for row in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            d = ids[row, j]
            outside += np.int64(d < 0) + np.int64(d >= max_id)
    if outside:
        return 1, -1
    dup = _first_duplicate_row(ids, np.int64(-1))
    return (2, dup) if dup >= 0 else (0, -1)


@njit_leaf
def _clean_values(ids, lps, pad_id, max_id, tolerance, out):  # type: ignore[no-untyped-def]
    """Whether every id of ``ids`` (``[R, k]``) lies in ``(pad_id, max_id]`` and every
    logprob of ``lps`` is a number at most ``tolerance``: then ``out`` holds them as
    float32. One pass over the flat arrays with no branch in its loop (the compiler
    vectorises it: ~4 us for 2048 x 16, against ~40 for the general pass); ``False``
    leaves ``out`` to :func:`topk_faults`' general pass, which names the fault. The three
    arrays are C-contiguous (:func:`~opd_stream.scanner._calls.topk_check` sees to it)."""
    n = ids.size
    if n == 0:
        return True
    flat_ids = ids.reshape(n)
    flat_lps = lps.reshape(n)
    flat_out = out.reshape(n)
    lo = flat_ids[0]
    hi = lo
    bad = np.int64(0)
    for i in range(n):
        d = flat_ids[i]
        lo = min(lo, d)
        hi = max(hi, d)
        v = flat_lps[i]
        flat_out[i] = v
        bad += np.int64(v > tolerance) + np.int64(v != v)
    return lo > pad_id and hi <= max_id and bad == 0


@njit_cached
def topk_faults(ids, lps, pad_id, max_id, tolerance, out):  # type: ignore[no-untyped-def]
    """Check ``ids`` (int64 ``[R, k]``) and ``lps`` (float ``[R, k]``), both C-contiguous,
    and write ``lps`` as float32 into ``out`` (``-inf`` where the id is ``pad_id``, whatever
    the logprob there, and for a NaN).

    Returns int64 ``[len(FAULTS)]``: for each fault, the first row that holds it, or -1. A
    logprob in a padding slot is never judged; a duplicate ignores padding ids.
    """
    first = np.full(N_FAULTS, -1, dtype=np.int64)
    # (the common case: no padding and no fault, the one pass, then only the duplicates)
    if not _clean_values(ids, lps, pad_id, max_id, tolerance, out):
        _value_faults(ids, lps, pad_id, max_id, tolerance, out, first)
    first[DUPLICATE] = _first_duplicate_row(ids, pad_id)
    return first


@njit_leaf
def _value_faults(ids, lps, pad_id, max_id, tolerance, out, first):  # type: ignore[no-untyped-def]
    """:func:`topk_faults`' general pass: ``out`` written and each fault but the duplicate
    noted at its first row in ``first``, entry by entry."""
    r, k = ids.shape
    for row in range(r):
        seen_pad = False
        for j in range(k):
            d = ids[row, j]
            if d == pad_id:
                seen_pad = True
                out[row, j] = -np.inf
                continue
            if seen_pad and first[PAD_BEFORE_ID] < 0:
                first[PAD_BEFORE_ID] = row
            if d < pad_id and first[NEGATIVE_ID] < 0:
                first[NEGATIVE_ID] = row
            if d > max_id and first[ID_ABOVE] < 0:
                first[ID_ABOVE] = row
            v = lps[row, j]
            if v != v:
                out[row, j] = -np.inf
                if first[LP_NAN] < 0:
                    first[LP_NAN] = row
                continue
            out[row, j] = v
            if v > tolerance:
                if v == np.inf and first[LP_POSINF] < 0:
                    first[LP_POSINF] = row
                if first[LP_ABOVE] < 0:
                    first[LP_ABOVE] = row


@njit_leaf
def pick_id_rows(e_ids, e_lps, entry_off, row_width, row_null, first_row, expect, out):  # type: ignore[no-untyped-def]
    """The per-position requested-id rows of one answer, checked and picked in one pass.

    Rows ``first_row .. first_row + R - 1`` (entry ``j`` of row ``t`` at ``entry_off[row]
    + j`` of ``e_ids`` / ``e_lps``) must each be non-null, ``k`` wide, and return exactly
    ``expect[t]`` (int64 ``[R, k]``) in order; their logprobs go to ``out`` (float32
    ``[R, k]``, NaN as ``-inf``). Returns ``(ok, largest logprob)``; on ``ok`` False the
    caller takes its general path, which names the fault.
    """
    r, k = expect.shape
    top = -np.inf
    for t in range(r):
        row = first_row + t
        if row_null[row] or row_width[row] != k:
            return False, top
        base = entry_off[row]
        for j in range(k):
            if e_ids[base + j] != expect[t, j]:
                return False, top
            v = e_lps[base + j]
            if v != v:
                out[t, j] = -np.inf
            else:
                top = max(top, v)
                out[t, j] = v
    return True, top
