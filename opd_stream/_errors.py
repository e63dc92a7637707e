"""Errors raised (or carried inside a :class:`SampleFailure`) by ``opd_stream``.

The whole tree::

    OPDStreamError(Exception)               base of everything below
    ├── ConfigError(ValueError)             bad StreamConfig / OPD_STREAM_* variable
    ├── InvalidSampleError(ValueError)      a Sample field is wrong; fails that sample only
    ├── RoutingError(LookupError)           no teacher for a sample's metadata (no ``default``)
    ├── MissingLogprobError(ValueError)     a selected token has no logprob on one side
    ├── DeadlineExceeded(TimeoutError)      a logical request ran out of its budget
    ├── xtok._process.EncoderError(RuntimeError)  a tokenizer's helper process exited or
    │                                       failed (reason ``encoder_failed``)
    └── ServerError                         one request to one SGLang server went wrong
        ├── ServerHTTPError                 non-2xx answer: ``.status``, the server's message
        ├── ServerAbortError                HTTP 200 with ``finish_reason.type == "abort"``
        ├── ConnectionFailed                connect / reset / timeout below HTTP
        ├── ResponseTooLarge                body over ``max_response_bytes``
        └── ProtocolError                   a 200 answer that cannot be used as is
            ├── MalformedResponseError      not JSON, or the wrong shape (msgspec path)
            ├── MisalignedResponseError     row counts or token ids differ from the request
            ├── CapabilityError             the server ignored a feature we relied on
            │                               (``.capability``: per_position or b64_topk)
            └── WeightVersionChanged        one sample's answers (of one side) came from
                                            different weights (``meta_info.weight_version``)

Every error carries ``reason``, a short stable code used in :class:`SampleFailure.reason`
and in ``stats()["failures"]``, and ``retryable``, which the retry policy consults.
Messages never contain payloads or the API key: only shapes, positions and ids.
"""

from __future__ import annotations

__all__ = (
    "CapabilityError",
    "ConfigError",
    "ConnectionFailed",
    "DeadlineExceeded",
    "InvalidSampleError",
    "MalformedResponseError",
    "MisalignedResponseError",
    "MissingLogprobError",
    "OPDStreamError",
    "ProtocolError",
    "ResponseTooLarge",
    "RoutingError",
    "ServerAbortError",
    "ServerError",
    "ServerHTTPError",
    "WeightVersionChanged",
)

RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})


def _rebuild(
    cls: type[OPDStreamError], args: tuple[object, ...], state: dict[str, object]
) -> OPDStreamError:
    """Unpickle an error without calling its ``__init__`` (whose signature varies)."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class OPDStreamError(Exception):
    """Base class of every error raised by opd_stream.

    Errors pickle faithfully (every attribute kept), so that they survive the trip back
    from a decode worker process.
    """

    reason: str = "error"
    retryable: bool = False

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class ConfigError(OPDStreamError, ValueError):
    """The configuration is invalid; the message names the field or environment variable."""

    reason = "config"


class InvalidSampleError(OPDStreamError, ValueError):
    """A sample is invalid; ``field`` names the offending Sample field."""

    reason = "invalid_sample"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class RoutingError(OPDStreamError, LookupError):
    """No teacher is configured for the name a sample's metadata carries."""

    reason = "routing"


class MissingLogprobError(OPDStreamError, ValueError):
    """A selected candidate token has no logprob on one side (``side`` is student/teacher).

    The message names the side and the position; the token id (a value of the sample) is
    on ``token_id``, not in the message.
    """

    reason = "missing_logprob"

    def __init__(self, side: str, token_id: int, position: int, batch_index: int = 0) -> None:
        super().__init__(
            f"missing {side} logprob for a selected candidate token at response position {position}"
        )
        self.side = side
        self.token_id = token_id
        self.position = position
        self.batch_index = batch_index


class DeadlineExceeded(OPDStreamError, TimeoutError):
    """A logical request (retries included) did not finish within ``request_deadline_s``."""

    reason = "deadline_exceeded"


class ServerError(OPDStreamError):
    """One request to one server failed; ``side`` is ``teacher`` or ``student``."""

    reason = "server_error"

    def __init__(self, message: str, *, side: str = "teacher", url: str | None = None) -> None:
        super().__init__(message)
        self.side = side
        self.url = url


class ServerHTTPError(ServerError):
    """The server answered with a non-2xx status; the message is the server's own."""

    def __init__(
        self, status: int, message: str, *, side: str = "teacher", url: str | None = None
    ) -> None:
        super().__init__(f"HTTP {status}: {message}", side=side, url=url)
        self.status = status
        self.server_message = message
        self.reason = f"{side}_http_{status}"
        self.retryable = status in RETRYABLE_STATUSES
        self.retry_after: float | None = None  # seconds, from a 429/503's Retry-After


class ServerAbortError(ServerError):
    """HTTP 200 whose ``finish_reason.type`` is ``abort`` (SGLang's in-band failure)."""

    reason = "aborted"
    retryable = True


class ConnectionFailed(ServerError):
    """The connection failed, was reset, or timed out below the HTTP layer.

    ``refused`` is true when no connection could be made at all (refused, no route to the
    host, a name that does not resolve, no answer within ``connect_timeout_s``): the
    server was not reached. A stream stops
    retrying a replica set whose every replica has refused for ``unreachable_after_s``
    (``_balance.EndpointPool.unreachable``); that failure is a ``ConnectionFailed`` too,
    with ``retryable`` false.
    """

    reason = "connection_error"
    retryable = True

    def __init__(
        self,
        message: str,
        *,
        side: str = "teacher",
        url: str | None = None,
        refused: bool = False,
        retryable: bool = True,
    ) -> None:
        super().__init__(message, side=side, url=url)
        self.refused = refused
        self.retryable = retryable


class ResponseTooLarge(ServerError):
    """The response body exceeded ``max_response_bytes`` (checked while reading)."""

    reason = "response_too_large"

    def __init__(self, limit: int, *, side: str = "teacher", url: str | None = None) -> None:
        super().__init__(f"response body exceeds the {limit}-byte cap", side=side, url=url)
        self.limit = limit


class ProtocolError(ServerError):
    """An HTTP 200 answer that cannot be used as is."""

    reason = "protocol_error"


class MalformedResponseError(ProtocolError):
    """The body is not valid JSON, or not the SGLang response shape."""

    reason = "malformed_response"
    # A truncated or garbled body is usually a transport accident: worth another try.
    retryable = True


class MisalignedResponseError(ProtocolError):
    """Row counts or token ids in the answer differ from what was sent."""

    reason = "misaligned_response"


class CapabilityError(ProtocolError):
    """The server silently ignored a feature (``capability``) the request relied on."""

    reason = "capability"

    def __init__(
        self, capability: str, message: str, *, side: str = "teacher", url: str | None = None
    ) -> None:
        super().__init__(message, side=side, url=url)
        self.capability = capability


class WeightVersionChanged(ProtocolError):
    """The answers of one side (student or teacher) for one sample report different
    ``meta_info.weight_version`` values: the weights changed between (or within) the
    requests, so their logprobs must not be combined.

    Not retried as an attempt: the fetcher asks the side's requests once more as a whole,
    and fails the sample with this error (reason ``weight_version_changed``) when the
    versions differ again. ``versions`` lists the distinct versions seen, in answer order
    (``None`` where an answer carried none). ``member``: the ensemble member whose answers
    differ (``member 2 of 3 (URLS)``; the rule holds per member, whose versions may differ
    from each other's), named first in the message; None for a teacher that is not an
    ensemble, and for the student.
    """

    reason = "weight_version_changed"

    def __init__(
        self,
        versions: tuple[str | None, ...],
        *,
        side: str = "teacher",
        url: str | None = None,
        where: str = "the answers",
        member: str | None = None,
    ) -> None:
        super().__init__("weight_version changed", side=side, url=url)
        self.versions = versions
        self.where = where
        self.member = member

    def __str__(self) -> str:
        # the side is known only once the attempt that decoded the answer names it
        shown = ", ".join("none" if v is None else repr(v[:64]) for v in self.versions)
        named = "" if self.member is None else f"ensemble {self.member}: "
        return (
            f"{named}{self.side}: {self.where} report different meta_info.weight_version "
            f"values ({shown})"
        )
