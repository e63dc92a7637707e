"""RetryPolicy: full-jitter exponential backoff, attempt and deadline bounds."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_stream._errors import (
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
from opd_stream.fetch._retry import RetryPolicy

FAR = 1e9  # a deadline that never binds


def _reference_ceiling(attempt: int, initial_s: float, max_s: float) -> float:
    """The backoff ceiling by the formula, in float64, one attempt at a time."""
    ceiling = initial_s
    for _ in range(attempt - 1):
        ceiling = min(max_s, ceiling * 2.0)
    return min(max_s, ceiling)


# --------------------------------------------------------------------------- backoff


def test_ceiling_doubles_from_initial_and_is_capped() -> None:
    policy = RetryPolicy(max_attempts=10, initial_s=0.1, max_s=1.0)
    ceilings = [policy.ceiling(a) for a in range(1, 8)]
    assert ceilings == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0], rel=0, abs=1e-15)


def test_ceiling_of_a_huge_attempt_number_is_the_cap() -> None:
    assert RetryPolicy(3, 0.05, 2.0).ceiling(100_000) == 2.0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_delay_is_a_uniform_draw_below_the_ceiling(seed: int) -> None:
    policy = RetryPolicy(max_attempts=8, initial_s=0.05, max_s=1.0, rng=random.Random(seed))
    reference = random.Random(seed)
    for attempt in range(1, 8):
        expected = reference.uniform(0.0, _reference_ceiling(attempt, 0.05, 1.0))
        got = policy.delay(attempt, now=0.0, deadline=FAR)
        assert got == expected
        assert got is not None
        assert 0.0 <= got <= _reference_ceiling(attempt, 0.05, 1.0)


def test_delays_use_the_whole_jitter_range_and_grow_with_attempts() -> None:
    policy = RetryPolicy(max_attempts=10, initial_s=0.1, max_s=10.0, rng=random.Random(7))
    for attempt in (1, 2, 3, 4):
        draws = [policy.delay(attempt, 0.0, FAR) for _ in range(2000)]
        values = [d for d in draws if d is not None]
        assert len(values) == 2000
        ceiling = 0.1 * 2 ** (attempt - 1)
        assert max(values) <= ceiling
        assert max(values) > 0.95 * ceiling
        assert min(values) < 0.05 * ceiling
        assert sum(values) / len(values) == pytest.approx(ceiling / 2, rel=0.08)


def test_delays_stop_growing_at_the_cap() -> None:
    policy = RetryPolicy(max_attempts=50, initial_s=0.1, max_s=0.3, rng=random.Random(3))
    values = [policy.delay(a, 0.0, FAR) for a in range(3, 49) for _ in range(50)]
    assert all(v is not None and 0.0 <= v <= 0.3 for v in values)


def test_default_rng_draws_within_bounds() -> None:
    delay = RetryPolicy(3, 0.2, 1.0).delay(2, now=5.0, deadline=FAR)
    assert delay is not None
    assert 0.0 <= delay <= 0.4


# --------------------------------------------------------------------------- attempts


def test_no_delay_once_attempts_are_exhausted() -> None:
    policy = RetryPolicy(max_attempts=3, initial_s=0.01, max_s=0.01, rng=random.Random(0))
    assert policy.delay(1, 0.0, FAR) is not None
    assert policy.delay(2, 0.0, FAR) is not None
    assert policy.delay(3, 0.0, FAR) is None
    assert policy.delay(4, 0.0, FAR) is None


def test_a_single_attempt_never_retries() -> None:
    assert RetryPolicy(1, 0.01, 0.01).delay(1, 0.0, FAR) is None


def test_attempt_numbers_start_at_one() -> None:
    with pytest.raises(ValueError, match="attempt must be >= 1"):
        RetryPolicy(3, 0.01, 0.01).delay(0, 0.0, FAR)


# --------------------------------------------------------------------------- deadline


def test_no_delay_when_the_deadline_has_passed() -> None:
    policy = RetryPolicy(5, 0.01, 0.01, rng=random.Random(0))
    assert policy.delay(1, now=10.0, deadline=10.0) is None
    assert policy.delay(1, now=11.0, deadline=10.0) is None


def test_no_delay_when_the_sleep_would_reach_the_deadline() -> None:
    # uniform(0, 1) with this seed; a deadline just below now + draw gives up.
    draw = random.Random(5).uniform(0.0, 1.0)
    assert RetryPolicy(5, 1.0, 1.0, rng=random.Random(5)).delay(1, 100.0, 100.0 + draw) is None
    below = RetryPolicy(5, 1.0, 1.0, rng=random.Random(5)).delay(1, 100.0, 100.0 + draw + 1e-6)
    assert below == draw


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    attempt=st.integers(1, 12),
    now=st.floats(0.0, 1e6, allow_nan=False),
    budget=st.floats(-5.0, 5.0, allow_nan=False),
)
def test_a_delay_never_sleeps_past_the_deadline(
    seed: int, attempt: int, now: float, budget: float
) -> None:
    policy = RetryPolicy(8, 0.05, 2.0, rng=random.Random(seed))
    deadline = now + budget
    delay = policy.delay(attempt, now, deadline)
    if delay is not None:
        assert attempt < 8
        assert delay >= 0.0
        assert now + delay < deadline


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0, 0.05, 2.0), "max_attempts"),
        ((True, 0.05, 2.0), "max_attempts"),
        ((3, 0.0, 2.0), "backoff_initial_s"),
        ((3, math.inf, math.inf), "backoff_initial_s"),
        ((3, math.nan, 2.0), "backoff_initial_s"),
        ((3, 0.5, 0.1), "backoff_max_s"),
        ((3, 0.5, math.inf), "backoff_max_s"),
    ],
)
def test_invalid_policy_is_a_config_error(args: tuple[int, float, float], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}\b"):
        RetryPolicy(*args)


# --------------------------------------------------------------------------- retryable errors


def _error_id(value: object) -> str:
    if isinstance(value, ServerHTTPError):
        return f"HTTP{value.status}"
    return type(value).__name__ if isinstance(value, BaseException) else str(value)


@pytest.mark.parametrize(
    ("exc", "retryable"),
    [
        (ConnectionFailed("reset"), True),
        (ServerAbortError("aborted"), True),
        (MalformedResponseError("truncated"), True),
        (ServerHTTPError(429, "slow down"), True),
        (ServerHTTPError(500, "oops"), True),
        (ServerHTTPError(502, "bad gateway"), True),
        (ServerHTTPError(503, "unavailable"), True),
        (ServerHTTPError(504, "timeout"), True),
        (ServerHTTPError(400, "bad request"), False),
        (ServerHTTPError(404, "not found"), False),
        (ServerHTTPError(501, "not implemented"), False),
        (ResponseTooLarge(1024), False),
        (MisalignedResponseError("rows"), False),
        (CapabilityError("per_position", "ignored"), False),
        (DeadlineExceeded("late"), False),
        (ConfigError("bad"), False),
        (RoutingError("who"), False),
        (InvalidSampleError("tokens", "empty"), False),
        (MissingLogprobError("teacher", 3, 0), False),
    ],
    ids=_error_id,
)
def test_retryable_follows_the_error_tree(exc: OPDStreamError, retryable: bool) -> None:
    # what the scorer reads before asking RetryPolicy.delay for a backoff
    assert exc.retryable is retryable
