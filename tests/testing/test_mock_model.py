"""The mock SGLang model: exact normalisation, top-k, consistency, masking, sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opd_stream.testing.mock_sglang import MockModel

V = 151936
RNG = np.random.default_rng(12345)
TOKENS = RNG.integers(0, V - 2, size=300).astype(np.int64)
SAMPLED_POSITIONS = [1, 2, 3, 57, 150, 299, 300]


def reference_distribution(
    model: MockModel, tokens: np.ndarray, p: int
) -> tuple[dict[int, float], float]:
    """Per-position Python reference: {head id: logprob} and the logprob of every tail id."""
    rows = model.head_rows(tokens, np.array([p]))
    ids = [int(i) for i in rows.ids[0]]
    logits = [float(x) for x in rows.logits[0]]
    masked = {int(m) for m in model.masked_ids}
    n_tail = V - len(ids) - len(masked - set(ids))
    finite = [x for i, x in zip(ids, logits, strict=True) if i not in masked]
    mx = max(finite)
    z = mx + math.log(
        math.fsum(math.exp(x - mx) for x in finite) + n_tail * math.exp(model.tail_logit - mx)
    )
    head = {i: (-math.inf if i in masked else x - z) for i, x in zip(ids, logits, strict=True)}
    return head, model.tail_logit - z


@pytest.mark.parametrize("role", ["teacher", "student"])
@pytest.mark.parametrize("p", SAMPLED_POSITIONS)
def test_distribution_sums_to_one_over_the_full_vocabulary(role: str, p: int) -> None:
    model = MockModel(role, seed=3)  # type: ignore[arg-type]
    lp = model.logprobs(TOKENS, [p], np.arange(V)[None, :])[0]
    total = math.fsum(math.exp(x) for x in lp.tolist() if x != -math.inf)
    assert abs(total - 1.0) < 1e-6


def test_distribution_is_normalised_when_masked_ids_fall_in_the_head() -> None:
    base = MockModel("teacher", seed=1)
    head_ids = base.head_rows(TOKENS, [10]).ids[0]
    model = MockModel("teacher", seed=1, masked_ids=(int(head_ids[0]), int(head_ids[70]), 5))
    lp = model.logprobs(TOKENS, [10], np.arange(V)[None, :])[0]
    assert lp[head_ids[0]] == -math.inf
    assert lp[head_ids[70]] == -math.inf
    assert lp[5] == -math.inf
    assert abs(math.fsum(math.exp(x) for x in lp.tolist() if x != -math.inf) - 1.0) < 1e-6


def test_logprobs_match_the_per_position_reference() -> None:
    model = MockModel("student", seed=9)
    for p in SAMPLED_POSITIONS:
        head, tail = reference_distribution(model, TOKENS, p)
        ids = [*list(head)[:40], 0, 1, V - 1, V - 2, int(TOKENS[p - 1])]
        got = model.logprobs(TOKENS, [p], np.array([ids]))[0]
        for i, g in zip(ids, got.tolist(), strict=True):
            want = -math.inf if i in (V - 1, V - 2) else head.get(i, tail)
            assert g == pytest.approx(want, abs=1e-12) or (g == want == -math.inf)


def test_topk_is_the_best_k_of_the_reference_best_first_ties_by_smaller_id() -> None:
    model = MockModel("teacher", seed=2)
    ids, lps = model.topk(TOKENS, SAMPLED_POSITIONS, 64)
    for row, p in enumerate(SAMPLED_POSITIONS):
        head, tail = reference_distribution(model, TOKENS, p)
        want = sorted(head.items(), key=lambda kv: (-kv[1], kv[0]))[:64]
        assert ids[row].tolist() == [i for i, _ in want]
        assert lps[row].tolist() == pytest.approx([x for _, x in want], abs=1e-12)
        assert want[-1][1] > tail  # the head outranks every tail id


def test_topk_beyond_the_head_continues_with_the_smallest_tail_ids() -> None:
    model = MockModel("teacher", seed=2, head_size=8, vocab_size=1000)
    ids, lps = model.topk(TOKENS % 998, [5], 12)
    head, tail = reference_distribution_small(model, TOKENS % 998, 5)
    head_sorted = [i for i, _ in sorted(head.items(), key=lambda kv: (-kv[1], kv[0]))]
    tail_ids = [i for i in range(1000) if i not in head and i not in (998, 999)][:4]
    assert ids[0].tolist() == head_sorted + tail_ids
    assert lps[0, 8:].tolist() == pytest.approx([tail] * 4)


def reference_distribution_small(
    model: MockModel, tokens: np.ndarray, p: int
) -> tuple[dict[int, float], float]:
    lp = model.logprobs(tokens, [p], np.arange(model.vocab_size)[None, :])[0]
    rows = model.head_rows(tokens, [p])
    head = {int(i): float(lp[i]) for i in rows.ids[0]}
    return head, float(rows.tail_lp[0])


def test_same_context_gives_the_same_logprob_whatever_the_earlier_tokens() -> None:
    model = MockModel("teacher", seed=4)
    other = TOKENS.copy()
    other[:97] = RNG.integers(0, V - 2, size=97)  # position 100 sees tokens 98, 99 and p only
    ids = np.array([[int(TOKENS[100]), 7, 11]])
    assert model.logprobs(TOKENS, [100], ids).tolist() == model.logprobs(other, [100], ids).tolist()


def test_teacher_and_student_top_k_overlap_partially() -> None:
    teacher, student = MockModel("teacher", seed=1), MockModel("student", seed=2)
    pos = np.arange(1, 300)
    t_ids, _ = teacher.topk(TOKENS, pos, 8)
    s_ids, _ = student.topk(TOKENS, pos, 8)
    overlap = np.mean(
        [len(set(a) & set(b)) / 8 for a, b in zip(t_ids.tolist(), s_ids.tolist(), strict=True)]
    )
    assert 0.2 < overlap < 0.95


def test_zero_divergence_makes_teacher_and_student_identical() -> None:
    teacher = MockModel("teacher", seed=1, divergence=0.0)
    student = MockModel("student", seed=2, divergence=0.0)
    pos = np.arange(1, 50)
    assert np.array_equal(teacher.topk(TOKENS, pos, 16)[1], student.topk(TOKENS, pos, 16)[1])


def test_adjacent_positions_share_part_of_their_top_k() -> None:
    model = MockModel("teacher", seed=1)
    ids, _ = model.topk(TOKENS, np.arange(1, 300), 16)
    shared = np.mean(
        [len(set(a) & set(b)) for a, b in zip(ids[:-1].tolist(), ids[1:].tolist(), strict=True)]
    )
    assert 0.5 < shared < 16


def test_masked_ids_are_never_in_top_k_nor_sampled() -> None:
    model = MockModel("teacher", seed=5, vocab_size=600, head_size=8, masked_ids=(3, 4, 5))
    toks = TOKENS % 590
    ids, _ = model.topk(toks, np.arange(1, 200), 8)
    assert not np.isin(ids, [3, 4, 5]).any()
    gen = model.sample(toks[:5], 3000, np.random.default_rng(0))
    assert gen.size == 3000
    assert not np.isin(gen, [3, 4, 5]).any()


def test_greedy_sampling_follows_the_top_1_chain() -> None:
    model = MockModel("student", seed=8)
    gen = model.sample(TOKENS[:10], 6, np.random.default_rng(0), temperature=0.0)
    seq = TOKENS[:10].tolist()
    for g in gen.tolist():
        top, _ = model.topk(np.array(seq), [len(seq)], 1)
        assert g == int(top[0, 0])
        seq.append(g)


def test_sampling_frequency_of_the_top_token_matches_its_probability() -> None:
    model = MockModel("teacher", seed=6)
    ctx = TOKENS[:20]
    rng = np.random.default_rng(1)
    draws = [int(model.sample(ctx, 1, rng)[0]) for _ in range(1500)]
    top, lp = model.topk(ctx, [20], 1)
    prob = math.exp(float(lp[0, 0]))
    freq = draws.count(int(top[0, 0])) / len(draws)
    assert abs(freq - prob) < 4 * math.sqrt(prob * (1 - prob) / len(draws))


def test_sampling_stops_after_a_stop_token() -> None:
    model = MockModel("teacher", seed=6)
    greedy = model.sample(TOKENS[:4], 5, np.random.default_rng(0), temperature=0.0)
    gen = model.sample(
        TOKENS[:4], 5, np.random.default_rng(0), temperature=0.0, stop_token_ids=(int(greedy[1]),)
    )
    assert gen.tolist() == greedy[:2].tolist()


def test_token_logprobs_equal_logprobs_of_the_actual_tokens() -> None:
    model = MockModel("teacher", seed=1)
    pos = np.arange(1, 300)
    want = [model.logprobs(TOKENS, [p], [[int(TOKENS[p])]])[0, 0] for p in pos.tolist()]
    assert model.token_logprobs(TOKENS, pos).tolist() == want


def test_position_zero_cannot_be_scored() -> None:
    with pytest.raises(ValueError, match="positions"):
        MockModel().logprobs(TOKENS, [0], [[1]])
