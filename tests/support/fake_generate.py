"""A tiny deterministic fake SGLang ``/generate`` scorer for wire tests.

Written from ``docs/protocol.md``, "Request fields" to "Per-position id scoring",
independently of ``opd_stream.wire._request``: it parses a request body with the stdlib
``json`` module and builds the answer with plain Python loops.

The "model" is a deterministic function of (context, position, token):
``fake_logprob(context, token)`` hashes the whole context (so a row depends only on its
prefix, as with causal attention), computes a float64 value and rounds it to float32, the
way SGLang's fp32 logprobs reach JSON. About 1 value in 11 is ``-inf`` (sent as ``null``).
Top-k is the best ``k`` of the vocabulary ``range(VOCAB)`` by (logprob desc, id asc).
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Sequence
from typing import Any

VOCAB = 40
_MASK = 2**64 - 1
SAMPLING_KEYS = frozenset(
    [
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "beam_width",
        "watermark",
        "choice",
    ]
)


class FakeRequestError(AssertionError):
    """The request would be rejected by SGLang (HTTP 400)."""


def _mix(h: int, x: int) -> int:
    h ^= x + 0x9E3779B97F4A7C15 + ((h << 6) & _MASK) + (h >> 2)
    h = (h * 0xFF51AFD7ED558CCD) & _MASK
    return h ^ (h >> 33)


def context_hash(context: Sequence[int]) -> int:
    h = 1469598103934665603
    for tok in context:
        h = _mix(h, tok)
    return _mix(h, len(context))


def _f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def _lp_from_hash(h: int, token: int) -> float:
    x = _mix(h, token + 1)
    if x % 11 == 0:
        return -math.inf
    return _f32(-12.0 * ((x >> 11) / 2.0**53) - 1e-3 * (x % 7))


def fake_logprob(context: Sequence[int], token: int) -> float:
    """log p(token | context) of the fake model (float32-exact; may be -inf)."""
    return _lp_from_hash(context_hash(context), token)


def fake_topk(context: Sequence[int], k: int) -> list[tuple[float, int]]:
    """The fake model's top-k ``(logprob, id)`` after ``context``, best first."""
    h = context_hash(context)
    scored = [(_lp_from_hash(h, v), v) for v in range(VOCAB)]
    scored.sort(key=lambda e: (-e[0], e[1]))
    return scored[:k]


def _json_lp(x: float) -> float | None:
    return None if x == -math.inf else x


def _triple(lp: float, tok: int) -> list[Any]:
    return [_json_lp(lp), tok, None]


def _answer_item(
    input_ids: list[int],
    *,
    start: int,
    top_k: int,
    flat_ids: list[int] | None,
    positions: list[list[int]] | None,
    flat_raw: bool,
    b64: bool,
) -> dict[str, Any]:
    length = len(input_ids)
    if not input_ids:
        raise FakeRequestError("input_ids cannot be empty.")
    s = length if start == -1 else start
    if not 0 <= s < length:
        raise FakeRequestError(f"logprob_start_len={s} outside [0, {length})")
    targets = range(s + 1, length)  # entry j >= 1 <-> absolute target position s + j
    hashes = {i: context_hash(input_ids[:i]) for i in [*targets, length]}

    def row(i: int, ids: list[int]) -> list[list[Any]]:
        return [_triple(_lp_from_hash(hashes[i], t), t) for t in ids]

    meta: dict[str, Any] = {
        "id": "fake",
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": length,
        "weight_version": "fake-v1",
        "num_retractions": 0,
        "input_token_logprobs": [[None, input_ids[s], None]]
        + [_triple(_lp_from_hash(hashes[i], input_ids[i]), input_ids[i]) for i in targets],
        "output_token_logprobs": [],
        "output_token_logprobs_length": 0,
    }
    if top_k > 0:
        top_rows = [fake_topk(input_ids[:i], top_k) for i in targets]
        if flat_raw and b64:
            vals = [lp for r in top_rows for lp, _ in r]
            idxs = [t for r in top_rows for _, t in r]
            meta["input_top_logprobs_shape"] = [len(top_rows), top_k]
            meta["input_top_logprobs_null_prefix"] = 1
            meta["input_top_logprobs_val_flat_b64"] = base64.b64encode(
                struct.pack(f"<{len(vals)}f", *vals)
            ).decode("ascii")
            meta["input_top_logprobs_idx_flat_b64"] = base64.b64encode(
                struct.pack(f"<{len(idxs)}i", *idxs)
            ).decode("ascii")
            meta["input_top_logprobs_val_flat_b64_dtype"] = "float32"
            meta["input_top_logprobs_idx_flat_b64_dtype"] = "int32"
        else:
            meta["input_top_logprobs"] = [None] + [
                [_triple(lp, t) for lp, t in r] for r in top_rows
            ]
        meta["output_top_logprobs"] = [[_triple(lp, t) for lp, t in fake_topk(input_ids, top_k)]]
    if flat_ids:
        meta["input_token_ids_logprobs"] = [None] + [row(i, flat_ids) for i in targets]
        meta["output_token_ids_logprobs"] = [row(length, flat_ids)]
    elif positions is not None:
        meta["input_token_ids_logprobs"] = [None] + [
            (row(i, positions[i]) or None) for i in targets
        ]
    meta.update(completion_tokens=0, cached_tokens=0, e2e_latency=0.001)
    return {"text": "", "output_ids": [], "meta_info": meta}


def _per_item(value: Any, n: int, is_batch: bool, *, nested: bool = False) -> list[Any]:
    """Broadcast a scalar (or, for ``nested``, a flat list) or take a per-item list."""
    if not is_batch:
        return [value]
    if isinstance(value, list) and (not nested or (value and isinstance(value[0], list))):
        if len(value) != n:
            raise FakeRequestError(f"per-item list of length {len(value)} for {n} items")
        return value
    return [value] * n


def answer(
    body: bytes, *, per_position: bool = True, b64: bool = True
) -> dict[str, Any] | list[dict[str, Any]]:
    """Answer a scoring request body as JSON-ready objects (mutate them to fake faults).

    Args:
        body: a ``/generate`` request body with ``max_new_tokens == 0``.
        per_position: act as a per-position-patched server; else ignore the field.
        b64: honour ``return_flat_raw_top_logprobs(_b64)``; else answer nested JSON.
    """
    req = json.loads(body)
    ids = req["input_ids"]
    is_batch = not isinstance(ids[0], int)
    seqs: list[list[int]] = ids if is_batch else [ids]
    n = len(seqs)
    for sp in _per_item(req.get("sampling_params", {}), n, is_batch):
        unknown = set(sp) - SAMPLING_KEYS
        if unknown:
            raise FakeRequestError(f"unknown field `{sorted(unknown)[0]}` in sampling_params")
        if sp.get("max_new_tokens") != 0:
            raise FakeRequestError("this fake only scores (max_new_tokens must be 0)")
    if "top_logprobs_num" in req.get("sampling_params", {}):
        raise FakeRequestError("top_logprobs_num belongs at the top level")
    if req.get("return_logprob") is not True or req.get("stream", False):
        raise FakeRequestError("scoring needs return_logprob=true and stream=false")
    starts = _per_item(req.get("logprob_start_len", -1), n, is_batch)
    tops = _per_item(req.get("top_logprobs_num", 0), n, is_batch)
    flat = req.get("token_ids_logprob") or None
    flats = _per_item(flat, n, is_batch, nested=True)
    positions = req.get("token_ids_logprob_positions") if per_position else None
    if positions is not None:
        if is_batch:
            raise FakeRequestError("Per-position scoring accepts one input sequence per request")
        if flat is not None:
            raise FakeRequestError("token_ids_logprob_positions excludes token_ids_logprob")
        if len(positions) != len(seqs[0]) or starts[0] == -1:
            raise FakeRequestError("token_ids_logprob_positions needs one row per input token")
        for r in positions:
            if len(set(r)) != len(r) or any(type(t) is not int or t < 0 for t in r):
                raise FakeRequestError("bad token_ids_logprob_positions row")
    flat_raw = b64 and bool(req.get("return_flat_raw_top_logprobs"))
    want_b64 = b64 and bool(req.get("return_flat_raw_top_logprobs_b64"))
    items = [
        _answer_item(
            seqs[i],
            start=starts[i],
            top_k=tops[i],
            flat_ids=flats[i],
            positions=positions,
            flat_raw=flat_raw,
            b64=want_b64,
        )
        for i in range(n)
    ]
    return items if is_batch else items[0]


def respond(body: bytes, *, per_position: bool = True, b64: bool = True) -> bytes:
    """:func:`answer` encoded as SGLang does (compact JSON, no NaN/Infinity literals)."""
    return encode(answer(body, per_position=per_position, b64=b64))


def encode(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
