"""The fetch stage's thread policy: which step of an attempt (a request body's build, an
answer's decode) goes to one of ``decode_threads`` worker threads, and the CPU each step
spent in the thread that ran it. Plain sync functions, asked by the async shell
(:mod:`opd_stream.fetch._attempts`).

``offload_bytes`` splits them. The compiled scanner reads an answer of :data:`SLICED_FROM`
or more on the loop a slice at a time (:data:`SLICE_BYTES`, ``_codec.decode_in_slices``),
then its columns whole: below ``offload_bytes`` it stays on the loop. What the loop does
whole, a body's build and a parse by msgspec (the scanner not ready, a vLLM answer,
blocks), goes to a thread from ``offload_bytes // WHOLE`` on. Why:
``docs/design-notes.md``, "opd_stream/fetch/_threads.py".
"""

from __future__ import annotations

import time

from ..scanner._loader import available
from ..wire._answers import Body, ScoreRows
from ..wire._codec import Answer, Parser, decode
from ..wire._payloads import build_laid, payload_size_hint
from ..wire._request import Layout, ScoreRequest, layout

__all__ = (
    "SLICED_FROM",
    "SLICE_BYTES",
    "WHOLE",
    "build_in_thread",
    "decode_in_thread",
    "read_in_slices",
    "sliced_on_loop",
    "timed_build",
    "timed_decode",
)

#: The bytes of an answer the scanner reads on the loop between two of its turns (a slice
#: costs ~1-3 ms; a rest shorter than a quarter of it is read with the slice before).
SLICE_BYTES = 1 << 20
#: An answer the loop parses is read in slices from this size on; a smaller one whole, as
#: it arrives (at most ~1.5-3 ms; its bytes still in the cache, no wait for another's).
SLICED_FROM = 1 << 20
#: Work the loop does whole goes to a worker thread from ``offload_bytes // WHOLE`` on.
WHOLE = 4


def build_in_thread(req: ScoreRequest, threshold: int) -> bool:
    """Whether ``req``'s body is built in a worker thread (estimated at a quarter of
    ``threshold`` bytes or more: a build holds the loop whole)."""
    return payload_size_hint(req) >= threshold // WHOLE


def sliced_on_loop(answer: Answer, req: ScoreRequest) -> bool:
    """Whether the loop would read ``answer`` with the scanner, which can pause between
    slices of it, were it big enough (else whole: msgspec)."""
    return available() and req.engine == "sglang" and isinstance(answer, Body)


def read_in_slices(size: int, sliced: bool) -> bool:
    """Whether the loop reads an answer of ``size`` bytes a slice at a time (``sliced``:
    its scanner can): from :data:`SLICED_FROM` on."""
    return sliced and size >= SLICED_FROM


def decode_in_thread(size: int, threshold: int, sliced: bool) -> bool:
    """Whether an answer of ``size`` bytes is decoded in a worker thread: from
    ``threshold`` on where the loop would read it a slice at a time (``sliced``), else from
    a quarter of it."""
    return size >= (threshold if sliced else threshold // WHOLE)


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
