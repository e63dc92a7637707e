"""SGLang ``/generate`` answers -> verl's vLLM ``prompt_logprobs`` lists (the contract is in
:mod:`opd_stream.integrations.verl`'s docstring): :func:`extract_prompt_logprobs`,
:func:`fill_prompt_logprobs`, and :func:`sglang_prompt_logprobs_params` to ask for them.

Read from the nested form (``[logprob, token_id, text]`` triples) or the flat forms of
SGLang >= 0.5.23 (base64 or plain lists); never asserts: a short or misaligned answer is a
:class:`~opd_stream.MisalignedResponseError`, a missing field a
:class:`~opd_stream.MalformedResponseError`.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from ..._errors import (
    ConfigError,
    MalformedResponseError,
    MisalignedResponseError,
    ServerAbortError,
)

__all__ = (
    "check_k",
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
    k = check_k(num_prompt_logprobs)
    out: dict[str, Any] = {"return_logprob": True, "logprob_start_len": 0}
    if k > 0:
        out["top_logprobs_num"] = k
    return out


def check_k(k: Any) -> int:
    """``k`` when it is an integer >= 0 (``num_prompt_logprobs``, verl's K), else ConfigError."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(f"num_prompt_logprobs must be an integer >= 0, got {k!r}")
    return k


def _lp(value: Any, where: str) -> float:
    if value is None:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedResponseError(f"{where}: logprob is {type(value).__name__}, not a number")
    out = float(value)
    # SGLang writes NaN as null (-inf); the b64 and flat forms map NaN the same way.
    return -math.inf if math.isnan(out) else out


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


def _flat_shape(meta: Mapping[str, Any], k: int, n_rows: int) -> int:
    """Check ``input_top_logprobs_shape`` / ``_null_prefix`` of a flat answer; return rows."""
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
    return rows


def _b64_topk_as_lists(meta: Mapping[str, Any], k: int, n_rows: int) -> _Lists:
    rows = _flat_shape(meta, k, n_rows)
    vals = _b64(meta, "input_top_logprobs_val_flat_b64", "<f4", rows * k).reshape(rows, k)
    idx = _b64(meta, "input_top_logprobs_idx_flat_b64", "<i4", rows * k).reshape(rows, k)
    keep = slice(rows - n_rows, rows)
    lps = [[-math.inf if math.isnan(v) else float(v) for v in row] for row in vals[keep].tolist()]
    return [[int(i) for i in row] for row in idx[keep].tolist()], lps


def _plain_flat_topk(meta: Mapping[str, Any], k: int, n_rows: int) -> _Lists:
    """``return_flat_raw_top_logprobs`` without b64: ``_val_flat`` (numbers or null) and
    ``_idx_flat`` (ints), row-major, with the same ``_shape`` and ``_null_prefix``."""
    rows = _flat_shape(meta, k, n_rows)
    vals, idx = meta.get("input_top_logprobs_val_flat"), meta.get("input_top_logprobs_idx_flat")
    for name, arr in (("val_flat", vals), ("idx_flat", idx)):
        if not isinstance(arr, list):
            raise MalformedResponseError(f"meta_info.input_top_logprobs_{name} is missing")
        if len(arr) != rows * k:
            raise MisalignedResponseError(
                f"meta_info.input_top_logprobs_{name} holds {len(arr)} values, expected {rows * k}"
            )
    assert isinstance(vals, list)
    assert isinstance(idx, list)
    start = (rows - n_rows) * k
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for r in range(n_rows):
        at = start + r * k
        where = f"input_top_logprobs row {r + 1}"
        pairs = [_entry([vals[at + j], idx[at + j]], where) for j in range(k)]
        ids.append([p[0] for p in pairs])
        lps.append([p[1] for p in pairs])
    return ids, lps


def _check_not_aborted(meta: Mapping[str, Any]) -> None:
    reason = meta.get("finish_reason")
    if isinstance(reason, Mapping) and reason.get("type") == "abort":
        detail = reason.get("message")
        raise ServerAbortError(
            "SGLang aborted the request (finish_reason=abort"
            + (f": {str(detail)[:200]}" if detail else "")
            + "); there are no logprobs to read"
        )


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
        ServerAbortError: the answer's ``finish_reason`` is ``abort`` (the message says
            ``finish_reason=abort``).

    Top-k is read from the nested ``input_top_logprobs``, or the flat fields
    (``return_flat_raw_top_logprobs``, with or without ``_b64``). A ``null`` or NaN logprob
    is ``-inf`` in every form (SGLang writes NaN as ``null``).
    """
    k = check_k(num_prompt_logprobs)
    _check_not_aborted(meta_info)
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
        ids, lps = _b64_topk_as_lists(meta_info, k, n_rows)
    elif meta_info.get("input_top_logprobs_val_flat") is not None:
        ids, lps = _plain_flat_topk(meta_info, k, n_rows)
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
