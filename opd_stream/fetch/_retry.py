"""Retry policy: exponential backoff with full jitter, bounded by attempts and a deadline.

Pure and synchronous: the caller owns the clock and the sleeping. One logical request
makes at most ``max_attempts`` attempts; after attempt ``n`` (1-based) fails with a
retryable error, the caller asks :meth:`RetryPolicy.delay` how long to sleep before
attempt ``n + 1``. The sleep is drawn uniformly from ``[0, min(max_s, initial_s * 2**(n-1))]``
("full jitter"), and the answer is ``None`` (give up now) when no attempt is left or when
the sleep would reach the request's deadline: a retry never sleeps past the deadline. The
arguments are checked against the same declarations as the :class:`StreamConfig` fields
they come from (``max_attempts``, ``backoff_initial_s``, ``backoff_max_s``).
"""

from __future__ import annotations

import email.utils
import math
import random
import time

from ..config._settings import check_settings

__all__ = ("RetryPolicy", "retry_after_s")

_RETRY_AFTER_MAX_S = 3600.0  # a longer wait is read as this (the deadline caps it anyway)


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header's wait in seconds (delta-seconds or an HTTP date; a date in
    the past is 0); ``None`` when absent or unreadable."""
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - time.time()
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), _RETRY_AFTER_MAX_S)


# 2**60 times any sane initial_s is far above any max_s; bounding the exponent avoids
# float overflow for absurd attempt numbers.
_MAX_EXPONENT = 60


class RetryPolicy:
    """When to retry a failed request, and how long to wait first.

    Args:
        max_attempts: attempts per logical request, the first included (>= 1).
        initial_s: backoff ceiling after the first failure, in seconds (finite, > 0).
        max_s: largest backoff ceiling, in seconds (finite, >= ``initial_s``).
        rng: the random source of the jitter; ``None`` makes a private unseeded one.
            Pass a seeded ``random.Random`` for reproducible delays.

    Raises:
        ConfigError: an argument out of range; the message names the StreamConfig field.
    """

    __slots__ = ("_initial_s", "_max_attempts", "_max_s", "_rng")

    def __init__(
        self,
        max_attempts: int,
        initial_s: float,
        max_s: float,
        rng: random.Random | None = None,
    ) -> None:
        checked = check_settings(
            max_attempts=max_attempts, backoff_initial_s=initial_s, backoff_max_s=max_s
        )
        self._max_attempts: int = checked["max_attempts"]
        self._initial_s: float = checked["backoff_initial_s"]
        self._max_s: float = checked["backoff_max_s"]
        self._rng = random.Random() if rng is None else rng

    @property
    def max_attempts(self) -> int:
        """Attempts per logical request, the first included."""
        return self._max_attempts

    @property
    def initial_s(self) -> float:
        """Backoff ceiling after the first failure, in seconds."""
        return self._initial_s

    @property
    def max_s(self) -> float:
        """Largest backoff ceiling, in seconds."""
        return self._max_s

    def ceiling(self, attempt: int) -> float:
        """Return the jitter ceiling after attempt ``attempt`` (1-based).

        That is ``min(max_s, initial_s * 2**(attempt - 1))``.

        Raises:
            ValueError: ``attempt < 1``.
        """
        if attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {attempt}")
        exponent = min(attempt - 1, _MAX_EXPONENT)
        return min(self._max_s, math.ldexp(self._initial_s, exponent))

    def delay(
        self, attempt: int, now: float, deadline: float, retry_after: float | None = None
    ) -> float | None:
        """Return the sleep before attempt ``attempt + 1``, or ``None`` to give up.

        Args:
            attempt: how many attempts have been made (and failed) so far, >= 1.
            now: the current time on the caller's clock.
            deadline: when the logical request's budget ends, on the same clock.
            retry_after: the server's ``Retry-After`` (seconds) on the failed attempt, if
                any: the sleep is at least that long.

        Returns:
            ``max(uniform(0, ceiling(attempt)), retry_after)`` seconds; ``None`` when
            ``attempt >= max_attempts`` or when ``now + sleep >= deadline`` (the next
            attempt could not start before the deadline).

        Raises:
            ValueError: ``attempt < 1``.
        """
        if attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {attempt}")
        if attempt >= self._max_attempts:
            return None
        if now >= deadline:
            return None
        sleep = self._rng.uniform(0.0, self.ceiling(attempt))
        if retry_after is not None:
            sleep = max(sleep, retry_after)
        if now + sleep >= deadline:
            return None
        return sleep

    def __repr__(self) -> str:
        return (
            f"RetryPolicy(max_attempts={self._max_attempts}, initial_s={self._initial_s}, "
            f"max_s={self._max_s})"
        )
