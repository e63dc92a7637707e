"""The msgspec decoder of sampling (rollout) ``/generate`` answers:
:func:`decode_generate_response`.
"""

from __future__ import annotations

import msgspec
import numpy as np

from .._errors import MalformedResponseError, MisalignedResponseError, ProtocolError
from ._answers import Body, Generation, Segment
from ._checks import generation_flat_topk, to_logprobs
from ._entries import (
    ENTRY_ID,
    ENTRY_LP,
    Entry,
    EntryRows,
    FinishReason,
    Int64,
    check_abort,
    rows_block,
    too_deep,
)

__all__ = ("decode_generate_response",)


class _GenMeta(msgspec.Struct, gc=False, frozen=True):
    finish_reason: FinishReason | None = None
    output_token_logprobs: list[Entry] | None = None
    output_top_logprobs: EntryRows | None = None
    # SGLang >= 0.5.23 ``return_flat_raw_output_top_logprobs`` (+ ``_b64``): the output
    # top-k as flat arrays instead of ``output_top_logprobs`` (see ``flat_topk``)
    output_top_logprobs_shape: list[int] | None = None
    output_top_logprobs_null_prefix: int | None = None
    output_top_logprobs_val_flat_b64: str | None = None
    output_top_logprobs_idx_flat_b64: str | None = None
    output_top_logprobs_val_flat_b64_dtype: str | None = None
    output_top_logprobs_idx_flat_b64_dtype: str | None = None
    output_top_logprobs_val_flat: list[float | None] | None = None
    output_top_logprobs_idx_flat: list[Int64] | None = None


class _GenResponse(msgspec.Struct, gc=False, frozen=True):
    output_ids: list[int] | None = None
    meta_info: _GenMeta | None = None


_GENERATE = msgspec.json.Decoder(_GenResponse | list[_GenResponse])


def decode_generate_response(body: Body) -> list[Generation]:
    """Decode a sampling ``/generate`` answer (single object or batch array).

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
    try:
        decoded = _GENERATE.decode(body)
    except msgspec.DecodeError as exc:
        raise MalformedResponseError(f"cannot decode the response: {exc}", side="student") from None
    except RecursionError:
        exc2 = too_deep()
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
    check_abort(meta.finish_reason, where, "student")
    entries = meta.output_token_logprobs
    field = f"{where}.meta_info.output_token_logprobs"
    if entries is None:
        raise MalformedResponseError(f"Object missing required field `{field}`", side="student")
    n = len(entries)
    ids = np.fromiter(map(ENTRY_ID, entries), dtype=np.int64, count=n)
    if item.output_ids is not None and item.output_ids != ids.tolist():
        raise MisalignedResponseError(
            f"`{where}.output_ids` ({len(item.output_ids)} ids) differ from the ids of "
            f"`{field}` ({n} entries)",
            side="student",
        )
    lps = np.fromiter(map(ENTRY_LP, entries), dtype=np.float64, count=n)
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
            tid, tlp = rows_block(rows, tfield, Segment(length=n, start=0, rows=n), 0, k)
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
