"""Teacher routing: server URL validation, ``NAME=URL`` parsing and per-sample teacher choice.

Semantics: ``docs/semantics.md``, "Teachers". A routing map is ``NAME=URL`` entries (split
on the first ``=``; replicas joined with ``|``; an ensemble as ``W*URLS;W*URLS...``);
without one there is one teacher, ``default``. Per sample the teacher is
``str(metadata[teacher_key])``; an unknown or missing name goes to ``default`` when there is
one, else raises :class:`RoutingError`. Everything is validated once, when
:class:`TeacherRouting` (or :class:`StreamConfig`) is built (:class:`ConfigError`); URLs
with ``user:password@`` are rejected. The rules in full: ``docs/design-notes.md``,
"opd_stream/fleet/_routing.py".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias
from urllib.parse import urlsplit

from .._errors import ConfigError, RoutingError
from ._ensemble import Ensemble, ensemble_from_mapping, is_ensemble_text, parse_ensemble

__all__ = (
    "DEFAULT_TEACHER",
    "Teacher",
    "TeacherRouting",
    "TeachersSpec",
    "endpoint_url",
    "generate_url",
    "normalize_server_url",
    "normalize_teachers",
    "parse_teacher_urls",
    "replica_groups",
    "show_value",
)

DEFAULT_TEACHER = "default"
"""The reserved teacher name that catches samples with an unknown or missing teacher name."""

TeachersSpec: TypeAlias = (
    str | Sequence[str] | Mapping[str, str | Sequence[str] | Mapping[str, float] | Ensemble]
)
"""Every accepted spelling of a teacher configuration (see :func:`normalize_teachers`)."""

Teacher: TypeAlias = tuple[str, ...] | Ensemble
"""One configured teacher: its replica base URLs, or an :class:`Ensemble` of members."""

_EXPECTED = "expected NAME=URL"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_MAX_VALUE_CHARS = 80


def _redact(url: str) -> str:
    """Return ``url`` for an error message, with anything that may be credentials masked.

    Whatever comes before the last ``@`` (after the ``scheme://``, if any) is replaced by
    ``***``, however malformed the URL: a password may hold ``/``, ``?``, ``#`` or ``@``,
    and a URL without a scheme has no clear authority. The host part after it is kept.
    """
    at = url.rfind("@")
    if at < 0:
        return url
    scheme = _SCHEME.match(url)
    head = scheme.group(0) if scheme else ""
    return f"{head}***{url[at:]}"


def _has_userinfo(url: str) -> bool:
    """``user:password@`` anywhere after the scheme, whatever the password holds."""
    scheme = _SCHEME.match(url)
    rest = url[scheme.end() if scheme else 0 :]
    at = rest.rfind("@")
    return at >= 0 and ("@" in urlsplit(url).netloc or ":" in rest[:at])


def normalize_server_url(url: str) -> str:
    """Validate one SGLang server URL and return its normalised base URL.

    A URL may name the server's base (``http://host:port``, optionally below a path prefix
    such as ``http://host/sglang``) or its ``/generate`` endpoint; both normalise to the
    base. The result has a lower-case scheme and host, no trailing slash and no
    ``/generate`` suffix. A query string is kept (``endpoint_url`` re-attaches it after the
    endpoint path); a fragment is rejected.

    Args:
        url: the URL as configured (surrounding whitespace is ignored).

    Returns:
        The base URL, e.g. ``http://h:30000`` or ``http://h/sglang?tag=a``.

    Raises:
        ConfigError: not a string; scheme other than ``http``/``https``; no host; an
            invalid port; a fragment; or credentials (``user:password@``) in the URL
            (they would leak into logs). The message never repeats credentials.
    """
    if not isinstance(url, str):
        raise ConfigError(f"server URL must be a string, got {type(url).__name__}")
    text = url.strip()
    if not text:
        raise ConfigError("server URL is empty")
    shown = _redact(text)
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # e.g. an unbalanced IPv6 bracket
        detail = "cannot be parsed" if "@" in text else str(exc)  # the error may quote it
        raise ConfigError(f"invalid server URL {shown!r}: {detail}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ConfigError(
            f"invalid server URL {shown!r}: scheme must be http or https "
            "(expected e.g. http://host:30000)"
        )
    if parts.username is not None or parts.password is not None or _has_userinfo(text):
        raise ConfigError(
            f"invalid server URL {shown!r}: credentials (user:password@) are not allowed "
            "in URLs; use api_key"
        )
    if not parts.hostname:
        raise ConfigError(f"invalid server URL {shown!r}: no host")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"invalid server URL {shown!r}: invalid port") from None
    if port == 0 or parts.netloc.endswith(":"):
        raise ConfigError(f"invalid server URL {shown!r}: invalid port")
    if parts.fragment or text.endswith("#"):
        raise ConfigError(f"invalid server URL {shown!r}: a fragment (#...) is not allowed")
    path = parts.path.rstrip("/")
    if path.endswith("/generate"):
        path = path[: -len("/generate")].rstrip("/")
    base = f"{scheme}://{parts.netloc.lower()}{path}"
    return f"{base}?{parts.query}" if parts.query else base


def endpoint_url(base: str, path: str) -> str:
    """Join a normalised base URL and an endpoint path, keeping the base's query string.

    ``endpoint_url("http://h/sglang?tag=a", "generate") == "http://h/sglang/generate?tag=a"``.

    Args:
        base: a URL returned by :func:`normalize_server_url`.
        path: the endpoint path (``"generate"``, ``"/health"``, ...); it carries no query.
    """
    head, sep, query = base.partition("?")
    url = f"{head.rstrip('/')}/{path.lstrip('/')}"
    return f"{url}?{query}" if sep else url


def generate_url(base: str) -> str:
    """Return the ``/generate`` endpoint of a normalised base URL (see :func:`endpoint_url`)."""
    return endpoint_url(base, "generate")


def _looks_like_url(text: str) -> bool:
    """True when ``text`` is a plain URL (a ``://`` before any ``=``), not a ``NAME=URL``."""
    scheme_at = text.find("://")
    equals_at = text.find("=")
    return scheme_at >= 0 and (equals_at < 0 or scheme_at < equals_at)


def _replicas(name: str, urls: Iterable[str], *, shown: str | None = None) -> tuple[str, ...]:
    """Normalise one teacher's replica URLs; empty or duplicate replicas are errors.

    ``shown`` is how messages name the teacher (default: ``repr(name)``).
    """
    who = repr(name) if shown is None else shown
    out: list[str] = []
    for raw in urls:
        if not isinstance(raw, str):
            raise ConfigError(f"teacher {who}: URL must be a string, got {type(raw).__name__}")
        if not raw.strip():
            raise ConfigError(f"teacher {who}: empty URL ({_EXPECTED})")
        try:
            url = normalize_server_url(raw)
        except ConfigError as exc:
            raise ConfigError(f"teacher {who}: {exc}") from None
        if url in out:
            raise ConfigError(f"teacher {who}: duplicate replica URL {url!r}")
        out.append(url)
    if not out:
        raise ConfigError(f"teacher {who}: no URL ({_EXPECTED})")
    return tuple(out)


def _member_replicas(who: str, urls: Iterable[str]) -> tuple[str, ...]:
    """An ensemble member's replicas (``who``, ``teacher 'mix' member 2``, names it)."""
    return _replicas("", urls, shown=who.removeprefix("teacher "))


def _teacher_value(name: str, text: str, *, shown: str | None = None) -> Teacher:
    """One teacher's text value: an ensemble (``W*URLS;...``) or replicas (``URL|URL``)."""
    who = repr(name) if shown is None else shown
    if is_ensemble_text(text):
        return parse_ensemble(f"teacher {who}", text, _member_replicas)
    return _replicas(name, text.split("|"), shown=shown)


def parse_teacher_urls(entries: Iterable[str] | str) -> dict[str, Teacher]:
    """Parse ``NAME=URL`` routing entries into ``{name: (replica base URLs, ...)}``.

    Each entry is split on its FIRST ``=``; the URL part may hold several replicas joined
    with ``|``, or be an ensemble, ``W*URLS;W*URLS...`` (an :class:`Ensemble`). Names and
    URLs are stripped of surrounding whitespace; every URL is normalised by
    :func:`normalize_server_url`.

    Args:
        entries: an iterable of entries, or one string holding comma-separated entries
            (in that form a URL cannot contain a comma).

    Returns:
        Teacher name -> tuple of normalised replica URLs, in entry order.

    Raises:
        ConfigError: an entry without ``=``, with an empty name or an empty URL
            ("expected NAME=URL"); a duplicate teacher name; an invalid URL.
    """
    items = entries.split(",") if isinstance(entries, str) else list(entries)
    teachers: dict[str, Teacher] = {}
    for index, entry in enumerate(items, start=1):
        if not isinstance(entry, str):
            raise ConfigError(f"teacher entry {index}: {_EXPECTED}, got {type(entry).__name__}")
        name, sep, urls = entry.partition("=")
        name = name.strip()
        # An entry with an '@' may be a URL with credentials cut at an '=' of its password:
        # its "name" is then not echoed either.
        shown = "'***'" if "@" in entry else repr(name)
        if not sep:
            raise ConfigError(f"teacher entry {index}: {_EXPECTED} (no '=')")
        if not name:
            raise ConfigError(f"teacher entry {index}: {_EXPECTED} (empty name)")
        if not urls.strip():
            raise ConfigError(f"teacher entry {index} ({shown}): {_EXPECTED} (empty URL)")
        if name in teachers:
            raise ConfigError(f"duplicate teacher name {shown} (entry {index})")
        teachers[name] = _teacher_value(name, urls, shown=shown)
    if not teachers:
        raise ConfigError(f"no teacher configured ({_EXPECTED})")
    return teachers


def normalize_teachers(spec: TeachersSpec) -> dict[str, Teacher]:
    """Normalise every accepted teacher spelling to ``{name: (replica base URLs, ...)}``,
    or ``{name: Ensemble}`` for an ensemble teacher.

    Accepted spellings:

    * a plain URL string, replicas joined with ``|`` (``"http://h1|http://h2"``), or an
      ensemble (``"0.5*http://a;0.5*http://b"``): one teacher named ``default``. A string
      is a plain URL when a ``://`` comes before any ``=``;
    * a string of comma-separated ``NAME=URL`` entries (:func:`parse_teacher_urls`);
    * a sequence of plain URLs (replicas of ``default``) or of ``NAME=URL`` entries (not
      a mixture);
    * a mapping of name to a URL string (replicas may be joined with ``|``, or an ensemble
      ``W*URLS;...``), a sequence of replica URLs, a member map ``{URLS: weight}`` or an
      :class:`Ensemble`.

    Raises:
        ConfigError: an empty configuration, a mixed sequence, a bad entry, name or URL,
            a bad ensemble (weights, members).
    """
    if isinstance(spec, str):
        if _looks_like_url(spec.strip()):
            return {DEFAULT_TEACHER: _teacher_value(DEFAULT_TEACHER, spec)}
        return parse_teacher_urls(spec)
    if isinstance(spec, Mapping):
        teachers: dict[str, Teacher] = {}
        for key, value in spec.items():
            if not isinstance(key, str) or not key.strip():
                raise ConfigError(f"teacher name must be a non-empty string, got {key!r}")
            name = key.strip()
            if name in teachers:
                raise ConfigError(f"duplicate teacher name {name!r}")
            if isinstance(value, Ensemble | Mapping):
                teachers[name] = ensemble_from_mapping(f"teacher {name!r}", value, _member_replicas)
                continue
            if isinstance(value, str):
                teachers[name] = _teacher_value(name, value)
                continue
            urls = value
            if not isinstance(urls, Sequence):
                raise ConfigError(
                    f"teacher {name!r}: expected a URL or a list of URLs, "
                    f"got {type(value).__name__}"
                )
            teachers[name] = _replicas(name, urls)
        if not teachers:
            raise ConfigError("no teacher configured (the mapping is empty)")
        return teachers
    if isinstance(spec, Sequence):
        entries = list(spec)
        if not entries:
            raise ConfigError(f"no teacher configured ({_EXPECTED})")
        if not all(isinstance(e, str) for e in entries):
            raise ConfigError("teacher list entries must be strings")
        plain = [_looks_like_url(e.strip()) for e in entries]
        if all(plain):
            return {DEFAULT_TEACHER: _replicas(DEFAULT_TEACHER, entries)}
        if any(plain):
            raise ConfigError("teacher list mixes plain URLs and NAME=URL entries; use one form")
        return parse_teacher_urls(entries)
    raise ConfigError(
        "teachers must be a URL, a list of URLs, NAME=URL entries or a mapping, "
        f"got {type(spec).__name__}"
    )


def replica_groups(teachers: Mapping[str, Teacher]) -> dict[str, tuple[str, ...]]:
    """Every group of replicas that must give the same numbers: each plain teacher's, and
    each ensemble member's (``NAME member I``, 1-based: the members are different models,
    so their numbers may differ). For a check across replicas (main's teacher probe)."""
    out: dict[str, tuple[str, ...]] = {}
    for name, teacher in teachers.items():
        if isinstance(teacher, Ensemble):
            for i, member in enumerate(teacher.members, start=1):
                out[f"{name} member {i}"] = member
        else:
            out[name] = teacher
    return out


def show_value(value: object) -> str:
    """``repr(str(value))`` for a message, cut to 80 characters (a teacher name from sample
    metadata may be anything)."""
    text = repr(str(value))
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 4] + "...'"
    return text


class TeacherRouting:
    """Chooses the teacher of each sample from its metadata (``docs/semantics.md``, "Teachers").

    Args:
        teachers: any spelling accepted by :func:`normalize_teachers`.
        teacher_key: the metadata key holding a sample's teacher name.

    Raises:
        ConfigError: the teacher configuration or ``teacher_key`` is invalid.
    """

    __slots__ = ("_teacher_key", "_teachers")

    def __init__(self, teachers: TeachersSpec, teacher_key: str = "opd_teacher") -> None:
        if not isinstance(teacher_key, str) or not teacher_key:
            raise ConfigError("teacher_key must be a non-empty string")
        self._teachers = normalize_teachers(teachers)
        self._teacher_key = teacher_key

    @property
    def teacher_key(self) -> str:
        """The metadata key that names a sample's teacher."""
        return self._teacher_key

    @property
    def names(self) -> tuple[str, ...]:
        """The configured teacher names, sorted."""
        return tuple(sorted(self._teachers))

    @property
    def teachers(self) -> dict[str, Teacher]:
        """A copy of the normalised map: teacher name -> replica base URLs (an
        :class:`Ensemble` for an ensemble teacher)."""
        return dict(self._teachers)

    def teacher(self, name: str) -> Teacher:
        """Return teacher ``name``: its replica base URLs, or its :class:`Ensemble`.

        Raises:
            RoutingError: ``name`` is not configured.
        """
        try:
            return self._teachers[name]
        except KeyError:
            raise RoutingError(
                f"unknown teacher {show_value(name)}; known teachers: {list(self.names)}"
            ) from None

    def urls(self, name: str) -> tuple[str, ...]:
        """Return the base URLs of teacher ``name`` (an ensemble's: every member's).

        Raises:
            RoutingError: ``name`` is not configured.
        """
        found = self.teacher(name)
        return found.urls if isinstance(found, Ensemble) else found

    def resolve(self, metadata: Mapping[str, Any] | None) -> str:
        """Return the teacher name for a sample with this metadata.

        The value of ``metadata[teacher_key]`` is compared as a string (``str(value)``).
        A missing key, a ``None`` value or ``metadata=None`` count as missing.

        Returns:
            The matching teacher name; otherwise ``"default"`` when configured.

        Raises:
            RoutingError: unknown or missing name and no ``default`` teacher; the message
                names the key and the sorted known names, and says whether the value is
                missing (the value itself comes from the sample and is never repeated).
        """
        value = None if metadata is None else metadata.get(self._teacher_key)
        if value is not None:
            name = str(value)
            if name in self._teachers:
                return name
        if DEFAULT_TEACHER in self._teachers:
            return DEFAULT_TEACHER
        # the value comes from the sample: described, never repeated
        shown = (
            "missing" if value is None else f"a {type(value).__name__} that names no such teacher"
        )
        raise RoutingError(
            f"no teacher for metadata key {self._teacher_key!r} (value: {shown}); "
            f"known teachers: {list(self.names)}; configure a {DEFAULT_TEACHER!r} "
            "teacher to catch other samples"
        )

    def route(self, metadata: Mapping[str, Any] | None) -> tuple[str, Teacher]:
        """Return ``(teacher name, replica base URLs or Ensemble)`` for a sample; see
        :meth:`resolve`."""
        name = self.resolve(metadata)
        return name, self._teachers[name]

    def __repr__(self) -> str:
        return f"TeacherRouting(teachers={self._teachers!r}, teacher_key={self._teacher_key!r})"
