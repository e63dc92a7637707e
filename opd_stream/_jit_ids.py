"""The compiled writer of per-position id rows for request payloads (numba, ``nogil``).

Its own module: numba caches a compiled function keyed on its file alone, and this one
calls nothing from the scan's file (:mod:`opd_stream._jit_kernel`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._jit_kernel import njit_cached

__all__ = ("id_rows_json",)


@njit_cached
def _write_id_rows(ids, out):  # type: ignore[no-untyped-def]
    """``ids`` (int64 ``[R, k]``, each in ``[0, 2^62)``) as ``[a,b],[c,d]`` into ``out``;
    the bytes written, or -1 for an id out of that range."""
    digits = np.empty(20, dtype=np.uint8)
    pos = 0
    for r in range(ids.shape[0]):
        if r:
            out[pos] = 44
            pos += 1
        out[pos] = 91
        pos += 1
        for j in range(ids.shape[1]):
            if j:
                out[pos] = 44
                pos += 1
            v = ids[r, j]
            if v < 0 or v >= 4611686018427387904:
                return -1
            nd = 0
            while True:
                digits[nd] = 48 + v % 10
                v //= 10
                nd += 1
                if v == 0:
                    break
            for t in range(nd - 1, -1, -1):
                out[pos] = digits[t]
                pos += 1
        out[pos] = 93
        pos += 1
    return pos


def id_rows_json(ids: Any) -> bytes | None:
    """``[a,b],[c,d]`` for int64 ``ids [R, k]`` (rows of non-negative ids), the same bytes
    as ``msgspec.json.encode(ids.tolist())[1:-1]``; ``None`` for a negative id. The GIL is
    released while it writes."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    r, k = ids.shape
    out = np.empty(max(r * (3 + 21 * k), 1), dtype=np.uint8)  # "[...]," and "digits,"
    n = _write_id_rows(ids, out)
    return None if n < 0 else out[:n].tobytes()
