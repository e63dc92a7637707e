"""SGLang error bodies: :func:`parse_error_message` (the server's message, redacted and
capped; never raises)."""

from __future__ import annotations

import html
import re
from typing import Any

import msgspec

from .._redact import redact, redact_json
from ._answers import Body

__all__ = ("parse_error_message",)

_ENCODER = msgspec.json.Encoder()
_MESSAGE_CAP = 500
_PREFIX_CAP = 200
_REDACT_SPAN = _MESSAGE_CAP + (1 << 14)
_TITLE_CAP = 100
_HTML_START = re.compile(r"<(?:!doctype\s+html|html|head|body|title)\b", re.IGNORECASE)
_HTML_TITLE = re.compile(r"<title\b[^>]*>(.*?)</title\s*>", re.IGNORECASE | re.DOTALL)


def parse_error_message(body: Body, *, secret: str | None = None) -> str:
    """Extract the server's message from an SGLang error body; never raises.

    Tries, in order: ``body["error"]["message"]``, ``body["error"]`` (a string),
    ``body["message"]``, ``body["detail"]`` (a string, or other JSON re-encoded). An HTML
    page (a proxy's or a web server's error page) is summarised by its ``<title>`` (at most
    100 characters), never dumped. Otherwise returns a printable prefix of the body (at
    most 200 characters, non-printables escaped) or ``"<empty body>"``. Messages are capped
    at 500 characters.

    Secrets are masked first, before any cut or re-encoding (:func:`opd_stream._redact.redact`):
    the token of every ``Bearer <token>`` the server echoed, and ``secret`` (the API key)
    when given.
    """
    try:
        return _parse_error_message(body, secret)
    except Exception:  # pragma: no cover - defensive: this function must never raise
        return "<unreadable body>"


def _parse_error_message(body: Body, secret: str | None = None) -> str:
    # Redaction sees a span longer than the cap by more than any header can be (aiohttp
    # refuses header lines over 8 KiB), so a key that starts before the cut is masked whole.
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, TypeError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        candidates: list[Any] = [
            err.get("message") if isinstance(err, dict) else None,
            err,
            obj.get("message"),
        ]
        for value in candidates:
            if isinstance(value, str) and value:
                return _cap(redact(value[:_REDACT_SPAN], secret), _MESSAGE_CAP)
        detail = obj.get("detail")
        if isinstance(detail, str) and detail:
            return _cap(redact(detail[:_REDACT_SPAN], secret), _MESSAGE_CAP)
        if detail is not None:
            text = _ENCODER.encode(redact_json(detail, secret)).decode("utf-8", "replace")
            return _cap(redact(text[:_REDACT_SPAN], secret), _MESSAGE_CAP)
    text = bytes(body[:_REDACT_SPAN]).decode("utf-8", "backslashreplace").strip()
    if not text:
        return "<empty body>"
    if _HTML_START.match(text):
        return _html_summary(text, secret)
    return _cap(redact(text, secret), _PREFIX_CAP)


def _html_summary(text: str, secret: str | None) -> str:
    """An HTML page (a proxy's or a plain web server's error page) in a few words: its
    title, not its markup."""
    found = _HTML_TITLE.search(text)
    title = " ".join(html.unescape(found.group(1)).split()) if found else ""
    if not title:
        return "an HTML page without a title (not an SGLang answer: a proxy or another server?)"
    shown = _cap(redact(title, secret), _TITLE_CAP)
    return f"an HTML page titled {shown!r} (not an SGLang answer: a proxy or another server?)"


def _cap(text: str, limit: int) -> str:
    """At most ``limit`` characters of ``text`` (redacted beforehand), non-printables escaped."""
    cut = text[:limit]
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return out + ("…" if len(text) > limit else "")
