"""The KL fast paths: both index backends (numpy on CPU, torch elsewhere: run here on CPU,
and on CUDA when present), every membership path, row boundaries of the joined batch, and
the KL stage's batching (results independent of batch mates, owned memory, per-sample
missing-logprob errors).

Every number is checked against the float64 per-position reference ``kl_reference``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kl_reference import reference_position

import opd_stream._scoring as scoring
import opd_stream.kl._math as kl
import opd_stream.kl._select as klselect
from opd_stream import Sample
from opd_stream._errors import MissingLogprobError
from opd_stream._sample import Fetched, PreparedSample, ScoredSample
from opd_stream._scoring import score_batch
from opd_stream.kl._math import STRATEGIES, WEIGHT_MODES, Strategy, TopKBatch, WeightMode
from opd_stream.wire._answers import ScoreRows

# (device, index backend): the CPU default, the other devices' code run on CPU, CUDA.
PATHS = [
    pytest.param("cpu", "numpy", id="cpu-numpy"),
    pytest.param("cpu", "torch", id="cpu-torch"),
] + ([pytest.param("cuda", "torch", id="cuda")] if torch.cuda.is_available() else [])
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
COMBOS = [(s, w) for s in STRATEGIES for w in WEIGHT_MODES]
FIELDS = ("s_ids", "s_lp", "t_on_s", "t_ids", "t_lp", "s_on_t")
BATCH_FIELDS = (
    "student_ids",
    "student_lp",
    "teacher_on_student",
    "teacher_ids",
    "teacher_lp",
    "student_on_teacher",
)


@contextlib.contextmanager
def index_backend(name: str) -> Iterator[None]:
    """Run the candidate selection on ``name`` ("numpy": CPU default, "torch": other devices)."""
    before = klselect._CPU_INDEX_BACKEND
    klselect._CPU_INDEX_BACKEND = name
    try:
        yield
    finally:
        klselect._CPU_INDEX_BACKEND = before


@contextlib.contextmanager
def broadcast_below(k: int, chunk: int | None = None) -> Iterator[None]:
    before = klselect._BROADCAST_MAX_K, klselect._EQ_CHUNK_ELEMENTS
    klselect._BROADCAST_MAX_K = k
    if chunk is not None:
        klselect._EQ_CHUNK_ELEMENTS = chunk
    try:
        yield
    finally:
        klselect._BROADCAST_MAX_K, klselect._EQ_CHUNK_ELEMENTS = before


# ------------------------------------------------------------------------------- inputs


def random_rows(
    rng: np.random.Generator,
    r: int,
    ks: int,
    kt: int,
    *,
    overlap: float = 0.6,
    p_inf: float = 0.1,
    p_hole: float = 0.0,
    hole_id: int = -1,
    id_offset: int = 0,
) -> dict[str, np.ndarray]:
    """One sample's top-k rows: distinct ids per row (+ ``id_offset``), about ``overlap`` of
    T drawn from S, empty slots (id ``hole_id``, values NaN) with probability ``p_hole``."""
    vocab = ks + kt + 5
    perm = np.argsort(rng.random((r, vocab)), axis=1) * 3 + 1
    s_ids = perm[:, :ks]
    fresh = perm[:, ks : ks + kt]
    shuffled = np.take_along_axis(s_ids, np.argsort(rng.random((r, ks)), axis=1), axis=1)
    from_s = shuffled[:, :kt] if ks >= kt else np.pad(shuffled, ((0, 0), (0, kt - ks)))
    common = rng.binomial(min(ks, kt), overlap, size=r)
    t_ids = np.where(np.arange(kt)[None, :] < common[:, None], from_s, fresh)
    t_ids = np.take_along_axis(t_ids, np.argsort(rng.random((r, kt)), axis=1), axis=1)

    def lp(k: int) -> np.ndarray:
        x = rng.uniform(-30.0, 0.0, size=(r, k)).astype(np.float32)
        x[rng.random((r, k)) < p_inf] = -np.inf
        return x

    out = {
        "s_ids": (s_ids + id_offset).astype(np.int64),
        "s_lp": lp(ks),
        "t_on_s": lp(ks),
        "t_ids": (t_ids + id_offset).astype(np.int64),
        "t_lp": lp(kt),
        "s_on_t": lp(kt),
    }
    for ids, vals in (("s_ids", ("s_lp", "t_on_s")), ("t_ids", ("t_lp", "s_on_t"))):
        hole = rng.random(out[ids].shape) < p_hole
        out[ids][hole] = hole_id
        for v in vals:
            out[v][hole] = np.nan
    return out


def padded_batch(samples: list[dict[str, np.ndarray]], device: str = "cpu") -> TopKBatch:
    """[B, R_max, K] with padding ids -1 and NaN values (never read)."""
    r_max = max(s["s_ids"].shape[0] for s in samples)
    fields = {}
    for name, key in zip(BATCH_FIELDS, FIELDS, strict=True):
        k = samples[0][key].shape[1]
        ids = key.endswith("ids")
        out = np.full((len(samples), r_max, k), -1 if ids else np.nan)
        for i, s in enumerate(samples):
            out[i, : s[key].shape[0]] = s[key]
        fields[name] = torch.from_numpy(out.astype(np.int64 if ids else np.float32)).to(device)
    valid = torch.from_numpy(
        np.arange(r_max)[None, :] < np.array([s["s_ids"].shape[0] for s in samples])[:, None]
    )
    return TopKBatch(valid=valid.to(device), **fields)


def expected(
    samples: list[dict[str, np.ndarray]], strategy: str, weight_mode: str
) -> list[list[Any]]:
    rows = []
    for s in samples:
        lists = {k: v.tolist() for k, v in s.items()}
        rows.append(
            [
                reference_position(
                    strategy=strategy,
                    weight_mode=weight_mode,
                    **{k: v[pos] for k, v in lists.items()},
                )
                for pos in range(s["s_ids"].shape[0])
            ]
        )
    return rows


def assert_sample_matches(got: dict[str, torch.Tensor], refs: list[Any], c: int) -> None:
    """``got``: one sample's ``signal [R]`` and ``ids/student_lp/teacher_lp/weights/mask
    [R, C]`` (padding positions excluded) against the reference positions."""
    r = len(refs)
    assert got["signal"].shape == (r,)
    for name in ("ids", "student_lp", "teacher_lp", "weights", "mask"):
        assert got[name].shape == (r, c), name
    exp_ids = np.full((r, c), -1, dtype=np.int64)
    exp = {name: np.zeros((r, c)) for name in ("student_lp", "teacher_lp", "weights")}
    for pos, ref in enumerate(refs):
        n = len(ref.ids)
        exp_ids[pos, :n] = ref.ids
        exp["student_lp"][pos, :n] = ref.student
        exp["teacher_lp"][pos, :n] = ref.teacher
        exp["weights"][pos, :n] = ref.weights
        tol = 1e-5 + 2e-6 * ref.scale
        assert abs(float(got["signal"][pos]) - ref.r) <= tol, (pos, ref.r)
    np.testing.assert_array_equal(got["ids"].numpy(), exp_ids)
    np.testing.assert_array_equal(got["mask"].numpy(), exp_ids != -1)
    for name, want in exp.items():
        np.testing.assert_allclose(got[name].double().numpy(), want, rtol=0, atol=1e-5)
        # unselected slots are exactly +0.0 (not -0.0, not NaN)
        unused = got[name][exp_ids == -1]
        assert not torch.signbit(unused).any() and (unused == 0).all(), name


def check_batch(
    samples: list[dict[str, np.ndarray]],
    strategy: Strategy,
    weight_mode: WeightMode,
    device: str = "cpu",
) -> None:
    res = kl.topk_reverse_kl(padded_batch(samples, device), strategy, weight_mode)
    assert res.ids.device.type == device
    assert res.student_tail_lp is None and res.teacher_tail_lp is None  # (tail=False)
    res = kl.TopKResult(*(x.cpu() for x in res[:6]))
    assert res.signal.dtype == res.student_lp.dtype == res.weights.dtype == torch.float32
    assert res.ids.dtype == torch.int64 and res.mask.dtype == torch.bool
    ks, kt = samples[0]["s_ids"].shape[1], samples[0]["t_ids"].shape[1]
    c = {"only-student": ks, "only-teacher": kt, "intersection": ks}.get(strategy, ks + kt)
    for i, refs in enumerate(expected(samples, strategy, weight_mode)):
        r = len(refs)
        got = {name: getattr(res, name)[i, :r] for name in res._fields[:6]}
        assert_sample_matches(got, refs, c)
        # padding positions: nothing selected
        assert not res.mask[i, r:].any() and (res.signal[i, r:] == 0).all()


# ------------------------------------------------------- both backends vs the reference


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    ks = draw(st.integers(1, 40))
    kt = draw(st.one_of(st.just(ks), st.integers(0, 40)))
    return {
        "ks": ks if kt else draw(st.integers(0, 40)),
        "kt": kt,
        "lengths": draw(st.lists(st.integers(0, 30), min_size=1, max_size=3)),
        "overlap": draw(st.sampled_from([0.0, 0.5, 1.0])),
        "p_inf": draw(st.sampled_from([0.0, 0.2, 1.0])),
        "p_hole": draw(st.sampled_from([0.0, 0.0, 0.15])),
        "hole_id": draw(st.sampled_from([-1, -1, -9])),
        "id_offset": draw(st.sampled_from([0, 0, 2**28, 2**40])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@pytest.mark.parametrize(("device", "backend"), PATHS)
@pytest.mark.parametrize(("strategy", "weight_mode"), COMBOS)
@settings(max_examples=12, deadline=None)
@given(case=cases())
def test_each_index_backend_matches_the_float64_reference(
    device: str, backend: str, strategy: Strategy, weight_mode: WeightMode, case: dict[str, Any]
) -> None:
    rng = np.random.default_rng(case["seed"])
    knobs = {k: case[k] for k in ("overlap", "p_inf", "p_hole", "hole_id", "id_offset")}
    samples = [random_rows(rng, r, case["ks"], case["kt"], **knobs) for r in case["lengths"]]
    with index_backend(backend):
        check_batch(samples, strategy, weight_mode, device)


@pytest.mark.parametrize(("device", "backend"), PATHS)
@pytest.mark.parametrize(
    "path",
    [
        "int32-keys",  # numpy: the in-place fast path
        "int64-keys",  # ids too large for int32 packed keys
        "broadcast-small-k",
        "broadcast-chunked",
        "broadcast-huge-ids",  # ids too large for any packed key
        "holes-below-minus-one",
    ],
)
@pytest.mark.parametrize("strategy", ["intersection", "union", "xor"])
def test_every_membership_path_matches_the_reference(
    device: str, backend: str, path: str, strategy: Strategy
) -> None:
    rng = np.random.default_rng(7)
    offset = {"int64-keys": 2**35, "broadcast-huge-ids": 2**60}.get(path, 0)
    hole_id = -123 if path == "holes-below-minus-one" else -1
    samples = [
        random_rows(rng, r, 12, 9, p_hole=0.1, hole_id=hole_id, id_offset=offset)
        for r in (40, 0, 23)
    ]
    threshold = 1000 if path.startswith("broadcast-small") or path == "broadcast-chunked" else 2
    chunk = 3 * 12 * 9 if path == "broadcast-chunked" else None
    with index_backend(backend), broadcast_below(threshold, chunk):
        for weight_mode in WEIGHT_MODES:
            check_batch(samples, strategy, weight_mode, device)


@pytest.mark.parametrize(("device", "backend"), PATHS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_id_shared_by_adjacent_rows_is_not_a_match(
    device: str, backend: str, strategy: Strategy
) -> None:
    # Sorted row 0 ends with id 9 and sorted row 1 starts with 9: in the flattened batch they
    # are neighbours, which must not read as an S id found in T.
    def lp(*v: float) -> np.ndarray:
        return np.array(v, dtype=np.float32)

    sample = {
        "s_ids": np.array([[5, 1], [9, 30]]),
        "s_lp": np.stack([lp(-1, -2), lp(-3, -4)]),
        "t_on_s": np.stack([lp(-2, -1), lp(-4, -3)]),
        "t_ids": np.array([[2, 9], [31, 40]]),
        "t_lp": np.stack([lp(-0.5, -1.5), lp(-2.5, -3.5)]),
        "s_on_t": np.stack([lp(-6, -7), lp(-8, -9)]),
    }
    with index_backend(backend):
        for weight_mode in WEIGHT_MODES:
            check_batch([sample], strategy, weight_mode, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("strategy", "weight_mode"), COMBOS)
def test_inputs_are_never_modified_or_aliased(
    device: str, strategy: Strategy, weight_mode: WeightMode
) -> None:
    rng = np.random.default_rng(3)
    samples = [random_rows(rng, 9, 5, 5, p_hole=0.2), random_rows(rng, 4, 5, 5)]
    batch = padded_batch(samples, device)
    before = [None if x is None else x.clone() for x in batch]
    res = kl.topk_reverse_kl(batch, strategy, weight_mode)
    for x, y in zip(batch, before, strict=True):
        if x is not None and y is not None:
            assert torch.equal(x.nan_to_num(-7.0), y.nan_to_num(-7.0))
    inputs = {x.untyped_storage().data_ptr() for x in batch if x is not None}
    assert not inputs & {t.untyped_storage().data_ptr() for t in res if t is not None}


def test_joined_columns_are_a_view_only_when_adjacent() -> None:
    base = torch.arange(24).reshape(4, 6)
    a, b = base[:, :2], base[:, 2:]
    joined = kl._joined(a, b)
    assert torch.equal(joined, base)
    assert joined.data_ptr() == base.data_ptr()
    gap = kl._joined(base[:, :2], base[:, 3:])
    assert torch.equal(gap, torch.cat((base[:, :2], base[:, 3:]), dim=1))
    assert gap.data_ptr() != base.data_ptr()


# --------------------------------------------------------------------------- KL stage


def fetched(index: int, arrays: dict[str, np.ndarray], strategy: Strategy) -> Fetched:
    """What the fetch workers hand the KL stage for ``strategy`` (``docs/semantics.md``,
    "Which requests each strategy makes")."""
    r = arrays["s_ids"].shape[0]
    tokens = np.arange(3 + r, dtype=np.int64) + 100
    uses_s = strategy != "only-teacher"
    t_topk = strategy != "only-student"
    scores_s = strategy in ("only-student", "union", "xor")
    scores_t = strategy in ("only-teacher", "union", "xor")
    teacher_rows = ScoreRows(
        token_ids=tokens[3:],
        token_logprobs=np.full(r, -1.5, dtype=np.float32),
        top_ids=arrays["t_ids"] if t_topk else None,
        top_logprobs=arrays["t_lp"] if t_topk else None,
        id_logprobs=arrays["t_on_s"] if scores_s else None,
        used_b64=False,
        weight_version=None,
    )
    student_rows = None
    if scores_t:
        student_rows = ScoreRows(
            token_ids=tokens[3:],
            token_logprobs=np.zeros(r, dtype=np.float32),
            top_ids=None,
            top_logprobs=None,
            id_logprobs=arrays["s_on_t"],
            used_b64=False,
            weight_version=None,
        )
    prepared = PreparedSample(
        sample=Sample(tokens.tolist(), r),
        index=index,
        teacher="default",
        tokens=tokens,
        prompt_length=3,
        response_length=r,
        rollout_logprobs=None,
        student_top_ids=arrays["s_ids"] if uses_s else None,
        student_top_logprobs=arrays["s_lp"] if uses_s else None,
    )
    return Fetched(
        prepared=prepared,
        teacher_rows=teacher_rows,
        student_ids=arrays["s_ids"] if uses_s else None,
        student_lps=arrays["s_lp"] if uses_s else None,
        student_rows=student_rows,
        attempts=1,
        admitted_at=0.0,
    )


def score(
    items: list[Fetched],
    strategy: Strategy,
    weight_mode: WeightMode = "student_p",
    device: str = "cpu",
) -> Any:
    k = items[0].prepared.student_top_ids
    top_k = (k if k is not None else items[0].teacher_rows.top_ids).shape[1]  # type: ignore[union-attr]
    return score_batch(
        items,
        top_k=top_k,
        strategy=strategy,
        weight_mode=weight_mode,
        device=torch.device(device),
    )


def as_dict(res: ScoredSample) -> dict[str, torch.Tensor]:
    c = res.candidates
    assert c is not None and res.reverse_kl is not None
    return {
        "signal": res.reverse_kl,
        "ids": c.ids,
        "student_lp": c.student_logprobs,
        "teacher_lp": c.teacher_logprobs,
        "weights": c.weights,
        "mask": c.mask,
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("strategy", "weight_mode"), COMBOS)
def test_stage_results_match_the_reference(
    device: str, strategy: Strategy, weight_mode: WeightMode
) -> None:
    rng = np.random.default_rng(11)
    samples = [random_rows(rng, r, 6, 6, p_hole=0.05) for r in (17, 0, 30, 1)]
    items = [fetched(i, s, strategy) for i, s in enumerate(samples)]
    out = score(items, strategy, weight_mode, device)
    c = 12 if strategy in ("union", "xor") else 6
    for res, refs in zip(out, expected(samples, strategy, weight_mode), strict=True):
        assert isinstance(res, ScoredSample)
        assert_sample_matches(as_dict(res), refs, c)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_sample_scores_bit_identically_alone_and_in_any_batch_on_cpu(strategy: Strategy) -> None:
    rng = np.random.default_rng(5)
    samples = [random_rows(rng, r, 16, 16, p_hole=0.02) for r in (300, 7, 129, 64)]
    items = [fetched(i, s, strategy) for i, s in enumerate(samples)]
    together = score(items, strategy)
    reordered = score(items[::-1], strategy)[::-1]
    for i, item in enumerate(items):
        (alone,) = score([item], strategy)
        for other in (together[i], reordered[i]):
            for name, tensor in as_dict(alone).items():
                assert torch.equal(bits(tensor), bits(as_dict(other)[name])), (i, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("strategy", "tail", "divergence"),
    [(s, False, "reverse_kl") for s in STRATEGIES]
    + [("union", True, "reverse_kl"), ("only-student", False, "jsd")],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_without_candidates_the_signal_is_the_same_bits_and_nothing_else_comes_out(
    device: str, strategy: Strategy, tail: bool, divergence: Any, batch: int
) -> None:
    rng = np.random.default_rng(9)
    samples = [random_rows(rng, r, 8, 8, p_hole=0.05) for r in (40, 0, 13)[:batch]]
    items = [fetched(i, s, strategy) for i, s in enumerate(samples)]

    def run(candidates: bool) -> list[Any]:
        return score_batch(
            items,
            top_k=8,
            strategy=strategy,
            weight_mode="student_p",
            device=torch.device(device),
            tail=tail,
            divergence=divergence,
            candidates=candidates,
        )

    for full, alone in zip(run(True), run(False), strict=True):
        assert isinstance(full, ScoredSample) and isinstance(alone, ScoredSample)
        assert full.candidates is not None and alone.candidates is None
        assert full.signal is not None and alone.signal is not None
        assert torch.equal(bits(full.signal), bits(alone.signal))
        assert alone.signal.untyped_storage().nbytes() == alone.signal.numel() * 4  # its own


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that -0.0 != 0.0 and NaN == NaN."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", ["only-student", "union"])
def test_stage_results_own_their_memory(device: str, strategy: Strategy) -> None:
    rng = np.random.default_rng(2)
    samples = [random_rows(rng, r, 4, 4) for r in (5, 8)]
    alone = [fetched(0, samples[0], strategy)]
    together = [fetched(i, s, strategy) for i, s in enumerate(samples)]
    for items in (alone, together):
        out = score(items, strategy, device=device)
        inputs = [a for s in samples for a in s.values()]
        seen: set[int] = set()
        for res in out:
            for name, t in as_dict(res).items():
                storage = t.untyped_storage()
                assert storage.nbytes() == t.numel() * t.element_size(), name  # not a batch view
                assert storage.data_ptr() not in seen
                seen.add(storage.data_ptr())
                assert not any(np.shares_memory(t.numpy(), a) for a in inputs), name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_batch_of_one_hands_over_what_its_kl_computed_without_copying_it(
    strategy: Strategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arrays computed for one sample alone become its result's tensors as they are;
    a batch of several copies each sample's rows out (what the test above checks holds
    either way)."""
    copies: list[tuple[int, ...]] = []
    copy = scoring._own

    def counted(a: np.ndarray) -> torch.Tensor:
        copies.append(a.shape)
        return copy(a)

    monkeypatch.setattr(scoring, "_own", counted)
    rng = np.random.default_rng(3)
    samples = [random_rows(rng, r, 4, 4) for r in (6, 9)]
    score([fetched(0, samples[0], strategy)], strategy)
    assert copies == []
    score([fetched(i, s, strategy) for i, s in enumerate(samples)], strategy)
    assert len(copies) >= 2 * 6


def test_a_tensor_is_handed_over_only_when_it_is_the_whole_of_memory_no_input_shares() -> None:
    batch_input = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    owner = scoring._Owner([batch_input])
    fresh = torch.ones(3, 4)
    assert owner(fresh) is fresh  # its own: as it is
    again = owner(fresh)  # handed over already: a copy
    assert again.data_ptr() != fresh.data_ptr()
    assert torch.equal(again, fresh)
    assert owner(batch_input).data_ptr() != batch_input.data_ptr()  # an input's
    assert owner(batch_input[1:]).data_ptr() != batch_input[1].data_ptr()  # a part of one
    wide = torch.ones(6, 4)
    half = owner(wide[:3])  # a part of a larger tensor: a copy, not a view of it
    assert half.untyped_storage().nbytes() == 3 * 4 * 4
    assert half.data_ptr() != wide.data_ptr()
    strided = torch.ones(4, 3).t()  # the whole of its memory, not C-contiguous: a copy
    copied = owner(strided)
    assert copied.data_ptr() != strided.data_ptr() and copied.is_contiguous()
    assert torch.equal(copied, strided)
    big = torch.zeros(4, 4)
    inside = scoring._Owner([big[1:2]])  # an input in the middle of a tensor's memory
    assert inside(big).data_ptr() != big.data_ptr()  # overlaps it: a copy
    block = np.zeros((4, 4), dtype=np.float32)  # an input viewing a part of an array
    around = scoring._Owner([torch.from_numpy(block[1:3])])
    whole = torch.from_numpy(block)
    assert around(whole).data_ptr() != whole.data_ptr()  # overlaps it: a copy
    after = torch.zeros(2, 4)
    beside = scoring._Owner([torch.zeros(2, 4)])
    assert beside(after) is after  # no overlap: as it is


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_missing_logprob_fails_only_its_sample_naming_its_own_position(
    device: str, strategy: Strategy
) -> None:
    rng = np.random.default_rng(9)
    overlap = 1.0 if strategy == "intersection" else 0.0  # every S id selected
    samples = [random_rows(rng, r, 4, 4, overlap=overlap, p_inf=0.0) for r in (6, 0, 7, 5, 9)]
    # Values every strategy reads: S's student value (T's for only-teacher).
    field = "s_on_t" if strategy == "only-teacher" else "s_lp"
    ids_field = "t_ids" if strategy == "only-teacher" else "s_ids"
    samples[2][field][4, 1] = np.nan  # sample 2, position 4
    samples[4][field][2, 0] = np.nan  # sample 4, position 2 (after sample 2 is taken out)
    items = [fetched(i, s, strategy) for i, s in enumerate(samples)]
    out = score(items, strategy, device=device)
    for i in (2, 4):
        f, err = out[i]
        assert f is items[i] and isinstance(err, MissingLogprobError)
        assert err.side == "student"
    assert (out[2][1].position, out[2][1].batch_index) == (4, 2)
    assert out[2][1].token_id == int(samples[2][ids_field][4, 1])
    # the second offender is found in the second round, without sample 2: index 3 of 4
    assert (out[4][1].position, out[4][1].batch_index) == (2, 3)
    assert out[4][1].token_id == int(samples[4][ids_field][2, 0])
    for i in (0, 1, 3):
        (alone,) = score([items[i]], strategy, device=device)
        for name, tensor in as_dict(alone).items():
            other = as_dict(out[i])[name]
            if device == "cpu" or not tensor.dtype.is_floating_point:
                assert torch.equal(tensor, other), name
            else:  # CUDA reductions may round differently for another batch shape
                assert torch.allclose(tensor, other, rtol=0, atol=1e-6), name


def test_stage_float_results_are_float32_close_to_float64() -> None:
    # Softmax weights and r_t are computed in float32 (as the results); against the float64
    # reference the error stays far inside the 1e-5 tolerance used everywhere.
    rng = np.random.default_rng(4)
    samples = [random_rows(rng, 200, 16, 16, p_inf=0.0)]
    (res,) = score([fetched(0, samples[0], "union")], "union")
    refs = expected(samples, "union", "student_p")[0]
    for p, ref in enumerate(refs):
        got = float(res.reverse_kl[p])
        assert math.isfinite(got)
        assert abs(got - ref.r) <= 2e-6 + 2e-7 * ref.scale, (p, got, ref.r)
