"""``Secret``: a string (the API key) that never shows itself in ``repr``, ``str`` or logs."""

from __future__ import annotations

from typing import Any

from .._errors import ConfigError

__all__ = ("Secret", "as_secret")


class Secret:
    """A string that never shows itself: ``repr`` is ``Secret('***')``, ``str`` is ``***``.

    Args:
        value: the secret text.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"Secret takes a str, got {type(value).__name__}")
        self._value = value

    def get_secret_value(self) -> str:
        """Return the secret text (for the one place that must send it)."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    def __str__(self) -> str:
        return "***"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return self._value == other._value

    def __hash__(self) -> int:
        return hash((Secret, self._value))


def as_secret(value: Any) -> Secret:
    """Return ``value`` (a ``str`` or a :class:`Secret`) as a :class:`Secret` fit for an
    HTTP header.

    Raises:
        ConfigError: not a string; empty, or holding whitespace or unprintable characters
            (the message never echoes the value).
    """
    secret = value if isinstance(value, Secret) else None
    if secret is None:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {type(value).__name__}")
        secret = Secret(value)
    text = secret.get_secret_value()
    if not text or any(ch.isspace() or not ch.isprintable() for ch in text):
        raise ConfigError("must be non-empty printable text without whitespace")
    return secret
