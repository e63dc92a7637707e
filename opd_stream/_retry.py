"""Retry policy: exponential backoff with full jitter, bounded by attempts and a deadline.

Pure and synchronous: the caller owns the clock and the sleeping. One logical request
makes at most ``max_attempts`` attempts; after attempt ``n`` (1-based) fails with a
retryable error, the caller asks :meth:`RetryPolicy.delay` how long to sleep before
attempt ``n + 1``. The sleep is drawn uniformly from ``[0, min(max_s, initial_s * 2**(n-1))]``
("full jitter"), raised to a server's ``Retry-After`` hint when one is given, and the
answer is ``None`` (give up now) when no attempt is left or when the sleep would reach the
request's deadline: a retry never sleeps past the deadline.
"""

from __future__ import annotations

import math
import random
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING

from ._errors import ConfigError, OPDStreamError

if TYPE_CHECKING:
    from ._config import StreamConfig

__all__ = ("RetryPolicy", "is_retryable", "parse_retry_after")

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
        ConfigError: an argument out of range.
    """

    __slots__ = ("_initial_s", "_max_attempts", "_max_s", "_rng")

    def __init__(
        self,
        max_attempts: int,
        initial_s: float,
        max_s: float,
        rng: random.Random | None = None,
    ) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
            raise ConfigError("max_attempts: expected an integer")
        if max_attempts < 1:
            raise ConfigError(f"max_attempts: must be >= 1, got {max_attempts}")
        if not (math.isfinite(initial_s) and initial_s > 0):
            raise ConfigError(f"backoff_initial_s: must be finite and > 0, got {initial_s}")
        if not (math.isfinite(max_s) and max_s >= initial_s):
            raise ConfigError(
                f"backoff_max_s: must be finite and >= backoff_initial_s ({initial_s}), got {max_s}"
            )
        self._max_attempts = max_attempts
        self._initial_s = float(initial_s)
        self._max_s = float(max_s)
        self._rng = random.Random() if rng is None else rng

    @classmethod
    def from_config(cls, cfg: StreamConfig, rng: random.Random | None = None) -> RetryPolicy:
        """Build the policy of a :class:`StreamConfig` (max_attempts and backoff fields)."""
        return cls(cfg.max_attempts, cfg.backoff_initial_s, cfg.backoff_max_s, rng)

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
        self,
        attempt: int,
        now: float,
        deadline: float,
        retry_after: float | None = None,
    ) -> float | None:
        """Return the sleep before attempt ``attempt + 1``, or ``None`` to give up.

        Args:
            attempt: how many attempts have been made (and failed) so far, >= 1.
            now: the current time on the caller's clock.
            deadline: when the logical request's budget ends, on the same clock.
            retry_after: a server's hint (e.g. HTTP ``Retry-After``), in seconds; the
                sleep is at least this long. Negative or NaN hints are ignored.

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
        if retry_after is not None and retry_after > 0:  # False for NaN
            sleep = max(sleep, float(retry_after))
        if now + sleep >= deadline:
            return None
        return sleep

    def __repr__(self) -> str:
        return (
            f"RetryPolicy(max_attempts={self._max_attempts}, initial_s={self._initial_s}, "
            f"max_s={self._max_s})"
        )


def is_retryable(exc: BaseException) -> bool:
    """Return whether a failed attempt that raised ``exc`` may be retried.

    ``opd_stream`` errors say so themselves (``.retryable``: e.g. connection failures,
    aborts, malformed bodies and HTTP 429/5xx are; deadline, capability and misalignment
    errors are not). Any other exception is a bug or a cancellation, never retried.
    """
    if isinstance(exc, OPDStreamError):
        return bool(exc.retryable)
    return False


def parse_retry_after(value: str | None, *, now_epoch: float | None = None) -> float | None:
    """Parse an HTTP ``Retry-After`` header into seconds from now.

    Args:
        value: the header text: delta-seconds (``"3"``, ``"1.5"``) or an HTTP-date.
        now_epoch: the current Unix time, needed for the HTTP-date form (``None``: that
            form is ignored).

    Returns:
        Seconds (>= 0, finite), or ``None`` for a missing or unusable header.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        if now_epoch is None:
            return None
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # "-0000" dates; HTTP-dates are always GMT
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp() - now_epoch
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)
