"""An HTTP transport on httpx (anyio-native: runs under asyncio and trio).

The ``httpx`` extra (``pip install 'opd-stream[httpx]'``). :class:`~opd_stream.OPDStream`
picks it by itself under trio, where aiohttp cannot run; under asyncio the default stays
:class:`~opd_stream.AiohttpTransport`, whose rules it keeps: one pooled keep-alive client
while entered, timing by the caller's cancel scopes (a connect watchdog only), no redirects,
proxies or ``.netrc``, the byte cap enforced while reading with each chunk charged to the
request's :class:`~opd_stream.BudgetLease`, no compression (:class:`MalformedResponseError`),
and :class:`ConnectionFailed`, redacted of the key. The rules in full:
``docs/design-notes.md``, "opd_stream/transport/_httpx.py".
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import AsyncIterator
from typing import Self

import anyio.to_thread
import httpx

from .._errors import ResponseTooLarge
from ._transports import PooledTransport, Request, Response, kept_headers

__all__ = ("HttpxTransport",)

_KEEPALIVE_S = 30.0


class HttpxTransport(PooledTransport):
    """Pooled keep-alive httpx transport (any anyio backend: asyncio and trio).

    Args:
        api_key: sent as ``Authorization: Bearer <api_key>``.
        connect_timeout_s: watchdog for establishing a connection.
        pool_size: the client's total connection limit (0 = unlimited); per-endpoint
            concurrency is enforced by the pipeline's own limiters, so this is a backstop.
    """

    _client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Self:
        limits = httpx.Limits(
            max_connections=self._pool_size or None,
            max_keepalive_connections=None,
            keepalive_expiry=_KEEPALIVE_S,
        )
        timeout = httpx.Timeout(connect=self._connect_timeout_s, read=None, write=None, pool=None)
        # made in a worker thread: its TLS context (OpenSSL's, the CA bundle read) is 20-40
        # ms of CPU, 0.1 s the first time, that the caller's loop would wait out
        self._client = await anyio.to_thread.run_sync(
            functools.partial(
                httpx.AsyncClient,
                headers=self._headers,
                timeout=timeout,
                limits=limits,
                follow_redirects=False,
                trust_env=False,
            )
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    @property
    def idle(self) -> bool:
        """True when no pooled connection is busy with a request (for tests and stats)."""
        client = self._client
        if client is None:
            return True
        pool = getattr(client._transport, "_pool", None)
        connections = getattr(pool, "connections", ())
        return all(c.is_idle() or c.is_closed() for c in connections)

    async def send(self, request: Request) -> Response:
        client = self._client
        if client is None:
            raise RuntimeError("HttpxTransport used outside its 'async with' block")
        url, max_bytes, lease = request.url, request.max_bytes, request.lease
        try:
            async with client.stream(
                request.method, url, content=request.body, headers=request.headers
            ) as resp:
                text = resp.headers.get("Content-Length", "").strip()
                declared = int(text) if text.isdigit() else None
                self._check_head(resp.headers.get("Content-Encoding", ""), declared, max_bytes, url)
                chunks = resp.aiter_raw()
                try:
                    buf = await self._read_body(chunks, max_bytes, url, declared, lease)
                except ResponseTooLarge:
                    await _abandon(resp, chunks)
                    raise
                return Response(resp.status_code, buf, kept_headers(resp.headers))  # no copy
        except httpx.ConnectError as exc:  # refused, unreachable, unresolved
            raise self._not_connected(exc, url, _os_error(exc)) from None
        except httpx.ConnectTimeout as exc:  # no answer to the connect
            raise self._not_connected(exc, url, None) from None
        except (httpx.TransportError, httpx.StreamError, OSError) as exc:
            # ConnectError, ReadError, RemoteProtocolError (a body cut short, a malformed
            # status line or header), the connect watchdog: all below HTTP semantics.
            raise self._failed(exc, url) from None


def _os_error(exc: BaseException) -> BaseException:
    """The deepest ``OSError`` with an errno behind an httpx error (its words), else it."""
    found: BaseException = exc
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno:
            found = cause
        cause = cause.__cause__ or cause.__context__
    return found


async def _abandon(resp: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
    """Stop reading a body half way: close the connection, then let the chain of httpx's
    body iterators see it closed and end (closing only the outermost one would leave the
    inner ones to the garbage collector, which trio reports as a ResourceWarning)."""
    await resp.aclose()
    with contextlib.suppress(Exception):  # the read on the closed connection fails: expected
        async for _ in chunks:  # (only what was already buffered, if anything)
            pass
