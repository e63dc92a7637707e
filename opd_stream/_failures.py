"""What a sample that the KL stage does not score ends as: a :class:`SampleFailure` whose
message is redacted (a server may echo the Authorization header in an error body, an abort
message or a malformed header line, possibly cut by a cap)."""

from __future__ import annotations

from typing import Any

from ._errors import OPDStreamError
from ._logging import get_logger
from ._redact import redact
from ._sample import PreparedSample, SampleFailure

__all__ = ("internal_failure", "sample_failure")

log = get_logger()


def sample_failure(
    sample: Any, index: int, exc: OPDStreamError, attempts: int, secret: str | None
) -> SampleFailure:
    """``exc`` as the failure of ``sample`` (the caller's object as given, a Sample or not:
    invalid_sample), its message redacted."""
    message = redact(str(exc), secret)
    return SampleFailure(
        sample=sample, index=index, reason=exc.reason, message=message, attempts=attempts
    )


def internal_failure(
    prepared: PreparedSample, exc: Exception, attempts: int, secret: str | None
) -> SampleFailure:
    """An unexpected error (a bug) as the failure of its sample (reason ``internal_error``),
    logged with its traceback."""
    log.error("internal_error", index=prepared.index, error=type(exc).__name__, exc_info=exc)
    message = f"internal error ({type(exc).__name__}); please report it: {exc}"
    return SampleFailure(
        sample=prepared.sample,
        index=prepared.index,
        reason="internal_error",
        message=redact(message, secret)[:500],
        attempts=attempts,
    )
