"""The teachers of the ``--teacher`` flags (``score`` and ``probe``): :func:`flag_teachers`.

Each flag is a ``NAME=URL`` entry or, without a name, a value of the teacher ``default``,
spelled as in ``OPD_STREAM_TEACHERS``: a URL, replicas joined with ``|``, or a weighted
ensemble ``W*URLS;W*URLS``. Several flags without a name are replicas of ``default``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import ConfigError
from ..fleet._ensemble import is_ensemble_text
from ..fleet._router import DEFAULT_TEACHER, Teacher, normalize_teachers

__all__ = ("flag_teachers",)


def flag_teachers(entries: Sequence[str]) -> dict[str, Teacher]:
    """The teachers that the ``--teacher`` flags ``entries`` name.

    Raises:
        ConfigError: a bad entry, name, URL or ensemble; an ensemble given with other
            values of ``default``.
    """
    values = [entry.strip() for entry in entries]
    plain = [v for v in values if _is_plain(v)]
    if len(values) == 1 and plain:
        # one value of the teacher 'default': a URL, replicas or an ensemble
        return normalize_teachers({DEFAULT_TEACHER: values[0]})
    if len(values) > 1 and any(is_ensemble_text(v) for v in plain):
        raise ConfigError(
            "an ensemble (W*URLS;W*URLS) is one --teacher value: give it alone, or name it "
            "(NAME=W*URLS;W*URLS)"
        )
    return normalize_teachers(values)


def _is_plain(value: str) -> bool:
    """A value without a name: a ``://`` comes before any ``=`` (as the router reads it)."""
    scheme_at = value.find("://")
    equals_at = value.find("=")
    return scheme_at >= 0 and (equals_at < 0 or scheme_at < equals_at)
