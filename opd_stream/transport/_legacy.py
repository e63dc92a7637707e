"""A transport written for ``post`` / ``get`` (before :class:`~opd_stream.Request`), kept
working for one release: :func:`as_transport` wraps it once, when the stream is made, with a
``DeprecationWarning``; the stream then only calls ``send``.
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Self, cast

from ._transports import Request, Response, Transport

__all__ = ("PostTransport", "as_transport")


def as_transport(transport: object) -> Transport:
    """``transport`` as the stream calls it: itself when it has ``send`` (a
    :class:`~opd_stream.Transport`), else one with ``post`` and ``get`` wrapped in a
    :class:`PostTransport` (a ``DeprecationWarning``, here, once per wrapping).

    A class that overrides ``post`` or ``get`` below the class that gives it ``send`` (a
    subclass of a built-in transport written for the old seam) is wrapped too, so that its
    override is still what is called.

    Raises:
        TypeError: ``transport`` has neither ``send`` nor ``post``.
    """
    send = getattr(transport, "send", None)
    if callable(send) and not _overrides_old_methods(type(transport)):
        return cast(Transport, transport)
    if not callable(getattr(transport, "post", None)):
        raise TypeError(
            f"transport must have an async send(request) (opd_stream.Transport), got "
            f"{type(transport).__name__}"
        )
    warnings.warn(
        f"{type(transport).__name__} implements post()/get(), which the stream no longer "
        "calls: implement send(request: opd_stream.Request) -> opd_stream.Response instead "
        "(this transport is wrapped for now; the wrapping goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    return PostTransport(transport)


def _overrides_old_methods(cls: type) -> bool:
    """``post`` or ``get`` is defined by a class below the one that defines ``send``."""
    mro = cls.__mro__

    def definer(name: str) -> int:
        return next((n for n, c in enumerate(mro) if name in vars(c)), len(mro))

    return min(definer("post"), definer("get")) < definer("send")


class PostTransport:
    """A transport with ``post(url, body, *, max_bytes, headers=, lease=)`` and
    ``get(url, *, max_bytes)`` seen through ``send``.

    ``headers`` and ``lease`` are passed when the request has them and the transport's
    ``post`` takes them: one written before a keyword existed refuses it on the first call
    (the ``TypeError`` of the call itself, raised before it runs), and is not passed it
    again. An answer read without the lease is charged to it once it is whole.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._refused: set[str] = set()  # the optional keywords its post does not take

    def __repr__(self) -> str:
        return f"PostTransport({self.inner!r})"

    async def __aenter__(self) -> Self:
        await self.inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.inner.__aexit__(exc_type, exc, tb)

    async def send(self, request: Request) -> Response:
        if request.method == "GET":
            return _response(await self.inner.get(request.url, max_bytes=request.max_bytes))
        given = {"headers": request.headers, "lease": request.lease}
        extra = {k: v for k, v in given.items() if v is not None and k not in self._refused}
        while True:
            try:  # binds the arguments (a refused keyword raises here), runs nothing yet
                call = self.inner.post(
                    request.url, request.body or b"", max_bytes=request.max_bytes, **extra
                )
                break
            except TypeError as exc:
                refused = {k for k in extra if f"'{k}'" in str(exc)}
                if not refused:
                    raise
                self._refused |= refused
                extra = {k: v for k, v in extra.items() if k not in refused}
        resp = _response(await call)
        lease = request.lease
        if lease is not None and "lease" not in extra:  # charged after the fact
            await lease.settle(lease.held + len(resp.body))
        return resp


def _response(resp: Any) -> Response:
    """A :class:`Response` (a user's answer object may be another with the same fields, or
    predate ``headers``)."""
    if isinstance(resp, Response):
        return resp
    return Response(resp.status, resp.body, getattr(resp, "headers", None))
