"""The fault matrix, asserted: every fault mode of the mock, over real HTTP, mixed workload.

Each mode runs ``support.fault_matrix.run_fault_mode`` (the function that
``bench/reliability.py`` renders as docs/reliability.md) and checks: every sample comes out
exactly once; retryable faults recover and the retries are counted; non-retryable faults
fail their sample alone with the right reason; every scored result equals the independent
closed-form reference (so none was computed from a bad answer); the run stays within its
deadline budget; afterwards no task is pending and the connection pools are idle.

Real sockets, real clock (aiohttp needs asyncio), so every time limit here is one a busy
machine cannot reach by itself: a healthy request has 30 s (``DEADLINE_S``), a hung one ends
at the hang row's 8 s deadline, the watchdog row abandons an attempt after 4 s; healthy
requests take well under 2 s on a 2-core box with both cores busy.

The same rows run against the mock vLLM servers (``engine="vllm"``, issue 33), on fewer
samples: every mode whose outcome depends on the answer the client decodes (the vLLM
dialect's errors, abort, bodies cut or bad, rows missing, sizes); "hang", "hang_watchdog"
and "restart" end before any answer is decoded (the SGLang rows cover them), and "misaligned" is
``tests/system/test_vllm_reliability.py``'s (vLLM's binary rows carry no token ids).
"""

from __future__ import annotations

from typing import Any

import pytest
from support.fault_matrix import (
    DEFAULT_N,
    HANG_DEADLINE_S,
    MODES,
    TOP_K,
    VLLM_MODES,
    FaultMode,
    FaultRun,
    run_fault_mode,
    teacher_model,
)
from support.pipeline_reference import assert_matches, expected_result

from opd_stream import SampleFailure, ScoredSample
from opd_stream.testing.mock_sglang import FAULT_KINDS

N = DEFAULT_N  # samples per stream: 240 per mode, as in docs/reliability.md
N_VLLM = 24  # per stream on the vLLM mocks: each mode still injects tens of faults
_N = {"sglang": N, "vllm": N_VLLM}
VLLM_SKIP = {"hang", "hang_watchdog", "restart", "misaligned"}  # see the module docstring
_BY_KEY = {m.key: m for m in MODES}

pytestmark = pytest.mark.slow


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    # Real sockets need asyncio; debug mode off to keep a few hundred requests per mode fast.
    return ("asyncio", {})


def _modes(*expects: str) -> list[Any]:
    """(engine, mode) of every row with one of ``expects``, SGLang's and vLLM's."""
    out = [pytest.param("sglang", m, id=m.key) for m in MODES if m.expect in expects]
    out += [
        pytest.param("vllm", m, id=f"vllm-{m.key}")
        for m in VLLM_MODES
        if m.expect in expects and m.key not in VLLM_SKIP
    ]
    return out


def test_the_matrix_covers_every_fault_kind_of_the_mock() -> None:
    kinds = {m.fault_kind for m in MODES if m.fault_kind is not None}
    assert kinds == set(FAULT_KINDS)
    assert {"unpatched", "restart", "none"} <= set(_BY_KEY)
    # vLLM: every mode but the SGLang-only one (per_position)
    assert {m.key for m in VLLM_MODES} == set(_BY_KEY) - {"unpatched"}


def _assert_invariants(run: FaultRun, n: int = N) -> None:
    row = run.row
    assert row.samples_out == row.samples_in == 2 * n
    assert row.unique_out == row.samples_in  # each index exactly once, per stream
    assert sorted(r.index for r in run.topk_results) == list(range(n))
    assert sorted(r.index for r in run.sampled_results) == list(range(n))
    assert row.scored + sum(row.failures.values()) == row.samples_in
    assert row.wrong == 0
    assert row.wall_s <= row.budget_s, (row.wall_s, row.budget_s)
    assert row.pending_tasks == 0
    assert row.pool_idle
    assert row.high_water_ok
    # top-k results: the whole candidate set and reverse KL against the float64 reference
    for res in run.topk_results:
        if not isinstance(res, ScoredSample):
            continue
        smp = res.sample
        exp = expected_result(
            tokens=smp.tokens,
            response_length=smp.response_length,
            teacher=teacher_model(run.workload, smp),
            student=run.workload.models["student"],
            top_k=TOP_K,
            strategy="union",
            weight_mode="student_p",
        )
        assert_matches(res, exp)


@pytest.mark.parametrize(("engine", "mode"), _modes("clean"))
async def test_harmless_modes_score_everything_without_retries(
    engine: str, mode: FaultMode
) -> None:
    run = await run_fault_mode(mode, _N[engine], engine=engine)  # type: ignore[arg-type]
    _assert_invariants(run, _N[engine])
    assert run.row.failures == {}
    assert run.row.retries == 0
    if mode.fault_kind is not None:
        assert run.row.injected > 0


@pytest.mark.parametrize(("engine", "mode"), _modes("recover"))
async def test_retryable_faults_recover_and_every_retry_is_counted(
    engine: str, mode: FaultMode
) -> None:
    run = await run_fault_mode(mode, _N[engine], engine=engine)  # type: ignore[arg-type]
    _assert_invariants(run, _N[engine])
    row = run.row
    assert row.injected > 0
    assert set(row.failures) <= mode.reasons, row.failures
    # at 10% with 4 attempts a logical request fails about once in 10^4
    assert sum(row.failures.values()) <= 2
    # every injected fault cost one attempt: retried, or the last attempt of a failure
    assert row.retries + sum(row.failures.values()) == row.injected


@pytest.mark.parametrize(("engine", "mode"), _modes("fail"))
async def test_non_retryable_faults_fail_their_sample_alone_with_the_reason(
    engine: str, mode: FaultMode
) -> None:
    run = await run_fault_mode(mode, _N[engine], engine=engine)  # type: ignore[arg-type]
    _assert_invariants(run, _N[engine])
    row = run.row
    assert row.injected > 0
    (reason,) = mode.reasons
    assert row.failures == {reason: row.injected}
    assert row.retries == 0


async def test_hangs_fail_at_the_deadline_and_the_server_sees_the_disconnect() -> None:
    run = await run_fault_mode(_BY_KEY["hang"], N)
    _assert_invariants(run)
    row = run.row
    assert row.injected > 0
    assert row.failures == {"deadline_exceeded": row.injected}
    failed = [r for r in run.topk_results + run.sampled_results if isinstance(r, SampleFailure)]
    # each at its own request's deadline, after its one attempt
    within = f"within {HANG_DEADLINE_S} s after 1 attempt(s)"
    assert all(within in r.message for r in failed), [r.message for r in failed]
    assert row.retries == 0
    assert row.disconnects >= row.injected


async def test_servers_ignoring_per_position_are_detected_and_scored_blocked() -> None:
    run = await run_fault_mode(_BY_KEY["unpatched"], N)
    _assert_invariants(run)
    assert run.row.failures == {} and run.row.retries == 0
    topk_endpoints = run.stats[0].endpoints
    assert len(topk_endpoints) == 4  # two math replicas, default, student
    assert all(ep.per_position is False for ep in topk_endpoints.values())


async def test_a_killed_and_restarted_replica_costs_retries_not_samples() -> None:
    run = await run_fault_mode(_BY_KEY["restart"], N)
    _assert_invariants(run)
    row = run.row
    assert row.failures == {}  # a retry goes to the live replica
    assert row.retries > 0  # at least the request held by the killed replica
    assert run.restarted_served > 0  # the replica took work again after its restart
