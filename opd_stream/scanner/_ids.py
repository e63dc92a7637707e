"""The compiled writer of per-position id rows for request payloads (numba, ``nogil``).

Its own module: numba caches a compiled function keyed on its file alone; it takes from
other files only what :mod:`opd_stream.scanner._shared` holds (the store intrinsic, whose code
is generated inline, and the bytes of JSON by name), whose digest it carries as
``SHARED_DIGEST`` (``tests/scanner/test_scanner_cache.py``). A token id (below 10^7) is one
SWAR word of eight digits, shifted to its own digits with a comma after them, and one
unaligned store.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._shared import CLOSE_BRACKET, COMMA, OPEN_BRACKET, ZERO, njit_cached, njit_leaf, store_le64

__all__ = ("SHARED_DIGEST", "positions_json")

#: :func:`opd_stream.scanner._shared.digest` of the file this one's kernels take code from
#: (an edit there must edit this file too, or numba serves its stale cache).
SHARED_DIGEST = "818ed0a9f5e24213"

#: "00" "01" ... "99": two digits per table step, half the divisions.
_PAIRS = np.frombuffer(b"".join(b"%02d" % n for n in range(100)), dtype=np.uint8).copy()
_POWERS = np.array([10**i for i in range(19)], dtype=np.int64)  # a digit count, no division
_LIMIT = 4611686018427387904  # 2^62: any id below it has at most 19 digits
_EIGHT_DIGITS = 100_000_000
_SEVEN_DIGITS = 10_000_000  # ids below it: their digits and a comma fit one word
_CHUNK_IDS = 1024  # ids a chunk of _write_positions (its words and sizes: 16 KiB)
_LOW7_PER32 = np.uint64(0x0000007F0000007F)
_LOW4_PER16 = np.uint64(0x000F000F000F000F)
_ASCII_ZEROS = np.uint64(0x3030303030303030)


@njit_leaf
def _ascii8(v):  # type: ignore[no-untyped-def]
    """The eight ASCII digits of ``0 <= v < 10^8`` (leading zeros included) as one
    little-endian word, first digit in the lowest byte: SWAR, no division."""
    hi = v // 10000  # a constant divisor: a multiply
    x = np.uint64(hi) | (np.uint64(v - hi * 10000) << np.uint64(32))  # 4 + 4 digits
    q = ((x * np.uint64(5243)) >> np.uint64(19)) & _LOW7_PER32  # each half // 100
    x = q | ((x - q * np.uint64(100)) << np.uint64(16))  # 2 digits per 16-bit lane
    t = ((x * np.uint64(103)) >> np.uint64(10)) & _LOW4_PER16  # each lane // 10
    x = t | ((x - t * np.uint64(10)) << np.uint64(8))  # 1 digit per byte
    return x + _ASCII_ZEROS


@njit_leaf
def _long_id(v, out, pos):  # type: ignore[no-untyped-def]
    """``10^8 <= v < 2^62`` written at ``out[pos:]`` (two digits per table step); the
    position after it. No token id is this big: kept out of the writer's loop, whose
    code stays small."""
    nd = 1
    while nd < 19 and v >= _POWERS[nd]:
        nd += 1
    end = pos + nd
    while v >= 100:
        q = v // 100
        p = 2 * (v - 100 * q)
        out[end - 2] = _PAIRS[p]
        out[end - 1] = _PAIRS[p + 1]
        end -= 2
        v = q
    if v >= 10:
        out[end - 2] = _PAIRS[2 * v]
        out[end - 1] = _PAIRS[2 * v + 1]
    else:
        out[end - 1] = ZERO + v
    return pos + nd


@njit_leaf
def _write_row(ids, row, out, pos):  # type: ignore[no-untyped-def]
    """Row ``row`` of ``ids`` (each id in ``[0, 2^62)``) written at ``out[pos:]`` as
    ``[a,b],`` one id at a time; the position after it, or -1 for an id out of range."""
    out[pos] = OPEN_BRACKET
    pos += 1
    for j in range(ids.shape[1]):
        v = ids[row, j]
        if v < _EIGHT_DIGITS and v >= 0:  # every real token id: one word, shifted
            # to its digits; the digit count by compares against constants (no loop)
            nd = (
                1
                + (v >= 10)
                + (v >= 100)
                + (v >= 1000)
                + (v >= 10000)
                + (v >= 100000)
                + (v >= 1000000)
                + (v >= 10000000)
            )
            store_le64(out, pos, _ascii8(v) >> np.uint64(8 * (8 - nd)))
            pos += nd
        elif v < 0 or v >= _LIMIT:
            return -1
        else:
            pos = _long_id(v, out, pos)
        out[pos] = COMMA
        pos += 1
    if ids.shape[1]:
        pos -= 1  # the last comma of the row
    out[pos] = CLOSE_BRACKET
    out[pos + 1] = COMMA
    return pos + 2


@njit_cached
def _write_positions(ids, empty_rows, out):  # type: ignore[no-untyped-def]
    """``[[],...,[],[a,b],[c,d]]`` (``empty_rows`` empty rows, then the rows of ``ids``,
    C-contiguous int64 ``[R, k]``, each in ``[0, 2^62)``) into ``out``; the bytes written,
    or -1 for an id out of that range.

    ~1,000 ids at a time, in two passes: the first turns each id below 10^7 into its
    digits and a comma, one word, and its length (no branch: the compiler vectorises it);
    the second stores the words one after the other. Half the time of writing each id as
    it comes (~60 against ~120 us for 2048 x 16), whose digit count and stores wait on
    each other. A chunk holding a bigger (or negative) id is written id by id."""
    pos = 0
    out[pos] = OPEN_BRACKET
    pos += 1
    for _ in range(empty_rows):
        out[pos] = OPEN_BRACKET
        out[pos + 1] = CLOSE_BRACKET
        out[pos + 2] = COMMA
        pos += 3
    r, k = ids.shape
    rows = max(1, _CHUNK_IDS // max(k, 1))  # rows a chunk
    words = np.empty(rows * k, dtype=np.uint64)
    sizes = np.empty(rows * k, dtype=np.int64)
    flat = ids.reshape(r * k)
    for first in range(0, r, rows):
        last = min(r, first + rows)
        base = first * k
        other = np.int64(0)
        for i in range((last - first) * k):
            v = flat[base + i]
            nd = (
                1
                + np.int64(v >= 10)
                + np.int64(v >= 100)
                + np.int64(v >= 1000)
                + np.int64(v >= 10000)
                + np.int64(v >= 100000)
                + np.int64(v >= 1000000)
            )
            other += np.int64(v < 0) + np.int64(v >= _SEVEN_DIGITS)
            digits = _ascii8(min(max(v, 0), _SEVEN_DIGITS - 1)) >> np.uint64(8 * (8 - nd))
            words[i] = digits | (np.uint64(COMMA) << np.uint64(8 * nd))
            sizes[i] = nd + 1
        if other:
            for row in range(first, last):
                pos = _write_row(ids, row, out, pos)
                if pos < 0:
                    return -1
            continue
        i = 0
        for _ in range(first, last):
            out[pos] = OPEN_BRACKET
            pos += 1
            for _ in range(k):
                store_le64(out, pos, words[i])
                pos += sizes[i]
                i += 1
            if k:
                pos -= 1  # the last comma of the row
            out[pos] = CLOSE_BRACKET
            out[pos + 1] = COMMA
            pos += 2
    if r or empty_rows:
        pos -= 1  # the last comma
    out[pos] = CLOSE_BRACKET
    return pos + 1


def positions_json(ids: Any, empty_rows: int) -> memoryview | None:
    """``[[],...,[],ids[0],ids[1],...]`` (``empty_rows`` empty rows before the rows of
    int64 ``ids [R, k]``, non-negative), the same bytes as
    ``msgspec.json.encode([[]] * empty_rows + ids.tolist())``, as a view of the buffer it
    was written into (no copy); ``None`` for a negative id. The GIL is released while it
    writes."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    r, k = ids.shape
    out = np.empty(10 + 3 * empty_rows + r * (3 + 20 * k), dtype=np.uint8)  # 8-byte stores
    n = _write_positions(ids, empty_rows, out)
    return None if n < 0 else out.data[:n]
