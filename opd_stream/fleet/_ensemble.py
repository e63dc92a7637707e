"""Weighted teacher ensembles: the configuration form, and the sans-IO mixture of the
members' answers.

An ensemble teacher is a probability-space mixture of member teachers (each a URL or a
replica group, all sharing the student's tokenizer) with weights ``w_i`` that sum to 1. Its
logprob of a token is ``log sum_i w_i exp(t_i(v))``, computed in float64 (log-sum-exp) from
the members' float32 answers and rounded once to float32 (docs/semantics.md, "Teacher
ensembles").

Configuration (``OPD_STREAM_TEACHERS``, ``--teacher``, ``--opd-teacher-urls``): a teacher's
value ``W*URLS;W*URLS...``: members separated by ``;``, each a weight, ``*``, and its URL or
replicas joined with ``|`` (so ``|`` keeps its meaning inside a member):
``mix=0.7*http://a:1|http://a:2;0.3*http://b:1``. A value is an ensemble when it starts with
a weight and ``*``; any other value is a URL (or replicas), as before. In Python a member
map ``{"http://a:1|http://a:2": 0.7, "http://b:1": 0.3}`` or an :class:`Ensemble` works too.

The candidate set's teacher side (what the members' answers must cover):

* the teacher's logprob of a sampled token or of a given id (the student's top-k ``S``) is
  the mixture of every member's logprob of it: each member is asked for the same ids;
* the teacher's top-k ``T`` is chosen among the union ``U`` of the members' top-k ids: each
  member is asked for its top-k, then (with two members or more) scores every id of ``U``,
  and ``T`` is the ``k`` ids of ``U`` with the highest mixture logprob (ties: the earlier in
  ``U``, which lists member 1's top-k, then member 2's new ids, ...). A token outside every
  member's top-k is never in ``T``, though it may be in the true mixture's top-k (a token
  second everywhere can beat tokens first in one member only): ``T`` is the mixture's top-k
  over ``U``, not over the vocabulary.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import ConfigError, OPDStreamError, WeightVersionChanged
from ..wire._answers import ScoreRows

__all__ = (
    "WEIGHT_SUM_TOLERANCE",
    "Ensemble",
    "ensemble_from_mapping",
    "is_ensemble_text",
    "member_error",
    "mix_logprobs",
    "mixed_rows",
    "mixture_topk",
    "parse_ensemble",
    "present",
    "union_ids",
)

_T = TypeVar("_T")

WEIGHT_SUM_TOLERANCE = 1e-6
"""How far from 1 the weights' sum may be (they are then divided by it)."""

_WEIGHT_PREFIX = re.compile(r"^\s*([+-]?(?:[0-9][0-9.eE+-]*|\.[0-9][0-9eE+-]*))\s*\*")


class Ensemble(msgspec.Struct, frozen=True):
    """A teacher that is a weighted mixture of member teachers.

    Attributes:
        members: each member's replica base URLs (normalised), in configuration order.
        weights: each member's weight (> 0; they sum to 1).
    """

    members: tuple[tuple[str, ...], ...]
    weights: tuple[float, ...]

    @property
    def urls(self) -> tuple[str, ...]:
        """Every member's URLs, in order."""
        return tuple(url for member in self.members for url in member)

    def spec(self) -> str:
        """The ``W*URLS;W*URLS`` spelling (what ``to_log_dict`` shows; weights exact)."""
        return ";".join(
            f"{w!r}*{'|'.join(urls)}" for w, urls in zip(self.weights, self.members, strict=True)
        )

    def member_name(self, index: int) -> str:
        """How messages name member ``index`` (0-based): ``member 2 of 3 (URLS)``, each URL
        without its query string (which a proxy may use for a token)."""
        urls = "|".join(url.partition("?")[0] for url in self.members[index])
        return f"member {index + 1} of {len(self.members)} ({urls})"


def is_ensemble_text(text: str) -> bool:
    """``text`` (a teacher's value) is an ensemble: it starts with a weight and ``*``."""
    return _WEIGHT_PREFIX.match(text) is not None


def _weight(text: str, who: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{who}: weight {text.strip()!r} is not a number") from None
    return value


def _checked(
    who: str, pairs: Sequence[tuple[float, Sequence[str]]], normalise_urls: Any
) -> Ensemble:
    """An :class:`Ensemble` from ``(weight, replica URLs)`` pairs, every rule checked."""
    if not pairs:
        raise ConfigError(f"{who}: an ensemble needs at least one member")
    members: list[tuple[str, ...]] = []
    weights: list[float] = []
    seen: set[str] = set()
    for i, (weight, urls) in enumerate(pairs, start=1):
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ConfigError(f"{who} member {i}: weight must be a number")
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"{who} member {i}: weight must be finite and > 0, got {weight!r}")
        replicas = normalise_urls(f"{who} member {i}", urls)
        for url in replicas:
            if url in seen:
                raise ConfigError(
                    f"{who}: URL {url!r} is in two members (a member is a URL or a replica "
                    "group; give each server to one member)"
                )
            seen.add(url)
        members.append(replicas)
        weights.append(float(weight))
    total = math.fsum(weights)
    if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
        shown = " + ".join(f"{w:g}" for w in weights)
        raise ConfigError(f"{who}: ensemble weights must sum to 1, got {shown} = {total:g}")
    return Ensemble(tuple(members), tuple(w / total for w in weights))


def parse_ensemble(who: str, text: str, normalise_urls: Any) -> Ensemble:
    """Parse ``W*URLS;W*URLS...`` (see the module doc).

    Args:
        who: how messages name the teacher (``teacher 'mix'``).
        text: the value.
        normalise_urls: ``(who, urls) -> tuple of normalised URLs`` (the router's replica
            check), given a member's URLs split on ``|``.

    Raises:
        ConfigError: a member without ``W*``, a weight that is not a positive finite
            number, weights that do not sum to 1, a URL in two members, a bad URL.
    """
    pairs: list[tuple[float, list[str]]] = []
    for i, part in enumerate(text.split(";"), start=1):
        match = _WEIGHT_PREFIX.match(part)
        if match is None:
            raise ConfigError(
                f"{who} member {i}: expected WEIGHT*URL (an ensemble's members are "
                "W*URLS joined with ';', replicas of a member joined with '|')"
            )
        weight = _weight(match.group(1), f"{who} member {i}")
        pairs.append((weight, part[match.end() :].split("|")))
    return _checked(who, pairs, normalise_urls)


def ensemble_from_mapping(who: str, value: Any, normalise_urls: Any) -> Ensemble:
    """An ensemble given as ``{URLS: weight}`` (URLS a URL, replicas joined with ``|``, or a
    tuple of replica URLs) or as an :class:`Ensemble` (checked again)."""
    if isinstance(value, Ensemble):
        pairs = list(zip(value.weights, value.members, strict=True))
        return _checked(who, pairs, normalise_urls)
    assert isinstance(value, Mapping)
    items: list[tuple[float, Sequence[str]]] = []
    for urls, weight in value.items():
        if isinstance(urls, str):
            items.append((weight, urls.split("|")))
        elif isinstance(urls, tuple):
            items.append((weight, urls))
        else:
            raise ConfigError(
                f"{who}: an ensemble member is a URL or a tuple of replica URLs, "
                f"got {type(urls).__name__}"
            )
    return _checked(who, items, normalise_urls)


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


# ------------------------------------------------------------------------- the mixture


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
