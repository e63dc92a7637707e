"""The array-level checks of an answer, shared by both parsers (msgspec and the compiled scanner).

Each takes flat numpy arrays (however they were parsed) and the request's
:class:`~opd_stream.wire._answers.Segment` s, checks them and gives the validated arrays:
:func:`to_logprobs` (null / NaN -> ``-inf``, nothing above 0), :func:`token_values` (echoed
ids, sampled tokens' logprobs), :func:`id_values` (requested ids, their columns),
:func:`with_tail_values` (blocked id-only tail rows), and the flat top-k fields
(:func:`flat_topk`, :func:`generation_flat_topk`: b64 or JSON flat arrays). Errors name the
field as a ``$.meta_info.…`` path and a position, never a payload value.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .._errors import MalformedResponseError, MisalignedResponseError, WeightVersionChanged
from ._answers import Segment

__all__ = (
    "LOGPROB_TOLERANCE",
    "FlatTopK",
    "cat",
    "flat_topk",
    "generation_flat_topk",
    "id_values",
    "input_rows",
    "item_of",
    "item_path",
    "missing_field",
    "one_weight_version",
    "spread",
    "to_logprobs",
    "token_values",
    "with_tail_values",
)

_F32_MAX = float(np.finfo(np.float32).max)
#: The largest logprob accepted: a log-probability is <= 0; servers' float32 rounding can
#: leave a tiny positive value (log_softmax of a near-certain token).
LOGPROB_TOLERANCE = 1e-4
_MAX_DIM = 2**31  # flat top-k shapes: SGLang's arrays are int32-indexed


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


def one_weight_version(values: Sequence[str | None]) -> str | None:
    """The one ``meta_info.weight_version`` of an answer's items (block answers included).

    Raises:
        WeightVersionChanged: the items report different versions (a missing one counts as
            a version of its own), i.e. weights changed while the sample was scored.
    """
    first = values[0] if values else None
    for v in values:
        if v != first:
            seen = tuple(dict.fromkeys(values))
            raise WeightVersionChanged(seen, where="the items of one answer")
    return first


def missing_field(field: str) -> MalformedResponseError:
    return MalformedResponseError(f"Object missing required field `{field}`")


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


def cat(parts: list[Any]) -> Any:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def item_of(counts: npt.NDArray[np.intp], flat_index: int) -> tuple[int, int]:
    """(item, index within the item) of a flat index over items of ``counts`` each."""
    ends = np.cumsum(counts)
    item = int(np.searchsorted(ends, flat_index, side="right"))
    return item, flat_index - int(ends[item] - counts[item])


def item_path(batch: bool, n: int) -> str:
    return f"$[{n}]" if batch else "$"


def input_rows(seg: Segment) -> int:
    """The rows of ``seg`` answered in ``input_*`` fields (all but an output-row tail)."""
    return seg.rows - (seg.tail_col >= 0)


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
        lps: the logprobs of every item's last ``input_rows(seg)`` entries (NaN = null).

    Raises:
        MisalignedResponseError: an echoed id differs from the one sent (names the item
            and the absolute position).
    """
    echoed = np.array([seg.length - seg.start - 1 for seg in segments], dtype=np.intp)
    sent = cat([tokens[seg.start + 1 : seg.length] for seg in segments])
    bad = np.flatnonzero(echoed_ids != sent)
    if bad.size:
        n, j = item_of(echoed, int(bad[0]))
        pos = segments[n].start + 1 + j
        raise MisalignedResponseError(
            f"`{item_path(batch, n)}.meta_info.input_token_logprobs`: the token id at absolute "
            f"position {pos} differs from the one sent"
        )
    field = "$[*].meta_info.input_token_logprobs" if batch else "$.meta_info.input_token_logprobs"
    return to_logprobs(lps, field)  # type: ignore[no-any-return]


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


_SPREAD_BY_CUMSUM = 1 << 16


def spread(values: npt.NDArray[Any], counts: npt.NDArray[np.intp]) -> npt.NDArray[Any]:
    """``np.repeat(values, counts)`` (integer ``values``, ``counts >= 0``). ``np.repeat``
    keeps the GIL, ~5-60 ms for a million outputs; a long result is built instead as the
    running sum of the jumps between consecutive values, in numpy calls that release it."""
    total = int(counts.sum())
    if total < _SPREAD_BY_CUMSUM:
        return np.repeat(values, counts)
    keep = counts > 0
    v, c = values[keep], counts[keep]
    jumps = np.zeros(total, dtype=np.result_type(values.dtype, np.intp))
    jumps[np.cumsum(c) - c] = np.diff(v, prepend=0)
    return np.cumsum(jumps, out=jumps)


def id_values(
    ids: npt.NDArray[np.int64],
    lps: npt.NDArray[np.float64],
    segments: Sequence[Segment],
    batch: bool,
) -> npt.NDArray[np.float32]:
    """Check the requested-id entries and pick each row's columns (shared by both parsers).

    Args:
        ids, lps: every selected requested-id row's entries, flat in answer order: per
            item, its ``input_rows(seg)`` last input rows, then its tail row if any
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
        n, j = item_of(sizes, int(bad[0]))
        seg = segments[n]
        row = j // int(widths[n])
        t0 = int(rows[:n].sum())
        raise MisalignedResponseError(
            f"`{item_path(batch, n)}.meta_info.input_token_ids_logprobs` row for absolute position "
            f"{seg.length - seg.rows + row} (response position {t0 + row}) does not return "
            f"exactly the requested ids in request order"
        )
    row_width = np.repeat(widths, rows)
    row_start = np.concatenate(([0], np.cumsum(row_width)[:-1]))
    cols = cat(
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
        return cat(  # type: ignore[no-any-return]
            [
                np.tile(e, r) if e.ndim == 1 else e.reshape(-1)
                for e, r in zip(expects, rows, strict=True)
            ]
        )
    union = cat(expects)
    row_width = np.repeat(widths, rows)
    # entry j of a row starting at flat offset f, of a segment whose ids start at u in
    # ``union``, expects union[u + (j - f)]
    shift = spread(
        np.cumsum(row_width) - row_width - np.repeat(np.cumsum(widths) - widths, rows), row_width
    )
    out: npt.NDArray[np.int64] = union[np.arange(total, dtype=np.intp) - shift]
    return out


# --- flat top-k fields (b64 or JSON) ---------------------------------------------------


class FlatTopK(NamedTuple):
    """The flat top-k fields of one side (``{side}_top_logprobs_*``), as decoded."""

    shape: list[int] | None
    null_prefix: int | None
    val_b64: str | None
    idx_b64: str | None
    val_b64_dtype: str | None
    idx_b64_dtype: str | None
    val: list[float | None] | None
    idx: list[int] | None


def flat_topk(
    f: FlatTopK, base: str
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
            raise missing_field(f"{base}_val_flat_b64")
        if idx_b64 is None:
            raise missing_field(f"{base}_idx_flat_b64")
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
            raise missing_field(f"{base}_val_flat")
        if idx is None:
            raise missing_field(f"{base}_idx_flat")
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


def _flat_layout(f: FlatTopK, base: str) -> tuple[int, int, int]:
    """``(rows, k, null_prefix)`` of flat top-k fields, checked (see :func:`flat_topk`)."""
    shape, prefix = f.shape, f.null_prefix
    if shape is None:
        raise missing_field(f"{base}_shape")
    if prefix is None:
        raise missing_field(f"{base}_null_prefix")
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
    meta: Any, where: str, n: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None:
    """The output top-k from the flat fields, checked like the nested rows: one row per
    output token, none of them null (a null prefix is a null row)."""
    base = f"{where}.meta_info.output_top_logprobs"
    got = flat_topk(
        FlatTopK(
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
