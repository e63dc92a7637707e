"""Sans-IO SGLang ``/generate`` protocol of the mock: request parsing and validation.

Independent of ``opd_stream``'s client code. Semantics follow ``docs/protocol.md`` (SGLang
0.5.23 plus the per-position patch #38119): validation in SGLang's three layers, each with
its error shape (:class:`RequestError`); ``logprob_start_len`` ``s`` defaults to -1, mapped
to ``L`` (``L-1`` when ``token_ids_logprob`` is set and the request generates); with
``stream: true`` SGLang's ValueErrors are answered in the event stream (HTTP 200,
``data: {"error": {...}}`` then ``data: [DONE]``), only body and contract checks with HTTP
400. The answers are built by :mod:`._answer`; the error shapes are :mod:`._errors`'.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from ._contract import ContractError, check_generate_contract
from ._errors import RequestError, validation_error

__all__ = (
    "GenerateItem",
    "GenerateRequestSpec",
    "parse_generate_request",
)

_decoder = msgspec.json.Decoder()


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
    cache_salt: str | None = None  # SGLang's cache_salt of this item (accepted, recorded)


class GenerateRequestSpec(msgspec.Struct, kw_only=True):
    """A parsed ``/generate`` body."""

    items: list[GenerateItem]
    is_batch: bool
    stream: bool
    flat_input: bool
    flat_output: bool
    b64: bool


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
        raise validation_error(
            f"'{key}'", "Input should be a valid boolean, unable to interpret input", "bool_parsing"
        )
    raise validation_error(f"'{key}'", "Input should be a valid boolean", "bool_type")


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
            raise validation_error(f"'{field}'", "Input should be a valid list", "list_type")
        nested = bool(v) and isinstance(v[0], list)
        rows = v if nested else [v]
        for i, row in enumerate(rows):
            if not isinstance(row, list):
                raise validation_error(
                    f"'{field}', {i}", "Input should be a valid list", "list_type"
                )
            for e in row:
                if not _is_int(e):
                    raise validation_error(
                        f"'{field}'", "Input should be a valid integer", "int_type"
                    )


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
    salts = _per_item(body, "cache_salt", None, n, is_batch)
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
                cache_salt=None if salts[i] is None else str(salts[i]),
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
