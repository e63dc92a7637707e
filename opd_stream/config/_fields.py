"""Settings fields declared once, and everything derived from the declaration.

A field of a settings Struct is ``Annotated[type, msgspec.Meta(...), ...]``: type, bounds,
``description`` and, in ``Meta.extra``, ``"advanced": True`` (a tuning knob) or
``"problem"``/``"above"`` (a custom error phrase); a value that needs more (a URL, a secret)
also carries a :class:`Normalise` marker. :class:`FieldSpec` derives from it the check of a
value (:meth:`FieldSpec.check`: the normaliser, the Python type with ``bool`` never a number
and floats finite, then the Meta constraints through ``msgspec.convert``), the parse of an
environment variable (:meth:`FieldSpec.parse_env`) and the documented table's row
(:meth:`FieldSpec.row`). Nothing here knows a particular field: see
:mod:`opd_stream.config._settings`.
"""

from __future__ import annotations

import difflib
import math
import operator
from collections.abc import Callable, Iterable, Mapping
from types import NoneType, UnionType
from typing import Annotated, Any, Final, Literal, NamedTuple, Union, get_args, get_origin

import msgspec

from .._deprecated import warn_renamed
from .._errors import ConfigError

__all__ = (
    "ConfigField",
    "FieldSpec",
    "Invalid",
    "Normalise",
    "REQUIRED",
    "did_you_mean",
    "field_specs",
    "read_env",
)

_KIB: Final = 1024
_MIB: Final = 1024 * _KIB
_GIB: Final = 1024 * _MIB

_ENV_KINDS: Final[dict[type, str]] = {
    int: "an integer",
    float: "a number",
    bool: "one of 1/0/true/false",
}


class _Required:
    """``Annotated`` marker of a field whose empty factory default (``{}``) only stands
    for "not given": the settings check requires it, and its table row says so."""

    __slots__ = ()


REQUIRED: Final = _Required()


class Normalise:
    """``Annotated`` marker: ``func(value)`` checks and normalises a field's value.

    ``func`` raises :class:`ConfigError` whose text is the problem (without the field
    name); it is not called for ``None`` on an optional field.
    """

    __slots__ = ("func",)

    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func = func


class Invalid(Exception):
    """One configuration problem, before it is phrased as a :class:`ConfigError`."""

    def __init__(self, fields: str | tuple[str, ...], problem: str) -> None:
        super().__init__(problem)
        self.fields = (fields,) if isinstance(fields, str) else fields
        self.problem = problem

    def message(self, sources: Mapping[str, str] | None = None) -> str:
        """Phrase the problem, naming each field and the env variable it came from."""
        names = []
        for name in self.fields:
            var = None if sources is None else sources.get(name)
            names.append(f"{name} (from {var})" if var else name)
        return f"{', '.join(names)}: {self.problem}"


class ConfigField(NamedTuple):
    """One row of the configuration table."""

    field: str
    env_var: str
    default: str
    meaning: str


class FieldSpec(NamedTuple):
    """What one field's declaration says, read once from its ``Annotated`` type."""

    name: str
    declared: Any
    """The declared type, constraints included (what ``msgspec.convert`` checks)."""
    kind: type | None
    """``int``, ``float``, ``bool`` or ``str`` (``Literal`` choices count as ``str``);
    ``None`` for any other type (checked by the field's normaliser only)."""
    optional: bool
    choices: tuple[Any, ...]
    meta: msgspec.Meta
    normalise: Callable[[Any], Any] | None
    default: Any

    @property
    def advanced(self) -> bool:
        """A tuning knob (documented as advanced)."""
        return bool((self.meta.extra or {}).get("advanced"))

    def check(self, value: Any) -> Any:
        """Return ``value`` checked and normalised.

        Raises:
            Invalid: the value breaks the declaration.
        """
        if value is None and self.optional:
            return None
        original = value
        if self.normalise is not None:
            try:
                value = self.normalise(value)
            except ConfigError as exc:
                raise Invalid(self.name, str(exc)) from None
        if self.kind is int:
            value = self._integer(value)
        elif self.kind is float:
            value = self._number(value)
        elif self.kind is bool and not isinstance(value, bool):
            raise Invalid(self.name, f"expected a bool, got {type(value).__name__}")
        if self.kind is not None and not self._accepted(value):
            raise Invalid(self.name, self._problem(original, value))
        return value

    def parse_env(self, var: str, raw: str) -> Any:
        """Turn the text of environment variable ``var`` into a value for this field.

        The text is stripped; empty text is ``None`` for an optional field; integers,
        numbers and bools are coerced by ``msgspec.convert(..., strict=False)``; any other
        text is kept as it is (checked later, like any value).

        Raises:
            ConfigError: the text does not parse; the message names the field and ``var``.
        """
        text = raw.strip()
        if self.optional:
            return text or None
        if self.kind not in _ENV_KINDS:
            return text
        try:
            return msgspec.convert(text, self.kind, strict=False)
        except msgspec.ValidationError:
            expected = _ENV_KINDS[self.kind]
            raise ConfigError(
                f"{self.name} (from {var}): expected {expected}, got {text!r}"
            ) from None

    def row(self, env_prefix: str) -> ConfigField:
        """This field's row of the configuration table."""
        meaning = self.meta.description or ""
        return ConfigField(
            field=self.name,
            env_var=env_prefix + self.name.upper(),
            default=self._shown_default(),
            meaning=f"(advanced) {meaning}" if self.advanced else meaning,
        )

    def _integer(self, value: Any) -> int:
        if isinstance(value, bool):
            raise Invalid(self.name, "expected an integer, got bool")
        try:
            return operator.index(value)
        except TypeError:
            raise Invalid(self.name, f"expected an integer, got {type(value).__name__}") from None

    def _number(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Invalid(self.name, f"expected a number, got {type(value).__name__}")
        number = float(value)
        if not math.isfinite(number):
            raise Invalid(self.name, f"must be finite, got {number}")
        return number

    def _accepted(self, value: Any) -> bool:
        try:
            msgspec.convert(value, self.declared)
        except msgspec.ValidationError:
            return False
        return True

    def _problem(self, original: Any, value: Any) -> str:
        """Phrase a value the declaration's constraints refuse."""
        meta, extra = self.meta, self.meta.extra or {}
        if "problem" in extra:
            return str(extra["problem"]).format(value=original)
        if self.choices:
            return f"must be one of {', '.join(self.choices)}; got {original!r}"
        if self.kind is int:
            low = meta.ge
            bound = f"in {low}..{meta.le}" if meta.le is not None else f">= {low}"
            return f"must be {bound}, got {value}"
        low = meta.gt if meta.gt is not None else meta.ge
        if low is not None and (value < low or (meta.gt is not None and value == low)):
            return f"must be {'>' if meta.gt is not None else '>='} {low:g}, got {value:g}"
        above = extra.get("above", "must be below {limit:g}, got {value:g}")
        return str(above).format(limit=meta.lt, value=value)

    def _shown_default(self) -> str:
        value = self.default
        if value is msgspec.NODEFAULT:
            return "required"
        if value is None or (isinstance(value, dict) and not value):
            return "none"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int) and self.name.endswith("_bytes"):
            for unit, size in (("GiB", _GIB), ("MiB", _MIB), ("KiB", _KIB)):
                if value >= size and value % size == 0:
                    return f"{value // size} {unit}"
        if isinstance(value, float):
            return f"{value:g}"
        return str(value)


def _spec(info: msgspec.structs.FieldInfo) -> FieldSpec:
    declared = info.type
    base, metas, normalise = declared, [], None
    if get_origin(declared) is Annotated:
        base, *extras = get_args(declared)
        metas = [m for m in extras if isinstance(m, msgspec.Meta)]
        markers = [m.func for m in extras if isinstance(m, Normalise)]
        normalise = markers[0] if markers else None
    meta = metas[0] if metas else msgspec.Meta()
    members = get_args(base) if get_origin(base) in (Union, UnionType) else (base,)
    optional = NoneType in members
    (core,) = [m for m in members if m is not NoneType]
    choices: tuple[Any, ...] = ()
    if get_origin(core) is Literal:
        choices, core = get_args(core), str
    kind = core if core in (int, float, bool, str) else None
    default = info.default
    if default is msgspec.NODEFAULT and info.default_factory is not msgspec.NODEFAULT:
        required = get_origin(declared) is Annotated and REQUIRED in get_args(declared)[1:]
        default = msgspec.NODEFAULT if required else info.default_factory()
    return FieldSpec(info.name, declared, kind, optional, choices, meta, normalise, default)


def field_specs(struct: type[msgspec.Struct]) -> dict[str, FieldSpec]:
    """Name -> :class:`FieldSpec` of every field of ``struct``, in declaration order."""
    return {info.name: _spec(info) for info in msgspec.structs.fields(struct)}


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``candidates``, or ``""``."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def read_env(
    specs: Mapping[str, FieldSpec],
    environ: Mapping[str, str],
    prefix: str,
    renamed: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Read every ``<prefix><FIELD>`` variable of ``environ`` (other names are ignored);
    ``renamed`` (old field name -> new) names fields whose old variable is still read, with
    a ``DeprecationWarning``.

    Returns:
        (field -> parsed value, field -> the variable it came from).

    Raises:
        ConfigError: a variable with the prefix that names no field (with the closest
            name), or text that does not parse (see :meth:`FieldSpec.parse_env`), or both
            the old and the new variable of a renamed field.
    """
    by_var = {prefix + name.upper(): spec for name, spec in specs.items()}
    old_vars = {prefix + old.upper(): prefix + new.upper() for old, new in (renamed or {}).items()}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for var in sorted(environ):
        if not var.startswith(prefix):
            continue
        spec = by_var.get(var)
        if var in old_vars:
            if old_vars[var] in environ:
                raise ConfigError(f"{old_vars[var]}: set twice, also as {var} (its old name)")
            # (the line that asked for the configuration: from_env's caller)
            warn_renamed(f"the environment variable {var}", old_vars[var], stacklevel=4)
            spec = by_var[old_vars[var]]
        if spec is None:
            raise ConfigError(f"unknown environment variable {var}{did_you_mean(var, by_var)}")
        values[spec.name] = spec.parse_env(var, environ[var])
        sources[spec.name] = var
    return values, sources
