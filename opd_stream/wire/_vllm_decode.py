"""vLLM answers into :class:`~opd_stream.wire._answers.ScoreRows` (same dtypes and meaning as the
SGLang decoders'), checked as strictly (vLLM 0.34.0; the bodies: :mod:`opd_stream.wire._vllm`).

``"vllm"``: ``prompt_token_id_logprobs`` (read by :func:`opd_stream.wire._npy.read_npy_f32`)
and ``prompt_logprobs`` (the top-k), one answer per chunk of columns, stitched here;
``"vllm-completions"``: ``choices[0].prompt_logprobs``. Every row's dict is checked for its
count (``top_k`` or ``top_k + 1``), the actual token and top-k ranks exactly ``1..top_k``;
vLLM's ``-9999.0`` is read as ``-inf``. Messages name the field and position, never a
payload value. The fields in full: ``docs/design-notes.md``,
"opd_stream/wire/_vllm_decode.py".
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import attrgetter
from typing import TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import (
    CapabilityError,
    MalformedResponseError,
    MisalignedResponseError,
    ServerAbortError,
)
from ._answers import Body, ScoreRows, total_cached
from ._checks import missing_field, one_weight_version, to_logprobs
from ._entries import decode_error, too_deep
from ._npy import read_npy_f32
from ._request import Layout, ScoreRequest, column_chunks
from ._vllm import sends_id_columns

__all__ = ("VLLM_NEG_INF", "decode_vllm")

#: vLLM's JSON spelling of ``-inf`` in ``prompt_logprobs`` (``clamp_prompt_logprobs``).
VLLM_NEG_INF = -9999.0


class _Logprob(msgspec.Struct, gc=False, frozen=True):
    logprob: float
    rank: int  # always set in prompt logprobs; decoded_token is skipped unparsed


class _Span(msgspec.Struct, gc=False, frozen=True):
    version: str
    start: int
    end: int


class _Choice(msgspec.Struct, gc=False, frozen=True):
    finish_reason: str | None = None
    weight_versions: list[_Span] | None = None
    prompt_logprobs: list[msgspec.Raw] | None = None  # completions: decoded row range only
    prompt_token_ids: list[int] | None = None


class _Details(msgspec.Struct, gc=False, frozen=True):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct, gc=False, frozen=True):
    prompt_tokens_details: _Details | None = None


_Row = dict[int, _Logprob] | None


class _ScaleOut(msgspec.Struct, gc=False, frozen=True):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    prompt_logprobs: list[_Row] | None = None
    prompt_token_id_logprobs: bytes | None = None  # base64 in JSON: msgspec decodes it
    prompt_token_ids: list[int] | None = None


class _Completions(msgspec.Struct, gc=False, frozen=True):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None


_SCALE_OUT = msgspec.json.Decoder(_ScaleOut)
_COMPLETIONS = msgspec.json.Decoder(_Completions)
_ROWS = msgspec.json.Decoder(list[_Row])
_T = TypeVar("_T")
_LP = attrgetter("logprob")
_RANK = attrgetter("rank")


def decode_vllm(answer: Body | Sequence[Body], req: ScoreRequest, lay: Layout) -> ScoreRows:
    """The answer(s) to :func:`~opd_stream.wire._vllm.build_vllm_bodies` (in order), checked.

    Raises:
        MalformedResponseError: not JSON, wrong types, a missing field, a bad ``.npy``.
        MisalignedResponseError: rows, shapes, echoed ids, top-k counts or ranks differ
            from the request.
        ServerAbortError: ``finish_reason`` ``"abort"``.
        CapabilityError: ``"vllm_token_id_logprobs"``: a scale-out answer without
            ``prompt_token_id_logprobs`` (a vLLM older than 0.34.0 ignores the request field).
        WeightVersionChanged: the chunks of one request report different weight versions.
    """
    bodies = [answer] if isinstance(answer, Body) else list(answer)
    if req.engine == "vllm-completions":
        if len(bodies) != 1:
            raise ValueError(f"{len(bodies)} answers for 1 completions request")
        return _decode_completions(bodies[0], req, lay)
    chunks = column_chunks(req)
    if len(bodies) != len(chunks):
        raise ValueError(f"{len(bodies)} answers for {len(chunks)} column chunks")
    with_columns = sends_id_columns(req)
    parts, versions, cached = [], [], []
    top: tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None = None
    token_lp: npt.NDArray[np.float32] | None = None
    for n, (body, (lo, hi)) in enumerate(zip(bodies, chunks, strict=True)):
        where = "$" if len(bodies) == 1 else f"$<chunk {n}>"
        got = _decode(_SCALE_OUT, body)
        choice = _one_choice(got.choices, where, exact=False)
        versions.append(_weight_version(choice))
        cached.append(_cached(got.usage))
        _check_echo(got.prompt_token_ids, lay, f"{where}.prompt_token_ids")
        if with_columns:
            parts.append(_id_columns(got.prompt_token_id_logprobs, lay, hi - lo, where))
        if n == 0 and req.top_k > 0:
            rows = got.prompt_logprobs
            field = f"{where}.prompt_logprobs"
            if rows is None:
                raise missing_field(field)
            top_ids, top_lp, token_lp = _top_k(
                _scored_rows(rows, lay, field), lay, req.top_k, field
            )
            top = (top_ids, top_lp)
    id_lp = None
    if parts:  # the sampled token's logprob from column 0 (from the dicts otherwise)
        values = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        field = "$.prompt_token_id_logprobs"
        token_lp = to_logprobs(values[:, 0], field)
        id_lp = to_logprobs(values[:, 1:], field) if req.ids is not None else None
    assert token_lp is not None  # columns are sent unless the top-k's dicts are read
    return _rows(lay, token_lp, top, id_lp, one_weight_version(versions), total_cached(cached))


def _id_columns(raw: bytes | None, lay: Layout, cols: int, where: str) -> npt.NDArray[np.float32]:
    """One answer's ``prompt_token_id_logprobs`` (``[R, cols]``), checked."""
    if raw is None:
        raise CapabilityError(
            "vllm_token_id_logprobs",
            f"the answer has no `{where}.prompt_token_id_logprobs`: the server ignored "
            "prompt_logprob_token_ids (vLLM 0.34.0 or newer scores chosen ids)",
        )
    return read_npy_f32(raw, (lay.segments[0].rows, cols), f"{where}.prompt_token_id_logprobs")


def _decode_completions(body: Body, req: ScoreRequest, lay: Layout) -> ScoreRows:
    got = _decode(_COMPLETIONS, body)
    choice = _one_choice(got.choices, "$", exact=True)
    field = "$.choices[0].prompt_logprobs"
    raws = choice.prompt_logprobs
    if raws is None:
        raise missing_field(field)
    _check_echo(choice.prompt_token_ids, lay, "$.choices[0].prompt_token_ids")
    length, p = lay.tokens.shape[0], lay.prompt_length
    if len(raws) != length:
        raise MisalignedResponseError(
            f"`{field}` has {len(raws)} entries, expected {length} (one per prompt token)"
        )
    # only the response rows are decoded into objects (the prompt's stay raw bytes)
    joined = b"[" + b",".join(raws[p:]) + b"]"
    rows = _decode(_ROWS, joined)
    top_ids, top_lp, token_lp = _top_k(rows, lay, req.top_k, field)
    top = (top_ids, top_lp) if req.top_k > 0 else None
    return _rows(lay, token_lp, top, None, _weight_version(choice), _cached(got.usage))


def _rows(
    lay: Layout,
    token_lp: npt.NDArray[np.float32],
    top: tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None,
    id_lp: npt.NDArray[np.float32] | None,
    version: str | None,
    cached: int | None,
) -> ScoreRows:
    return ScoreRows(
        token_ids=np.array(lay.tokens[lay.prompt_length :], dtype=np.int64),
        token_logprobs=token_lp,
        top_ids=None if top is None else top[0],
        top_logprobs=None if top is None else top[1],
        id_logprobs=id_lp,
        used_b64=False,
        weight_version=version,
        cached_tokens=cached,
    )


def _decode(decoder: msgspec.json.Decoder[_T], body: Body) -> _T:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise decode_error(exc) from None
    except RecursionError:
        raise too_deep() from None


def _one_choice(choices: list[_Choice] | None, where: str, *, exact: bool) -> _Choice:
    """``choices[0]`` (there must be exactly one where ``exact``), not aborted."""
    field = f"{where}.choices"
    if choices is None:
        raise missing_field(field)
    if not choices or (exact and len(choices) != 1):
        raise MisalignedResponseError(f"`{field}` has {len(choices)} entries, expected 1")
    choice = choices[0]
    if choice.finish_reason == "abort":
        raise ServerAbortError(f"server aborted the request (`{field}[0].finish_reason`)")
    return choice


def _weight_version(choice: _Choice) -> str | None:
    """The version of the span that covers output token 0, else ``None``."""
    for span in choice.weight_versions or ():
        if span.start <= 0 < span.end:
            return span.version
    return None


def _cached(usage: _Usage | None) -> int | None:
    details = None if usage is None else usage.prompt_tokens_details
    return None if details is None else details.cached_tokens


def _check_echo(echoed: list[int] | None, lay: Layout, field: str) -> None:
    """An echoed ``prompt_token_ids`` (where the server sent one) must be the tokens sent."""
    if echoed is None:
        return
    tokens = lay.tokens
    if len(echoed) != tokens.shape[0]:
        raise MisalignedResponseError(
            f"`{field}` has {len(echoed)} ids, expected the {tokens.shape[0]} sent"
        )
    bad = np.flatnonzero(np.asarray(echoed, dtype=np.int64) != tokens)
    if bad.size:
        raise MisalignedResponseError(
            f"`{field}`: the token id at absolute position {int(bad[0])} differs from the one sent"
        )


def _scored_rows(rows: list[_Row], lay: Layout, field: str) -> list[_Row]:
    """The ``R`` response rows of a scale-out ``prompt_logprobs`` (``L`` entries)."""
    length = lay.tokens.shape[0]
    if len(rows) != length:
        raise MisalignedResponseError(
            f"`{field}` has {len(rows)} entries, expected {length} (one per prompt token)"
        )
    return rows[lay.prompt_length :]


def _top_k(
    rows: list[_Row], lay: Layout, top_k: int, field: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """The top-k (ids, logprobs, best first) and the actual tokens' logprobs of the
    response rows' dicts, every row checked (see the module docstring)."""
    p = lay.prompt_length
    r = len(rows)
    if None in rows:
        t = rows.index(None)
        raise MisalignedResponseError(
            f"`{field}` has no row for absolute position {p + t} (response position {t})"
        )
    counts = np.fromiter(map(len, rows), dtype=np.intp, count=r)  # type: ignore[arg-type]
    bad = np.flatnonzero((counts != top_k) & (counts != top_k + 1))
    if bad.size:
        t = int(bad[0])
        raise MisalignedResponseError(
            f"`{field}` row for absolute position {p + t} (response position {t}) has "
            f"{int(counts[t])} entries, expected {top_k} (top-k) or {top_k + 1} "
            "(top-k and the actual token)"
        )
    total = int(counts.sum())
    entries = list(chain.from_iterable(map(dict.values, rows)))  # type: ignore[arg-type]
    keys = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=total)  # type: ignore[arg-type]
    lps = np.fromiter(map(_LP, entries), dtype=np.float64, count=total)
    ranks = np.fromiter(map(_RANK, entries), dtype=np.int64, count=total)
    row_of = np.repeat(np.arange(r), counts)
    is_actual = keys == lay.tokens[p:][row_of]
    missing = np.flatnonzero(np.bincount(row_of[is_actual], minlength=r) != 1)
    if missing.size:
        t = int(missing[0])
        raise MisalignedResponseError(
            f"`{field}` row for absolute position {p + t} (response position {t}) lacks the "
            "actual token (the token sent there)"
        )
    lps[lps == VLLM_NEG_INF] = -np.inf
    token_lp = to_logprobs(lps[is_actual], field)
    in_top = ~(is_actual & (counts == top_k + 1)[row_of])
    top_rank = ranks[in_top]
    order = np.argsort(row_of[in_top] * (top_k + 1) + np.clip(top_rank, 0, top_k), kind="stable")
    sorted_rank = top_rank[order].reshape(r, top_k)
    bad = np.flatnonzero((sorted_rank != np.arange(1, top_k + 1)).any(axis=1))
    if bad.size:
        t = int(bad[0])
        raise MisalignedResponseError(
            f"`{field}` row for absolute position {p + t} (response position {t}): the top-k "
            f"ranks are not 1..{top_k}"
        )
    top_ids = keys[in_top][order].reshape(r, top_k)
    if top_ids.size and int(top_ids.min()) < 0:
        raise MalformedResponseError(f"`{field}` top-k holds a negative token id")
    top_lp = to_logprobs(lps[in_top][order].reshape(r, top_k), field)
    return top_ids, top_lp, token_lp
