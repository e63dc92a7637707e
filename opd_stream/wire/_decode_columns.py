"""Scoring answers decoded from columns: off the GIL, straight into arrays.

A *reader* (the compiled scanner of :mod:`opd_stream.wire._scan_reader`) parses the body into
columns with the GIL released (:class:`~opd_stream.wire._columns.Answers`), and every check
runs over those columns in a few vectorised numpy passes. A *fast path* with one rule: it
accepts an answer only when every check of the msgspec decoder
(:mod:`opd_stream.wire._decode_score`) passes, and gives exactly the arrays that decoder
gives; anything else returns ``None``, and the caller runs the msgspec decoder on the same
bytes for the precise error (tests/scanner/test_scanner_decode.py checks the rule). Why,
with the costs: ``docs/design-notes.md``, "opd_stream/wire/_decode_columns.py".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .._errors import ProtocolError
from ..scanner._loader import compiled
from ._answers import Body, ScoreRows, Segment, total_cached
from ._checks import (
    LOGPROB_TOLERANCE,
    id_values,
    one_weight_version,
    token_values,
    with_tail_values,
)
from ._columns import Answers, Reader, RowColumns, gather
from ._scan_reader import read_answers_jit

__all__ = ("decode_segments_columns",)

_FLAT_FIELDS = ("val_flat_b64", "idx_flat_b64", "val_flat_b64_dtype", "idx_flat_b64_dtype")


def decode_segments_columns(
    body: Body,
    *,
    batch: bool,
    segments: Sequence[Segment],
    tokens: npt.NDArray[np.int64],
    top_k: int,
    reader: Reader = read_answers_jit,
) -> ScoreRows | None:
    """The answer as :func:`opd_stream.wire._decode_score.decode_segments` decodes it, or ``None``.

    ``reader`` parses the body into columns: the compiled scanner
    (:func:`opd_stream.wire._scan_reader.read_answers_jit`; ``None`` until it is ready). ``None``
    means: decode it with msgspec, which raises the precise error (or, for the rare valid
    answer the reader does not take, such as an entry with a text element, decodes it).
    Never raises for a bad answer.
    """
    try:
        return _decode(reader(body, batch), segments, tokens, top_k, batch)
    except ProtocolError:
        return None


def _decode(
    metas: Answers | None,
    segments: Sequence[Segment],
    tokens: npt.NDArray[np.int64],
    top_k: int,
    batch: bool,
) -> ScoreRows | None:
    if metas is None or len(metas) != len(segments):
        return None
    if "abort" in metas.finish_types():
        return None
    n_items = len(segments)
    n_entries = np.array([seg.length - seg.start for seg in segments], dtype=np.intp)
    n_tail = np.array([seg.tail_col >= 0 for seg in segments], dtype=np.intp)
    rows = np.array([seg.rows for seg in segments], dtype=np.intp)
    n_in = rows - n_tail

    # every declared list field is checked whole, as msgspec type-checks it whole
    got_tok = metas.entries("input_token_logprobs")
    if got_tok is None:
        return None
    tok, tok_off = got_tok
    if not tok.ok or not np.array_equal(np.diff(tok_off), n_entries):
        return None
    fields = {
        name: metas.rows(name)
        for name in ("input_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")
    }
    if not all(f.ok for f in fields.values()):
        return None

    # sampled tokens: echoed ids (all but each item's first entry), logprobs of input rows
    echo_idx = gather(tok_off[:-1] + 1, n_entries - 1)
    echoed = tok.ids[echo_idx]
    if echoed.size and float(echoed.max()) >= 2.0**53:  # beyond exact doubles: let msgspec say
        return None
    lp_idx = gather(tok_off[1:] - n_in, n_in)
    token_lp = token_values(echoed.astype(np.int64), tok.lps[lp_idx], segments, tokens, batch)

    top_ids = top_lps = None
    used_b64 = top_k > 0
    if top_k > 0:
        got = _topk(metas, fields["input_top_logprobs"], segments, top_k, n_entries, batch)
        if got is None:
            return None
        top_ids, top_lps, used_b64 = got

    id_lp = None
    if any(seg.expect is not None for seg in segments):
        if any(seg.expect is None for seg in segments):
            return None  # no layout mixes them
        id_lp = _picked_id_rows(fields["input_token_ids_logprobs"], segments, n_entries)
        if id_lp is None:  # the general path (any layout; it names the fault)
            got_ids = _id_rows(fields, segments, n_entries, n_in, n_tail)
            if got_ids is None:
                return None
            ids_f, lps_f, tail_values = got_ids
            id_lp = id_values(ids_f.astype(np.int64), lps_f, segments, batch)
            if n_tail.any():
                token_lp = with_tail_values(token_lp, tail_values, segments, batch)
    elif n_tail.any():
        return None

    weight_version = one_weight_version(metas.values("weight_version")) if n_items else None
    return ScoreRows(
        token_ids=np.array(tokens[tokens.shape[0] - int(rows.sum()) :], dtype=np.int64),
        token_logprobs=token_lp,
        top_ids=top_ids,
        top_logprobs=top_lps,
        id_logprobs=id_lp,
        used_b64=used_b64,
        weight_version=weight_version,
        cached_tokens=total_cached(metas.values("cached_tokens")),
    )


def _picked_id_rows(
    f: RowColumns, segments: Sequence[Segment], n_entries: npt.NDArray[np.intp]
) -> npt.NDArray[np.float32] | None:
    """One per-position item's requested-id rows through the compiled pick
    (:func:`opd_stream.scanner._checks.pick_id_rows`): float32 ``[R, k]``, or ``None`` (no
    kernels, another layout, or anything the general path must judge and name)."""
    kernel = compiled()
    if kernel is None or len(segments) != 1:
        return None
    seg = segments[0]
    if seg.expect is None or seg.expect.ndim != 2 or seg.col is not None or seg.tail_col >= 0:
        return None
    if f.item_null[0] or f.count(0) != n_entries[0] or seg.rows > n_entries[0]:
        return None
    out = np.empty(seg.expect.shape, dtype=np.float32)
    ints = f.entries.ints
    ok, top = kernel.pick_rows(
        f.entries.ids.astype(np.int64) if ints is None else ints,
        np.asarray(f.entries.lps, dtype=np.float64),
        np.asarray(f.entry_off, dtype=np.intp),
        np.asarray(f.row_width, dtype=np.intp),
        np.asarray(f.row_null, dtype=bool),
        int(f.item_off[1]) - seg.rows,
        np.ascontiguousarray(seg.expect, dtype=np.int64),
        out,
    )
    if not ok or top > LOGPROB_TOLERANCE:
        return None
    picked: npt.NDArray[np.float32] = out
    return picked


def _selected_rows(
    f: RowColumns,
    counts: npt.NDArray[np.intp],
    take: npt.NDArray[np.intp],
    widths: npt.NDArray[np.intp],
) -> npt.NDArray[np.intp] | None:
    """Entry indices of each item's last ``take[n]`` rows, or ``None`` when an item lacks
    the field, has another row count, or a kept row is null or not ``widths[n]`` wide."""
    if f.item_null.any() or not np.array_equal(np.diff(f.item_off), counts):
        return None
    row_idx = gather(f.item_off[1:] - take, take)
    want = np.repeat(widths, take)
    if f.row_null[row_idx].any() or not np.array_equal(f.row_width[row_idx], want):
        return None
    return gather(f.entry_off[row_idx], want)


def _topk(
    metas: Answers,
    nested: RowColumns,
    segments: Sequence[Segment],
    top_k: int,
    n_entries: npt.NDArray[np.intp],
    batch: bool,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], bool] | None:
    val, idx = (metas.values(f"input_top_logprobs_{name}") for name in _FLAT_FIELDS[:2])
    has_b64 = np.array([v is not None or i is not None for v, i in zip(val, idx, strict=True)])
    rows = np.array([seg.rows for seg in segments], dtype=np.intp)
    if has_b64.all():
        return _b64_topk_from_columns(metas, segments, top_k, n_entries)
    if has_b64.any():
        return None  # mixed forms within one answer: let msgspec sort it out
    sel = _selected_rows(nested, n_entries, rows, np.full(len(segments), top_k, dtype=np.intp))
    if sel is None:
        return None
    ids = nested.entries.ids[sel]
    if ids.size and float(ids.min()) < 0:
        return None
    lps = nested.entries.lps[sel]
    if lps.size and float(np.nanmax(lps, initial=-np.inf)) > LOGPROB_TOLERANCE:
        return None  # msgspec's decoder names the bad value
    with np.errstate(over="ignore"):
        out_lps = np.where(np.isnan(lps), -np.inf, lps).astype(np.float32)
    r = int(rows.sum())
    return ids.astype(np.int64).reshape(r, top_k), out_lps.reshape(r, top_k), False


def _b64_topk_from_columns(
    metas: Answers,
    segments: Sequence[Segment],
    top_k: int,
    n_entries: npt.NDArray[np.intp],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], bool] | None:
    """The b64 flat top-k of every item (the checks of ``_checks.flat_topk``)."""
    shapes = metas.values("input_top_logprobs_shape")
    prefixes = metas.values("input_top_logprobs_null_prefix")
    vals = metas.b64("input_top_logprobs_val_flat_b64")
    idxs = metas.b64("input_top_logprobs_idx_flat_b64")
    if vals is None or idxs is None:
        return None  # not valid base64: msgspec's decoder names it
    val_dtypes = metas.values("input_top_logprobs_val_flat_b64_dtype")
    idx_dtypes = metas.values("input_top_logprobs_idx_flat_b64_dtype")
    ids_parts: list[npt.NDArray[np.int64]] = []
    lp_parts: list[npt.NDArray[np.float32]] = []
    for n, seg in enumerate(segments):
        shape, prefix = shapes[n], prefixes[n]
        v_raw, i_raw, val_dtype, idx_dtype = vals[n], idxs[n], val_dtypes[n], idx_dtypes[n]
        if (
            v_raw is None
            or i_raw is None
            or shape is None
            or prefix is None
            or len(shape) != 2
            or None in shape
            or val_dtype not in (None, "float32")
            or idx_dtype not in (None, "int32")
        ):
            return None
        rows, k = shape
        if not (0 <= rows < 2**31 and k == top_k and prefix >= 0):
            return None
        if prefix + rows != n_entries[n] or rows < seg.rows:
            return None
        if len(v_raw) != 4 * rows * k or len(i_raw) != 4 * rows * k:
            return None
        v_all = np.frombuffer(v_raw, dtype="<f4")
        if v_all.size and float(np.nanmax(v_all, initial=-np.inf)) > LOGPROB_TOLERANCE:
            return None  # > 0 or +inf anywhere (msgspec's decoder checks every row)
        v = v_all.reshape(rows, k)[rows - seg.rows :]
        i = np.frombuffer(i_raw, dtype="<i4").reshape(rows, k)[rows - seg.rows :]
        if i.size and int(i.min()) < 0:
            return None
        ids_parts.append(i.astype(np.int64))
        lp_parts.append(np.where(np.isnan(v), np.float32(-np.inf), v).astype(np.float32))
    cat = np.concatenate
    return cat(ids_parts), cat(lp_parts), True


def _id_rows(
    fields: dict[str, RowColumns],
    segments: Sequence[Segment],
    n_entries: npt.NDArray[np.intp],
    n_in: npt.NDArray[np.intp],
    n_tail: npt.NDArray[np.intp],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]] | None:
    """Requested-id entries flat in answer order (per item: input rows, then its tail row)
    and the tail rows' target logprobs; ``None`` when a row is missing, null or ragged."""
    widths = np.array([seg.expect.shape[-1] for seg in segments], dtype=np.intp)  # type: ignore[union-attr]
    f_in = fields["input_token_ids_logprobs"]
    sel_in = _selected_rows(f_in, n_entries, n_in, widths)
    if sel_in is None:
        return None
    ids_in, lps_in = f_in.entries.ids[sel_in], f_in.entries.lps[sel_in]
    if not n_tail.any():
        return ids_in, lps_in, np.empty(0)
    f_out = fields["output_token_ids_logprobs"]
    tails = np.flatnonzero(n_tail)
    if f_out.item_null[tails].any():
        return None
    counts = np.diff(f_out.item_off)[tails]
    if (counts < 1).any():
        return None
    first = f_out.item_off[tails]
    if f_out.row_null[first].any() or not np.array_equal(f_out.row_width[first], widths[tails]):
        return None
    sel_out = gather(f_out.entry_off[first], widths[tails])
    # interleave: each item's input-row entries, then its tail-row entries
    size_in = n_in * widths
    size_out = n_tail * widths
    per_item = size_in + size_out
    item_start = np.cumsum(per_item) - per_item
    total = int(per_item.sum())
    ids = np.empty(total, dtype=np.float64)
    lps = np.empty(total, dtype=np.float64)
    dest_in = gather(item_start, size_in)
    dest_out = gather(item_start[tails] + size_in[tails], widths[tails])
    ids[dest_in], lps[dest_in] = ids_in, lps_in
    ids[dest_out] = f_out.entries.ids[sel_out]
    lps[dest_out] = f_out.entries.lps[sel_out]
    tail_cols = np.array([segments[int(n)].tail_col for n in tails], dtype=np.intp)
    tail_values = f_out.entries.lps[f_out.entry_off[first] + tail_cols]
    return ids, lps, tail_values
