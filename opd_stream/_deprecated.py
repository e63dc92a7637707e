"""Old spellings of renamed public names, kept one release: each use warns.

Every name here is listed in ``docs/changelog.md`` (old -> new)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

__all__ = ("DictRead", "warn_renamed")


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn (``DeprecationWarning``) that ``old`` is spelt ``new`` now; ``stacklevel`` 3
    points at the caller of the function that calls this one."""
    warnings.warn(
        f"{old} is deprecated: it is {new} now (the old spelling goes in the next release)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


class DictRead:
    """Dict-style reads of a stats struct that used to be a ``dict`` (``table[key]``,
    ``keys()``, ``items()``, iteration, ...), each a ``DeprecationWarning``: read the
    attribute instead (``as_dict()`` is the mapping, without a warning).

    A mixin of msgspec Structs: the keys are the struct's fields; ``old_keys`` maps a
    renamed key to its field."""

    __slots__ = ()
    __struct_fields__: ClassVar[tuple[str, ...]]
    old_keys: ClassVar[Mapping[str, str]] = {}

    def as_dict(self) -> dict[str, Any]:
        """Field -> value, in field order (the shape the table had as a ``dict``)."""
        return {name: getattr(self, name) for name in self.__struct_fields__}

    def _warn(self, how: str) -> None:
        name = type(self).__name__
        warnings.warn(
            f"reading {name} like a dict ({how}) is deprecated: read its attributes, "
            "or as_dict() (the dict reads go in the next release)",
            DeprecationWarning,
            stacklevel=3,
        )

    def _field(self, key: object) -> str:
        if isinstance(key, str):
            if key in self.old_keys:
                # (the user's line: it -> the dict read -> here -> warn_renamed)
                warn_renamed(f"the key {key!r}", repr(self.old_keys[key]), stacklevel=4)
                return self.old_keys[key]
            if key in self.__struct_fields__:
                return key
        raise KeyError(key)

    def __getitem__(self, key: str) -> Any:
        self._warn(f"[{key!r}]")
        return getattr(self, self._field(key))

    def get(self, key: str, default: Any = None) -> Any:
        self._warn("get()")
        try:
            return getattr(self, self._field(key))
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        self._warn("in")
        try:
            self._field(key)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        self._warn("iteration")
        return iter(self.__struct_fields__)

    def __len__(self) -> int:
        self._warn("len()")
        return len(self.__struct_fields__)

    def keys(self) -> list[str]:
        self._warn("keys()")
        return list(self.__struct_fields__)

    def values(self) -> list[Any]:
        self._warn("values()")
        return list(self.as_dict().values())

    def items(self) -> list[tuple[str, Any]]:
        self._warn("items()")
        return list(self.as_dict().items())
