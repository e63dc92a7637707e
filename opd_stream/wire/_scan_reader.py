"""The compiled scanner (:mod:`opd_stream.scanner._scan`) as a reader of scoring answers.

:func:`read_answers_jit` runs the scan (GIL released), decodes the envelope with the msgspec
decoder's own types (:func:`opd_stream.wire._decode_score.decode_metas`), and hands the
column decoder (:mod:`opd_stream.wire._decode_columns`) checked columns
(:mod:`opd_stream.wire._columns`). An answer the scan does not take, or whose envelope does
not decode, gives ``None``: msgspec decodes it. Until the kernels are ready
(:mod:`opd_stream.scanner._loader`), and without numba, it gives ``None``. In full:
``docs/design-notes.md``, "opd_stream/wire/_scan_reader.py".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..scanner._loader import compiled
from ..scanner._types import Kernels, Scan, ScanSlices, scan_schema
from ._answers import Body
from ._columns import EntryColumns, RowColumns
from ._decode_score import B64, ENVELOPE, SCANNED, decode_metas

__all__ = ("JitAnswers", "read_answers_jit", "read_scanned", "scan_slices")

#: What the scan parses: the msgspec decoder's schema (:data:`opd_stream.wire._decode_score.
#: SCANNED`), handed to the kernel with every answer.
_SCHEMA = scan_schema(SCANNED, ENVELOPE)


def read_answers_jit(body: Body, batch: bool) -> JitAnswers | None:
    """Every item's ``meta_info``, the logprob lists scanned into arrays, or ``None``
    (scanner not ready, or an answer it does not take)."""
    kernel = compiled()
    if kernel is None or not body:
        return None
    return _answers(body, batch, kernel.run_scan(body, batch, _SCHEMA), kernel)


def scan_slices(body: Body, batch: bool) -> ScanSlices | None:
    """The scan of :func:`read_answers_jit` for a caller that runs it a slice at a time,
    then reads the answer with :func:`read_scanned`; ``None`` when the scanner is not ready
    (or the body is empty)."""
    kernel = compiled()
    if kernel is None or not body:
        return None
    return kernel.sliced_scan(body, batch, _SCHEMA)


def read_scanned(body: Body, batch: bool, scanned: Scan) -> JitAnswers | None:
    """:func:`read_answers_jit` of a body already scanned (:func:`scan_slices`)."""
    kernel = compiled()
    if kernel is None:  # (it never goes away once ready)
        return None
    return _answers(body, batch, scanned, kernel)


def _answers(body: Body, batch: bool, got: Scan, kernel: Kernels) -> JitAnswers | None:
    if got.status != kernel.OK:
        return None
    records: list[list[int]] = got.records.tolist()  # (one call: a few dozen records)
    r_key, r_start, r_end, r_item = kernel.R_KEY, kernel.R_START, kernel.R_END, kernel.R_ITEM
    kinds = _SCHEMA.kinds
    view = memoryview(body)
    pieces: list[bytes | memoryview] = []
    pos = 0
    for r in records:
        pieces += (view[pos : r[r_start]], b'""' if kinds[r[r_key]] == B64 else b"[]")
        pos = r[r_end]
    pieces.append(view[pos:])
    metas = decode_metas(b"".join(pieces), batch)
    if metas is None or len(metas) != got.n_items:
        return None
    keys = _SCHEMA.keys
    by_key: dict[int, list[list[int]]] = {}
    for r in records:
        # the envelope must agree with the scan
        key = r[r_key]
        if getattr(metas[r[r_item]], keys[key]) != ("" if kinds[key] == B64 else []):
            return None
        by_key.setdefault(key, []).append(r)
    return JitAnswers(metas, got, kernel, by_key)


class JitAnswers:
    """:class:`~opd_stream.wire._columns.Answers` from the scan: the cut lists' columns
    come from the kernel's buffers, everything else from the decoded envelope."""

    __slots__ = ("_by_key", "_ids", "_k", "_keys", "_lps", "_metas", "_nulls", "_raw", "_widths")

    def __init__(
        self,
        metas: Sequence[Any],
        scan: Scan,
        kernel: Kernels,
        by_key: dict[int, list[list[int]]],
    ) -> None:
        """``by_key``: ``scan.records`` as lists, by key (each key's in the scan's order)."""
        self._metas, self._keys, self._raw = metas, _SCHEMA.keys, scan.raw
        self._lps, self._ids = scan.lps, scan.ids
        self._widths, self._nulls, self._k = scan.widths, scan.nulls, kernel
        self._by_key = by_key

    def __len__(self) -> int:
        return len(self._metas)

    def values(self, name: str) -> list[Any]:
        return [getattr(m, name) for m in self._metas]

    def finish_types(self) -> list[str | None]:
        return [None if m.finish_reason is None else m.finish_reason.type for m in self._metas]

    def b64(self, name: str) -> list[bytes | None] | None:
        k = self._k
        out: list[bytes | None] = [None] * len(self._metas)
        for n, r in enumerate(self._records(name)):
            if r is not None:
                out[n] = self._raw[r[k.R_ENT0] : r[k.R_ENT1]].tobytes()
            elif getattr(self._metas[n], name) is not None:
                return None  # a string the scan did not decode: cannot happen, but be sure
        return out

    def _records(self, name: str) -> list[list[int] | None]:
        """The record of ``name`` per item (``None``: null or absent)."""
        k = self._k
        out: list[list[int] | None] = [None] * len(self._metas)
        for r in self._by_key.get(self._keys.index(name), ()):
            out[r[k.R_ITEM]] = r
        return out

    def _entries_of(self, recs: list[list[int]]) -> EntryColumns:
        k = self._k
        spans = [(r[k.R_ENT0], r[k.R_ENT1]) for r in recs]
        lps = _cat([self._lps[a:b] for a, b in spans], np.float64)
        ids = _cat([self._ids[a:b] for a, b in spans], np.int64)
        return EntryColumns.of(ids, lps)  # (int64: doubles only if a check reads them)

    def entries(self, name: str) -> tuple[EntryColumns, npt.NDArray[np.intp]] | None:
        recs = self._records(name)
        if any(r is None for r in recs):
            return None
        present = [r for r in recs if r is not None]
        k = self._k
        counts = np.array([r[k.R_ENT1] - r[k.R_ENT0] for r in present], dtype=np.intp)
        offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.intp)
        return self._entries_of(present), offsets

    def rows(self, name: str) -> RowColumns:
        k = self._k
        recs = self._records(name)
        present = [r for r in recs if r is not None]
        if not present:  # null or absent in every item (the fields a request did not ask)
            return _absent_rows(len(recs))
        item_null = np.array([r is None for r in recs], dtype=bool)
        counts = np.array([0 if r is None else r[k.R_ROW1] - r[k.R_ROW0] for r in recs])
        item_off = np.concatenate(([0], np.cumsum(counts))).astype(np.intp)
        spans = [(r[k.R_ROW0], r[k.R_ROW1]) for r in present]
        row_width = _cat([self._widths[a:b] for a, b in spans], np.int32).astype(np.intp)
        row_null = _cat([self._nulls[a:b] for a, b in spans], np.uint8).astype(bool)
        return RowColumns.of(item_null, item_off, row_null, row_width, self._entries_of(present))


_NO_ROWS = np.empty(0, dtype=np.intp)
_NO_ROWS.flags.writeable = False


@functools.lru_cache(maxsize=64)
def _absent_rows(n: int) -> RowColumns:
    """The rows of a field null or absent in each of ``n`` items (its arrays read-only:
    one object serves every answer of ``n`` items)."""
    empty = EntryColumns.of(_frozen(np.empty(0)), _frozen(np.empty(0)))
    none = _frozen(np.ones(n, dtype=bool))
    rows = RowColumns.of(none, _frozen(np.zeros(n + 1, np.intp)), none[:0], _NO_ROWS, empty)
    _frozen(rows.entry_off)
    return rows


def _frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    a.flags.writeable = False
    return a


def _cat(parts: list[npt.NDArray[Any]], dtype: Any) -> npt.NDArray[Any]:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
