"""The rollout engine's student top-k (``Sample.student_top_logprobs``) as arrays.

Two forms, both validated once at intake by :func:`opd_stream._sample.prepare_sample`:
rows of ``[logprob, token_id(, text)]`` entries (:func:`parse_student_topk`) and a pair of
``[R, >= k]`` arrays (:func:`student_topk_arrays`). Short and empty rows are padded at
their end with id :data:`PAD_ID` (logprob ``-inf``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import InvalidSampleError
from ..scanner._loader import compiled
from ._checks import LOGPROB_TOLERANCE
from ._entries import ENTRY_ID, ENTRY_LP, Entry

__all__ = (
    "MAX_TOKEN_ID",
    "PAD_ID",
    "ENTRIES_PER_SLICE",
    "ROWS_PER_SLICE",
    "ROW_ENTRY_BYTES",
    "RowsRead",
    "joined_rows_msgpack",
    "parse_student_topk",
    "rows_convert_in_thread",
    "rows_msgpack_slices",
    "rows_read_slices",
    "student_topk_arrays",
)

#: The id of a padding slot in student top-k arrays: a row with fewer than ``k`` entries
#: is padded at its end with it (logprob ``-inf``).
PAD_ID = -1
#: Token ids must fit SGLang's int32 flat top-k arrays.
MAX_TOKEN_ID = 2**31 - 1

_ROW_IN_PATH = re.compile(r" - at `\$\[(\d+)\]")

RowsRead = bytes | tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]
"""A sample's Python top-k rows read already, on the loop a slice at a time
(:func:`rows_read_slices`): their arrays ``(lps float64, ids int64)``, each ``[R * k]``,
read in place, or their msgpack where they were not."""


def parse_student_topk(
    rows: Sequence[Sequence[Any]], response_length: int, k: int, *, read: RowsRead | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Parse the rollout engine's student top-k rows into arrays.

    Args:
        rows: ``R`` rows (one per response token), each a sequence of entries
            ``[logprob, token_id]`` or ``[logprob, token_id, text]`` (SGLang triples), best
            first. Python ``int`` ids and ``float``/``int``/``None`` logprobs (as JSON
            decoding gives); ``None`` means ``-inf``. A ``None`` entry is skipped. A row may
            hold fewer than ``k`` entries, or none (``[]``: Miles' multi-turn merge leaves
            such rows on observation spans).
        response_length: ``R``; ``len(rows)`` must equal it.
        k: how many entries to keep per row (the first ``k`` present).
        read: ``rows`` read already (a slice at a time on the loop:
            :func:`rows_read_slices`); ``None``: read here.

    Returns:
        ``(ids, logprobs)``: int64 ``[R, k]`` and float32 ``[R, k]``; a row with fewer than
        ``k`` entries is padded at its end with id ``-1`` and logprob ``-inf``.

    Raises:
        InvalidSampleError: (field ``student_top_logprobs``) wrong row count, an entry that
            is not ``[number|null, int, ...]`` (bools rejected), a negative id or one above
            ``MAX_TOKEN_ID`` (SGLang's arrays are int32), duplicate ids in a row, a NaN /
            ``+inf`` logprob, or a logprob above ``1e-4`` (not a logprob). The message names
            the row.
    """
    field = "student_top_logprobs"
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
        raise InvalidSampleError(field, f"expected a sequence of rows, got {type(rows).__name__}")
    if len(rows) != response_length:
        raise InvalidSampleError(
            field, f"has {len(rows)} rows, expected response_length = {response_length}"
        )
    fast = _scanned_topk(rows, response_length, k, read)
    if fast is not None:
        return fast
    try:
        parsed = msgspec.convert(rows, list[list[Entry | None]])
    except msgspec.ValidationError as exc:
        text = str(exc)  # e.g. "Expected `int`, got `bool` - at `$[3][1][1]`"
        row = _ROW_IN_PATH.search(text)
        raise InvalidSampleError(field, f"row {row.group(1)}: {text}" if row else text) from None
    total = response_length * k
    kept: Sequence[Sequence[Entry | None]] = parsed
    if set(map(len, parsed)) - {k}:
        kept = [row[:k] for row in parsed]
    entries = list(chain.from_iterable(kept))
    if len(entries) == total and None not in entries:  # every row full: the common case
        ids = np.fromiter(map(ENTRY_ID, entries), dtype=np.int64, count=total)
        lps = np.fromiter(map(ENTRY_LP, entries), dtype=np.float64, count=total)
        if total and int(ids.min()) < 0:
            r = int(np.argmax(ids < 0)) // k
            raise InvalidSampleError(field, f"row {r} holds a negative token id")
    else:
        ids, lps = _padded_topk(parsed, k)
    ids, lps = ids.reshape(response_length, k), lps.reshape(response_length, k)
    # fromiter turned None into NaN; a NaN the caller sent is an error, a None is -inf.
    for r, c in zip(*np.nonzero(np.isnan(lps)), strict=True):
        if ids[r, c] != PAD_ID and _present(parsed[r])[c].lp is not None:
            raise InvalidSampleError(field, f"row {int(r)} holds a NaN logprob")
    return ids, _checked(ids, lps, field, _ROW_FAULTS)


_ROWS_MSGPACK = msgspec.msgpack.Encoder()


def _scanned_topk(
    rows: Sequence[Sequence[Any]], r: int, k: int, read: RowsRead | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None:
    """Rows of plain entries, each at least ``k`` long, through a compiled reader and the
    compiled checks, which give the float32 logprobs. The rows are read in place
    (:mod:`opd_stream.scanner._objects`: CPython's lists, floats and ints followed, ~3x
    cheaper than writing their msgpack first); where they are not (another interpreter,
    a float subclass, an id beyond 2^60), ``msgspec.msgpack`` writes them (no Python
    object per entry, floats as their 8 IEEE bytes) and :mod:`opd_stream.scanner._rows`
    reads them back, the GIL released: either way ~3x cheaper or more than converting
    entry by entry. ``None`` (the entry-by-entry path decides, and names any fault) when
    the kernels are not compiled or anything is unusual: a short row, a ``None`` entry, a
    bool, a negative id, an object msgspec cannot write. A NaN logprob is an error here as
    there, judged before the others. ``read``: the rows read already
    (:func:`rows_read_slices`).
    """
    kernel = compiled()
    if kernel is None:
        return None
    got: tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]] | None = None
    if isinstance(read, tuple):
        got = read if read[0].shape == (r * k,) else None
    elif read is None and isinstance(rows, list) and kernel.objects_readable():
        got = _empty_read(r * k)
        if not kernel.object_rows_read(rows, 0, r, k, *got):
            got = None
    if got is None:
        body = read if isinstance(read, bytes) else None
        if body is None:
            try:
                body = _ROWS_MSGPACK.encode(rows)
            except (TypeError, ValueError, OverflowError):
                return None
        got = kernel.rows_read(body, r, k)
    if got is None:
        return None
    lps, ids = got
    ids = ids.reshape(r, k)
    out, found = kernel.topk_check(ids, lps.reshape(r, k), PAD_ID, MAX_TOKEN_ID, LOGPROB_TOLERANCE)
    field = "student_top_logprobs"
    if "lp_nan" in found:
        raise InvalidSampleError(field, f"row {found['lp_nan']} holds a NaN logprob")
    for name, what in _ROW_FAULTS:
        if name in found:
            raise InvalidSampleError(field, f"row {found[name]} holds {what}")
    return ids, out


ROWS_PER_SLICE = 512
"""Rows :func:`rows_msgpack_slices` writes between two turns of the loop (512 x 16 entries:
~0.2-0.3 ms)."""


ENTRIES_PER_SLICE = 1 << 13
"""Top-k entries :func:`rows_read_slices` reads in place between two turns of the loop
(512 x 16: ~75 us). Samples of 1024 x 16 read whole, with no turn of the loop, cost
more CPU than in two slices (``bench.run --quick --scenario 1``, median of 5 runs 2.82 s
per 1M tokens against 2.15 of 4): their answers waited longer in the loop for their read."""


def rows_read_slices(rows: Any, k: int, into: list[RowsRead]) -> Iterator[None]:
    """Read a list of Python top-k rows, pausing (a ``yield``) between two slices so that
    the event loop can take its turn: in place (:data:`ENTRIES_PER_SLICE` entries a
    slice, :mod:`opd_stream.scanner._objects`) where the kernels read them so, else their
    msgpack written a slice at a time (:func:`rows_msgpack_slices`). ``into`` receives
    what was read, for :func:`parse_student_topk`'s ``read``; nothing when nothing could
    be (not a list, the kernels not ready, an object msgspec cannot write): the
    conversion then does it all itself, and its slow path names any fault.
    """
    kernel = compiled()
    if not isinstance(rows, list) or kernel is None:
        return
    r = len(rows)
    if k > 0 and kernel.objects_readable():
        arrays = _empty_read(r * k)
        step = max(1, ENTRIES_PER_SLICE // k)
        for start in range(0, r, step):
            if start:
                yield
            if len(rows) != r or not kernel.object_rows_read(rows, start, start + step, k, *arrays):
                break
        else:
            into.append(arrays)
            return
    parts: list[bytes | memoryview] = []
    yield from rows_msgpack_slices(rows, parts)
    body = joined_rows_msgpack(parts)
    if body is not None:
        into.append(body)


def _empty_read(n: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """The arrays rows are read into in place: ``(lps float64 [n], ids int64 [n])``."""
    return np.empty(n, dtype=np.float64), np.empty(n, dtype=np.int64)


def rows_msgpack_slices(rows: Any, parts: list[bytes | memoryview]) -> Iterator[None]:
    """Write a list of Python top-k rows as ``msgspec.msgpack`` would write it whole,
    :data:`ROWS_PER_SLICE` rows at a time, pausing (a ``yield``) after each slice but the
    last, so that the event loop can take its turn. ``parts`` receives the pieces;
    :func:`joined_rows_msgpack` makes them the rows' msgpack. Writes nothing when ``rows``
    is not a list, or when a slice cannot be written (``parts`` is then cleared): the
    conversion writes the rows itself, and its slow path names any fault.
    """
    if not isinstance(rows, list) or compiled() is None:
        return
    parts.append(_array_head(len(rows)))
    for start in range(0, len(rows), ROWS_PER_SLICE):
        if start:
            yield
        chunk = rows[start : start + ROWS_PER_SLICE]
        try:
            piece = _ROWS_MSGPACK.encode(chunk)
        except (TypeError, ValueError, OverflowError):
            parts.clear()
            return
        parts.append(memoryview(piece)[len(_array_head(len(chunk))) :])  # (no copy)


def joined_rows_msgpack(parts: list[bytes | memoryview]) -> bytes | None:
    """The rows' msgpack from the pieces :func:`rows_msgpack_slices` wrote (``None`` if it
    wrote none)."""
    return b"".join(parts) if parts else None


def _array_head(n: int) -> bytes:
    """A msgpack array header for ``n`` elements (fixarray, array 16, array 32)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _present(row: list[Entry | None]) -> list[Entry]:
    return [e for e in row if e is not None]


def _padded_topk(
    parsed: list[list[Entry | None]], k: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Rows with skipped (``None``) entries or fewer than ``k`` entries, padded at the end
    with id ``PAD_ID`` and a NaN logprob (``-inf`` after conversion), flat ``[R * k]``."""
    r = len(parsed)
    ids = np.full((r, k), PAD_ID, dtype=np.int64)
    lps = np.full((r, k), np.nan, dtype=np.float64)
    for n, row in enumerate(parsed):
        present = _present(row)[:k]
        if present:
            if min(e.id for e in present) < 0:
                raise InvalidSampleError(
                    "student_top_logprobs", f"row {n} holds a negative token id"
                )
            ids[n, : len(present)] = [e.id for e in present]
            lps[n, : len(present)] = [np.nan if e.lp is None else e.lp for e in present]
    return ids.reshape(-1), lps.reshape(-1)


#: The faults of the row form, in the order they are reported (NaN is judged before, where
#: a ``None`` can still be told from a NaN; padding only ever ends a row).
_ROW_FAULTS = (
    ("negative_id", "a negative token id"),
    ("id_above", f"a token id above {MAX_TOKEN_ID}"),
    ("duplicate", "a duplicate token id"),
    ("lp_posinf", "a +inf logprob"),
    ("lp_above", "a value > 0, which is not a logprob"),
)
#: The faults of the array form, in the order they are reported.
_ARRAY_FAULTS = (
    ("negative_id", "a negative token id"),
    ("id_above", f"a token id above {MAX_TOKEN_ID}"),
    ("lp_nan", "a NaN logprob"),
    ("lp_posinf", "a +inf logprob"),
    ("lp_above", "a value > 0, which is not a logprob"),
    ("pad_before_id", f"padding (id {PAD_ID}) before a token id: pad at the end"),
    ("duplicate", "a duplicate token id"),
)


def _checked(
    ids: npt.NDArray[np.int64],
    lps: npt.NDArray[np.floating[Any]],
    field: str,
    faults: tuple[tuple[str, str], ...],
) -> npt.NDArray[np.float32]:
    """Check ``ids`` / ``lps`` (``[R, k]``) and give the logprobs as float32 (``-inf`` for
    padding and NaN): one compiled pass where the kernels are ready, else numpy
    (:func:`_topk_faults`). Raises for the first of ``faults`` found."""
    kernel = compiled()
    if kernel is not None and lps.dtype in (np.float32, np.float64):
        out, found = kernel.topk_check(
            ids, np.ascontiguousarray(lps), PAD_ID, MAX_TOKEN_ID, LOGPROB_TOLERANCE
        )
    else:
        out, found = _topk_faults(ids, np.asarray(lps, dtype=np.float64))
    for name, what in faults:
        if name in found:
            raise InvalidSampleError(field, f"row {found[name]} holds {what}")
    checked: npt.NDArray[np.float32] = out
    return checked


def _topk_faults(
    ids: npt.NDArray[np.int64], lps: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float32], dict[str, int]]:
    """The vectorised twin of :func:`opd_stream.scanner._checks.topk_faults`: the float32
    logprobs and ``{fault: first row}`` for every fault found."""

    def first_row(mask: npt.NDArray[np.bool_]) -> int | None:
        rows = mask.any(axis=1)  # [R, k] -> [R]; reshape(R, -1) fails when R == 0
        return int(np.argmax(rows)) if rows.any() else None

    pad = ids == PAD_ID
    lps = np.where(pad, -np.inf, lps)  # a copy: the caller's array stays as it was
    nan = np.isnan(lps)
    masks = {
        "negative_id": ids < PAD_ID,
        "id_above": ids > MAX_TOKEN_ID,
        "lp_nan": nan,
        "lp_posinf": np.isposinf(lps),
        "lp_above": lps > LOGPROB_TOLERANCE,
    }
    if ids.shape[1] > 1:
        srt = np.sort(ids, axis=1)
        masks["pad_before_id"] = pad[:, :-1] & ~pad[:, 1:]
        masks["duplicate"] = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != PAD_ID)
    found = {name: row for name, mask in masks.items() if (row := first_row(mask)) is not None}
    with np.errstate(over="ignore"):  # below -float32 max: -inf, as it should
        return np.where(nan, -np.inf, lps).astype(np.float32), found


def student_topk_arrays(
    ids: Any, logprobs: Any, r: int, k: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """The array form of ``student_top_logprobs``: ``(ids [R, >=k], logprobs [R, >=k])``.

    Validated like the row form, vectorised: integer ids in ``[0, MAX_TOKEN_ID]``, no
    duplicate id within a row's first ``k``, logprobs finite or ``-inf`` and ``<= 0``. A row
    with fewer than ``k`` entries is padded at its end with id ``-1`` (whatever the logprob
    there, which is ignored and becomes ``-inf``), the form the row parser gives for short
    and empty rows; padding before a real id is an error. ``ids`` and ``logprobs`` are
    numpy arrays (a caller's tensors are converted by ``prepare_sample``).
    """
    field = "student_top_logprobs"
    if ids.dtype.kind not in "iu":
        raise InvalidSampleError(field, f"ids must be an integer array, got dtype {ids.dtype}")
    if logprobs.dtype.kind != "f":
        raise InvalidSampleError(
            field, f"logprobs must be a float array, got dtype {logprobs.dtype}"
        )
    if ids.ndim != 2 or ids.shape != logprobs.shape or ids.shape[0] != r or ids.shape[1] < k:
        raise InvalidSampleError(
            field,
            f"(ids, logprobs) must both have shape [R={r}, >= k={k}], "
            f"got {ids.shape} and {logprobs.shape}",
        )
    ids = np.ascontiguousarray(ids[:, :k], dtype=np.int64)
    return ids, _checked(ids, logprobs[:, :k], field, _ARRAY_FAULTS)


ROW_ENTRY_BYTES = 16
"""About what one top-k entry of Python rows weighs as ``msgspec.msgpack`` writes it (an
array header, a float64, an id, perhaps a ``nil``): the unit :func:`rows_convert_in_thread`
measures rows in."""


def rows_convert_in_thread(sample: Any, top_k: int, threshold: int) -> bool:
    """Whether a sample's Python top-k rows are converted in a worker thread: from
    ``threshold`` bytes of their msgpack on (estimated, :data:`ROW_ENTRY_BYTES` an entry).

    The conversion holds the GIL from start to end (the rows read in place, ~9 ns an entry,
    or msgspec's walk of them, ~3 ms per MiB of msgpack, then the compiled read; then the
    checks). Below ``threshold`` the loop does it (a slice at a time,
    :func:`rows_read_slices`, then the checks whole): a thread would cost more CPU than it
    saves the loop (2048 x 16 rows: ~0.35 ms of work read in place, ~1.4 ms through
    msgpack, and about 2 ms more a sample for the hand-offs of the GIL while the thread and the
    loop both run; ``docs/design-notes.md``, "opd_stream/fetch/_threads.py"). The pipeline passes
    ``offload_bytes // WHOLE``: the size from which what the loop does whole goes to a
    thread. Arrays stay on the loop. Until the kernels are ready (and without numba) the
    conversion goes entry by entry, ~10x dearer (13 ms for 2048 x 16): from
    :data:`_SLOW_ROWS_IN_THREAD` entries on it goes to a thread whatever ``threshold``, as
    every conversion did before.
    """
    rows = getattr(sample, "student_top_logprobs", None)
    if not isinstance(rows, list):
        return False
    entries = len(rows) * max(top_k, 1)
    if compiled() is None and entries >= _SLOW_ROWS_IN_THREAD:
        return True
    return entries * ROW_ENTRY_BYTES >= threshold


_SLOW_ROWS_IN_THREAD = 1 << 15
"""Top-k entries from which Python rows go to a worker thread while the kernels are not
ready (the entry-by-entry conversion: ~6.5 ms per 2^14 entries)."""
