"""One :class:`~opd_stream.OPDStream` shared by a host's concurrent calls: what the Miles
and verl adapters have in common.

Such a host awaits one sample per task, many at once, and gives no scope of its own for a
stream to live in. The first call starts one asyncio task on its loop that holds the stream
open (``async with OPDStream(...)``) until :meth:`SharedStream.aclose`; every call goes
through the stream's public per-call entry points (:meth:`OPDStream.score`,
:meth:`OPDStream.teacher_rows`), so the calls share its bounds and show in its
:meth:`~opd_stream.OPDStream.stats`, and a cancelled call cancels its sample's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from .._errors import OPDStreamError
from .._sample import Sample, SampleFailure, ScoredSample
from .._stream import OPDStream
from ..config._settings import StreamConfig
from ..transport._transports import Transport
from ..wire._answers import ScoreRows
from ..xtok._tokenizers import CrossTokenizers

__all__ = ("SharedStream",)


class SharedStream:
    """A stream held open for the calls of one asyncio loop (the loop of the first call).

    Args:
        config: the stream configuration.
        transport: passed to :class:`OPDStream` (default: the pooled asyncio transport).
        owner: the adapter's name, for error messages.
    """

    def __init__(
        self, config: StreamConfig, *, transport: Transport | None = None, owner: str
    ) -> None:
        self.config = config
        self._transport = transport
        self._owner = owner
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stop = asyncio.Event()
        self._callers = 0  # calls between entry and return (for a graceful close)
        self._idle = asyncio.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._closed = False
        self.stream: OPDStream | None = None
        """The shared stream while it runs (for ``stream.stats()``), else None."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the stream runs on (``None`` before the first call)."""
        return self._loop

    async def score(self, sample: Sample) -> ScoredSample | SampleFailure:
        """:meth:`OPDStream.score` on the shared stream (started by the first call)."""
        with self._caller():
            stream = await self._started()
            return await stream.score(sample)

    async def teacher_rows(self, sample: Sample) -> ScoreRows:
        """:meth:`OPDStream.teacher_rows` on the shared stream (started by the first call)."""
        with self._caller():
            stream = await self._started()
            return await stream.teacher_rows(sample)

    async def cross_tokenizers(self) -> CrossTokenizers | None:
        """The shared stream's tokenizers, loaded as it starts (started by the first call):
        the student's and each teacher's own, or None when every teacher shares the
        student's vocabulary."""
        with self._caller():
            stream = await self._started()
            parts = stream._parts  # the stream's own, loaded once: never a second copy
            return None if parts is None else parts.fetcher.xtok

    @contextlib.contextmanager
    def _caller(self) -> Iterator[None]:
        self._callers += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._callers -= 1
            if self._callers == 0:
                self._idle.set()

    async def _started(self) -> OPDStream:
        if self._closed:
            raise RuntimeError(f"{self._owner} is closed")
        if self._error is not None:
            raise OPDStreamError(
                f"the shared OPD stream stopped: {type(self._error).__name__}: {self._error}"
            )
        loop = asyncio.get_running_loop()
        if self._loop is not None and loop is not self._loop:
            raise RuntimeError(f"{self._owner} used from a different event loop")
        if self._ready is None:
            self._loop = loop
            self._ready = loop.create_future()
            self._task = loop.create_task(self._serve(), name=f"opd_stream.{self._owner}")
        await asyncio.shield(self._ready)
        if self.stream is None:
            raise OPDStreamError("the shared OPD stream is not running")
        return self.stream

    async def _serve(self) -> None:
        assert self._ready is not None
        try:
            async with OPDStream(self.config, transport=self._transport) as stream:
                self.stream = stream
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            self._error = exc
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise
        finally:
            self.stream = None

    async def aclose(self) -> None:
        """Let the calls in flight finish, then end the stream. Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        if task is None:
            return
        await self._idle.wait()
        self._stop.set()
        with contextlib.suppress(Exception):  # already raised to the calls that needed it
            await task
