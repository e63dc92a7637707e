"""Hostile servers (issue 17): key echoes past the message caps, credentials in URLs,
compression bombs, and the per-stream byte budget.

The servers are small raw asyncio socket servers on 127.0.0.1 (a free port, started and
stopped by each test): they answer exactly the bytes a test gives them, which aiohttp's
own server would not (echoed headers cut at chosen offsets, gzip bodies, aborts).
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import structlog
from support.cli import run_cli
from support.config import FAST_BACKOFF, stream_config

from opd_stream import (
    AiohttpTransport,
    ConfigError,
    MalformedResponseError,
    OPDStream,
    Sample,
    SampleFailure,
    ScoredSample,
    StreamConfig,
)
from opd_stream._redact import redact
from opd_stream.cli._main import main
from opd_stream.testing import capture_events
from opd_stream.transport._budget import ByteBudget
from opd_stream.wire._codec import PARSERS
from opd_stream.wire._error_body import parse_error_message

KEY = "sk-Zq81-7f3aQv9c1e5b2d4XwY"  # 26 characters, none of them in the padding
ODD_KEY = "k\"ey\\Zq81-sec/ret'Wq7"  # quote, backslash, slash, apostrophe


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # the aiohttp transport is asyncio only


@pytest.fixture
def events() -> Iterator[list[dict[str, Any]]]:
    with capture_events() as captured:
        yield captured


def _windows(secret: str, size: int = 4) -> list[str]:
    """Every run of ``size`` characters of ``secret`` (and of its JSON escaping)."""
    out = set()
    for form in (secret, msgspec.json.encode(secret).decode()[1:-1]):
        out.update(form[i : i + size] for i in range(len(form) - size + 1))
    return sorted(out)


def _assert_no_key(text: str, secret: str = KEY) -> None:
    leaked = [w for w in _windows(secret) if w in text]
    assert not leaked, (leaked, text)


# --------------------------------------------------------------------------- the server


Answer = Callable[[dict[str, str]], bytes]


@asynccontextmanager
async def raw_server(answer: Answer) -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """Answers each request with ``answer(request headers)`` (a whole HTTP response).

    Yields ``(base URL, the headers of every request seen)``. One request per connection.
    """
    seen: list[dict[str, str]] = []

    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    data += await stream.receive()
                head, _, body = data.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")[1:]
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)
                }
                length = int(headers.get("content-length", "0"))
                while len(body) < length:
                    body += await stream.receive()
                seen.append(headers)
                await stream.send(answer(headers))
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                pass

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        try:
            yield f"http://127.0.0.1:{port}", seen
        finally:
            tg.cancel_scope.cancel()


def http(status: int, body: bytes, *, headers: tuple[str, ...] = ()) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 403: "Forbidden"}.get(status, "X")
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", *headers]
    head += [f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _samples(n: int) -> list[Sample]:
    return [Sample([1, 2, 3, 4 + i], 1, rollout_logprobs=[-0.5], sample_id=i) for i in range(n)]


_cfg = partial(
    stream_config,
    **FAST_BACKOFF,
    request_deadline_s=10.0,
    max_attempts=2,
    gateway_discovery="off",  # these servers answer every request alike
)


async def _run(cfg: StreamConfig, samples: list[Sample]) -> list[ScoredSample | SampleFailure]:
    async with OPDStream(cfg) as stream, stream.run(samples) as results:
        return [r async for r in results]


def _echo_error(prefix_len: int, *, bearer: bool, status: int = 400) -> Answer:
    """An error body whose message echoes the Authorization header after ``prefix_len``
    characters of padding (with or without the word Bearer)."""

    def answer(headers: dict[str, str]) -> bytes:
        auth = headers.get("authorization", "")
        echoed = auth if bearer else auth.removeprefix("Bearer ")
        message = "p" * prefix_len + echoed + " was refused"
        return http(status, msgspec.json.encode({"error": {"message": message}}))

    return answer


# --------------------------------------------------------------------------- item 1: key echo


@pytest.mark.parametrize("bearer", [True, False], ids=["bearer", "bare-key"])
@pytest.mark.parametrize("inside", [1, 3, 13, 25])
async def test_an_echoed_key_cut_by_the_message_cap_leaks_no_part_of_it(
    bearer: bool, inside: int, events: list[dict[str, Any]]
) -> None:
    # The 500-character cap cuts `inside` characters into the key.
    word = len("Bearer ") if bearer else 0
    pad = 500 - word - inside
    async with raw_server(_echo_error(pad, bearer=bearer)) as (url, seen):
        out = await _run(_cfg(url, api_key=KEY), _samples(2))
    assert seen and all(h["authorization"] == f"Bearer {KEY}" for h in seen)
    assert [f.reason for f in out] == ["teacher_http_400"] * 2
    for f in out:
        assert isinstance(f, SampleFailure)
        _assert_no_key(f.message)
    failed = [e for e in events if e["event"] == "sample_failed"]
    assert len(failed) == 2
    for e in events:
        _assert_no_key(repr(e))


async def test_a_key_with_quotes_and_backslashes_in_a_json_detail_object_is_masked(
    events: list[dict[str, Any]],
) -> None:
    def answer(headers: dict[str, str]) -> bytes:
        auth = headers["authorization"]
        detail = {"seen": {"authorization": auth, auth: "as a key", "bare": auth[7:]}}
        return http(403, msgspec.json.encode({"detail": detail}))

    async with raw_server(answer) as (url, _):
        out = await _run(_cfg(url, api_key=ODD_KEY), _samples(1))
    (failure,) = out
    assert isinstance(failure, SampleFailure) and failure.reason == "teacher_http_403"
    assert "authorization" in failure.message  # the rest of the detail is kept
    _assert_no_key(failure.message, ODD_KEY)
    for e in events:
        _assert_no_key(repr(e), ODD_KEY)


async def test_an_abort_on_200_echoing_the_header_is_masked() -> None:
    def answer(headers: dict[str, str]) -> bytes:
        message = "q" * 480 + "client sent " + headers["authorization"]
        meta = {"finish_reason": {"type": "abort", "message": message}}
        return http(200, msgspec.json.encode({"text": "", "meta_info": meta}))

    async with raw_server(answer) as (url, _):
        out = await _run(_cfg(url, api_key=KEY), _samples(2))
    for f in out:
        assert isinstance(f, SampleFailure) and f.reason == "aborted"
        _assert_no_key(f.message)


def test_parse_error_message_masks_any_bearer_token_before_the_cut() -> None:
    token = "Tok_" + "z" * 40  # not our key: any bearer token a server sends back
    for pad in (0, 180, 195, 480, 495):
        body = msgspec.json.encode({"message": "m" * pad + f"Bearer {token}"})
        assert "Tok_" not in parse_error_message(body)
        raw = ("r" * pad + f"Authorization: Bearer {token}").encode()
        assert "Tok_" not in parse_error_message(raw)
    assert redact('Bearer a"b\\c', None) == "Bearer ***"
    assert redact("x" * 10 + KEY[:6] + "…", KEY) == "x" * 10 + "***…"


async def test_the_score_command_output_and_events_hold_no_part_of_an_echoed_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = structlog.get_config()
    monkeypatch.setenv("OPD_TEST_HOSTILE_KEY", KEY)
    monkeypatch.setenv("OPD_STREAM_KL_DEVICE", "cpu")
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [1, 2], "response_ids": [3]}\n' * 2)
    try:
        async with raw_server(_echo_error(500 - 7 - 20, bearer=True)) as (url, _):
            code = await run_cli(
                "--log-level",
                "debug",
                "score",
                "--teacher",
                f"t={url}",
                "--api-key-env",
                "OPD_TEST_HOSTILE_KEY",
                "--input",
                str(tmp_path / "in.jsonl"),
                "--output",
                str(tmp_path / "out.jsonl"),
            )
    finally:
        structlog.configure(**saved)
    assert code == 1  # nothing was scored
    out = (tmp_path / "out.jsonl").read_text()
    assert out.count('"reason":"teacher_http_400"') == 2
    _assert_no_key(out)
    err = capsys.readouterr().err
    assert "line_failed" in err
    _assert_no_key(err)


# --------------------------------------------------------------------------- item 2: URLs

PASSWORD = "S3cr/et?pw#9"


@pytest.mark.parametrize(
    "url",
    [
        f"http://alice:{PASSWORD}@teacher:30000",
        f"https://alice:{PASSWORD}@teacher",
        f"alice:{PASSWORD}@teacher:30000",  # no scheme
        f"http://alice:{PASSWORD}@[::1",  # unparseable as well
        f"http://alice:{PASSWORD}@x@teacher",
        f"ftp://alice:{PASSWORD}@teacher",
    ],
)
def test_credentials_in_server_urls_are_never_echoed(url: str) -> None:
    for spec in (url, {"math": url}, f"math={url}"):
        with pytest.raises(ConfigError) as info:
            StreamConfig.from_env({}, teachers=spec)
        for part in ("alice", "S3cr", "et?pw", "pw#9"):
            assert part not in str(info.value), str(info.value)
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_env({}, teachers="http://t:1", student_url=url)
    assert "S3cr" not in str(info.value) and "alice" not in str(info.value)


def test_credentials_split_at_an_equals_sign_are_not_echoed_as_a_teacher_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "in.jsonl").write_text("")
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")]
    assert main(["score", "--teacher", "alice:pa=ss@teacher:1", *argv]) == 2
    err = capsys.readouterr().err
    assert "alice" not in err and "pa" not in err.replace("parse", "")


# --------------------------------------------------------------------------- item 4: bombs


def _bomb(inflated: int) -> bytes:
    return gzip.compress(b"[" * inflated, compresslevel=9)


async def test_no_compression_is_asked_for_and_a_gzip_bomb_is_refused_unread() -> None:
    bomb = _bomb(32 << 20)  # 32 MiB inflated, ~32 KiB on the wire

    def answer(headers: dict[str, str]) -> bytes:
        return http(200, bomb, headers=("Content-Encoding: gzip",))

    async with raw_server(answer) as (url, seen), AiohttpTransport() as transport:
        with pytest.raises(MalformedResponseError, match="compressed body"):
            await transport.post(url + "/generate", b"{}", max_bytes=1 << 20)
    (headers,) = seen
    assert headers.get("accept-encoding") == "identity"


async def test_a_compressing_server_fails_its_samples_without_inflating_anything() -> None:
    bomb = _bomb(8 << 20)

    def answer(headers: dict[str, str]) -> bytes:
        return http(200, bomb, headers=("Content-Encoding: deflate",))

    async with raw_server(answer) as (url, seen):
        async with OPDStream(_cfg(url, max_response_bytes=1 << 20)) as stream:
            async with stream.run(_samples(2)) as results:
                out = [r async for r in results]
            stats = stream.stats()
    assert [f.reason for f in out] == ["malformed_response"] * 2
    assert all("compressed" in f.message for f in out if isinstance(f, SampleFailure))
    assert len(seen) == 4  # 2 samples x max_attempts: each refused, then retried once
    assert stats.bytes_received == 0  # nothing was read, let alone inflated


# --------------------------------------------------------------------------- item 4: budget


async def test_budget_grants_within_the_limit_and_queues_beyond_it() -> None:
    budget = ByteBudget(100)
    a, b = budget.lease(), budget.lease()
    await a.grow(60)
    assert budget.used == 60
    granted = anyio.Event()

    async def take() -> None:
        await b.grow(50)  # 110 > 100: waits for a's release
        granted.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(take)
        await anyio.wait_all_tasks_blocked()
        assert not granted.is_set() and budget.waiting == 1
        a.done_reading()  # a still holds its bytes (decoding): b still waits
        await anyio.wait_all_tasks_blocked()
        assert not granted.is_set()
        a.release()
    assert granted.is_set() and budget.used == 50 and budget.peak == 60
    b.release()
    assert budget.used == 0


async def test_budget_lets_one_answer_larger_than_the_whole_budget_through_alone() -> None:
    budget = ByteBudget(10)
    with budget.lease() as lease:
        for _ in range(5):
            await lease.grow(8)  # 40 bytes in all, alone
        assert budget.used == 40
    assert budget.used == 0


async def test_budget_breaks_a_standstill_with_one_privileged_reader() -> None:
    """Three readers each read a part and want more: nobody would release. The one that
    read the most finishes alone; the bytes held never exceed the budget plus one answer."""
    budget = ByteBudget(100)
    answer, chunk = 150, 10
    finished: list[int] = []

    async def reader(n: int, first: int) -> None:
        with budget.lease() as lease:
            await lease.grow(first)
            await anyio.wait_all_tasks_blocked()
            while lease.held < answer:
                await lease.grow(chunk)
            lease.done_reading()
            finished.append(n)
            await anyio.wait_all_tasks_blocked()  # "decoding"

    async with anyio.create_task_group() as tg:
        for n, first in enumerate((30, 40, 30)):
            tg.start_soon(reader, n, first)
    assert sorted(finished) == [0, 1, 2]
    assert finished[0] == 1  # the one holding the most went first
    assert budget.used == 0 and budget.waiting == 0
    assert budget.peak <= budget.limit + answer


async def test_budget_try_grow_grants_what_grow_would_at_once_and_else_charges_nothing() -> None:
    budget = ByteBudget(100)
    a, b, c = budget.lease(), budget.lease(), budget.lease()
    assert a.try_grow(60) and budget.used == 60
    assert not b.try_grow(50) and b.held == 0 and budget.used == 60  # 110 > 100
    async with anyio.create_task_group() as tg:
        tg.start_soon(c.grow, 50)  # waits: 110 > 100
        await anyio.wait_all_tasks_blocked()
        assert not b.try_grow(10) and b.held == 0  # it would fit, but c waits first
        a.release()  # c is granted
    assert budget.used == 50 and budget.waiting == 0
    assert b.try_grow(10) and budget.used == 60


async def test_budget_forgets_a_cancelled_waiter() -> None:
    budget = ByteBudget(10)
    holder = budget.lease()
    await holder.grow(10)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await budget.lease().grow(5)
    assert budget.waiting == 0 and budget.used == 10
    holder.release()
    assert budget.used == 0


async def test_the_transport_charges_what_it_reads_to_the_lease_it_is_given() -> None:
    body = b"[" + b"0," * 40_000 + b"0]"

    async with raw_server(lambda _h: http(200, body)) as (url, _):
        async with AiohttpTransport() as transport:
            budget = ByteBudget(1 << 20)
            with budget.lease() as lease:
                resp = await transport.post(
                    url + "/generate", b"{}", max_bytes=1 << 20, lease=lease
                )
                assert lease.held == len(resp.body) == len(body)
            assert budget.used == 0

            # Many answers at once through a budget of two: all complete, bounded.
            small = ByteBudget(2 * len(body))

            async def one() -> None:
                with small.lease() as lease:
                    await transport.post(url + "/generate", b"{}", max_bytes=1 << 20, lease=lease)

            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(one)
            assert small.used == 0
            assert small.peak <= small.limit + len(body)


class _TransportWithoutLease:
    """A user's transport written before ``post`` took ``lease``: it charges nothing."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.sizes: list[int] = []

    async def __aenter__(self) -> _TransportWithoutLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def post(self, url: str, body: bytes, *, max_bytes: int) -> Any:
        resp = await self._inner.post(url, body, max_bytes=max_bytes)
        self.sizes.append(len(resp.body))
        return resp

    async def get(self, url: str, *, max_bytes: int) -> Any:
        return await self._inner.get(url, max_bytes=max_bytes)


async def test_an_answer_read_by_a_transport_without_a_lease_is_charged_once_whole() -> None:
    from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

    url = "http://teacher:1"
    transport = _TransportWithoutLease(mock_transport({url: InProcessSGLang("teacher", 1)}))
    cfg = _cfg(url, max_inflight_response_bytes=1024)
    samples = [Sample([1, 2, 3, 4 + i, 5, 6], 3) for i in range(6)]
    with pytest.warns(DeprecationWarning, match="implement send"):  # the old seam, wrapped
        stream = OPDStream(cfg, transport=transport)  # type: ignore[arg-type]
    async with stream:
        budget = stream._parts.fetcher._sender._body_budget  # type: ignore[union-attr]
        async with stream.run(samples) as results:
            out = [r async for r in results]
        assert all(isinstance(r, ScoredSample) for r in out)
        assert budget.peak >= max(transport.sizes) > 0  # each answer was charged
        assert budget.used == 0 and budget.waiting == 0  # and released


# ------------------------------------------------------------------ hostile answers (decode)


def _valid_answer(tokens: list[int], lp: float) -> dict[str, Any]:
    """A valid one-row scoring answer (sampled-token, ``logprob_start_len`` = P - 1)."""
    return {
        "meta_info": {
            "finish_reason": {"type": "length", "length": 0},
            "input_token_logprobs": [[None, tokens[-2], None], [lp, tokens[-1], None]],
            "output_token_logprobs": [],
        }
    }


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_deeply_nested_unknown_field_is_malformed_never_internal(
    parser: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import opd_stream.scanner._loader as jr

    nest = 100_000
    tokens = [1, 2, 3, 4]

    def answer(_: dict[str, str]) -> bytes:
        good = msgspec.json.encode(_valid_answer(tokens, -0.5))
        return http(200, b'{"deep":' + b"[" * nest + b"]" * nest + b"," + good[1:])

    assert jr.prepare()
    async with raw_server(answer) as (url, _):
        threaded = parser != "msgspec"
        cfg = _cfg(url, max_attempts=1, offload_bytes=1 if threaded else 1 << 30)
        if parser == "msgspec":
            monkeypatch.setattr(jr, "_kernel", None)
            monkeypatch.setattr(jr, "_failed", True)
        (out,) = await _run(cfg, [Sample(tokens, 1, rollout_logprobs=[-0.5])])
    # the scanner hands it to msgspec, which refuses it
    assert isinstance(out, SampleFailure)
    assert out.reason == "malformed_response" and "nested too deeply" in out.message


@pytest.mark.parametrize("threaded", [False, True], ids=["loop", "thread"])
async def test_a_positive_teacher_logprob_is_a_malformed_answer(threaded: bool) -> None:
    tokens = [1, 2, 3, 4]

    def answer(_: dict[str, str]) -> bytes:
        return http(200, msgspec.json.encode(_valid_answer(tokens, 5.0)))

    async with raw_server(answer) as (url, _):
        cfg = _cfg(url, max_attempts=1, offload_bytes=1 if threaded else 1 << 30)
        (out,) = await _run(cfg, [Sample(tokens, 1, rollout_logprobs=[-0.5])])
    assert isinstance(out, SampleFailure)
    assert out.reason == "malformed_response" and "logprob above 0" in out.message
