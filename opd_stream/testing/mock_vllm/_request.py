"""Sans-IO parsing and validation of the mock vLLM server's requests (vLLM 0.34.0).

Independent of ``opd_stream``'s client code; written from vLLM's own source:
``POST /inference/v1/generate`` (``GenerateRequest``) and ``POST /v1/completions``
(``CompletionRequest``: ``prompt`` as token ids). Checks run in vLLM's order, each with its
message: the body (400, type ``"Bad Request"``), the serving layer, then
``SamplingParams.verify`` / ``_validate_logprobs`` and the input processor (400
``"BadRequestError"`` with the field at fault as ``param``). The model has no tokenizer
(as ``vllm serve --skip-tokenizer-init``): text prompts, stop strings and an ``output_mode``
other than ``"tokens"`` are refused.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from ._errors import VllmError

__all__ = ("Limits", "VllmItem", "parse_completions", "parse_generate")

_decoder = msgspec.json.Decoder()
_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2


class Limits(msgspec.Struct, frozen=True):
    """The server settings a request is checked against."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int  # resolved (-1 -> vocab_size)
    served_model: str = "mock-teacher"


def _check_model(body: dict[str, Any], lim: Limits) -> None:
    """The serving layer's ``_check_model``: a ``model`` other than the served one is 404."""
    model = body.get("model")
    if model is not None and model != lim.served_model:
        raise VllmError(f"The model `{model}` does not exist.", 404, param="model")


class VllmItem(msgspec.Struct, kw_only=True):
    """One engine request (one prompt), as the mock answers it."""

    token_ids: npt.NDArray[np.int64]
    request_id: str
    max_tokens: int
    temperature: float
    seed: int | None
    stop_token_ids: tuple[int, ...]
    prompt_logprobs: int | None  # -1 resolved to the vocabulary size
    ids: npt.NDArray[np.int64] | None  # prompt_logprob_token_ids [rows, cols], -1 pads
    start: int  # prompt_logprob_start (0 when unset)
    skip_reading_prefix_cache: bool
    salt: str | None
    return_token_ids: bool

    # What the shared prefix cache / compute model / signal faults read (CacheItem).
    @property
    def input_ids(self) -> npt.NDArray[np.int64]:
        return self.token_ids

    @property
    def cache_salt(self) -> str | None:
        return self.salt

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens

    @property
    def return_logprob(self) -> bool:
        # vLLM reads the prefix cache unless skip_reading_prefix_cache; a request with prompt
        # logprobs reuses at most the rows before prompt_logprob_start.
        return self.skip_reading_prefix_cache or self.scores_prompt

    @property
    def logprob_start_len(self) -> int:
        return 0 if self.skip_reading_prefix_cache else self.start

    @property
    def scores_prompt(self) -> bool:
        """Whether the request asks for prompt logprobs (dicts or fixed ids)."""
        return self.prompt_logprobs is not None or self.ids is not None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _body_error(model: str, loc: str, msg: str, param: str | None = None) -> VllmError:
    """A 400 from the body layer (pydantic, or ``SamplingParams.__post_init__``)."""
    return VllmError(
        f"1 validation error for {model}\n{loc}\n  {msg}", param=param, type_="Bad Request"
    )


def _decode(raw: bytes, model: str) -> dict[str, Any]:
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise VllmError(f"JSON decode error: {exc}", type_="Bad Request") from None
    if not isinstance(body, dict):
        raise _body_error(model, "body", "Input should be a valid dictionary or object")
    return body


def _opt_int(d: dict[str, Any], key: str, model: str, loc: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise _body_error(model, f"{loc}{key}", "Input should be a valid integer")
    return int(v)


def _opt_float(d: dict[str, Any], key: str, model: str, loc: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _body_error(model, f"{loc}{key}", "Input should be a valid number")
    return float(v)


def _opt_bool(d: dict[str, Any], key: str, model: str, loc: str) -> bool | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _body_error(model, f"{loc}{key}", "Input should be a valid boolean")
    return v


class _Sampling(msgspec.Struct, kw_only=True):
    """The ``SamplingParams`` fields the mock reads, after ``__post_init__``."""

    n: int = 1
    temperature: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ids: list[list[int]] | None = None
    start: int | None = None
    skip_reading_prefix_cache: bool = False
    detokenize: bool = True


def _post_init(s: _Sampling, model: str, skip: bool | None, stop: Any) -> _Sampling:
    """``SamplingParams.__post_init__`` / ``_verify_args`` (the checks that can fire for
    the fields the mock reads)."""

    def bad(msg: str, param: str | None = None) -> VllmError:
        return _body_error(model, "sampling_params", f"Value error, {msg}", param)

    if s.n < 1:
        raise bad(f"n must be at least 1, got {s.n}.")
    if not math.isfinite(s.temperature):
        raise bad(f"temperature must be a finite number, got {s.temperature}.", "temperature")
    if s.temperature < 0.0:
        raise bad(f"temperature must be non-negative, got {s.temperature}.", "temperature")
    if s.temperature > 2.0:
        raise bad(f"temperature must be in [0, 2], got {s.temperature}.", "temperature")
    if 0 < s.temperature < _MAX_TEMP:
        s.temperature = _MAX_TEMP
    if s.seed == -1:
        s.seed = None
    if s.max_tokens is not None and s.max_tokens < 1:
        raise bad(f"max_tokens must be at least 1, got {s.max_tokens}.", "max_tokens")
    if s.logprobs is not None and s.logprobs != -1 and s.logprobs < 0:
        raise bad(f"logprobs must be non-negative or -1, got {s.logprobs}.", "logprobs")
    if s.prompt_logprobs is not None and s.prompt_logprobs != -1 and s.prompt_logprobs < 0:
        raise bad(
            f"prompt_logprobs must be non-negative or -1, got {s.prompt_logprobs}.",
            "prompt_logprobs",
        )
    if stop:
        if not s.detokenize:
            raise bad(
                "stop strings are only supported when detokenize is True. "
                "Set detokenize=True to use stop."
            )
        raise VllmError("The mock vLLM server has no tokenizer: use stop_token_ids, not stop.")
    if s.temperature < _SAMPLING_EPS and s.n > 1:
        raise bad(f"n must be 1 when using greedy sampling, got {s.n}.")
    s.stop_token_ids = tuple(dict.fromkeys(s.stop_token_ids))
    s.skip_reading_prefix_cache = (
        (s.prompt_logprobs is not None or s.ids is not None) if skip is None else skip
    )
    return s


def _validate_logprobs(s: _Sampling, lim: Limits) -> npt.NDArray[np.int64] | None:
    """``SamplingParams._validate_logprobs`` (engine layer); returns the padded id array."""
    max_lp = lim.max_logprobs
    if s.logprobs:
        n = lim.vocab_size if s.logprobs == -1 else s.logprobs
        if n > max_lp:
            raise VllmError(
                f"Requested sample logprobs of {n}, which is greater than max allowed: {max_lp}",
                param="logprobs",
            )
    if s.prompt_logprobs:
        n = lim.vocab_size if s.prompt_logprobs == -1 else s.prompt_logprobs
        if n > max_lp:
            raise VllmError(
                f"Requested prompt logprobs of {n}, which is greater than max allowed: {max_lp}",
                param="prompt_logprobs",
            )
    arr: npt.NDArray[np.int64] | None = None
    if s.ids is not None:
        rows = s.ids
        shape = (len(rows), max(map(len, rows), default=0))
        if 0 in shape:
            raise VllmError(
                "prompt_logprob_token_ids must be a non-empty integer array of shape "
                "[num_rows, num_ids].",
                param="prompt_logprob_token_ids",
            )
        max_rows = lim.max_model_len - 1
        if shape[0] > max_rows:
            raise VllmError(
                f"prompt_logprob_token_ids has {shape[0]} rows, but a prompt has at most "
                f"{max_rows} scored rows (max_model_len - 1).",
                param="prompt_logprob_token_ids",
            )
        num_ids = shape[1]
        if num_ids > max_lp:
            raise VllmError(
                f"Requested {num_ids} token ids per row in prompt_logprob_token_ids, which is "
                f"greater than max allowed: {max_lp}. Set max_logprobs (--max-logprobs) to at "
                f"least {num_ids}.",
                param="prompt_logprob_token_ids",
            )
        arr = np.full(shape, -1, dtype=np.int64)
        for i, row in enumerate(rows):
            arr[i, : len(row)] = row
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -1 or hi >= lim.vocab_size:
            raise VllmError(
                "prompt_logprob_token_ids contain out-of-vocab token ids (-1 pads a row). "
                f"Vocabulary size: {lim.vocab_size}",
                param="prompt_logprob_token_ids",
            )
    if s.start is not None:
        if s.ids is None and s.prompt_logprobs is None:
            raise VllmError(
                "prompt_logprob_start requires prompt_logprobs or prompt_logprob_token_ids.",
                param="prompt_logprob_start",
            )
        if s.start < 0:
            raise VllmError(
                "prompt_logprob_start must be non-negative.", param="prompt_logprob_start"
            )
    return arr


def _check_prompt(tokens: list[int], s: _Sampling, ids: Any, lim: Limits) -> int:
    """The input processor: prompt length, token ids, ``prompt_logprob_start`` and the row
    count; returns the generation budget (``max_tokens``, or up to ``max_model_len``)."""
    length = len(tokens)
    m = lim.max_model_len
    if length > m:
        raise VllmError(
            f"The decoder prompt (length {length}) is longer than the maximum model length of "
            f"{m}. Make sure that `max_model_len` is no smaller than the number of text tokens."
        )
    if length == m:
        raise VllmError(
            f"The decoder prompt (length {length}) plus the number of requested output tokens "
            f"(at least 1) is longer than the maximum model length of {m}. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
            "output tokens)."
        )
    top = max(tokens)
    if top >= lim.vocab_size:
        raise VllmError(f"Token id {top} is out of vocabulary")
    start = s.start or 0
    if start and start >= length - 1:
        raise VllmError(
            f"prompt_logprob_start must be less than prompt_len - 1 ({length - 1}) so at least "
            "one prompt row is scored.",
            param="prompt_logprob_start",
        )
    if ids is not None:
        num_rows = max(length - 1 - start, 0)
        if len(ids) != num_rows:
            raise VllmError(
                f"prompt_logprob_token_ids has {len(ids)} rows, but the prompt has {num_rows} "
                "scored rows (prompt_len - 1 - prompt_logprob_start).",
                param="prompt_logprob_token_ids",
            )
    budget = m - length
    return budget if s.max_tokens is None else min(s.max_tokens, budget)


def _sampling_from_json(sp: Any, model: str) -> tuple[_Sampling, bool | None, Any]:
    """``GenerateRequest.sampling_params`` as JSON -> fields (types checked as pydantic)."""
    loc = "sampling_params."
    if not isinstance(sp, dict):
        raise _body_error(model, "sampling_params", "Input should be an object")
    ids = sp.get("prompt_logprob_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(r, list) for r in ids):
            raise _body_error(
                model, f"{loc}prompt_logprob_token_ids", "Input should be a valid list"
            )
        for row in ids:
            for v in row:
                if not _is_int(v):
                    raise _body_error(
                        model, f"{loc}prompt_logprob_token_ids", "Input should be a valid integer"
                    )
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise _body_error(model, f"{loc}stop_token_ids", "Input should be a valid list of int")
    # Absent or null: the server's default, generating up to max_model_len.
    max_tokens = sp.get("max_tokens")
    if max_tokens is not None and not _is_int(max_tokens):
        raise _body_error(model, f"{loc}max_tokens", "Input should be a valid integer")
    temperature = _opt_float(sp, "temperature", model, loc)
    s = _Sampling(
        n=_opt_int(sp, "n", model, loc) or 1,
        temperature=1.0 if temperature is None else temperature,
        seed=_opt_int(sp, "seed", model, loc),
        max_tokens=max_tokens,
        stop_token_ids=tuple(stop_ids),
        logprobs=_opt_int(sp, "logprobs", model, loc),
        prompt_logprobs=_opt_int(sp, "prompt_logprobs", model, loc),
        ids=ids,
        start=_opt_int(sp, "prompt_logprob_start", model, loc),
        detokenize=bool(_opt_bool(sp, "detokenize", model, loc) is not False),
    )
    return s, _opt_bool(sp, "skip_reading_prefix_cache", model, loc), sp.get("stop")


def _cache_salt(body: dict[str, Any], model: str) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise _body_error(model, "cache_salt", "Input should be a valid string")
    if not 1 <= len(salt) <= 1024:
        raise _body_error(model, "cache_salt", "String should have between 1 and 1024 characters")
    return salt


def _item(
    tokens: list[int],
    s: _Sampling,
    arr: npt.NDArray[np.int64] | None,
    lim: Limits,
    request_id: str,
    salt: str | None,
    return_token_ids: bool,
) -> VllmItem:
    max_tokens = _check_prompt(tokens, s, arr, lim)
    plp = s.prompt_logprobs
    return VllmItem(
        token_ids=np.asarray(tokens, dtype=np.int64),
        request_id=request_id,
        max_tokens=max_tokens,
        temperature=s.temperature,
        seed=s.seed,
        stop_token_ids=s.stop_token_ids,
        prompt_logprobs=lim.vocab_size if plp == -1 else plp,
        ids=arr,
        start=s.start or 0,
        skip_reading_prefix_cache=s.skip_reading_prefix_cache,
        salt=salt,
        return_token_ids=return_token_ids,
    )


def parse_generate(
    raw: bytes, lim: Limits, *, header_request_id: str | None = None
) -> tuple[VllmItem, bool]:
    """A ``/inference/v1/generate`` body -> the item and whether ``stream`` was asked.

    Raises:
        VllmError: the answer vLLM would give instead.
    """
    model = "GenerateRequest"
    body = _decode(raw, model)
    tokens = body.get("token_ids")
    if tokens is None:
        raise _body_error(model, "token_ids", "Field required")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise _body_error(model, "token_ids", "Input should be a valid list of integers")
    if not tokens:
        raise _body_error(
            model, "token_ids", "List should have at least 1 item after validation, not 0"
        )
    if any(t < 0 for t in tokens):
        raise _body_error(
            model, "token_ids", "Value error, token_ids must not contain negative values"
        )
    if "sampling_params" not in body:
        raise _body_error(model, "sampling_params", "Field required")
    s, skip, stop = _sampling_from_json(body["sampling_params"], model)
    s = _post_init(s, model, skip, stop)
    output_mode = body.get("output_mode", "tokens")
    if output_mode not in ("tokens", "text", "derender"):
        raise _body_error(model, "output_mode", "Input should be 'tokens', 'text' or 'derender'")
    if output_mode != "tokens" and not s.detokenize:
        raise _body_error(
            model,
            "body",
            f"Value error, output_mode={output_mode!r} requires sampling_params.detokenize "
            "to be true",
        )
    salt = _cache_salt(body, model)
    stream = bool(_opt_bool(body, "stream", model, ""))
    return_ids = bool(_opt_bool(body, "return_token_ids", model, ""))
    rid = body.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise _body_error(model, "request_id", "Input should be a valid string")
    base = header_request_id or rid or uuid.uuid4().hex
    # Serving layer.
    _check_model(body, lim)
    if s.n != 1:
        raise VllmError("The mock vLLM server supports n=1 only.")
    if stream and s.ids is not None:
        raise VllmError("prompt_logprob_token_ids are not available when stream=true.")
    if output_mode != "tokens":
        raise VllmError(
            f"output_mode={output_mode!r} requires a tokenizer, but this server does not load "
            "one (--tokens-only or --skip-tokenizer-init). Send the request to a server that "
            "loads a tokenizer, or use output_mode='tokens'."
        )
    if stream:
        raise VllmError("The mock vLLM server does not stream: send stream=false.")
    if s.logprobs is not None:
        raise VllmError(
            "The mock vLLM server does not return output-token logprobs "
            "(sampling_params.logprobs): score the tokens as prompt rows instead."
        )
    # Engine layer.
    arr = _validate_logprobs(s, lim)
    return _item(tokens, s, arr, lim, f"generate-tokens-{base}", salt, return_ids), stream


def parse_completions(
    raw: bytes, lim: Limits, *, header_request_id: str | None = None
) -> tuple[list[VllmItem], dict[str, Any]]:
    """A ``/v1/completions`` body -> one item per prompt, and the request's response flags
    (``return_token_ids``, ``return_weight_versions``, ``request_id``).

    Raises:
        VllmError: the answer vLLM would give instead.
    """
    model = "CompletionRequest"
    body = _decode(raw, model)
    prompt = body.get("prompt")
    if (
        prompt is None
        or isinstance(prompt, str)
        or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str))
    ):
        raise VllmError(
            "The mock vLLM server has no tokenizer: send the prompt as token ids."
            if prompt is not None
            else "Either prompt or prompt_embeds must be provided and non-empty."
        )
    if not isinstance(prompt, list) or not prompt:
        raise VllmError("Either prompt or prompt_embeds must be provided and non-empty.")
    batch = isinstance(prompt[0], list)
    prompts: list[Any] = prompt if batch else [prompt]
    for p in prompts:
        if not isinstance(p, list) or not all(_is_int(t) for t in p):
            raise _body_error(model, "prompt", "Input should be a valid list of integers")
        if any(t < 0 for t in p):
            raise _body_error(model, "prompt", "Input should be greater than or equal to 0")
        if not p:
            raise VllmError("The decoder prompt cannot be empty")
    plp = _opt_int(body, "prompt_logprobs", model, "")
    stream = bool(_opt_bool(body, "stream", model, ""))
    if plp is not None:
        if stream and (plp > 0 or plp == -1):
            raise VllmError(
                "`prompt_logprobs` are not available when `stream=True`.",
                param="prompt_logprobs",
            )
        if plp < 0 and plp != -1:
            raise VllmError(
                "`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs"
            )
    _check_model(body, lim)
    if stream:
        raise VllmError("The mock vLLM server does not stream: send stream=false.")
    if body.get("echo") or body.get("logprobs") is not None:
        raise VllmError("The mock vLLM server answers neither echo nor logprobs (no tokenizer).")
    max_tokens = 16 if body.get("max_tokens") is None else _opt_int(body, "max_tokens", model, "")
    temperature = _opt_float(body, "temperature", model, "")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise _body_error(model, "stop_token_ids", "Input should be a valid list of int")
    salt = _cache_salt(body, model)
    rid = body.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise _body_error(model, "request_id", "Input should be a valid string")
    base = header_request_id or rid or uuid.uuid4().hex
    flags = {
        "id": f"cmpl-{base}",
        "return_token_ids": bool(_opt_bool(body, "return_token_ids", model, "")),
        "return_weight_versions": bool(_opt_bool(body, "return_weight_versions", model, "")),
        "model": body.get("model"),
    }
    n = _opt_int(body, "n", model, "") or 1
    items = []
    for i, p in enumerate(prompts):
        budget = lim.max_model_len - len(p)
        if max_tokens is not None and len(p) + max_tokens > lim.max_model_len:
            if len(p) >= lim.max_model_len:
                raise VllmError(
                    f"This model's maximum context length is {lim.max_model_len} tokens. "
                    f"However, your request has {len(p)} input tokens. Please reduce the "
                    "length of the input messages.",
                    param="input_tokens",
                )
            raise VllmError(
                f"'max_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {lim.max_model_len} tokens and your request has {len(p)} input "
                f"tokens ({max_tokens} > {lim.max_model_len} - {len(p)}).",
                param="max_tokens",
            )
        s = _Sampling(
            n=n,
            temperature=1.0 if temperature is None else temperature,
            seed=_opt_int(body, "seed", model, ""),
            max_tokens=max_tokens if max_tokens is not None else budget,
            stop_token_ids=tuple(stop_ids),
            prompt_logprobs=plp,
        )
        s = _post_init(s, "SamplingParams", None, body.get("stop"))
        if s.n != 1:
            raise VllmError("The mock vLLM server supports n=1 only.")
        _validate_logprobs(s, lim)
        items.append(_item(p, s, None, lim, f"{flags['id']}-{i}", salt, False))
    return items, flags
