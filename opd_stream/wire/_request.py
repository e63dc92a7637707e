"""A scoring request on the SGLang ``/generate`` wire: :class:`ScoreRequest` and its layout.

Sans-IO. This module owns :class:`ScoreRequest`, its checks, and how it maps to HTTP items
(:func:`layout`: one :class:`~opd_stream.wire._answers.Segment` per item; :func:`auto_block_size`).
The bodies are built by :mod:`opd_stream.wire._payloads`, answers decoded by
:mod:`opd_stream.wire._codec` (which picks the parser), error bodies read by
:mod:`opd_stream.wire._error_body`. A request asks, at the ``R`` response positions of
``tokens`` (``L = P + R``, ``P >= 1``), for the sampled token's logprob, the top-``top_k``
(optional) and caller-chosen ``ids[t, :]`` (optional) in one of three id forms:
``per-position``, ``flat`` or ``blocked`` (``block_size = 0``: auto). The forms, ``start``
and the body's fields: ``docs/design-notes.md``, "opd_stream/wire/_request.py".
"""

from __future__ import annotations

from typing import Any, Final, Literal, get_args

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import InvalidSampleError
from ..scanner._loader import compiled
from ._answers import Segment

__all__ = (
    "AUTO_BLOCK_SIZES",
    "ENGINES",
    "Engine",
    "IdForm",
    "Layout",
    "ScoreRequest",
    "auto_block_size",
    "column_chunks",
    "json_digits",
    "layout",
    "multi_body",
    "resolved_block_size",
)

IdForm = Literal["per-position", "flat", "blocked", "blocks"]

Engine = Literal["sglang", "vllm", "vllm-completions"]
"""The dialect a server speaks: SGLang's ``/generate``; vLLM's scale-out
``POST /inference/v1/generate`` (``vllm serve --enable-scale-out``; ids per position, binary
answer); vLLM's OpenAI ``POST /v1/completions`` (any vLLM; whole-prompt rows, top-k only)."""
#: The same names as a tuple, in this order.
ENGINES: Final[tuple[Engine, ...]] = get_args(Engine)

_MAX_ID = 2**31  # SGLang ships ids as int32; anything at or above this cannot be a token id


class ScoreRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What to ask a server about one sample (see the module docstring for the forms).

    Attributes:
        tokens: int64 ``[L]``, prompt followed by response.
        response_length: ``R``, ``1 <= R <= L - 1``.
        top_k: ``> 0`` asks ``top_logprobs_num = top_k``.
        ids: int64 ``[R, k]`` (``k >= 1``), ids to score at each response position; no
            duplicates within a row; ``0 <= id < 2**31``.
        id_form: how ``ids`` travel: ``"per-position"``, ``"flat"``, ``"blocked"`` (one
            batch body) or ``"blocks"`` (the blocked layout's items as independent single
            requests: :func:`build_block_payloads`, :func:`decode_block_answers`).
        start: ``logprob_start_len`` = ``P - 1`` (``"prompt"``) or ``0`` (``"zero"``).
        topk_wire: ``"b64"`` asks for the b64 flat top-k fields.
        block_size: ``B`` for the blocked form; 0 = auto (:func:`auto_block_size`).
        cache_salt: SGLang's ``cache_salt`` (requests with different salts share no cached
            prefix); ``None`` sends none.
        salt_each_item: each HTTP item gets a salt of its own (``cache_salt`` + ``-n`` for
            item or block ``n``), so not even the blocks of one request share a prefix.
        engine: the server's dialect (:data:`Engine`). For ``"vllm"`` the id form, ``start``,
            ``topk_wire`` and ``block_size`` do not apply: ids always travel per position
            (``prompt_logprob_token_ids``), from the response start.
        max_ids: vLLM only: the id columns per row the server allows (its
            ``--max-logprobs``); a request with more columns (the sampled token's + ``k``)
            is sent as several bodies, one per chunk of columns (:func:`column_chunks`).
            0 = no cap.
        ids_checked: ``ids`` hold only ids in ``[0, 2**31)``, distinct within each row,
            checked already by whoever made them (the stream: a sample's own top-k ids,
            checked when the sample was prepared, with its padding filled): :func:`layout`
            checks their shape and type, not every id again. ``False``: every id is checked.
    """

    tokens: npt.NDArray[np.int64]
    response_length: int
    top_k: int = 0
    ids: npt.NDArray[np.int64] | None = None
    id_form: IdForm = "per-position"
    start: Literal["prompt", "zero"] = "prompt"
    topk_wire: Literal["b64", "json"] = "json"
    block_size: int = 0
    cache_salt: str | None = None
    salt_each_item: bool = False
    engine: Engine = "sglang"
    max_ids: int = 0
    ids_checked: bool = False


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """A checked request as HTTP items: one :class:`Segment` per item (a batch when several)."""

    tokens: npt.NDArray[np.int64]
    prompt_length: int
    batch: bool
    segments: list[Segment]
    unions: list[npt.NDArray[np.int64]]  # per item, flat / blocked forms only


def _check_request(req: ScoreRequest) -> tuple[npt.NDArray[np.int64], int]:
    tokens = np.asarray(req.tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise InvalidSampleError(
            "tokens", f"expected a 1-D integer array, got {tokens.dtype}{list(tokens.shape)}"
        )
    length, r = tokens.shape[0], req.response_length
    if not 1 <= r <= length - 1:
        raise InvalidSampleError(
            "response_length", f"{r} is outside [1, {length - 1}] for {length} tokens (P >= 1)"
        )
    if req.top_k < 0:
        raise InvalidSampleError("top_k", f"{req.top_k} < 0")
    if req.id_form not in ("per-position", "flat", "blocked", "blocks"):
        raise InvalidSampleError("id_form", f"unknown id form {req.id_form!r}")
    if req.start not in ("prompt", "zero"):
        raise InvalidSampleError("start", f"unknown start {req.start!r}")
    if req.topk_wire not in ("b64", "json"):
        raise InvalidSampleError("topk_wire", f"unknown top-k wire form {req.topk_wire!r}")
    if req.block_size < 0:
        raise InvalidSampleError("block_size", f"{req.block_size} < 0")
    if req.engine not in ENGINES:
        raise InvalidSampleError("engine", f"unknown engine {req.engine!r}")
    if req.max_ids < 0:
        raise InvalidSampleError("max_ids", f"{req.max_ids} < 0")
    ids = req.ids
    if ids is not None:
        if ids.ndim != 2 or ids.shape[0] != r or ids.shape[1] < 1:
            raise InvalidSampleError("ids", f"shape {list(ids.shape)}, expected [{r}, k >= 1]")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidSampleError("ids", f"dtype {ids.dtype} is not an integer type")
        if not req.ids_checked and (fault := _id_fault(ids)) is not None:
            raise InvalidSampleError("ids", fault)
    return tokens.astype(np.int64, copy=False), length - r


def _id_fault(ids: npt.NDArray[np.integer[Any]]) -> str | None:
    """What is wrong with requested ``ids`` (``[R, k]``, integers): an id outside
    ``[0, 2^31)`` (first), else the first row that holds an id twice; ``None`` if nothing.
    One compiled pass where the kernels are ready."""
    kernel = compiled()
    if kernel is not None:
        # (a uint64 id past int64 wraps to a negative one: outside the range all the same)
        fault, row = kernel.id_fault(np.ascontiguousarray(ids, np.int64), _MAX_ID)
        return None if fault == 0 else _ID_FAULTS[fault].format(row=row)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= _MAX_ID):
        return _ID_FAULTS[1]
    s = np.sort(ids, axis=1)
    dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
    return _ID_FAULTS[2].format(row=int(np.argmax(dup))) if dup.any() else None


_ID_FAULTS = {
    1: f"an id is outside [0, {_MAX_ID})",
    2: "duplicate id in the row of response position {row}",
}


def _sorted_unique(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``np.unique`` by sorting (numpy 2's hash-based unique is ~5x slower here)."""
    s = np.sort(values)
    if s.size == 0:
        return s
    keep = np.empty(s.shape[0], dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


#: Block sizes ``auto`` chooses from.
AUTO_BLOCK_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
_ENTRY_BYTES = 33  # one ``[lp,id,null]`` answer entry (docs/performance.md, "Answer sizes")
_ITEM_BYTES = 450  # one batch item's fixed answer fields (id, finish_reason, counts, ...)


def json_digits(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The decimal digits of each non-negative id: its length in compact JSON."""
    digits = np.ones(values.shape, dtype=np.int64)
    if values.size == 0:
        return digits
    top = int(values.max())
    for power in range(1, 19):
        if top < 10**power:
            break
        digits += values >= 10**power
    return digits


def _json_int_bytes(values: npt.NDArray[np.int64]) -> float:
    """Mean bytes of one non-negative id in a compact JSON list (digits + comma)."""
    if values.size == 0:
        return 0.0
    return float(json_digits(values).mean()) + 1.0


def auto_block_size(
    tokens: npt.NDArray[np.int64], response_length: int, ids: Any, *, top_k: int = 0
) -> int:
    """The blocked form's block size that minimises the estimated bytes on the wire.

    Small blocks make small answers (each block answers ``(B + 1)`` rows of its union of
    ids) but re-send the prefix once per block; large blocks do the opposite. For each
    candidate ``B`` in :data:`AUTO_BLOCK_SIZES` (up to ``R``) this estimates the answer,
    ``R · U_B · 33 + 450 · blocks`` bytes (``(R + blocks) · ...`` with ``top_k > 0``, where
    each block's output row is an extra row rather than its last one), and the request,
    every block's prefix at the measured bytes per token id plus its union, where the
    union size ``U_B`` grows by
    the measured overlap of adjacent rows: ``U_B = min(B·k, k + (B - 1)·d)`` with
    ``d = mean |union(ids[t], ids[t+1])| - k``. Deterministic in its inputs, so the decoder
    re-derives the same layout.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[0] != response_length or ids.shape[1] < 1:
        raise InvalidSampleError(
            "ids", f"shape {list(ids.shape)}, expected [{response_length}, k >= 1]"
        )
    r, k = ids.shape
    if r < 2:
        return 1
    pair = np.sort(np.concatenate((ids[:-1], ids[1:]), axis=1), axis=1)
    pair_union = k * 2 - (pair[:, 1:] == pair[:, :-1]).sum(axis=1)
    d = float(pair_union.mean()) - k
    p = tokens.shape[0] - r
    tok_b, id_b = _json_int_bytes(tokens), _json_int_bytes(ids[: min(r, 64)])
    best, best_cost = 1, np.inf
    for b in AUTO_BLOCK_SIZES:
        if b > r:
            break
        n_blocks = -(-r // b)
        u = min(b * k, k + (b - 1) * d)
        # every row answers the block's union; with top-k the output row is one more
        rows = r + (n_blocks if top_k > 0 else 0)
        answer = rows * u * _ENTRY_BYTES + n_blocks * _ITEM_BYTES
        ends = np.minimum(np.arange(1, n_blocks + 1) * b, r)
        request = (n_blocks * p + int(ends.sum())) * tok_b + n_blocks * (u * id_b + 16)
        if answer + request < best_cost:
            best, best_cost = b, answer + request
    return best


def resolved_block_size(req: ScoreRequest) -> int:
    """``req.block_size``, or the automatic choice when it is 0 (blocked form with ids)."""
    if req.block_size > 0 or req.ids is None:
        return max(req.block_size, 1)
    return auto_block_size(np.asarray(req.tokens), req.response_length, req.ids, top_k=req.top_k)


def column_chunks(req: ScoreRequest) -> list[tuple[int, int]]:
    """vLLM scale-out: the id columns of each body, as ``[lo, hi)`` ranges over the
    columns ``[sampled token, ids[:, 0], ..., ids[:, k-1]]`` (``1 + k`` in all), at most
    ``max_ids`` per body (all in one when ``max_ids`` is 0). One range for any other
    engine."""
    cols = 1 + (0 if req.ids is None else int(np.shape(req.ids)[1]))
    if req.engine != "vllm" or req.max_ids <= 0 or cols <= req.max_ids:
        return [(0, cols)]
    m = req.max_ids
    return [(lo, min(lo + m, cols)) for lo in range(0, cols, m)]


def multi_body(req: ScoreRequest) -> bool:
    """Whether ``req`` is sent as several independent bodies (:func:`~opd_stream.wire._payloads.
    build_block_payloads`, answers decoded together as a list by
    :func:`~opd_stream.wire._codec.decode`): SGLang's ``"blocks"`` id form, or a vLLM
    scale-out request with more id columns than ``max_ids``."""
    if req.ids is None:
        return False
    if req.engine == "sglang":
        return req.id_form == "blocks"
    return len(column_chunks(req)) > 1


def layout(req: ScoreRequest) -> Layout:
    """Validate ``req`` and derive the items, their layouts and expected ids (a vLLM request:
    one segment, from the response start, the ids per position)."""
    tokens, p = _check_request(req)
    length, r, ids = tokens.shape[0], req.response_length, req.ids
    if req.engine != "sglang":
        s = p - 1 if req.engine == "vllm" else 0
        expect = None if ids is None else ids.astype(np.int64, copy=False)
        seg = Segment(length=length, start=s, rows=r, expect=expect)
        return Layout(tokens=tokens, prompt_length=p, batch=False, segments=[seg], unions=[])
    s = p - 1 if req.start == "prompt" else 0
    if ids is None:
        seg = Segment(length=length, start=s, rows=r)
        return Layout(tokens=tokens, prompt_length=p, batch=False, segments=[seg], unions=[])
    ids = ids.astype(np.int64, copy=False)
    if req.id_form == "per-position":
        seg = Segment(length=length, start=s, rows=r, expect=ids)
        return Layout(tokens=tokens, prompt_length=p, batch=False, segments=[seg], unions=[])
    if req.id_form == "flat":
        union = _sorted_unique(ids.reshape(-1))
        col = np.searchsorted(union, ids)
        seg = Segment(length=length, start=s, rows=r, expect=union, col=col)
        return Layout(tokens=tokens, prompt_length=p, batch=False, segments=[seg], unions=[union])
    # blocked: per-block unions in one vectorised pass over keys (block, id)
    b = resolved_block_size(req)
    n_blocks = -(-r // b)
    block_of = np.arange(r, dtype=np.int64) // b
    ends = np.minimum(np.arange(1, n_blocks + 1) * b, r)
    # id-only: each block's last row is SGLang's output row (see Segment.tail_col), so the
    # block's last target token joins its union and its prefix stops one token short
    tail = req.top_k == 0
    last_tokens = tokens[p + ends - 1]
    span = max(int(ids.max()), int(last_tokens.max()) if tail else 0) + 1
    keys = block_of[:, None] * span + ids
    all_keys = keys.reshape(-1)
    if tail:
        tail_keys = np.arange(n_blocks, dtype=np.int64) * span + last_tokens
        all_keys = np.concatenate((all_keys, tail_keys))
    ukeys = _sorted_unique(all_keys)
    bounds = np.searchsorted(ukeys // span, np.arange(n_blocks + 1))
    cols = np.searchsorted(ukeys, keys) - bounds[block_of][:, None]
    tail_cols = np.searchsorted(ukeys, tail_keys) - bounds[:-1] if tail else None
    union_all = ukeys % span
    segments, unions = [], []
    for blk in range(n_blocks):
        lo, hi = blk * b, int(ends[blk])
        union = union_all[bounds[blk] : bounds[blk + 1]]
        unions.append(union)
        segments.append(
            Segment(
                length=p + hi - tail,
                start=p + lo - 1,
                rows=hi - lo,
                expect=union,
                col=cols[lo:hi],
                tail_col=int(tail_cols[blk]) if tail_cols is not None else -1,
            )
        )
    return Layout(tokens=tokens, prompt_length=p, batch=True, segments=segments, unions=unions)
