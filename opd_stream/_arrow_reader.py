"""pyarrow's JSON reader, fed one answer object per row, and the checked arrays it gives.

Shared by the pyarrow fast paths (:mod:`opd_stream._decode_arrow` for scoring answers,
:mod:`opd_stream._decode_arrow_generate` for sampling answers): :func:`read_rows` parses a
body (GIL released) against an explicit schema, :class:`ArrowEntries` / :class:`ArrowRows`
check the ``[logprob, id, ...]`` entries the way msgspec's types would (``ok`` False where
msgspec would reject them), :func:`gather` builds index ranges.

Two leniencies are inherent: the reader parses an entry's numbers as doubles, so a token id
written as an integral float (``5.0``) is read as ``5`` here, where msgspec rejects it; and
it skips an unknown field nested deeper than msgspec's depth limit (~1000 levels), where
msgspec fails the answer as malformed. No SGLang release writes either.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from ._answers import Body
from ._decode_checks import spread

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

__all__ = ("Answers", "ArrowAnswers", "Reader", "ArrowEntries", "ArrowRows", "gather", "read_rows")

_I64_LIMIT = 2.0**63
_MAX_BODY = 2**31 - 64  # the reader's block size is an int32

_SINGLE_SHAPE = re.compile(rb"[ \t\r\n]*\{")
_BATCH_SHAPE = re.compile(rb"[ \t\r\n]*\[[ \t\r\n]*(?=\{)")
_BATCH_END = re.compile(rb"\}[ \t\r\n]*\][ \t\r\n]*\Z")
_ITEM_SEP = b"},{"


def _ndjson(body: Body, batch: bool) -> tuple[Body, int] | None:
    """The bytes to give the reader (one object per row) and the rows they must hold.

    The reader takes newline-delimited objects, not a JSON array, so a batch answer
    ``[{...},{...}]`` (SGLang writes it compactly) is handed over as its items with each
    ``},{`` turned into ``}\n{``. That edit is only valid JSON where the separator really
    sits between two items: inside a string it would put a raw newline there, inside a
    nested array it would drop a comma, and the reader rejects both; any other row
    boundary makes the row count differ from the separators counted. A body that does not
    open with an object (or, batch, ``[{``) is not given to the reader at all: a
    top-level ``null`` crashes it (pyarrow 16-25).
    """
    if not batch:
        return (body, 1) if _SINGLE_SHAPE.match(body) else None
    head, tail = _BATCH_SHAPE.match(body), _BATCH_END.search(body)
    if head is None or tail is None or tail.start() < head.end():
        return None
    inner = bytes(body[head.end() : tail.start() + 1])  # (a copy: the edit makes one anyway)
    return inner.replace(_ITEM_SEP, b"}\n{"), inner.count(_ITEM_SEP) + 1


def read_rows(body: Body, batch: bool, schema: Any) -> Any:
    """The reader's table (a row per item), or ``None``."""
    import pyarrow as pa
    import pyarrow.json as pj

    if not 0 < len(body) < _MAX_BODY:
        return None
    prepared = _ndjson(body, batch)
    if prepared is None:
        return None
    data, rows = prepared
    try:
        table = pj.read_json(
            pa.py_buffer(data),
            read_options=pj.ReadOptions(use_threads=False, block_size=len(data) + 1),
            parse_options=pj.ParseOptions(
                explicit_schema=schema,
                unexpected_field_behavior="ignore",
                newlines_in_values=True,
            ),
        )
    except (pa.ArrowException, ValueError):
        return None
    if table.num_rows != rows:  # e.g. two objects where one was sent
        return None
    return table


class ArrowEntries:
    """The entries of one ``list<list<double>>`` (``[logprob, id, ...]`` each), checked.

    ``ok`` is False when msgspec would reject any entry: a null entry, fewer than 2
    elements, a null / non-integral / out-of-int64 id, or a NaN / infinite literal anywhere.
    """

    __slots__ = ("ids", "lps", "ok")

    def __init__(self, arr: pa.ListArray) -> None:
        self.ok = False
        self.ids: npt.NDArray[np.float64] = np.empty(0)
        self.lps: npt.NDArray[np.float64] = np.empty(0)
        if arr.null_count:
            return
        off = arr.offsets.to_numpy()
        starts = off[:-1]
        if starts.size and int(np.diff(off).min()) < 2:
            return
        values = arr.values
        v = values.to_numpy(zero_copy_only=False)  # null -> NaN
        valid = None if values.null_count == 0 else ~values.is_null().to_numpy(zero_copy_only=False)
        finite = np.isfinite(v)
        if valid is None:
            if not finite.all():
                return
        elif (valid & ~finite).any():
            return
        ids = v[starts + 1]
        if ids.size and (
            not (np.floor(ids) == ids).all() or float(np.abs(ids).max()) >= _I64_LIMIT
        ):
            return  # NaN (a null id) fails the first test
        self.ids, self.lps, self.ok = ids, v[starts], True

    @classmethod
    def of(cls, ids: npt.NDArray[np.float64], lps: npt.NDArray[np.float64]) -> ArrowEntries:
        """Entries another reader already checked (ids as doubles, NaN for null)."""
        out = cls.__new__(cls)
        out.ids, out.lps, out.ok = ids, lps, True
        return out


class ArrowRows:
    """A ``list<list<list<double>>>`` field (rows of entries, a row may be null), checked."""

    __slots__ = ("entries", "entry_off", "item_null", "item_off", "ok", "row_null", "row_width")

    def __init__(self, field: pa.ListArray) -> None:
        self.item_null = field.is_null().to_numpy(zero_copy_only=False)
        self.item_off = field.offsets.to_numpy()
        rows = field.values
        self.row_null = rows.is_null().to_numpy(zero_copy_only=False)
        self.entry_off = rows.offsets.to_numpy()
        self.row_width = np.diff(self.entry_off)
        self.entries = ArrowEntries(rows.values)
        self.ok = self.entries.ok

    @classmethod
    def of(
        cls,
        item_null: npt.NDArray[np.bool_],
        item_off: npt.NDArray[np.intp],
        row_null: npt.NDArray[np.bool_],
        row_width: npt.NDArray[np.intp],
        entries: ArrowEntries,
    ) -> ArrowRows:
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
    """Every item's ``meta_info``, parsed into checked columns by a reader (pyarrow's, or
    the compiled scanner of :mod:`opd_stream._jit_reader`)."""

    def __len__(self) -> int: ...

    def values(self, name: str) -> list[Any]:
        """A scalar or string field's value per item (``None`` where null or absent)."""

    def finish_types(self) -> list[str | None]: ...

    def b64(self, name: str) -> list[bytes | None] | None:
        """A base64 string field decoded per item (``None`` where null or absent), or
        ``None`` when one is not valid base64 (``b64decode(validate=True)``)."""

    def entries(self, name: str) -> tuple[ArrowEntries, npt.NDArray[np.intp]] | None:
        """A list-of-entries field of every item and each item's entry offsets, or
        ``None`` when an item lacks it."""

    def rows(self, name: str) -> ArrowRows:
        """A list-of-rows field of every item."""


#: Parses a body (``batch``: a JSON array of items) into :class:`Answers`, or ``None``.
Reader = Callable[[Body, bool], "Answers | None"]


class ArrowAnswers:
    """Every item's ``meta_info`` as the reader parsed it (a ``StructArray``), seen through
    the accessors the scoring decoder uses (:mod:`opd_stream._decode_arrow`)."""

    __slots__ = ("_metas",)

    def __init__(self, metas: pa.StructArray) -> None:
        self._metas = metas

    def __len__(self) -> int:
        return len(self._metas)

    def values(self, name: str) -> list[Any]:
        """A field's value per item (``None`` where null or absent)."""
        return self._metas.field(name).to_pylist()  # type: ignore[no-any-return]

    def finish_types(self) -> list[str | None]:
        return self._metas.field("finish_reason").field("type").to_pylist()  # type: ignore[no-any-return]

    def b64(self, name: str) -> list[bytes | None] | None:
        try:
            return [
                None if text is None else base64.b64decode(text, validate=True)
                for text in self.values(name)
            ]
        except (binascii.Error, ValueError):
            return None

    def entries(self, name: str) -> tuple[ArrowEntries, npt.NDArray[np.intp]] | None:
        """A list-of-entries field of every item and each item's entry offsets, or
        ``None`` when an item lacks it."""
        field = self._metas.field(name)
        if field.null_count:
            return None
        return ArrowEntries(field.values), field.offsets.to_numpy()

    def rows(self, name: str) -> ArrowRows:
        return ArrowRows(self._metas.field(name))


def gather(starts: npt.NDArray[np.intp], widths: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
    """Concatenated ``arange(s, s + w)`` for each (s, w)."""
    total = int(widths.sum())
    base = spread(starts - (np.cumsum(widths) - widths), widths)
    return base + np.arange(total, dtype=np.intp)
