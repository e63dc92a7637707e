"""HTTP/1.1 for one client request at a time, sans-IO: the request's head, the answer's head,
and a chunked body's framing. Plain functions and small state machines over bytes; the
asyncio shell that drives them is :mod:`opd_stream.transport._native`.

What is accepted of an answer is strict and small (what SGLang, vLLM, smg and a proxy in
front of them send): a status line ``HTTP/1.0`` or ``HTTP/1.1``, header fields without
line folding, a body framed by ``Transfer-Encoding: chunked``, by one ``Content-Length``, or
by the end of the connection. Anything else is a :class:`FramingError` naming what was
wrong (never quoting more than a few bytes of it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = (
    "MAX_HEAD_BYTES",
    "ChunkedDecoder",
    "FramingError",
    "ResponseHead",
    "parse_response_head",
    "request_head",
    "shown",
)

#: The most bytes an answer's head may take (status line and header fields together).
MAX_HEAD_BYTES = 64 * 1024
_MAX_CHUNK_LINE = 1024
_NO_BODY_STATUSES = frozenset({204, 304})


class FramingError(Exception):
    """The server's bytes are not an HTTP/1.1 answer this client accepts."""


def shown(data: bytes | str) -> str:
    """A few bytes a server sent, for an error message: short and printable."""
    text = data[:40] if isinstance(data, str) else data[:40].decode("latin-1")
    return "".join(c if c.isprintable() else "?" for c in text) + ("..." if len(data) > 40 else "")


def _check_field(name: str, value: str) -> None:
    if not name or any(c in name for c in " \t\r\n:") or any(c in value for c in "\r\n\0"):
        raise ValueError(f"header {name[:40]!r}: a name or value that HTTP cannot carry")


def request_head(
    method: str,
    target: str,
    host: str,
    fields: Iterable[tuple[str, str]],
    body_length: int | None,
) -> bytes:
    """The head of one request (``Host`` first, then ``fields``, then ``Content-Length``).

    Raises:
        ValueError: a header name or value with a line break, a NUL or (in a name) a space
            or colon (sending it would let the value write further headers), or a character
            that is not latin-1.
    """
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    for name, value in fields:
        _check_field(name, value)
        lines.append(f"{name}: {value}")
    if body_length is not None:
        lines.append(f"Content-Length: {body_length}")
    lines.append("\r\n")
    try:
        return "\r\n".join(lines).encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError("a header value that HTTP cannot carry (not latin-1)") from None


class ResponseHead:
    """An answer's status line and header fields, and how its body is framed.

    Attributes:
        status: the status code.
        headers: the header fields, names in lower case; a repeated field's values joined
            with ``", "``.
        length: the body's ``Content-Length`` (``None``: chunked, or until the end).
        chunked: the body comes in chunks.
        keep_alive: the connection may carry another request once this body is read.
        informational: a 1xx answer (another head follows it).
    """

    __slots__ = ("chunked", "headers", "informational", "keep_alive", "length", "status")

    def __init__(
        self,
        status: int,
        headers: Mapping[str, str],
        length: int | None,
        chunked: bool,
        keep_alive: bool,
    ) -> None:
        self.status = status
        self.headers = headers
        self.length = length
        self.chunked = chunked
        self.keep_alive = keep_alive
        self.informational = 100 <= status < 200

    @property
    def until_close(self) -> bool:
        """The body is what comes until the server closes the connection."""
        return self.length is None and not self.chunked


def parse_response_head(head: bytes, *, method: str = "POST") -> ResponseHead:
    """The head ``head`` holds (the bytes before the blank line that ends it).

    Raises:
        FramingError: not a status line this client reads, a malformed field, a folded
            line, a ``Content-Length`` that is not one number, a transfer coding other than
            ``chunked``, or ``101 Switching Protocols``.
    """
    lines = head.split(b"\r\n")
    status_line = lines[0]
    version, _, rest = status_line.partition(b" ")
    code = rest[:3]
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise FramingError(f"not an HTTP/1.1 status line: {shown(status_line)!r}")
    if rest[3:4] not in (b"", b" "):
        raise FramingError(f"not an HTTP/1.1 status line: {shown(status_line)!r}")
    status = int(code)
    if status < 100 or status == 101:
        raise FramingError(f"status {status} is not an answer this client reads")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            raise FramingError("a folded header line (obsolete line folding)")
        raw_name, sep, raw_value = line.partition(b":")
        if not sep or not raw_name or raw_name != raw_name.strip() or b" " in raw_name:
            raise FramingError(f"a malformed header line: {shown(line)!r}")
        name = raw_name.decode("latin-1").lower()
        value = raw_value.strip(b" \t").decode("latin-1")
        fields[name] = f"{fields[name]}, {value}" if name in fields else value
    keep_alive = _keeps_alive(version, fields.get("connection", ""))
    length: int | None = None
    chunked = False
    coding = fields.get("transfer-encoding")
    if coding is not None:
        codings = [c.strip().lower() for c in coding.split(",")]
        if codings != ["chunked"]:
            raise FramingError(f"a transfer coding other than chunked: {shown(coding)!r}")
        chunked = True
        if "content-length" in fields:  # both framings: never reuse such a connection
            keep_alive = False
    elif "content-length" in fields:
        values = {v.strip() for v in fields["content-length"].split(",")}
        text = values.pop() if len(values) == 1 else ""
        if not text.isdigit() or not text.isascii():
            raise FramingError(f"a Content-Length that is not one number: {shown(text)!r}")
        length = int(text)
    if status in _NO_BODY_STATUSES or 100 <= status < 200 or method == "HEAD":
        length, chunked = 0, False
    elif length is None and not chunked:
        keep_alive = False  # the body ends with the connection
    return ResponseHead(status, fields, length, chunked, keep_alive)


def _keeps_alive(version: bytes, connection: str) -> bool:
    tokens = {t.strip().lower() for t in connection.split(",")}
    if version == b"HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens


class ChunkedDecoder:
    """A ``Transfer-Encoding: chunked`` body's framing, fed bytes as they come.

    :meth:`feed` takes what was read and returns the body's bytes it held (views into the
    data fed: copy them before the buffer is reused) and how many bytes of the input it
    used; bytes of a line split between two reads stay unused and must be fed again at the
    front of the next read. ``done``: the last chunk and the trailer fields have come; what
    follows belongs to the next answer.
    """

    __slots__ = ("_left", "_state", "done", "size")

    def __init__(self) -> None:
        self._state = "size"  # size -> data -> data_end -> size ... -> trailer -> done
        self._left = 0
        self.size = 0  # body bytes so far
        self.done = False

    def feed(self, data: memoryview) -> tuple[list[memoryview], int]:
        """Decode what ``data`` holds; ``(body pieces, bytes used)``.

        Raises:
            FramingError: a malformed chunk size line, or a chunk not followed by CRLF.
        """
        out: list[memoryview] = []
        pos, end = 0, len(data)
        while pos < end and not self.done:
            if self._state == "data":
                take = min(self._left, end - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._left -= take
                self.size += take
                if self._left == 0:
                    self._state = "data_end"
                continue
            line_end = _find_crlf(data, pos)
            if line_end < 0:
                if end - pos > _MAX_CHUNK_LINE:
                    raise FramingError("a chunk size or trailer line over 1 KiB")
                break
            line = bytes(data[pos:line_end])
            pos = line_end + 2
            if self._state == "data_end":
                if line:
                    raise FramingError("a chunk not followed by CRLF")
                self._state = "size"
            elif self._state == "size":
                size_text = line.split(b";", 1)[0].strip(b" \t")
                if (
                    not size_text
                    or len(size_text) > 16
                    or any(c not in b"0123456789abcdefABCDEF" for c in size_text)
                ):
                    raise FramingError(f"a malformed chunk size line: {shown(line)!r}")
                self._left = int(size_text, 16)
                self._state = "data" if self._left else "trailer"
            elif not line:  # the blank line that ends the trailer fields
                self.done = True
        return out, pos


def _find_crlf(data: memoryview, start: int) -> int:
    """The index of the first CRLF in ``data`` at or after ``start``, or -1."""
    stop = min(len(data), start + _MAX_CHUNK_LINE + 2)
    found = bytes(data[start:stop]).find(b"\r\n")
    return -1 if found < 0 else start + found
