"""Secrets out of text a server sent back: sans-IO, applied before any cut or re-encoding.

:func:`redact` replaces with ``***`` any ``Bearer <token>`` (case-insensitive; the token is
everything up to the next whitespace) and, when the key is known, the key itself (as sent,
and JSON- or Python-escaped) and a cut-off start of it at the very end of the text. What a
server echoes (a proxy's error page, an abort message) goes into :class:`SampleFailure`
messages, log events and the score command's output, so redaction happens before a message
is capped and on decoded strings before they are re-encoded; it stays safe on text already
cut (the tail rule). The rules in full: ``docs/design-notes.md``, "opd_stream/_redact.py".
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ("MASK", "redact", "redact_bearer", "redact_json")

_MAX_DEPTH = 64

MASK = "***"

_BEARER = re.compile(r"(?i)(bearer)(\s+)\S+")
_MIN_TAIL = 4  # a cut-off key prefix this long or longer at the end of a text is masked
_ELLIPSES = ("…", "...")


def redact_bearer(text: str) -> str:
    """Mask the token of every ``Bearer <token>`` in ``text`` (the scheme word is kept)."""
    return _BEARER.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)


def _spellings(secret: str) -> list[str]:
    """The key as sent, and as JSON / Python string escaping would show it."""
    escaped = secret.replace("\\", "\\\\").replace('"', '\\"')
    forms = {secret, escaped, escaped.replace("/", "\\/"), secret.replace("'", "\\'")}
    return sorted(forms, key=len, reverse=True)


def _mask_tail(text: str, forms: list[str]) -> str:
    """Mask a start of any spelling of the key left at the end of ``text`` by a cut."""
    body, suffix = text, ""
    for ellipsis in _ELLIPSES:
        if body.endswith(ellipsis):
            body, suffix = body[: -len(ellipsis)], ellipsis
            break
    for form in forms:
        for size in range(min(len(form), len(body)), _MIN_TAIL - 1, -1):
            if body.endswith(form[:size]):
                return body[:-size] + MASK + suffix
    return text


def redact(text: str, secret: str | None = None) -> str:
    """Return ``text`` with bearer tokens and (when given) ``secret`` masked as ``***``.

    Args:
        text: a message that may hold what a server echoed.
        secret: the API key, when the caller knows it.
    """
    out = redact_bearer(text)
    if secret:
        forms = _spellings(secret)
        for form in forms:
            out = out.replace(form, MASK)
        out = _mask_tail(out, forms)
    return out


def redact_json(value: Any, secret: str | None = None, _depth: int = 0) -> Any:
    """Decoded JSON ``value`` with every string, object keys included, redacted.

    Nesting deeper than 64 levels is replaced by a placeholder (an error message has no
    use for it, and it bounds the recursion).
    """
    if _depth > _MAX_DEPTH:
        return "<nested too deeply>"
    if isinstance(value, str):
        return redact(value, secret)
    if isinstance(value, list):
        return [redact_json(v, secret, _depth + 1) for v in value]
    if isinstance(value, dict):
        return {
            redact(str(k), secret): redact_json(v, secret, _depth + 1) for k, v in value.items()
        }
    return value
