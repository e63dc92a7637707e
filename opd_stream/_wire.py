"""SGLang ``/generate`` wire format: payload builders, response decoders, error bodies.

Sans-IO: bytes in, bytes or numpy arrays out. The decoders live in :mod:`opd_stream._decode`
and are re-exported here; this module owns :class:`ScoreRequest` and how it maps to HTTP.

A scoring request asks for, at the ``R`` response positions of ``tokens`` (``L = P + R``,
``P >= 1``): the sampled token's logprob (always), the top-``top_k`` (optional) and the
logprobs of caller-chosen ``ids[t, :]`` (optional) in one of three id forms:

``per-position``
    ``token_ids_logprob_positions`` with exactly ``L`` rows: rows of absolute positions
    ``< P`` are ``[]``, row ``P + t`` is ``ids[t]`` in request order. Never sent together
    with the flat field. Needs a patched SGLang (spec §4); an unpatched one silently ignores
    the field and the decoder raises ``CapabilityError("per_position")``.
``flat``
    ``token_ids_logprob`` = the sorted unique union ``U`` of all ids, scored at every
    position (answer ``O(R·|U|)``); columns are picked by ``searchsorted``.
``blocked``
    One SGLang *batch* body. Response positions are cut into blocks of ``block_size`` (B);
    block ``b`` covers ``[b·B, min((b+1)·B, R))`` and is one item with
    ``input_ids = tokens[:P + end]``, ``logprob_start_len = P + start - 1`` and
    ``token_ids_logprob`` = the sorted unique union of ``ids[start:end]``. Without top-k
    the item stops one token earlier (``tokens[:P + end - 1]``) and its last row is the
    ``output_token_ids_logprobs`` row SGLang answers anyway for ``max_new_tokens = 0``
    (that row's target token joins the union, for its logprob), so no row is wasted.
    The answer is ``O(R·k·B)``, works on unpatched releases, and the stitched result equals the
    per-position one exactly (causal attention: a row depends only on its prefix). The
    request body carries one prefix per block, i.e. ``O(ceil(R/B)·L)`` token ids.
    ``block_size = 0`` (auto) picks B per sample to minimise the estimated bytes on the
    wire, request and answer together (see :func:`auto_block_size`).

``start`` picks ``logprob_start_len`` for the single-item forms: ``"prompt"`` sends
``P - 1`` (answer has ``R + 1`` entries, the prompt prefix stays cacheable), ``"zero"``
sends 0 (the reference's choice: ``L`` entries, no prefix cache reuse). In the blocked form
every item uses ``P + start - 1`` regardless, since ``"zero"`` would only add rows. Without
``ids`` the id form is irrelevant and a single request is sent.

Every scoring body has ``"return_logprob": true``, ``"return_text_in_logprobs": false``,
``"stream": false`` and ``"sampling_params": {"temperature": 0, "max_new_tokens": 0}``;
``top_logprobs_num`` and ``logprob_start_len`` are top-level. ``topk_wire="b64"`` (with
``top_k > 0``) adds ``return_flat_raw_top_logprobs``, ``return_flat_raw_output_top_logprobs``
and ``return_flat_raw_top_logprobs_b64`` (SGLang >= 0.5.23: the input top-k, and the one
unused output row of ``max_new_tokens = 0``, as b64 arrays); a server that ignores them
answers nested JSON, which decodes fine with ``ScoreRows.used_b64 = False``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from ._decode import (
    Generation,
    ScoreRows,
    Segment,
    decode_generate_response,
    decode_segments,
    parse_student_topk,
)
from ._decode_arrow import decode_segments_arrow
from ._errors import InvalidSampleError
from ._gc import gc_paused
from ._redact import redact, redact_json

__all__ = (
    "Generation",
    "IdForm",
    "Parser",
    "ScoreRequest",
    "ScoreRows",
    "auto_block_size",
    "build_generate_payload",
    "build_block_payloads",
    "build_score_payload",
    "decode_block_answers",
    "decode_generate_response",
    "decode_score_response",
    "parse_error_message",
    "parse_student_topk",
    "payload_size_hint",
    "resolved_block_size",
)

IdForm = Literal["per-position", "flat", "blocked", "blocks"]
Parser = Literal["msgspec", "arrow"]

_ENCODER = msgspec.json.Encoder()
_MAX_ID = 2**31  # SGLang ships ids as int32; anything at or above this cannot be a token id
_MESSAGE_CAP = 500
_PREFIX_CAP = 200
_REDACT_SPAN = _MESSAGE_CAP + (1 << 14)


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
    """

    tokens: npt.NDArray[np.int64]
    response_length: int
    top_k: int = 0
    ids: npt.NDArray[np.int64] | None = None
    id_form: IdForm = "per-position"
    start: Literal["prompt", "zero"] = "prompt"
    topk_wire: Literal["b64", "json"] = "json"
    block_size: int = 0


class _Layout(msgspec.Struct, frozen=True, kw_only=True):
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
    ids = req.ids
    if ids is not None:
        if ids.ndim != 2 or ids.shape[0] != r or ids.shape[1] < 1:
            raise InvalidSampleError("ids", f"shape {list(ids.shape)}, expected [{r}, k >= 1]")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidSampleError("ids", f"dtype {ids.dtype} is not an integer type")
        if int(ids.min()) < 0 or int(ids.max()) >= _MAX_ID:
            raise InvalidSampleError("ids", f"an id is outside [0, {_MAX_ID})")
        s = np.sort(ids, axis=1)
        dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if dup.any():
            raise InvalidSampleError(
                "ids", f"duplicate id in the row of response position {int(np.argmax(dup))}"
            )
    return tokens.astype(np.int64, copy=False), length - r


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
_ENTRY_BYTES = 33  # one ``[lp,id,null]`` answer entry (spec: ~33 B)
_ITEM_BYTES = 450  # one batch item's fixed answer fields (id, finish_reason, counts, ...)


def _json_int_bytes(values: npt.NDArray[np.int64]) -> float:
    """Mean bytes of one non-negative id in a compact JSON list (digits + comma)."""
    if values.size == 0:
        return 0.0
    digits = np.ones(values.shape, dtype=np.int64)
    for power in range(1, 10):
        digits += values >= 10**power
    return float(digits.mean()) + 1.0


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


def _layout(req: ScoreRequest) -> _Layout:
    """Validate ``req`` and derive the items, their layouts and expected ids."""
    tokens, p = _check_request(req)
    length, r, ids = tokens.shape[0], req.response_length, req.ids
    s = p - 1 if req.start == "prompt" else 0
    if ids is None:
        seg = Segment(length=length, start=s, rows=r)
        return _Layout(tokens=tokens, prompt_length=p, batch=False, segments=[seg], unions=[])
    ids = ids.astype(np.int64, copy=False)
    if req.id_form == "per-position":
        seg = Segment(length=length, start=s, rows=r, expect=ids)
        return _Layout(tokens=tokens, prompt_length=p, batch=False, segments=[seg], unions=[])
    if req.id_form == "flat":
        union = _sorted_unique(ids.reshape(-1))
        col = np.searchsorted(union, ids)
        seg = Segment(length=length, start=s, rows=r, expect=union, col=col)
        return _Layout(tokens=tokens, prompt_length=p, batch=False, segments=[seg], unions=[union])
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
    return _Layout(tokens=tokens, prompt_length=p, batch=True, segments=segments, unions=unions)


def build_score_payload(req: ScoreRequest) -> bytes:
    """Encode ``req`` as one ``/generate`` JSON body (blocked: one SGLang batch body).

    Keys appear in a fixed order: ``input_ids, sampling_params, return_logprob,
    logprob_start_len, [top_logprobs_num], [token_ids_logprob |
    token_ids_logprob_positions], [return_flat_raw_top_logprobs,
    return_flat_raw_output_top_logprobs, return_flat_raw_top_logprobs_b64],
    return_text_in_logprobs, stream``. The three flat flags (``topk_wire="b64"`` with
    ``top_k > 0``) ask SGLang >= 0.5.23 for both the input and the output top-k as b64 flat
    arrays; servers that do not know them ignore them and answer nested JSON.

    Raises:
        InvalidSampleError: a malformed request (names the field).
    """
    with gc_paused():
        return _build(req)


def _build(req: ScoreRequest) -> bytes:
    if req.id_form == "blocks" and req.ids is not None:
        raise ValueError("the 'blocks' id form is sent as several bodies: build_block_payloads")
    lay = _layout(req)
    body: dict[str, Any] = {}
    if lay.batch:
        lengths = [seg.length for seg in lay.segments]
        body["input_ids"] = msgspec.Raw(_prefixes_json(lay.tokens, lengths))
        body["sampling_params"] = {"temperature": 0, "max_new_tokens": 0}
        body["return_logprob"] = True
        body["logprob_start_len"] = [seg.start for seg in lay.segments]
    else:
        body["input_ids"] = lay.tokens.tolist()
        body["sampling_params"] = {"temperature": 0, "max_new_tokens": 0}
        body["return_logprob"] = True
        body["logprob_start_len"] = lay.segments[0].start
    if req.top_k > 0:
        body["top_logprobs_num"] = req.top_k
    if req.ids is not None:
        if req.id_form == "per-position":
            body["token_ids_logprob_positions"] = msgspec.Raw(
                _positions_json(np.asarray(req.ids), lay.prompt_length)
            )
        elif lay.batch:
            body["token_ids_logprob"] = [u.tolist() for u in lay.unions]
        else:
            body["token_ids_logprob"] = lay.unions[0].tolist()
    _finish(body, req)
    return _ENCODER.encode(body)


def _finish(body: dict[str, Any], req: ScoreRequest) -> None:
    """The keys every scoring body ends with (b64 flags when asked, text off, no stream)."""
    if req.top_k > 0 and req.topk_wire == "b64":
        # output side too: the one (unused) output top-k row SGLang answers for
        # max_new_tokens = 0 is ~23% smaller in b64 than as nested triples (417 vs 543 B at k=16)
        body["return_flat_raw_top_logprobs"] = True
        body["return_flat_raw_output_top_logprobs"] = True
        body["return_flat_raw_top_logprobs_b64"] = True
    body["return_text_in_logprobs"] = False
    body["stream"] = False


def build_block_payloads(req: ScoreRequest) -> list[bytes]:
    """The ``"blocks"`` id form: one single (non-batch) ``/generate`` body per block.

    The items of the blocked form (see the module docstring: block ``b`` is
    ``input_ids = tokens[:P + end]`` (one token short for id-only requests),
    ``logprob_start_len = P + start - 1``, ``token_ids_logprob`` = the block's id union),
    each sent as an independent request with a single ``logprob_start_len``: what a proxy
    that rejects per-item lists (sglang-router 0.3.2 answers them 422) forwards. Answers stay
    ``O(R k B)`` in all, never the flat union's ``O(R^2 k)``.

    Raises:
        InvalidSampleError: a malformed request (names the field).
    """
    with gc_paused():
        lay = _layout(req)
        prefixes = _prefix_list(lay.tokens, [seg.length for seg in lay.segments])
        out = []
        for seg, union, prefix in zip(lay.segments, lay.unions, prefixes, strict=True):
            body: dict[str, Any] = {
                "input_ids": msgspec.Raw(prefix),
                "sampling_params": {"temperature": 0, "max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": seg.start,
            }
            if req.top_k > 0:
                body["top_logprobs_num"] = req.top_k
            body["token_ids_logprob"] = union.tolist()
            _finish(body, req)
            out.append(_ENCODER.encode(body))
        return out


def decode_block_answers(
    bodies: Sequence[bytes | bytearray], req: ScoreRequest, *, parser: Parser = "msgspec"
) -> ScoreRows:
    """Decode the answers to :func:`build_block_payloads` (in order) and stitch them.

    The answers are checked together as the items of one batch answer (item ``n`` is block
    ``n``: every check of :func:`decode_score_response`, in one vectorised pass); the result
    equals the per-position one exactly.
    """
    lay = _layout(req)
    if len(bodies) != len(lay.segments):
        raise ValueError(f"{len(bodies)} answers for {len(lay.segments)} blocks")
    joined = b"[" + b",".join(bodies) + b"]"
    if parser == "arrow":
        rows = decode_segments_arrow(
            joined, batch=True, segments=lay.segments, tokens=lay.tokens, top_k=req.top_k
        )
        if rows is not None:
            return rows
    return decode_segments(
        joined,
        batch=True,
        segments=lay.segments,
        tokens=lay.tokens,
        top_k=req.top_k,
        per_position=False,
    )


_ROWS_PER_CHUNK = 1024


def _positions_json(ids: npt.NDArray[np.int64], prompt_length: int) -> bytes:
    """``[[],...,[],ids[0],ids[1],...]`` (``prompt_length`` empty rows) as compact JSON.

    Encoded ``_ROWS_PER_CHUNK`` rows at a time: the same bytes as encoding the whole list,
    but no single call holds the GIL for long, so a large payload built in a worker
    thread leaves the event loop its turns (and no list of ``R * k`` ints exists at once).
    """
    parts = [b"[]"] * prompt_length
    for lo in range(0, ids.shape[0], _ROWS_PER_CHUNK):
        chunk = _ENCODER.encode(ids[lo : lo + _ROWS_PER_CHUNK].tolist())
        parts.append(chunk[1:-1])
    return b"[" + b",".join(parts) + b"]"


def payload_size_hint(req: ScoreRequest) -> int:
    """A cheap upper estimate of ``len(build_score_payload(req))`` (7 bytes per id sent)."""
    ids = 0 if req.ids is None else int(req.ids.size)
    tokens = int(req.tokens.size)
    if req.id_form in ("blocked", "blocks") and req.ids is not None:
        tokens *= -(-req.response_length // max(req.block_size, 1))  # a prefix per block
    return 7 * (tokens + ids)


def _prefix_list(tokens: npt.NDArray[np.int64], lengths: list[int]) -> list[bytes]:
    """``[t0,...,t(n-1)]`` as compact JSON for each ``n`` in ``lengths`` (one encoding,
    sliced; see :func:`_prefixes_json`)."""
    whole = _ENCODER.encode(tokens.tolist())
    end = _element_ends(tokens)
    return [whole[: int(end[n])] + b"]" if n else b"[]" for n in lengths]


def _element_ends(tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``end[n]`` (``n >= 1``): the offset just past element ``n - 1`` of ``tokens``'
    compact JSON encoding, before its comma."""
    digits = np.ones(tokens.shape[0], dtype=np.int64)
    for power in range(1, 19):
        digits += tokens >= 10**power
    out: npt.NDArray[np.int64] = np.concatenate(([1], 1 + np.cumsum(digits + 1))) - 1
    return out


def _prefixes_json(tokens: npt.NDArray[np.int64], lengths: list[int]) -> bytes:
    """``[[t0..t(n0-1)],[t0..t(n1-1)],...]`` as compact JSON, by slicing one encoding.

    The blocked form re-sends the prefix once per block (``O(R/B * L)`` ids); encoding the
    sequence once and copying byte ranges of it costs a memcpy per block instead of
    building and encoding ``O(R/B * L)`` Python ints. Byte-identical to
    ``msgspec.json.encode([tokens[:n].tolist() for n in lengths])`` for non-negative ids.
    """
    whole = _ENCODER.encode(tokens.tolist())  # b"[t0,t1,...]"
    end = _element_ends(tokens)
    # one copy of each prefix, straight into the result (memoryview slices copy nothing)
    view = memoryview(whole)
    parts: list[bytes | memoryview] = [b"["]
    for i, n in enumerate(lengths):
        if i:
            parts.append(b",")
        parts += (view[: int(end[n])], b"]") if n else (b"[]",)
    parts.append(b"]")
    return b"".join(parts)


def decode_score_response(
    body: bytes | bytearray, req: ScoreRequest, *, parser: Parser = "msgspec"
) -> ScoreRows:
    """Decode and validate the HTTP 200 answer to ``build_score_payload(req)``.

    ``parser`` picks how the JSON is read; both give the same arrays and the same errors.
    ``"msgspec"`` (cheapest in CPU) holds the GIL for the whole decode (~8 ns per byte).
    ``"arrow"`` parses with pyarrow's JSON reader, which releases the GIL (~1.9x msgspec's
    CPU): for large answers decoded in threads beside the event loop. An answer it does
    not accept is decoded again with msgspec, which raises the precise error (see
    :mod:`opd_stream._decode_arrow`).

    Checks, per item (messages name the field as a ``$.meta_info.…`` path and the absolute
    / response position, never payload values): ``finish_reason.type != "abort"``; every
    requested field present; ``input_token_logprobs`` has ``L - s`` entries and echoes
    ``tokens[s+1:]``; top-k rows in the response range are non-null with ``top_k`` entries
    (or the b64 fields are consistent); requested-id rows return exactly the requested ids
    in order (per-position: ``ids[t]``; flat / blocked: the sorted union); a batch answer has
    one item per block. Stitched blocked results equal per-position ones exactly.

    Raises:
        MalformedResponseError: not JSON, truncated, wrong types, missing field, bad b64.
        MisalignedResponseError: counts, echoed token ids or requested ids differ.
        ServerAbortError: ``finish_reason.type == "abort"`` (with the server's message).
        CapabilityError: ``"per_position"`` when a per-position request is answered
            without ``input_token_ids_logprobs`` (the server ignored the field).
        InvalidSampleError: ``req`` itself is malformed.
    """
    lay = _layout(req)
    if parser == "arrow":
        rows = decode_segments_arrow(
            body, batch=lay.batch, segments=lay.segments, tokens=lay.tokens, top_k=req.top_k
        )
        if rows is not None:
            return rows
    return decode_segments(
        body,
        batch=lay.batch,
        segments=lay.segments,
        tokens=lay.tokens,
        top_k=req.top_k,
        per_position=req.ids is not None and req.id_form == "per-position",
    )


def parse_error_message(body: bytes | bytearray, *, secret: str | None = None) -> str:
    """Extract the server's message from an SGLang error body; never raises.

    Tries, in order: ``body["error"]["message"]``, ``body["error"]`` (a string),
    ``body["message"]``, ``body["detail"]`` (a string, or other JSON re-encoded). Otherwise
    returns a printable prefix of the body (at most 200 characters, non-printables escaped)
    or ``"<empty body>"``. Messages are capped at 500 characters.

    Secrets are masked first, before any cut or re-encoding (:func:`opd_stream._redact.redact`):
    the token of every ``Bearer <token>`` the server echoed, and ``secret`` (the API key)
    when given.
    """
    try:
        return _parse_error_message(body, secret)
    except Exception:  # pragma: no cover - defensive: this function must never raise
        return "<unreadable body>"


def _parse_error_message(body: bytes | bytearray, secret: str | None = None) -> str:
    # Redaction sees a span longer than the cap by more than any header can be (aiohttp
    # refuses header lines over 8 KiB), so a key that starts before the cut is masked whole.
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, TypeError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        candidates: list[Any] = [
            err.get("message") if isinstance(err, dict) else None,
            err,
            obj.get("message"),
        ]
        for value in candidates:
            if isinstance(value, str) and value:
                return _cap(redact(value[:_REDACT_SPAN], secret), _MESSAGE_CAP)
        detail = obj.get("detail")
        if isinstance(detail, str) and detail:
            return _cap(redact(detail[:_REDACT_SPAN], secret), _MESSAGE_CAP)
        if detail is not None:
            text = _ENCODER.encode(redact_json(detail, secret)).decode("utf-8", "replace")
            return _cap(redact(text[:_REDACT_SPAN], secret), _MESSAGE_CAP)
    text = bytes(body[:_REDACT_SPAN]).decode("utf-8", "backslashreplace").strip()
    if not text:
        return "<empty body>"
    return _cap(redact(text, secret), _PREFIX_CAP)


def _cap(text: str, limit: int) -> str:
    """At most ``limit`` characters of ``text`` (redacted beforehand), non-printables escaped."""
    cut = text[:limit]
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return out + ("…" if len(text) > limit else "")


def build_generate_payload(
    prompts: list[list[int]] | list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_logprobs_num: int = 0,
    seed: int | None = None,
    *,
    topk_wire: Literal["b64", "json"] = "json",
) -> bytes:
    """Encode a sampling (rollout) ``/generate`` request, single or batch.

    ``sampling_params`` holds ``temperature``, ``max_new_tokens`` and (if given)
    ``sampling_seed``; ``return_logprob`` is true so that the answer carries
    ``output_token_logprobs`` (and the output top-k when ``top_logprobs_num > 0``).
    No ``logprob_start_len`` is sent (SGLang's -1: no input logprobs).

    ``topk_wire="b64"`` (with ``top_logprobs_num > 0``) also sends
    ``return_flat_raw_output_top_logprobs`` and ``return_flat_raw_top_logprobs_b64``
    (after ``top_logprobs_num``): SGLang >= 0.5.23 then answers the output top-k as b64
    float32 / int32 flat arrays instead of nested triples (about 3x smaller). Servers that do
    not know the flags ignore them and answer nested rows; :func:`decode_generate_response`
    accepts both. The default stays ``"json"``, which every server version answers alike.

    Raises:
        ValueError: empty prompts, a non-int id, ``max_new_tokens < 1``,
            ``top_logprobs_num < 0``, an unknown ``topk_wire``.
    """
    if topk_wire not in ("b64", "json"):
        raise ValueError(f"topk_wire must be 'b64' or 'json', got {topk_wire!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
    if not prompts:
        raise ValueError("prompts is empty")
    seqs = [prompts] if not isinstance(prompts[0], list) else prompts
    for n, seq in enumerate(seqs):
        if not isinstance(seq, list) or not seq:
            raise ValueError(f"prompt {n} is not a non-empty list of token ids")
        if not all(type(t) is int and t >= 0 for t in seq):
            raise ValueError(f"prompt {n} holds an id that is not a non-negative int")
    sampling: dict[str, Any] = {"temperature": temperature, "max_new_tokens": max_new_tokens}
    if seed is not None:
        sampling["sampling_seed"] = seed
    body: dict[str, Any] = {
        "input_ids": prompts,
        "sampling_params": sampling,
        "return_logprob": True,
    }
    if top_logprobs_num > 0:
        body["top_logprobs_num"] = top_logprobs_num
        if topk_wire == "b64":
            body["return_flat_raw_output_top_logprobs"] = True
            body["return_flat_raw_top_logprobs_b64"] = True
    body["return_text_in_logprobs"] = False
    body["stream"] = False
    return _ENCODER.encode(body)
