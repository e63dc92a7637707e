"""A compiled reader (numba, ``nogil``) of a rollout's flat Python lists, as
``msgspec.msgpack`` writes them: its token ids (``Sample.tokens``, ints) and its rollout
logprobs (``Sample.rollout_logprobs``, floats).

msgspec walks a list of 2,560 Python ints in ~7 us, where numpy's conversion and the check
of each element's type take ~110 us; this reader takes the bytes back into an array in a
few more. Called through :mod:`opd_stream.scanner._calls`; it calls no function of another
file and takes only :mod:`opd_stream.scanner._shared`'s names, carrying its
``SHARED_DIGEST`` (``tests/scanner/test_scanner_cache.py``). Anything but the plain form is
answered ``False`` (an id that is not a non-negative integer up to ``max_id``; a logprob
that is not a finite float64 at most ``tolerance``; another length), for numpy's
conversion to take or reject with its precise error.
"""

from __future__ import annotations

import numpy as np

from ._shared import load_be16, load_be32, load_be64, load_byte, njit_leaf

__all__ = ("SHARED_DIGEST", "read_ids", "read_logprobs")

#: :func:`opd_stream.scanner._shared.digest` of the file this one's kernels take code from
#: (an edit there must edit this file too, or numba serves its stale cache).
SHARED_DIGEST = "818ed0a9f5e24213"

# MessagePack's type bytes (its specification's names)
POSITIVE_FIXINT_MAX = 0x7F
FIXARRAY, FIXARRAY_MAX = 0x90, 0x9F
FLOAT64 = 0xCB
UINT8, UINT16, UINT32 = 0xCC, 0xCD, 0xCE
ARRAY16, ARRAY32 = 0xDC, 0xDD


@njit_leaf
def _length(b, n):  # type: ignore[no-untyped-def]
    """The msgpack array header at ``b[0]``: (index after it, length); length -1 if the
    body does not start with one."""
    if n < 1:
        return 0, -1
    c = load_byte(b, 0)
    if FIXARRAY <= c <= FIXARRAY_MAX:
        return 1, np.int64(c - FIXARRAY)
    if c == ARRAY16 and n >= 3:
        return 3, np.int64(load_be16(b, 1))
    if c == ARRAY32 and n >= 5:
        return 5, np.int64(load_be32(b, 1))
    return 0, -1


@njit_leaf
def read_ids(b, out, max_id):  # type: ignore[no-untyped-def]
    """Read ``b`` (the msgpack of a list of ``len(out)`` ints) into ``out`` (int64):
    whether it took them. msgspec writes a non-negative int in the shortest of a fixint,
    uint8, uint16 and uint32 up to 2^32 - 1; anything else (a negative int, a bool, a
    float, a larger int) and an id above ``max_id`` are not taken."""
    n = b.shape[0]
    i, m = _length(b, n)
    if m != out.shape[0]:
        return False
    for t in range(m):
        if i >= n:
            return False
        c = load_byte(b, i)
        if c <= POSITIVE_FIXINT_MAX:
            v = np.int64(c)
            i += 1
        elif c == UINT8 and i + 2 <= n:
            v = np.int64(load_byte(b, i + 1))
            i += 2
        elif c == UINT16 and i + 3 <= n:
            v = np.int64(load_be16(b, i + 1))
            i += 3
        elif c == UINT32 and i + 5 <= n:
            v = np.int64(load_be32(b, i + 1))
            i += 5
        else:
            return False
        if v > max_id:
            return False
        out[t] = v
    return i == n


@njit_leaf
def read_logprobs(b, out, out_bits, tolerance):  # type: ignore[no-untyped-def]
    """Read ``b`` (the msgpack of a list of ``len(out)`` floats) into ``out`` (float64,
    written through ``out_bits``, its uint64 view: msgpack keeps a float as its 8 IEEE
    bytes): whether it took them. A value must be a float64 (msgspec writes an int as an
    int: not taken), finite and at most ``tolerance``."""
    n = b.shape[0]
    i, m = _length(b, n)
    if m != out.shape[0]:
        return False
    for t in range(m):
        if i + 9 > n or load_byte(b, i) != FLOAT64:
            return False
        out_bits[t] = load_be64(b, i + 1)
        v = out[t]
        # NaN fails the first compare, +-inf one of the two
        if not (v <= tolerance and v > -np.inf):
            return False
        i += 9
    return i == n
