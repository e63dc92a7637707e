"""The error tree: reasons, retryability, and faithful pickling (decode worker processes)."""

from __future__ import annotations

import pickle

import pytest

from opd_stream import (
    CapabilityError,
    ConfigError,
    ConnectionFailed,
    DeadlineExceeded,
    InvalidSampleError,
    MalformedResponseError,
    MisalignedResponseError,
    MissingLogprobError,
    OPDStreamError,
    ResponseTooLarge,
    RoutingError,
    ServerAbortError,
    ServerHTTPError,
)

ERRORS = [
    ConfigError("top_k: must be >= 0"),
    InvalidSampleError("tokens", "negative token id at position 3"),
    RoutingError("no teacher"),
    MissingLogprobError("teacher", 17, 4, batch_index=2),
    DeadlineExceeded("teacher request did not finish within 1 s"),
    ServerHTTPError(503, "queue full", side="student", url="http://s:1"),
    ServerAbortError("Abort request.", side="teacher", url="http://t:1"),
    ConnectionFailed("reset", url="http://t:1"),
    ResponseTooLarge(1024, side="student"),
    MalformedResponseError("Input data was truncated", url="http://t:1"),
    MisalignedResponseError("row 3: token id differs", side="student"),
    CapabilityError("per_position", "server ignored the field", side="student", url="http://s"),
]


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_survive_pickling_with_every_attribute(exc: OPDStreamError) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert back.reason == exc.reason and back.retryable == exc.retryable
    assert vars(back) == vars(exc)


def test_http_reasons_name_the_side_and_status() -> None:
    assert ServerHTTPError(400, "x", side="teacher").reason == "teacher_http_400"
    assert ServerHTTPError(429, "x", side="student").reason == "student_http_429"


@pytest.mark.parametrize(
    ("status", "retryable"),
    [
        (400, False),
        (401, False),
        (404, False),
        (422, False),
        (429, True),
        (500, True),
        (502, True),
        (503, True),
        (504, True),
    ],
)
def test_only_transient_statuses_are_retryable(status: int, retryable: bool) -> None:
    assert ServerHTTPError(status, "x").retryable is retryable


def test_the_builtin_bases_let_callers_catch_broadly() -> None:
    assert isinstance(ConfigError("x"), ValueError)
    assert isinstance(DeadlineExceeded("x"), TimeoutError)
    assert isinstance(RoutingError("x"), LookupError)
    assert isinstance(InvalidSampleError("f", "x"), ValueError)
