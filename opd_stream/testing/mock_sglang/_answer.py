"""Sans-IO SGLang ``/generate`` answers of the mock: one answer object per request item.

Semantics follow ``docs/protocol.md`` (SGLang 0.5.23 plus the per-position patch #38119);
the request was parsed by :mod:`._request`. Every ``input_*`` list has ``L - s`` entries
(entry ``j`` about position ``s + j``, entry 0 always empty); empty rows and ``-inf`` are
``null``; values are float64 logprobs rounded to float32. The ``return_flat_raw_*`` flags
replace the nested top logprobs by ``{side}_top_logprobs_val_flat``, ``_idx_flat``,
``_shape`` and ``_null_prefix``, as base64 little-endian float32 / int32 with ``_b64``
(``tokenizer_manager._build_flat_top_logprobs_fields``).
"""

from __future__ import annotations

import base64
from itertools import repeat
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ._bytemodel import ByteModel
from ._model import HeadRows, MockModel
from ._request import GenerateItem

__all__ = (
    "ItemFault",
    "abort_response",
    "build_item_response",
    "token_text",
)

ItemFault = Literal["misaligned", "missing_rows"] | None


def token_text(token_id: int) -> str:
    """The mock's detokenisation of one id (``return_text_in_logprobs`` and ``text``)."""
    return f"<{token_id}>"


def _take(rows: HeadRows, sel: npt.NDArray[np.int64] | slice) -> HeadRows:
    return HeadRows(
        rows.ids[sel],
        rows.logits[sel],
        rows.logz[sel],
        rows.tail_lp[sel],
        rows.a[sel],
        rows.b_index[sel],
    )


def _triples(
    lp: npt.NDArray[np.float64], ids: npt.NDArray[np.int64], with_text: bool
) -> list[tuple[float | None, int, str | None]]:
    lps: list[Any] = lp.astype(np.float32).reshape(-1).tolist()
    idl: list[int] = ids.reshape(-1).tolist()
    if with_text:
        return list(zip(lps, idl, map(token_text, idl), strict=True))
    return list(zip(lps, idl, repeat(None)))


def _nested_rows(
    lp: npt.NDArray[np.float64], ids: npt.NDArray[np.int64], with_text: bool
) -> list[Any]:
    n, k = lp.shape
    flat = _triples(lp, ids, with_text)
    if k == 0:
        return [None] * n  # empty rows are null
    return [flat[i * k : (i + 1) * k] for i in range(n)]


def _flat_fields(
    side: str,
    lp: npt.NDArray[np.float64],
    ids: npt.NDArray[np.int64],
    null_prefix: int,
    b64: bool,
) -> dict[str, Any]:
    val = lp.astype(np.float32)
    out: dict[str, Any] = {}
    if b64:
        out[f"{side}_top_logprobs_val_flat_b64"] = base64.b64encode(
            val.astype("<f4").tobytes()
        ).decode("ascii")
        out[f"{side}_top_logprobs_idx_flat_b64"] = base64.b64encode(
            ids.astype("<i4").tobytes()
        ).decode("ascii")
        out[f"{side}_top_logprobs_val_flat_b64_dtype"] = "float32"
        out[f"{side}_top_logprobs_idx_flat_b64_dtype"] = "int32"
    else:
        out[f"{side}_top_logprobs_val_flat"] = val.reshape(-1).tolist()
        out[f"{side}_top_logprobs_idx_flat"] = ids.reshape(-1).tolist()
    out[f"{side}_top_logprobs_shape"] = [int(lp.shape[0]), int(lp.shape[1])]
    out[f"{side}_top_logprobs_null_prefix"] = null_prefix
    return out


def build_item_response(
    model: MockModel,
    item: GenerateItem,
    *,
    rng: np.random.Generator,
    weight_version: str,
    flat_input: bool = False,
    flat_output: bool = False,
    b64: bool = False,
    fault: ItemFault = None,
    e2e_latency: float = 0.0,
    sent_ts: float = 0.0,
    shift: float = 0.0,
    byte_model: ByteModel | None = None,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """The JSON-ready answer object for one item (``{"text", "output_ids", "meta_info"}``).

    ``fault`` applies a wire fault at the data level: ``"misaligned"`` shifts the token ids
    of ``input_token_logprobs`` by one row; ``"missing_rows"`` drops the last row of every
    ``input_*`` list. ``shift`` is added to every logprob the answer carries (a replica off
    by a set amount; 0: the model's values). ``byte_model``: the sampled tokens' logprobs
    come from it (top-k and requested ids still come from ``model``).
    """
    tok = item.input_ids
    length = int(tok.size)
    s = item.logprob_start_len
    if item.max_new_tokens > 0:
        gen = model.sample(
            tok,
            item.max_new_tokens,
            rng,
            temperature=item.temperature,
            stop_token_ids=item.stop_token_ids,
        )
    else:
        gen = np.zeros(0, dtype=np.int64)
    n_gen = int(gen.size)
    full = np.concatenate([tok, gen]) if n_gen else tok
    finish: dict[str, Any]
    if (n_gen and n_gen < item.max_new_tokens) or (n_gen and int(gen[-1]) in item.stop_token_ids):
        finish = {"type": "stop", "matched": int(gen[-1])}
    else:
        finish = {"type": "length", "length": n_gen}
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": finish,
        "prompt_tokens": length,
        "weight_version": weight_version,
        "num_retractions": 0,
    }
    if item.return_logprob:
        meta.update(
            _logprob_fields(
                model,
                item,
                full,
                s,
                n_gen,
                flat_input,
                flat_output,
                b64,
                fault,
                shift,
                byte_model,
            )
        )
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = n_gen
    meta["cached_tokens"] = cached_tokens
    meta["e2e_latency"] = e2e_latency
    meta["response_sent_to_client_ts"] = sent_ts
    gen_list: list[int] = gen.tolist()
    out: dict[str, Any] = {
        "text": "".join(map(token_text, gen_list)),
        "output_ids": gen_list,
        "meta_info": meta,
    }
    if item.return_prompt_token_ids:
        out["prompt_token_ids"] = tok.tolist()
    return out


def _logprob_fields(
    model: MockModel,
    item: GenerateItem,
    full: npt.NDArray[np.int64],
    s: int,
    n_gen: int,
    flat_input: bool,
    flat_output: bool,
    b64: bool,
    fault: ItemFault,
    shift: float = 0.0,
    byte_model: ByteModel | None = None,
) -> dict[str, Any]:
    length = int(item.input_ids.size)
    n_in = length - s  # entries of every input_* list
    n_in_rows = max(n_in - 1, 0)  # entries 1.. (positions s+1 .. L-1)
    n_out_rows = max(n_gen, 1)
    positions = np.arange(min(s + 1, length), length + n_out_rows, dtype=np.int64)
    rows = model.head_rows(full, positions)
    in_sel = slice(0, n_in_rows)
    out_sel = slice(n_in_rows, n_in_rows + n_out_rows)
    with_text = item.return_text
    fields: dict[str, Any] = {}

    # Token logprobs of input entries 1.. and of generated tokens.
    tok_pos = positions[: n_in_rows + n_gen]
    tok_ids = full[tok_pos]
    tok_rows = _take(rows, slice(0, n_in_rows + n_gen))
    tok_lp = model.logprobs_in(tok_rows, tok_ids[:, None])[:, 0] + shift
    if byte_model is not None:
        tok_lp = byte_model.token_logprobs(full, tok_pos) + shift
    in_ids = tok_ids[:n_in_rows]
    if fault == "misaligned" and n_in_rows:
        in_ids = np.roll(in_ids, 1)
    input_tok: list[Any] = []
    if n_in:
        first = int(full[s])
        input_tok = [(None, first, token_text(first) if with_text else None)]
        input_tok += _triples(tok_lp[:n_in_rows], in_ids, with_text)
    if fault == "misaligned" and n_in == 1:
        input_tok = [(None, int(full[s]) + 1, None)]
    drop = 1 if fault == "missing_rows" and n_in else 0
    fields["input_token_logprobs"] = input_tok[: len(input_tok) - drop]
    fields["output_token_logprobs"] = _triples(tok_lp[n_in_rows:], tok_ids[n_in_rows:], with_text)
    fields["output_token_logprobs_length"] = n_gen

    k = item.top_logprobs_num
    if k > 0:
        top_ids, top_lp = model.topk_in(rows, k)
        top_lp = top_lp + shift
        in_top_lp, in_top_ids = top_lp[in_sel], top_ids[in_sel]
        if drop:
            in_top_lp, in_top_ids = (
                in_top_lp[: max(n_in_rows - 1, 0)],
                in_top_ids[: max(n_in_rows - 1, 0)],
            )
        null_prefix = 1 if n_in - drop >= 1 else 0
        if flat_input:
            fields.update(_flat_fields("input", in_top_lp, in_top_ids, null_prefix, b64))
        else:
            nested = _nested_rows(in_top_lp, in_top_ids, with_text)
            fields["input_top_logprobs"] = ([None] * null_prefix) + nested
        out_top_lp, out_top_ids = top_lp[out_sel], top_ids[out_sel]
        if flat_output:
            fields.update(_flat_fields("output", out_top_lp, out_top_ids, 0, b64))
        else:
            fields["output_top_logprobs"] = _nested_rows(out_top_lp, out_top_ids, with_text)

    if item.token_ids_logprob is not None:
        req = np.asarray(item.token_ids_logprob, dtype=np.int64)
        mat = np.broadcast_to(req, (positions.size, req.size))
        lp = model.logprobs_in(rows, mat) + shift
        in_rows = _nested_rows(lp[in_sel], mat[in_sel], with_text)
        if drop:
            in_rows = in_rows[:-1] if in_rows else in_rows
        fields["input_token_ids_logprobs"] = ([None] if n_in - drop >= 1 else []) + in_rows
        fields["output_token_ids_logprobs"] = _nested_rows(lp[out_sel], mat[out_sel], with_text)
    elif item.positions_ids is not None:
        fields["input_token_ids_logprobs"] = _per_position_rows(
            model, rows, positions[in_sel], item.positions_ids, n_in, with_text, drop, shift
        )
        fields["output_token_ids_logprobs"] = [None]
    return fields


def _per_position_rows(
    model: MockModel,
    rows: HeadRows,
    in_positions: npt.NDArray[np.int64],
    positions_ids: list[list[int]],
    n_in: int,
    with_text: bool,
    drop: int,
    shift: float = 0.0,
) -> list[Any]:
    if n_in == 0:
        return []
    n = int(in_positions.size)
    lists = [positions_ids[int(p)] for p in in_positions]
    widths = np.fromiter((len(r) for r in lists), dtype=np.int64, count=n)
    out: list[Any] = [None] * n
    if n and int(widths.max(initial=0)) > 0:
        w = int(widths.max())
        mat = np.zeros((n, w), dtype=np.int64)
        for i, r in enumerate(lists):
            if r:
                mat[i, : len(r)] = r
        lp = model.logprobs_in(_take(rows, slice(0, n)), mat) + shift
        lpl = lp.astype(np.float32).tolist()
        for i, r in enumerate(lists):
            if r:
                vals = lpl[i][: len(r)]
                texts = [token_text(t) for t in r] if with_text else repeat(None)
                out[i] = list(zip(vals, r, texts, strict=False))
    res: list[Any] = [None, *out]
    return res[: len(res) - drop]


def abort_response(item: GenerateItem, weight_version: str, message: str) -> dict[str, Any]:
    """An HTTP-200 abort answer (``finish_reason.type == "abort"``, ``status_code`` null)."""
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": item.rid,
            "finish_reason": {
                "type": "abort",
                "message": message,
                "status_code": None,
                "err_type": None,
            },
            "prompt_tokens": int(item.input_ids.size),
            "weight_version": weight_version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "e2e_latency": 0.0,
        },
    }
