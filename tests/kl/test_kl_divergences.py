"""Forward KL and generalized JSD over the candidate set (issue 27), tail bucket or not.

Every value is checked against the independent float64 loop of ``kl_reference``; on the
mock's closed-form model each divergence with the tail is at least 0 and at most its
full-vocabulary value; the JSD is symmetric at beta = 0.5, bounded by log 2 (by the binary
entropy of beta in general) and, divided by beta (by 1 - beta), tends to the forward
(reverse) KL over the same outcomes as beta goes to 0 (to 1).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kl_reference import reference_divergence_position, reference_full_divergence
from support.kl_rows import FIELDS, Rows, batch_of, distribution_rows, model_rows

from opd_stream._errors import MissingLogprobError
from opd_stream.kl._math import STRATEGIES, Strategy, TopKBatch, topk_divergence
from opd_stream.testing.mock_sglang import MockModel

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
WEIGHTS = {"reverse_kl": "student_p", "forward_kl": "teacher_p", "jsd": "student_p"}


def run(
    samples: list[Rows],
    strategy: Strategy,
    divergence: Any,
    *,
    tail: bool,
    beta: float = 0.5,
    device: str = "cpu",
) -> Any:
    return topk_divergence(
        batch_of(samples, device),
        strategy,
        WEIGHTS[divergence],  # type: ignore[arg-type]
        divergence=divergence,
        jsd_beta=beta,
        tail=tail,
    )


def check(
    samples: list[Rows],
    strategy: Strategy,
    divergence: str,
    *,
    tail: bool,
    beta: float = 0.5,
    device: str = "cpu",
) -> tuple[Any, list[Any]]:
    """Run and compare every output with the float64 reference."""
    res = run(samples, strategy, divergence, tail=tail, beta=beta, device=device)
    got_r = res.signal.double().cpu().numpy()
    got_w = res.weights.double().cpu().numpy()
    refs = []
    for i, smp in enumerate(samples):
        rows = {key: smp[key].tolist() for _, key in FIELDS}
        for pos in range(smp["s_ids"].shape[0]):
            ref = reference_divergence_position(
                divergence=divergence,
                beta=beta,
                strategy=strategy,
                tail=tail,
                **{k: v[pos] for k, v in rows.items()},
            )
            refs.append(ref)
            n = len(ref.ids)
            assert res.ids[i, pos, :n].tolist() == ref.ids
            assert res.mask[i, pos, :n].all() and not res.mask[i, pos, n:].any()
            assert (got_w[i, pos, n:] == 0).all()
            np.testing.assert_allclose(got_w[i, pos, :n], ref.weights, rtol=2e-6, atol=1e-9)
            if tail:
                assert ref.tails is not None and res.student_tail_lp is not None
                ls, lt = ref.tails
                assert abs(res.student_tail_lp[i, pos].item() - ls) <= 1e-6 * abs(ls) + 1e-12
                assert abs(res.teacher_tail_lp[i, pos].item() - lt) <= 1e-6 * abs(lt) + 1e-12
            else:
                assert res.student_tail_lp is None
            if divergence == "jsd":
                # float64 throughout, from float32 inputs: a float32 rounding of the result
                tol = 1e-6 * abs(ref.r) + 1e-7
            else:
                tol = 2e-6 * ref.scale + 1e-6 * abs(ref.r) + 1e-8
            assert abs(got_r[i, pos] - ref.r) <= tol, (strategy, pos, got_r[i, pos], ref.r)
    return res, refs


def one_position(s: list[float], t: list[float]) -> TopKBatch:
    """One only-student position: candidates 1.., student logprobs ``s``, teacher's ``t``."""
    return TopKBatch(
        student_ids=torch.arange(1, len(s) + 1)[None, None],
        student_lp=torch.tensor([[s]], dtype=torch.float32),
        teacher_on_student=torch.tensor([[t]], dtype=torch.float32),
        teacher_ids=None,
        teacher_lp=None,
        student_on_teacher=None,
        valid=torch.ones((1, 1), dtype=torch.bool),
    )


# ---------------------------------------------------------------------- hand-computed values


def test_forward_kl_by_hand() -> None:
    # S = {1: .5, 2: .2}; the teacher's values .6 and .3: tails .3 and .1
    batch = one_position([math.log(0.5), math.log(0.2)], [math.log(0.6), math.log(0.3)])
    res = topk_divergence(batch, "only-student", "teacher_p", divergence="forward_kl", tail=True)
    expected = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.2) + 0.1 * math.log(0.1 / 0.3)
    assert res.signal.item() == pytest.approx(expected, rel=1e-6)
    assert res.weights[0, 0].tolist() == pytest.approx([0.6, 0.3], rel=1e-6)
    plain = topk_divergence(batch, "only-student", "teacher_p", divergence="forward_kl")
    w = (2 / 3, 1 / 3)  # the teacher's softmax over the two candidates
    expected = w[0] * math.log(0.6 / 0.5) + w[1] * math.log(0.3 / 0.2)
    assert plain.signal.item() == pytest.approx(expected, rel=1e-6)


def test_the_result_names_its_signal_whatever_the_divergence() -> None:
    batch = one_position([math.log(0.5), math.log(0.2)], [math.log(0.6), math.log(0.3)])
    res = topk_divergence(batch, "only-student", "teacher_p", divergence="forward_kl", tail=True)
    assert res._fields[0] == "signal" and "reverse_kl" not in res._fields
    assert res.signal is res[0]


def test_the_old_name_reverse_kl_reads_the_signal_with_a_warning() -> None:
    batch = one_position([math.log(0.5), math.log(0.2)], [math.log(0.6), math.log(0.3)])
    res = topk_divergence(batch, "only-student", "teacher_p", divergence="forward_kl", tail=True)
    with pytest.deprecated_call(
        match=r"TopKResult.reverse_kl is deprecated: it is TopKResult.signal"
    ) as caught:
        old = res.reverse_kl
    assert old is res.signal
    assert caught[0].filename == __file__


def test_jsd_by_hand() -> None:
    beta = 0.3
    batch = one_position([math.log(0.5), math.log(0.2)], [math.log(0.6), math.log(0.3)])
    res = topk_divergence(
        batch, "only-student", "student_p", divergence="jsd", jsd_beta=beta, tail=True
    )
    p, q = (0.5, 0.2, 0.3), (0.6, 0.3, 0.1)
    m = [beta * b + (1 - beta) * a for a, b in zip(p, q, strict=True)]
    expected = sum(
        beta * b * math.log(b / c) + (1 - beta) * a * math.log(a / c)
        for a, b, c in zip(p, q, m, strict=True)
    )
    assert res.signal.item() == pytest.approx(expected, rel=1e-6)
    assert res.weights[0, 0].tolist() == pytest.approx(m[:2], rel=1e-6)
    # without the tail: both sides renormalised over the two candidates
    plain = topk_divergence(batch, "only-student", "student_p", divergence="jsd", jsd_beta=beta)
    p, q = (5 / 7, 2 / 7), (2 / 3, 1 / 3)
    m = [beta * b + (1 - beta) * a for a, b in zip(p, q, strict=True)]
    expected = sum(
        beta * b * math.log(b / c) + (1 - beta) * a * math.log(a / c)
        for a, b, c in zip(p, q, m, strict=True)
    )
    assert plain.signal.item() == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 12),
    lengths=st.lists(st.integers(0, 20), min_size=1, max_size=3),
    overlap=st.sampled_from([0.0, 0.5, 1.0]),
    beta=st.sampled_from([0.5, 0.1, 0.9, 0.013]),
)
def test_divergences_match_the_float64_reference(
    device: str,
    tail: bool,
    divergence: str,
    strategy: Strategy,
    seed: int,
    k: int,
    lengths: list[int],
    overlap: float,
    beta: float,
) -> None:
    rng = np.random.default_rng(seed)
    samples = [
        distribution_rows(
            rng, r, k, overlap=overlap, mass_s=rng.uniform(0.0, 1.0, r), mass_t=rng.uniform(size=r)
        )
        for r in lengths
    ]
    # a few floored values (probability 0) and empty slots
    for smp in samples:
        if smp["s_lp"].size:
            smp["t_on_s"].flat[0] = -np.inf
            smp["s_ids"][-1, -1] = -1
    check(samples, strategy, divergence, tail=tail, beta=beta, device=device)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
@pytest.mark.parametrize("tail", [False, True])
def test_a_missing_selected_value_raises(divergence: str, tail: bool) -> None:
    rng = np.random.default_rng(3)
    rows = distribution_rows(rng, 3, 4, overlap=0.5, mass_s=0.7, mass_t=0.8)
    rows["t_on_s"][1, 2] = np.nan
    with pytest.raises(MissingLogprobError) as info:
        run([rows], "only-student", divergence, tail=tail)
    assert (info.value.side, info.value.position) == ("teacher", 1)
    assert info.value.token_id == int(rows["s_ids"][1, 2])


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_padding_and_empty_rows_give_zero(divergence: str) -> None:
    rng = np.random.default_rng(4)
    a = distribution_rows(rng, 4, 3, overlap=0.0, mass_s=0.6, mass_t=0.6)
    a["s_ids"][2, :] = -1  # an empty row under only-student
    b = distribution_rows(rng, 1, 3, overlap=0.0, mass_s=0.6, mass_t=0.6)
    for tail in (False, True):
        res = run([a, b], "only-student", divergence, tail=tail)
        assert res.signal[0, 2].item() == 0.0
        assert (res.signal[1, 1:] == 0).all()  # padding
        assert torch.isfinite(res.signal).all() and torch.isfinite(res.weights).all()


@pytest.mark.parametrize(
    ("divergence", "weight_mode", "match"),
    [
        ("forward_kl", "student_p", "set weight_mode teacher_p"),
        ("forward_kl", "none", "set weight_mode teacher_p"),
        ("jsd", "teacher_p", "leave it at student_p"),
        ("jsd", "none", "leave it at student_p"),
    ],
)
def test_weight_modes_a_divergence_does_not_take_are_refused(
    divergence: str, weight_mode: Any, match: str
) -> None:
    batch = one_position([-1.0], [-2.0])
    with pytest.raises(ValueError, match=match):
        topk_divergence(batch, "only-student", weight_mode, divergence=divergence)  # type: ignore[arg-type]


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5, 1.5, math.nan])
def test_jsd_beta_outside_the_open_interval_is_refused(beta: float) -> None:
    batch = one_position([-1.0], [-2.0])
    with pytest.raises(ValueError, match=r"jsd_beta must be in \(0, 1\)"):
        topk_divergence(batch, "only-student", "student_p", divergence="jsd", jsd_beta=beta)


def test_reverse_kl_through_topk_divergence_is_topk_reverse_kl() -> None:
    from opd_stream.kl._math import topk_reverse_kl

    rng = np.random.default_rng(5)
    batch = batch_of([distribution_rows(rng, 6, 4, overlap=0.5, mass_s=0.7, mass_t=0.8)])
    for tail in (False, True):
        a = topk_divergence(batch, "union", "student_p", tail=tail)
        b = topk_reverse_kl(batch, "union", "student_p", tail=tail)
        for x, y in zip(a, b, strict=True):
            assert (x is None and y is None) or torch.equal(x, y)


# ------------------------------------------------------- the mock's closed form: the bounds


def mock_case(
    seed: int, divergence: float, logit_scale: float, tail_logit: float, head: int, k: int
) -> tuple[MockModel, MockModel, np.ndarray, np.ndarray, int]:
    kw: dict[str, Any] = {
        "vocab_size": 4096,
        "head_size": head,
        "divergence": divergence,
        "logit_scale": logit_scale,
        "tail_logit": tail_logit,
    }
    student = MockModel("student", seed, **kw)
    teacher = MockModel("teacher", seed + 1, **kw)
    tokens = np.random.default_rng(seed).integers(0, 4000, size=24)
    return student, teacher, tokens, np.arange(1, 24), min(k, head)


def full_values(
    student: MockModel,
    teacher: MockModel,
    tokens: np.ndarray,
    positions: np.ndarray,
    divergence: str,
    beta: float = 0.5,
) -> list[float]:
    rows_s = student.head_rows(tokens, positions)
    rows_t = teacher.head_rows(tokens, positions)
    n_tail = student.vocab_size - student.head_size - student.masked_ids.size
    return [
        reference_full_divergence(
            divergence,
            (rows_s.logits[j] - rows_s.logz[j]).tolist(),
            (rows_t.logits[j] - rows_t.logz[j]).tolist(),
            float(rows_s.tail_lp[j]),
            float(rows_t.tail_lp[j]),
            n_tail,
            beta,
        )
        for j in range(positions.size)
    ]


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    spread=st.floats(0.0, 1.0),
    logit_scale=st.floats(0.3, 9.0),
    tail_logit=st.floats(-30.0, -4.0),
    head=st.sampled_from([4, 8, 16, 32]),
    k=st.integers(1, 16),
    beta=st.sampled_from([0.5, 0.2, 0.8]),
)
def test_with_the_tail_each_divergence_is_at_least_zero_and_at_most_its_full_value(
    divergence: str,
    strategy: Strategy,
    seed: int,
    spread: float,
    logit_scale: float,
    tail_logit: float,
    head: int,
    k: int,
    beta: float,
) -> None:
    student, teacher, tokens, positions, k = mock_case(
        seed, spread, logit_scale, tail_logit, head, k
    )
    rows, _ = model_rows(student, teacher, tokens, positions, k)
    full = full_values(student, teacher, tokens, positions, divergence, beta)
    res, refs = check([rows], strategy, divergence, tail=True, beta=beta)
    got = res.signal[0].double().numpy()
    for j, bound in enumerate(full):
        assert got[j] >= 0.0
        # float32 inputs move the values by ~1e-7 relative; the clamp by at most ~TAIL_MIN.
        # A tail is 1 minus the candidates' mass, whose float32 rounding (<= 2^-23 |s| exp(s)
        # per candidate) is a large relative error of a tiny tail; weighed by the other
        # side's tail (the forward KL's T log(T / S), the JSD's mixture), it shows.
        ref = refs[j]
        assert ref.tails is not None
        ls, lt = ref.tails
        err_s = math.fsum(math.exp(x) * abs(x) for x in ref.student) * 2**-23
        err_t = math.fsum(math.exp(x) * abs(x) for x in ref.teacher) * 2**-23
        slack = math.exp(lt - ls) * err_s + math.exp(ls - lt) * err_t
        tol = 1e-5 * (1.0 + bound) + slack
        assert got[j] <= bound + tol, (strategy, j, got[j], bound, slack)
        assert ref.r <= bound + tol


# ------------------------------------------------------------------- the JSD's properties


def swapped(rows: Rows) -> Rows:
    """The same position with the two models' roles exchanged."""
    return {
        "s_ids": rows["t_ids"],
        "s_lp": rows["t_lp"],
        "t_on_s": rows["s_on_t"],
        "t_ids": rows["s_ids"],
        "t_lp": rows["s_lp"],
        "s_on_t": rows["t_on_s"],
    }


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("strategy", ["intersection", "union"])
def test_jsd_is_symmetric_at_one_half(tail: bool, strategy: Strategy) -> None:
    # (intersection and union select the same set, in another order, when the roles swap)
    rng = np.random.default_rng(11)
    rows = distribution_rows(rng, 40, 6, overlap=0.5, mass_s=rng.uniform(size=40), mass_t=0.7)
    a = run([rows], strategy, "jsd", tail=tail).signal
    b = run([swapped(rows)], strategy, "jsd", tail=tail).signal
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert (a > 0).any()
    # and not at another beta
    c = run([rows], strategy, "jsd", tail=tail, beta=0.2).signal
    d = run([swapped(rows)], strategy, "jsd", tail=tail, beta=0.2).signal
    assert not torch.allclose(c, d, rtol=1e-3)


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("beta", [0.5, 0.05, 0.7])
def test_jsd_is_bounded_by_the_binary_entropy_of_beta(tail: bool, beta: float) -> None:
    rng = np.random.default_rng(12)
    rows = distribution_rows(rng, 200, 4, overlap=0.0, mass_s=rng.uniform(size=200), mass_t=0.99)
    # near-disjoint supports: the student puts almost nothing where the teacher's mass is
    rows["s_on_t"][:] = -60.0
    rows["t_on_s"][:] = -60.0
    got = run([rows], "union", "jsd", tail=tail, beta=beta).signal.double()
    bound = -beta * math.log(beta) - (1 - beta) * math.log1p(-beta)
    assert bound <= math.log(2) + 1e-15
    assert (got >= 0).all() and (got <= bound + 1e-6).all()
    assert got.max().item() > 0.9 * bound  # the bound is approached, not only respected


@pytest.mark.parametrize("strategy", ["only-student", "union"])
def test_jsd_over_beta_tends_to_the_forward_and_reverse_kl(strategy: Strategy) -> None:
    """As beta -> 0, jsd / beta -> the forward KL over the same |C| + 1 outcomes; as
    beta -> 1, jsd / (1 - beta) -> the reverse KL (each with the tail bucket)."""
    student, teacher, tokens, positions, k = mock_case(3, 0.4, 2.0, -8.0, 16, 6)
    rows, _ = model_rows(student, teacher, tokens, positions, k)
    fkl = run([rows], strategy, "forward_kl", tail=True).signal.double()
    rkl = run([rows], strategy, "reverse_kl", tail=True).signal.double()
    assert (fkl > 1e-3).all() and (rkl > 1e-3).all()
    errors = []
    for eps in (1e-2, 1e-3, 1e-4):
        low = run([rows], strategy, "jsd", tail=True, beta=eps).signal.double() / eps
        high = run([rows], strategy, "jsd", tail=True, beta=1 - eps).signal.double() / eps
        errors.append(
            max(((low - fkl).abs() / fkl).max().item(), ((high - rkl).abs() / rkl).max().item())
        )
    assert errors[-1] < 2e-3, errors
    assert errors[0] > errors[1] > errors[2], errors  # it tends there
    # the JSD itself tends to 0 at both ends
    tiny = run([rows], strategy, "jsd", tail=True, beta=1e-6).signal
    assert (tiny.double() <= 1e-6 * fkl + 1e-9).all()


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
@pytest.mark.parametrize("tail", [False, True])
def test_inputs_are_never_modified_or_aliased(divergence: str, tail: bool) -> None:
    rng = np.random.default_rng(9)
    rows = [distribution_rows(rng, r, 5, overlap=0.5, mass_s=0.6, mass_t=0.8) for r in (7, 3)]
    rows[0]["s_ids"][2, 3:] = -1  # some unselected slots too
    batch = batch_of(rows)
    before = [None if x is None else x.clone() for x in batch]
    for strategy in ("only-student", "union"):
        res = topk_divergence(
            batch,
            strategy,
            WEIGHTS[divergence],  # type: ignore[arg-type]
            divergence=divergence,  # type: ignore[arg-type]
            tail=tail,
        )
        for x, y in zip(batch, before, strict=True):
            assert x is not None and y is not None
            assert torch.equal(x.nan_to_num(-7.0), y.nan_to_num(-7.0))
        inputs = {x.untyped_storage().data_ptr() for x in batch if x is not None}
        assert not inputs & {t.untyped_storage().data_ptr() for t in res if t is not None}
