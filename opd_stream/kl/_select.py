"""Candidate-set selection for the top-k KL: which ids each position selects, packed in order.

:func:`plan_selection` turns the id rows of a batch (one id set for only-student /
only-teacher, the joined ``[S | T]`` for intersection, union and xor) into a
:class:`SelectionPlan`: per output slot the column to read the id and student value from,
the column to read the teacher value from, and the masks that clear unselected slots (id
``-1``, value ``+0.0``). Integer index work only, no Python loop over positions (numpy on
CPU, torch elsewhere); the float math is :mod:`opd_stream.kl._math`'s. Semantics:
``docs/semantics.md``, "Top-k mode". Tuning knobs and test hooks (module globals, read at
call time): ``_BROADCAST_MAX_K``, ``_EQ_CHUNK_ELEMENTS``, ``_CPU_INDEX_BACKEND``. How it
works: ``docs/design-notes.md``, "opd_stream/kl/_select.py".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ._index import Index, NumpyIndex, TorchIndex
from ._names import Strategy
from ._plan import candidate_width

__all__ = ("SelectionPlan", "plan_selection")


# Membership: broadcast equality below this k, sorted packed keys from it on.  The row sort
# wins from k = 2 on (numpy, N = 8192 rows, 1 thread: k=2 0.6 vs 1.3 ms, k=8 1.6 vs 4.8 ms,
# k=16 3.3 vs 11 ms); on CUDA both are a few kernels.
_BROADCAST_MAX_K = 2
# At most this many booleans in one broadcast equality chunk.
_EQ_CHUNK_ELEMENTS = 1 << 22
# Softmax basis of an unselected slot: exp(basis - row max) is exactly 0 in float32 whenever
# the row has a selected slot (floored logprobs are >= -1e4).
_UNSELECTED_BASIS = -1e30
_UNSELECTED_BITS = int(np.array(_UNSELECTED_BASIS, dtype=np.float32).view(np.int32))

# Which index backend CPU tensors use; tests set "torch" to run the other devices' path on CPU.
_CPU_INDEX_BACKEND = "numpy"


class SelectionPlan(NamedTuple):
    """Which base column each output slot reads: the packed selection of one batch.

    ``src`` / ``tsrc``: flat ``[N * C]`` indices into the row-major ``[N, W]`` bases of the
    slot's id and student value / of its teacher value; ``keep``: int32 ``[N, C]``, ``-1`` on
    selected slots and ``0`` elsewhere; ``mask`` / ``unsel``: bool ``[N, C]``, True on
    selected / on unselected slots; ``basis``: int32 ``[N, C]``, ``0`` on selected slots and
    the bits of ``_UNSELECTED_BASIS`` elsewhere, when asked for (OR-ed into the cleared
    values: the softmax's input), else None; ``empty_rows``: some row selects nothing.
    """

    src: Tensor
    tsrc: Tensor
    keep: Tensor
    mask: Tensor
    unsel: Tensor
    basis: Tensor | None
    empty_rows: bool


def _bits(n: int) -> int:
    """Bits needed to hold ``0 .. n - 1`` (at least 1)."""
    return max(1, (n - 1).bit_length())


def plan_selection(
    strategy: Strategy, ids_t: Tensor, ks: int, row_valid_t: Tensor | None, basis: bool
) -> SelectionPlan | None:
    """Decide each position's selected candidates and pack them to the front, in order.

    Args:
        strategy: The strategy.
        ids_t: int64 ``[N, W]``: only-*: the one id set; else the joined ``[S | T]`` (``ks``
            columns of ``S``).
        ks: Width of ``S`` (only-*: ``W``).
        row_valid_t: bool ``[N]`` or None (all valid).
        basis: Also make :attr:`SelectionPlan.basis`.

    Returns:
        None when every slot is selected and already in place (only-* without empty slots),
        else the :class:`SelectionPlan`.

    Every selected candidate is a column of the row, and the strategy's order is column order, so
    packing is a row sort of ``unselected << 2b | column << b | teacher column`` keys (``b``
    bits per column); the low bits carry the column to read the teacher value from (the
    ``T`` twin of an ``S`` id that is also in ``T``, for union and intersection).
    Membership comes from a row sort of packed ``id << b | column`` keys, where an id in both
    sets sorts as a pair, ``S`` then ``T`` (ids are distinct within ``S`` and within ``T``),
    or, for small k (``_BROADCAST_MAX_K``) or ids too large to pack, a broadcast equality.
    """
    if ids_t.device.type == "cpu" and _CPU_INDEX_BACKEND == "numpy":
        xp: Index = NumpyIndex()
    else:
        xp = TorchIndex(ids_t.device)
    ids = xp.asarray(ids_t)
    row_valid = None if row_valid_t is None else xp.asarray(row_valid_t)
    w = ids.shape[1]
    b = _bits(w)
    kdt = xp.i32 if 2 * b + 1 <= 31 else xp.i64
    if strategy in ("only-student", "only-teacher"):
        unsel = ids < 0
        if row_valid is not None:
            unsel |= ~row_valid[:, None]
        if not xp.has(unsel):
            return None
        col = xp.arange(0, w, 1, kdt)
        keys = (xp.cast(unsel, kdt) << (2 * b)) | (col << b) | col
        return _unpack(xp, xp.sort_rows(keys), b, w, basis)
    kt = w - ks
    lo, hi = xp.minmax(ids)
    if min(ks, kt) == 0 or max(ks, kt) < _BROADCAST_MAX_K or hi >= 1 << (63 - b):
        unsel, key = _membership_other(xp, strategy, ids, ks, kdt, b)
    elif isinstance(xp, NumpyIndex) and hi < 1 << (31 - b) and 2 * b + 1 <= 31:
        return _plan_sorted_numpy(strategy, ids, ks, row_valid, lo, basis)
    else:
        unsel, key = _membership_sorted(xp, strategy, ids, ks, kdt, b, lo, hi)
    if row_valid is not None:
        unsel |= ~row_valid[:, None]
    c = candidate_width(strategy, ks, w - ks)
    return _unpack(xp, xp.sort_rows((xp.cast(unsel, kdt) << (2 * b)) | key)[:, :c], b, w, basis)


def _unpack(xp: Index, srt: Any, b: int, w: int, basis: bool) -> SelectionPlan:
    """The :class:`SelectionPlan` of row-sorted ``unselected << 2b | column << b | teacher column``
    keys ``[N, C]``, for row-major ``[N, W]`` bases (a flat index is ``row * W + column``)."""
    n = srt.shape[0]
    low = (1 << b) - 1
    idt = xp.i32 if xp.small_index and n * w < 2**31 else xp.i64
    rows = xp.arange(0, n * w, w, idt)[:, None]
    unsel = srt >> (2 * b)
    keep = xp.cast(unsel, xp.i32) - 1
    return SelectionPlan(
        src=xp.tensor(xp.cast((srt >> b) & low, idt) + rows).reshape(-1),
        tsrc=xp.tensor(xp.cast(srt & low, idt) + rows).reshape(-1),
        keep=xp.tensor(keep),
        mask=xp.tensor(unsel == 0),
        unsel=xp.tensor(unsel != 0),
        basis=xp.tensor(~keep & _UNSELECTED_BITS) if basis else None,
        empty_rows=n > 0 and xp.has(unsel[:, 0] != 0),
    )


def _membership_other(xp: Index, strategy: str, ids: Any, ks: int, kdt: Any, b: int) -> Any:
    """:func:`_membership_sorted` when a set is empty (nothing is in both), for small k, or
    for ids too large to pack: by broadcast equality ``[rows, Ks, Kt]``, chunked so that at
    most ``_EQ_CHUNK_ELEMENTS`` booleans exist at once; slots in column order."""
    n, w = ids.shape
    kt = w - ks
    col = xp.arange(0, w, 1, kdt)
    if ks == 0 or kt == 0:
        nothing = xp.zeros((n, w), xp.b8)
        return _classify(xp, strategy, ids < 0, nothing, nothing, col, col, kdt, b)
    s_ids, t_ids = ids[:, :ks], ids[:, ks:]
    rows_per_chunk = max(1, _EQ_CHUNK_ELEMENTS // (ks * kt))
    parts = []
    for i in range(0, n, rows_per_chunk):
        s, t = s_ids[i : i + rows_per_chunk], t_ids[i : i + rows_per_chunk]
        eq = (s[:, :, None] == t[:, None, :]) & (s >= 0)[:, :, None]
        parts.append((xp.any(eq, 2), xp.argmax(eq, 2), xp.any(eq, 1)))
    s_in, s_match, t_in = (xp.cat_rows([p[j] for p in parts]) for j in range(3))
    s_in_t = xp.cat((s_in, xp.zeros((n, kt), xp.b8)))
    t_in_s = xp.cat((xp.zeros((n, ks), xp.b8), t_in))
    twin = xp.cat((xp.cast(s_match, kdt) + ks, xp.zeros((n, kt), kdt) + col[ks:]))
    return _classify(xp, strategy, ids < 0, s_in_t, t_in_s, col, twin, kdt, b)


def _membership_sorted(
    xp: Index, strategy: str, ids: Any, ks: int, kdt: Any, b: int, lo: int, hi: int
) -> Any:
    """Per slot of the joined row ``[S | T]``, in the order of a row sort of packed
    ``id << b | column`` keys: ``unselected`` and ``column << b | teacher column`` (see
    :func:`_classify`).  Every negative id is an empty slot; ids are below ``2**(63 - b)``."""
    n, w = ids.shape
    if lo < -1:
        ids = xp.clip_neg(ids)
    sdt = xp.i32 if hi < 1 << (31 - b) else xp.i64
    srt = xp.sort_rows((xp.cast(ids, sdt) << b) | xp.arange(0, w, 1, sdt))
    sid = srt >> b
    scol = xp.cast(srt & ((1 << b) - 1), kdt)
    # An S id in T sorts right before its T twin: pair (p, p + 1).
    pair = (sid[:, 1:] == sid[:, :-1]) & (sid[:, 1:] >= 0)
    none = xp.zeros((n, 1), xp.b8)
    s_in_t = xp.cat((pair, none))  # at the S slot of a pair
    t_in_s = xp.cat((none, pair))  # at the T slot of a pair
    twin = xp.cat((scol[:, 1:], scol[:, -1:]))  # the next slot's column
    return _classify(xp, strategy, sid < 0, s_in_t, t_in_s, scol, twin, kdt, b)


def _classify(
    xp: Index,
    strategy: str,
    hole: Any,
    s_in_t: Any,
    t_in_s: Any,
    col: Any,
    twin: Any,
    kdt: Any,
    b: int,
) -> tuple[Any, Any]:
    """``(unselected, column << b | teacher column)`` per slot (``docs/semantics.md``,
    "Top-k mode").

    ``s_in_t``: an ``S`` slot whose id is in ``T``, ``twin`` its ``T`` column; ``t_in_s``: a
    ``T`` slot whose id is in ``S``; ``hole``: an empty slot.
    """
    if strategy == "xor":
        return hole | s_in_t | t_in_s, (col << b) | col
    tcol = col + xp.cast(s_in_t, kdt) * (twin - col)
    unsel = hole | t_in_s if strategy == "union" else ~s_in_t  # intersection: S ids in T
    return unsel, (col << b) | tcol


def _plan_sorted_numpy(
    strategy: Strategy, ids: Any, ks: int, row_valid: Any, lo: int, basis: bool
) -> SelectionPlan:
    """:func:`plan_selection` for intersection, union and xor on numpy when ``id << b | column``
    fits int32: the two row sorts of :func:`_membership_sorted` and :func:`plan_selection`, written
    as in-place passes over flat arrays of one scratch block (on one CPU thread numpy is slow
    on ``[N, small]`` slices, and every fresh array can cost page faults)."""
    n, w = ids.shape
    size = n * w
    c = candidate_width(strategy, ks, w - ks)
    b = _bits(w)
    low = (1 << b) - 1
    idt: Any = np.int32 if size < 2**31 else np.int64
    isz = np.dtype(idt).itemsize
    # Scratch: keys (int32) | work (index dtype) | out (index dtype) | pair | unsel (bool).
    block = np.empty(size * (4 + 2 * isz + 2), dtype=np.uint8)
    keys = block[: 4 * size].view(np.int32)
    work = block[4 * size : (4 + isz) * size].view(idt)
    out = block[(4 + isz) * size : (4 + 2 * isz) * size].view(idt)
    pair = block[(4 + 2 * isz) * size : (5 + 2 * isz) * size].view(np.bool_)
    unsel = block[(5 + 2 * isz) * size :].view(np.bool_)
    keys2d = keys.reshape(n, w)

    np.left_shift(ids if lo >= -1 else np.maximum(ids, -1), b, out=keys2d, casting="unsafe")
    keys2d |= np.arange(w, dtype=np.int32)
    keys2d.sort(axis=1)
    # pair[p]: sorted slots p (an S id) and p + 1 (its T twin) hold the same id, >= 0.
    tmp = work[: size - 1].view(np.uint32 if isz == 4 else np.uint64)[: size - 1]
    u = keys.view(np.uint32)
    np.bitwise_xor(u[1:], u[:-1], out=tmp, casting="unsafe")
    np.less(tmp, 1 << b, out=pair[:-1])
    pair[w - 1 :: w] = False  # a row's last slot: the next slot is another row's
    if lo < 0:
        np.less(keys, 0, out=unsel)  # holes (sorted first in a row)
        pair &= ~unsel
    else:
        unsel[:] = False
    keys &= low  # now each slot's column
    # The teacher column of each slot, in work: its T twin's for an S id in T (union,
    # intersection), else its own.
    tcol = work[:size]
    if strategy == "xor":
        tcol[:] = keys
        unsel |= pair
    else:
        twin = tcol[: size - 1]
        np.subtract(keys[1:], keys[:-1], out=twin, casting="unsafe")
        twin *= pair[:-1]
        twin += keys[:-1]
        tcol[size - 1] = keys[size - 1]
    if strategy == "intersection":
        np.logical_not(pair, out=unsel)  # an S id not in T (and every T slot)
    else:
        unsel[1:] |= pair[:-1]  # the T twin of a pair: its id is S's
    if row_valid is not None:
        unsel.reshape(n, w)[~row_valid] = True
    keys <<= b
    keys |= tcol
    np.copyto(work, unsel)  # (bool to int: a plain cast is numpy's fast loop)
    work <<= 2 * b
    keys |= work
    keys2d.sort(axis=1)

    srt = keys2d[:, :c]
    rows = np.arange(0, size, w, dtype=idt)[:, None]
    src = out[: n * c].reshape(n, c)
    np.right_shift(srt, b, out=src, casting="unsafe")
    src &= low
    src += rows
    tsrc = work[: n * c].reshape(n, c)
    np.bitwise_and(srt, low, out=tsrc, casting="unsafe")
    tsrc += rows
    keep = keys2d[:, :c]
    keep >>= 2 * b
    keep -= 1  # -1 selected, 0 not
    mask = pair[: n * c].reshape(n, c)
    np.not_equal(keep, 0, out=mask)
    np.logical_not(mask, out=unsel[: n * c].reshape(n, c))
    nb = None
    if basis:
        nb = np.invert(keep)
        nb &= _UNSELECTED_BITS
    return SelectionPlan(
        src=torch.from_numpy(out[: n * c]),
        tsrc=torch.from_numpy(work[: n * c]),
        keep=torch.from_numpy(np.ascontiguousarray(keep)),
        mask=torch.from_numpy(mask),
        unsel=torch.from_numpy(unsel[: n * c].reshape(n, c)),
        basis=None if nb is None else torch.from_numpy(nb),
        empty_rows=n > 0 and not bool(mask[:, 0].all()),
    )
