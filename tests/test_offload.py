"""Decode-pool calls with their bulk bytes in a shared-memory segment (``_offload``).

A segment is an anonymous memory file named ``opd_stream_offload``: it shows up only as a
descriptor (``/proc/<pid>/fd``) or a mapping (``/proc/<pid>/maps``) of a process, so "no
segment leaked" is checked on this process and on its worker processes, not in a shared
directory. The async tests share one worker process per backend (module-scoped backend and
limiter), since starting one takes seconds.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.to_process
import numpy as np
import pytest

from opd_stream import OPDStream, Sample, ScoredSample, StreamConfig, _offload
from opd_stream._errors import (
    CapabilityError,
    MalformedResponseError,
    MisalignedResponseError,
    OPDStreamError,
)
from opd_stream._wire import ScoreRequest, ScoreRows, build_score_payload, decode_score_response
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

SEGMENT = "memfd:" + _offload._SEGMENT_NAME


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ],
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(scope="module")
async def limiter() -> anyio.CapacityLimiter:
    """One worker process for the whole module (per backend), started up front."""
    lim = anyio.CapacityLimiter(1)
    assert await anyio.to_process.run_sync(abs, -1, limiter=lim) == 1
    return lim


@pytest.fixture
def called(monkeypatch: pytest.MonkeyPatch) -> list[Callable[..., Any]]:
    """The functions handed to ``anyio.to_process.run_sync`` during the test."""
    calls: list[Callable[..., Any]] = []
    real = anyio.to_process.run_sync

    async def spy(func: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        calls.append(func)
        return await real(func, *args, **kw)

    monkeypatch.setattr(anyio.to_process, "run_sync", spy)
    monkeypatch.setattr(_offload._State, "worker_cannot_use", False)
    return calls


# --- helpers run in the worker (module level: pickled by reference) -------------------


def sleep_then_length(data: Any, delay: float) -> int:
    time.sleep(delay)
    return len(data)


def exit_abruptly(data: Any) -> None:
    os._exit(3)


def alias_of(data: Any) -> Any:
    """A result that is a view of its argument (of the mapping, in a worker)."""
    return np.frombuffer(data, dtype=np.uint8)


# --- where segments are -------------------------------------------------------------


def _workers() -> list[int]:
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except FileNotFoundError:
            continue  # the thread ended since listdir: it has no children to report
    return pids


def _segments_of(pid: int) -> list[str]:
    """Process ``pid``'s descriptors and mappings of offload segments."""
    found: list[str] = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            if target.startswith("/" + SEGMENT):
                found.append(f"fd {fd}")
        with open(f"/proc/{pid}/maps") as f:
            found += [line.strip() for line in f if SEGMENT in line]
    except (FileNotFoundError, ProcessLookupError):
        pass  # the process is gone: it holds nothing
    return found


def _segments_anywhere() -> dict[int, list[str]]:
    pids = [os.getpid(), *_workers()]
    return {pid: found for pid in pids if (found := _segments_of(pid))}


@pytest.fixture
def no_leak() -> Iterator[None]:
    """Fails the test if any offload segment is still open or mapped after it.

    A worker unmaps after it has answered, so a segment may outlive a call by a moment:
    only one that is still there after a grace period is a leak.
    """
    assert _settled_segments() == {}
    yield
    assert _settled_segments() == {}


def _settled_segments(grace_s: float = 2.0) -> dict[int, list[str]]:
    deadline = time.monotonic() + grace_s
    while (found := _segments_anywhere()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


# --- requests and real bodies (from the in-process mock SGLang) ---------------------

P, R = 24, 1200
_RNG = np.random.default_rng(7)
TOKENS = _RNG.integers(0, 5000, P + R).astype(np.int64)
IDS = np.stack([_RNG.choice(5000, 8, replace=False) for _ in range(R)]).astype(np.int64)

REQUESTS = {
    "per-position ids": ScoreRequest(tokens=TOKENS, response_length=R, ids=IDS),
    "b64 top-k": ScoreRequest(tokens=TOKENS, response_length=R, top_k=8, topk_wire="b64"),
    "blocked ids with top-k": ScoreRequest(
        tokens=TOKENS, response_length=R, top_k=4, ids=IDS, id_form="blocked", block_size=64
    ),
}


def _body(req: ScoreRequest, **server: Any) -> bytes:
    resp = InProcessSGLang("teacher", 1, **server).handle(
        "POST", "/generate", build_score_payload(req)
    )
    assert resp.status == 200
    return resp.body


def _assert_rows_equal(got: ScoreRows, want: ScoreRows) -> None:
    for name in ScoreRows.__struct_fields__:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray), name
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            assert np.array_equal(a, b), name
            # the parent's own writable memory, not a view of anything shared
            assert a.flags.writeable, name
            assert a.base is None or isinstance(a.base, bytearray | np.ndarray), name
        else:
            assert a == b, name


def _error_state(exc: BaseException) -> tuple[Any, ...]:
    return (type(exc), exc.args, vars(exc))


def _truncated() -> tuple[bytes, ScoreRequest]:
    req = REQUESTS["per-position ids"]
    body = _body(req)
    return body[: len(body) // 2], req


def _other_tokens() -> tuple[bytes, ScoreRequest]:
    req = REQUESTS["per-position ids"]
    tokens = TOKENS.copy()
    tokens[-1] += 1
    return _body(req), ScoreRequest(tokens=tokens, response_length=R, ids=IDS)


def _unpatched() -> tuple[bytes, ScoreRequest]:
    req = REQUESTS["per-position ids"]
    return _body(req, per_position="unpatched"), req


# --- sync: the parts that need no worker --------------------------------------------


def test_pack_call_leaves_only_control_data_in_the_pickle() -> None:
    req = REQUESTS["per-position ids"]
    body = _body(req)
    meta, buffers = _offload.pack_call(decode_score_response, (body, req))
    assert TOKENS.nbytes < _offload.OUT_OF_BAND_MIN <= IDS.nbytes  # tokens stay in band
    assert len(meta) < TOKENS.nbytes + 1024
    assert [b.nbytes for b in buffers] == [len(body), IDS.nbytes]


def test_small_buffers_stay_in_the_pickle() -> None:
    small = b"x" * (_offload.OUT_OF_BAND_MIN - 1)
    meta, buffers = _offload.pack_call(len, (small,))
    assert buffers == [] and len(meta) > len(small)


def test_segments_are_not_tried_without_memfd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_offload._State, "worker_cannot_use", False)
    assert _offload.segments_usable()
    monkeypatch.delattr(os, "memfd_create")
    assert not _offload.segments_usable()


def test_segments_are_not_tried_without_proc_fd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_offload._State, "worker_cannot_use", False)
    monkeypatch.setattr(_offload._State, "proc_fd", None)  # not looked up yet
    monkeypatch.setattr(os.path, "isdir", lambda path: False)
    assert not _offload.segments_usable()


def test_a_segment_the_worker_cannot_open_is_reported_not_raised() -> None:
    reply = _offload._worker_entry("/nonexistent/opd_stream/segment", b"", (16,))
    assert reply.kind == "unusable"


def test_a_segment_the_worker_cannot_map_is_reported_not_raised() -> None:
    fd = _offload._new_segment()
    assert fd is not None
    try:  # shorter than the lengths say: cannot be mapped
        reply = _offload._worker_entry(_offload._segment_path(fd), b"", (16,))
    finally:
        os.close(fd)
    assert reply.kind == "unusable"


# --- async, in this process: the worker side called directly ------------------------


async def test_a_result_aliasing_its_argument_is_written_after_the_input(no_leak: None) -> None:
    data = bytes(range(256)) * 300
    meta, buffers = _offload.pack_call(alias_of, (data,))
    fd = _offload._new_segment()
    assert fd is not None
    try:
        assert await _offload._write_segment(fd, buffers)
        reply = _offload._worker_entry(_offload._segment_path(fd), meta, (len(data),))
        assert reply.kind == "pickle"
        assert reply.offset == -(-len(data) // mmap.PAGESIZE) * mmap.PAGESIZE
        got = await _offload._read_reply(fd, reply)
    finally:
        os.close(fd)
    assert bytes(got) == data


async def test_the_worker_frees_the_input_and_keeps_only_the_result(no_leak: None) -> None:
    req = REQUESTS["per-position ids"]
    body = _body(req)
    meta, buffers = _offload.pack_call(decode_score_response, (body, req))
    fd = _offload._new_segment()
    assert fd is not None
    try:
        assert await _offload._write_segment(fd, buffers)
        assert os.fstat(fd).st_size == sum(b.nbytes for b in buffers)
        lengths = tuple(b.nbytes for b in buffers)
        reply = _offload._worker_entry(_offload._segment_path(fd), meta, lengths)
        assert reply.kind == "pickle" and reply.offset == 0
        assert os.fstat(fd).st_size == sum(reply.lengths)
        got = await _offload._read_reply(fd, reply)
    finally:
        os.close(fd)
    _assert_rows_equal(got, decode_score_response(body, req))


async def test_a_worker_error_unmaps_the_segment_before_it_is_raised(no_leak: None) -> None:
    body, req = _truncated()
    meta, buffers = _offload.pack_call(decode_score_response, (body, req))
    fd = _offload._new_segment()
    assert fd is not None
    try:
        assert await _offload._write_segment(fd, buffers)
        lengths = tuple(b.nbytes for b in buffers)
        with pytest.raises(MalformedResponseError) as raised:
            _offload._worker_entry(_offload._segment_path(fd), meta, lengths)
        assert raised.value.__traceback__ is not None  # still alive, with its frames
        assert [m for m in _segments_of(os.getpid()) if not m.startswith("fd ")] == []
        assert os.fstat(fd).st_size == 0  # and the input's pages are freed
    finally:
        os.close(fd)


# --- async, through a worker process -------------------------------------------------


@pytest.mark.parametrize("form", list(REQUESTS))
async def test_a_decode_in_the_pool_equals_the_inline_decode(
    form: str, limiter: anyio.CapacityLimiter, called: list[Any], no_leak: None
) -> None:
    req = REQUESTS[form]
    body = _body(req)
    got = await _offload.run_in_worker(decode_score_response, body, req, limiter=limiter)
    _assert_rows_equal(got, decode_score_response(body, req))
    assert called == [_offload._worker_entry]


async def test_a_payload_built_in_the_pool_is_the_same_bytes(
    limiter: anyio.CapacityLimiter, called: list[Any], no_leak: None
) -> None:
    req = REQUESTS["blocked ids with top-k"]
    got = await _offload.run_in_worker(build_score_payload, req, limiter=limiter)
    assert type(got) is bytes and got == build_score_payload(req)
    assert called == [_offload._worker_entry]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (_truncated, MalformedResponseError),
        (_other_tokens, MisalignedResponseError),
        (_unpatched, CapabilityError),
    ],
)
async def test_an_error_raised_in_the_worker_arrives_with_its_attributes(
    case: Callable[[], tuple[bytes, ScoreRequest]],
    expected: type[OPDStreamError],
    limiter: anyio.CapacityLimiter,
    called: list[Any],
    no_leak: None,
) -> None:
    body, req = case()
    assert len(body) >= _offload.OUT_OF_BAND_MIN
    with pytest.raises(expected) as inline:
        decode_score_response(body, req)
    with pytest.raises(expected) as pooled:
        await _offload.run_in_worker(decode_score_response, body, req, limiter=limiter)
    assert _error_state(pooled.value) == _error_state(inline.value)
    assert called == [_offload._worker_entry]


async def _wait_until(cond: Callable[[], bool]) -> None:
    """Poll ``cond`` (state of other processes: nothing to wait on) for up to 20 s."""
    for _ in range(4000):
        if cond():
            return
        await anyio.sleep(0.005)
    raise AssertionError("condition not reached within 20 s")


async def test_a_call_cancelled_while_waiting_for_a_worker_leaves_no_segment(
    limiter: anyio.CapacityLimiter, called: list[Any], no_leak: None
) -> None:
    body = os.urandom(3 * 2**20)
    finished = []
    async with limiter:  # the only worker is taken: the call waits for it
        async with anyio.create_task_group() as tg:

            async def call() -> None:
                await _offload.run_in_worker(len, body, limiter=limiter)
                finished.append(True)

            tg.start_soon(call)
            await _wait_until(lambda: bool(_segments_of(os.getpid())))
            await _wait_until(lambda: called == [_offload._worker_entry])
            tg.cancel_scope.cancel()
    assert finished == []


async def test_a_call_cancelled_while_in_the_worker_leaves_no_segment(
    limiter: anyio.CapacityLimiter, no_leak: None
) -> None:
    # The worker cannot be interrupted (run_sync is not cancellable): the cancelled task
    # waits for it, then closes the segment on its way out.
    body = os.urandom(3 * 2**20)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: _offload.run_in_worker(sleep_then_length, body, 0.5, limiter=limiter)
            )
            await _wait_until(lambda: any(_segments_of(pid) for pid in _workers()))
            scope.cancel()
    assert scope.cancelled_caught


async def test_the_fallback_without_memfd_goes_through_the_pipe(
    limiter: anyio.CapacityLimiter,
    called: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    no_leak: None,
) -> None:
    monkeypatch.delattr(os, "memfd_create")
    req = REQUESTS["b64 top-k"]
    body = _body(req)
    got = await _offload.run_in_worker(decode_score_response, body, req, limiter=limiter)
    _assert_rows_equal(got, decode_score_response(body, req))
    assert called == [decode_score_response]


async def test_a_segment_that_cannot_be_created_falls_back_to_the_pipe(
    limiter: anyio.CapacityLimiter,
    called: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    no_leak: None,
) -> None:
    def no_more_files(name: str, flags: int = 0) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(os, "memfd_create", no_more_files)
    req = REQUESTS["b64 top-k"]
    body = _body(req)
    got = await _offload.run_in_worker(decode_score_response, body, req, limiter=limiter)
    _assert_rows_equal(got, decode_score_response(body, req))
    assert called == [decode_score_response]


async def test_a_segment_that_cannot_be_written_falls_back_to_the_pipe(
    limiter: anyio.CapacityLimiter,
    called: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    no_leak: None,
) -> None:
    def full(fd: int, view: memoryview, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_offload, "_pwrite_all", full)
    req = REQUESTS["b64 top-k"]
    body = _body(req)
    got = await _offload.run_in_worker(decode_score_response, body, req, limiter=limiter)
    _assert_rows_equal(got, decode_score_response(body, req))
    assert called == [decode_score_response]


async def test_a_worker_that_cannot_open_segments_turns_them_off(
    limiter: anyio.CapacityLimiter,
    called: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    no_leak: None,
) -> None:
    monkeypatch.setattr(_offload, "_segment_path", lambda fd: f"/nonexistent/{fd}")
    req = REQUESTS["b64 top-k"]
    body = _body(req)
    want = decode_score_response(body, req)
    _assert_rows_equal(
        await _offload.run_in_worker(decode_score_response, body, req, limiter=limiter), want
    )
    assert called == [_offload._worker_entry, decode_score_response]
    _assert_rows_equal(
        await _offload.run_in_worker(decode_score_response, body, req, limiter=limiter), want
    )
    assert called[2:] == [decode_score_response]


async def test_a_stream_decodes_in_the_pool_through_segments(
    limiter: anyio.CapacityLimiter, called: list[Any], no_leak: None
) -> None:
    rng = np.random.default_rng(3)
    samples = [Sample(rng.integers(0, 5000, 300).tolist(), 280) for _ in range(3)]
    t, s = "http://teacher:1", "http://student:2"
    servers = {t: InProcessSGLang("teacher", 1), s: InProcessSGLang("student", 1)}
    base = {"teachers": t, "student_url": s, "top_k": 8, "strategy": "union", "kl_device": "cpu"}
    out: dict[int, list[ScoredSample]] = {}
    for workers in (0, 1):
        cfg = StreamConfig.from_env(
            {}, **base, decode_workers=workers, decode_offload_bytes=_offload.OUT_OF_BAND_MIN
        )
        async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
            async with stream.run(samples) as results:
                got = [r async for r in results if isinstance(r, ScoredSample)]
        assert len(got) == len(samples)
        out[workers] = sorted(got, key=lambda r: r.index)
    assert _offload._worker_entry in called
    for a, b in zip(out[0], out[1], strict=True):
        assert a.reverse_kl is not None and b.reverse_kl is not None
        assert a.reverse_kl.tolist() == b.reverse_kl.tolist()
        assert a.teacher_logprobs.tolist() == b.teacher_logprobs.tolist()


async def test_a_worker_that_dies_mid_call_leaves_no_segment(
    limiter: anyio.CapacityLimiter, no_leak: None
) -> None:
    # Last in the module: the pool has to start a new worker after this one.
    with pytest.raises(anyio.BrokenWorkerProcess):
        await _offload.run_in_worker(exit_abruptly, os.urandom(2**20), limiter=limiter)
