"""An independent re-implementation of SGLang 0.5.23's ``/generate`` request contract check.

SGLang re-checks the raw JSON body against ``api/v1/api_types.py::GenerateRequest``: unknown
top-level keys pass, unknown ``sampling_params`` keys and wrongly typed known fields are rejected
with ``400 {"error": "<message>"}``. The messages follow serde's texts, as SGLang's do. Only the
fields a scoring / generation client may plausibly send are type-checked at the top level; every
``sampling_params`` key is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ("SAMPLING_PARAMS_FIELDS", "ContractError", "check_generate_contract")

SAMPLING_PARAMS_FIELDS: tuple[str, ...] = (
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
)


class ContractError(ValueError):
    """The body violates the request contract; ``str(err)`` is the 400 ``error`` string."""


def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _bad(v: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: Any, expected: str = "i64") -> None:
    if not _is_int(v):
        raise _bad(v, expected)


def _uint(v: Any, expected: str) -> None:
    _int(v, expected)
    if v < 0:
        raise ContractError(f"invalid value: integer `{v}`, expected {expected}")


def _float(v: Any, expected: str = "f64") -> None:
    if not (_is_int(v) or isinstance(v, float)):
        raise _bad(v, expected)


def _bool(v: Any, expected: str = "a boolean") -> None:
    if not isinstance(v, bool):
        raise _bad(v, expected)


def _str(v: Any, expected: str = "a string") -> None:
    if not isinstance(v, str):
        raise _bad(v, expected)


def _seq(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(v, "a sequence")
    return v


def _map(v: Any, expected: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _bad(v, expected)
    return v


def _str_or_list(v: Any) -> None:
    if isinstance(v, list):
        for e in v:
            _str(e)
    else:
        _str(v, "a value or an array of values for StringOrList")


def _int_list(v: Any) -> None:
    for e in _seq(v):
        _int(e)


def _bool_or_list(v: Any) -> None:
    if isinstance(v, list):
        for e in v:
            _bool(e)
    else:
        _bool(v, "a value or an array of values for BoolOrList")


def _int_or_list(v: Any) -> None:
    if isinstance(v, list):
        for e in v:
            _int(e)
    else:
        _int(v, "a value or an array of values for Int64OrList")


def _token_ids_or_list(v: Any) -> None:
    if not isinstance(v, list):
        raise _bad(v, "a value or an array of values for TokenIdsOrList")
    if not v or _is_int(v[0]) or isinstance(v[0], float):
        _int_list(v)
    else:
        for e in v:
            _int_list(e)


def _watermark(v: Any) -> None:
    m = _map(v, "struct WatermarkRequestConfig")
    fields = ("enabled", "key", "context_window")
    checks: dict[str, Callable[[Any], None]] = {
        "enabled": _bool,
        "key": _str,
        "context_window": _int,
    }
    for key, x in m.items():
        if key not in checks:
            raise _unknown_field(key, fields)
        if x is not None:
            checks[key](x)


def _float_map(v: Any) -> None:
    for e in _map(v, "a map").values():
        _float(e)


def _str_seq(v: Any) -> None:
    for e in _seq(v):
        _str(e)


def _any(v: Any) -> None:
    return None


_SP_CHECKS: dict[str, Callable[[Any], None]] = {
    "max_new_tokens": _int,
    "stop": _str_or_list,
    "stop_token_ids": _int_list,
    "stop_regex": _str_or_list,
    "temperature": _float,
    "top_p": _float,
    "top_k": _int,
    "min_p": _float,
    "frequency_penalty": _float,
    "presence_penalty": _float,
    "repetition_penalty": _float,
    "min_new_tokens": _int,
    "n": _int,
    "json_schema": _str,
    "regex": _str,
    "ebnf": _str,
    "structural_tag": _str,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "stream_interval": _int,
    "logit_bias": _float_map,
    "sampling_seed": _int,
    "custom_params": _any,
    "beam_width": _int,
    "watermark": _watermark,
    "choice": _str_seq,
}


def _unknown_field(key: str, fields: tuple[str, ...]) -> ContractError:
    if len(fields) == 1:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}`")
    if len(fields) == 2:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}` or `{fields[1]}`")
    listed = ", ".join(f"`{f}`" for f in fields)
    return ContractError(f"unknown field `{key}`, expected one of {listed}")


def _sampling_params(v: Any, expected: str = "struct SamplingParams") -> None:
    m = _map(v, expected)
    for key, x in m.items():
        check = _SP_CHECKS.get(key)
        if check is None:
            raise _unknown_field(key, SAMPLING_PARAMS_FIELDS)
        if x is not None:
            check(x)


def _sampling_params_or_list(v: Any) -> None:
    if isinstance(v, list):
        for e in v:
            _sampling_params(e)
    else:
        _sampling_params(v, "a value or an array of values for SamplingParamsOrList")


def _str_map(v: Any) -> None:
    for e in _map(v, "a map").values():
        _str(e)


_TOP_CHECKS: dict[str, Callable[[Any], None]] = {
    "rid": _str_or_list,
    "text": _str_or_list,
    "input_ids": _token_ids_or_list,
    "stream": _bool,
    "sampling_params": _sampling_params_or_list,
    "return_logprob": _bool_or_list,
    "logprob_start_len": _int_or_list,
    "top_logprobs_num": _int_or_list,
    "token_ids_logprob": _token_ids_or_list,
    "return_hidden_states": _bool_or_list,
    "return_text_in_logprobs": _bool,
    "routed_dp_rank": _int,
    "extra_key": _str_or_list,
    "priority": _int,
    "cache_salt": _str_or_list,
    "require_reasoning": _bool,
    "routing_key": _str,
    "session_id": _str,
    "custom_labels": _str_map,
    "return_sampling_mask": _bool_or_list,
}

# Fields of the contract that are non-optional: null is a type error for them.
_NON_NULL: dict[str, Callable[[Any], None]] = {
    "return_prompt_token_ids": _bool,
    "routed_experts_start_len": _int,
}


def check_generate_contract(body: Any) -> None:
    """Check a parsed ``/generate`` JSON body like SGLang's ``generate_contract_error``.

    Raises:
        ContractError: with the message SGLang puts in ``{"error": "<message>"}``.
    """
    m = _map(body, "struct GenerateRequest")
    for key, x in m.items():
        check = _TOP_CHECKS.get(key)
        if check is not None:
            if x is not None:
                check(x)
            continue
        strict = _NON_NULL.get(key)
        if strict is not None:
            strict(x)
        if key == "max_thinking_tokens" and x is not None:
            _uint(x, "u64")
