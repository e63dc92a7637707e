"""Sampling ``/generate`` answers parsed by pyarrow's JSON reader (the fast path of
:func:`opd_stream._decode_generate.decode_generate_response` with ``parser="arrow"``).

The rule of :mod:`opd_stream._decode_arrow` holds here too: an answer is accepted only when
every check of the msgspec decoder passes, with the same arrays; anything else gives
``None`` and the caller decodes it with msgspec for the precise error.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np
import numpy.typing as npt

from ._answers import Body, Generation
from ._arrow_reader import ArrowEntries, ArrowRows, gather, read_rows
from ._decode_checks import generation_flat_topk, to_logprobs
from ._errors import ProtocolError

__all__ = ("decode_generate_arrow",)

_GEN_FLAT = ("val_flat_b64", "idx_flat_b64", "val_flat_b64_dtype", "idx_flat_b64_dtype")


@functools.cache
def _generation_schema() -> Any:
    """The explicit schema of one generation answer (the fields msgspec's decoder declares)."""
    import pyarrow as pa

    entries = pa.list_(pa.list_(pa.float64()))
    meta = pa.struct(
        [
            ("finish_reason", pa.struct([("type", pa.string()), ("message", pa.string())])),
            ("output_token_logprobs", entries),
            ("output_top_logprobs", pa.list_(entries)),
            ("output_top_logprobs_shape", pa.list_(pa.int64())),
            ("output_top_logprobs_null_prefix", pa.int64()),
            *((f"output_top_logprobs_{name}", pa.string()) for name in _GEN_FLAT),
            ("output_top_logprobs_val_flat", pa.list_(pa.float64())),
            ("output_top_logprobs_idx_flat", pa.list_(pa.int64())),
        ]
    )
    return pa.schema([("output_ids", pa.list_(pa.int64())), ("meta_info", meta)])


def decode_generate_arrow(body: Body) -> list[Generation] | None:
    """A sampling answer as :func:`opd_stream._decode_generate.decode_generate_response` decodes
    it, or ``None`` (then decode it with msgspec, which raises the precise error)."""
    batch = bytes(body[:64]).lstrip()[:1] == b"["
    try:
        return _generations(body, batch)
    except ProtocolError:
        return None


def _generations(body: Body, batch: bool) -> list[Generation] | None:
    table = read_rows(body, batch, _generation_schema())
    if table is None:
        return None
    metas = table.column("meta_info").combine_chunks()
    output_ids = table.column("output_ids").combine_chunks()
    if metas.null_count or "abort" in metas.field("finish_reason").field("type").to_pylist():
        return None
    tok_field = metas.field("output_token_logprobs")
    top_field = metas.field("output_top_logprobs")
    if tok_field.null_count:
        return None
    tok, top = ArrowEntries(tok_field.values), ArrowRows(top_field)
    if not (tok.ok and top.ok):
        return None
    tok_off = tok_field.offsets.to_numpy()
    ids_given = output_ids.values.to_numpy(zero_copy_only=False)
    ids_off = output_ids.offsets.to_numpy()
    ids_null = output_ids.is_null().to_numpy(zero_copy_only=False)
    flat_cols = {
        name: metas.field(f"output_top_logprobs_{name}")
        for name in ("shape", "null_prefix", *_GEN_FLAT, "val_flat", "idx_flat")
    }
    out = []
    for n in range(len(metas)):
        where = f"$[{n}]" if batch else "$"
        lo, hi = int(tok_off[n]), int(tok_off[n + 1])
        count = hi - lo
        ids_f = tok.ids[lo:hi]
        if float(np.abs(ids_f).max(initial=0)) >= 2.0**53:
            return None
        ids = ids_f.astype(np.int64)
        if not ids_null[n]:
            given = ids_given[ids_off[n] : ids_off[n + 1]]
            if given.shape != ids.shape or not np.array_equal(given, ids):
                return None
        lps = to_logprobs(tok.lps[lo:hi], f"{where}.meta_info.output_token_logprobs")
        values = {name: col[n].as_py() for name, col in flat_cols.items()}
        if not _flat_values_ok(values):
            return None
        meta = types.SimpleNamespace(
            **{f"output_top_logprobs_{name}": v for name, v in values.items()}
        )
        flat = generation_flat_topk(meta, where, count)
        top_ids = top_lps = None
        if flat is not None:
            top_ids, top_lps = flat
        elif not top.item_null[n]:
            got = _generation_rows(top, n, count, where)
            if got is None:
                return None
            top_ids, top_lps = got
        out.append(
            Generation(
                output_ids=ids,
                output_logprobs=lps,
                output_top_ids=top_ids,
                output_top_logprobs=top_lps,
            )
        )
    return out


def _generation_rows(
    top: ArrowRows, n: int, count: int, where: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None:
    """Item ``n``'s nested top-k rows: one per output token, none null, all as wide as
    the first."""
    if top.count(n) != count:
        return None
    rows = np.arange(top.item_off[n], top.item_off[n + 1])
    k = int(top.row_width[rows[0]]) if count else 0
    if top.row_null[rows].any() or (top.row_width[rows] != k).any():
        return None
    sel = gather(top.entry_off[rows], np.full(count, k, dtype=np.intp))
    ids = top.entries.ids[sel]
    if ids.size and float(np.abs(ids).max()) >= 2.0**53:
        return None
    lps = to_logprobs(top.entries.lps[sel], f"{where}.meta_info.output_top_logprobs")
    return ids.astype(np.int64).reshape(count, k), lps.reshape(count, k)


def _flat_values_ok(values: dict[str, Any]) -> bool:
    """What msgspec's types reject and the reader lets through: a null inside the shape or
    the ids, a NaN / infinite literal among the values."""
    for name in ("shape", "idx_flat"):
        if values[name] is not None and None in values[name]:
            return False
    val = values["val_flat"]
    if val is not None:
        arr = np.array([np.nan if v is None else v for v in val], dtype=np.float64)
        present = np.array([v is not None for v in val], dtype=bool)
        if (present & ~np.isfinite(arr)).any():
            return False
    return True
