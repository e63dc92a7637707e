"""A compiled reader (numba, ``nogil``) of a rollout's Python top-k rows, as
``msgspec.msgpack`` writes them: ``R`` arrays of entries ``[logprob, id(, text)]``.

MessagePack keeps a float as its 8 IEEE bytes, so the logprobs come back bit for bit (NaN
and infinities included) from a byte walk. Called through :mod:`opd_stream.scanner._calls`;
it calls no function of another file and takes only :mod:`opd_stream.scanner._shared`'s
names, carrying its ``SHARED_DIGEST`` (``tests/scanner/test_scanner_cache.py``). Anything but the
exact shape (entries of 2-3 elements; a float64, ``nil`` or ±2^53 integer logprob; an int64
id, not negative among the ``k`` kept; ``nil`` or string text; at least ``k`` entries a row,
the first ``k`` kept) is answered ``False``, for the entry-by-entry conversion to take or
reject with its precise error.
"""

from __future__ import annotations

import numpy as np

from ._shared import load_be16, load_be32, load_be64, load_byte, njit_leaf

__all__ = ("SHARED_DIGEST", "read_rows")

#: :func:`opd_stream.scanner._shared.digest` of the file this one's kernels take code from
#: (an edit there must edit this file too, or numba serves its stale cache).
SHARED_DIGEST = "818ed0a9f5e24213"

_U8 = np.uint64(8)
_EXACT = 2**53

# MessagePack's type bytes (its specification's names)
POSITIVE_FIXINT_MAX = 0x7F
FIXARRAY, FIXARRAY_MAX = 0x90, 0x9F
FIXSTR, FIXSTR_MAX = 0xA0, 0xBF
NIL = 0xC0
FLOAT64 = 0xCB
UINT8, UINT16, UINT32, UINT64 = 0xCC, 0xCD, 0xCE, 0xCF
INT8, INT64 = 0xD0, 0xD3
STR8, STR32 = 0xD9, 0xDB
ARRAY16, ARRAY32 = 0xDC, 0xDD
NEGATIVE_FIXINT_MIN = 0xE0


@njit_leaf
def _uint(b, i, size):  # type: ignore[no-untyped-def]
    """The big-endian unsigned integer of ``size`` bytes at ``b[i]``."""
    v = np.uint64(0)
    for j in range(size):
        v = (v << _U8) | np.uint64(load_byte(b, i + j))
    return v


@njit_leaf
def _int(b, i, n):  # type: ignore[no-untyped-def]
    """A msgpack integer at ``b[i]``: (next index, value, ok); ``ok`` is False for
    anything else and for an unsigned value beyond int64."""
    c = load_byte(b, i)
    if c <= POSITIVE_FIXINT_MAX:
        return i + 1, np.int64(c), True
    if c >= NEGATIVE_FIXINT_MIN:
        return i + 1, np.int64(c) - 256, True
    if UINT8 <= c <= UINT64:
        size = 1 << (c - UINT8)
        if i + 1 + size > n:
            return i, np.int64(0), False
        u = _uint(b, i + 1, size)
        if u > np.uint64(2**63 - 1):
            return i, np.int64(0), False
        return i + 1 + size, np.int64(u), True
    if INT8 <= c <= INT64:
        size = 1 << (c - INT8)
        if i + 1 + size > n:
            return i, np.int64(0), False
        u = _uint(b, i + 1, size)
        bits = 8 * size
        if bits < 64 and u >= (np.uint64(1) << np.uint64(bits - 1)):
            return i + 1 + size, np.int64(u) - (np.int64(1) << np.int64(bits)), True
        return i + 1 + size, np.int64(u), True  # 64 bits: the cast keeps the sign bit
    return i, np.int64(0), False


@njit_leaf
def _array(b, i, n):  # type: ignore[no-untyped-def]
    """A msgpack array header at ``b[i]``: (next index, length); length -1 if not one."""
    if i >= n:
        return i, -1
    c = load_byte(b, i)
    if FIXARRAY <= c <= FIXARRAY_MAX:
        return i + 1, np.int64(c - FIXARRAY)
    if c == ARRAY16 and i + 3 <= n:
        return i + 3, np.int64(_uint(b, i + 1, np.int64(2)))
    if c == ARRAY32 and i + 5 <= n:
        return i + 5, np.int64(_uint(b, i + 1, np.int64(4)))
    return i, -1


@njit_leaf
def _skip_text(b, i, n):  # type: ignore[no-untyped-def]
    """A ``nil`` or a string at ``b[i]``: the next index, or -1."""
    c = load_byte(b, i)
    if c == NIL:
        return i + 1
    if FIXSTR <= c <= FIXSTR_MAX:
        size = np.int64(c - FIXSTR)
        start = i + 1
    elif STR8 <= c <= STR32:
        w = 1 << (c - STR8)
        if i + 1 + w > n:
            return -1
        size = np.int64(_uint(b, i + 1, w))
        start = i + 1 + w
    else:
        return -1
    return start + size if start + size <= n else -1


@njit_leaf
def read_rows(b, r, k, lps, lp_bits, ids):  # type: ignore[no-untyped-def]
    """Read ``b`` (the msgpack of ``r`` rows) into ``lps`` / ``lp_bits`` (one float64
    buffer and its uint64 view, ``r * k``) and ``ids`` (int64, ``r * k``): whether it
    took them (``False``: unusual, or a negative id among a row's first ``k``: the
    entry-by-entry conversion decides). The common
    forms (a float64 logprob, a small id, a ``nil`` text) are tested first, inline;
    :func:`_int` and :func:`_skip_text` take the rest."""
    n = b.shape[0]
    i, rows = _array(b, np.int64(0), n)
    if rows != r:
        return False
    out = 0
    for _ in range(r):
        i, width = _array(b, i, n)
        if width < k:
            return False
        for e in range(width):
            if i + 12 > n:  # the shortest entry is 3 bytes; the slow checks take it
                i, size = _array(b, i, n)
            else:
                c = load_byte(b, i)
                size = np.int64(c) - FIXARRAY
                i += 1
            if size != 2 and size != 3:
                return False
            if i >= n:
                return False
            c = load_byte(b, i)
            keep = e < k
            if c == FLOAT64:
                if i + 9 > n:
                    return False
                if keep:
                    lp_bits[out] = load_be64(b, i + 1)
                i += 9
            elif c == NIL:
                if keep:
                    lps[out] = -np.inf
                i += 1
            else:
                i, v, ok = _int(b, i, n)
                if not ok or v > _EXACT or v < -_EXACT:
                    return False
                if keep:
                    lps[out] = np.float64(v)
            if i >= n:
                return False
            c = load_byte(b, i)
            if c <= POSITIVE_FIXINT_MAX:
                d = np.int64(c)
                i += 1
            elif c == UINT16 and i + 3 <= n:
                d = np.int64(load_be16(b, i + 1))
                i += 3
            elif c == UINT32 and i + 5 <= n:
                d = np.int64(load_be32(b, i + 1))
                i += 5
            else:
                i, d, ok = _int(b, i, n)
                if not ok or (keep and d < 0):  # a negative id: the entry path names it
                    return False
            if keep:
                ids[out] = d
                out += 1
            if size == 3:
                if i >= n:
                    return False
                if load_byte(b, i) == NIL:
                    i += 1
                else:
                    i = _skip_text(b, i, n)
                    if i < 0:
                        return False
    return i == n
