"""A compiled reader (numba, ``nogil``) of a rollout's Python top-k rows, as
``msgspec.msgpack`` writes them: ``R`` arrays of entries ``[logprob, id(, text)]``.

MessagePack keeps a float as its 8 IEEE bytes, so no number is printed or parsed: the
logprobs come back bit for bit (NaN and infinities included) and the reader's work is a
byte walk. Called through :mod:`opd_stream._jit_calls`; it calls no function of another
file (numba's disk cache keys a compiled function on its own file only), only the load
intrinsics of :mod:`opd_stream._jit_kernel`, whose code is generated inline (should they
ever change, touch this file too, or its cached code keeps the old loads).

What it accepts, and nothing else (it answers ``False`` for the rest, which the
entry-by-entry conversion then takes or rejects with its precise error): an outer array
of ``R`` arrays; entries that are arrays of 2 or 3 elements; a logprob that is a
float64, ``nil`` (written ``-inf``) or an integer within ``±2^53``; an id that is an
integer within int64; a third element that is ``nil`` or a string (skipped: the text is
never used); at least ``k`` entries in every row, of which the first ``k`` are kept (the
rest are still read and checked). A ``nil`` entry, a short row, a bool, a float32, a map
or anything else is unusual.
"""

from __future__ import annotations

import numpy as np

from ._jit_kernel import load_be64, load_byte, njit_leaf

__all__ = ("read_rows",)

_U8 = np.uint64(8)
_EXACT = 2**53


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
    if c <= 0x7F:
        return i + 1, np.int64(c), True
    if c >= 0xE0:
        return i + 1, np.int64(c) - 256, True
    if 0xCC <= c <= 0xCF:
        size = 1 << (c - 0xCC)
        if i + 1 + size > n:
            return i, np.int64(0), False
        u = _uint(b, i + 1, size)
        if u > np.uint64(2**63 - 1):
            return i, np.int64(0), False
        return i + 1 + size, np.int64(u), True
    if 0xD0 <= c <= 0xD3:
        size = 1 << (c - 0xD0)
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
    if 0x90 <= c <= 0x9F:
        return i + 1, np.int64(c - 0x90)
    if c == 0xDC and i + 3 <= n:
        return i + 3, np.int64(_uint(b, i + 1, np.int64(2)))
    if c == 0xDD and i + 5 <= n:
        return i + 5, np.int64(_uint(b, i + 1, np.int64(4)))
    return i, -1


@njit_leaf
def _skip_text(b, i, n):  # type: ignore[no-untyped-def]
    """A ``nil`` or a string at ``b[i]``: the next index, or -1."""
    c = load_byte(b, i)
    if c == 0xC0:
        return i + 1
    if 0xA0 <= c <= 0xBF:
        size = np.int64(c - 0xA0)
        start = i + 1
    elif 0xD9 <= c <= 0xDB:
        w = 1 << (c - 0xD9)
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
    took them (``False``: unusual, the entry-by-entry conversion decides). The common
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
                size = np.int64(c) - 0x90
                i += 1
            if size != 2 and size != 3:
                return False
            if i >= n:
                return False
            c = load_byte(b, i)
            keep = e < k
            if c == 0xCB:
                if i + 9 > n:
                    return False
                if keep:
                    lp_bits[out] = load_be64(b, i + 1)
                i += 9
            elif c == 0xC0:
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
            if c <= 0x7F:
                d = np.int64(c)
                i += 1
            elif c == 0xCD and i + 3 <= n:
                d = (np.int64(load_byte(b, i + 1)) << 8) | np.int64(load_byte(b, i + 2))
                i += 3
            elif c == 0xCE and i + 5 <= n:
                d = (
                    (np.int64(load_byte(b, i + 1)) << 24)
                    | (np.int64(load_byte(b, i + 2)) << 16)
                    | (np.int64(load_byte(b, i + 3)) << 8)
                    | np.int64(load_byte(b, i + 4))
                )
                i += 5
            else:
                i, d, ok = _int(b, i, n)
                if not ok:
                    return False
            if keep:
                ids[out] = d
                out += 1
            if size == 3:
                if i >= n:
                    return False
                if load_byte(b, i) == 0xC0:
                    i += 1
                else:
                    i = _skip_text(b, i, n)
                    if i < 0:
                        return False
    return i == n
