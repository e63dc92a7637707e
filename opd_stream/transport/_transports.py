"""HTTP transports: the one seam between the pipeline and the network.

A :class:`Transport` has one operation, ``send``: it takes a :class:`Request` and returns a
:class:`Response` whose body was read under the cap (``post`` and ``get`` build the request).
:class:`AiohttpTransport` (asyncio only) was the default before ``_native``'s;
:class:`MockTransport` calls a handler in-process on any anyio backend. Errors:
:class:`ConnectionFailed`, :class:`ResponseTooLarge`, :class:`MalformedResponseError` (a
compressed body); HTTP status
codes are *not* errors here. Every transport charges what it reads to the request's
``lease`` when there is one. In full: ``docs/design-notes.md``,
"opd_stream/transport/_transports.py".
"""

from __future__ import annotations

import abc
import inspect
import os
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Literal, Protocol, Self
from urllib.parse import urlsplit

import anyio.lowlevel
import msgspec
import numpy as np

from .._deprecated import warn_renamed
from .._errors import ConfigError, ConnectionFailed, MalformedResponseError, ResponseTooLarge
from .._redact import redact
from ..wire._answers import Body
from ._budget import BudgetLease
from ._http1 import shown

__all__ = (
    "AiohttpTransport",
    "HTTPMethods",
    "MockTransport",
    "Request",
    "Response",
    "Transport",
)

_READ_CHUNK = 1 << 18
#: Bytes read between two turns given to the event loop (see ``_read_body``).
_YIELD_BYTES = 1 << 20


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """One HTTP request, as the stream hands it to :meth:`Transport.send`.

    Attributes:
        url: the whole URL (``http://host:port/generate``).
        max_bytes: the cap on the answer's body: read no more than this, raise
            :class:`~opd_stream.ResponseTooLarge` instead (a ``Content-Length`` over it is
            refused unread).
        method: ``"POST"`` (a scoring or detection request) or ``"GET"`` (``/health``,
            a gateway's worker list).
        body: the JSON body of a POST (``None`` for a GET).
        headers: sent besides the transport's own (the stream passes a request's routing
            key, ``X-SMG-Routing-Key`` and ``X-SMG-Routing-Tokens``, under the ``prefix``
            balance); ``None``: none.
        lease: the stream's byte budget for this answer (``None``: none): charge each chunk
            as it is read (``await lease.grow(len(chunk))``, which waits while the stream
            holds too many answer bytes), then call ``lease.done_reading()`` once the body
            is whole; a transport that reads the body in one piece calls
            ``await lease.settle(lease.held + len(body))``.

    There is no timeout: the caller bounds a request with its own anyio cancel scopes
    (``request_deadline_s``, ``attempt_timeout_s``), which cancel ``send``.
    """

    url: str
    max_bytes: int
    method: Literal["GET", "POST"] = "POST"
    body: bytes | None = None
    headers: Mapping[str, str] | None = None
    lease: BudgetLease | None = None


class Response(msgspec.Struct, frozen=True):
    """An HTTP answer: status code and the whole body.

    ``body`` is a :data:`~opd_stream.wire._answers.Body`: ``bytes``, or from the built-in
    transports what it was read into (copying a 36 MB answer into ``bytes`` would hold the
    event loop ~30 ms). Treat it as read-only.
    """

    status: int
    body: Body
    headers: Mapping[str, str] | None = None
    """Of the answer's headers, those in :data:`KEPT_HEADERS` that it had (lower-case
    names); ``None`` when it had none of them (a transport may leave it ``None``)."""


KEPT_HEADERS = ("retry-after", "x-smg-routed-worker-id")
"""The answer headers a transport passes on (``Retry-After`` on 429/503, smg's worker)."""


def kept_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The :data:`KEPT_HEADERS` of ``headers`` (a case-insensitive mapping)."""
    out = {name: value for name in KEPT_HEADERS if (value := headers.get(name)) is not None}
    return out or None


class Transport(Protocol):
    """What the pipeline needs from HTTP: an async context manager (entered once, around
    the stream's life) whose :meth:`send` makes one request.

    A transport written for the ``post(url, body, *, max_bytes, headers=, lease=)`` and
    ``get(url, *, max_bytes)`` of releases before :class:`Request` still works for one
    release: :class:`~opd_stream.OPDStream` wraps it (a ``DeprecationWarning``, once, when
    the stream is made).
    """

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None: ...

    async def send(self, request: Request) -> Response:
        """Send ``request``; its answer, the body read under ``request.max_bytes`` and
        charged to ``request.lease`` (see :class:`Request`).

        Raises:
            ConnectionFailed: no answer (refused, reset, cut short); ``refused=True`` when
                no connection could be made at all.
            ResponseTooLarge: the body is over ``request.max_bytes``.
        """
        ...


class HTTPMethods(abc.ABC):
    """``post`` and ``get`` over ``send``, for the transports here: each builds the
    :class:`Request` and sends it."""

    @abc.abstractmethod
    async def send(self, request: Request) -> Response:
        """Send ``request`` (see :meth:`Transport.send`)."""

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        max_bytes: int,
        headers: Mapping[str, str] | None = None,
        lease: BudgetLease | None = None,
    ) -> Response:
        """POST ``body`` (JSON) to ``url``; read at most ``max_bytes`` of the answer."""
        request = Request(url=url, max_bytes=max_bytes, body=body, headers=headers, lease=lease)
        return await self.send(request)

    async def get(self, url: str, *, max_bytes: int) -> Response:
        """GET ``url``; read at most ``max_bytes`` of the answer."""
        return await self.send(Request(url=url, max_bytes=max_bytes, method="GET"))


Handler = Callable[[str, str, bytes], "Response | Awaitable[Response]"]


class MockTransport(HTTPMethods):
    """A transport that answers every request by calling ``handler(method, url, body)``.

    The handler may be sync or async and returns a :class:`Response`; it may raise
    :class:`ConnectionFailed` to simulate a network failure. The byte cap is enforced
    on what it returns, like a real transport.

    Gateway discovery's ``GET .../workers`` and ``GET .../v1/rl/workers``
    (``gateway_discovery="auto"``) are answered 404, as a plain SGLang server answers them,
    without calling the handler; pass ``gateways=True`` to let the handler answer them (to
    play a gateway: smg, sglang-router). (``routers=``, its name before 1.0, still works for
    one release, with a ``DeprecationWarning``.)
    ``last_headers`` holds the extra headers of the last POST (``None``: none). The
    ``lease`` of a request is charged once the handler's answer is whole.
    """

    def __init__(
        self, handler: Handler, *, gateways: bool = False, routers: bool | None = None
    ) -> None:
        if routers is not None:
            warn_renamed("MockTransport(routers=...)", "MockTransport(gateways=...)")
            gateways = gateways or routers
        self._handler = handler
        self._gateways = gateways
        self.requests = 0
        self.last_headers: dict[str, str] | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        return None

    async def send(self, request: Request) -> Response:
        method, url, max_bytes = request.method, request.url, request.max_bytes
        if method == "POST":
            self.last_headers = dict(request.headers) if request.headers else None
        elif not self._gateways and url.split("?")[0].endswith("/workers"):
            # (also smg's /v1/rl/workers)
            return Response(404, b'{"detail":"Not Found"}')
        self.requests += 1
        result = self._handler(method, url, request.body or b"")
        if inspect.isawaitable(result):
            result = await result
        assert isinstance(result, Response)
        if len(result.body) > max_bytes:
            raise ResponseTooLarge(max_bytes, url=url)
        if request.lease is not None:
            await request.lease.settle(len(result.body))
        return result


class PooledTransport(HTTPMethods):
    """What both pooled HTTP transports share (aiohttp here, httpx in ``_httpx``):
    the headers (``Accept-Encoding: identity``, the bearer token), the refusal of a
    compressed answer, reading a body under the byte cap while charging the budget lease it
    was given, and turning connection problems into a redacted :class:`ConnectionFailed`.
    Subclasses implement ``send``.

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(connect_timeout_s={self._connect_timeout_s})"

    @staticmethod
    def _check_head(encoding: str, declared: int | None, max_bytes: int, url: str) -> None:
        """Refuse, before reading it, a compressed body or one declared over the cap."""
        encoding = encoding.strip().lower()
        if encoding not in ("", "identity"):
            raise MalformedResponseError(
                f"the server sent a compressed body (Content-Encoding: "
                f"{shown(encoding)}) although none was asked for; refused unread",
                url=url,
            )
        if declared is not None and declared > max_bytes:
            raise ResponseTooLarge(max_bytes, url=url)

    @staticmethod
    async def _read_body(
        chunks: AsyncIterator[bytes],
        max_bytes: int,
        url: str,
        declared: int | None = None,
        lease: BudgetLease | None = None,
    ) -> Body:
        """The body, chunk by chunk: the cap enforced as it is read (a lying or absent
        ``Content-Length`` included), each chunk charged to ``lease`` (when given).

        With a ``Content-Length`` (``declared``, already checked against the cap), each
        chunk is copied as it comes into an uninitialised buffer of that size (numpy's:
        ``bytearray(n)`` would zero it first, on the loop), given back as a memoryview: the
        one copy of the body is spread over its chunks, between which the loop gets its
        turns. Without one (or past it), the chunks are kept and joined once at the end
        (a single copy, but one that holds the loop: 5-20 ms for a 46 MB answer; a
        bytearray grown chunk by chunk would be copied again at each realloc that cannot
        grow in place, ~10 copies of such a body once glibc serves it from the heap).
        """
        view = np.empty(declared or 0, dtype=np.uint8).data
        parts: list[bytes] = []
        size = copied = since_yield = 0
        async for chunk in chunks:
            n = len(chunk)
            if size + n > max_bytes:
                raise ResponseTooLarge(max_bytes, url=url)
            if lease is not None:
                await lease.grow(n)
            if not parts and copied + n <= len(view):
                view[copied : copied + n] = chunk
                copied += n
            else:  # no length declared, or more bytes than it said
                parts.append(chunk)
            size += n
            since_yield += n
            if since_yield >= _YIELD_BYTES:  # buffered chunks come without a suspension:
                since_yield = 0  # let the loop run between megabytes
                await anyio.lowlevel.checkpoint()
        if lease is not None:
            lease.done_reading()
        if parts:
            return bytearray().join([view[:copied], *parts])
        return view[:copied] if copied < len(view) else view

    def _failed(self, exc: BaseException, url: str) -> ConnectionFailed:
        """A connection problem below HTTP semantics; what the server sent back is redacted
        before the cut."""
        detail = redact(str(exc), self._api_key)[:200]
        return ConnectionFailed(
            f"{type(exc).__name__} talking to the server" + (f": {detail}" if detail else ""),
            url=url,
        )

    def _not_connected(
        self, exc: BaseException, url: str, os_error: BaseException | None
    ) -> ConnectionFailed:
        """No connection could be made to ``url``'s host (``refused``): the message names
        the host, the port and the system's words for the error (``Connection refused``;
        for ``os_error`` None, a connect that timed out), and nothing else (no TLS setting
        for an ``http://`` URL, no payload)."""
        parts = urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            port = 0
        errno = getattr(os_error, "errno", None)
        if os_error is None:
            why = f"no connection within connect_timeout_s={self._connect_timeout_s:g} s"
        elif isinstance(errno, int) and errno > 0:
            why = os.strerror(errno)
        else:
            why = str(getattr(os_error, "strerror", None) or os_error or type(exc).__name__)
        return ConnectionFailed(
            f"cannot connect to {parts.hostname}:{port}: {why[:200]}", url=url, refused=True
        )


class AiohttpTransport(PooledTransport):
    """Pooled keep-alive aiohttp transport (asyncio only).

    One ``ClientSession`` is created when the transport is entered (inside the running
    loop) and closed when it is left. Timing is owned by the caller's anyio cancel scopes;
    the session keeps only a connect watchdog. Redirects are not followed. The bearer
    token, when given, is sent on every request and never logged; what the server sends
    back in a connection error is redacted. No compression is asked for
    (``Accept-Encoding: identity``; SGLang does not compress) and none is undone: an answer
    with a ``Content-Encoding`` is refused unread, so no body can inflate past the cap.

    Args:
        api_key: sent as ``Authorization: Bearer <api_key>``.
        connect_timeout_s: watchdog for establishing a connection.
        pool_size: the connector's total connection limit (0 = unlimited); per-endpoint
            concurrency is enforced by the pipeline's own limiters, so this is a backstop.
    """

    _session: object | None = None

    async def __aenter__(self) -> Self:
        import asyncio

        import aiohttp

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError(
                "the aiohttp transport requires the asyncio backend; under trio pass a "
                "transport that supports it (e.g. MockTransport in tests)"
            ) from None
        connector = aiohttp.TCPConnector(limit=self._pool_size, keepalive_timeout=30.0)
        timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=self._connect_timeout_s, sock_read=None
        )
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=self._headers, auto_decompress=False
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        import aiohttp

        session = self._session
        self._session = None
        if isinstance(session, aiohttp.ClientSession):
            await session.close()

    @property
    def idle(self) -> bool:
        """True when no pooled connection is checked out (for tests and stats)."""
        import aiohttp

        session = self._session
        if not isinstance(session, aiohttp.ClientSession):
            return True
        connector = session.connector
        acquired = getattr(connector, "_acquired", ())
        return len(acquired) == 0

    async def send(self, request: Request) -> Response:
        import aiohttp

        session = self._session
        if not isinstance(session, aiohttp.ClientSession):
            raise RuntimeError("AiohttpTransport used outside its 'async with' block")
        url, max_bytes, lease = request.url, request.max_bytes, request.lease
        try:
            async with session.request(
                request.method,
                url,
                data=request.body,
                headers=request.headers,
                allow_redirects=False,
            ) as resp:
                self._check_head(
                    resp.headers.get("Content-Encoding", ""), resp.content_length, max_bytes, url
                )
                chunks = resp.content.iter_chunked(_READ_CHUNK)
                buf = await self._read_body(chunks, max_bytes, url, resp.content_length, lease)
                return Response(resp.status, buf, kept_headers(resp.headers))  # no copy
        except aiohttp.ClientConnectorCertificateError as exc:  # reached, but not trusted
            raise self._failed(exc, url) from None
        except aiohttp.ClientConnectorError as exc:  # refused, unreachable, unresolved
            raise self._not_connected(exc, url, exc.os_error) from None
        except aiohttp.ConnectionTimeoutError as exc:  # no answer to the connect
            raise self._not_connected(exc, url, None) from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            # ClientPayloadError (truncated / reset mid-body), ServerDisconnectedError,
            # ClientConnectorError, socket timeouts: all below HTTP semantics.
            # aiohttp may quote a bad header line the server sent: redacted before the cut.
            raise self._failed(exc, url) from None
