"""verl drop-in: SGLang teacher logprobs in verl's vLLM ``prompt_logprobs`` contract.

verl's distillation teacher manager consumes, per sequence of ``sequence_length`` tokens,
two lists of ``sequence_length`` rows each, every row ``max(k, 1)`` wide:

* ``prompt_ids[j]`` / ``prompt_logprobs[j]`` for ``j < sequence_length - 1``: the
  prediction of token ``j + 1`` (position 0 has no context and is skipped): with
  ``k = 0`` the scored token itself ``[token_id]`` / ``[logprob]``; with ``k > 0`` the
  teacher's top-k there, best first.
* one pad row last, ``[0] * max(k, 1)`` / ``[0.0] * max(k, 1)``.

This module builds those lists from an SGLang ``/generate`` answer asked with
:func:`sglang_prompt_logprobs_params` (``logprob_start_len = 0``), in the nested form
(``[logprob, token_id, text]`` triples) or the base64 flat form of SGLang >= 0.5.23. Unlike
verl's own ``_extract_prompt_logprobs_sglang`` it never asserts: a short or misaligned
answer raises :class:`~opd_stream.MisalignedResponseError` naming the position and the
counts, a missing field :class:`~opd_stream.MalformedResponseError`, a bad argument
:class:`~opd_stream.ConfigError`. SGLang's ``null`` logprob (``-inf``) becomes
``float("-inf")``.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from .._errors import ConfigError, MalformedResponseError, MisalignedResponseError

__all__ = (
    "extract_prompt_logprobs",
    "fill_prompt_logprobs",
    "sglang_prompt_logprobs_params",
)


def sglang_prompt_logprobs_params(num_prompt_logprobs: int) -> dict[str, Any]:
    """Top-level ``/generate`` fields that make SGLang answer what this module reads.

    ``{"return_logprob": True, "logprob_start_len": 0}`` plus ``top_logprobs_num`` when
    ``num_prompt_logprobs > 0`` (top level: SGLang rejects it inside ``sampling_params``).

    Raises:
        ConfigError: ``num_prompt_logprobs`` is not an integer >= 0.
    """
    k = _check_k(num_prompt_logprobs)
    out: dict[str, Any] = {"return_logprob": True, "logprob_start_len": 0}
    if k > 0:
        out["top_logprobs_num"] = k
    return out


def _check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(f"num_prompt_logprobs must be an integer >= 0, got {k!r}")
    return k


def _lp(value: Any, where: str) -> float:
    if value is None:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedResponseError(f"{where}: logprob is {type(value).__name__}, not a number")
    out = float(value)
    if math.isnan(out):
        raise MalformedResponseError(f"{where}: logprob is NaN")
    return out


def _entry(entry: Any, where: str) -> tuple[int, float]:
    if not isinstance(entry, list | tuple) or len(entry) < 2:
        raise MalformedResponseError(f"{where}: expected a [logprob, token_id, text] entry")
    token = entry[1]
    if isinstance(token, bool) or not isinstance(token, int):
        raise MalformedResponseError(f"{where}: token id is not an integer")
    return int(token), _lp(entry[0], where)


_Lists = tuple[list[list[int]], list[list[float]]]


def _nested_topk(meta: Mapping[str, Any], k: int, n_rows: int) -> _Lists:
    rows = meta.get("input_top_logprobs")
    if rows is None:
        raise MalformedResponseError(
            "meta_info.input_top_logprobs is missing (ask with top_logprobs_num > 0)"
        )
    if not isinstance(rows, list) or len(rows) != n_rows + 1:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise MisalignedResponseError(
            f"meta_info.input_top_logprobs has {got} entries, expected {n_rows + 1} "
            "(one per input token with logprob_start_len=0)"
        )
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for position in range(1, n_rows + 1):
        row = rows[position] or []
        if len(row) != k:
            raise MisalignedResponseError(
                f"SGLang returned {len(row)} top logprobs at position {position}, expected {k}"
            )
        pairs = [_entry(e, f"input_top_logprobs[{position}]") for e in row]
        ids.append([p[0] for p in pairs])
        lps.append([p[1] for p in pairs])
    return ids, lps


def _b64(meta: Mapping[str, Any], name: str, dtype: str, count: int) -> Any:
    text = meta.get(name)
    if not isinstance(text, str):
        raise MalformedResponseError(f"meta_info.{name} is missing")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedResponseError(f"meta_info.{name} is not valid base64") from None
    if len(raw) != 4 * count:
        raise MisalignedResponseError(
            f"meta_info.{name} holds {len(raw) // 4} values, expected {count}"
        )
    return np.frombuffer(raw, dtype=dtype)


def _b64_topk(meta: Mapping[str, Any], k: int, n_rows: int) -> _Lists:
    shape = meta.get("input_top_logprobs_shape")
    prefix = meta.get("input_top_logprobs_null_prefix")
    if not (isinstance(shape, list) and len(shape) == 2 and isinstance(prefix, int)):
        raise MalformedResponseError(
            "meta_info.input_top_logprobs_shape / _null_prefix are missing or malformed"
        )
    rows, width = int(shape[0]), int(shape[1])
    if width != k:
        raise MisalignedResponseError(
            f"SGLang returned {width} top logprobs per position, expected {k}"
        )
    if prefix + rows != n_rows + 1 or prefix < 1:
        raise MisalignedResponseError(
            f"meta_info.input_top_logprobs covers null_prefix {prefix} + {rows} rows, "
            f"expected 1 + {n_rows} (one per input token with logprob_start_len=0)"
        )
    vals = _b64(meta, "input_top_logprobs_val_flat_b64", "<f4", rows * k).reshape(rows, k)
    idx = _b64(meta, "input_top_logprobs_idx_flat_b64", "<i4", rows * k).reshape(rows, k)
    keep = slice(rows - n_rows, rows)
    lps = [[-math.inf if math.isnan(v) else float(v) for v in row] for row in vals[keep].tolist()]
    return [[int(i) for i in row] for row in idx[keep].tolist()], lps


def extract_prompt_logprobs(
    meta_info: Mapping[str, Any],
    num_prompt_logprobs: int,
    sequence_length: int,
    *,
    input_ids: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Build verl's ``(prompt_ids, prompt_logprobs)`` from an SGLang ``meta_info``.

    Args:
        meta_info: the ``meta_info`` of one SGLang ``/generate`` answer, asked with
            :func:`sglang_prompt_logprobs_params` (``logprob_start_len = 0``).
        num_prompt_logprobs: k; 0 = the scored tokens' own logprobs.
        sequence_length: tokens sent; both lists get exactly this many rows.
        input_ids: the tokens sent; when given, the token ids SGLang echoes are checked.

    Returns:
        ``(prompt_ids, prompt_logprobs)``, each ``sequence_length`` rows of
        ``max(k, 1)`` entries, the last row padding (see the module docstring).

    Raises:
        ConfigError: ``num_prompt_logprobs`` < 0, ``sequence_length`` < 1, or
            ``input_ids`` of another length.
        MalformedResponseError: a field is missing or not SGLang's shape.
        MisalignedResponseError: row counts, top-k widths or echoed token ids differ
            from what was asked (SGLang returned fewer entries than asked, or the
            request did not use ``logprob_start_len = 0``).
    """
    k = _check_k(num_prompt_logprobs)
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, int):
        raise ConfigError("sequence_length must be an integer")
    if sequence_length < 1:
        raise ConfigError(f"sequence_length must be >= 1, got {sequence_length}")
    if input_ids is not None and len(input_ids) != sequence_length:
        raise ConfigError(
            f"input_ids has {len(input_ids)} tokens but sequence_length is {sequence_length}"
        )
    n_rows = sequence_length - 1
    tokens = meta_info.get("input_token_logprobs")
    if not isinstance(tokens, list):
        raise MalformedResponseError("meta_info.input_token_logprobs is missing")
    if len(tokens) != sequence_length:
        raise MisalignedResponseError(
            f"SGLang prompt_logprobs length ({len(tokens)}) does not match sequence length "
            f"({sequence_length}); ask with logprob_start_len=0"
        )
    token_rows = [
        _entry(tokens[j], f"input_token_logprobs[{j}]") for j in range(1, sequence_length)
    ]
    if input_ids is not None:
        for j, (token, _) in enumerate(token_rows, start=1):
            if token != int(input_ids[j]):
                raise MisalignedResponseError(
                    f"input_token_logprobs[{j}] echoes a token id that differs from input_ids[{j}]"
                )
    if k == 0:
        ids = [[token] for token, _ in token_rows]
        lps = [[lp] for _, lp in token_rows]
    elif meta_info.get("input_top_logprobs_val_flat_b64") is not None:
        ids, lps = _b64_topk(meta_info, k, n_rows)
    else:
        ids, lps = _nested_topk(meta_info, k, n_rows)
    width = max(k, 1)
    ids.append([0] * width)
    lps.append([0.0] * width)
    return ids, lps


def fill_prompt_logprobs(
    meta_info: Mapping[str, Any],
    num_prompt_logprobs: int,
    sequence_length: int,
    result_dict: MutableMapping[str, Any],
) -> None:
    """Drop-in for verl's ``_extract_prompt_logprobs_sglang``: set ``result_dict``'s
    ``prompt_ids`` and ``prompt_logprobs`` (see :func:`extract_prompt_logprobs`)."""
    ids, lps = extract_prompt_logprobs(meta_info, num_prompt_logprobs, sequence_length)
    result_dict["prompt_ids"] = ids
    result_dict["prompt_logprobs"] = lps
