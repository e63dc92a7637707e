"""The files of ``opd-stream score``: the input read in chunks and decoded line by line
(:class:`LineReader`, in a worker thread), the input and output opened and closed
(:func:`open_input` without blocking the event loop, :func:`open_file`, :func:`close_file`),
and the check that the output is not the input (:func:`same_file`).

A problem with the command line, the configuration or the files is a :class:`UsageError`
(exit code 2).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO, cast

import anyio
import anyio.from_thread
import anyio.lowlevel

from .._errors import InvalidSampleError
from .._sample import Sample, SampleFailure
from ._score_schema import line_failure

__all__ = (
    "DEFAULT_MAX_LINE_BYTES",
    "READ_CHUNK",
    "LineReader",
    "UsageError",
    "close_file",
    "discard_output",
    "open_file",
    "open_input",
    "open_output",
    "same_file",
    "truncate_output",
)

READ_CHUNK = 1 << 20
"""Bytes asked of the input per read."""
_BOM = b"\xef\xbb\xbf"
DEFAULT_MAX_LINE_BYTES = 64 << 20
"""The longest input line by default (``--max-line-bytes``)."""


class UsageError(Exception):
    """A problem with the command line, the configuration or the files (exit code 2)."""


class LineReader:
    """Reads and decodes input lines in chunks (called from a worker thread).

    A UTF-8 byte-order mark at the start of the input is skipped. A line longer than
    ``max_line_bytes`` fails alone (``invalid_sample``, field ``line``) as soon as it is
    seen to be too long; the rest of it is read and dropped, never held. Any error while
    decoding one line fails that line alone.
    """

    def __init__(
        self,
        fh: BinaryIO,
        decode: Callable[[bytes, int, int], Sample],
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> None:
        read1 = getattr(fh, "read1", None)
        self._read: Callable[[int], bytes] = read1 if read1 is not None else fh.read
        self._decode = decode
        self._max = max_line_bytes
        self._parts: list[bytes] = []
        self._held = 0  # bytes in _parts
        self._skipping = False  # inside a line that already failed as too long
        self._started = False
        self._eof = False
        self.lines = 0  # physical lines seen
        self.seq = 0  # non-blank lines seen

    def _next_seq(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    def _take(self, data: bytes, out: list[Sample | SampleFailure]) -> None:
        self.lines += 1
        if len(data) > self._max:
            self._too_long(out, counted=True)
            return
        if not data.strip():
            return
        seq = self._next_seq()
        try:
            out.append(self._decode(data, self.lines, seq))
        except InvalidSampleError as exc:
            out.append(line_failure(data, line=self.lines, seq=seq, error=exc))
        except Exception as exc:  # whatever else a hostile line does, it fails alone
            error = InvalidSampleError("json", f"cannot be read ({type(exc).__name__})")
            out.append(line_failure(data, line=self.lines, seq=seq, error=error))

    def _too_long(self, out: list[Sample | SampleFailure], *, counted: bool) -> None:
        if not counted:
            self.lines += 1
        error = InvalidSampleError(
            "line", f"longer than {self._max} bytes (the limit is --max-line-bytes)"
        )
        out.append(line_failure(b"", line=self.lines, seq=self._next_seq(), error=error))

    def _first_chunk(self) -> bytes:
        """The first bytes of the input, without a UTF-8 byte-order mark."""
        self._started = True
        chunk = self._read(READ_CHUNK)
        while chunk and len(chunk) < len(_BOM) and _BOM.startswith(chunk):
            more = self._read(READ_CHUNK)
            if not more:
                break
            chunk += more
        return chunk.removeprefix(_BOM)

    def read_batch(self) -> list[Sample | SampleFailure] | None:
        """The next decoded lines (at least one), or None at the end of the input.

        Reads at most one chunk more than it needs; a line longer than a chunk is
        gathered in parts and joined once.
        """
        out: list[Sample | SampleFailure] = []
        while not out and not self._eof:
            chunk = self._read(READ_CHUNK) if self._started else self._first_chunk()
            if not chunk:
                self._eof = True
                if self._parts:
                    last, self._parts, self._held = b"".join(self._parts), [], 0
                    self._take(last, out)
                break
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                piece = chunk[start:end]
                start = end + 1
                if self._skipping:  # the end of a line that already failed
                    self._skipping = False
                    continue
                if self._parts:
                    self._parts.append(piece)
                    piece, self._parts, self._held = b"".join(self._parts), [], 0
                self._take(piece, out)
            if start < len(chunk) and not self._skipping:
                self._parts.append(chunk[start:])
                self._held += len(chunk) - start
                if self._held > self._max:
                    self._parts, self._held, self._skipping = [], 0, True
                    self._too_long(out, counted=False)
        return out or None


def open_file(path: str, mode: str) -> BinaryIO:
    """Open ``path`` (``-``: stdin or stdout, not to be closed) in binary ``mode``."""
    std = sys.stdin if mode == "rb" else sys.stdout
    if path == "-":
        return std.buffer
    what = "input" if mode == "rb" else "output"
    try:
        fh = open(path, mode)  # noqa: SIM115 (closed by run_score)
    except OSError as exc:
        raise UsageError(f"cannot open {what} {path!r}: {exc.strerror or exc}") from None
    return cast(BinaryIO, fh)


def open_output(path: str) -> tuple[BinaryIO, bool]:
    """Open the output for writing (``-``: stdout) without truncating it yet, so that an
    error found later (a configuration the stream refuses) leaves an existing file as it
    was; and whether this call created the file. :func:`truncate_output` empties it once
    the run goes ahead, :func:`discard_output` gives it up."""
    if path == "-":
        return sys.stdout.buffer, False
    created = not os.path.lexists(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    except OSError as exc:
        raise UsageError(f"cannot open output {path!r}: {exc.strerror or exc}") from None
    return cast(BinaryIO, os.fdopen(fd, "wb")), created


def truncate_output(fh: BinaryIO, path: str) -> None:
    """Empty the output opened by :func:`open_output` (a regular file; a pipe, a terminal
    or ``/dev/null`` has nothing to truncate)."""
    if path == "-":
        return
    fd = fh.fileno()
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.ftruncate(fd, 0)


def discard_output(fh: BinaryIO, path: str, created: bool) -> None:
    """Give up the output opened by :func:`open_output` before anything was written: close
    it, and remove it when :func:`open_output` created it."""
    if path == "-":
        return
    with contextlib.suppress(OSError):
        fh.close()
        if created:
            os.unlink(path)


class _Opener:
    """Opens the input in a daemon thread: ``open`` blocks on a FIFO with no writer.

    The event loop stays free (so the first Ctrl-C interrupts), and a daemon thread does
    not hold up the interpreter's exit while it is still blocked. A file opened after the
    wait was given up is closed at once.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._abandoned = False
        self._fh: BinaryIO | None = None
        self._error: UsageError | None = None

    def open(self) -> None:
        """In the thread: open, keep the file or the error."""
        try:
            fh = open_file(self._path, "rb")
        except UsageError as exc:
            self._error = exc
            return
        with self._lock:
            if self._abandoned:
                fh.close()
                return
            self._fh = fh

    def abandon(self) -> None:
        """Nobody waits any more: close the file if it came, or when it comes."""
        with self._lock:
            self._abandoned = True
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def result(self) -> BinaryIO:
        if self._error is not None:
            raise self._error
        assert self._fh is not None
        return self._fh


async def open_input(path: str) -> BinaryIO:
    """Open the input (``-``: stdin) without blocking the event loop."""
    if path == "-":
        return open_file(path, "rb")
    opener = _Opener(path)
    opened = anyio.Event()
    token = anyio.lowlevel.current_token()

    def work() -> None:
        opener.open()
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            anyio.from_thread.run_sync(opened.set, token=token)

    threading.Thread(target=work, name="opd-stream-open-input", daemon=True).start()
    try:
        await opened.wait()
    except BaseException:
        opener.abandon()
        raise
    return opener.result()


def close_file(fh: BinaryIO, path: str) -> str | None:
    """Close a file opened by :func:`open_file` (flush stdout); the error text, if any."""
    try:
        if path == "-":
            fh.flush()
        else:
            fh.close()
    except (OSError, ValueError) as exc:
        return f"cannot write output: {getattr(exc, 'strerror', None) or exc}"
    return None


def _file_id(path: str, std: Any) -> tuple[int, int] | None:
    """(device, inode) of the regular file at ``path`` (``-``: behind ``std``), else None."""
    try:
        st = os.fstat(std.fileno()) if path == "-" else os.stat(path)
    except (OSError, ValueError, AttributeError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def same_file(input_path: str, output_path: str) -> bool:
    """True when the output is the very file the input is read from (stdin and stdout
    included), which opening the output would truncate before it is read."""
    a, b = _file_id(input_path, sys.stdin), _file_id(output_path, sys.stdout)
    return a is not None and a == b
