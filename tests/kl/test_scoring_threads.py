"""The KL stage leaves torch's thread settings as the host set them (it never calls
``torch.set_num_threads``), and its numbers do not depend on them."""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest
import torch

import opd_stream._scoring as klstage
from opd_stream import Sample
from opd_stream._sample import Fetched, PreparedSample
from opd_stream.wire._answers import ScoreRows

R, K = 3, 2
S_IDS = np.array([[1, 2], [4, 5], [7, 8]], dtype=np.int64)
S_LP = np.log(np.array([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]], dtype=np.float32))
T_ON_S = np.log(np.array([[0.3, 0.7], [0.4, 0.6], [0.25, 0.75]], dtype=np.float32))


def _fetched() -> Fetched:
    tokens = np.array([10, 11, 12, 13], dtype=np.int64)
    prepared = PreparedSample(
        sample=Sample(tokens.tolist(), R),
        index=0,
        teacher="default",
        tokens=tokens,
        prompt_length=1,
        response_length=R,
        rollout_logprobs=None,
        student_top_ids=S_IDS,
        student_top_logprobs=S_LP,
    )
    rows = ScoreRows(
        token_ids=tokens[1:],
        token_logprobs=np.full(R, -1.0, dtype=np.float32),
        top_ids=None,
        top_logprobs=None,
        id_logprobs=T_ON_S,
        used_b64=False,
        weight_version=None,
    )
    return Fetched(
        prepared=prepared,
        teacher_rows=rows,
        student_ids=S_IDS,
        student_lps=S_LP,
        student_rows=None,
        attempts=1,
        admitted_at=0.0,
    )


def _score_in_thread(threads: int, seen: list[int]) -> tuple[Any, int]:
    out: dict[str, Any] = {}

    def work() -> None:
        torch.set_num_threads(threads)
        out["res"] = klstage.score_batch(
            [_fetched()],
            top_k=K,
            strategy="only-student",
            weight_mode="student_p",
            device=torch.device("cpu"),
        )
        out["after"] = torch.get_num_threads()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return out["res"], out["after"]


def test_a_cpu_batch_runs_with_the_hosts_thread_setting_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []
    real = klstage.topk_divergence

    def spy(*args: Any, **kw: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kw)

    monkeypatch.setattr(klstage, "topk_divergence", spy)
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    _, after = _score_in_thread(2, seen)
    assert calls == [2]  # only the test's own call
    assert seen == [torch.get_num_threads()]
    assert after == torch.get_num_threads()


def test_the_callers_thread_setting_is_untouched() -> None:
    before = torch.get_num_threads()
    _score_in_thread(2, [])
    assert torch.get_num_threads() == before


def test_the_reverse_kl_matches_a_float64_reference() -> None:
    (res,), _ = _score_in_thread(2, [])
    s, t = S_LP.astype(np.float64), T_ON_S.astype(np.float64)
    want = []
    for row in range(R):
        w = np.exp(s[row] - s[row].max())
        w /= w.sum()
        want.append(float(np.sum(w * (s[row] - t[row]))))
    got = res.reverse_kl.numpy().astype(np.float64)
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(got, want, strict=True))
