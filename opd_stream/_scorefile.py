"""``opd-stream score``: score a JSON Lines file of rollouts against real SGLang servers.

The runner: :func:`run_score` (the ``score`` sub-command; :func:`add_score_arguments`
declares its options). The line schemas and the sans-IO decoding and rendering of one
line are :mod:`opd_stream._scorefile_schema`'s.

Input is read incrementally in a worker thread (``read1`` chunks, lines split here,
decoded in that thread), so memory stays bounded by the pipeline's capacities (plus the
longest line) however large the file; every non-blank input line gives exactly one output
line. Output is rendered and written in a worker thread, in batches.

Order: by default output lines come in completion order. With ``--ordered`` (or
``OPD_STREAM_ORDER=input``) they come in input order: the stream runs with
``order="input"`` (its reorder buffer holds at most ``max_reorder`` results) and lines
that fail to decode are merged back in at their place through a bounded queue of
``max_inflight + max_reorder`` tickets.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, BinaryIO, cast, get_args

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._config import IdScoring, Strategy, StreamConfig, WeightMode
from ._errors import ConfigError, InvalidSampleError
from ._logging import LOG_LEVELS, get_logger
from ._pipeline import Result
from ._progress import Progress
from ._router import normalize_teachers, parse_teacher_urls
from ._sample import Sample, SampleFailure, ScoredSample
from ._scorefile_schema import decode_line, line_failure, line_ref_of, render_result
from ._stream import OPDStream

__all__ = ("add_score_arguments", "run_score")

log = get_logger()

_PROG = "opd-stream score"
_TEACHERS_VAR = "OPD_STREAM_TEACHERS"
_READ_CHUNK = 1 << 20  # bytes asked of the input per read
_WRITE_BATCH = 256  # most results rendered and written per worker-thread call
_BOM = b"\xef\xbb\xbf"
DEFAULT_MAX_LINE_BYTES = 64 << 20


# --- reading --------------------------------------------------------------------------------


class _LineReader:
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
        chunk = self._read(_READ_CHUNK)
        while chunk and len(chunk) < len(_BOM) and _BOM.startswith(chunk):
            more = self._read(_READ_CHUNK)
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
            chunk = self._read(_READ_CHUNK) if self._started else self._first_chunk()
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


# --- command line ---------------------------------------------------------------------------


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    """Declare the options of ``opd-stream score`` on ``p``."""
    p.add_argument(
        "--teacher",
        action="append",
        metavar="NAME=URL",
        help="a teacher server (repeatable); replicas joined with '|'; required unless "
        "OPD_STREAM_TEACHERS is set (the flags then replace it)",
    )
    p.add_argument(
        "--default-teacher",
        metavar="NAME",
        help="teacher of lines that name none (default: the first --teacher)",
    )
    p.add_argument("--student-url", metavar="URL", help="student scoring server")
    p.add_argument("--input", required=True, metavar="PATH", help="JSON Lines input ('-': stdin)")
    p.add_argument(
        "--output", required=True, metavar="PATH", help="JSON Lines output ('-': stdout)"
    )
    p.add_argument("--top-k", type=int, help="0 = sampled-token mode; > 0 = top-k mode")
    p.add_argument("--strategy", choices=get_args(Strategy), help="top-k candidate set")
    p.add_argument("--weight-mode", choices=get_args(WeightMode), help="candidate weights")
    p.add_argument("--id-scoring", choices=get_args(IdScoring), help="how ids are scored")
    p.add_argument("--max-inflight", type=int, help="samples in the pipeline at once")
    p.add_argument(
        "--request-deadline-s", type=float, help="budget of one logical request, in seconds"
    )
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="read the API key from environment variable VAR (never from the command line)",
    )
    p.add_argument("--ordered", action="store_true", help="write results in input order")
    p.add_argument(
        "--with-candidates",
        action="store_true",
        help="include the per-candidate arrays in top-k mode (large)",
    )
    p.add_argument(
        "--max-line-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_LINE_BYTES,
        metavar="N",
        help="longest input line, in bytes; a longer line fails alone "
        f"(default {DEFAULT_MAX_LINE_BYTES >> 20} MiB)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--fail-on-error", action="store_true", help="exit 1 when any sample failed")
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,  # keeps a value given before the sub-command
        help="structlog level, also accepted before 'score' (default warning)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _UsageError(Exception):
    """A problem with the command line, the configuration or the files (exit code 2)."""


# StreamConfig fields with a flag of the same name (``--top-k`` -> ``top_k``); unset = env.
_FLAG_FIELDS = (
    "student_url",
    "top_k",
    "strategy",
    "weight_mode",
    "id_scoring",
    "max_inflight",
    "request_deadline_s",
)


def _config(args: argparse.Namespace) -> tuple[StreamConfig, str]:
    """The configuration (env, then flags) and the default teacher's name."""
    env_teachers: dict[str, tuple[str, ...]] | None = None
    if _TEACHERS_VAR in os.environ:  # validated even when --teacher replaces it
        try:
            env_teachers = normalize_teachers(os.environ[_TEACHERS_VAR].strip())
        except ConfigError as exc:
            raise _UsageError(f"{_TEACHERS_VAR}: {exc}") from None
    if args.teacher:
        try:
            teachers = parse_teacher_urls(list(args.teacher))
        except ConfigError as exc:
            raise _UsageError(f"--teacher: {exc}") from None
    elif env_teachers is not None:
        teachers = env_teachers
    else:
        raise _UsageError(f"--teacher is required (or set {_TEACHERS_VAR})")
    default = args.default_teacher if args.default_teacher is not None else next(iter(teachers))
    if default not in teachers:
        raise _UsageError(
            f"--default-teacher {default!r} is not a configured teacher "
            f"(known: {', '.join(sorted(teachers))})"
        )
    overrides: dict[str, Any] = {"teachers": teachers}
    for field in _FLAG_FIELDS:
        value = getattr(args, field)
        if value is not None:
            overrides[field] = value
    if args.ordered:
        overrides["order"] = "input"
    if args.api_key_env is not None:
        key = os.environ.get(args.api_key_env, "")
        if not key.strip():
            raise _UsageError(
                f"--api-key-env: environment variable {args.api_key_env} is not set or empty"
            )
        overrides["api_key"] = key.strip()
    try:
        cfg = StreamConfig.from_env(**overrides)
    except ConfigError as exc:
        raise _UsageError(f"configuration: {exc}") from None
    if args.with_candidates and cfg.top_k == 0:
        raise _UsageError("--with-candidates needs top-k mode (--top-k > 0)")
    return cfg, default


def _open(path: str, mode: str) -> BinaryIO:
    """Open ``path`` (``-``: stdin or stdout, not to be closed) in binary ``mode``."""
    std = sys.stdin if mode == "rb" else sys.stdout
    if path == "-":
        return std.buffer
    what = "input" if mode == "rb" else "output"
    try:
        fh = open(path, mode)  # noqa: SIM115 (closed by run_score)
    except OSError as exc:
        raise _UsageError(f"cannot open {what} {path!r}: {exc.strerror or exc}") from None
    return cast(BinaryIO, fh)


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
        self._error: _UsageError | None = None

    def open(self) -> None:
        """In the thread: open, keep the file or the error."""
        try:
            fh = _open(self._path, "rb")
        except _UsageError as exc:
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


async def _open_input(path: str) -> BinaryIO:
    """Open the input (``-``: stdin) without blocking the event loop."""
    if path == "-":
        return _open(path, "rb")
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


def _close(fh: BinaryIO, path: str) -> str | None:
    """Close a file opened by :func:`_open` (flush stdout); the error text, if any."""
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


def _same_file(input_path: str, output_path: str) -> bool:
    """True when the output is the very file the input is read from (stdin and stdout
    included), which opening the output would truncate before it is read."""
    a, b = _file_id(input_path, sys.stdin), _file_id(output_path, sys.stdout)
    return a is not None and a == b


class _Run:
    """One ``score`` run: reader -> stream -> (merge) -> writer, and the counts."""

    def __init__(
        self,
        args: argparse.Namespace,
        stream: OPDStream,
        default_teacher: str,
        source: BinaryIO,
        sink: BinaryIO,
    ) -> None:
        cfg = self.cfg = stream.config
        self.stream = stream
        self.source = source
        self.sink = sink
        self.with_candidates = bool(args.with_candidates)
        self.max_line_bytes = int(getattr(args, "max_line_bytes", DEFAULT_MAX_LINE_BYTES))
        self.ordered = cfg.order == "input"
        self.progress = Progress(sys.stderr, enabled=not args.no_progress)
        self.ok = 0
        self.failed: Counter[str] = Counter()
        self.input_error: str | None = None
        self.output_error: str | None = None
        self._teacher_key = cfg.teacher_key
        self._default_teacher = default_teacher
        # input order: one ticket per non-blank line (its seq, or its failure)
        self._tickets_send, self._tickets_recv = anyio.create_memory_object_stream[
            int | SampleFailure
        ](cfg.max_inflight + cfg.max_reorder)

    def _decode(self, data: bytes, line: int, seq: int) -> Sample:
        return decode_line(
            data,
            line=line,
            seq=seq,
            teacher_key=self._teacher_key,
            default_teacher=self._default_teacher,
        )

    async def _samples(self, out: MemoryObjectSendStream[Result]) -> AsyncIterator[Sample]:
        """The valid samples, for the stream; line failures go to ``out`` (or the tickets)."""
        reader = _LineReader(self.source, self._decode, self.max_line_bytes)
        try:
            while True:
                try:
                    batch = await anyio.to_thread.run_sync(
                        reader.read_batch, abandon_on_cancel=True
                    )
                except OSError as exc:
                    self.input_error = (
                        f"cannot read input after line {reader.lines}: {exc.strerror or exc}"
                    )
                    break
                if batch is None:
                    break
                for item in batch:
                    if isinstance(item, Sample):
                        if self.ordered:
                            await self._tickets_send.send(item.sample_id.seq)
                        yield item
                        continue
                    if self.ordered:
                        await self._tickets_send.send(item)
                    else:
                        await out.send(item)
            self.progress.set_total(reader.seq)
        finally:
            self._tickets_send.close()

    async def _pump(self, stream: OPDStream, out: MemoryObjectSendStream[Result]) -> None:
        """Completion order: results go to the writer as they come."""
        async with out, stream.run(self._samples(out)) as results:
            async for item in results:
                await out.send(item)

    async def _merge(self, stream: OPDStream, out: MemoryObjectSendStream[Result]) -> None:
        """Input order: follow the tickets; a valid line's result is the stream's next one."""
        async with out, self._tickets_recv, stream.run(self._samples(out)) as results:
            async for ticket in self._tickets_recv:
                if isinstance(ticket, SampleFailure):
                    await out.send(ticket)
                    continue
                item = await anext(results, None)
                if item is None or line_ref_of(item).seq != ticket:
                    raise RuntimeError(f"results out of input order at sample {ticket}")
                await out.send(item)
            if await anext(results, None) is not None:
                raise RuntimeError("a result without an input line")

    def _write_batch(self, batch: list[Result]) -> list[str | None]:
        """Render and write ``batch`` (worker thread); the failure reason of each, or None."""
        lines = [render_result(item, with_candidates=self.with_candidates) for item in batch]
        self.sink.write(b"".join(lines))
        self.sink.flush()
        return [None if isinstance(item, ScoredSample) else item.reason for item in batch]

    async def _writer(
        self, results: MemoryObjectReceiveStream[Result], scope: anyio.CancelScope
    ) -> None:
        async with results:
            while True:
                try:
                    batch = [await results.receive()]
                except anyio.EndOfStream:
                    return
                while len(batch) < _WRITE_BATCH:
                    try:
                        batch.append(results.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                try:
                    reasons = await anyio.to_thread.run_sync(self._write_batch, batch)
                except OSError as exc:
                    self.output_error = f"cannot write output: {exc.strerror or exc}"
                    scope.cancel()
                    return
                for item in batch:
                    if isinstance(item, SampleFailure):
                        log.info(
                            "line_failed",
                            line=line_ref_of(item).line,
                            reason=item.reason,
                            attempts=item.attempts,
                            message=item.message,
                        )
                failed = [r for r in reasons if r is not None]
                self.failed.update(failed)
                self.ok += len(reasons) - len(failed)
                self.progress.update(ok=len(reasons) - len(failed), failed=len(failed))

    async def run(self) -> None:
        send, receive = anyio.create_memory_object_stream[Result](self.cfg.channel_capacity)
        with self._tickets_send, self._tickets_recv, send, receive:
            async with self.stream as stream, anyio.create_task_group() as tg:
                tg.start_soon(self._writer, receive, tg.cancel_scope)
                tg.start_soon(self._merge if self.ordered else self._pump, stream, send)


async def run_score(args: argparse.Namespace) -> int:
    """Run ``opd-stream score`` with parsed ``args``; return the exit code.

    Returns:
        0 when the run completed (whatever failed per sample); 1 with ``--fail-on-error``
        when a sample failed; 2 on a usage, configuration or file error (the message goes
        to stderr, no traceback).
    """
    start = time.perf_counter()
    try:
        cfg, default = _config(args)
        stream = OPDStream(cfg)  # resolves kl_device (a ConfigError is a usage error)
        if _same_file(args.input, args.output):
            raise _UsageError("--output is the same file as --input (or the file behind stdin)")
        source = await _open_input(args.input)
    except ConfigError as exc:
        return _fail(f"configuration: {exc}")
    except _UsageError as exc:
        return _fail(str(exc))
    try:
        try:
            sink = _open(args.output, "wb")
        except _UsageError as exc:
            return _fail(str(exc))
        run = _Run(args, stream, default, source, sink)
        log.info(
            "score_started",
            teachers=sorted(cfg.teachers),
            default_teacher=default,
            top_k=cfg.top_k,
            order=cfg.order,
        )
        try:
            await run.run()
        finally:
            run.progress.close()
            closed = _close(sink, args.output)
            run.output_error = run.output_error or closed
    finally:
        if args.input != "-":
            source.close()
    wall = time.perf_counter() - start
    total_failed = sum(run.failed.values())
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(run.failed.items()))
    print(
        f"{_PROG}: {run.ok + total_failed} samples, {run.ok} ok, {total_failed} failed"
        f"{f' ({reasons})' if reasons else ''} in {wall:.2f} s",
        file=sys.stderr,
    )
    log.info("score_finished", ok=run.ok, failed=total_failed, wall_s=round(wall, 3))
    error = run.output_error or run.input_error
    if error is not None:
        if run.output_error is not None and args.output == "-":
            _silence_stdout()
        return _fail(error)
    return 1 if args.fail_on_error and total_failed else 0


def _fail(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return 2


def _silence_stdout() -> None:
    """After a broken stdout, point it at /dev/null so that the exit flush is quiet."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
