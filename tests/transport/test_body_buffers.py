"""Big answers' buffers, used again once nothing refers to them (``transport/_bodies.py``):
which buffer a body gets, when a buffer counts as busy (any view, array or thread still
holding it), the pool's bounds, and the asyncio transport and the stream that use it."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
from support.raw_http import answer_bytes, raw_server

from opd_stream import AsyncioTransport
from opd_stream.transport import _bodies
from opd_stream.transport._bodies import MIN_POOLED, BodyPool

MIB = 1 << 20
BIG = MIN_POOLED + 3


def _base(view: memoryview) -> int:
    """The address of the memory a view reads (the same buffer: the same address)."""
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def test_a_body_gets_a_writable_view_of_exactly_its_length() -> None:
    view = BodyPool().take(BIG)
    assert len(view) == BIG and not view.readonly


def test_a_small_body_gets_a_buffer_of_its_own_the_pool_keeps_none() -> None:
    pool = BodyPool()
    first = _base(pool.take(MIN_POOLED - 1))
    pool.take(MIN_POOLED - 1)
    assert pool.held_bytes == 0 and pool.reused == 0
    assert first  # (a buffer was made)


def test_a_buffer_nothing_refers_to_any_more_is_used_again() -> None:
    pool = BodyPool()
    view = pool.take(BIG)
    view[:3] = b"abc"
    at = _base(view)
    del view
    again = pool.take(BIG + 100)  # a little bigger: it fits (a buffer has room above)
    assert _base(again) == at and pool.reused == 1
    assert bytes(again[:3]) == b"abc"  # the same memory, not zeroed again


@pytest.mark.parametrize(
    "holder",
    [
        lambda v: v,  # the view itself
        lambda v: v[10:20],  # a slice of it
        lambda v: np.frombuffer(v, dtype=np.uint8),  # an array over it
    ],
    ids=["view", "slice", "array"],
)
def test_a_buffer_something_still_refers_to_is_not_handed_out(holder: object) -> None:
    pool = BodyPool()
    view = pool.take(BIG)
    kept = holder(view)  # type: ignore[operator]
    at = _base(view)
    del view
    assert _base(pool.take(BIG)) != at and pool.reused == 0
    del kept


def test_a_buffer_a_thread_still_reads_is_busy_until_the_thread_lets_go() -> None:
    pool = BodyPool()
    view = pool.take(BIG)
    at = _base(view)
    started, release = threading.Event(), threading.Event()

    def decode(body: memoryview) -> None:  # a decode its caller no longer waits for
        started.set()
        release.wait()
        del body

    thread = threading.Thread(target=decode, args=(view,))
    thread.start()
    started.wait()
    del view
    busy = pool.take(BIG)
    assert _base(busy) != at
    del busy
    release.set()
    thread.join()
    assert {_base(pool.take(BIG)), _base(pool.take(BIG))} >= {at}


def test_the_smallest_free_buffer_that_fits_is_taken_and_never_one_twice_the_body() -> None:
    pool = BodyPool()
    # made for 20, 8 and 12 MiB, each has an eighth more room: 23, 9 and 14 MiB
    views = [pool.take(n * MIB) for n in (20, 8, 12)]
    big, small, middle = (_base(v) for v in views)
    del views
    ten = pool.take(10 * MIB)
    assert _base(ten) == middle  # 9 too small, 23 over twice 10
    assert _base(pool.take(12 * MIB)) == big  # (14 is busy: ten) 23 fits, under twice 12
    assert pool.reused == 2
    assert _base(pool.take(MIN_POOLED + MIB // 4)) not in (small, middle, big)  # 9: too big


def test_the_pool_keeps_at_most_keep_buffers_dropping_free_ones_for_new(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_bodies, "_KEEP", 3)
    pool = BodyPool()
    busy = [pool.take(BIG) for _ in range(3)]
    assert len(pool._buffers) == 3
    extra = pool.take(BIG)  # every kept one busy: made, not kept
    assert len(pool._buffers) == 3
    del extra
    freed = _base(busy.pop())
    new = pool.take(2 * BIG + MIB)  # a free one too small for it: dropped to make room
    assert len(pool._buffers) == 3 and _base(new) != freed
    assert all(_base(b) != freed for b in [*busy, new])


def test_the_pool_keeps_at_most_keep_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_bodies, "_KEEP_BYTES", 3 * BIG)
    pool = BodyPool()
    first = pool.take(BIG)
    second = pool.take(BIG)
    assert pool.held_bytes <= 3 * BIG and len(pool._buffers) == 2
    pool.take(BIG)  # would pass the bound: not kept
    assert len(pool._buffers) == 2
    assert pool.take(4 * BIG) is not None and len(pool._buffers) == 2  # over it alone
    del first, second


def test_clear_drops_every_buffer_and_a_busy_one_stays_valid() -> None:
    pool = BodyPool()
    busy = pool.take(BIG)
    busy[:2] = b"ok"
    pool.take(BIG)
    pool.clear()
    assert pool.held_bytes == 0
    assert bytes(busy[:2]) == b"ok"  # its user still reads it


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the asyncio transport runs on asyncio alone


async def test_the_asyncio_transport_reads_big_answers_into_the_same_buffer() -> None:
    bodies = [b'{"n":' + str(i).encode() + b',"pad":"' + b"x" * (BIG + i) + b'"}' for i in range(3)]
    answers = iter(bodies)

    def reply(head: bytes, body: bytes) -> tuple[bytes, bool]:
        return answer_bytes(next(answers)), False

    async with raw_server(reply) as server, AsyncioTransport() as transport:
        seen = []
        for expected in bodies:
            resp = await transport.post(server.url, b"{}", max_bytes=1 << 30)
            assert bytes(resp.body) == expected  # each answer whole, its own length
            seen.append(_base(memoryview(resp.body)))
            del resp
        assert seen[0] == seen[1] == seen[2]
        assert transport._bodies.reused == 2
    assert transport._bodies.held_bytes == 0  # left: the buffers are dropped


async def test_an_answer_still_held_keeps_its_buffer_from_the_next_one() -> None:
    def reply(head: bytes, body: bytes) -> tuple[bytes, bool]:
        return answer_bytes(b'"' + b"y" * BIG + b'"'), False

    async with raw_server(reply) as server, AsyncioTransport() as transport:
        first = await transport.post(server.url, b"{}", max_bytes=1 << 30)
        second = await transport.post(server.url, b"{}", max_bytes=1 << 30)
        assert _base(memoryview(first.body)) != _base(memoryview(second.body))
        assert bytes(first.body) == bytes(second.body)
        await anyio.lowlevel.checkpoint()
