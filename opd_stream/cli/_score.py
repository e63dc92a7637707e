"""``opd-stream score``: score a JSON Lines file of rollouts against real SGLang servers.

The runner, :func:`run_score`; its options are :mod:`opd_stream.cli._score_options`', input
and files :mod:`opd_stream.cli._score_files`', line schemas and codecs
:mod:`opd_stream.cli._score_schema`'s. Input is read and decoded incrementally in a worker
thread, so memory stays bounded however large the file; every non-blank input line gives
exactly one output line, rendered and written in a worker thread, in batches. Lines come in
completion order, or with ``--ordered`` (``OPD_STREAM_ORDER=input``) in input order: the
stream's reorder buffer, plus a bounded queue of ``max_inflight + max_reorder`` tickets
that merges the lines that fail to decode back in at their place.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import BinaryIO

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._errors import ConfigError
from .._logging import get_logger
from .._pipeline import Result
from .._sample import Sample, SampleFailure, ScoredSample
from .._stream import OPDStream
from ..xtok._chat import TeacherPrompts
from ._parser_notice import scanner_notice
from ._progress import Progress
from ._score_files import (
    DEFAULT_MAX_LINE_BYTES,
    LineReader,
    UsageError,
    close_file,
    discard_output,
    open_input,
    open_output,
    same_file,
    truncate_output,
)
from ._score_options import add_score_arguments, score_config
from ._score_schema import decode_line, line_ref_of, render_result

__all__ = ("add_score_arguments", "run_score")

log = get_logger()

_PROG = "opd-stream score"
_WRITE_BATCH = 256  # most results rendered and written per worker-thread call


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
        # prompt_messages -> a teacher's own chat template (loaded on first use, in the
        # reader thread)
        self._teacher_prompts = TeacherPrompts(cfg.teacher_tokenizers)
        self._own_tokenizer = frozenset(cfg.teacher_tokenizers or ())
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
            teacher_prompts=self._teacher_prompts,
            own_tokenizer=self._own_tokenizer,
        )

    async def _samples(self, out: MemoryObjectSendStream[Result]) -> AsyncIterator[Sample]:
        """The valid samples, for the stream; line failures go to ``out`` (or the tickets)."""
        reader = LineReader(self.source, self._decode, self.max_line_bytes)
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
        """Score the input into the output (the stream entered already)."""
        send, receive = anyio.create_memory_object_stream[Result](self.cfg.channel_capacity)
        with self._tickets_send, self._tickets_recv, send, receive:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._writer, receive, tg.cancel_scope)
                tg.start_soon(self._merge if self.ordered else self._pump, self.stream, send)


async def run_score(args: argparse.Namespace) -> int:
    """Run ``opd-stream score`` with parsed ``args``; return the exit code.

    The command line, the configuration and both files are checked before the stream is
    built (which imports torch): a usage error costs well under a second.

    Returns:
        0 when the run completed and some sample was scored (whatever failed per sample);
        1 when samples failed and none was scored, or with ``--fail-on-error`` when any
        sample failed; 2 on a usage, configuration or file error (the message goes to
        stderr, no traceback).
    """
    start = time.perf_counter()
    try:
        cfg, default = score_config(args)
        if same_file(args.input, args.output):
            raise UsageError("--output is the same file as --input (or the file behind stdin)")
        source = await open_input(args.input)
    except UsageError as exc:
        return _fail(str(exc))
    try:
        try:
            sink, created = open_output(args.output)  # not truncated yet
        except UsageError as exc:
            return _fail(str(exc))
        async with contextlib.AsyncExitStack() as entered:
            try:
                stream = OPDStream(cfg)
                # entered before the output is emptied: torch is imported (off the loop)
                # and kl_device resolved, the tokenizers of teachers with their own are
                # loaded, so that a file that does not load (or a missing [xtok] extra)
                # leaves the output as it was
                await entered.enter_async_context(stream)
            except ConfigError as exc:
                discard_output(sink, args.output, created)
                return _fail(f"configuration: {exc}")
            try:
                truncate_output(sink, args.output)
            except OSError as exc:
                discard_output(sink, args.output, created)
                return _fail(f"cannot write output: {exc.strerror or exc}")
            notice = scanner_notice()
            if notice is not None:
                print(f"{_PROG}: {notice}", file=sys.stderr)
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
                closed = close_file(sink, args.output)
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
    if total_failed and run.ok == 0:
        print(f"{_PROG}: error: no sample was scored", file=sys.stderr)
        return 1
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
