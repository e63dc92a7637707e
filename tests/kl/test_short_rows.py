"""Student top-k rows with fewer than k entries, or none (``docs/semantics.md``, "Missing
values and empty rows").

Miles' multi-turn merge leaves empty rows (``[]``) on observation spans, and a rollout
engine may return fewer than k entries. The reference builds each position's candidate set
from the entries present: only-student on an empty row selects nothing (0.0), union selects
the teacher's top-k alone, and so on. In the array form such rows are padded at their end
with id -1. Checked here through the whole pipeline (mock servers in-process) against the
independent float64 per-position reference, for every strategy x weight mode, and every id
form; and that no request ever carries a padding id.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from support.config import stream_config
from support.kl_reference import reference_position

from opd_stream import OPDStream, Sample, SampleFailure, ScoredSample
from opd_stream._sample import request_ids
from opd_stream.kl._math import STRATEGIES, WEIGHT_MODES
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.wire._student_topk import PAD_ID

T, S = "http://teacher:1", "http://student:2"
K = 4
COMBOS = [(s, w) for s in STRATEGIES for w in WEIGHT_MODES]


def _f32(values: Any) -> list[float]:
    return [float(np.float32(v)) for v in np.asarray(values, dtype=np.float64).ravel()]


class _Case:
    """Samples whose student top-k rows keep a random prefix of 0..K entries."""

    def __init__(self, seed: int, n: int = 3) -> None:
        self.teacher = InProcessSGLang("teacher", 0)
        self.student = InProcessSGLang("student", 1)
        rng = np.random.default_rng(seed)
        self.samples: list[Sample] = []
        self.kept: list[list[int]] = []
        for i in range(n):
            p, r = int(rng.integers(2, 6)), int(rng.integers(4, 10))
            tokens = rng.integers(0, 5000, p + r)
            ids, lps = self.student.model.topk(tokens, np.arange(p, p + r), K)
            kept = rng.integers(0, K + 1, r)
            kept[0], kept[-1] = 0, K  # at least one empty and one full row
            if i == 0:
                kept[1] = 1
            pad = np.arange(K)[None, :] >= kept[:, None]
            pad_ids = np.where(pad, PAD_ID, ids).astype(np.int64)
            # Whatever a padding slot's logprob (here 0.0, not -inf), it is ignored.
            pad_lps = np.where(pad, 0.0, lps).astype(np.float32)
            self.samples.append(
                Sample(tokens.tolist(), r, student_top_logprobs=(pad_ids, pad_lps), sample_id=i)
            )
            self.kept.append(kept.tolist())

    def transport(self) -> Any:
        return mock_transport({T: self.teacher, S: self.student})

    def expected(self, i: int, strategy: str, weight_mode: str) -> list[Any]:
        """The reference's per-position answers for sample ``i``."""
        smp = self.samples[i]
        tok = np.asarray(smp.tokens, dtype=np.int64)
        p = len(tok) - smp.response_length
        out = []
        for t in range(smp.response_length):
            pos = np.array([p + t])
            s_ids, s_lp = self.student.model.topk(tok, pos, K)
            n = self.kept[i][t]
            s_ids, s_lp = s_ids[:, :n], s_lp[:, :n]
            t_ids, t_lp = self.teacher.model.topk(tok, pos, K)
            t_on_s = self.teacher.model.logprobs(tok, pos, s_ids) if n else np.zeros((1, 0))
            s_on_t = self.student.model.logprobs(tok, pos, t_ids)
            out.append(
                reference_position(
                    strategy=strategy,
                    weight_mode=weight_mode,
                    s_ids=[int(x) for x in s_ids[0]],
                    s_lp=_f32(s_lp[0]),
                    t_on_s=_f32(t_on_s[0]),
                    t_ids=[int(x) for x in t_ids[0]],
                    t_lp=_f32(t_lp[0]),
                    s_on_t=_f32(s_on_t[0]),
                )
            )
        return out


async def _run(case: _Case, **fields: Any) -> list[ScoredSample | SampleFailure]:
    cfg = stream_config(T, student_url=S, top_k=K, **fields)
    async with OPDStream(cfg, transport=case.transport()) as stream:
        async with stream.run(case.samples) as results:
            return sorted([r async for r in results], key=lambda r: r.index)


def _check(case: _Case, results: list[Any], strategy: str, weight_mode: str) -> None:
    for i, res in enumerate(results):
        assert isinstance(res, ScoredSample), getattr(res, "message", res)
        assert res.reverse_kl is not None and res.candidates is not None
        got = res.reverse_kl.tolist()
        for t, ref in enumerate(case.expected(i, strategy, weight_mode)):
            assert abs(got[t] - ref.r) <= 1e-5 + 1e-6 * ref.scale, (i, t, got[t], ref.r)
            n = len(ref.ids)
            assert res.candidates.ids[t, :n].tolist() == ref.ids, (i, t)
            assert bool(res.candidates.mask[t, :n].all()), (i, t)
            assert not bool(res.candidates.mask[t, n:].any()), (i, t)
            for g, e in zip(res.candidates.weights[t, :n].tolist(), ref.weights, strict=True):
                assert abs(g - e) <= 1e-5, (i, t, g, e)


def _sent_ids(server: InProcessSGLang) -> list[int]:
    """Every token id the server was asked to score (any id form)."""
    out: list[int] = []
    for body in server.bodies:
        reqs = msgspec.json.decode(body)
        for req in reqs if isinstance(reqs, list) else [reqs]:
            for name in ("token_ids_logprob_positions", "token_ids_logprob"):
                rows = req.get(name)
                if rows is None:
                    continue
                stack = list(rows) if isinstance(rows, list) else [rows]
                while stack:
                    x = stack.pop()
                    if isinstance(x, list):
                        stack.extend(x)
                    elif x is not None:
                        out.append(int(x))
    return out


@pytest.mark.parametrize(("strategy", "weight_mode"), COMBOS)
async def test_short_and_empty_rows_match_the_reference(strategy: str, weight_mode: str) -> None:
    case = _Case(seed=len(strategy) * 7 + len(weight_mode))
    results = await _run(
        case, strategy=strategy, weight_mode=weight_mode, id_scoring="per-position"
    )
    _check(case, results, strategy, weight_mode)
    assert all(i >= 0 for i in _sent_ids(case.teacher) + _sent_ids(case.student))


@pytest.mark.parametrize("id_scoring", ["per-position", "blocked", "flat"])
@pytest.mark.parametrize("strategy", ["only-student", "union", "xor"])
async def test_every_id_form_sends_no_padding_and_scores_the_same(
    id_scoring: str, strategy: str
) -> None:
    case = _Case(seed=3)
    results = await _run(case, strategy=strategy, id_scoring=id_scoring)
    _check(case, results, strategy, "student_p")
    sent = _sent_ids(case.teacher)
    assert sent and min(sent) >= 0


async def test_only_student_empty_rows_are_zero_and_select_nothing() -> None:
    case = _Case(seed=5)
    results = await _run(case, strategy="only-student")
    for res, kept in zip(results, case.kept, strict=True):
        assert isinstance(res, ScoredSample) and res.reverse_kl is not None
        assert res.candidates is not None
        for t, n in enumerate(kept):
            assert int(res.candidates.mask[t].sum()) == n
            if n == 0:
                assert res.reverse_kl[t].item() == 0.0
                assert (res.candidates.ids[t] == -1).all()


async def test_union_on_an_empty_row_selects_the_teacher_top_k_alone() -> None:
    case = _Case(seed=6)
    results = await _run(case, strategy="union")
    res, smp = results[0], case.samples[0]
    assert isinstance(res, ScoredSample) and res.candidates is not None
    tok = np.asarray(smp.tokens)
    p = len(tok) - smp.response_length
    t_ids, _ = case.teacher.model.topk(tok, np.array([p]), K)
    assert res.candidates.ids[0, :K].tolist() == t_ids[0].tolist()  # row 0 is empty
    assert not bool(res.candidates.mask[0, K:].any())


# --- the array form's validation and the request filler --------------------------------


def _arrays() -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([[5, 9, 2, 7], [1, 2, -1, -1], [-1, -1, -1, -1]], dtype=np.int64)
    lps = np.log(np.array([[0.5, 0.2, 0.1, 0.05]] * 3)).astype(np.float32)
    return ids, lps


async def _score_arrays(ids: np.ndarray, lps: np.ndarray) -> ScoredSample | SampleFailure:
    servers = {T: InProcessSGLang("teacher", 2)}
    cfg = stream_config(T, top_k=K)
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        sample = Sample([11, 12, 13, 14], 3, student_top_logprobs=(ids, lps))
        async with stream.run([sample]) as rs:
            (result,) = [r async for r in rs]
            return result


async def test_padding_values_are_ignored_even_nan() -> None:
    ids, lps = _arrays()
    a = await _score_arrays(ids, lps)
    lps2 = lps.copy()
    lps2[ids == PAD_ID] = np.nan
    b = await _score_arrays(ids, lps2)
    assert isinstance(a, ScoredSample) and isinstance(b, ScoredSample)
    assert a.reverse_kl is not None and b.reverse_kl is not None
    assert torch.equal(a.reverse_kl, b.reverse_kl)
    assert a.reverse_kl[2].item() == 0.0
    assert lps[1, 2] == np.float32(math.log(0.1))  # the caller's array is not modified


@pytest.mark.parametrize(
    ("where", "value", "words"),
    [
        ((1, 0), -1, "row 1 holds padding (id -1) before a token id"),
        ((0, 0), -1, "row 0 holds padding (id -1) before a token id"),
        ((0, 2), -2, "row 0 holds a negative token id"),
    ],
)
async def test_padding_must_end_its_row(where: tuple[int, int], value: int, words: str) -> None:
    ids, lps = _arrays()
    ids[where] = value
    out = await _score_arrays(ids, lps)
    assert isinstance(out, SampleFailure) and out.reason == "invalid_sample"
    assert words in out.message, out.message


def test_request_ids_fill_padding_with_the_smallest_free_ids() -> None:
    ids = np.array([[5, 9, 2, 7], [0, 2, -1, -1], [-1, -1, -1, -1], [1, -1, -1, -1]])
    out = request_ids(ids)
    assert out.tolist() == [[5, 9, 2, 7], [0, 2, 1, 3], [0, 1, 2, 3], [1, 0, 2, 3]]
    assert ids[1, 2] == -1  # a copy
    full = np.array([[3, 1]])
    assert request_ids(full) is full  # nothing to replace: no copy


def test_request_ids_are_distinct_per_row_on_random_rows() -> None:
    rng = np.random.default_rng(0)
    for k in (1, 2, 5, 16):
        ids = np.stack([rng.permutation(3 * k)[:k] for _ in range(200)]).astype(np.int64)
        kept = rng.integers(0, k + 1, 200)
        ids[np.arange(k)[None, :] >= kept[:, None]] = -1
        out = request_ids(ids)
        assert (out >= 0).all()
        assert all(len(set(row)) == k for row in out.tolist())
        keep = ids >= 0
        assert (out[keep] == ids[keep]).all()
