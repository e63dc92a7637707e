"""Security: the API key stays secret, URLs are checked, redirects are not followed, the
response byte cap holds, and logs carry shapes and counts only.

Real HTTP on 127.0.0.1 (asyncio): the mock SGLang server, small aiohttp apps, and a raw
asyncio server for answers aiohttp's server will not produce (endless chunked bodies,
lying ``Content-Length``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import msgspec
import numpy as np
import pytest
from aiohttp import web
from support.config import FAST_BACKOFF, stream_config

from opd_stream import (
    AiohttpTransport,
    ConfigError,
    ConnectionFailed,
    OPDStream,
    ResponseTooLarge,
    Sample,
    SampleFailure,
    ScoredSample,
    StreamConfig,
)
from opd_stream.testing import capture_events
from opd_stream.testing.mock_sglang import MockOptions, serve_mock

KEY = "sk-opd-7f3a9c1e5b2d4f60"
TOKENS_LO = 100_000  # sample token ids are >= this: no count, position or port reaches it


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


@pytest.fixture
def events() -> Iterator[list[dict[str, Any]]]:
    """Every structlog event (every level) emitted while the test runs."""
    with capture_events() as captured:
        yield captured


def _samples(n: int, *, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(3, 7)), int(rng.integers(2, 6))
        tokens = rng.integers(TOKENS_LO, 150_000, p + r).tolist()
        rollout = [-0.5] * r
        out.append(Sample(tokens, r, rollout_logprobs=rollout, sample_id=i))
    return out


_cfg = partial(stream_config, **FAST_BACKOFF, request_deadline_s=2.0)


async def _run(
    cfg: StreamConfig, samples: list[Sample], transport: Any = None
) -> tuple[list[ScoredSample | SampleFailure], Any, OPDStream]:
    async with OPDStream(cfg, transport=transport) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
        return out, stream.stats(), stream


# --------------------------------------------------------------------------- the API key


@asynccontextmanager
async def _app(handler: Any, path: str = "/generate") -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_api_key_goes_out_only_as_a_bearer_header() -> None:
    seen: list[dict[str, str]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        assert KEY not in (await request.read()).decode()
        return web.json_response({"error": {"message": "no"}}, status=400)

    async with _app(record) as url:
        out, _, _ = await _run(_cfg(url, api_key=KEY), _samples(2))
    assert [f.reason for f in out] == ["teacher_http_400"] * 2
    assert len(seen) == 2
    for headers in seen:
        assert headers["Authorization"] == f"Bearer {KEY}"
        others = {k: v for k, v in headers.items() if k != "Authorization"}
        assert KEY not in repr(others)
        assert "?" not in headers.get("Host", "")


async def test_api_key_never_appears_in_repr_logs_errors_or_stats(
    events: list[dict[str, Any]],
) -> None:
    opts = MockOptions(api_key=KEY, fault_http_500=0.3, fault_misaligned=0.2, fault_seed=5)
    async with serve_mock("teacher", 1, options=opts) as teacher:
        cfg = _cfg(teacher.url, api_key=KEY, max_attempts=2)
        transport = AiohttpTransport(api_key=KEY)
        out, stats, stream = await _run(cfg, _samples(40), transport)
        # and with a wrong key: every request answers 401
        wrong = _cfg(teacher.url, api_key="sk-wrong-key", max_attempts=1)
        out401, _, _ = await _run(wrong, _samples(3))
    assert teacher.stats[0].generate_requests > 40  # retries happened
    assert {f.reason for f in out if isinstance(f, SampleFailure)} >= {"misaligned_response"}
    assert {f.reason for f in out401} == {"teacher_http_401"}
    texts = [repr(cfg), str(cfg), repr(stream), repr(transport), msgspec.json.encode(stats)]
    texts += [msgspec.json.encode(cfg.to_log_dict())]
    texts += [f"{f.message} {f.reason} {f!r}" for f in out + out401 if isinstance(f, SampleFailure)]
    texts += [repr(e) for e in events]
    assert events, "the run logged nothing: the capture is not working"
    for text in texts:
        assert KEY not in str(text)


async def test_a_server_echoing_the_key_does_not_get_it_into_errors_or_logs(
    events: list[dict[str, Any]],
) -> None:
    async def echo(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        return web.json_response({"error": {"message": f"bad token: {auth}"}}, status=403)

    async with _app(echo) as url:
        out, stats, _ = await _run(_cfg(url, api_key=KEY), _samples(2))
    assert [f.reason for f in out] == ["teacher_http_403"] * 2
    for f in out:
        assert isinstance(f, SampleFailure)
        assert "bad token" in f.message
        assert KEY not in f.message
    assert all(KEY not in repr(e) for e in events)
    assert KEY not in msgspec.json.encode(stats).decode()


async def test_redirects_are_not_followed_and_the_key_does_not_travel() -> None:
    hits: list[str] = []

    async def target(request: web.Request) -> web.Response:
        hits.append(request.headers.get("Authorization", ""))
        return web.json_response({})

    async with _app(target) as elsewhere:

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(elsewhere + "/generate")

        async with _app(redirect) as url:
            out, _, _ = await _run(_cfg(url, api_key=KEY), _samples(2))
    assert [f.reason for f in out] == ["teacher_http_307"] * 2
    assert hits == []


# --------------------------------------------------------------------------- server URLs


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "unix:///var/run/sglang.sock",
        "javascript:alert(1)",
        "gopher://h:70",
        "http:///generate",
        "https://",
        "//h:30000",
    ],
)
@pytest.mark.parametrize("field", ["teachers", "student_url"])
def test_server_urls_must_be_http_or_https_with_a_host(field: str, url: str) -> None:
    kw: dict[str, Any] = {"teachers": "http://t:1", field: url}
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_env({}, **kw)
    assert str(info.value).startswith(field)


# --------------------------------------------------------------------------- the byte cap


@asynccontextmanager
async def _raw_server(head: bytes, body_chunk: bytes, *, chunked: bool) -> AsyncIterator[Any]:
    """A server that answers every request with ``head`` then ``body_chunk`` forever.

    Yields ``(url, sent)`` where ``sent[0]`` counts body bytes written and ``sent[1]`` the
    answers that ended (the client went away).
    """
    sent = [0, 0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(head)
            while True:
                frame = (
                    f"{len(body_chunk):x}\r\n".encode() + body_chunk + b"\r\n"
                    if chunked
                    else body_chunk
                )
                writer.write(frame)
                sent[0] += len(body_chunk)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            sent[1] += 1

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", sent
    finally:
        server.close()
        await server.wait_closed()


CAP = 64 * 1024


def _socket_buffers() -> int:
    """The most a loopback connection's two kernel buffers can hold (Linux), else 0."""
    total = 0
    for name in ("tcp_rmem", "tcp_wmem"):
        try:
            with open(f"/proc/sys/net/ipv4/{name}") as f:
                total += int(f.read().split()[-1])
        except (OSError, ValueError, IndexError):
            pass
    return total


_JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


async def test_the_byte_cap_holds_for_an_endless_chunked_body() -> None:
    head = _JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    async with _raw_server(head, b"x" * 4096, chunked=True) as (url, sent):
        async with AiohttpTransport() as transport:
            with pytest.raises(ResponseTooLarge):
                await asyncio.wait_for(transport.post(url + "/generate", b"{}", max_bytes=CAP), 30)
            assert transport.idle
        for _ in range(500):  # the client went away: the server's writes fail, it stops
            if sent[1]:
                break
            await asyncio.sleep(0.01)
    assert sent[1] == 1
    # what the server got out before it noticed fits in the cap and the two sockets'
    # kernel buffers (autotuned up to net.ipv4.tcp_rmem / tcp_wmem's maxima)
    assert sent[0] < 64 * CAP + _socket_buffers()


async def test_the_byte_cap_holds_when_content_length_understates_the_body() -> None:
    head = _JSON_HEAD + b"Content-Length: 100\r\n\r\n"
    async with _raw_server(head, b"x" * 4096, chunked=False) as (url, _):
        async with AiohttpTransport() as transport:
            try:
                resp = await asyncio.wait_for(
                    transport.post(url + "/generate", b"{}", max_bytes=CAP), 30
                )
            except ConnectionFailed:
                return  # aiohttp's parser saw bytes beyond the declared length: refused
    assert resp.status == 200 and len(resp.body) == 100  # never more than declared


async def test_a_content_length_above_the_cap_is_refused_before_reading() -> None:
    head = _JSON_HEAD + f"Content-Length: {100 * CAP}\r\n\r\n".encode()
    async with _raw_server(head, b"x" * 4096, chunked=False) as (url, _):
        async with AiohttpTransport() as transport:
            with pytest.raises(ResponseTooLarge, match=f"{CAP}-byte cap"):
                await asyncio.wait_for(transport.post(url + "/generate", b"{}", max_bytes=CAP), 30)


async def test_an_endless_chunked_answer_fails_its_sample_with_response_too_large() -> None:
    head = _JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    async with _raw_server(head, b"[" * 4096, chunked=True) as (url, _):
        out, stats, _ = await _run(_cfg(url, max_response_bytes=CAP), _samples(3))
    assert [f.reason for f in out] == ["response_too_large"] * 3
    assert stats.bytes_received == 0


async def test_a_lying_content_length_fails_its_sample_without_a_result() -> None:
    head = _JSON_HEAD + b"Content-Length: 100\r\n\r\n"
    async with _raw_server(head, b'{"meta_info": {"x": [' * 200, chunked=False) as (url, _):
        out, _, _ = await _run(_cfg(url, max_response_bytes=CAP, max_attempts=2), _samples(3))
    assert len(out) == 3
    assert all(isinstance(f, SampleFailure) for f in out)
    assert {f.reason for f in out} <= {"malformed_response", "connection_error"}


# --------------------------------------------------------------------------- logs


_FLOAT_LIST = re.compile(r"\[\s*-?\d+\.\d+(?:e-?\d+)?\s*,\s*-?\d")
_INT = re.compile(r"\d+")


async def test_logs_hold_shapes_and_counts_never_token_ids_or_logprob_lists(
    events: list[dict[str, Any]],
) -> None:
    opts = MockOptions(
        fault_http_503=0.1,
        fault_misaligned=0.1,
        fault_malformed=0.1,
        fault_seed=3,
        per_position="unpatched",
    )
    samples = _samples(40, seed=2)
    async with (
        serve_mock("teacher", 2, options=opts) as teacher,
        serve_mock("student", 2, options=opts) as student,
    ):
        cfg = _cfg(teacher.url, student_url=student.url, top_k=3, strategy="union", max_attempts=2)
        out, _, _ = await _run(cfg, samples)
        sampled, _, _ = await _run(_cfg(teacher.url), samples)
    results = out + sampled
    assert any(isinstance(r, SampleFailure) for r in results)
    assert any(isinstance(r, ScoredSample) for r in results)
    names = {e["event"] for e in events}
    assert {"stream_started", "run_finished", "sample_failed", "retry"} <= names, names
    token_ids = {t for s in samples for t in s.tokens}
    for event in events:
        for key, value in event.items():
            assert not isinstance(value, (list, tuple, np.ndarray)) or key == "teachers", event
        text = repr(event)
        assert not _FLOAT_LIST.search(text), event
        assert not token_ids & {int(m) for m in _INT.findall(text)}, event
    for res in results:
        if isinstance(res, SampleFailure):
            assert not _FLOAT_LIST.search(res.message), res.message
            assert not token_ids & {int(m) for m in _INT.findall(res.message)}, res.message
