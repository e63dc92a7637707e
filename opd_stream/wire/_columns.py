"""The checked columns a reader parses an answer into (:class:`Answers`), which the column
decoder (:mod:`opd_stream.wire._decode_columns`) checks in vectorised passes.

The one reader is the compiled scanner (:mod:`opd_stream.wire._scan_reader`): :class:`EntryColumns`
and :class:`RowColumns` hold what it parsed, already checked the way msgspec's types check
them; :func:`gather` builds index ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ._answers import Body
from ._checks import spread

__all__ = ("Answers", "EntryColumns", "Reader", "RowColumns", "gather")


class EntryColumns:
    """The entries of a list-of-entries field (``[logprob, id, ...]`` each) as columns:
    ids (:attr:`ids` as doubles, exact: the reader takes ids below 2^53 only; :attr:`ints`
    as int64 where the reader gave them so) and logprobs (NaN for null)."""

    __slots__ = ("_ids", "ints", "lps", "ok")

    _ids: npt.NDArray[np.float64] | None
    ints: npt.NDArray[np.int64] | None
    lps: npt.NDArray[np.float64]
    ok: bool

    @classmethod
    def of(
        cls, ids: npt.NDArray[np.float64] | npt.NDArray[np.int64], lps: npt.NDArray[np.float64]
    ) -> EntryColumns:
        """Entries another reader already checked (ids as doubles or as int64, NaN for
        null). int64 ids become doubles only when :attr:`ids` is first read."""
        out = cls.__new__(cls)
        if ids.dtype == np.int64:
            out._ids, out.ints = None, ids  # type: ignore[assignment]
        else:
            out._ids, out.ints = np.asarray(ids, dtype=np.float64), None
        out.lps, out.ok = lps, True
        return out

    @property
    def ids(self) -> npt.NDArray[np.float64]:
        """The ids as doubles (made from :attr:`ints` on first use)."""
        if self._ids is None:
            assert self.ints is not None
            self._ids = self.ints.astype(np.float64)
        return self._ids


class RowColumns:
    """A list-of-rows field (rows of entries, a row may be null) as columns."""

    __slots__ = ("entries", "entry_off", "item_null", "item_off", "ok", "row_null", "row_width")

    entries: EntryColumns
    entry_off: npt.NDArray[np.intp]
    item_null: npt.NDArray[np.bool_]
    item_off: npt.NDArray[np.intp]
    ok: bool
    row_null: npt.NDArray[np.bool_]
    row_width: npt.NDArray[np.intp]

    @classmethod
    def of(
        cls,
        item_null: npt.NDArray[np.bool_],
        item_off: npt.NDArray[np.intp],
        row_null: npt.NDArray[np.bool_],
        row_width: npt.NDArray[np.intp],
        entries: EntryColumns,
    ) -> RowColumns:
        """Rows another reader already parsed: per item its rows (``item_off``), per row
        its width (a null row is 0 wide)."""
        out = cls.__new__(cls)
        out.item_null, out.item_off = item_null, item_off
        out.row_null, out.row_width = row_null, row_width
        out.entry_off = np.concatenate(([0], np.cumsum(row_width)))
        out.entries, out.ok = entries, entries.ok
        return out

    def count(self, n: int) -> int:
        return int(self.item_off[n + 1] - self.item_off[n])


class Answers(Protocol):
    """Every item's ``meta_info``, parsed into checked columns by a reader (the compiled
    scanner of :mod:`opd_stream.wire._scan_reader`)."""

    def __len__(self) -> int: ...

    def values(self, name: str) -> list[Any]:
        """A scalar or string field's value per item (``None`` where null or absent)."""

    def finish_types(self) -> list[str | None]: ...

    def b64(self, name: str) -> list[bytes | None] | None:
        """A base64 string field decoded per item (``None`` where null or absent), or
        ``None`` when one is not valid base64 (``b64decode(validate=True)``)."""

    def entries(self, name: str) -> tuple[EntryColumns, npt.NDArray[np.intp]] | None:
        """A list-of-entries field of every item and each item's entry offsets, or
        ``None`` when an item lacks it."""

    def rows(self, name: str) -> RowColumns:
        """A list-of-rows field of every item."""


#: Parses a body (``batch``: a JSON array of items) into :class:`Answers`, or ``None``.
Reader = Callable[[Body, bool], "Answers | None"]


def gather(starts: npt.NDArray[np.intp], widths: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
    """Concatenated ``arange(s, s + w)`` for each (s, w)."""
    total = int(widths.sum())
    base = spread(starts - (np.cumsum(widths) - widths), widths)
    return base + np.arange(total, dtype=np.intp)
