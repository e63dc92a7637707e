"""A tiny dependency-free progress bar for command-line runs (``opd-stream score``).

On a terminal it redraws one line in place (``\\r``), at most every ``min_interval_s``
(0.1 s by default, so ~10 redraws per second however fast results arrive), and ends it
with a newline on :meth:`Progress.close`. When the stream is not a terminal (a log file, a
pipe, CI) nothing is drawn while the run goes on and :meth:`Progress.close` writes one
plain final line. A disabled bar writes nothing at all.

The line shows results done (``done/total`` and a percentage once the total is known,
else ``done``), ok and failed counts, the rate since the bar was created and the elapsed
time, e.g. ``scored 120/1000 samples (12.0%) | ok 118, failed 2 | 34.5 samples/s | 3.5 s``.
It never shows data, only counts.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ("Progress",)


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class Progress:
    """Counts of a run, drawn on ``stream`` (stderr by default).

    Args:
        stream: where to draw; ``None`` means ``sys.stderr`` at construction time.
        enabled: False makes every method a no-op (``--no-progress``).
        label: the verb in front of the counts (``scored``).
        unit: the plural noun of what is counted (``samples``).
        min_interval_s: smallest time between two redraws on a terminal.
        clock: monotonic time source, in seconds (injected by tests).
        width: line width on a terminal; ``None`` asks the terminal (minus one column).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        enabled: bool = True,
        label: str = "scored",
        unit: str = "samples",
        min_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        width: int | None = None,
    ) -> None:
        self._stream = sys.stderr if stream is None else stream
        self._enabled = enabled
        self._tty = enabled and _is_tty(self._stream)
        self._label = label
        self._unit = unit
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._width = width
        self._start = clock()
        self._last_draw: float | None = None
        self._closed = False
        self.total: int | None = None
        self.ok = 0
        self.failed = 0

    @property
    def done(self) -> int:
        """Results counted so far (ok + failed)."""
        return self.ok + self.failed

    @property
    def is_tty(self) -> bool:
        """Whether the bar redraws in place (enabled, and the stream is a terminal)."""
        return self._tty

    def set_total(self, total: int | None) -> None:
        """Set (or forget, with ``None``) the number of results expected in all."""
        self.total = total
        self._maybe_draw()

    def update(self, *, ok: int = 0, failed: int = 0) -> None:
        """Count ``ok`` more successes and ``failed`` more failures; redraw if it is time."""
        self.ok += ok
        self.failed += failed
        self._maybe_draw()

    def render(self, now: float | None = None) -> str:
        """The progress line (no ``\\r``, no newline) as of ``now`` (default: the clock)."""
        elapsed = max((self._clock() if now is None else now) - self._start, 0.0)
        done = self.done
        if self.total is not None:
            pct = 100.0 * done / self.total if self.total else 100.0
            count = f"{done}/{self.total} {self._unit} ({pct:.1f}%)"
        else:
            count = f"{done} {self._unit}"
        rate = done / elapsed if elapsed > 0 else 0.0
        return (
            f"{self._label} {count} | ok {self.ok}, failed {self.failed} | "
            f"{rate:.1f} {self._unit}/s | {elapsed:.1f} s"
        )

    def close(self) -> None:
        """Draw the final state and end the line (a terminal), or write one plain line
        (not a terminal). Idempotent; a disabled bar writes nothing."""
        if self._closed:
            return
        self._closed = True
        if not self._enabled:
            return
        if self._tty:
            self._draw(self._clock())
            self._write("\n")
        else:
            self._write(self.render() + "\n")

    def _maybe_draw(self) -> None:
        if not self._tty or self._closed:
            return
        now = self._clock()
        if self._last_draw is None or now - self._last_draw >= self._min_interval_s:
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._last_draw = now
        width = self._width
        if width is None:
            width = max(shutil.get_terminal_size((80, 24)).columns - 1, 20)
        self._write("\r" + self.render(now)[:width] + "\x1b[K")

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not end the run
            pass
