"""The transport seam: the stream hands a transport one :class:`Request` per HTTP request
(``send``) and gets one :class:`Response`; the seam's types are public. A transport written
for the old ``post`` / ``get`` still works for one release, wrapped once, when the stream is
made, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import pytest
from support.config import one_pool, stream_config

import opd_stream
from opd_stream import (
    BudgetLease,
    MockTransport,
    OPDStream,
    Request,
    Response,
    Sample,
    ScoredSample,
)
from opd_stream.fleet._balance import ROUTING_KEY_HEADER
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

T = "http://teacher:1"
_cfg = partial(stream_config, T)


def _samples(n: int = 4) -> list[Sample]:
    return [Sample([1, 2, 3, 4 + i, 5, 6], 3) for i in range(n)]


async def _score(stream: OPDStream, samples: list[Sample]) -> list[Any]:
    async with stream, stream.run(samples) as results:
        return [r async for r in results]


class _SendOnly:
    """A user's transport written for the seam: ``send`` and nothing else."""

    def __init__(self, urls: tuple[str, ...] = (T,)) -> None:
        self._inner = mock_transport({u: InProcessSGLang("teacher", 1) for u in urls})
        self.requests: list[Request] = []
        self.charged: list[tuple[int, int]] = []  # (the lease's bytes, the body's) per POST

    async def __aenter__(self) -> _SendOnly:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def send(self, request: Request) -> Response:
        self.requests.append(request)
        resp = await self._inner.send(request)
        if request.lease is not None:
            self.charged.append((request.lease.held, len(resp.body)))
        return resp


async def test_the_stream_sends_one_request_struct_per_http_request() -> None:
    transport = _SendOnly()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a transport with send: no warning
        stream = OPDStream(_cfg(), transport=transport)
    out = await _score(stream, _samples())
    assert all(isinstance(r, ScoredSample) for r in out)
    posts = [r for r in transport.requests if r.method == "POST"]
    assert len(posts) == 4
    for request in posts:
        assert request.url == T + "/generate"
        assert request.max_bytes == stream.config.max_response_bytes
        assert isinstance(request.body, bytes) and request.body.startswith(b"{")
        assert isinstance(request.lease, BudgetLease)
    # each answer was charged to its lease (by the transport) as it was read
    assert len(transport.charged) == 4
    assert all(held == size > 0 for held, size in transport.charged)


async def test_the_routing_key_goes_out_in_the_requests_headers() -> None:
    urls = ("http://a:1", "http://b:1")
    transport = _SendOnly(urls)
    cfg = stream_config(one_pool(urls), balance="prefix")
    out = await _score(OPDStream(cfg, transport=transport), _samples(2))
    assert all(isinstance(r, ScoredSample) for r in out)
    posts = [r for r in transport.requests if r.method == "POST"]
    assert posts and all(ROUTING_KEY_HEADER in (r.headers or {}) for r in posts)


class _PostOnly:
    """A user's transport written for the old seam: ``post`` (with ``headers`` and
    ``lease``, as the old protocol had them) and ``get``."""

    def __init__(self) -> None:
        self._inner = mock_transport({T: InProcessSGLang("teacher", 1)})
        self.posts = 0
        self.charged: list[tuple[int, int]] = []

    async def __aenter__(self) -> _PostOnly:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        max_bytes: int,
        headers: Any = None,
        lease: BudgetLease | None = None,
    ) -> Response:
        self.posts += 1
        resp = await self._inner.post(url, body, max_bytes=max_bytes, lease=lease)
        assert lease is not None  # the adapter passes it: this post takes it
        self.charged.append((lease.held, len(resp.body)))
        return resp

    async def get(self, url: str, *, max_bytes: int) -> Response:
        return await self._inner.get(url, max_bytes=max_bytes)


async def test_an_old_post_transport_warns_once_when_the_stream_is_made() -> None:
    transport = _PostOnly()
    with warnings.catch_warnings(record=True) as made:
        warnings.simplefilter("always")
        stream = OPDStream(_cfg(), transport=transport)  # type: ignore[arg-type]
    assert [w.category for w in made] == [DeprecationWarning]
    assert "_PostOnly implements post()/get()" in str(made[0].message)
    assert "send(request: opd_stream.Request)" in str(made[0].message)
    assert made[0].filename == __file__  # the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none per request
        out = await _score(stream, _samples(6))
    assert all(isinstance(r, ScoredSample) for r in out)
    assert transport.posts == 6
    assert transport.charged and all(held == size > 0 for held, size in transport.charged)


class _CountingMock(MockTransport):
    """A subclass of a built-in transport that overrides the old ``post``."""

    posts = 0

    async def post(self, url: str, body: bytes, **kw: Any) -> Response:
        self.posts += 1
        return await super().post(url, body, **kw)


async def test_a_subclass_overriding_post_is_still_called_through_it() -> None:
    server = InProcessSGLang("teacher", 1)
    transport = _CountingMock(lambda m, url, body: server.handle(m, url[len(T) :], body))
    with pytest.warns(DeprecationWarning, match="_CountingMock implements post"):
        stream = OPDStream(_cfg(), transport=transport)
    out = await _score(stream, _samples(3))
    assert all(isinstance(r, ScoredSample) for r in out)
    assert transport.posts == 3 == server.requests


def test_a_transport_with_neither_send_nor_post_is_refused_when_the_stream_is_made() -> None:
    with pytest.raises(TypeError, match=r"transport must have an async send\(request\)"):
        OPDStream(_cfg(), transport=object())  # type: ignore[arg-type]


def test_the_seams_types_are_public_and_documented() -> None:
    from opd_stream import transport

    for name in ("Transport", "Request", "Response", "BudgetLease"):
        assert name in opd_stream.__all__ and name in transport.__all__
        assert getattr(opd_stream, name) is getattr(transport, name)
        assert (getattr(opd_stream, name).__doc__ or "").strip()
    assert "done_reading" in (Request.__doc__ or "")  # how a transport charges the lease


class _HeadersNoLease:
    """An old transport whose ``post`` took ``headers`` but not yet ``lease``."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def post(self, url: str, body: bytes, *, max_bytes: int, headers: Any = None) -> Response:
        self.calls.append({"url": url, "headers": headers})
        return Response(200, b"x" * 10)


async def test_the_wrapper_passes_the_keywords_an_old_post_takes_and_charges_the_rest() -> None:
    from opd_stream.transport._budget import ByteBudget
    from opd_stream.transport._legacy import PostTransport

    inner = _HeadersNoLease()
    wrapped = PostTransport(inner)
    budget = ByteBudget(1 << 20)
    for n in range(3):
        with budget.lease() as lease:
            request = Request(
                url=f"{T}/{n}", max_bytes=100, body=b"{}", headers={"k": "v"}, lease=lease
            )
            resp = await wrapped.send(request)
            assert (resp.status, lease.held) == (200, 10)  # charged once whole
    assert inner.calls == [{"url": f"{T}/{n}", "headers": {"k": "v"}} for n in range(3)]
    assert wrapped._refused == {"lease"}
