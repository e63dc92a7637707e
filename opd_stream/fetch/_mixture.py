"""The mixture of an ensemble's answers (sans-IO), for the fetch plan that asks its members
(:meth:`~opd_stream.fetch._fetcher.SampleFetcher._teacher`); the ensemble itself, its
members and weights: :mod:`opd_stream.fleet._ensemble`.

The ensemble's logprob of a token is ``log sum_i w_i exp(t_i(v))``, in float64 from the
members' float32 answers, rounded once to float32 (docs/semantics.md, "Teacher ensembles").
A sampled token or a given id is asked of every member; the teacher's top-k ``T`` is the
``k`` ids of the union ``U`` of the members' top-k with the highest mixture logprob (ties:
the earlier in ``U``): the mixture's top-k over ``U``, not over the vocabulary. In full:
``docs/design-notes.md``, "opd_stream/fetch/_mixture.py".
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from .._errors import OPDStreamError, WeightVersionChanged
from ..fleet._ensemble import Ensemble
from ..wire._answers import ScoreRows

__all__ = (
    "member_error",
    "mix_logprobs",
    "mixed_rows",
    "mixture_topk",
    "present",
    "union_ids",
)

_T = TypeVar("_T")


def member_error(exc: OPDStreamError, member: str) -> OPDStreamError:
    """A copy of ``exc`` (same type, reason and attributes) whose message starts with the
    ensemble member that failed: ``ensemble member 2 of 3 (URLS): <message>``. (A
    :class:`WeightVersionChanged`, whose message is made from its attributes, gets the
    member as its ``member``.)"""
    named = copy.copy(exc)
    if isinstance(named, WeightVersionChanged):
        if named.member is None:
            named.member = member
    else:
        named.args = (f"ensemble {member}: {exc}",)
    return named


def mix_logprobs(
    parts: Sequence[npt.NDArray[np.floating[Any]]], weights: Sequence[float]
) -> npt.NDArray[np.float32]:
    """``log sum_i w_i exp(x_i)`` elementwise, in float64, rounded once to float32.

    ``-inf`` (probability 0) is a value: it adds nothing, and all ``-inf`` gives ``-inf``.
    NaN (missing) in any member gives NaN (a partial mixture is not the teacher's value).
    """
    x = np.stack([np.asarray(p, dtype=np.float64) for p in parts])
    w = np.asarray(weights, dtype=np.float64).reshape((-1,) + (1,) * (x.ndim - 1))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        top = np.max(x, axis=0)  # NaN where any member is NaN
        shift = np.where(np.isfinite(top), top, 0.0)
        total = np.sum(w * np.exp(x - shift), axis=0)
        out = shift + np.log(total)
    out = np.where(np.isnan(top), np.nan, out)
    return out.astype(np.float32)


def union_ids(tops: Sequence[npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
    """Per row, the distinct ids of the members' top-k rows (``[R, k_i]`` each), member 1's
    first, then each next member's new ones, in rank order; padded at the end with ``-1``
    to the width of the row with the most ids (at least the widest ``k_i``; at most
    ``sum k_i``). Negative ids (padding) are dropped.

    The width is the union's real one, not ``sum k_i``: the union is sent to the members
    with its padding replaced by the smallest ids absent from the row
    (:func:`~opd_stream._sample.request_ids`), which stay below the vocabulary size ``V``
    only when the row is at most ``V`` wide (members' top-k ids are distinct ids below
    ``V``, so a union row never holds more than ``V``; ``sum k_i`` may exceed it)."""
    joined = np.concatenate(tops, axis=1)
    w = joined.shape[1]
    if w == 0:
        return joined.astype(np.int64)
    col = np.arange(w)
    # stable sort by id keeps, of equal ids, the earliest column first
    order = np.argsort(joined, axis=1, kind="stable")
    srt = np.take_along_axis(joined, order, axis=1)
    dup_sorted = np.zeros_like(srt, dtype=bool)
    dup_sorted[:, 1:] = srt[:, 1:] == srt[:, :-1]
    drop = np.empty_like(dup_sorted)
    np.put_along_axis(drop, order, dup_sorted, axis=1)
    drop |= joined < 0
    keep_order = np.argsort(drop * w + col, axis=1, kind="stable")
    out = np.take_along_axis(joined, keep_order, axis=1)
    out[np.take_along_axis(drop, keep_order, axis=1)] = -1
    most = int((~drop).sum(axis=1).max()) if joined.shape[0] else 0
    width = max(most, max(t.shape[1] for t in tops))
    return np.ascontiguousarray(out[:, :width], dtype=np.int64)


def mixture_topk(
    ids: npt.NDArray[np.int64], lps: npt.NDArray[np.float32], k: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """The ``k`` ids of each row of ``ids`` (``-1``: padding) with the highest ``lps``,
    best first (ties: the earlier column); a NaN value ranks last but is kept."""
    rank = np.where((ids < 0) | np.isnan(lps), -np.inf, lps.astype(np.float64))
    # padding after every real id, even one of probability 0 (-inf)
    key = np.stack([np.where(ids < 0, 1, 0), -rank], axis=0)
    order = np.lexsort((np.arange(ids.shape[1])[None, :].repeat(ids.shape[0], 0), key[1], key[0]))
    top = order[:, :k]
    return (
        np.ascontiguousarray(np.take_along_axis(ids, top, axis=1), dtype=np.int64),
        np.ascontiguousarray(np.take_along_axis(lps, top, axis=1), dtype=np.float32),
    )


def present(value: _T | None, name: str) -> _T:
    """``value``, which every member's answer to the same request has (a bug otherwise)."""
    if value is None:
        raise AssertionError(f"an ensemble member's answer lacks {name}")
    return value


def mixed_rows(
    ensemble: Ensemble,
    answers: Sequence[ScoreRows],
    top: tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None,
) -> ScoreRows:
    """The ensemble's answer from its members' (in member order): the mixture of every
    member's sampled-token and requested-id logprobs, and ``top`` as its top-k (see
    :func:`mixture_topk`; None: no top-k was asked). ``weight_version`` is the members'
    when they all agree, else None."""
    first = answers[0]
    weights = ensemble.weights
    id_lps = None
    if first.id_logprobs is not None:
        id_lps = mix_logprobs([present(a.id_logprobs, "id_logprobs") for a in answers], weights)
    versions = {a.weight_version for a in answers}
    return ScoreRows(
        token_ids=first.token_ids,
        token_logprobs=mix_logprobs([a.token_logprobs for a in answers], weights),
        top_ids=None if top is None else top[0],
        top_logprobs=None if top is None else top[1],
        id_logprobs=id_lps,
        used_b64=any(a.used_b64 for a in answers),
        weight_version=versions.pop() if len(versions) == 1 else None,
    )
