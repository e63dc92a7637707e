"""TRL's ``get_sequence_logprobs`` contract, sans IO: the checks of a call's arguments and
one sequence's result lists built from the teacher's :class:`~opd_stream.wire.ScoreRows`.

Per sequence, one row per position ``prompt_length .. len(sequence) - 1`` (row ``t``
predicts ``sequence[prompt_length + t]``): ``logprobs`` / ``logprob_token_ids``
``[R][top_logprobs]``, the teacher's top entries best first, padded with ``-inf`` / id 0;
``actual_logprobs`` / ``actual_token_ids`` ``[R][1]``, the actual token. As TRL's own
client (vLLM's JSON) gives them, a real ``-inf`` logprob is ``-9999.0`` and only padding is
``-inf``; position 0 (no context) is a padding row with an actual logprob of ``-inf``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ..._errors import ConfigError, InvalidSampleError
from ...wire._answers import ScoreRows

__all__ = (
    "KEYS",
    "PAD_ID",
    "VLLM_NEG_INF",
    "check_batch",
    "check_temperature",
    "check_top_logprobs",
    "sequence_result",
    "sequence_tokens",
)

KEYS: Final = ("logprobs", "logprob_token_ids", "actual_logprobs", "actual_token_ids")
"""The result's keys, in TRL's order."""

VLLM_NEG_INF: Final = -9999.0
"""vLLM's JSON spelling of a ``-inf`` logprob (``clamp_prompt_logprobs``), which TRL's
client passes on to the trainer."""

PAD_ID: Final = 0
"""The id TRL pads ``logprob_token_ids`` with (its logprob: ``-inf``)."""


def check_temperature(temperature: Any) -> None:
    """Refuse any ``temperature`` but 1.0.

    Raises:
        ConfigError: (a ``ValueError``) the temperature is not 1.0, saying why.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise ConfigError(f"temperature must be a number, got {type(temperature).__name__}")
    if float(temperature) != 1.0:
        raise ConfigError(
            f"temperature={temperature!r}: the teacher's logprobs cannot be taken at a "
            "temperature. vLLM 0.34 computes prompt logprobs from the raw logits whatever "
            "the request's temperature (it only shapes the one generated token), so TRL's own "
            "client returns temperature-1 values while TRL's trainer divides the student's "
            "logits by the temperature: the loss would compare a tempered student with an "
            "untempered teacher. Train with temperature=1.0 for the teacher-server loss"
        )


def check_top_logprobs(top_logprobs: Any) -> int:
    """``top_logprobs`` as an int >= 0.

    Raises:
        ConfigError: not an integer, or negative.
    """
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, numbers.Integral):
        raise ConfigError(
            f"top_logprobs must be an integer >= 0, got {type(top_logprobs).__name__}"
        )
    k = int(top_logprobs)
    if k < 0:
        raise ConfigError(f"top_logprobs must be an integer >= 0, got {k}")
    return k


def check_batch(sequences: Sequence[Any], prompt_lengths: Sequence[Any]) -> list[int]:
    """The prompt lengths as ints, once the batch's shape is checked.

    Raises:
        ValueError: ``sequences`` and ``prompt_lengths`` differ in length (as TRL's
            ``zip(..., strict=True)``).
        InvalidSampleError: a prompt length that is not an integer in ``[0, len(sequence)]``,
            or an empty sequence; the message names the sequence's index.
    """
    if len(sequences) != len(prompt_lengths):
        raise ValueError(
            f"{len(sequences)} sequences but {len(prompt_lengths)} prompt_lengths: "
            "give one prompt length per sequence"
        )
    out: list[int] = []
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        if isinstance(p, bool) or not isinstance(p, numbers.Integral):
            raise InvalidSampleError(
                "prompt_lengths", f"[{i}] must be an integer, got {type(p).__name__}"
            )
        n = len(seq)
        if n == 0:
            raise InvalidSampleError("sequences", f"[{i}] is empty (prompt + completion ids)")
        if not 0 <= int(p) <= n:
            raise InvalidSampleError(
                "prompt_lengths", f"[{i}] = {int(p)}, outside [0, {n}] (the sequence's length)"
            )
        out.append(int(p))
    return out


def sequence_tokens(sequence: Any, index: int) -> npt.NDArray[np.int64]:
    """One sequence's ids as int64 ``[L]``.

    Raises:
        InvalidSampleError: the sequence holds something other than integers (a float, a
            bool, an id beyond int64), naming its index: never rounded silently.
    """
    arr = np.asarray(sequence)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):
        what = f"{arr.ndim}-d" if arr.ndim != 1 else f"{arr.dtype} values"
        raise InvalidSampleError(
            "sequences", f"[{index}] must be a list of integer token ids, got {what}"
        )
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidSampleError("sequences", f"[{index}] holds an id beyond int64")
    return arr.astype(np.int64, copy=False)


def _tolist_2d(a: npt.NDArray[Any]) -> list[list[Any]]:
    rows: list[list[Any]] = a.tolist()
    return rows


def _actual_ids(
    tokens: npt.NDArray[np.int64], prompt_length: int, sequence: Sequence[Any] | None
) -> list[list[Any]]:
    if isinstance(sequence, (list, tuple)):
        return [[x] for x in sequence[prompt_length:]]
    return _tolist_2d(tokens[prompt_length:, None])


def sequence_result(
    rows: ScoreRows | None,
    tokens: npt.NDArray[np.int64],
    prompt_length: int,
    top_logprobs: int,
    sequence: Sequence[Any] | None = None,
) -> dict[str, list[Any]]:
    """One sequence's result in TRL's contract (see the module's docstring).

    Args:
        rows: the teacher's rows for positions ``max(prompt_length, 1) ..``; ``None`` when
            there are none (an empty completion, or a one-token sequence from position 0).
        tokens: the sequence's ids (int64 ``[L]``).
        sequence: the caller's own sequence (``tokens`` as given): a list or tuple gives
            ``actual_token_ids`` its own id objects, as TRL's client does
            (``[sequence[p]]``), not new ints.
        prompt_length: TRL's ``prompt_length`` (``0 <= prompt_length <= L``).
        top_logprobs: TRL's ``top_logprobs`` (the rows' top-k width when > 0).
    """
    n_rows = len(tokens) - prompt_length
    k = top_logprobs
    lead = 1 if prompt_length == 0 and n_rows > 0 else 0  # position 0: no context
    body = n_rows - lead
    values = np.full((n_rows, k), -math.inf, np.float64)
    ids = np.full((n_rows, k), PAD_ID, np.int64)
    actual = np.full((n_rows, 1), -math.inf, np.float64)
    if body:
        if rows is None or rows.token_logprobs.shape[0] != body:
            got = 0 if rows is None else rows.token_logprobs.shape[0]
            raise AssertionError(f"teacher rows: {got}, expected {body}")
        lp = rows.token_logprobs.astype(np.float64)
        actual[lead:, 0] = np.where(np.isneginf(lp), VLLM_NEG_INF, lp)
        if k:
            assert rows.top_ids is not None
            assert rows.top_logprobs is not None
            width = min(k, rows.top_ids.shape[1])
            top_ids = rows.top_ids[:, :width]
            top_lp = rows.top_logprobs[:, :width].astype(np.float64)
            real = top_ids >= 0
            values[lead:, :width] = np.where(
                real, np.where(np.isneginf(top_lp), VLLM_NEG_INF, top_lp), -math.inf
            )
            ids[lead:, :width] = np.where(real, top_ids, PAD_ID)
    return {
        "logprobs": _tolist_2d(values),
        "logprob_token_ids": _tolist_2d(ids),
        "actual_logprobs": _tolist_2d(actual),
        "actual_token_ids": _actual_ids(tokens, prompt_length, sequence),
    }
