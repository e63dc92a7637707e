"""The default transport under asyncio: pooled keep-alive HTTP/1.1 on asyncio's buffered
protocols, standard library only.

The socket reads straight into the body's own buffer, sized by its ``Content-Length``
(aiohttp passed a megabyte through three fresh buffers: ``bench/transport_micro.py``). The
rules are :class:`~opd_stream.AiohttpTransport`'s (one pool while entered, timing by the
caller's cancel scopes, no redirects, proxies or compression, the byte cap, each body charged
to its lease before it is read, :class:`ConnectionFailed` redacted of the key); a request on
a kept-alive connection the server had closed, with no byte back, is sent once more on a
new one. The framing: ``_http1``. In full: ``docs/design-notes.md``,
"opd_stream/transport/_native.py".
"""

from __future__ import annotations

import asyncio
import ssl as _ssl_types
import time
import types
from collections.abc import Callable
from functools import partial
from typing import Self
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._errors import ConfigError, ConnectionFailed, ResponseTooLarge
from ..wire._answers import Body
from ._bodies import BodyPool
from ._budget import BudgetLease
from ._http1 import (
    MAX_HEAD_BYTES,
    ChunkedDecoder,
    FramingError,
    ResponseHead,
    parse_response_head,
    request_head,
)
from ._transports import PooledTransport, Request, Response, kept_headers

__all__ = ("AsyncioTransport",)

_KEEPALIVE_S = 30.0
_STAGING = 16 * 1024
_STAGING_LONG = 256 * 1024  # for a body with no length, read through the staging buffer
_URL_CACHE = 256

_IDLE, _HEAD, _BODY, _CHUNKED, _UNTIL_CLOSE, _WAIT = range(6)


class ServerDisconnected(Exception):
    """The connection ended before the answer was whole."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered  # some byte of the answer had come


class _Target:
    """Where a request's URL goes: the pool's key and what the request head needs."""

    __slots__ = ("host", "host_field", "key", "path", "port", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http:// or https:// URL with a host")  # (never echoed)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        netloc = parts.netloc.rpartition("@")[2]  # never the URL's credentials
        self.host_field = netloc
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.key = (parts.scheme, self.host, self.port)


class _Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection, one request at a time: the socket reads into a staging
    buffer while a head (or a chunked body's framing) is read, and straight into the body's
    own buffer once its length is known (a big one from the transport's ``bodies``)."""

    def __init__(self, bodies: BodyPool) -> None:
        self._bodies = bodies
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.last_used = 0.0
        self._staging = bytearray(_STAGING)
        self._staging_size = _STAGING
        self._staged = 0
        self._mode = _IDLE
        self._waiter: asyncio.Future[None] | None = None
        self._need = 0  # bytes the lease must grant before reading on (mode _WAIT)
        self._resume = _IDLE
        self._failure: BaseException | None = None
        self._answered = False
        self._trailing = False  # bytes came past the body's end
        self._eof = False  # the server ended a body that lasts until it closes
        # the exchange in flight
        self._method = "POST"
        self._max_bytes = 0
        self._lease: BudgetLease | None = None
        self._check: Callable[[ResponseHead], None] | None = None
        self.head: ResponseHead | None = None
        self._view: memoryview | None = None
        self._filled = 0
        self._parts: list[bytes] = []
        self._size = 0
        self._chunks: ChunkedDecoder | None = None

    # --- asyncio's callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._mode == _BODY and self._view is not None:
            return self._view[self._filled :]
        grow = self._staging_size - len(self._staging)
        if self._staged == len(self._staging):  # a long head (up to MAX_HEAD_BYTES)
            grow = max(grow, _STAGING)
        if grow > 0:
            self._staging.extend(bytes(grow))
        return memoryview(self._staging)[self._staged :]

    def buffer_updated(self, nbytes: int) -> None:
        self._answered = self._answered or self._mode != _IDLE
        if self._mode == _BODY:
            self._filled += nbytes
            if self._filled == len(self._view or b""):
                self._finish()
            return
        self._staged += nbytes
        self._advance_or_fail()

    def eof_received(self) -> bool:
        if self._mode == _UNTIL_CLOSE:
            self._eof = True
            self._advance_or_fail()
            if self._mode == _UNTIL_CLOSE:
                self._finish()
        elif self._mode != _IDLE:
            cut = "the server closed the connection mid-answer"
            self._fail(ServerDisconnected(cut, answered=self._answered))
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        if exc is None and self._eof:
            if self._mode == _UNTIL_CLOSE:
                self._finish()
        elif self._mode != _IDLE:
            why = f"the connection was lost: {exc}" if exc else "the server closed the connection"
            self._fail(ServerDisconnected(why, answered=self._answered))

    # --- the state machine ------------------------------------------------------------------

    def _advance_or_fail(self) -> None:
        """:meth:`_advance`; what it meets (the framing, a check of the caller's: the cap,
        the encoding) fails the exchange."""
        try:
            self._advance()
        except Exception as exc:
            self._fail(exc)

    def _advance(self) -> None:
        """Use what the staging buffer holds, in the current mode."""
        if self._mode == _HEAD:
            self._read_head()
        if self._mode == _CHUNKED:
            self._read_chunks()
        elif self._mode == _UNTIL_CLOSE and self._staged:
            self._take(bytes(self._staging[: self._staged]))
            self._staged = 0
        elif self._mode == _IDLE and self._staged:
            self._trailing = True  # bytes nobody asked for: this connection is done
            self._staged = 0
            self.close()

    def _read_head(self) -> None:
        while True:
            end = self._staging.find(b"\r\n\r\n", 0, self._staged)
            if end < 0:
                if self._staged >= MAX_HEAD_BYTES:
                    raise FramingError(f"an answer head over {MAX_HEAD_BYTES // 1024} KiB")
                return
            head = parse_response_head(bytes(self._staging[:end]), method=self._method)
            self._shift(end + 4)
            if not head.informational:
                break
        self.head = head
        assert self._check is not None
        self._check(head)
        if head.chunked or head.until_close:  # read through the staging buffer: a larger one
            self._staging_size = _STAGING_LONG  # (made in get_buffer: it is in use here)
        if head.chunked:
            self._chunks = ChunkedDecoder()
            self._mode = _CHUNKED
        elif head.until_close:
            self._mode = _UNTIL_CLOSE
            self._advance()
        else:
            self._expect(head.length or 0)

    def _expect(self, length: int) -> None:
        """The body has ``length`` bytes (within the cap: the caller's check saw it): charge
        them, then read them into their buffer."""
        if not self._granted(length, _BODY):
            return
        self._start_body(length)

    def _start_body(self, length: int) -> None:
        self._view = self._bodies.take(length)
        have = min(self._staged, length)
        self._view[:have] = memoryview(self._staging)[:have]
        self._filled = have
        self._trailing = self._staged > length
        self._staged = 0
        self._mode = _BODY
        if have == length:
            self._finish()

    def _read_chunks(self) -> None:
        decoder = self._chunks
        assert decoder is not None
        pieces, used = decoder.feed(memoryview(self._staging)[: self._staged])
        data = b"".join(pieces)
        del pieces
        self._shift(used)
        self._take(data)
        if decoder.done and self._mode == _CHUNKED:
            self._trailing = self._staged > 0
            self._staged = 0
            self._finish()

    def _take(self, data: bytes) -> None:
        """Keep ``data`` of a body without a length, under the cap, charged to the lease."""
        if not data:
            return
        if self._size + len(data) > self._max_bytes:
            raise _TooLarge()
        self._size += len(data)
        self._parts.append(data)
        self._granted(len(data), self._mode)

    def _granted(self, size: int, then: int) -> bool:
        """Charge ``size`` bytes to the lease now if it grants them at once; otherwise stop
        reading and let the request's task wait for them (mode ``then`` on grant)."""
        lease = self._lease
        if lease is None or size == 0 or lease.try_grow(size):
            return True
        self._need, self._resume, self._mode = size, then, _WAIT
        if self.transport is not None:
            self.transport.pause_reading()
        self._wake()
        return False

    def granted(self) -> None:
        """The lease granted the bytes the reading waited for: read on."""
        mode, self._need = self._resume, 0
        if mode == _BODY:
            assert self.head is not None
            self._mode = _HEAD  # (a placeholder while the buffer is made)
            self._start_body(self.head.length or 0)
        else:
            self._mode = mode
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        if self._mode in (_CHUNKED, _UNTIL_CLOSE):
            self._advance_or_fail()
            if self._eof and self._mode == _UNTIL_CLOSE:
                self._finish()

    def _shift(self, n: int) -> None:
        """Drop the first ``n`` staged bytes."""
        rest = self._staged - n
        if rest:
            self._staging[:rest] = self._staging[n : self._staged]
        self._staged = rest

    def _finish(self) -> None:
        self._mode = _IDLE
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._mode = _IDLE
        self.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _result(self) -> Body:
        """The body read: its own buffer, or the pieces of one without a length, joined."""
        if self._view is not None:
            return self._view
        if len(self._parts) == 1:
            return self._parts[0]
        return b"".join(self._parts)

    # --- the request's side -----------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Idle, open and with nothing left over from the last answer."""
        return (
            not self.closed
            and self._mode == _IDLE
            and self._failure is None
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _begin(
        self,
        method: str,
        max_bytes: int,
        lease: BudgetLease | None,
        check: Callable[[ResponseHead], None],
    ) -> None:
        """A new exchange's state: nothing read yet, a head awaited."""
        self._method, self._max_bytes, self._lease, self._check = method, max_bytes, lease, check
        self._failure, self._answered, self._trailing, self._eof = None, False, False, False
        self.head, self._view, self._filled = None, None, 0
        self._parts, self._size, self._chunks = [], 0, None
        self._mode = _HEAD

    async def exchange(
        self,
        head: bytes,
        body: bytes | None,
        method: str,
        max_bytes: int,
        lease: BudgetLease | None,
        check: Callable[[ResponseHead], None],
    ) -> tuple[ResponseHead, Body]:
        """Send one request and read its answer whole (raises what the reading met)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._begin(method, max_bytes, lease, check)
        if body is None or len(body) < _STAGING:
            self.transport.write(head + body if body else head)
        else:  # two writes, not a copy of a long body
            self.transport.write(head)
            self.transport.write(body)
        while True:
            self._waiter = loop.create_future()
            if self._mode != _IDLE and self._failure is None:
                await self._waiter
            self._waiter = None
            if self._failure is not None:
                raise self._failure
            if self._mode == _WAIT:
                assert lease is not None
                await lease.grow(self._need)
                self.granted()
                continue
            if self._mode == _IDLE:
                break
        self.last_used = time.monotonic()
        if lease is not None:
            lease.done_reading()
        assert self.head is not None
        result = self._result()
        answer = self.head
        self._view = None
        self._parts = []
        if self._trailing or not answer.keep_alive:
            self.close()
        return answer, result


class _TooLarge(Exception):
    """The body is over the request's cap (raised as ``ResponseTooLarge`` by the caller)."""


class AsyncioTransport(PooledTransport):
    """Pooled keep-alive HTTP/1.1 transport on asyncio's buffered protocols (asyncio only;
    the default under asyncio).

    Keeps :class:`~opd_stream.AiohttpTransport`'s rules (see the module docstring) at a
    fraction of its CPU per answer: the socket reads straight into the body's buffer. An
    answer of 4 MiB or more is read into a buffer the transport keeps (at most 8 and 512
    MiB) and reads a later answer into once nothing refers to the first any more; they
    are dropped as it closes, and as a stream using it idles.

    Args:
        api_key: sent as ``Authorization: Bearer <api_key>``.
        connect_timeout_s: watchdog for establishing a connection.
        pool_size: the most connections in use at once (0 = unlimited); per-endpoint
            concurrency is enforced by the pipeline's own limiters, so this is a backstop.
    """

    def __init__(
        self, *, api_key: str | None = None, connect_timeout_s: float = 10.0, pool_size: int = 0
    ) -> None:
        super().__init__(api_key=api_key, connect_timeout_s=connect_timeout_s, pool_size=pool_size)
        self._fields = tuple(self._headers.items())
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._in_use: set[_Connection] = set()
        self._targets: dict[str, _Target] = {}
        self._slots: anyio.Semaphore | None = None
        self._tls: _ssl_types.SSLContext | None = None
        self._entered = False
        self._bodies = BodyPool()  # big answers' buffers, used again (_bodies)

    async def __aenter__(self) -> Self:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError(
                "the asyncio transport requires the asyncio backend; under trio pass a "
                "transport that supports it (the httpx one is the default there)"
            ) from None
        self._slots = anyio.Semaphore(self._pool_size) if self._pool_size > 0 else None
        self._entered = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self._entered = False
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        for conn in self._in_use:
            conn.abort()
        self._bodies.clear()
        with anyio.CancelScope(shield=True):
            await anyio.lowlevel.checkpoint()  # let the transports' close callbacks run

    @property
    def idle(self) -> bool:
        """True when no connection is checked out (for tests and stats)."""
        return not self._in_use

    def _drop_body_buffers(self) -> None:
        """Drop the big answers' buffers kept for reuse (the stream does so as it idles,
        before it gives freed memory back)."""
        self._bodies.clear()

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _URL_CACHE:
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        return target

    async def send(self, request: Request) -> Response:
        if not self._entered:
            raise RuntimeError("AsyncioTransport used outside its 'async with' block")
        url, max_bytes = request.url, request.max_bytes
        try:
            target = self._target(url)
        except ValueError as exc:
            raise ConnectionFailed(str(exc), url=url) from None
        fields = self._fields
        if request.headers:
            fields = fields + tuple(request.headers.items())
        body = request.body if request.method == "POST" else None
        head = request_head(
            request.method,
            target.path,
            target.host_field,
            fields,
            None if body is None and request.method == "GET" else len(body or b""),
        )

        def check(answer: ResponseHead) -> None:
            self._check_head(
                answer.headers.get("content-encoding", ""), answer.length, max_bytes, url
            )

        if self._slots is not None:
            async with self._slots:
                return await self._send(target, head, body, request, check)
        return await self._send(target, head, body, request, check)

    async def _send(
        self,
        target: _Target,
        head: bytes,
        body: bytes | None,
        request: Request,
        check: Callable[[ResponseHead], None],
    ) -> Response:
        url = request.url
        for fresh_only in (False, True):
            conn = await self._checkout(target, url, fresh_only)
            self._in_use.add(conn)
            try:
                answer, data = await conn.exchange(
                    head, body, request.method, request.max_bytes, request.lease, check
                )
            except ServerDisconnected as exc:
                conn.abort()
                if conn.reused and not exc.answered and not fresh_only:
                    continue  # a kept-alive connection the server had closed: once more
                raise self._failed(exc, url) from None
            except _TooLarge:
                conn.abort()
                raise ResponseTooLarge(request.max_bytes, url=url) from None
            except FramingError as exc:
                conn.abort()
                raise self._failed(exc, url) from None
            except BaseException:  # cancelled, or refused by a check: never reused
                conn.abort()
                raise
            finally:
                self._in_use.discard(conn)
            if conn.usable and self._entered:
                conn.reused = True
                self._idle.setdefault(target.key, []).append(conn)
            return Response(answer.status, data, kept_headers(answer.headers))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _checkout(self, target: _Target, url: str, fresh_only: bool) -> _Connection:
        """An idle connection to ``target`` (the latest used), or a new one."""
        conns = self._idle.get(target.key)
        now = time.monotonic()
        while conns and not fresh_only:
            conn = conns.pop()
            if conn.usable and now - conn.last_used < _KEEPALIVE_S:
                return conn
            conn.close()
        return await self._connect(target, url)

    async def _connect(self, target: _Target, url: str) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = await self._tls_context() if target.tls else None
        try:
            with anyio.fail_after(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    partial(_Connection, self._bodies),
                    target.host,
                    target.port,
                    ssl=tls,
                    server_hostname=target.host if tls is not None else None,
                )
        except TimeoutError as exc:
            raise self._not_connected(exc, url, None) from None
        except _ssl_types.SSLError as exc:  # reached, but not trusted
            raise self._failed(exc, url) from None
        except OSError as exc:  # refused, unreachable, unresolved
            raise self._not_connected(exc, url, exc) from None
        return conn

    async def _tls_context(self) -> _ssl_types.SSLContext:
        """The system's default TLS context, made once (it reads the CA files: a thread)."""
        if self._tls is None:
            self._tls = await anyio.to_thread.run_sync(_ssl_types.create_default_context)
        return self._tls
