"""The compiled scanner (numba, ``nogil``: the GIL is released while it runs): a scoring
answer's logprob lists straight into numpy buffers.

Plain functions over numpy arrays, called through :mod:`opd_stream.scanner._calls`;
:mod:`opd_stream.wire._scan_reader` turns the result into checked columns. In one pass it
follows the JSON structure of the whole body without judging it (msgspec decodes the rest),
parses the logprob lists named by ``keys`` (:data:`opd_stream.wire._decode_score.SCANNED`)
under a strict grammar and decodes the base64 flat top-k strings, recording their spans;
anything outside the grammar ends the scan with :data:`UNUSUAL` (the next parser decides).
Every function it calls is in this file; it takes only :mod:`opd_stream.scanner._shared`'s
names and carries its ``SHARED_DIGEST``. Grammar, numbers and speed:
``docs/design-notes.md``, "opd_stream/scanner/_scan.py".
"""

from __future__ import annotations

import numpy as np

from ._shared import (
    BACKSLASH,
    CLOSE_BRACE,
    CLOSE_BRACKET,
    COLON,
    COMMA,
    DOT,
    EQUALS,
    LOWER_A,
    LOWER_E,
    LOWER_L,
    LOWER_N,
    LOWER_U,
    LOWER_Z,
    MINUS,
    NEWLINE,
    NINE,
    OPEN_BRACE,
    OPEN_BRACKET,
    PLUS,
    QUOTE,
    RETURN,
    SLASH,
    SPACE,
    TAB,
    UPPER_A,
    UPPER_E,
    UPPER_Z,
    ZERO,
    load_byte,
    load_le64,
    njit_leaf,
    njit_once,
)

__all__ = (
    "B64",
    "ENTRIES",
    "ROWS",
    "CAPACITY",
    "MAX_DEPTH",
    "OK",
    "PAUSED",
    "P_DONE",
    "R_END",
    "R_ENT0",
    "R_ENT1",
    "R_ITEM",
    "R_KEY",
    "R_ROW0",
    "R_ROW1",
    "R_START",
    "SHARED_DIGEST",
    "S_I",
    "S_PHASE",
    "S_SIZE",
    "UNUSUAL",
    "scan",
)

#: :func:`opd_stream.scanner._shared.digest` of the file this one's kernels take code from
#: (an edit there must edit this file too, or numba serves its stale cache).
SHARED_DIGEST = "818ed0a9f5e24213"

OK = 0
#: Not for this parser: the answer goes to the next one (never an error by itself).
UNUSUAL = 1
#: The output buffers were too small (cannot happen with ``_calls``' sizes).
CAPACITY = 2
#: The scan stopped at ``stop`` (between two values of the body, or between two rows of a
#: rows list) with its state saved: called again, it goes on from there.
PAUSED = 3

#: The saved state of a scan (``state``, int64 ``[S_SIZE]``; all zeros before the first
#: call): where it is (``S_PHASE``: not started, in the body, between two rows of a rows
#: list, done), the scan's own variables, and the rows list it is in.
S_PHASE, S_I, S_DEPTH, S_ITEM, S_NREC, S_NE, S_NR, S_NB = range(8)
S_STR0, S_STR1, S_ESCAPED, S_META_KEY, S_IN_META = range(8, 13)
S_KEY, S_START, S_NE0, S_NR0 = range(13, 17)
S_SIZE = 17
P_NEW, P_BODY, P_ROWS, P_DONE = range(4)

#: The kinds of value (``kinds``), as the wire numbers them (:data:`opd_stream.wire.
#: _decode_score.ENTRIES` ...; ``tests/scanner/test_scanner_constants.py`` ties the two).
ENTRIES, ROWS, B64 = 0, 1, 2
MAX_DEPTH = 64


_P10 = np.array([10.0**i for i in range(23)], dtype=np.float64)
_EXACT_MANTISSA = 2**53
_F32_SAFE = 1e38  # well below float32's max (3.4e38): the range check stays exact
_2_POW_M26 = 2.0**-26
_F32_TINY = 1.2e-38  # float32's smallest normal: below it, fall back
_TOLERANCE = 1e-4  # wire._checks.LOGPROB_TOLERANCE: a logprob near it falls back

# record columns (int64 [n_records, 8])
R_KEY, R_ITEM, R_START, R_END, R_ROW0, R_ROW1, R_ENT0, R_ENT1 = range(8)


@njit_leaf
def _ws(b, i, n):  # type: ignore[no-untyped-def]
    while i < n:
        c = load_byte(b, i)
        # the first test is the one that most often decides
        if c > SPACE or (c != SPACE and c != NEWLINE and c != RETURN and c != TAB):
            return i
        i += 1
    return i


@njit_leaf
def _is_null(b, i, n):  # type: ignore[no-untyped-def]
    return (
        i + 4 <= n
        and load_byte(b, i) == LOWER_N
        and load_byte(b, i + 1) == LOWER_U
        and load_byte(b, i + 2) == LOWER_L
        and load_byte(b, i + 3) == LOWER_L
    )


@njit_leaf
def _f32_unambiguous(v):  # type: ignore[no-untyped-def]
    """Whether an approximate double ``v`` (within a few ulps of the exact value) rounds
    to the same float32 as the exact value would, far from every checked threshold."""
    a = abs(v)
    if a >= _F32_SAFE or a < _F32_TINY:
        return False
    if v > 0.0 and abs(v - _TOLERANCE) <= 1e-12:
        return False
    f32 = np.float32(v)
    f = np.float64(f32)
    d = abs(v - f)
    # f's rounding interval reaches at least |f| 2^-25 on either side: well inside it
    # (the common case, a float32 printed as a double), no neighbour is needed
    if d < a * _2_POW_M26:
        return True
    # else the distance to the nearer rounding boundary, the midpoint between f and a
    # float32 neighbour (exact in float64)
    lo = (f + np.float64(np.nextafter(f32, np.float32(-np.inf)))) * 0.5
    hi = (f + np.float64(np.nextafter(f32, np.float32(np.inf)))) * 0.5
    return min(abs(v - lo), abs(v - hi)) > a * 1e-14


_ASCII_ZEROS = np.uint64(0x3030303030303030)
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_PLUS_SIX = np.uint64(0x0606060606060606)
_ALL_THREES = np.uint64(0x3333333333333333)
_LANES8 = np.uint64(0x00FF00FF00FF00FF)
_LANES16 = np.uint64(0x0000FFFF0000FFFF)
_LANES32 = np.uint64(0xFFFFFFFF)


@njit_leaf
def _eight_digits(b, i):  # type: ignore[no-untyped-def]
    """The value of the eight ASCII digits at ``b[i : i + 8]``, or -1 if any byte is not
    a digit (one little-endian word: :func:`_lead_digits`, :func:`_digits_value`)."""
    x = load_le64(b, i)
    if _lead_digits(x) != 8:
        return np.int64(-1)
    return _digits_value(x, np.int64(8))


@njit_once
def _number(b, i, n, p10):  # type: ignore[no-untyped-def]
    """Parse a JSON number at ``b[i]``: (next index, value, ok)."""
    neg = False
    if i < n and load_byte(b, i) == MINUS:
        neg = True
        i += 1
    if i >= n or load_byte(b, i) < ZERO or load_byte(b, i) > NINE:
        return i, 0.0, False
    m = 0
    nd = 0
    e = 0
    inexact = False
    integral = True  # no fraction, no exponent: msgspec reads it as an int (-0 is 0)
    if load_byte(b, i) == ZERO:
        i += 1
        if i < n and ZERO <= load_byte(b, i) <= NINE:
            return i, 0.0, False
    else:
        while i < n:
            c = load_byte(b, i)
            if c < ZERO or c > NINE:
                break
            if nd < 18:
                m = m * 10 + (int(c) - ZERO)
                nd += 1
            else:
                e += 1
                if c != ZERO:
                    inexact = True
            i += 1
    if i < n and load_byte(b, i) == DOT:
        integral = False
        i += 1
        if i >= n or load_byte(b, i) < ZERO or load_byte(b, i) > NINE:
            return i, 0.0, False
        # eight digits at a time once past the leading zeros, while they fit 18 digits
        while m != 0 and nd <= 10 and i + 8 <= n:
            x = _eight_digits(b, i)
            if x < 0:
                break
            m = m * 100000000 + x
            nd += 8
            e -= 8
            i += 8
        while i < n:
            c = load_byte(b, i)
            if c < ZERO or c > NINE:
                break
            if nd < 18:
                if m != 0 or c != ZERO:
                    m = m * 10 + (int(c) - ZERO)
                    if m != 0:
                        nd += 1
                e -= 1
            elif c != ZERO:
                inexact = True
            i += 1
    if i < n and (load_byte(b, i) == LOWER_E or load_byte(b, i) == UPPER_E):
        integral = False
        i += 1
        eneg = False
        if i < n and (load_byte(b, i) == PLUS or load_byte(b, i) == MINUS):
            eneg = load_byte(b, i) == MINUS
            i += 1
        if i >= n or load_byte(b, i) < ZERO or load_byte(b, i) > NINE:
            return i, 0.0, False
        x = 0
        while i < n:
            c = load_byte(b, i)
            if c < ZERO or c > NINE:
                break
            if x < 100000:
                x = x * 10 + (int(c) - ZERO)
            i += 1
        e += -x if eneg else x
    if m == 0:  # "-0" is 0.0 (an int for msgspec), "-0.0" and "-0e1" are -0.0
        return i, (-0.0 if neg and not integral else 0.0), True
    if e < -44 or e > 22:
        return i, 0.0, False
    if e >= 0:
        v = float(m) * p10[e]
    elif e >= -22:
        v = float(m) / p10[-e]
    else:
        v = float(m) / p10[22] / p10[-e - 22]
        inexact = True
    if neg:
        v = -v
    if (inexact or m > _EXACT_MANTISSA or e < -22) and not _f32_unambiguous(v):
        return i, 0.0, False
    return i, v, True


_ONES = np.uint64(0x0101010101010101)
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGH1 = np.uint64(0x8080808080808080)
_P10I = np.array([10**i for i in range(19)], dtype=np.int64)
#: ``,null],[`` as a little-endian word: an entry's end and the next one's start.
_NULL_NEXT = np.uint64(int.from_bytes(b",null],[", "little"))


@njit_leaf
def _lead_digits(x):  # type: ignore[no-untyped-def]
    """How many of the word's bytes, from its first, are ASCII digits (0-8)."""
    t = (x & _HIGH_NIBBLES) | (((x + _PLUS_SIX) & _HIGH_NIBBLES) >> np.uint64(4))
    y = t ^ _ALL_THREES  # a lane is 0 where its byte is a digit
    mask = (((y & _LOW7) + _LOW7) | y) & _HIGH1  # 0x80 where a lane is not a digit
    if mask == 0:
        return 8
    low = mask & (~mask + np.uint64(1))
    return int((((low - np.uint64(1)) & _ONES) * _ONES) >> np.uint64(56)) - 1


@njit_leaf
def _digits_value(x, d):  # type: ignore[no-untyped-def]
    """The value of the first ``d`` (1-8) bytes of ``x``, all ASCII digits."""
    x = (x - _ASCII_ZEROS) << np.uint64(8 * (8 - d))
    x = (x * np.uint64(10) + (x >> np.uint64(8))) & _LANES8
    x = (x * np.uint64(100) + (x >> np.uint64(16))) & _LANES16
    x = (x * np.uint64(10000) + (x >> np.uint64(32))) & _LANES32
    return np.int64(x)


@njit_once
def _fast_entry(b, i, n, p10):  # type: ignore[no-untyped-def]
    """An entry's inside at ``b[i]`` (after its ``[``) in SGLang's compact form
    ``-D.DDD,ID,null],[`` (at most 18 digits, no exponent), read eight bytes a step:
    ``(index of the next entry's [, logprob, id, ok)``. Not ``ok``: not this form, or
    a value :func:`_number` would refuse; the general path then reads the entry."""
    if i + 64 > n:
        return i, 0.0, 0, False
    neg = load_byte(b, i) == MINUS
    if neg:
        i += 1
    x = load_le64(b, i)
    d0 = _lead_digits(x)
    if d0 == 0 or d0 > 3 or load_byte(b, i + d0) != DOT or (d0 > 1 and load_byte(b, i) == ZERO):
        return i, 0.0, 0, False
    m = _digits_value(x, d0)
    p = i + d0 + 1
    w1 = load_le64(b, p)
    w2 = load_le64(b, p + 8)
    d1 = _lead_digits(w1)
    d2 = _lead_digits(w2)
    if d1 == 0:
        return i, 0.0, 0, False
    if d1 < 8:
        fd = d1
        m = m * _P10I[d1] + _digits_value(w1, d1)
    else:
        m = m * 100000000 + _digits_value(w1, np.int64(8))
        if d2 < 8:
            fd = 8 + d2
            if d2 > 0:
                m = m * _P10I[d2] + _digits_value(w2, d2)
        else:
            w3 = load_le64(b, p + 16)
            d3 = _lead_digits(w3)
            if d3 == 8:
                return i, 0.0, 0, False
            fd = 16 + d3
            m = m * 100000000 + _digits_value(w2, np.int64(8))
            if d3 > 0:
                m = m * _P10I[d3] + _digits_value(w3, d3)
    if fd > 18 or (d0 + fd > 18 and load_byte(b, i) != ZERO):  # beyond 18 digits: exact?
        return i, 0.0, 0, False
    q = p + fd
    if load_byte(b, q) != COMMA:
        return i, 0.0, 0, False
    x = load_le64(b, q + 1)
    d = _lead_digits(x)
    if d == 0 or d == 8 or (d > 1 and load_byte(b, q + 1) == ZERO):
        return i, 0.0, 0, False
    t = q + 1 + d
    if load_le64(b, t) != _NULL_NEXT:
        return i, 0.0, 0, False
    if m == 0:
        v = -0.0 if neg else 0.0
    else:
        v = float(m) / p10[fd]
        if neg:
            v = -v
        if m > _EXACT_MANTISSA and not _f32_unambiguous(v):
            return i, 0.0, 0, False
    return t + 7, v, _digits_value(x, d), True


@njit_leaf
def _entries(b, i, n, p10, lps, ids, ne):  # type: ignore[no-untyped-def]
    """A ``[`` entry, ... ``]`` list at ``b[i]`` (which is ``[``): (next index, entries
    after it, status)."""
    cap = lps.shape[0]
    i = _ws(b, i + 1, n)
    if i < n and load_byte(b, i) == CLOSE_BRACKET:
        return i + 1, ne, OK
    while True:
        if i >= n or load_byte(b, i) != OPEN_BRACKET:
            return i, ne, UNUSUAL
        if ne >= cap:
            return i, ne, CAPACITY
        j, v, d, ok = _fast_entry(b, i + 1, n, p10)
        if ok:
            lps[ne] = v
            ids[ne] = d
            ne += 1
            i = j
            continue
        i = _ws(b, i + 1, n)
        if _is_null(b, i, n):
            lps[ne] = np.nan
            i += 4
        else:
            i, v, ok = _number(b, i, n, p10)
            if not ok:
                return i, ne, UNUSUAL
            lps[ne] = v
        i = _ws(b, i, n)
        if i >= n or load_byte(b, i) != COMMA:
            return i, ne, UNUSUAL
        i = _ws(b, i + 1, n)
        neg = False
        if i < n and load_byte(b, i) == MINUS:
            neg = True
            i += 1
        if i >= n or load_byte(b, i) < ZERO or load_byte(b, i) > NINE:
            return i, ne, UNUSUAL
        d = 0
        nd = 0
        if load_byte(b, i) == ZERO:
            i += 1
            nd = 1
        else:
            while i < n:
                c = load_byte(b, i)
                if c < ZERO or c > NINE:
                    break
                d = d * 10 + (int(c) - ZERO)
                nd += 1
                i += 1
        if nd > 16 or d >= _EXACT_MANTISSA:  # beyond exact doubles: the others decide
            return i, ne, UNUSUAL
        if i < n and (
            load_byte(b, i) == DOT or load_byte(b, i) == LOWER_E or load_byte(b, i) == UPPER_E
        ):
            return i, ne, UNUSUAL
        if i < n and ZERO <= load_byte(b, i) <= NINE:  # a leading zero
            return i, ne, UNUSUAL
        ids[ne] = -d if neg else d
        i = _ws(b, i, n)
        if i < n and load_byte(b, i) == COMMA:
            i = _ws(b, i + 1, n)
            if not _is_null(b, i, n):
                return i, ne, UNUSUAL
            i = _ws(b, i + 4, n)
        if i >= n or load_byte(b, i) != CLOSE_BRACKET:
            return i, ne, UNUSUAL
        ne += 1
        i = _ws(b, i + 1, n)
        if i < n and load_byte(b, i) == COMMA:
            i = _ws(b, i + 1, n)
            continue
        if i < n and load_byte(b, i) == CLOSE_BRACKET:
            return i + 1, ne, OK
        return i, ne, UNUSUAL


@njit_leaf
def _rows(b, i, n, p10, lps, ids, ne, widths, nulls, nr, stop):  # type: ignore[no-untyped-def]
    """The rows of a rows list from its row at ``b[i]`` on (the list is not empty): (next,
    entries, rows, status). After a row, with the next one at or after ``stop``: status
    :data:`PAUSED`, ``next`` that row's first byte (call again from there)."""
    cap = widths.shape[0]
    while True:
        if nr >= cap:
            return i, ne, nr, CAPACITY
        if _is_null(b, i, n):
            widths[nr] = 0
            nulls[nr] = 1
            i += 4
        elif i < n and load_byte(b, i) == OPEN_BRACKET:
            i, ne2, st = _entries(b, i, n, p10, lps, ids, ne)
            if st != OK:
                return i, ne2, nr, st
            widths[nr] = ne2 - ne
            nulls[nr] = 0
            ne = ne2
        else:
            return i, ne, nr, UNUSUAL
        nr += 1
        i = _ws(b, i, n)
        if i < n and load_byte(b, i) == COMMA:
            i = _ws(b, i + 1, n)
            if i >= stop:
                return i, ne, nr, PAUSED
            continue
        if i < n and load_byte(b, i) == CLOSE_BRACKET:
            return i + 1, ne, nr, OK
        return i, ne, nr, UNUSUAL


#: Each byte's value in the base64 alphabet (``A-Z a-z 0-9 + /``: 0-63), or 255.
_B64_VALUES = np.full(256, 255, dtype=np.uint8)
_B64_VALUES[
    np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", np.uint8)
] = np.arange(64, dtype=np.uint8)
_B64_VALUES.flags.writeable = False


@njit_leaf
def _b64(b, i, n, raw, nb):  # type: ignore[no-untyped-def]
    """A JSON string at ``b[i]`` (which is ``"``) of canonical base64 (no escapes, no
    whitespace, exactly the padding its length needs), decoded into ``raw[nb:]``:
    (index after the closing quote, bytes end, status). A subset of what
    ``base64.b64decode(validate=True)`` accepts, decoded alike."""
    cap = raw.shape[0]
    i += 1
    acc = 0
    bits = 0
    alpha = 0
    pads = 0
    # four characters of the alphabet a step, three bytes out (the string's body); the
    # first step that meets anything else (the padding, the closing quote, a stray byte)
    # leaves it to the loop below, which starts at a whole group: no bits pending
    while i + 4 <= n and nb + 3 <= cap:
        v0 = _B64_VALUES[load_byte(b, i)]
        v1 = _B64_VALUES[load_byte(b, i + 1)]
        v2 = _B64_VALUES[load_byte(b, i + 2)]
        v3 = _B64_VALUES[load_byte(b, i + 3)]
        if (v0 | v1 | v2 | v3) > 63:
            break
        x = (np.int64(v0) << 18) | (np.int64(v1) << 12) | (np.int64(v2) << 6) | np.int64(v3)
        raw[nb] = (x >> 16) & 0xFF
        raw[nb + 1] = (x >> 8) & 0xFF
        raw[nb + 2] = x & 0xFF
        nb += 3
        alpha += 4
        i += 4
    while i < n:
        c = load_byte(b, i)
        if c == QUOTE:
            break
        if c == EQUALS:
            pads += 1
            i += 1
            continue
        if pads:
            return i, nb, UNUSUAL
        if UPPER_A <= c <= UPPER_Z:
            v = c - UPPER_A
        elif LOWER_A <= c <= LOWER_Z:
            v = c - LOWER_A + 26
        elif ZERO <= c <= NINE:
            v = c - ZERO + 52
        elif c == PLUS:  # the alphabet: A-Z a-z 0-9 + /
            v = 62
        elif c == SLASH:
            v = 63
        else:
            return i, nb, UNUSUAL
        alpha += 1
        acc = ((acc << 6) | v) & 0xFFFFFF
        bits += 6
        if bits >= 8:
            bits -= 8
            if nb >= cap:
                return i, nb, CAPACITY
            raw[nb] = (acc >> bits) & 0xFF
            nb += 1
        i += 1
    if i >= n:
        return i, nb, UNUSUAL
    tail = alpha % 4
    if not ((pads == 0 and tail == 0) or (pads == 1 and tail == 3) or (pads == 2 and tail == 2)):
        return i, nb, UNUSUAL
    return i + 1, nb, OK


@njit_leaf
def _record(records, at, key, item, start, end, row0, row1, ent0, ent1):  # type: ignore[no-untyped-def]
    """Row ``at`` of ``records``: which value (``key``, ``item``), where it sits in the body
    (``start .. end``), and its rows and entries (or bytes in ``raw``, for base64) in the
    output buffers."""
    records[at, R_KEY] = key
    records[at, R_ITEM] = item
    records[at, R_START] = start
    records[at, R_END] = end
    records[at, R_ROW0] = row0
    records[at, R_ROW1] = row1
    records[at, R_ENT0] = ent0
    records[at, R_ENT1] = ent1


@njit_leaf
def _key_index(b, s, e, keys, starts):  # type: ignore[no-untyped-def]
    """Which of the keys (``keys[starts[k]:starts[k + 1]]``) the raw string ``b[s:e]`` is,
    or -1."""
    for k in range(starts.shape[0] - 1):
        ks, ke = starts[k], starts[k + 1]
        if ke - ks != e - s:
            continue
        same = True
        for j in range(e - s):
            if load_byte(b, s + j) != keys[ks + j]:
                same = False
                break
        if same:
            return k
    return -1


@njit_leaf
def _same(b, s, e, word):  # type: ignore[no-untyped-def]
    if e - s != word.shape[0]:
        return False
    for j in range(e - s):  # noqa: SIM110 (numba compiles no generators)
        if load_byte(b, s + j) != word[j]:
            return False
    return True


@njit_leaf
def _save(state, phase, at, flags, rows):  # type: ignore[no-untyped-def]
    """The scan's state into ``state`` (see :data:`S_SIZE`): ``at`` its variables (i,
    depth, item, nrec, ne, nr, nb, str0, str1), ``flags`` its booleans (escaped, meta key,
    in meta) as bits 0-2, ``rows`` the rows list it is in (key, start, first entry, first
    row) or -1s. Every argument an int64 or a tuple of them, never a literal: numba would
    compile it once per literal value."""
    state[S_PHASE] = phase
    for j in range(9):
        state[S_I + j] = at[j]
    for j in range(3):
        state[S_ESCAPED + j] = (flags >> j) & 1
    for j in range(4):
        state[S_KEY + j] = rows[j]


@njit_leaf
def _flags(escaped, meta_key, in_meta):  # type: ignore[no-untyped-def]
    """The scan's three booleans as :func:`_save` takes them."""
    return np.int64(escaped) | (np.int64(meta_key) << 1) | (np.int64(in_meta) << 2)


@njit_leaf
def scan(  # type: ignore[no-untyped-def]
    b,
    batch,
    keys,
    kstarts,
    kinds,
    meta,
    lps,
    ids,
    widths,
    nulls,
    raw,
    records,
    stack,
    seen,
    state,
    stop,
):
    """Scan a whole answer (see the module docstring): ``keys`` the names of the values to
    parse, one after the other (key ``k`` is ``keys[kstarts[k]:kstarts[k + 1]]``), ``kinds``
    what each is, ``meta`` the name of the object that holds them.

    Returns ``(status, n_records, n_items, n_entries, n_rows)``. Each record is one cut
    value: key index, item, byte span in the body, rows range (rows lists) and entries range
    (for a b64 string: its bytes in ``raw``), in body order (so per key in item order).

    In slices: ``stack`` (uint8 ``[MAX_DEPTH + 1]``), ``seen`` (int64, one per key) and
    ``state`` (int64 ``[S_SIZE]``, zeros before the first call) hold the scan between
    calls. Where the next value of the body, or the next row of a rows list, starts at or
    after ``stop``, the scan saves itself and returns :data:`PAUSED`; called again with the
    same arguments and a later ``stop``, it goes on (any ``stop`` beyond the body: to the
    end). Another status ends the scan.
    """
    n = b.shape[0]
    p10 = _P10
    key_depth = 3 if batch else 2
    # counters typed int64 from the start: a literal 0 would have numba compile each
    # callee twice (once for the literal, once for int64), doubling the cold compile
    zero = np.int64(0)
    none = np.int64(-1)
    if state[S_PHASE] == P_NEW:
        for d in range(stack.shape[0]):
            stack[d] = 0  # 1 object, 2 array
        for d in range(seen.shape[0]):
            seen[d] = 0
        item0 = none if batch else zero
        _save(
            state,
            np.int64(P_BODY),
            (zero, zero, item0, zero, zero, zero, zero, none, none),
            zero,
            (none, none, none, none),
        )
    i = state[S_I]
    depth = state[S_DEPTH]
    item = state[S_ITEM]
    nrec = state[S_NREC]
    ne = state[S_NE]
    nr = state[S_NR]
    nb = state[S_NB]
    if state[S_PHASE] == P_DONE:
        return OK, nrec, item + 1, ne, nr
    s_start = state[S_STR0]
    s_end = state[S_STR1]
    s_escaped = state[S_ESCAPED] != 0
    meta_key = state[S_META_KEY] != 0  # the last key at depth key_depth - 1 was "meta_info"
    in_meta = state[S_IN_META] != 0
    # in a rows list (the scan paused in it, or it has just been opened): its key, start,
    # first entry and first row
    in_rows = state[S_PHASE] == P_ROWS
    k, start, ne0, nr0 = state[S_KEY], state[S_START], state[S_NE0], state[S_NR0]
    while True:
        if in_rows:  # the rows from the one at b[i] on (one call site: a compile's size)
            i, ne, nr, st = _rows(b, i, n, p10, lps, ids, ne, widths, nulls, nr, stop)
            if st == PAUSED:
                _save(
                    state,
                    np.int64(P_ROWS),
                    (i, depth, item, nrec, ne, nr, nb, s_start, s_end),
                    _flags(s_escaped, meta_key, in_meta),
                    (k, start, ne0, nr0),
                )
                return PAUSED, nrec, item + 1, ne, nr
            if st != OK:
                return st, nrec, item + 1, ne, nr
            _record(records, nrec, k, item, start, i, nr0, nr, ne0, ne)
            nrec += 1
            in_rows = False
            continue
        if i >= n:
            break
        if i >= stop:
            _save(
                state,
                np.int64(P_BODY),
                (i, depth, item, nrec, ne, nr, nb, s_start, s_end),
                _flags(s_escaped, meta_key, in_meta),
                (none, none, none, none),
            )
            return PAUSED, nrec, item + 1, ne, nr
        c = load_byte(b, i)
        if c == QUOTE:  # a string: skip it, remember where it was
            s_start = i + 1
            s_escaped = False
            i += 1
            while i < n:
                c = load_byte(b, i)
                if c == BACKSLASH:
                    s_escaped = True
                    i += 2
                    continue
                if c == QUOTE:
                    break
                i += 1
            if i >= n:
                return UNUSUAL, nrec, item + 1, ne, nr
            s_end = i
            i += 1
            continue
        if c == COLON:  # ':' after a key
            i = _ws(b, i + 1, n)
            if depth == key_depth - 1 and stack[depth] == 1:
                meta_key = (not s_escaped) and _same(b, s_start, s_end, meta)
                if s_escaped:
                    return UNUSUAL, nrec, item + 1, ne, nr
                continue
            if not (in_meta and depth == key_depth and stack[depth] == 1):
                continue
            if s_escaped:
                return UNUSUAL, nrec, item + 1, ne, nr
            k = _key_index(b, s_start, s_end, keys, kstarts)
            if k < 0:
                continue
            if seen[k] == item + 1:
                return UNUSUAL, nrec, item + 1, ne, nr  # a duplicate key
            seen[k] = item + 1
            if nrec >= records.shape[0]:
                return CAPACITY, nrec, item + 1, ne, nr
            if kinds[k] == B64:
                if i >= n or load_byte(b, i) != QUOTE:
                    continue  # null (or a wrong type, which msgspec names): left in place
                start, nb0 = i, nb
                i, nb, st = _b64(b, i, n, raw, nb)
                if st != OK:
                    return st, nrec, item + 1, ne, nr
                _record(records, nrec, k, item, start, i, zero, zero, nb0, nb)
                nrec += 1
                continue
            if i >= n or load_byte(b, i) != OPEN_BRACKET:
                continue  # null (or a wrong type, which msgspec names): left in place
            start, ne0, nr0 = i, ne, nr
            if kinds[k] == ENTRIES:
                i, ne, st = _entries(b, i, n, p10, lps, ids, ne)
                if st != OK:
                    return st, nrec, item + 1, ne, nr
                _record(records, nrec, k, item, start, i, nr0, nr, ne0, ne)
                nrec += 1
                continue
            i = _ws(b, i + 1, n)  # a rows list: empty, or its rows from the next turn on
            if i < n and load_byte(b, i) == CLOSE_BRACKET:
                i += 1
                _record(records, nrec, k, item, start, i, nr0, nr, ne0, ne)
                nrec += 1
            else:
                in_rows = True
            continue
        if c == OPEN_BRACE or c == OPEN_BRACKET:  # noqa: SIM109 (compares, no tuple)
            if depth >= MAX_DEPTH:
                return UNUSUAL, nrec, item + 1, ne, nr
            opened_object = c == OPEN_BRACE
            if opened_object and depth == key_depth - 1 and meta_key:
                in_meta = True
            if batch and opened_object and depth == 1 and stack[1] == 2:
                item += 1
            depth += 1
            stack[depth] = 1 if opened_object else 2
            i += 1
            continue
        if c == CLOSE_BRACE or c == CLOSE_BRACKET:  # noqa: SIM109 (compares, no tuple)
            if depth == 0:
                return UNUSUAL, nrec, item + 1, ne, nr
            if depth == key_depth:
                in_meta = False
            if depth == key_depth - 1:
                meta_key = False
            depth -= 1
            i += 1
            continue
        if c == COMMA and depth == key_depth - 1:
            meta_key = False
        i += 1
    rest = (i, depth, item, nrec, ne, nr, nb, none, none)
    _save(state, np.int64(P_DONE), rest, zero, (none, none, none, none))
    return OK, nrec, item + 1, ne, nr
