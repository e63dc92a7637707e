"""Sans-IO SGLang ``/generate`` protocol of the mock: request parsing/validation and answers.

Independent of ``opd_stream``'s client code. Semantics follow
``/work/shared/spec/sglang-protocol.md`` (SGLang 0.5.23 plus the per-position patch #38119):

* validation happens in SGLang's three layers, each with its error shape (:class:`RequestError`);
* ``logprob_start_len`` ``s`` defaults to -1, mapped to ``L`` (to ``L-1`` when
  ``token_ids_logprob`` is set and the request generates);
* every ``input_*`` list has ``L - s`` entries, entry ``j`` about absolute position ``s + j``,
  entry 0 always empty (``[null, ids[s], null]`` / ``null``); empty rows and ``-inf`` are ``null``;
* values are float64 model logprobs rounded to float32, emitted as Python floats;
* ``return_flat_raw_top_logprobs`` / ``return_flat_raw_output_top_logprobs`` replace the nested
  ``input_top_logprobs`` / ``output_top_logprobs`` by ``{side}_top_logprobs_val_flat``,
  ``_idx_flat``, ``_shape`` (``[rows, k]``) and ``_null_prefix`` (leading null rows, not in the
  arrays); ``return_flat_raw_top_logprobs_b64`` sends the arrays as base64 little-endian
  float32 / int32 (``..._flat_b64`` plus ``..._flat_b64_dtype`` markers) (SGLang 0.5.23
  ``tokenizer_manager._build_flat_top_logprobs_fields``);
* with ``stream: true``, SGLang's ValueErrors (tokenizer-manager checks, ``"value"`` kind) are
  answered in the event stream (HTTP 200, ``data: {"error": {...}}`` then ``data: [DONE]``),
  as 0.5.23's ``/generate`` does; only the body and contract checks answer HTTP 400.
"""

from __future__ import annotations

import base64
import uuid
from itertools import repeat
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from ._contract import ContractError, check_generate_contract
from ._model import HeadRows, MockModel

__all__ = (
    "GenerateItem",
    "abort_response",
    "GenerateRequestSpec",
    "ItemFault",
    "RequestError",
    "build_item_response",
    "error_response_body",
    "parse_generate_request",
    "token_text",
)

ItemFault = Literal["misaligned", "missing_rows"] | None

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def error_response_body(message: str, status: int, type_: str | None = None) -> bytes:
    """SGLang's ``ErrorResponse`` shape (HTTPException / validation handlers)."""
    return _encoder.encode(
        {
            "object": "error",
            "message": message,
            "type": type_ if type_ is not None else str(status),
            "param": None,
            "code": status,
        }
    )


class RequestError(Exception):
    """A ``/generate`` request was rejected; ``status`` and ``body`` are the HTTP answer.

    ``kind`` is ``"validation"`` (ErrorResponse shape), ``"contract"`` (``{"error": str}``),
    ``"value"`` (``{"error": {"message": str}}``) or ``"crash"`` (500, ErrorResponse shape).
    ``in_stream`` (``"value"`` errors of a ``stream: true`` request) makes the answer an HTTP
    200 event stream carrying the error, as SGLang's streaming ``/generate`` does.
    """

    def __init__(self, kind: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.error_status = status
        self.in_stream = False

    @property
    def status(self) -> int:
        """The HTTP status of the answer (200 for an in-stream error)."""
        return 200 if self.in_stream else self.error_status

    @property
    def content_type(self) -> str:
        """The answer's content type."""
        return "text/event-stream" if self.in_stream else "application/json"

    @property
    def body(self) -> bytes:
        if self.in_stream:
            err = {
                "message": self.message,
                "type": "invalid_request_error",
                "code": self.error_status,
                "retryable": False,
            }
            return b"data: " + _encoder.encode({"error": err}) + b"\n\ndata: [DONE]\n\n"
        if self.kind == "contract":
            return _encoder.encode({"error": self.message})
        if self.kind == "value":
            return _encoder.encode({"error": {"message": self.message}})
        type_ = "Bad Request" if self.kind == "validation" else None
        return error_response_body(self.message, self.status, type_)


class GenerateItem(msgspec.Struct, kw_only=True):
    """One normalised request item (one sequence)."""

    input_ids: npt.NDArray[np.int64]
    rid: str
    return_logprob: bool
    logprob_start_len: int  # resolved, in [0, L]
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    positions_ids: list[list[int]] | None  # per-position (patched), len == L
    return_text: bool
    max_new_tokens: int
    temperature: float
    stop_token_ids: tuple[int, ...]
    sampling_seed: int | None
    return_prompt_token_ids: bool


class GenerateRequestSpec(msgspec.Struct, kw_only=True):
    """A parsed ``/generate`` body."""

    items: list[GenerateItem]
    is_batch: bool
    stream: bool
    flat_input: bool
    flat_output: bool
    b64: bool


def token_text(token_id: int) -> str:
    """The mock's detokenisation of one id (``return_text_in_logprobs`` and ``text``)."""
    return f"<{token_id}>"


def _validation(loc: str, msg: str, kind: str) -> RequestError:
    detail = f"[{{'type': '{kind}', 'loc': ('body', {loc}), 'msg': '{msg}'}}]"
    return RequestError("validation", f"1 validation error for GenerateReqInput {detail}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: ``GenerateReqInput`` fields typed ``bool`` (not Optional) that the contract check skips.
_FLAT_FLAGS = (
    "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64",
)
_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_STRINGS = frozenset({"0", "off", "f", "false", "n", "no"})


def _lax_bool(body: dict[str, Any], key: str) -> bool:
    """Pydantic's lax ``bool`` of a non-Optional field (absent: False).

    Accepts booleans, the integers / floats 0 and 1, and the strings pydantic accepts
    (case-insensitive); other ints and strings are ``bool_parsing`` errors, ``null`` and
    everything else ``bool_type`` errors (pydantic 2's messages).
    """
    if key not in body:
        return False
    v = body[key]
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in _TRUE_STRINGS | _FALSE_STRINGS:
        return v.lower() in _TRUE_STRINGS
    if isinstance(v, int | str):
        raise _validation(
            f"'{key}'", "Input should be a valid boolean, unable to interpret input", "bool_parsing"
        )
    raise _validation(f"'{key}'", "Input should be a valid boolean", "bool_type")


def _check_pydantic(body: Any) -> None:
    """The FastAPI/pydantic layer: the body must be an object, ids must be ints, the flat
    top-k flags must be (lax) booleans."""
    if not isinstance(body, dict):
        raise RequestError(
            "validation", "1 validation error: Input should be a valid dictionary or object"
        )
    for flag in _FLAT_FLAGS:
        _lax_bool(body, flag)
    for field in ("input_ids", "token_ids_logprob"):
        v = body.get(field)
        if v is None:
            continue
        if not isinstance(v, list):
            raise _validation(f"'{field}'", "Input should be a valid list", "list_type")
        nested = bool(v) and isinstance(v[0], list)
        rows = v if nested else [v]
        for i, row in enumerate(rows):
            if not isinstance(row, list):
                raise _validation(f"'{field}', {i}", "Input should be a valid list", "list_type")
            for e in row:
                if not _is_int(e):
                    raise _validation(f"'{field}'", "Input should be a valid integer", "int_type")


def _per_item(body: dict[str, Any], key: str, default: Any, n: int, is_batch: bool) -> list[Any]:
    v = body.get(key)
    if v is None:
        return [default] * n
    if isinstance(v, list):
        if not is_batch:
            if len(v) != 1:
                raise RequestError("value", f"{key} must be a scalar for a single request.")
            return [v[0]]
        if len(v) != n:
            raise RequestError(
                "value", f"The length of {key} ({len(v)}) does not match the batch size ({n})."
            )
        return list(v)
    return [v] * n


def parse_generate_request(
    raw: bytes,
    *,
    vocab_size: int,
    context_length: int,
    per_position: Literal["patched", "unpatched"],
) -> GenerateRequestSpec:
    """Parse and validate a ``/generate`` body exactly as far as the mock models SGLang.

    Raises:
        RequestError: carrying the status and error body SGLang would answer.
    """
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise RequestError("validation", f"JSON decode error: {exc}") from None
    _check_pydantic(body)
    try:
        check_generate_contract(body)
    except ContractError as exc:
        raise RequestError("contract", str(exc)) from None

    stream = bool(body.get("stream") or False)
    try:
        return _normalise(body, stream, vocab_size, context_length, per_position)
    except RequestError as exc:
        # SGLang runs these checks inside the response generator: a streaming request gets
        # them as an in-stream error (the per-position patch's checks keep their HTTP 400).
        if stream and exc.kind == "value" and not exc.message.startswith(_PER_POSITION):
            exc.in_stream = True
        raise


_PER_POSITION = "token_ids_logprob_positions: "


def _normalise(
    body: dict[str, Any],
    stream: bool,
    vocab_size: int,
    context_length: int,
    per_position: Literal["patched", "unpatched"],
) -> GenerateRequestSpec:
    """SGLang's ``normalize_batch_and_arguments`` and tokenizer-manager checks, per item."""
    b64 = _lax_bool(body, "return_flat_raw_top_logprobs_b64")
    flat_input = _lax_bool(body, "return_flat_raw_top_logprobs")
    flat_output = _lax_bool(body, "return_flat_raw_output_top_logprobs")
    input_ids = body.get("input_ids")
    if input_ids is None:
        if body.get("text") is not None:
            raise RequestError(
                "value", "The mock SGLang server has no tokenizer: send input_ids, not text."
            )
        raise RequestError("value", "Either text, input_ids or input_embeds should be provided.")
    if flat_output and stream:
        raise RequestError(
            "value",
            "return_flat_raw_output_top_logprobs is only set on the finished response and "
            "does not support stream=True.",
        )
    if b64 and not (flat_input or flat_output):
        raise RequestError(
            "value",
            "return_flat_raw_top_logprobs_b64 requires return_flat_raw_top_logprobs "
            "or return_flat_raw_output_top_logprobs.",
        )
    if not input_ids:
        raise RequestError("value", "input_ids cannot be empty.")
    is_batch = not _is_int(input_ids[0])
    seqs: list[list[int]] = input_ids if is_batch else [input_ids]
    n = len(seqs)
    for seq in seqs:
        if not seq:
            raise RequestError("value", "input_ids cannot be empty.")

    positions_raw = body.get("token_ids_logprob_positions")
    use_positions = positions_raw is not None and per_position == "patched"

    sps = _per_item(body, "sampling_params", {}, n, is_batch)
    ret_lp = _per_item(body, "return_logprob", False, n, is_batch)
    starts = _per_item(body, "logprob_start_len", -1, n, is_batch)
    topks = _per_item(body, "top_logprobs_num", 0, n, is_batch)
    tid = body.get("token_ids_logprob")
    if not tid:
        tids: list[list[int] | None] = [None] * n
    elif isinstance(tid[0], list):
        if not is_batch or len(tid) != n:
            raise RequestError(
                "value",
                f"The length of token_ids_logprob ({len(tid)}) does not match the batch size "
                f"({n}).",
            )
        tids = [list(t) if t else None for t in tid]
    else:
        tids = [list(tid) for _ in range(n)]
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    else:
        rids = _per_item(body, "rid", None, n, is_batch)
        if len(set(rids)) != len(rids):
            dup = sorted({r for r in rids if rids.count(r) > 1})
            raise RequestError("value", f"Duplicate request IDs detected within the request: {dup}")
    return_text = bool(body.get("return_text_in_logprobs") or False)
    return_prompt = bool(body.get("return_prompt_token_ids") or False)

    items: list[GenerateItem] = []
    for i in range(n):
        arr: npt.NDArray[np.int64] = np.asarray(seqs[i], dtype=np.int64)
        length = int(arr.size)
        sp: dict[str, Any] = sps[i] or {}
        max_new = sp.get("max_new_tokens")
        max_new = 128 if max_new is None else int(max_new)
        if max_new < 0:
            raise RequestError("value", "max_new_tokens must be at least 0.")
        if int(sp.get("n") or 1) != 1:
            raise RequestError("value", "The mock SGLang server supports n=1 only.")
        temperature = sp.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        if length > context_length:
            raise RequestError(
                "value",
                f"The input ({length} tokens) is longer than the model's context length "
                f"({context_length} tokens).",
            )
        if length + max_new > context_length:
            raise RequestError(
                "value",
                f"Requested token count exceeds the model's maximum context length of "
                f"{context_length} tokens. You requested a total of {length + max_new} tokens: "
                f"{length} tokens from the input messages and {max_new} tokens for the "
                f"completion. Please reduce the number of tokens in the input messages or the "
                f"completion to fit within the limit.",
            )
        ids_i = tids[i]
        if ids_i is not None:
            for t in ids_i:
                if not 0 <= t < vocab_size:
                    raise RequestError(
                        "value",
                        f"token_ids_logprob contains out-of-vocabulary token id {t}; valid range "
                        f"is [0, {vocab_size}).",
                    )
        return_logprob = bool(ret_lp[i])
        s = int(starts[i])
        if s < -1:
            raise RequestError("value", f"logprob_start_len must be >= -1, got {s}.")
        if use_positions:
            _check_per_position(
                body,
                positions_raw,
                is_batch,
                length,
                return_logprob,
                max_new,
                s,
                stream,
                vocab_size,
            )
        if s == -1:
            s = length - 1 if (ids_i is not None and max_new > 0) else length
        if s > length:
            raise RequestError(
                "value",
                f"req.logprob_start_len={s} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={length}. Please use a smaller logprob_start_len.",
            )
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            raise RequestError(
                "crash",
                "CUDA error: device-side assert triggered (input_ids out of vocabulary; "
                "SGLang does not validate them)",
                status=500,
            )
        stop_ids = tuple(int(t) for t in (sp.get("stop_token_ids") or ()))
        seed = sp.get("sampling_seed")
        items.append(
            GenerateItem(
                input_ids=arr,
                rid=str(rids[i]),
                return_logprob=return_logprob,
                logprob_start_len=s,
                top_logprobs_num=max(int(topks[i] or 0), 0),
                token_ids_logprob=ids_i,
                positions_ids=positions_raw if use_positions else None,
                return_text=return_text,
                max_new_tokens=max_new,
                temperature=temperature,
                stop_token_ids=stop_ids,
                sampling_seed=None if seed is None else int(seed),
                return_prompt_token_ids=return_prompt,
            )
        )
    return GenerateRequestSpec(
        items=items,
        is_batch=is_batch,
        stream=stream,
        flat_input=flat_input,
        flat_output=flat_output,
        b64=b64,
    )


def _check_per_position(
    body: dict[str, Any],
    rows: Any,
    is_batch: bool,
    length: int,
    return_logprob: bool,
    max_new: int,
    start: int,
    stream: bool,
    vocab_size: int,
) -> None:
    """Validation of ``token_ids_logprob_positions`` (patched server, PR #38119)."""

    def bad(msg: str) -> RequestError:
        return RequestError("value", f"{_PER_POSITION}{msg}")

    if is_batch:
        raise bad("Per-position scoring accepts one input sequence per HTTP request")
    if body.get("token_ids_logprob"):
        raise bad("cannot be combined with token_ids_logprob")
    if not isinstance(rows, list):
        raise bad("must be a list with one row per input token")
    if len(rows) != length:
        raise bad(f"has {len(rows)} rows, expected one per input token ({length})")
    if not return_logprob:
        raise bad("requires return_logprob=true")
    if max_new != 0:
        raise bad("requires max_new_tokens=0")
    if start < 0:
        raise bad("requires logprob_start_len >= 0")
    if stream:
        raise bad("does not support stream=true")
    for p, row in enumerate(rows):
        if not isinstance(row, list):
            raise bad(f"row {p} is not a list")
        for t in row:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise bad(f"row {p} holds an invalid token id (must be an int in [0, vocab_size))")
        if len(set(row)) != len(row):
            raise bad(f"row {p} holds duplicate token ids")


# ---------------------------------------------------------------------------- answers


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
) -> dict[str, Any]:
    """The JSON-ready answer object for one item (``{"text", "output_ids", "meta_info"}``).

    ``fault`` applies a wire fault at the data level: ``"misaligned"`` shifts the token ids of
    ``input_token_logprobs`` by one row; ``"missing_rows"`` drops the last row of every
    ``input_*`` list.
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
            _logprob_fields(model, item, full, s, n_gen, flat_input, flat_output, b64, fault)
        )
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = n_gen
    meta["cached_tokens"] = 0
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
    tok_lp = model.logprobs_in(tok_rows, tok_ids[:, None])[:, 0]
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
        lp = model.logprobs_in(rows, mat)
        in_rows = _nested_rows(lp[in_sel], mat[in_sel], with_text)
        if drop:
            in_rows = in_rows[:-1] if in_rows else in_rows
        fields["input_token_ids_logprobs"] = ([None] if n_in - drop >= 1 else []) + in_rows
        fields["output_token_ids_logprobs"] = _nested_rows(lp[out_sel], mat[out_sel], with_text)
    elif item.positions_ids is not None:
        fields["input_token_ids_logprobs"] = _per_position_rows(
            model, rows, positions[in_sel], item.positions_ids, n_in, with_text, drop
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
        lp = model.logprobs_in(_take(rows, slice(0, n)), mat)
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
