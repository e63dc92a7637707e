"""A compiled reader (numba, the GIL held) of a rollout's Python top-k rows read in place:
CPython's own list, tuple, float and int objects, followed from their addresses.

It is given the addresses of the types it knows (the layout array, ``L_*`` fields:
:mod:`opd_stream.scanner._layout`) and follows an object only once its type is one of them
exactly, so every read stays inside an object the caller holds, which no other thread can
change while the GIL is held. It takes :mod:`opd_stream.scanner._rows`' form, or less: an
id of 2^60 or more, a subclass or anything unusual is answered ``False``, for the msgpack
reader or the entry-by-entry conversion. Why and how it stays safe:
``docs/design-notes.md``. Takes only :mod:`opd_stream.scanner._shared`'s names, carrying
its ``SHARED_DIGEST`` (``tests/scanner/test_scanner_cache.py``).
"""

from __future__ import annotations

import numpy as np

from ._shared import load_bits_at, load_u32_at, load_word_at, njit_held

__all__ = (
    "L_FLOAT",
    "L_INT",
    "L_INT_TAGGED",
    "L_LIST",
    "L_NONE",
    "L_SIZE",
    "L_STR",
    "L_TUPLE",
    "L_TUPLE_ITEMS",
    "SHARED_DIGEST",
    "read_object_rows",
)

#: :func:`opd_stream.scanner._shared.digest` of the file this one's kernels take code from
#: (an edit there must edit this file too, or numba serves its stale cache).
SHARED_DIGEST = "818ed0a9f5e24213"

# The fields of the layout array (int64): the types' addresses, where a tuple's items
# start, and whether an int keeps its sign and size in a tag (CPython 3.12 on) or in a
# signed size (3.11).
L_LIST, L_TUPLE, L_FLOAT, L_INT, L_NONE, L_STR, L_TUPLE_ITEMS, L_INT_TAGGED = range(8)
L_SIZE = 8

# Every object: its type at 8; a list's or tuple's size at 16; a list's item array at 24;
# a float's value at 16; an int's size (or tag) at 16, its 30-bit digits from 24.
OB_TYPE = 8
OB_SIZE = 16
LIST_ITEMS = 24
FLOAT_VALUE = 16
INT_DIGITS = 24
DIGIT_BITS = 30

_EXACT = 2**53
_NEG_INF = np.float64(-np.inf)


@njit_held
def _int_value(p, tagged):  # type: ignore[no-untyped-def]
    """The int object at ``p``: (ok, value); ``ok`` is False beyond two digits."""
    if tagged:
        tag = load_word_at(p + OB_SIZE)
        sign = tag & 3  # 0 positive, 1 zero, 2 negative
        if sign == 3:
            return False, np.int64(0)
        negative = sign == 2
        digits = tag >> 3
    else:
        size = load_word_at(p + OB_SIZE)
        negative = size < 0
        digits = -size if negative else size
    if digits == 0:
        v = np.int64(0)
    elif digits == 1:
        v = np.int64(load_u32_at(p + INT_DIGITS))
    elif digits == 2:
        high = np.int64(load_u32_at(p + INT_DIGITS + 4))
        v = np.int64(load_u32_at(p + INT_DIGITS)) | (high << DIGIT_BITS)
    else:
        return False, np.int64(0)
    return True, -v if negative else v


@njit_held
def _items(p, t, t_list, t_tuple, tuple_items):  # type: ignore[no-untyped-def]
    """Where the items of the object at ``p`` (of type ``t``) start: 0 if it is neither a
    list nor a tuple."""
    if t == t_list:
        return load_word_at(p + LIST_ITEMS)
    if t == t_tuple:
        return p + tuple_items
    return np.int64(0)


@njit_held
def read_object_rows(rows, start, stop, k, lps, lp_bits, ids, layout):  # type: ignore[no-untyped-def]
    """Read rows ``start`` to ``stop`` of the list at address ``rows`` into ``lps`` /
    ``lp_bits`` (one float64 buffer and its uint64 view) and ``ids`` (int64), from index
    ``start * k``: whether it took them. ``layout``: the int64 fields named ``L_*``."""
    t_list, t_tuple = layout[L_LIST], layout[L_TUPLE]
    t_float, t_int = layout[L_FLOAT], layout[L_INT]
    t_none, t_str = layout[L_NONE], layout[L_STR]
    tuple_items, tagged = layout[L_TUPLE_ITEMS], layout[L_INT_TAGGED] != 0
    if load_word_at(rows + OB_TYPE) != t_list or start < 0 or start > stop:
        return False
    if stop > load_word_at(rows + OB_SIZE):
        return False
    row_items = load_word_at(rows + LIST_ITEMS)
    out = start * k
    for n in range(start, stop):
        row = load_word_at(row_items + 8 * n)
        base = _items(row, load_word_at(row + OB_TYPE), t_list, t_tuple, tuple_items)
        if base == 0:
            return False
        width = load_word_at(row + OB_SIZE)
        if width < k:
            return False
        for e in range(width):
            entry = load_word_at(base + 8 * e)
            at = _items(entry, load_word_at(entry + OB_TYPE), t_list, t_tuple, tuple_items)
            if at == 0:
                return False
            size = load_word_at(entry + OB_SIZE)
            if size != 2 and size != 3:
                return False
            keep = e < k
            lp = load_word_at(at)
            kind = load_word_at(lp + OB_TYPE)
            if kind == t_float:
                if keep:
                    lp_bits[out] = load_bits_at(lp + FLOAT_VALUE)
            elif lp == t_none:
                if keep:
                    lps[out] = _NEG_INF
            elif kind == t_int:
                ok, v = _int_value(lp, tagged)
                if not ok or v > _EXACT or v < -_EXACT:
                    return False
                if keep:
                    lps[out] = np.float64(v)
            else:
                return False
            token = load_word_at(at + 8)
            if load_word_at(token + OB_TYPE) != t_int:
                return False
            ok, d = _int_value(token, tagged)
            if not ok or (keep and d < 0):  # a negative id: the entry path names it
                return False
            if keep:
                ids[out] = d
                out += 1
            if size == 3:
                text = load_word_at(at + 16)
                if text != t_none and load_word_at(text + OB_TYPE) != t_str:
                    return False
    return True
