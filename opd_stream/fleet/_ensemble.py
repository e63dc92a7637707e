"""Weighted teacher ensembles: the members and their weights, and the configuration form.

An ensemble teacher is a probability-space mixture of member teachers (each a URL or a
replica group, all sharing the student's tokenizer) with weights ``w_i`` that sum to 1
(the mixture of their answers: :mod:`opd_stream.fetch._mixture`; docs/semantics.md,
"Teacher ensembles"). Configured as ``W*URLS;W*URLS...``
(``mix=0.7*http://a:1|http://a:2;0.3*http://b:1``), or in Python as a member map or an
:class:`Ensemble`. The form in full: ``docs/design-notes.md``,
"opd_stream/fleet/_ensemble.py".
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .._errors import ConfigError

__all__ = (
    "WEIGHT_SUM_TOLERANCE",
    "Ensemble",
    "ensemble_from_mapping",
    "is_ensemble_text",
    "parse_ensemble",
)

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
