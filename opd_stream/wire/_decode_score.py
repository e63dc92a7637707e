"""The msgspec decoder of scoring answers: typed Structs into validated numpy arrays.

It knows nothing about :class:`~opd_stream.wire._request.ScoreRequest`:
:func:`opd_stream.wire._request.layout` turns a request into :class:`Segment` s (one per HTTP
item) and :mod:`opd_stream.wire._codec` calls :func:`decode_segments`. Layout:
``docs/protocol.md``, "Answer rows and positions" (an item's response rows are its last
``rows`` entries). Every logprob leaving this module is finite or ``-inf`` (a JSON ``null``,
and a b64 ``NaN``, is ``-inf``); a value above the float32 range (``+inf`` included) is a
:class:`MalformedResponseError`. In full: ``docs/design-notes.md``,
"opd_stream/wire/_decode_score.py".
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, islice
from typing import get_args

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import CapabilityError, MalformedResponseError, MisalignedResponseError
from ._answers import Body, ScoreRows, Segment, total_cached
from ._checks import (
    FlatTopK,
    cat,
    flat_topk,
    id_values,
    input_rows,
    item_path,
    missing_field,
    one_weight_version,
    to_logprobs,
    token_values,
    with_tail_values,
)
from ._entries import (
    ENTRY_ID,
    ENTRY_LP,
    Entry,
    EntryRows,
    FinishReason,
    check_abort,
    checked_rows,
    decode_error,
    rows_block,
    too_deep,
)

__all__ = ("B64", "ENTRIES", "ENVELOPE", "ROWS", "SCANNED", "decode_metas", "decode_segments")


class _Meta(msgspec.Struct, gc=False, frozen=True):
    # Every field optional, so that an absent one is reported by name (and an abort
    # answer, which may lack the logprob fields, is still recognised as an abort).
    # The output top-k (``output_top_logprobs`` or its flat ``output_top_logprobs_*``
    # fields, nested, JSON flat or b64) is deliberately not declared: no scoring layout
    # uses that row (top-k segments never have a ``tail_col``), so msgspec skips it
    # unparsed in whichever form the server sent it, or none.
    finish_reason: FinishReason | None = None
    weight_version: str | None = None
    cached_tokens: int | None = None
    input_token_logprobs: list[Entry] | None = None
    input_top_logprobs: EntryRows | None = None
    input_token_ids_logprobs: EntryRows | None = None
    output_token_ids_logprobs: EntryRows | None = None
    input_top_logprobs_shape: list[int] | None = None
    input_top_logprobs_null_prefix: int | None = None
    input_top_logprobs_val_flat_b64: str | None = None
    input_top_logprobs_idx_flat_b64: str | None = None
    input_top_logprobs_val_flat_b64_dtype: str | None = None
    input_top_logprobs_idx_flat_b64_dtype: str | None = None


class _Response(msgspec.Struct, gc=False, frozen=True):
    meta_info: _Meta | None = None


#: The kinds of value the compiled scanner parses itself: a list of entries, a list of rows
#: of entries, a base64 string.
ENTRIES, ROWS, B64 = 0, 1, 2


def _scanned() -> tuple[tuple[str, int], ...]:
    """The fields of :class:`_Meta` the scanner parses, with their kind, in declaration
    order: every list of entries, every list of rows, every ``str`` field named
    ``*_flat_b64``. The schema is declared once, above; the scanner takes it from here."""
    out = []
    for field in msgspec.structs.fields(_Meta):
        args = get_args(field.type)
        if list[Entry] in args:
            out.append((field.name, ENTRIES))
        elif EntryRows in args:
            out.append((field.name, ROWS))
        elif str in args and field.name.endswith("_flat_b64"):
            out.append((field.name, B64))
    return tuple(out)


#: ``(field name, kind)`` of every ``meta_info`` value the compiled scanner parses
#: (:mod:`opd_stream.scanner._scan`), the rest of an answer being decoded with the types above.
SCANNED = _scanned()

#: The object of an answer item that holds them (:class:`_Response`'s one field).
ENVELOPE: str = msgspec.structs.fields(_Response)[0].name


_SINGLE = msgspec.json.Decoder(_Response)
_BATCH = msgspec.json.Decoder(list[_Response])


def decode_metas(body: Body, batch: bool) -> list[_Meta] | None:
    """Every item's ``meta_info`` decoded with this decoder's types, or ``None`` when the
    body does not decode or an item has no ``meta_info`` (the compiled scanner
    validates an answer's envelope with it, :mod:`opd_stream.wire._scan_reader`)."""
    try:
        items = _BATCH.decode(body) if batch else [_SINGLE.decode(body)]
    except (msgspec.DecodeError, RecursionError):
        return None
    metas = [item.meta_info for item in items]
    return None if None in metas else metas  # type: ignore[return-value]


def _b64_topk_from_meta(
    meta: _Meta, where: str, seg: Segment, top_k: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None:
    """Top-k from the b64 flat fields, or ``None`` when the server answered without them."""
    base = f"{where}.meta_info.input_top_logprobs"
    flat = FlatTopK(
        meta.input_top_logprobs_shape,
        meta.input_top_logprobs_null_prefix,
        meta.input_top_logprobs_val_flat_b64,
        meta.input_top_logprobs_idx_flat_b64,
        meta.input_top_logprobs_val_flat_b64_dtype,
        meta.input_top_logprobs_idx_flat_b64_dtype,
        None,  # scoring asks for the b64 form only
        None,
    )
    got = flat_topk(flat, base)
    if got is None:
        return None
    ids, lps, prefix = got
    rows, k = ids.shape
    if k != top_k:
        raise MisalignedResponseError(
            f"`{base}_shape` is [{rows}, {k}] with null_prefix {prefix}, expected [rows, {top_k}]"
        )
    n_entries = seg.length - seg.start
    if prefix + rows != n_entries or rows < seg.rows:
        raise MisalignedResponseError(
            f"`{base}_shape` covers null_prefix {prefix} + {rows} rows, expected "
            f"{n_entries} entries (input length {seg.length} - logprob_start_len {seg.start})"
        )
    return ids[rows - seg.rows :], lps[rows - seg.rows :]


def decode_segments(
    body: Body,
    *,
    batch: bool,
    segments: Sequence[Segment],
    tokens: npt.NDArray[np.int64],
    top_k: int,
    per_position: bool,
) -> ScoreRows:
    """Decode and validate a scoring answer made of ``len(segments)`` items.

    Args:
        body: the HTTP 200 body: one response object, or (``batch``) a JSON array of them.
        batch: whether the request was an SGLang batch (``input_ids`` list of lists).
        segments: one per item, in order (see :class:`Segment`).
        tokens: the whole sample, int64 ``[L]``; every item's ``input_ids`` is a prefix.
        top_k: the ``top_logprobs_num`` sent (0 = none).
        per_position: ids were sent as ``token_ids_logprob_positions``; an answer without
            ``input_token_ids_logprobs`` then raises ``CapabilityError("per_position")``.

    Raises:
        MalformedResponseError: not JSON, truncated, wrong types, missing field (named).
        MisalignedResponseError: entry/row counts, echoed token ids, requested ids,
            top-k widths or batch item count differ from the request.
        ServerAbortError: ``finish_reason.type == "abort"``.
        CapabilityError: see ``per_position``.
    """
    return _decode_segments(body, batch, segments, tokens, top_k, per_position)


def _decode_segments(
    body: Body,
    batch: bool,
    segments: Sequence[Segment],
    tokens: npt.NDArray[np.int64],
    top_k: int,
    per_position: bool,
) -> ScoreRows:
    try:
        items = _BATCH.decode(body) if batch else [_SINGLE.decode(body)]
    except msgspec.DecodeError as exc:
        raise decode_error(exc) from None
    except RecursionError:
        raise too_deep() from None
    if len(items) != len(segments):
        raise MisalignedResponseError(
            f"batch answer has {len(items)} items, expected {len(segments)}"
        )
    top_i: list[npt.NDArray[np.int64]] = []
    top_lp: list[npt.NDArray[np.float32]] = []
    tok_entries: list[list[Entry]] = []
    id_sel: list[EntryRows] = []
    used_b64 = top_k > 0
    versions: list[str | None] = []
    cached: list[int | None] = []
    t0 = 0
    # Structure is checked item by item; the numbers of all items are then converted and
    # checked in one vectorised pass (a blocked answer has R/B small items). Error
    # messages (field paths) are only built on the error paths.
    for n, (item, seg) in enumerate(zip(items, segments, strict=True)):
        meta = item.meta_info
        if meta is None:
            raise missing_field(f"{item_path(batch, n)}.meta_info")
        fr = meta.finish_reason
        if fr is not None and fr.type == "abort":
            check_abort(fr, item_path(batch, n), "teacher")
        versions.append(meta.weight_version)
        cached.append(meta.cached_tokens)
        id_rows = meta.input_token_ids_logprobs
        if seg.expect is not None and id_rows is None:
            if per_position:
                raise CapabilityError(
                    "per_position",
                    "the server ignored token_ids_logprob_positions (no "
                    "meta_info.input_token_ids_logprobs in the answer): it is not a "
                    "per-position-patched SGLang, or a router dropped the field",
                )
            raise missing_field(f"{item_path(batch, n)}.meta_info.input_token_ids_logprobs")
        entries = meta.input_token_logprobs
        if entries is not None and len(entries) == seg.length - seg.start - 1:
            meta = _without_leading_row(meta, entries, item_path(batch, n), seg, tokens)
            entries = meta.input_token_logprobs
            id_rows = meta.input_token_ids_logprobs
        if entries is None or len(entries) != seg.length - seg.start:
            _token_entries(meta, item_path(batch, n), seg)  # raises, naming the field
        tok_entries.append(entries)  # type: ignore[arg-type]
        if top_k > 0:
            where = item_path(batch, n)
            got = _b64_topk_from_meta(meta, where, seg, top_k)
            if got is None:
                used_b64 = False
                field = f"{where}.meta_info.input_top_logprobs"
                if meta.input_top_logprobs is None:
                    raise missing_field(field)
                ids, lps = rows_block(meta.input_top_logprobs, field, seg, t0, top_k)
                got = ids, to_logprobs(lps, field)
            if got[0].size and int(got[0].min()) < 0:
                raise MalformedResponseError(f"`{where}` top-k holds a negative token id")
            top_i.append(got[0])
            top_lp.append(got[1])
        if seg.expect is not None:
            assert id_rows is not None
            n_entries, n_in = len(id_rows), input_rows(seg)
            if n_entries != seg.length - seg.start:
                checked_rows(id_rows, _id_field(batch, n), seg, t0, seg.expect.shape[-1])
            sel = id_rows[n_entries - n_in :]
            if seg.tail_col >= 0:
                out = meta.output_token_ids_logprobs
                if not out or out[0] is None:
                    _output_row(meta, item_path(batch, n), seg, t0, seg.expect.shape[-1])
                sel.append(out[0])  # type: ignore[index]
            id_sel.append(sel)
        t0 += seg.rows
    if id_sel and not _rows_are_well_formed(id_sel, segments):
        _raise_row_error(items, id_sel, segments, batch)
    weight_version = one_weight_version(versions)
    p = tokens.shape[0] - t0
    id_lp = _id_values(id_sel, segments, batch) if id_sel else None
    token_lp = _token_values(tok_entries, segments, tokens, batch, t0)
    if any(seg.tail_col >= 0 for seg in segments):
        token_lp = _with_tail_values(token_lp, id_sel, segments, batch)
    return ScoreRows(
        token_ids=np.array(tokens[p:], dtype=np.int64),
        token_logprobs=token_lp,
        top_ids=cat(top_i) if top_k > 0 else None,
        top_logprobs=cat(top_lp) if top_k > 0 else None,
        id_logprobs=id_lp,
        used_b64=used_b64,
        weight_version=weight_version,
        cached_tokens=total_cached(cached),
    )


def _without_leading_row(
    meta: _Meta, entries: list[Entry], where: str, seg: Segment, tokens: npt.NDArray[np.int64]
) -> _Meta:
    """An answer whose ``input_token_logprobs`` has one entry fewer than SGLang's (LMDeploy's
    ``/generate``: no leading empty row, entry ``j`` about absolute position ``s + 1 + j``),
    as SGLang's alignment (an empty leading row put back in every ``input_*`` row list one
    short), when its echoed ids say so unambiguously: they must equal ``tokens[s+1:]`` and not
    also fit SGLang's own alignment cut one short (``tokens[s:L-1]``).

    Raises:
        MisalignedResponseError: the echoed ids fit neither alignment, or both.
    """
    s, length = seg.start, seg.length
    got = np.fromiter(map(ENTRY_ID, entries), dtype=np.int64, count=len(entries))
    no_leading = bool(np.array_equal(got, tokens[s + 1 : length]))
    cut_short = bool(np.array_equal(got, tokens[s : length - 1]))
    if no_leading and not cut_short:
        lead = Entry(None, int(tokens[s]))

        def padded(rows: EntryRows | None) -> EntryRows | None:
            if rows is None or len(rows) != len(entries):
                return rows
            return [None, *rows]

        return msgspec.structs.replace(
            meta,
            input_token_logprobs=[lead, *entries],
            input_top_logprobs=padded(meta.input_top_logprobs),
            input_token_ids_logprobs=padded(meta.input_token_ids_logprobs),
        )
    verdict = "both fit: ambiguous" if no_leading else "they fit neither"
    raise MisalignedResponseError(
        f"`{where}.meta_info.input_token_logprobs` has {len(entries)} entries, expected "
        f"{length - s} (input length {length} - logprob_start_len {s}); alignments tried "
        f"against the echoed token ids: SGLang's (a leading empty row for absolute position "
        f"{s}) cut one short, and none leading (LMDeploy's: entry 0 about absolute position "
        f"{s + 1}); {verdict}"
    )


def _token_entries(meta: _Meta, where: str, seg: Segment) -> list[Entry]:
    field = f"{where}.meta_info.input_token_logprobs"
    entries = meta.input_token_logprobs
    if entries is None:
        raise missing_field(field)
    n_entries = seg.length - seg.start
    if len(entries) != n_entries:
        raise MisalignedResponseError(
            f"`{field}` has {len(entries)} entries, expected {n_entries} "
            f"(input length {seg.length} - logprob_start_len {seg.start})"
        )
    return entries


def _token_values(
    entries: list[list[Entry]],
    segments: Sequence[Segment],
    tokens: npt.NDArray[np.int64],
    batch: bool,
    r: int,
) -> npt.NDArray[np.float32]:
    """Check the echoed ids of every item, then the logprobs of the response rows answered
    in ``input_token_logprobs`` (all ``R`` but output-row tails), float32."""
    echoed = sum(seg.length - seg.start - 1 for seg in segments)
    got = np.fromiter(
        map(ENTRY_ID, chain.from_iterable(islice(e, 1, None) for e in entries)),
        dtype=np.int64,
        count=echoed,
    )
    lps = np.fromiter(
        map(
            ENTRY_LP,
            chain.from_iterable(
                islice(e, len(e) - input_rows(seg), None)
                for e, seg in zip(entries, segments, strict=True)
            ),
        ),
        dtype=np.float64,
        count=r - sum(seg.tail_col >= 0 for seg in segments),
    )
    return token_values(got, lps, segments, tokens, batch)


def _id_field(batch: bool, n: int) -> str:
    return f"{item_path(batch, n)}.meta_info.input_token_ids_logprobs"


def _rows_are_well_formed(id_sel: list[EntryRows], segments: Sequence[Segment]) -> bool:
    """Every selected requested-id row (all items at once) is non-null with its width."""
    flat = list(chain.from_iterable(id_sel))
    if None in flat:
        return False
    widths = np.fromiter(map(len, flat), dtype=np.intp, count=len(flat))  # type: ignore[arg-type]
    want = np.repeat(
        [seg.expect.shape[-1] for seg in segments if seg.expect is not None],
        [seg.rows for seg in segments if seg.expect is not None],
    )
    return widths.shape == want.shape and bool((widths == want).all())


def _raise_row_error(
    items: list[_Response], id_sel: list[EntryRows], segments: Sequence[Segment], batch: bool
) -> None:
    """The precise error for rows that failed :func:`_rows_are_well_formed` (item by item)."""
    t0 = 0
    for n, (item, seg) in enumerate(zip(items, segments, strict=True)):
        if seg.expect is not None:
            meta = item.meta_info
            assert meta is not None
            assert meta.input_token_ids_logprobs is not None
            width = seg.expect.shape[-1]
            checked_rows(meta.input_token_ids_logprobs, _id_field(batch, n), seg, t0, width)
            if seg.tail_col >= 0:
                _output_row(meta, item_path(batch, n), seg, t0, width)
        t0 += seg.rows
    raise AssertionError("unreachable: a malformed row was not found again")  # pragma: no cover


def _output_row(meta: _Meta, where: str, seg: Segment, t0: int, width: int) -> list[Entry]:
    """``output_token_ids_logprobs[0]``: the tail row of a blocked id-only item."""
    field = f"{where}.meta_info.output_token_ids_logprobs"
    rows = meta.output_token_ids_logprobs
    if rows is None:
        raise missing_field(field)
    pos = t0 + seg.rows - 1
    if len(rows) < 1 or rows[0] is None:
        raise MisalignedResponseError(
            f"`{field}` has no row for absolute position {seg.length} (response position {pos})"
        )
    row = rows[0]
    if len(row) != width:
        raise MisalignedResponseError(
            f"`{field}` row for absolute position {seg.length} (response position {pos}) "
            f"has {len(row)} entries, expected {width}"
        )
    return row


def _with_tail_values(
    token_lp: npt.NDArray[np.float32],
    id_sel: list[EntryRows],
    segments: Sequence[Segment],
    batch: bool,
) -> npt.NDArray[np.float32]:
    values = np.array(
        [id_sel[n][-1][seg.tail_col].lp for n, seg in enumerate(segments) if seg.tail_col >= 0],  # type: ignore[index]
        dtype=np.float64,
    )
    return with_tail_values(token_lp, values, segments, batch)


def _id_values(
    sels: list[EntryRows], segments: Sequence[Segment], batch: bool
) -> npt.NDArray[np.float32]:
    """Requested-id rows of every item: check the ids, pick the columns, float32 [R, k]."""
    total = sum(seg.rows * seg.expect.shape[-1] for seg in segments if seg.expect is not None)
    flat_rows = chain.from_iterable(chain.from_iterable(sels))  # type: ignore[arg-type]
    ids = np.fromiter(map(ENTRY_ID, flat_rows), dtype=np.int64, count=total)
    flat_rows = chain.from_iterable(chain.from_iterable(sels))  # type: ignore[arg-type]
    lps = np.fromiter(map(ENTRY_LP, flat_rows), dtype=np.float64, count=total)
    return id_values(ids, lps, segments, batch)
