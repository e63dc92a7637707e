"""An HTTP transport on httpx (anyio-native: runs under asyncio and trio).

The ``httpx`` extra (``pip install 'opd-stream[httpx]'``). :class:`~opd_stream.OPDStream`
picks it by itself under trio, where aiohttp cannot run; under asyncio the default stays
:class:`~opd_stream.AiohttpTransport`. It keeps the aiohttp transport's rules:

* one pooled keep-alive client, created when the transport is entered (inside the running
  loop) and closed when it is left; the pool has no limit of its own unless ``pool_size``
  says so (the pipeline's per-endpoint limiters bound concurrency) and keeps every idle
  connection alive for 30 s;
* timing is owned by the caller's anyio cancel scopes; the client keeps only a connect
  watchdog (``connect_timeout_s``): no read, write or pool timeout;
* redirects are not followed (a 3xx is handed to the caller as it is), and no proxy or
  ``.netrc`` setting of the environment is read (aiohttp's default too);
* the byte cap is enforced while reading (a lying or absent ``Content-Length`` included),
  and each chunk is charged to the task's :class:`~opd_stream._budget.BudgetLease`;
* no compression is asked for (``Accept-Encoding: identity``) and none is undone: a body
  with a ``Content-Encoding`` is refused unread (:class:`MalformedResponseError`);
* connection problems become :class:`ConnectionFailed`, redacted of the key.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import AsyncIterator, Mapping
from typing import Self

import httpx

from ._budget import current_lease
from ._errors import ConnectionFailed, MalformedResponseError, ResponseTooLarge
from ._redact import redact
from ._transport import Response, _show_token

__all__ = ("HttpxTransport",)

_KEEPALIVE_S = 30.0


class HttpxTransport:
    """Pooled keep-alive httpx transport (any anyio backend: asyncio and trio).

    Args:
        api_key: sent as ``Authorization: Bearer <api_key>``.
        connect_timeout_s: watchdog for establishing a connection.
        pool_size: the client's total connection limit (0 = unlimited); per-endpoint
            concurrency is enforced by the pipeline's own limiters, so this is a backstop.
    """

    def __init__(
        self, *, api_key: str | None = None, connect_timeout_s: float = 10.0, pool_size: int = 0
    ) -> None:
        self._headers: Mapping[str, str] = {
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
        }
        self._api_key = api_key or None
        if api_key:
            self._headers = {**self._headers, "Authorization": f"Bearer {api_key}"}
        self._connect_timeout_s = connect_timeout_s
        self._pool_size = pool_size
        self._client: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"HttpxTransport(connect_timeout_s={self._connect_timeout_s})"

    async def __aenter__(self) -> Self:
        limits = httpx.Limits(
            max_connections=self._pool_size or None,
            max_keepalive_connections=None,
            keepalive_expiry=_KEEPALIVE_S,
        )
        timeout = httpx.Timeout(connect=self._connect_timeout_s, read=None, write=None, pool=None)
        self._client = httpx.AsyncClient(
            headers=self._headers,
            timeout=timeout,
            limits=limits,
            follow_redirects=False,
            trust_env=False,
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

    async def post(self, url: str, body: bytes, *, max_bytes: int) -> Response:
        return await self._request("POST", url, body, max_bytes)

    async def get(self, url: str, *, max_bytes: int) -> Response:
        return await self._request("GET", url, None, max_bytes)

    async def _request(self, method: str, url: str, body: bytes | None, max_bytes: int) -> Response:
        client = self._client
        if client is None:
            raise RuntimeError("HttpxTransport used outside its 'async with' block")
        try:
            async with client.stream(method, url, content=body) as resp:
                encoding = resp.headers.get("Content-Encoding", "").strip().lower()
                if encoding not in ("", "identity"):
                    raise MalformedResponseError(
                        f"the server sent a compressed body (Content-Encoding: "
                        f"{_show_token(encoding)}) although none was asked for; refused unread",
                        url=url,
                    )
                declared = resp.headers.get("Content-Length", "").strip()
                if declared.isdigit() and int(declared) > max_bytes:
                    raise ResponseTooLarge(max_bytes, url=url)
                lease = current_lease()
                buf = bytearray()
                chunks = resp.aiter_raw()
                async for chunk in chunks:
                    if len(buf) + len(chunk) > max_bytes:
                        await _abandon(resp, chunks)
                        raise ResponseTooLarge(max_bytes, url=url)
                    if lease is not None:
                        await lease.grow(len(chunk))
                    buf += chunk
                if lease is not None:
                    lease.done_reading()
                return Response(resp.status_code, buf)  # no copy: see Response
        except (httpx.TransportError, httpx.StreamError, OSError) as exc:
            # ConnectError, ReadError, RemoteProtocolError (a body cut short, a malformed
            # status line or header), the connect watchdog: all below HTTP semantics.
            detail = redact(str(exc), self._api_key)[:200]
            raise ConnectionFailed(
                f"{type(exc).__name__} talking to the server" + (f": {detail}" if detail else ""),
                url=url,
            ) from None


async def _abandon(resp: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
    """Stop reading a body half way: close the connection, then let the chain of httpx's
    body iterators see it closed and end (closing only the outermost one would leave the
    inner ones to the garbage collector, which trio reports as a ResourceWarning)."""
    await resp.aclose()
    with contextlib.suppress(Exception):  # the read on the closed connection fails: expected
        async for _ in chunks:  # (only what was already buffered, if anything)
            pass
