"""HTTP/1.1 framing, sans-IO (``transport/_http1.py``): request heads, answer heads, and a
chunked body read back byte for byte however the reads split it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opd_stream.transport._http1 import (
    ChunkedDecoder,
    FramingError,
    parse_response_head,
    request_head,
)


def test_a_request_head_has_the_host_the_fields_and_the_length() -> None:
    head = request_head("POST", "/generate", "h:1", [("A", "b")], 12)
    assert head == b"POST /generate HTTP/1.1\r\nHost: h:1\r\nA: b\r\nContent-Length: 12\r\n\r\n"
    assert b"Content-Length" not in request_head("GET", "/health", "h", [], None)


@pytest.mark.parametrize(
    ("name", "value"), [("X", "a\nb"), ("X", "a\rb"), ("X Y", "1"), ("", "1"), ("X", "\u2603")]
)
def test_a_field_http_cannot_carry_is_refused(name: str, value: str) -> None:
    with pytest.raises(ValueError, match="cannot carry"):
        request_head("POST", "/", "h", [(name, value)], 0)


def test_an_answer_head_reads_status_fields_and_framing() -> None:
    head = parse_response_head(
        b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\nX-A: 1\r\nx-a: 2\r\n"
        b"Content-Length: 10"
    )
    assert (head.status, head.length, head.chunked, head.keep_alive) == (503, 10, False, True)
    assert head.headers == {"retry-after": "2", "x-a": "1, 2", "content-length": "10"}


@pytest.mark.parametrize(
    ("raw", "keep_alive", "length"),
    [
        (b"HTTP/1.0 200 OK\r\nContent-Length: 1", False, 1),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1", True, 1),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1", False, 1),
        (b"HTTP/1.1 200 OK", False, None),  # until the connection ends
        (b"HTTP/1.1 204 No Content", True, 0),
        (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 99", True, 0),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 7, 7", True, 7),
    ],
)
def test_what_ends_a_body_and_whether_the_connection_carries_on(
    raw: bytes, keep_alive: bool, length: int | None
) -> None:
    head = parse_response_head(raw)
    assert (head.keep_alive, head.length) == (keep_alive, length)


def test_an_informational_answer_says_so() -> None:
    assert parse_response_head(b"HTTP/1.1 103 Early Hints").informational
    with pytest.raises(FramingError, match="101"):
        parse_response_head(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c")


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, pos = [], 0
    for size in sizes:
        piece = body[pos : pos + size]
        if not piece:
            break
        out.append(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
        pos += len(piece)
    if pos < len(body):
        out.append(b"%X\r\n%s\r\n" % (len(body) - pos, body[pos:]))
    return b"".join(out) + b"0\r\nTrailer: x\r\n\r\n"


@given(
    body=st.binary(max_size=600),
    sizes=st.lists(st.integers(1, 200), max_size=8),
    cuts=st.lists(st.integers(1, 64), min_size=1, max_size=50),
)
def test_a_chunked_body_comes_back_whole_however_the_reads_split_it(
    body: bytes, sizes: list[int], cuts: list[int]
) -> None:
    wire = _chunked(body, sizes) + b"NEXT"
    decoder = ChunkedDecoder()
    got, pending, pos, i = [], b"", 0, 0
    while not decoder.done:
        assert pos < len(wire), "the decoder never finished"
        step = cuts[i % len(cuts)]
        i += 1
        pending += wire[pos : pos + step]
        pos += step
        pieces, used = decoder.feed(memoryview(pending))
        got.extend(bytes(p) for p in pieces)
        pending = pending[used:]
    assert b"".join(got) == body and decoder.size == len(body)
    assert pending + wire[min(pos, len(wire)) :] == b"NEXT"  # left for the next answer


@pytest.mark.parametrize(
    "wire", [b"g\r\n", b"3\r\nabcX\r\n", b"-1\r\n", b"\r\n", b"1" * 17 + b"\r\n"]
)
def test_a_malformed_chunk_is_a_framing_error(wire: bytes) -> None:
    with pytest.raises(FramingError):
        ChunkedDecoder().feed(memoryview(wire))
