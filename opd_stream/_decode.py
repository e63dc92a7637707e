"""Decoders for SGLang ``/generate`` answers: typed msgspec Structs into numpy arrays.

This is the decoding half of :mod:`opd_stream._wire` (which re-exports the public names).
It knows nothing about :class:`~opd_stream._wire.ScoreRequest`: the wire module turns a
request into :class:`Segment` s (one per HTTP item) and calls :func:`decode_segments`.

Layout (spec ``sglang-protocol.md`` §2.3): for an item with ``len(input_ids) == L`` sent with
``logprob_start_len == s``, every ``input_*`` list has ``L - s`` entries, entry ``j`` is about
absolute position ``s + j`` (it predicts ``input_ids[s + j]``), and entry 0 is empty. An item's
response rows are its last ``rows`` entries.

Values: a JSON ``null`` logprob is ``-inf`` (SGLang serialises ``-inf`` and ``NaN`` as
``null``); in the b64 form a ``NaN`` is mapped to ``-inf`` for the same reason. Every
logprob leaving this module is finite or ``-inf``; a value above the float32 range (which
includes ``+inf``) is a :class:`MalformedResponseError`.

Speed (``perf-facts.md`` "d2"): module-level reused ``msgspec.json.Decoder`` s, entries as
``array_like`` Structs (the trailing text element is ignored), and ``np.fromiter`` over
``attrgetter`` maps, only for the rows that are kept.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from itertools import chain, islice
from operator import attrgetter
from typing import Annotated, Any, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from ._errors import (
    CapabilityError,
    InvalidSampleError,
    MalformedResponseError,
    MisalignedResponseError,
    ProtocolError,
    ServerAbortError,
)
from ._gc import gc_paused
from ._redact import redact_bearer

__all__ = (
    "PAD_ID",
    "Generation",
    "ScoreRows",
    "Segment",
    "decode_generate_response",
    "decode_segments",
    "parse_student_topk",
)

_F32_MAX = float(np.finfo(np.float32).max)
#: The id of a padding slot in student top-k arrays: a row with fewer than ``k`` entries
#: is padded at its end with it (logprob ``-inf``).
PAD_ID = -1
#: The largest logprob accepted: a log-probability is <= 0; servers' float32 rounding can
#: leave a tiny positive value (log_softmax of a near-certain token).
LOGPROB_TOLERANCE = 1e-4
_MAX_DIM = 2**31  # flat top-k shapes: SGLang's arrays are int32-indexed
_LP = attrgetter("lp")
_ID = attrgetter("id")


_Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class _E(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One SGLang ``[logprob, token_id, text]`` triple; the text (if any) is ignored."""

    lp: float | None
    id: _Int64  # a larger id would overflow numpy's int64 arrays


_Rows = list[list[_E] | None]


class _FinishReason(msgspec.Struct, gc=False, frozen=True):
    type: str | None = None
    message: str | None = None


class _Meta(msgspec.Struct, gc=False, frozen=True):
    # Every field optional, so that an absent one is reported by name (and an abort
    # answer, which may lack the logprob fields, is still recognised as an abort).
    # The output top-k (``output_top_logprobs`` or its flat ``output_top_logprobs_*``
    # fields, nested, JSON flat or b64) is deliberately not declared: no scoring layout
    # uses that row (top-k segments never have a ``tail_col``), so msgspec skips it
    # unparsed in whichever form the server sent it, or none.
    finish_reason: _FinishReason | None = None
    weight_version: str | None = None
    input_token_logprobs: list[_E] | None = None
    input_top_logprobs: _Rows | None = None
    input_token_ids_logprobs: _Rows | None = None
    output_token_ids_logprobs: _Rows | None = None
    input_top_logprobs_shape: list[int] | None = None
    input_top_logprobs_null_prefix: int | None = None
    input_top_logprobs_val_flat_b64: str | None = None
    input_top_logprobs_idx_flat_b64: str | None = None
    input_top_logprobs_val_flat_b64_dtype: str | None = None
    input_top_logprobs_idx_flat_b64_dtype: str | None = None


class _Response(msgspec.Struct, gc=False, frozen=True):
    meta_info: _Meta | None = None


class _GenMeta(msgspec.Struct, gc=False, frozen=True):
    finish_reason: _FinishReason | None = None
    output_token_logprobs: list[_E] | None = None
    output_top_logprobs: _Rows | None = None
    # SGLang >= 0.5.23 ``return_flat_raw_output_top_logprobs`` (+ ``_b64``): the output
    # top-k as flat arrays instead of ``output_top_logprobs`` (see ``_flat_topk``)
    output_top_logprobs_shape: list[int] | None = None
    output_top_logprobs_null_prefix: int | None = None
    output_top_logprobs_val_flat_b64: str | None = None
    output_top_logprobs_idx_flat_b64: str | None = None
    output_top_logprobs_val_flat_b64_dtype: str | None = None
    output_top_logprobs_idx_flat_b64_dtype: str | None = None
    output_top_logprobs_val_flat: list[float | None] | None = None
    output_top_logprobs_idx_flat: list[_Int64] | None = None


class _GenResponse(msgspec.Struct, gc=False, frozen=True):
    output_ids: list[int] | None = None
    meta_info: _GenMeta | None = None


_SINGLE = msgspec.json.Decoder(_Response)
_BATCH = msgspec.json.Decoder(list[_Response])
_GENERATE = msgspec.json.Decoder(_GenResponse | list[_GenResponse])


class ScoreRows(msgspec.Struct, frozen=True, kw_only=True):
    """A decoded, validated scoring answer, response positions only (``R`` rows).

    Attributes:
        token_ids: int64 ``[R]``, the response tokens as echoed by the server
            (validated equal to ``tokens[P:]``).
        token_logprobs: float32 ``[R]``, ``log p(tokens[P+t] | tokens[:P+t])``.
        top_ids: int64 ``[R, top_k]``, best first; ``None`` when ``top_k == 0``.
        top_logprobs: float32 ``[R, top_k]``; ``None`` when ``top_k == 0``.
        id_logprobs: float32 ``[R, k]``, column ``j`` is the logprob of ``ids[:, j]``;
            ``None`` when no ids were requested.
        used_b64: the server answered top-k in the b64 flat form.
        weight_version: the server's ``meta_info.weight_version`` (first item's).
    """

    token_ids: npt.NDArray[np.int64]
    token_logprobs: npt.NDArray[np.float32]
    top_ids: npt.NDArray[np.int64] | None
    top_logprobs: npt.NDArray[np.float32] | None
    id_logprobs: npt.NDArray[np.float32] | None
    used_b64: bool
    weight_version: str | None


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    """One generated completion (``n`` tokens) from a ``/generate`` sampling request.

    Attributes:
        output_ids: int64 ``[n]``.
        output_logprobs: float32 ``[n]``, the sampled tokens' logprobs (``-inf`` for null).
        output_top_ids: int64 ``[n, k]`` best first, or ``None`` if top-k was not returned
            (from the nested rows or the flat / b64 fields, whichever the server sent).
        output_top_logprobs: float32 ``[n, k]`` (``-inf`` for null / NaN), or ``None``.
    """

    output_ids: npt.NDArray[np.int64]
    output_logprobs: npt.NDArray[np.float32]
    output_top_ids: npt.NDArray[np.int64] | None
    output_top_logprobs: npt.NDArray[np.float32] | None


class Segment(NamedTuple):
    """One HTTP item of a scoring request, as far as decoding is concerned.

    Segments are given in response order: their ``rows`` add up to ``R`` and the first
    segment's rows are response positions ``0 .. rows-1``.

    Attributes:
        length: ``len(input_ids)`` of the item (``L_i``).
        start: its ``logprob_start_len`` (``s_i``); ``0 <= s_i < L_i``.
        rows: how many response rows the item carries (its last ``rows`` entries).
        expect: the ids each requested-id row must return, in order: 1-D (one list shared
            by every row: flat / blocked union) or 2-D ``[rows, k]`` (per-position);
            ``None`` when no ids were requested.
        col: ``[rows, k]`` column of ``ids[t, j]`` within row ``t`` (flat / blocked);
            ``None`` means the identity (per-position).
        tail_col: ``-1``, or (blocked id-only items) the item's last row is not an input
            row but ``output_token_ids_logprobs[0]`` (the distribution after the whole
            ``input_ids``, which then stop one token short of the row's target), and the
            target token's logprob is that row's entry at column ``tail_col`` of
            ``expect``. This saves the output row SGLang always answers with
            ``max_new_tokens = 0``, which would otherwise be wasted.
    """

    length: int
    start: int
    rows: int
    expect: npt.NDArray[np.int64] | None = None
    col: npt.NDArray[np.intp] | None = None
    tail_col: int = -1


# --- small helpers -------------------------------------------------------------------


def to_logprobs(values: npt.NDArray[np.float64] | npt.NDArray[np.float32], where: str) -> Any:
    """float64/float32 (NaN for null) -> float32 with -inf for NaN; rejects a value above
    the float32 range, and a logprob above ``LOGPROB_TOLERANCE`` (not a log-probability)."""
    top = float(np.nanmax(values, initial=-np.inf)) if values.size else -np.inf
    if top > _F32_MAX:
        raise MalformedResponseError(f"`{where}` holds a value above the float32 range")
    if top > LOGPROB_TOLERANCE:
        raise MalformedResponseError(
            f"`{where}` holds a logprob above 0, which is not a log-probability"
        )
    out = np.where(np.isnan(values), -np.inf, values)
    with np.errstate(over="ignore"):  # below -float32 max: becomes -inf, as it should
        return out.astype(np.float32)


def _decode_error(exc: msgspec.DecodeError) -> MalformedResponseError:
    return MalformedResponseError(f"cannot decode the response: {exc}")


def _too_deep() -> MalformedResponseError:
    return MalformedResponseError(
        "cannot decode the response: JSON nested too deeply (beyond the decoder's depth limit)"
    )


def _check_abort(fr: _FinishReason | None, where: str, side: str) -> None:
    if fr is not None and fr.type == "abort":
        # bearer tokens masked before the cut (a cut inside one would leave part of it)
        msg = redact_bearer(fr.message or "<no message>")[:500]
        raise ServerAbortError(f"server aborted the request (`{where}`): {msg}", side=side)


def _missing(field: str) -> MalformedResponseError:
    return MalformedResponseError(f"Object missing required field `{field}`")


def _rows_block(
    rows: _Rows, field: str, seg: Segment, t0: int, width: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Validate and convert the last ``seg.rows`` rows of an ``input_*`` row list.

    Returns ids int64 ``[rows, width]`` and logprobs float64 ``[rows, width]`` (NaN = null).
    """
    sel = _checked_rows(rows, field, seg, t0, width)
    n = seg.rows
    total = n * width
    ids = np.fromiter(map(_ID, chain.from_iterable(sel)), dtype=np.int64, count=total)  # type: ignore[arg-type]
    lps = np.fromiter(map(_LP, chain.from_iterable(sel)), dtype=np.float64, count=total)  # type: ignore[arg-type]
    return ids.reshape(n, width), lps.reshape(n, width)


def _b64_array(text: str, dtype: str, count: int, field: str) -> npt.NDArray[Any]:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MalformedResponseError(f"`{field}` is not valid base64: {exc}") from None
    if len(raw) != 4 * count:
        raise MalformedResponseError(
            f"`{field}` decodes to {len(raw)} bytes, expected {4 * count} (shape product x 4)"
        )
    return np.frombuffer(raw, dtype=dtype)


def _b64_topk(
    meta: _Meta, where: str, seg: Segment, top_k: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None:
    """Top-k from the b64 flat fields, or ``None`` when the server answered without them."""
    base = f"{where}.meta_info.input_top_logprobs"
    flat = _FlatTopK(
        meta.input_top_logprobs_shape,
        meta.input_top_logprobs_null_prefix,
        meta.input_top_logprobs_val_flat_b64,
        meta.input_top_logprobs_idx_flat_b64,
        meta.input_top_logprobs_val_flat_b64_dtype,
        meta.input_top_logprobs_idx_flat_b64_dtype,
        None,  # scoring asks for the b64 form only
        None,
    )
    got = _flat_topk(flat, base)
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


# --- scoring answers -------------------------------------------------------------------


def decode_segments(
    body: bytes | bytearray,
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
    with gc_paused():
        return _decode_segments(body, batch, segments, tokens, top_k, per_position)


def _decode_segments(
    body: bytes | bytearray,
    batch: bool,
    segments: Sequence[Segment],
    tokens: npt.NDArray[np.int64],
    top_k: int,
    per_position: bool,
) -> ScoreRows:
    try:
        items = _BATCH.decode(body) if batch else [_SINGLE.decode(body)]
    except msgspec.DecodeError as exc:
        raise _decode_error(exc) from None
    except RecursionError:
        raise _too_deep() from None
    if len(items) != len(segments):
        raise MisalignedResponseError(
            f"batch answer has {len(items)} items, expected {len(segments)}"
        )
    top_i: list[npt.NDArray[np.int64]] = []
    top_lp: list[npt.NDArray[np.float32]] = []
    tok_entries: list[list[_E]] = []
    id_sel: list[_Rows] = []
    used_b64 = top_k > 0
    weight_version: str | None = None
    t0 = 0
    # Structure is checked item by item; the numbers of all items are then converted and
    # checked in one vectorised pass (a blocked answer has R/B small items). Error
    # messages (field paths) are only built on the error paths.
    for n, (item, seg) in enumerate(zip(items, segments, strict=True)):
        meta = item.meta_info
        if meta is None:
            raise _missing(f"{_where(batch, n)}.meta_info")
        fr = meta.finish_reason
        if fr is not None and fr.type == "abort":
            _check_abort(fr, _where(batch, n), "teacher")
        if n == 0:
            weight_version = meta.weight_version
        id_rows = meta.input_token_ids_logprobs
        if seg.expect is not None and id_rows is None:
            if per_position:
                raise CapabilityError(
                    "per_position",
                    "the server ignored token_ids_logprob_positions (no "
                    "meta_info.input_token_ids_logprobs in the answer): it is not a "
                    "per-position-patched SGLang, or a router dropped the field",
                )
            raise _missing(f"{_where(batch, n)}.meta_info.input_token_ids_logprobs")
        entries = meta.input_token_logprobs
        if entries is None or len(entries) != seg.length - seg.start:
            _token_entries(meta, _where(batch, n), seg)  # raises, naming the field
        tok_entries.append(entries)  # type: ignore[arg-type]
        if top_k > 0:
            where = _where(batch, n)
            got = _b64_topk(meta, where, seg, top_k)
            if got is None:
                used_b64 = False
                field = f"{where}.meta_info.input_top_logprobs"
                if meta.input_top_logprobs is None:
                    raise _missing(field)
                ids, lps = _rows_block(meta.input_top_logprobs, field, seg, t0, top_k)
                got = ids, to_logprobs(lps, field)
            if got[0].size and int(got[0].min()) < 0:
                raise MalformedResponseError(f"`{where}` top-k holds a negative token id")
            top_i.append(got[0])
            top_lp.append(got[1])
        if seg.expect is not None:
            assert id_rows is not None
            n_entries, n_in = len(id_rows), _input_rows(seg)
            if n_entries != seg.length - seg.start:
                _checked_rows(id_rows, _id_field(batch, n), seg, t0, seg.expect.shape[-1])
            sel = id_rows[n_entries - n_in :]
            if seg.tail_col >= 0:
                out = meta.output_token_ids_logprobs
                if not out or out[0] is None:
                    _output_row(meta, _where(batch, n), seg, t0, seg.expect.shape[-1])
                sel.append(out[0])  # type: ignore[index]
            id_sel.append(sel)
        t0 += seg.rows
    if id_sel and not _rows_are_well_formed(id_sel, segments):
        _raise_row_error(items, id_sel, segments, batch)
    p = tokens.shape[0] - t0
    id_lp = _id_values(id_sel, segments, batch) if id_sel else None
    token_lp = _token_values(tok_entries, segments, tokens, batch, t0)
    if any(seg.tail_col >= 0 for seg in segments):
        token_lp = _with_tail_values(token_lp, id_sel, segments, batch)
    return ScoreRows(
        token_ids=np.array(tokens[p:], dtype=np.int64),
        token_logprobs=token_lp,
        top_ids=_cat(top_i) if top_k > 0 else None,
        top_logprobs=_cat(top_lp) if top_k > 0 else None,
        id_logprobs=id_lp,
        used_b64=used_b64,
        weight_version=weight_version,
    )


def _cat(parts: list[Any]) -> Any:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _item_of(counts: npt.NDArray[np.intp], flat_index: int) -> tuple[int, int]:
    """(item, index within the item) of a flat index over items of ``counts`` each."""
    ends = np.cumsum(counts)
    item = int(np.searchsorted(ends, flat_index, side="right"))
    return item, flat_index - int(ends[item] - counts[item])


def _where(batch: bool, n: int) -> str:
    return f"$[{n}]" if batch else "$"


def _token_entries(meta: _Meta, where: str, seg: Segment) -> list[_E]:
    field = f"{where}.meta_info.input_token_logprobs"
    entries = meta.input_token_logprobs
    if entries is None:
        raise _missing(field)
    n_entries = seg.length - seg.start
    if len(entries) != n_entries:
        raise MisalignedResponseError(
            f"`{field}` has {len(entries)} entries, expected {n_entries} "
            f"(input length {seg.length} - logprob_start_len {seg.start})"
        )
    return entries


def _token_values(
    entries: list[list[_E]],
    segments: Sequence[Segment],
    tokens: npt.NDArray[np.int64],
    batch: bool,
    r: int,
) -> npt.NDArray[np.float32]:
    """Check the echoed ids of every item, then the logprobs of the response rows answered
    in ``input_token_logprobs`` (all ``R`` but output-row tails), float32."""
    echoed = sum(seg.length - seg.start - 1 for seg in segments)
    got = np.fromiter(
        map(_ID, chain.from_iterable(islice(e, 1, None) for e in entries)),
        dtype=np.int64,
        count=echoed,
    )
    lps = np.fromiter(
        map(
            _LP,
            chain.from_iterable(
                islice(e, len(e) - _input_rows(seg), None)
                for e, seg in zip(entries, segments, strict=True)
            ),
        ),
        dtype=np.float64,
        count=r - sum(seg.tail_col >= 0 for seg in segments),
    )
    return token_values(got, lps, segments, tokens, batch)


def token_values(
    echoed_ids: npt.NDArray[np.int64],
    lps: npt.NDArray[np.float64],
    segments: Sequence[Segment],
    tokens: npt.NDArray[np.int64],
    batch: bool,
) -> npt.NDArray[np.float32]:
    """The sampled tokens' side of an answer, from flat arrays (shared by both parsers).

    Args:
        echoed_ids: the ids of every item's ``input_token_logprobs`` entries but the first,
            items concatenated in order.
        lps: the logprobs of every item's last ``_input_rows(seg)`` entries (NaN = null).

    Raises:
        MisalignedResponseError: an echoed id differs from the one sent (names the item
            and the absolute position).
    """
    echoed = np.array([seg.length - seg.start - 1 for seg in segments], dtype=np.intp)
    sent = _cat([tokens[seg.start + 1 : seg.length] for seg in segments])
    bad = np.flatnonzero(echoed_ids != sent)
    if bad.size:
        n, j = _item_of(echoed, int(bad[0]))
        pos = segments[n].start + 1 + j
        raise MisalignedResponseError(
            f"`{_where(batch, n)}.meta_info.input_token_logprobs`: the token id at absolute "
            f"position {pos} differs from the one sent"
        )
    field = "$[*].meta_info.input_token_logprobs" if batch else "$.meta_info.input_token_logprobs"
    return to_logprobs(lps, field)  # type: ignore[no-any-return]


def _checked_rows(rows: _Rows, field: str, seg: Segment, t0: int, width: int) -> _Rows:
    """The last ``seg.rows`` rows, after checking the entry count, nulls and row widths."""
    n_entries = seg.length - seg.start
    if len(rows) != n_entries:
        raise MisalignedResponseError(
            f"`{field}` has {len(rows)} entries, expected {n_entries} "
            f"(input length {seg.length} - logprob_start_len {seg.start})"
        )
    n = _input_rows(seg)
    first_abs = seg.length - n
    sel = rows[n_entries - n :]
    if None in sel:
        r = sel.index(None)
        raise MisalignedResponseError(
            f"`{field}` row for absolute position {first_abs + r} "
            f"(response position {t0 + r}) is null or empty"
        )
    widths = np.fromiter(map(len, sel), dtype=np.intp, count=n)  # type: ignore[arg-type]
    bad = np.flatnonzero(widths != width)
    if bad.size:
        r = int(bad[0])
        raise MisalignedResponseError(
            f"`{field}` row for absolute position {first_abs + r} (response position {t0 + r}) "
            f"has {int(widths[r])} entries, expected {width}"
        )
    return sel


def _id_field(batch: bool, n: int) -> str:
    return f"{_where(batch, n)}.meta_info.input_token_ids_logprobs"


def _rows_are_well_formed(id_sel: list[_Rows], segments: Sequence[Segment]) -> bool:
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
    items: list[_Response], id_sel: list[_Rows], segments: Sequence[Segment], batch: bool
) -> None:
    """The precise error for rows that failed :func:`_rows_are_well_formed` (item by item)."""
    t0 = 0
    for n, (item, seg) in enumerate(zip(items, segments, strict=True)):
        if seg.expect is not None:
            meta = item.meta_info
            assert meta is not None
            assert meta.input_token_ids_logprobs is not None
            width = seg.expect.shape[-1]
            _checked_rows(meta.input_token_ids_logprobs, _id_field(batch, n), seg, t0, width)
            if seg.tail_col >= 0:
                _output_row(meta, _where(batch, n), seg, t0, width)
        t0 += seg.rows
    raise AssertionError("unreachable: a malformed row was not found again")  # pragma: no cover


def _input_rows(seg: Segment) -> int:
    """The rows of ``seg`` answered in ``input_*`` fields (all but an output-row tail)."""
    return seg.rows - (seg.tail_col >= 0)


def _output_row(meta: _Meta, where: str, seg: Segment, t0: int, width: int) -> list[_E]:
    """``output_token_ids_logprobs[0]``: the tail row of a blocked id-only item."""
    field = f"{where}.meta_info.output_token_ids_logprobs"
    rows = meta.output_token_ids_logprobs
    if rows is None:
        raise _missing(field)
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
    id_sel: list[_Rows],
    segments: Sequence[Segment],
    batch: bool,
) -> npt.NDArray[np.float32]:
    values = np.array(
        [id_sel[n][-1][seg.tail_col].lp for n, seg in enumerate(segments) if seg.tail_col >= 0],  # type: ignore[index]
        dtype=np.float64,
    )
    return with_tail_values(token_lp, values, segments, batch)


def with_tail_values(
    token_lp: npt.NDArray[np.float32],
    tail_values: npt.NDArray[np.float64],
    segments: Sequence[Segment],
    batch: bool,
) -> npt.NDArray[np.float32]:
    """Token logprobs of all ``R`` rows: the input rows' ones with each tail row's inserted.

    A tail row's target logprob is its requested-id entry at ``tail_col`` (the ids were
    checked against ``expect``, whose ``tail_col`` element is the target token);
    ``tail_values`` holds them, one per tail segment in order (NaN = null).
    """
    tails = [n for n, seg in enumerate(segments) if seg.tail_col >= 0]
    field = (
        "$[*].meta_info.output_token_ids_logprobs"
        if batch
        else "$.meta_info.output_token_ids_logprobs"
    )
    tail_lp = to_logprobs(tail_values, field)
    ends = np.cumsum([seg.rows for seg in segments]) - 1
    is_tail = np.zeros(int(ends[-1]) + 1, dtype=bool)
    is_tail[ends[tails]] = True
    out = np.empty(is_tail.shape[0], dtype=np.float32)
    out[is_tail] = tail_lp
    out[~is_tail] = token_lp
    return out


def _id_values(
    sels: list[_Rows], segments: Sequence[Segment], batch: bool
) -> npt.NDArray[np.float32]:
    """Requested-id rows of every item: check the ids, pick the columns, float32 [R, k]."""
    total = sum(seg.rows * seg.expect.shape[-1] for seg in segments if seg.expect is not None)
    flat_rows = chain.from_iterable(chain.from_iterable(sels))  # type: ignore[arg-type]
    ids = np.fromiter(map(_ID, flat_rows), dtype=np.int64, count=total)
    flat_rows = chain.from_iterable(chain.from_iterable(sels))  # type: ignore[arg-type]
    lps = np.fromiter(map(_LP, flat_rows), dtype=np.float64, count=total)
    return id_values(ids, lps, segments, batch)


def id_values(
    ids: npt.NDArray[np.int64],
    lps: npt.NDArray[np.float64],
    segments: Sequence[Segment],
    batch: bool,
) -> npt.NDArray[np.float32]:
    """Check the requested-id entries and pick each row's columns (shared by both parsers).

    Args:
        ids, lps: every selected requested-id row's entries, flat in answer order: per
            item, its ``_input_rows(seg)`` last input rows, then its tail row if any
            (NaN logprob = null).

    Returns:
        float32 ``[R, k]``: column ``j`` of row ``t`` is the logprob of ``ids[t, j]``.

    Raises:
        MisalignedResponseError: an entry that is not the requested id in request order.
    """
    widths = np.array([seg.expect.shape[-1] for seg in segments if seg.expect is not None])
    rows = np.array([seg.rows for seg in segments], dtype=np.intp)
    sizes = rows * widths
    total = int(sizes.sum())
    expect = _expected_ids(segments, widths, rows, total)
    bad = np.flatnonzero(ids != expect)
    if bad.size:
        n, j = _item_of(sizes, int(bad[0]))
        seg = segments[n]
        row = j // int(widths[n])
        t0 = int(rows[:n].sum())
        raise MisalignedResponseError(
            f"`{_where(batch, n)}.meta_info.input_token_ids_logprobs` row for absolute position "
            f"{seg.length - seg.rows + row} (response position {t0 + row}) does not return "
            f"exactly the requested ids in request order"
        )
    row_width = np.repeat(widths, rows)
    row_start = np.concatenate(([0], np.cumsum(row_width)[:-1]))
    cols = _cat(
        [
            seg.col
            if seg.col is not None
            else np.broadcast_to(np.arange(seg.expect.shape[-1]), (seg.rows, seg.expect.shape[-1]))
            for seg in segments
            if seg.expect is not None
        ]
    )
    picked = lps[row_start[:, None] + cols]
    field = (
        "$[*].meta_info.input_token_ids_logprobs"
        if batch
        else "$.meta_info.input_token_ids_logprobs"
    )
    return to_logprobs(picked, field)  # type: ignore[no-any-return]


def _expected_ids(
    segments: Sequence[Segment],
    widths: npt.NDArray[np.intp],
    rows: npt.NDArray[np.intp],
    total: int,
) -> npt.NDArray[np.int64]:
    """The ids every requested-id entry must return, flat, in answer order (``total``).

    A 1-D ``expect`` is repeated for each of its segment's rows, a 2-D one is taken row by
    row. All-1-D layouts (flat, blocked: one small segment per block) are gathered in one
    vectorised pass rather than one ``np.tile`` per segment.
    """
    expects = [seg.expect for seg in segments if seg.expect is not None]
    if any(e.ndim != 1 for e in expects):
        return _cat(  # type: ignore[no-any-return]
            [
                np.tile(e, r) if e.ndim == 1 else e.reshape(-1)
                for e, r in zip(expects, rows, strict=True)
            ]
        )
    union = _cat(expects)
    row_width = np.repeat(widths, rows)
    # entry j of a row starting at flat offset f, of a segment whose ids start at u in
    # ``union``, expects union[u + (j - f)]
    shift = np.repeat(
        np.cumsum(row_width) - row_width - np.repeat(np.cumsum(widths) - widths, rows), row_width
    )
    out: npt.NDArray[np.int64] = union[np.arange(total, dtype=np.intp) - shift]
    return out


# --- generation answers ----------------------------------------------------------------


class _FlatTopK(NamedTuple):
    """The flat top-k fields of one side (``{side}_top_logprobs_*``), as decoded."""

    shape: list[int] | None
    null_prefix: int | None
    val_b64: str | None
    idx_b64: str | None
    val_b64_dtype: str | None
    idx_b64_dtype: str | None
    val: list[float | None] | None
    idx: list[int] | None


def _flat_topk(
    f: _FlatTopK, base: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], int] | None:
    """Decode SGLang's flat top-k fields named ``{base}_*`` (``base`` is the field path of
    the nested ``{side}_top_logprobs``), or ``None`` when neither flat form is present.

    The b64 form (``_val_flat_b64`` little-endian float32, ``_idx_flat_b64`` int32, the
    ``_dtype`` markers optional but checked when present) wins over the JSON form
    (``_val_flat`` numbers or null, ``_idx_flat`` ints); both need ``_shape`` ``[rows, k]``
    and ``_null_prefix``, and hold ``rows * k`` entries, row-major, for the positions after
    the null prefix. Returns ``(ids int64 [rows, k], logprobs float32 [rows, k],
    null_prefix)``; null / NaN logprobs become ``-inf``.

    Raises:
        MalformedResponseError: a missing companion field, a shape that is not two ints
            in ``[0, 2**31)``, a negative null prefix, a wrong dtype marker, bad base64, or
            a value count that is not the shape's product (sizes only in the message).
    """
    val_b64, idx_b64, val, idx = f.val_b64, f.idx_b64, f.val, f.idx
    if val_b64 is not None or idx_b64 is not None:
        if val_b64 is None:
            raise _missing(f"{base}_val_flat_b64")
        if idx_b64 is None:
            raise _missing(f"{base}_idx_flat_b64")
        rows, k, prefix = _flat_layout(f, base)
        for marker, want, name in (
            (f.val_b64_dtype, "float32", "val"),
            (f.idx_b64_dtype, "int32", "idx"),
        ):
            if marker is not None and marker != want:
                raise MalformedResponseError(
                    f"`{base}_{name}_flat_b64_dtype` is {marker[:20]!r}, expected {want!r}"
                )
        v = _b64_array(val_b64, "<f4", rows * k, f"{base}_val_flat_b64")
        i = _b64_array(idx_b64, "<i4", rows * k, f"{base}_idx_flat_b64")
        lps = to_logprobs(v, f"{base}_val_flat_b64")
        ids = i.astype(np.int64)
    elif val is not None or idx is not None:
        if val is None:
            raise _missing(f"{base}_val_flat")
        if idx is None:
            raise _missing(f"{base}_idx_flat")
        rows, k, prefix = _flat_layout(f, base)
        for name, got in (("val", len(val)), ("idx", len(idx))):
            if got != rows * k:
                raise MalformedResponseError(
                    f"`{base}_{name}_flat` has {got} values, expected {rows * k} "
                    f"(shape [{rows}, {k}])"
                )
        lps = to_logprobs(np.array(val, dtype=np.float64), f"{base}_val_flat")
        ids = np.array(idx, dtype=np.int64)
    else:
        return None
    return ids.reshape(rows, k), lps.reshape(rows, k), prefix


def _flat_layout(f: _FlatTopK, base: str) -> tuple[int, int, int]:
    """``(rows, k, null_prefix)`` of flat top-k fields, checked (see :func:`_flat_topk`)."""
    shape, prefix = f.shape, f.null_prefix
    if shape is None:
        raise _missing(f"{base}_shape")
    if prefix is None:
        raise _missing(f"{base}_null_prefix")
    if len(shape) != 2:
        raise MalformedResponseError(
            f"`{base}_shape` has {len(shape)} elements, expected 2 ([rows, k])"
        )
    rows, k = shape
    if not (0 <= rows < _MAX_DIM and 0 <= k < _MAX_DIM):
        raise MalformedResponseError(
            f"`{base}_shape` [{rows}, {k}] has a dimension outside [0, 2**31)"
        )
    if prefix < 0:
        raise MalformedResponseError(f"`{base}_null_prefix` is {prefix}, expected >= 0")
    return rows, k, prefix


def generation_flat_topk(
    meta: _GenMeta | Any, where: str, n: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None:
    """The output top-k from the flat fields, checked like the nested rows: one row per
    output token, none of them null (a null prefix is a null row)."""
    base = f"{where}.meta_info.output_top_logprobs"
    got = _flat_topk(
        _FlatTopK(
            meta.output_top_logprobs_shape,
            meta.output_top_logprobs_null_prefix,
            meta.output_top_logprobs_val_flat_b64,
            meta.output_top_logprobs_idx_flat_b64,
            meta.output_top_logprobs_val_flat_b64_dtype,
            meta.output_top_logprobs_idx_flat_b64_dtype,
            meta.output_top_logprobs_val_flat,
            meta.output_top_logprobs_idx_flat,
        ),
        base,
    )
    if got is None:
        return None
    ids, lps, prefix = got
    rows = ids.shape[0]
    if prefix + rows != n:
        raise MisalignedResponseError(
            f"`{base}_shape` covers null_prefix {prefix} + {rows} rows, expected {n} "
            f"(one per output token)"
        )
    if prefix:
        raise MisalignedResponseError(
            f"`{base}_null_prefix` is {prefix}: the rows of output positions 0..{prefix - 1} "
            f"are null or empty"
        )
    return ids, lps


def decode_generate_response(
    body: bytes | bytearray, *, parser: str = "msgspec"
) -> list[Generation]:
    """Decode a sampling ``/generate`` answer (single object or batch array).

    ``parser="arrow"`` reads it with pyarrow's JSON reader (GIL released, for a thread);
    an answer that path does not accept is decoded with msgspec, which gives the error.

    The output top-k is read from whichever form the server sent: the b64 flat fields
    (``output_top_logprobs_{val,idx}_flat_b64`` + ``_shape`` / ``_null_prefix``, asked by
    ``build_generate_payload(..., topk_wire="b64")`` of SGLang >= 0.5.23), else the JSON flat
    fields (``output_top_logprobs_{val,idx}_flat``), else the nested
    ``output_top_logprobs`` rows; none of them gives ``None``. All forms decode to the same
    arrays (b64 values are the float32 the server computed, as are the JSON ones) and are
    checked alike: one row per output token, no null row, ``k`` entries per row.

    Raises:
        MalformedResponseError: bad JSON / types / a missing ``meta_info`` or
            ``meta_info.output_token_logprobs``; flat top-k fields that are inconsistent
            (a missing companion field, a bad shape or null prefix, a wrong dtype marker,
            bad base64, a value count other than the shape's product).
        MisalignedResponseError: ``output_ids`` differ from the logprob entries' ids,
            or the top-k rows do not match the tokens (count, null rows) or are ragged.
        ServerAbortError: ``finish_reason.type == "abort"``.

    All errors carry ``side="student"``.
    """
    if parser == "arrow":
        from ._decode_arrow import decode_generate_arrow

        fast = decode_generate_arrow(body)
        if fast is not None:
            return fast
    try:
        decoded = _GENERATE.decode(body)
    except msgspec.DecodeError as exc:
        raise MalformedResponseError(f"cannot decode the response: {exc}", side="student") from None
    except RecursionError:
        exc2 = _too_deep()
        exc2.side = "student"
        raise exc2 from None
    if isinstance(decoded, list):
        return [_generation(item, f"$[{n}]") for n, item in enumerate(decoded)]
    return [_generation(decoded, "$")]


def _generation(item: _GenResponse, where: str) -> Generation:
    meta = item.meta_info
    if meta is None:
        raise MalformedResponseError(
            f"Object missing required field `{where}.meta_info`", side="student"
        )
    _check_abort(meta.finish_reason, where, "student")
    entries = meta.output_token_logprobs
    field = f"{where}.meta_info.output_token_logprobs"
    if entries is None:
        raise MalformedResponseError(f"Object missing required field `{field}`", side="student")
    n = len(entries)
    ids = np.fromiter(map(_ID, entries), dtype=np.int64, count=n)
    if item.output_ids is not None and item.output_ids != ids.tolist():
        raise MisalignedResponseError(
            f"`{where}.output_ids` ({len(item.output_ids)} ids) differ from the ids of "
            f"`{field}` ({n} entries)",
            side="student",
        )
    lps = np.fromiter(map(_LP, entries), dtype=np.float64, count=n)
    top_ids = top_lps = None
    try:
        flat = generation_flat_topk(meta, where, n)
    except ProtocolError as exc:
        exc.side = "student"
        raise
    rows = meta.output_top_logprobs
    if flat is not None:
        top_ids, top_lps = flat
    elif rows is not None:
        tfield = f"{where}.meta_info.output_top_logprobs"
        if len(rows) != n:
            raise MisalignedResponseError(
                f"`{tfield}` has {len(rows)} rows, expected {n} (one per output token)",
                side="student",
            )
        k = len(rows[0] or ()) if n else 0
        try:
            tid, tlp = _rows_block(rows, tfield, Segment(length=n, start=0, rows=n), 0, k)
        except MisalignedResponseError as exc:
            exc.side = "student"
            raise
        top_ids, top_lps = tid, to_logprobs(tlp, tfield)
    return Generation(
        output_ids=ids,
        output_logprobs=to_logprobs(lps, field),
        output_top_ids=top_ids,
        output_top_logprobs=top_lps,
    )


# --- student top-k rows from the rollout engine ----------------------------------------

_ROW_IN_PATH = re.compile(r" - at `\$\[(\d+)\]")


def parse_student_topk(
    rows: Sequence[Sequence[Any]], response_length: int, k: int
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

    Returns:
        ``(ids, logprobs)``: int64 ``[R, k]`` and float32 ``[R, k]``; a row with fewer than
        ``k`` entries is padded at its end with id ``-1`` and logprob ``-inf``.

    Raises:
        InvalidSampleError: (field ``student_top_logprobs``) wrong row count, an entry that
            is not ``[number|null, int, ...]`` (bools rejected), a negative id, duplicate
            ids in a row, a NaN / ``+inf`` logprob, or a logprob above ``1e-4`` (not a
            logprob). The message names the row.
    """
    field = "student_top_logprobs"
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
        raise InvalidSampleError(field, f"expected a sequence of rows, got {type(rows).__name__}")
    if len(rows) != response_length:
        raise InvalidSampleError(
            field, f"has {len(rows)} rows, expected response_length = {response_length}"
        )
    try:
        parsed = msgspec.convert(rows, list[list[_E | None]])
    except msgspec.ValidationError as exc:
        text = str(exc)  # e.g. "Expected `int`, got `bool` - at `$[3][1][1]`"
        row = _ROW_IN_PATH.search(text)
        raise InvalidSampleError(field, f"row {row.group(1)}: {text}" if row else text) from None
    total = response_length * k
    kept: Sequence[Sequence[_E | None]] = parsed
    if set(map(len, parsed)) - {k}:
        kept = [row[:k] for row in parsed]
    entries = list(chain.from_iterable(kept))
    if len(entries) == total and None not in entries:  # every row full: the common case
        ids = np.fromiter(map(_ID, entries), dtype=np.int64, count=total)
        lps = np.fromiter(map(_LP, entries), dtype=np.float64, count=total)
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
    _check_student_topk(ids, lps, field)
    return ids, to_logprobs(lps, field)


def _present(row: list[_E | None]) -> list[_E]:
    return [e for e in row if e is not None]


def _padded_topk(
    parsed: list[list[_E | None]], k: int
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


def _check_student_topk(
    ids: npt.NDArray[np.int64], lps: npt.NDArray[np.float64], field: str
) -> None:
    def first_row(mask: npt.NDArray[np.bool_]) -> int | None:
        rows = mask.any(axis=1)  # [R, k] -> [R]; reshape(R, -1) fails when R == 0
        return int(np.argmax(rows)) if rows.any() else None

    if (r := first_row(ids < PAD_ID)) is not None:  # padded rows checked their own ids
        raise InvalidSampleError(field, f"row {r} holds a negative token id")
    if ids.shape[1] > 1:
        s = np.sort(ids, axis=1)
        if (r := first_row((s[:, 1:] == s[:, :-1]) & (s[:, 1:] != PAD_ID))) is not None:
            raise InvalidSampleError(field, f"row {r} holds a duplicate token id")
    if (r := first_row(np.isposinf(lps))) is not None:
        raise InvalidSampleError(field, f"row {r} holds a +inf logprob")
    if (r := first_row(lps > 1e-4)) is not None:
        raise InvalidSampleError(field, f"row {r} holds a value > 0, which is not a logprob")
