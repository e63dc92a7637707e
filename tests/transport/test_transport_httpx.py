"""The httpx transport keeps the aiohttp transport's rules, on asyncio and trio: pooling, the
byte cap, no compression, no redirects, connection errors, the byte budget; and a stream
with no transport given picks aiohttp under asyncio, httpx under trio.

A raw HTTP/1.1 server on an anyio listener (so it runs on either backend) answers with
exactly the bytes each test wants.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from support.config import stream_config
from support.raw_http import Reply, answer_bytes, raw_server

from opd_stream import (
    AiohttpTransport,
    AsyncioTransport,
    ConnectionFailed,
    MalformedResponseError,
    ResponseTooLarge,
)
from opd_stream._stream import default_transport
from opd_stream.transport._budget import ByteBudget
from opd_stream.transport._httpx import HttpxTransport


def _ok(body: bytes = b'{"ok": true}') -> Reply:
    return lambda head, req: (answer_bytes(body), False)


# aiohttp and the asyncio transport run on asyncio only (the reason the httpx transport
# exists): no trio x aiohttp or trio x asyncio case
_COMBOS = [("asyncio", "httpx"), ("asyncio", "aiohttp"), ("asyncio", "native"), ("trio", "httpx")]
both_transports = pytest.mark.parametrize(
    ("anyio_backend", "transport_name"), _COMBOS, ids=[f"{b}-{t}" for b, t in _COMBOS]
)


@pytest.fixture
def make(transport_name: str) -> Callable[..., Any]:
    return {"httpx": HttpxTransport, "aiohttp": AiohttpTransport, "native": AsyncioTransport}[
        transport_name
    ]


@both_transports
async def test_an_answer_is_read_whole_over_one_pooled_connection(make: Any) -> None:
    async with raw_server(_ok()) as server, make(api_key="k3y") as transport:
        for _ in range(3):
            resp = await transport.post(server.url + "/generate", b"{}", max_bytes=1 << 20)
            assert resp.status == 200 and bytes(resp.body) == b'{"ok": true}'
        assert transport.idle
    assert server.connections == 1  # keep-alive
    head = server.heads[0].decode().lower()
    assert "authorization: bearer k3y" in head
    assert "accept-encoding: identity" in head
    assert "content-type: application/json" in head


@both_transports
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_over_the_cap_is_refused(make: Any, chunked: bool) -> None:
    body = b"x" * 5000
    if chunked:
        data = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        raw = answer_bytes(data, headers="Transfer-Encoding: chunked\r\n", length=False)
    else:
        raw = answer_bytes(body)
    async with raw_server(lambda h, b: (raw, False)) as server, make() as transport:
        with pytest.raises(ResponseTooLarge):
            await transport.post(server.url, b"{}", max_bytes=4096)
        resp = await transport.post(server.url, b"{}", max_bytes=5000)  # the pool still works
        assert len(resp.body) == 5000


@both_transports
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_long_body_comes_back_byte_for_byte(make: Any, chunked: bool) -> None:
    # many reads: with a Content-Length each goes straight into a buffer of that size
    body = bytes(range(256)) * 12_289  # ~3 MiB, no two neighbouring chunks alike
    if chunked:
        pieces = [body[i : i + 70_001] for i in range(0, len(body), 70_001)]
        data = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        raw = answer_bytes(data, headers="Transfer-Encoding: chunked\r\n", length=False)
    else:
        raw = answer_bytes(body)
    async with raw_server(lambda h, b: (raw, False)) as server, make() as transport:
        resp = await transport.post(server.url, b"{}", max_bytes=len(body))
        assert bytes(resp.body) == body


@both_transports
async def test_a_compressed_body_is_refused_unread(make: Any) -> None:
    raw = answer_bytes(b"\x1f\x8b" + b"\0" * 20, headers="Content-Encoding: gzip\r\n")
    async with raw_server(lambda h, b: (raw, False)) as server, make() as transport:
        with pytest.raises(MalformedResponseError, match="Content-Encoding: gzip"):
            await transport.post(server.url, b"{}", max_bytes=1 << 20)


@both_transports
async def test_a_redirect_is_not_followed(make: Any) -> None:
    raw = answer_bytes(
        b"", status="302 Found", headers="Location: http://127.0.0.1:1/elsewhere\r\n"
    )
    async with raw_server(lambda h, b: (raw, False)) as server, make() as transport:
        resp = await transport.post(server.url, b"{}", max_bytes=1 << 20)
    assert resp.status == 302
    assert len(server.heads) == 1


@both_transports
async def test_a_cut_body_and_a_refused_connection_are_connection_failures(make: Any) -> None:
    cut = answer_bytes(b"x" * 10)[:-5]  # announces 10 bytes, sends 5, closes
    async with raw_server(lambda h, b: (cut, True)) as server, make() as transport:
        with pytest.raises(ConnectionFailed):
            await transport.post(server.url, b"{}", max_bytes=1 << 20)
        url = server.url
    async with make() as transport:  # the server is gone: connection refused
        with pytest.raises(ConnectionFailed):
            await transport.get(url + "/health", max_bytes=1024)


@both_transports
async def test_the_transport_charges_what_it_reads_to_the_lease_it_is_given(make: Any) -> None:
    budget = ByteBudget(1 << 20)
    async with raw_server(_ok(b"y" * 3000)) as server, make() as transport:
        with budget.lease() as lease:
            resp = await transport.post(server.url, b"{}", max_bytes=1 << 20, lease=lease)
            assert lease.held == len(resp.body) == 3000


async def test_a_stream_picks_the_asyncio_transport_under_asyncio_and_httpx_under_trio(
    anyio_backend_name: str,
) -> None:
    cfg = stream_config("http://127.0.0.1:1")
    want = AsyncioTransport if anyio_backend_name == "asyncio" else HttpxTransport
    assert type(default_transport(cfg)) is want


@pytest.mark.parametrize(
    ("declared", "pieces"),
    [
        (9, [b"abc", b"def", b"ghi"]),  # as declared: one buffer, filled as it came
        (4, [b"abc", b"def", b"ghi"]),  # more than declared: the rest kept and joined
        (12, [b"abc", b"def", b"ghi"]),  # fewer than declared (a client would have raised)
        (None, [b"abc", b"def", b"ghi"]),  # no length: joined once
        (0, []),
    ],
)
async def test_a_body_is_read_whole_whatever_its_declared_length(
    declared: int | None, pieces: list[bytes]
) -> None:
    from opd_stream.transport._transports import PooledTransport

    async def chunks() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    body = await PooledTransport._read_body(chunks(), 1 << 20, "http://x", declared)
    assert bytes(body) == b"".join(pieces)
