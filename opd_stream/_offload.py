"""Calls in anyio's worker processes with their bulk bytes in shared memory, not the pipe.

``anyio.to_process.run_sync`` pickles the function and its arguments into the worker's
stdin pipe and the return value back through its stdout pipe, 64 KiB per write and an
event-loop wakeup per chunk, after copying the whole body into one pickle on the event loop
(measured: event-loop stalls of 60 ms and more for 33 MB bodies). :func:`run_in_worker`
keeps the pipe for a few hundred bytes of control data and moves the bulk through one
shared-memory segment per call:

1. The parent pickles ``(func, args)`` with pickle protocol 5 and out-of-band buffers:
   contiguous numpy arrays and ``bytes`` / ``bytearray`` arguments of at least
   :data:`OUT_OF_BAND_MIN` bytes are not copied into the pickle but written, back to back,
   into an anonymous memory file (``os.memfd_create``, close-on-exec).
2. Through the pipe go the small pickle, the buffer lengths and the segment's path,
   ``/proc/<parent pid>/fd/<fd>``. The worker (:func:`_worker_entry`) opens that path,
   maps the segment copy-on-write (its arrays are writable as before; the parent's pages
   never change), unpickles with the mapped buffers and calls ``func``. **Out-of-band
   ``bytes`` arguments arrive as read-only memoryviews** (msgspec decoders accept any
   buffer).
3. The worker unmaps the input, writes the result's out-of-band buffers (the numpy arrays
   of a :class:`~opd_stream._decode.ScoreRows`; a ``bytes`` result as a whole) over it,
   cuts the segment to their end (freeing the input's pages in the worker, not on the
   parent's event loop), closes it and returns their lengths. The parent reads them into
   fresh memory of its own (``bytes`` for a ``bytes`` result, writable arrays otherwise):
   nothing returned refers to the segment.

Lifetime: the segment has no name in any file system; it lives while a descriptor or a
mapping refers to it. The parent closes its descriptor in a ``finally`` (success, error
raised by ``func``, cancellation, dead worker); the worker unmaps and closes before it
answers (when ``func`` raised, the finished frames of the traceback, whose locals hold
views of the mapping, are cleared first). Nothing outlives the call, even if either
process is killed. Errors raised by ``func`` reach the caller exactly as with ``run_sync``
(pickled by anyio with their attributes).

Fallback to plain ``run_sync`` (the pipe), transparently: when ``os.memfd_create`` or
``/proc/self/fd`` is missing (not Linux), when creating or writing the segment fails
(``ENOMEM``, ``EMFILE``, ...), when the call has no out-of-band buffer, or when a worker
cannot open or map the segment (no later call of this process tries segments again). A
worker that cannot write the result back returns it through the pipe.

Cancellation: ``run_sync`` waits for a worker that started the call (it is not
``cancellable``), so the segment is never closed under a worker that still reads it; a call
cancelled while waiting for the limiter never reaches a worker.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_process
import msgspec

__all__ = ("OUT_OF_BAND_MIN", "pack_call", "run_in_worker", "segments_usable")

T = TypeVar("T")

#: Buffers (array data, ``bytes`` arguments, a ``bytes`` result) at least this big travel
#: through the segment; smaller ones stay in the pickle.
OUT_OF_BAND_MIN = 16 * 1024

_SEGMENT_NAME = "opd_stream_offload"
_CHUNK = 256 * 1024  # parent-side reads and writes between two checkpoints


class _State:
    """Process-wide: whether ``/proc/self/fd`` exists (looked up once), and whether a worker
    could not open or map a segment (then segments are off for good in this process)."""

    proc_fd: bool | None = None
    worker_cannot_use = False


class _Reply(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`_worker_entry` sends back through the pipe.

    ``kind``: ``pickle`` (``meta`` is a protocol-5 pickle whose out-of-band buffers of
    ``lengths`` bytes lie back to back at ``offset`` in the segment), ``bytes`` (the result
    is the ``lengths[0]`` bytes at ``offset``), ``inline`` (the result is ``value``),
    ``unusable`` (the worker could not open or map the segment; nothing ran).
    """

    kind: Literal["pickle", "bytes", "inline", "unusable"]
    offset: int = 0
    meta: bytes = b""
    lengths: tuple[int, ...] = ()
    value: Any = None


def segments_usable() -> bool:
    """Whether calls in this process try the shared-memory segment at all."""
    if _State.proc_fd is None:
        _State.proc_fd = os.path.isdir("/proc/self/fd")
    return hasattr(os, "memfd_create") and _State.proc_fd and not _State.worker_cannot_use


def pack_call(func: Callable[..., Any], args: Sequence[Any]) -> tuple[bytes, list[memoryview]]:
    """Pickle ``(func, args)`` with the bulk buffers out of band.

    Returns:
        The protocol-5 pickle and its out-of-band buffers, in order, as flat byte
        memoryviews (views of the caller's objects, not copies). ``bytes`` and
        ``bytearray`` arguments of at least :data:`OUT_OF_BAND_MIN` bytes and contiguous
        numpy arrays of that size anywhere in ``args`` are out of band.
    """
    wrapped = tuple(
        pickle.PickleBuffer(a)
        if isinstance(a, bytes | bytearray) and len(a) >= OUT_OF_BAND_MIN
        else a
        for a in args
    )
    return _dumps((func, wrapped))


def _dumps(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Protocol-5 pickle of ``obj``; buffers of at least ``OUT_OF_BAND_MIN`` out of band."""
    buffers: list[memoryview] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        view = buf.raw()
        if view.nbytes < OUT_OF_BAND_MIN:
            return True  # in band
        buffers.append(view)
        return False

    return pickle.dumps(obj, protocol=5, buffer_callback=keep), buffers


def _pieces(views: Sequence[memoryview], offset: int) -> Iterator[tuple[memoryview, int]]:
    """``views`` laid back to back from ``offset``, cut into pieces of at most ``_CHUNK``."""
    for view in views:
        for start in range(0, view.nbytes, _CHUNK):
            yield view[start : start + _CHUNK], offset + start
        offset += view.nbytes


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:  # pwrite may write less than asked
        done += os.pwrite(fd, view[done:], offset + done)


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError("the offload segment is shorter than its reply says")
        done += n


def _write_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    for view in views:
        _pwrite_all(fd, view, offset)
        offset += view.nbytes


def _segment_path(fd: int) -> str:
    return f"/proc/{os.getpid()}/fd/{fd}"


def _new_segment() -> int | None:
    try:
        return os.memfd_create(_SEGMENT_NAME, os.MFD_CLOEXEC)
    except OSError:
        return None


async def _write_segment(fd: int, buffers: Sequence[memoryview]) -> bool:
    """Write ``buffers`` back to back from offset 0; False when the write fails (ENOSPC...).

    A checkpoint before each piece of ``_CHUNK`` keeps the event loop responsive (a fresh
    tmpfs page costs about 0.4 ms per MiB to allocate and fill; on 36 MB bodies, 256 KiB
    pieces measured a lower loop-lag p99 than 1-8 MiB ones, for ~30 us per checkpoint) and
    keeps the first piece apart from whatever the caller did just before (``run_sync``
    starts with a checkpoint too).
    """
    try:
        for piece, at in _pieces(buffers, 0):
            await anyio.lowlevel.checkpoint()
            _pwrite_all(fd, piece, at)
    except OSError:
        return False
    return True


async def _read_reply(fd: int, reply: _Reply) -> Any:
    """The worker's result: copied out of the segment into fresh memory (no views of it)."""
    if reply.kind == "inline":
        return reply.value
    if reply.kind == "bytes":
        data = os.pread(fd, reply.lengths[0], reply.offset)
        if len(data) < reply.lengths[0]:  # pragma: no cover - tmpfs reads are whole
            rest = bytearray(reply.lengths[0] - len(data))
            _pread_all(fd, memoryview(rest), reply.offset + len(data))
            data += rest
        return data
    buffers = [bytearray(n) for n in reply.lengths]
    for n, (piece, at) in enumerate(_pieces([memoryview(b) for b in buffers], reply.offset)):
        if n:
            await anyio.lowlevel.checkpoint()
        _pread_all(fd, piece, at)
    return pickle.loads(reply.meta, buffers=buffers)


async def run_in_worker(func: Callable[..., T], *args: Any, limiter: anyio.CapacityLimiter) -> T:
    """``anyio.to_process.run_sync(func, *args, limiter=limiter)``, bulk data in shared memory.

    ``func`` must be picklable by reference (a module-level function) and, when it gets a
    ``bytes``-like argument of at least :data:`OUT_OF_BAND_MIN` bytes, accept a read-only
    memoryview in its place. See the module docstring for the protocol, the cleanup
    guarantees and when the plain pipe is used instead.

    Raises:
        Whatever ``func`` raised (as ``run_sync`` delivers it), ``BrokenWorkerProcess``,
        or the backend's cancellation exception.
    """
    if segments_usable():
        meta, buffers = pack_call(func, args)
        fd = _new_segment() if buffers else None
        if fd is not None:
            try:
                if await _write_segment(fd, buffers):
                    reply: _Reply = await anyio.to_process.run_sync(
                        _worker_entry,
                        _segment_path(fd),
                        meta,
                        tuple(b.nbytes for b in buffers),
                        limiter=limiter,
                    )
                    if reply.kind == "unusable":
                        _State.worker_cannot_use = True
                    else:
                        result: T = await _read_reply(fd, reply)
                        return result
            finally:
                os.close(fd)
    result = await anyio.to_process.run_sync(func, *args, limiter=limiter)
    return result


# --- the worker's side ----------------------------------------------------------------


def _worker_entry(path: str, meta: bytes, lengths: tuple[int, ...]) -> _Reply:
    """Run in an anyio worker process: open the segment, call, write the result back.

    Once the input is unmapped, the result overwrites it from offset 0 and the segment is
    cut to the result's end, so the input's pages are freed here (not by the parent's
    ``close`` on the event loop) and the result reuses already allocated pages. If a view
    of the input is still alive (a result aliasing an argument) the mapping stays until
    that view goes, and the result is written after the input instead.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return _Reply(kind="unusable")
    try:
        total = sum(lengths)
        try:
            mapping = mmap.mmap(fd, total, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            return _Reply(kind="unusable")
        try:
            result = _call_mapped(mapping, meta, lengths)
        except BaseException as exc:
            _clear_frames(exc)
            if _close_mapping(mapping):
                _truncate(fd, 0)
            raise
        if not _close_mapping(mapping):
            return _write_result(fd, result, -(-total // mmap.PAGESIZE) * mmap.PAGESIZE)
        reply = _write_result(fd, result, 0)
        _truncate(fd, reply.offset + sum(reply.lengths))
        return reply
    finally:
        os.close(fd)


def _truncate(fd: int, size: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, size)


def _call_mapped(mapping: mmap.mmap, meta: bytes, lengths: tuple[int, ...]) -> Any:
    whole = memoryview(mapping)
    views: list[memoryview] = []
    pos = 0
    for n in lengths:
        views.append(whole[pos : pos + n])
        pos += n
    func, args = pickle.loads(meta, buffers=views)
    del views, whole
    return func(*args)


def _clear_frames(exc: BaseException) -> None:
    """Clear the finished frames of ``exc``'s traceback chain: their locals hold views."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += (e.__cause__, e.__context__)


def _close_mapping(mapping: mmap.mmap) -> bool:
    """Unmap; False when a view is still alive (the mapping then goes with the view)."""
    try:
        mapping.close()
    except BufferError:
        return False
    return True


def _write_result(fd: int, result: Any, offset: int) -> _Reply:
    try:
        if isinstance(result, bytes) and len(result) >= OUT_OF_BAND_MIN:
            _write_all(fd, [memoryview(result)], offset)
            return _Reply(kind="bytes", offset=offset, lengths=(len(result),))
        meta, buffers = _dumps(result)
        if not buffers:
            return _Reply(kind="inline", value=result)
        _write_all(fd, buffers, offset)
    except (OSError, BufferError):
        return _Reply(kind="inline", value=result)
    return _Reply(kind="pickle", offset=offset, meta=meta, lengths=tuple(b.nbytes for b in buffers))
