"""What a decoded answer is: :class:`ScoreRows` (scoring), :class:`Generation` (sampling),
and :class:`Segment`, one HTTP item of a scoring request as the decoders see it.

Shared by the msgspec decoders (:mod:`opd_stream.wire._decode_score`,
:mod:`opd_stream.wire._decode_generate`), the scanner's column decoder
(:mod:`opd_stream.wire._decode_columns`) and the request layout (:mod:`opd_stream.wire._request`,
which
turns a request into segments).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = ("Body", "Generation", "ScoreRows", "Segment", "total_cached")

#: An answer's body as the transports give it: ``bytes``, or what it was read into without
#: another copy (a ``bytearray`` the chunks were joined into, or a ``memoryview`` of the
#: buffer they were copied into as they came). Read-only by convention; every decoder
#: takes any of the three.
Body = bytes | bytearray | memoryview


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
        cached_tokens: input tokens the server served from its prefix cache
            (``meta_info.cached_tokens``, summed over the items); ``None`` when no item
            reports it.
    """

    token_ids: npt.NDArray[np.int64]
    token_logprobs: npt.NDArray[np.float32]
    top_ids: npt.NDArray[np.int64] | None
    top_logprobs: npt.NDArray[np.float32] | None
    id_logprobs: npt.NDArray[np.float32] | None
    used_b64: bool
    weight_version: str | None
    cached_tokens: int | None = None


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


def total_cached(values: Sequence[int | None]) -> int | None:
    """The items' ``meta_info.cached_tokens`` summed (``None`` when none reports one)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None
