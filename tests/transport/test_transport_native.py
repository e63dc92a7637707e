"""The asyncio transport's own rules, beyond those it shares with aiohttp and httpx
(``test_transport_httpx.py``): when a kept-alive connection is used again and when not, the
bodies framed by the end of the connection, informational answers, the byte budget's waits,
what is refused, and TLS. asyncio only (the transport runs on asyncio alone)."""

from __future__ import annotations

import functools
import os
import shutil
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest
from anyio.streams.tls import TLSStream
from support.raw_http import answer_bytes, raw_server

from opd_stream import AsyncioTransport, ConnectionFailed, ResponseTooLarge
from opd_stream.transport._budget import ByteBudget

pytestmark = pytest.mark.parametrize("anyio_backend", ["asyncio"])

OK = answer_bytes(b'{"ok":1}')


async def test_a_kept_alive_connection_closed_by_the_server_is_replaced_and_sent_again() -> None:
    seen = []

    def reply(head: bytes, body: bytes) -> tuple[bytes, bool]:
        seen.append(head)
        if len(seen) == 2:  # the server closes the idle connection as the request arrives
            return b"", True
        return OK, False

    async with raw_server(reply) as server, AsyncioTransport() as transport:
        for _ in range(2):
            resp = await transport.post(server.url, b"{}", max_bytes=1 << 20)
            assert bytes(resp.body) == b'{"ok":1}'
    assert len(seen) == 3 and server.connections == 2


async def test_a_new_connection_closed_without_an_answer_is_a_failure_not_sent_again() -> None:
    async with raw_server(lambda h, b: (b"", True)) as server, AsyncioTransport() as transport:
        with pytest.raises(ConnectionFailed, match="closed the connection"):
            await transport.post(server.url, b"{}", max_bytes=1 << 20)
    assert len(server.heads) == 1


async def test_a_connection_is_not_used_again_after_a_cancelled_request() -> None:
    calls = []

    def reply(head: bytes, body: bytes) -> tuple[bytes, bool]:
        calls.append(head)
        if len(calls) == 1:  # announces 100 bytes, sends 3: the reader waits for the rest
            return answer_bytes(b"x" * 100)[:-97], False
        return OK, False

    async with raw_server(reply) as server, AsyncioTransport() as transport:
        with anyio.move_on_after(0.3) as scope:
            await transport.post(server.url, b"{}", max_bytes=1 << 20)
        assert scope.cancelled_caught
        assert transport.idle
        resp = await transport.post(server.url, b"{}", max_bytes=1 << 20)
        assert bytes(resp.body) == b'{"ok":1}'
    assert server.connections == 2


@pytest.mark.parametrize(
    "raw",
    [
        answer_bytes(b'{"ok":1}', headers="Connection: close\r\n"),
        b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'8\r\n{"ok":1}\r\n0\r\n\r\n',
        answer_bytes(b'{"ok":1}') + b"garbage",
    ],
    ids=["connection-close", "both-framings", "bytes-past-the-length"],
)
async def test_an_answer_that_ends_its_connection_is_not_followed_on_it(raw: bytes) -> None:
    async with raw_server(lambda h, b: (raw, False)) as server, AsyncioTransport() as transport:
        for _ in range(2):
            resp = await transport.post(server.url, b"{}", max_bytes=1 << 20)
            assert bytes(resp.body) == b'{"ok":1}'
    assert server.connections == 2


async def test_a_body_without_a_length_is_read_until_the_server_closes() -> None:
    raw = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + b"z" * 200_000
    async with raw_server(lambda h, b: (raw, True)) as server, AsyncioTransport() as transport:
        resp = await transport.post(server.url, b"{}", max_bytes=1 << 20)
        assert bytes(resp.body) == b"z" * 200_000
        with pytest.raises(ResponseTooLarge):
            await transport.post(server.url, b"{}", max_bytes=100_000)


async def test_an_informational_answer_is_skipped() -> None:
    raw = b"HTTP/1.1 100 Continue\r\n\r\n" + OK
    async with raw_server(lambda h, b: (raw, False)) as server, AsyncioTransport() as transport:
        resp = await transport.post(server.url, b"{}", max_bytes=1 << 20)
    assert resp.status == 200 and bytes(resp.body) == b'{"ok":1}'


async def test_chunk_extensions_and_trailer_fields_are_read_past() -> None:
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;name=value\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    async with raw_server(lambda h, b: (raw, False)) as server, AsyncioTransport() as transport:
        for _ in range(2):
            resp = await transport.post(server.url, b"{}", max_bytes=1 << 20)
            assert bytes(resp.body) == b"abcde"
    assert server.connections == 1


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"HTTP/2 200 OK\r\n\r\n", "status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "transfer coding"),
        (b"HTTP/1.1 200 OK\r\nX: 1\r\n folded\r\n\r\n", "folded"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: " + b"a" * 70_000 + b"\r\n\r\n", "head over"),
    ],
    ids=["http2", "length-text", "two-lengths", "gzip-coding", "folded", "chunk-size", "huge"],
)
async def test_a_malformed_answer_is_a_connection_failure_naming_what_was_wrong(
    raw: bytes, words: str
) -> None:
    async with raw_server(lambda h, b: (raw, True)) as server, AsyncioTransport() as transport:
        with pytest.raises(ConnectionFailed, match=words):
            await transport.post(server.url, b"{}", max_bytes=1 << 20)


@pytest.mark.parametrize("url", ["ftp://user:s3cret@127.0.0.1/x", "http://user:s3cret@/x"])
async def test_a_url_it_cannot_send_to_is_a_failure_that_does_not_echo_it(url: str) -> None:
    async with AsyncioTransport() as transport:
        with pytest.raises(ConnectionFailed, match="not an http") as info:
            await transport.post(url, b"{}", max_bytes=1024)
    assert "s3cret" not in str(info.value)


async def test_a_header_value_with_a_line_break_is_refused_unsent() -> None:
    async with raw_server(lambda h, b: (OK, False)) as server, AsyncioTransport() as transport:
        with pytest.raises(ValueError, match="cannot carry"):
            await transport.post(
                server.url, b"{}", max_bytes=1 << 20, headers={"X-Key": "a\r\nX-Evil: 1"}
            )
    assert server.heads == []


async def test_a_body_over_the_budget_is_not_read_until_the_budget_grants_it() -> None:
    budget = ByteBudget(1000)
    body = b"q" * 3000
    got = []
    async with raw_server(lambda h, b: (answer_bytes(body), False)) as server:
        async with AsyncioTransport() as transport, anyio.create_task_group() as tg:
            other = budget.lease()
            await other.grow(1000)
            lease = budget.lease()

            async def read() -> None:
                resp = await transport.post(server.url, b"{}", max_bytes=1 << 20, lease=lease)
                got.append(bytes(resp.body))

            tg.start_soon(read)
            for _ in range(2000):  # until the reader waits for the budget
                if budget.waiting:
                    break
                await anyio.sleep(0.005)
            assert budget.waiting == 1 and got == []
            other.release()
        assert got == [body] and lease.held == 3000


async def test_the_pool_size_bounds_the_connections_in_use() -> None:
    async with raw_server(lambda h, b: (OK, False)) as server:
        async with AsyncioTransport(pool_size=1) as transport, anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(
                    functools.partial(transport.post, max_bytes=1 << 20), server.url, b"{}"
                )
    assert server.connections == 1 and len(server.heads) == 4


async def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:  # skipped where it is truly absent, never in CI (Linux has it)
        if os.environ.get("CI"):
            pytest.fail("no openssl command to make a self-signed certificate")
        pytest.skip("no openssl command to make a self-signed certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    await anyio.run_process(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-days", "1",
         "-keyout", str(key), "-out", str(cert)],
    )  # fmt: skip
    return key, cert


@asynccontextmanager
async def _tls_server(key: Path, cert: Path, body: bytes) -> AsyncIterator[int]:
    """A TLS server on a free port that answers each request with ``body``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                tls = await TLSStream.wrap(stream, server_side=True, ssl_context=ctx)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await tls.receive()
                await tls.send(answer_bytes(body))
                await tls.receive()  # until the client goes
            except Exception:
                return

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        yield port
        tg.cancel_scope.cancel()


async def test_an_untrusted_certificate_is_a_failure_but_not_a_refusal(tmp_path: Path) -> None:
    key, cert = await _self_signed(tmp_path)
    async with _tls_server(key, cert, b"{}") as port, AsyncioTransport() as transport:
        with pytest.raises(ConnectionFailed) as info:
            await transport.post(f"https://127.0.0.1:{port}/generate", b"{}", max_bytes=1024)
    assert not info.value.refused
    assert "CERTIFICATE" in str(info.value).upper()


async def test_an_answer_over_tls_is_read_whole(tmp_path: Path) -> None:
    key, cert = await _self_signed(tmp_path)
    body = bytes(range(256)) * 4000  # ~1 MB: many TLS records into the one body buffer
    async with _tls_server(key, cert, body) as port, AsyncioTransport() as transport:
        transport._tls = ssl.create_default_context(cafile=str(cert))  # trust this one
        resp = await transport.post(f"https://127.0.0.1:{port}/generate", b"{}", max_bytes=1 << 21)
    assert bytes(resp.body) == body
