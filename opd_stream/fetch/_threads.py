"""The fetch stage's thread policy: which step of an attempt (a request body's build, an
answer's decode) goes to one of ``decode_threads`` worker threads, and the CPU each step
spent in the thread that ran it.

Plain sync functions; the async shell (:mod:`opd_stream.fetch._attempts`) asks
:func:`build_in_thread` / :func:`decode_in_thread` whether a step goes to a worker thread
and runs :func:`timed_build` / :func:`~opd_stream.wire._codec.decode` /
:func:`timed_decode` there or on the loop. A request body (by
:func:`~opd_stream.wire._payloads.payload_size_hint`) or an answer of at least
``offload_bytes`` goes to a worker thread, a smaller one stays on the loop.
"""

from __future__ import annotations

import time

from ..wire._answers import ScoreRows
from ..wire._codec import Answer, Parser, decode
from ..wire._payloads import build_laid, payload_size_hint
from ..wire._request import Layout, ScoreRequest, layout

__all__ = ("build_in_thread", "decode_in_thread", "timed_build", "timed_decode")


def build_in_thread(req: ScoreRequest, threshold: int) -> bool:
    """Whether ``req``'s body is built in a worker thread (estimated at ``threshold`` bytes
    or more)."""
    return payload_size_hint(req) >= threshold


def decode_in_thread(size: int, threshold: int) -> bool:
    """Whether an answer of ``size`` bytes is decoded in a worker thread."""
    return size >= threshold


def timed_build(req: ScoreRequest) -> tuple[bytes, Layout, float]:
    """``req``'s body, its layout (checked once: the decode of the answer takes it again)
    and the CPU seconds of the thread that built it (it never waits for the kernels)."""
    start = time.thread_time()
    lay = layout(req)
    body = build_laid(req, lay)
    return body, lay, time.thread_time() - start


def timed_decode(
    answer: Answer, req: ScoreRequest, lay: Layout | None = None
) -> tuple[tuple[ScoreRows, Parser] | BaseException, float]:
    """Decode in a worker thread: the rows and their parser, or the error (raised again in
    the caller's task), and the thread's CPU seconds."""
    start = time.thread_time()
    try:
        got: tuple[ScoreRows, Parser] | BaseException = decode(answer, req, lay=lay)
    except Exception as exc:  # raised again in the caller's task
        got = exc
    return got, time.thread_time() - start
