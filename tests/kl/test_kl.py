"""Tests for opd_stream.kl._math against ``docs/semantics.md``, "Top-k mode" and
"Sampled-token mode" (with the floor and the edge cases), and a float64 reference."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kl_padding import pad_batch, pad_topk_batch
from support.kl_reference import Missing, reference_position, reference_sampled
from support.kl_rows import FIELDS

from opd_stream._errors import MissingLogprobError
from opd_stream.kl import _select
from opd_stream.kl._math import (
    LOGPROB_FLOOR,
    STRATEGIES,
    WEIGHT_MODES,
    Strategy,
    TopKBatch,
    WeightMode,
    needed_inputs,
    sampled_reverse_kl,
    topk_reverse_kl,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
COMBOS = [(s, w) for s in STRATEGIES for w in WEIGHT_MODES]
INF = math.inf
NAN = math.nan


# ----------------------------------------------------------------------------- helpers


@dataclass
class Sample:
    """One sample's per-position top-k inputs, ``[R, Ks]`` and ``[R, Kt]``."""

    s_ids: np.ndarray
    s_lp: np.ndarray
    t_on_s: np.ndarray
    t_ids: np.ndarray
    t_lp: np.ndarray
    s_on_t: np.ndarray


def make_batch(samples: list[Sample], strategy: str, device: str = "cpu") -> TopKBatch:
    """Pad the fields ``strategy`` needs (padding: ids -1, logprobs NaN); others are None."""
    needed = needed_inputs(strategy)  # type: ignore[arg-type]
    fields: dict[str, torch.Tensor | None] = {}
    valid = None
    for name, attr in FIELDS:
        if name not in needed:
            fields[name] = None
            continue
        arrays = [getattr(s, attr) for s in samples]
        fill = None if name.endswith("_ids") else NAN
        fields[name], valid = pad_batch(arrays, device=device, fill=fill)
    assert valid is not None
    return TopKBatch(valid=valid, **fields)


def check_against_reference(
    samples: list[Sample], strategy: Strategy, weight_mode: WeightMode, device: str = "cpu"
) -> None:
    """Run topk_reverse_kl and compare every output array with the per-position reference."""
    result = topk_reverse_kl(make_batch(samples, strategy, device), strategy, weight_mode)
    b = len(samples)
    r_max = max(s.s_ids.shape[0] for s in samples)
    ks, kt = samples[0].s_ids.shape[1], samples[0].t_ids.shape[1]
    c = {"only-student": ks, "only-teacher": kt, "intersection": ks}.get(strategy, ks + kt)
    assert result.signal.shape == (b, r_max)
    for name in ("ids", "student_lp", "teacher_lp", "weights", "mask"):
        assert getattr(result, name).shape == (b, r_max, c), name
    assert result.signal.dtype == torch.float32
    assert result.ids.dtype == torch.int64
    assert result.mask.dtype == torch.bool
    assert result.weights.dtype == torch.float32

    exp_r = np.zeros((b, r_max))
    tol_r = np.full((b, r_max), 1e-5)
    exp_ids = np.full((b, r_max, c), -1, dtype=np.int64)
    exp_s = np.zeros((b, r_max, c))
    exp_t = np.zeros((b, r_max, c))
    exp_w = np.zeros((b, r_max, c))
    exp_mask = np.zeros((b, r_max, c), dtype=np.bool_)
    for i, smp in enumerate(samples):
        rows = {
            "s_ids": smp.s_ids.tolist(),
            "s_lp": smp.s_lp.tolist(),
            "t_on_s": smp.t_on_s.tolist(),
            "t_ids": smp.t_ids.tolist(),
            "t_lp": smp.t_lp.tolist(),
            "s_on_t": smp.s_on_t.tolist(),
        }
        for pos in range(smp.s_ids.shape[0]):
            ref = reference_position(
                strategy=strategy,
                weight_mode=weight_mode,
                **{k: v[pos] for k, v in rows.items()},
            )
            n = len(ref.ids)
            exp_r[i, pos] = ref.r
            tol_r[i, pos] = 1e-5 + 2e-6 * ref.scale
            exp_ids[i, pos, :n] = ref.ids
            exp_s[i, pos, :n] = ref.student
            exp_t[i, pos, :n] = ref.teacher
            exp_w[i, pos, :n] = ref.weights
            exp_mask[i, pos, :n] = True

    got_r = result.signal.double().cpu().numpy()
    assert np.isfinite(got_r).all()
    worst = np.abs(got_r - exp_r) - tol_r
    assert (worst <= 0).all(), f"r off by {np.abs(got_r - exp_r).max()}"
    np.testing.assert_array_equal(result.mask.cpu().numpy(), exp_mask)
    np.testing.assert_array_equal(result.ids.cpu().numpy(), exp_ids)
    for name, expected in (("student_lp", exp_s), ("teacher_lp", exp_t), ("weights", exp_w)):
        got = getattr(result, name).double().cpu().numpy()
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5, err_msg=name)


def random_sample(
    rng: np.random.Generator,
    r: int,
    ks: int,
    kt: int,
    *,
    overlap: float,
    p_inf: float,
    p_hole: float,
    nan_unused_for: str | None = None,
) -> Sample:
    """Random top-k rows: distinct ids per row, ``overlap`` = expected share of T taken from S.

    Empty slots (id -1) carry NaN values.  ``nan_unused_for`` = "union" or "xor" also puts
    NaN in the slots that strategy never reads (the value of an id in both sets:
    ``docs/semantics.md``, "Which requests each strategy makes").
    """
    vocab = ks + kt + 3
    perm = np.argsort(rng.random((r, vocab)), axis=1) * 7 + 3
    s_ids = perm[:, :ks]
    not_s = perm[:, ks : ks + kt]
    s_shuffled = np.take_along_axis(s_ids, np.argsort(rng.random((r, ks)), axis=1), axis=1)
    s_ext = s_shuffled[:, :kt] if ks >= kt else np.pad(s_shuffled, ((0, 0), (0, kt - ks)))
    common = rng.binomial(min(ks, kt), overlap, size=r)
    t_ids = np.where(np.arange(kt)[None, :] < common[:, None], s_ext, not_s)
    t_ids = np.take_along_axis(t_ids, np.argsort(rng.random((r, kt)), axis=1), axis=1)

    def logprobs(k: int) -> np.ndarray:
        lp = rng.uniform(-20.0, 0.0, size=(r, k)).astype(np.float32)
        lp[rng.random((r, k)) < p_inf] = -np.inf
        return lp

    s_lp, t_on_s, t_lp, s_on_t = logprobs(ks), logprobs(ks), logprobs(kt), logprobs(kt)
    s_hole = rng.random((r, ks)) < p_hole
    t_hole = rng.random((r, kt)) < p_hole
    s_ids = np.where(s_hole, -1, s_ids).astype(np.int64)
    t_ids = np.where(t_hole, -1, t_ids).astype(np.int64)
    for arr in (s_lp, t_on_s):
        arr[s_hole] = np.nan
    for arr in (t_lp, s_on_t):
        arr[t_hole] = np.nan
    if nan_unused_for in ("union", "xor"):
        eq = (s_ids[:, :, None] == t_ids[:, None, :]) & (s_ids >= 0)[:, :, None]
        t_on_s[eq.any(axis=2)] = np.nan
        if nan_unused_for == "xor":
            s_on_t[eq.any(axis=1)] = np.nan
    return Sample(s_ids, s_lp, t_on_s, t_ids, t_lp, s_on_t)


@st.composite
def topk_cases(draw: st.DrawFn) -> dict[str, Any]:
    """Batch shape and data knobs; most examples small, about one in eight large."""
    big = draw(st.integers(0, 7)) == 0
    ks = draw(st.integers(1, 64))
    kt = draw(st.one_of(st.just(ks), st.integers(1, 64)))
    batch = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(0, 512 if big else 12), min_size=batch, max_size=batch))
    return {
        "lengths": lengths,
        "ks": ks,
        "kt": kt,
        "overlap": draw(st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0])),
        "p_inf": draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        "p_hole": draw(st.sampled_from([0.0, 0.0, 0.1])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def samples_for(case: dict[str, Any], strategy: str) -> list[Sample]:
    rng = np.random.default_rng(case["seed"])
    return [
        random_sample(
            rng,
            r,
            case["ks"],
            case["kt"],
            overlap=case["overlap"],
            p_inf=case["p_inf"],
            p_hole=case["p_hole"],
            nan_unused_for=strategy,
        )
        for r in case["lengths"]
    ]


def worked_example_batch(*, with_student_topk: bool = True) -> TopKBatch:
    """The worked example of ``docs/semantics.md``, "Worked example" (logprob = ln p), B = 1,
    R = 2, K = 2."""

    def lp(rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor([rows], dtype=torch.float64).log().float()

    def ids(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor([rows], dtype=torch.int64)

    return TopKBatch(
        student_ids=ids([[1, 2], [4, 5]]) if with_student_topk else None,
        student_lp=lp([[0.6, 0.4], [0.7, 0.3]]) if with_student_topk else None,
        teacher_on_student=lp([[0.3, 0.7], [0.4, 0.6]]) if with_student_topk else None,
        teacher_ids=ids([[2, 3], [4, 6]]),
        teacher_lp=lp([[0.5, 0.5], [0.8, 0.2]]),
        student_on_teacher=lp([[0.4, 0.2], [0.7, 0.1]]),
        valid=torch.ones((1, 2), dtype=torch.bool),
    )


def one_position_batch(
    s_ids: list[int],
    s_lp: list[float],
    t_on_s: list[float],
    t_ids: list[int],
    t_lp: list[float],
    s_on_t: list[float],
) -> TopKBatch:
    def f(x: list[float]) -> torch.Tensor:
        return torch.tensor([[x]], dtype=torch.float32)

    def i(x: list[int]) -> torch.Tensor:
        return torch.tensor([[x]], dtype=torch.int64)

    return TopKBatch(
        i(s_ids),
        f(s_lp),
        f(t_on_s),
        i(t_ids),
        f(t_lp),
        f(s_on_t),
        torch.ones((1, 1), dtype=torch.bool),
    )


# --------------------------------------- the worked example (docs/semantics.md, "Worked example")


def test_worked_example_only_student_student_p() -> None:
    res = topk_reverse_kl(worked_example_batch(), "only-student", "student_p")
    expected = [
        0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.7),
        0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6),
    ]
    assert res.signal[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert res.weights[0].flatten().tolist() == pytest.approx([0.6, 0.4, 0.7, 0.3], abs=1e-6)


def test_worked_example_intersection_none() -> None:
    res = topk_reverse_kl(worked_example_batch(), "intersection", "none")
    expected = [math.log(0.4 / 0.5), math.log(0.7 / 0.8)]
    assert res.signal[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert res.ids[0].tolist() == [[2, -1], [4, -1]]


def test_worked_example_only_teacher_student_p_without_student_topk() -> None:
    res = topk_reverse_kl(
        worked_example_batch(with_student_topk=False), "only-teacher", "student_p"
    )
    expected = [
        (2 / 3) * math.log(0.4 / 0.5) + (1 / 3) * math.log(0.2 / 0.5),
        (7 / 8) * math.log(0.7 / 0.8) + (1 / 8) * math.log(0.1 / 0.2),
    ]
    assert res.signal[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_worked_example_xor_none() -> None:
    res = topk_reverse_kl(worked_example_batch(), "xor", "none")
    expected = [
        math.log(0.6 / 0.3) + math.log(0.2 / 0.5),
        math.log(0.3 / 0.6) + math.log(0.1 / 0.2),
    ]
    assert res.signal[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert res.ids[0].tolist() == [[1, 3, -1, -1], [5, 6, -1, -1]]


def test_union_takes_student_value_from_s_and_teacher_value_from_t() -> None:
    res = topk_reverse_kl(worked_example_batch(), "union", "none")
    # Position 0: S = [1, 2], T \ S = [3]; id 2 is in both: student .4 (S), teacher .5 (T).
    assert res.ids[0, 0].tolist() == [1, 2, 3, -1]
    assert res.student_lp[0, 0, :3].tolist() == pytest.approx(
        [math.log(0.6), math.log(0.4), math.log(0.2)], abs=1e-6
    )
    assert res.teacher_lp[0, 0, :3].tolist() == pytest.approx(
        [math.log(0.3), math.log(0.5), math.log(0.5)], abs=1e-6
    )


# ------------------------------------------------------------- all 15 combos vs reference


@pytest.mark.parametrize(("strategy", "weight_mode"), COMBOS)
@settings(max_examples=40, deadline=None)
@given(case=topk_cases())
def test_topk_matches_float64_reference(
    strategy: Strategy, weight_mode: WeightMode, case: dict[str, Any]
) -> None:
    check_against_reference(samples_for(case, strategy), strategy, weight_mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [3, 31, 32, 64])
@pytest.mark.parametrize("path", ["broadcast", "broadcast-chunked", "sort-searchsorted"])
def test_membership_paths_agree_with_reference(
    monkeypatch: pytest.MonkeyPatch, path: str, k: int, device: str
) -> None:
    if path == "sort-searchsorted":
        monkeypatch.setattr(_select, "_BROADCAST_MAX_K", 1)
    else:
        monkeypatch.setattr(_select, "_BROADCAST_MAX_K", 1000)
    if path == "broadcast-chunked":
        monkeypatch.setattr(_select, "_EQ_CHUNK_ELEMENTS", 3 * k * k)  # 3 rows per chunk
    rng = np.random.default_rng(k)
    samples = [
        random_sample(rng, r, k, k, overlap=0.6, p_inf=0.1, p_hole=0.05, nan_unused_for="xor")
        for r in (40, 7, 0)
    ]
    for strategy in ("intersection", "xor"):
        check_against_reference(samples, strategy, "student_p", device)


# --------------------------------------------------------------------- -inf, NaN, edges


@pytest.mark.parametrize(("strategy", "weight_mode"), COMBOS)
def test_all_inf_logprobs_give_finite_results(strategy: Strategy, weight_mode: WeightMode) -> None:
    rng = np.random.default_rng(0)
    samples = [random_sample(rng, 6, 4, 4, overlap=0.5, p_inf=1.0, p_hole=0.0)]
    res = topk_reverse_kl(make_batch(samples, strategy), strategy, weight_mode)
    for name in ("signal", "student_lp", "teacher_lp", "weights"):
        assert torch.isfinite(getattr(res, name)).all(), name
    assert (res.signal == 0).all()  # floor - floor = 0 everywhere
    check_against_reference(samples, strategy, weight_mode)


def test_inf_student_logprob_is_floored_not_nan() -> None:
    batch = one_position_batch([7], [-INF], [-1.0], [7], [-1.0], [-INF])
    res = topk_reverse_kl(batch, "only-student", "none")
    assert res.student_lp[0, 0, 0].item() == LOGPROB_FLOOR
    assert res.signal[0, 0].item() == pytest.approx(LOGPROB_FLOOR + 1.0)


def test_finite_values_above_floor_are_untouched() -> None:
    batch = one_position_batch([7, 8], [-9999.5, -0.25], [-3.0, -0.5], [7], [-1.0], [-1.0])
    res = topk_reverse_kl(batch, "only-student", "none")
    assert res.student_lp[0, 0].tolist() == [-9999.5, -0.25]


@pytest.mark.parametrize(
    ("strategy", "field", "col", "side", "token_id"),
    [
        ("only-student", "s_lp", 1, "student", 12),
        ("only-student", "t_on_s", 1, "teacher", 12),
        ("only-teacher", "t_lp", 1, "teacher", 22),
        ("only-teacher", "s_on_t", 1, "student", 22),
        ("intersection", "t_lp", 0, "teacher", 12),
        ("intersection", "s_lp", 1, "student", 12),
        ("union", "s_on_t", 1, "student", 22),
        ("union", "t_lp", 0, "teacher", 12),
        ("xor", "t_on_s", 0, "teacher", 11),
        ("xor", "s_on_t", 1, "student", 22),
    ],
)
def test_nan_in_selected_candidate_raises_naming_side_and_token(
    strategy: Strategy, field: str, col: int, side: str, token_id: int
) -> None:
    # S = [11, 12], T = [12, 22] at every position; the NaN is at sample 1, position 2.
    rows = 4
    clean = Sample(
        s_ids=np.tile(np.array([11, 12]), (rows, 1)),
        s_lp=np.full((rows, 2), -1.0, dtype=np.float32),
        t_on_s=np.full((rows, 2), -2.0, dtype=np.float32),
        t_ids=np.tile(np.array([12, 22]), (rows, 1)),
        t_lp=np.full((rows, 2), -1.5, dtype=np.float32),
        s_on_t=np.full((rows, 2), -2.5, dtype=np.float32),
    )
    broken = Sample(**{k: v.copy() for k, v in vars(clean).items()})
    getattr(broken, field)[2, col] = np.nan
    getattr(broken, field)[3, :] = np.nan  # a later offender: not the one reported
    batch = make_batch([clean, broken], strategy)
    with pytest.raises(MissingLogprobError) as info:
        topk_reverse_kl(batch, strategy, "student_p")
    err = info.value
    assert (err.side, err.token_id, err.position, err.batch_index) == (side, token_id, 2, 1)
    assert side in str(err) and "response position 2" in str(err)
    assert str(token_id) not in str(err)  # a value of the sample: on .token_id only


def test_nan_in_unselected_slot_is_ignored() -> None:
    # Union: S id 5 is also in T, so T's teacher value is used and t_on_s[5] may be missing;
    # xor never reads either value of id 5.  NaN on the padding position is ignored too.
    samples = [
        Sample(
            s_ids=np.array([[5, 6]]),
            s_lp=np.array([[-1.0, -2.0]], dtype=np.float32),
            t_on_s=np.array([[np.nan, -3.0]], dtype=np.float32),
            t_ids=np.array([[7, 5]]),
            t_lp=np.array([[-0.5, -1.5]], dtype=np.float32),
            s_on_t=np.array([[-4.0, np.nan]], dtype=np.float32),
        ),
        Sample(*(np.zeros((2, 2), dtype=np.float32) for _ in range(6))),
    ]
    samples[1].s_ids = np.array([[1, 2], [3, 4]])
    samples[1].t_ids = np.array([[1, 2], [3, 4]])
    for strategy in ("union", "xor"):
        check_against_reference(samples, strategy, "none")


def test_missing_reference_agrees_on_error() -> None:
    # The reference itself refuses NaN in a selected slot (guards the reference).
    with pytest.raises(Missing):
        reference_position(
            strategy="only-student",
            weight_mode="none",
            s_ids=[1],
            s_lp=[NAN],
            t_on_s=[-1.0],
        )


@pytest.mark.parametrize(("strategy", "weight_mode"), COMBOS)
def test_zero_length_batch_gives_empty_tensors(strategy: Strategy, weight_mode: WeightMode) -> None:
    k = 4
    empty_f = torch.zeros((2, 0, k), dtype=torch.float32)
    empty_i = torch.zeros((2, 0, k), dtype=torch.int64)
    batch = TopKBatch(
        empty_i, empty_f, empty_f, empty_i, empty_f, empty_f, torch.ones((2, 0), dtype=torch.bool)
    )
    res = topk_reverse_kl(batch, strategy, weight_mode)
    c = 2 * k if strategy in ("union", "xor") else k
    assert res.signal.shape == (2, 0)
    assert res.signal.dtype == torch.float32
    assert res.ids.shape == res.weights.shape == res.mask.shape == (2, 0, c)


@pytest.mark.parametrize("weight_mode", WEIGHT_MODES)
@pytest.mark.parametrize("strategy", ["intersection", "xor"])
def test_empty_selection_gives_zero(strategy: Strategy, weight_mode: WeightMode) -> None:
    # intersection of disjoint sets, xor of equal sets: nothing selected.
    t_ids = [3, 4] if strategy == "intersection" else [2, 1]
    batch = one_position_batch(
        [1, 2], [-1.0, -2.0], [-3.0, -4.0], t_ids, [-1.0, -1.0], [-2.0, -2.0]
    )
    res = topk_reverse_kl(batch, strategy, weight_mode)
    assert res.signal.tolist() == [[0.0]]
    assert not res.mask.any()
    assert (res.ids == -1).all()
    assert (res.weights == 0).all()
    assert (res.student_lp == 0).all()
    assert (res.teacher_lp == 0).all()


def test_padding_positions_give_zero_and_no_candidates() -> None:
    rng = np.random.default_rng(3)
    samples = [random_sample(rng, r, 5, 5, overlap=0.5, p_inf=0.0, p_hole=0.0) for r in (1, 4)]
    res = topk_reverse_kl(make_batch(samples, "union"), "union", "student_p")
    assert res.signal[0, 1:].tolist() == [0.0, 0.0, 0.0]
    assert not res.mask[0, 1:].any()
    assert (res.ids[0, 1:] == -1).all()


# ---------------------------------------------------------------- inputs and validation


def test_needed_inputs_follow_the_contract() -> None:
    assert needed_inputs("only-student") == {"student_ids", "student_lp", "teacher_on_student"}
    assert needed_inputs("only-teacher") == {"teacher_ids", "teacher_lp", "student_on_teacher"}
    assert needed_inputs("intersection") == {
        "student_ids",
        "student_lp",
        "teacher_ids",
        "teacher_lp",
    }
    six = set(TopKBatch._fields) - {"valid"}
    assert needed_inputs("union") == needed_inputs("xor") == six
    assert set(STRATEGIES) == {"only-student", "only-teacher", "intersection", "union", "xor"}
    assert set(WEIGHT_MODES) == {"student_p", "teacher_p", "none"}


def test_missing_needed_field_is_a_value_error_naming_it() -> None:
    batch = worked_example_batch()._replace(teacher_on_student=None)
    with pytest.raises(ValueError, match="teacher_on_student"):
        topk_reverse_kl(batch, "union", "none")


def test_unknown_strategy_and_weight_mode_are_value_errors() -> None:
    with pytest.raises(ValueError, match="strategy"):
        topk_reverse_kl(worked_example_batch(), "both", "none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight mode"):
        topk_reverse_kl(worked_example_batch(), "union", "uniform")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy"):
        needed_inputs("both")  # type: ignore[arg-type]


def test_mismatched_shapes_are_value_errors() -> None:
    batch = worked_example_batch()._replace(teacher_on_student=torch.zeros((1, 2, 3)))
    with pytest.raises(ValueError, match="widths disagree"):
        topk_reverse_kl(batch, "only-student", "none")
    batch = worked_example_batch()._replace(valid=torch.ones((1, 3), dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        topk_reverse_kl(batch, "only-student", "none")


# ------------------------------------------------------------------------ sampled token


finite_or_inf = st.one_of(
    st.floats(min_value=-50.0, max_value=0.0, width=32), st.just(-INF), st.just(-1e6)
)


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(finite_or_inf, finite_or_inf), max_size=64))
def test_sampled_reverse_kl_matches_reference(pairs: list[tuple[float, float]]) -> None:
    rollout = [p[0] for p in pairs]
    teacher = [p[1] for p in pairs]
    got = sampled_reverse_kl(
        torch.tensor(rollout, dtype=torch.float32), torch.tensor(teacher, dtype=torch.float32)
    )
    assert got.dtype == torch.float32
    assert got.shape == (len(pairs),)
    assert torch.isfinite(got).all()
    expected = reference_sampled(rollout, teacher)
    for g, e in zip(got.tolist(), expected, strict=True):
        assert abs(g - e) <= 1e-5 + 1e-6 * abs(e)


def test_sampled_inf_minus_inf_is_zero() -> None:
    got = sampled_reverse_kl(torch.tensor([-INF, -INF, -1.0]), torch.tensor([-INF, -2.0, -INF]))
    assert got.tolist() == pytest.approx([0.0, LOGPROB_FLOOR + 2.0, -1.0 - LOGPROB_FLOOR])


def test_sampled_nan_raises_naming_side_token_and_position() -> None:
    rollout = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    teacher = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, NAN, NAN]])
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(MissingLogprobError) as info:
        sampled_reverse_kl(rollout, teacher, token_ids=ids)
    err = info.value
    assert (err.side, err.token_id, err.position, err.batch_index) == ("teacher", 9, 1, 1)


def test_sampled_padding_is_zero_and_ignores_nan() -> None:
    rollout = torch.tensor([[-1.0, NAN], [-3.0, -1.0]])
    teacher = torch.tensor([[-2.0, NAN], [-1.0, -1.0]])
    valid = torch.tensor([[True, False], [True, True]])
    got = sampled_reverse_kl(rollout, teacher, valid=valid)
    assert got.tolist() == [[1.0, 0.0], [-2.0, 0.0]]


# ------------------------------------------------------------------------------ padding


def test_pad_batch_pads_to_longest_with_valid_mask() -> None:
    arrays: list[np.ndarray] = [
        np.ones((2, 3), dtype=np.int32),
        np.ones((0, 3), dtype=np.int32),
        np.ones((4, 3)),
    ]
    with pytest.raises(ValueError, match="integer or all-float"):
        pad_batch(arrays)
    padded, valid = pad_batch([*arrays[:2], np.full((4, 3), 2, dtype=np.int64)])
    assert padded.dtype == torch.int64
    assert padded.shape == (3, 4, 3)
    assert valid.tolist() == [[True, True, False, False], [False] * 4, [True] * 4]
    assert (padded[0, 2:] == -1).all()
    assert (padded[2] == 2).all()


def test_pad_batch_floats_are_float32_with_chosen_fill() -> None:
    padded, valid = pad_batch([np.zeros(1, dtype=np.float64), np.zeros(3)], fill=-5.0)
    assert padded.dtype == torch.float32
    assert padded.tolist() == [[0.0, -5.0, -5.0], [0.0, 0.0, 0.0]]
    assert valid.tolist() == [[True, False, False], [True, True, True]]


def test_pad_topk_batch_builds_a_batch_the_kl_accepts() -> None:
    rng = np.random.default_rng(1)
    samples = [random_sample(rng, r, 3, 3, overlap=0.5, p_inf=0.0, p_hole=0.0) for r in (2, 5)]
    batch = pad_topk_batch(
        student_ids=[s.s_ids for s in samples],
        student_lp=[s.s_lp for s in samples],
        teacher_on_student=[s.t_on_s for s in samples],
    )
    assert batch.teacher_ids is None
    assert batch.valid.sum().item() == 7
    expected = topk_reverse_kl(make_batch(samples, "only-student"), "only-student", "student_p")
    got = topk_reverse_kl(batch, "only-student", "student_p")
    assert torch.equal(got.signal, expected.signal)
    with pytest.raises(ValueError, match="disagree"):
        pad_topk_batch(student_ids=[samples[0].s_ids], student_lp=[s.s_lp for s in samples])


# ------------------- short student rows (docs/semantics.md, "Missing values and empty rows")


def short_rows_samples(rng: np.random.Generator, k: int, lengths: list[int]) -> list[Sample]:
    """Student rows keeping a prefix of 0..k entries, padded at the end (id -1, logprob -inf;
    the teacher's values there are what a server answers for the filler ids: finite)."""
    out = []
    for r in lengths:
        smp = random_sample(rng, r, k, k, overlap=0.5, p_inf=0.1, p_hole=0.0)
        kept = rng.integers(0, k + 1, r)
        if r:
            kept[0] = 0
        pad = np.arange(k)[None, :] >= kept[:, None]
        smp.s_ids = np.where(pad, -1, smp.s_ids)
        smp.s_lp = np.where(pad, -np.inf, smp.s_lp).astype(np.float32)
        out.append(smp)
    return out


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("k", [1, 2, 5, 16])
@pytest.mark.parametrize(("strategy", "weight_mode"), COMBOS)
def test_short_and_empty_student_rows_match_reference(
    monkeypatch: pytest.MonkeyPatch,
    strategy: Strategy,
    weight_mode: WeightMode,
    k: int,
    backend: str,
) -> None:
    monkeypatch.setattr(_select, "_CPU_INDEX_BACKEND", backend)
    rng = np.random.default_rng(k * 31 + len(strategy))
    samples = short_rows_samples(rng, k, [9, 0, 17])
    check_against_reference(samples, strategy, weight_mode)


def test_only_student_on_empty_rows_is_zero_and_union_takes_t_alone() -> None:
    rng = np.random.default_rng(1)
    smp = random_sample(rng, 3, 4, 4, overlap=0.5, p_inf=0.0, p_hole=0.0)
    smp.s_ids[:] = -1
    smp.s_lp[:] = -np.inf
    res = topk_reverse_kl(make_batch([smp], "only-student"), "only-student", "student_p")
    assert res.signal.tolist() == [[0.0, 0.0, 0.0]]
    assert not res.mask.any()
    res = topk_reverse_kl(make_batch([smp], "union"), "union", "student_p")
    assert res.ids[0, :, :4].tolist() == smp.t_ids.tolist()
    assert not res.mask[0, :, 4:].any()
