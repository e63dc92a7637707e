"""Weighted teacher ensembles (issue 27): the configuration, the mixture, the pipeline.

An ensemble teacher is a probability-space mixture of member teachers: its logprob of a
token is ``log sum_i w_i exp(t_i)`` in float64. Checked here: the spelling and its errors;
the sans-IO mixture, union and top-k against plain loops; through the pipeline, an
ensemble of one member equals that teacher, two identical members equal one, and values
equal the float64 reference of the mock's closed form (``MixtureTeacher``) for every
strategy, divergence and the tail bucket; a member that fails fails its sample alone,
named, and each member's traffic shows in the per-endpoint stats.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.config import stream_config
from support.pipeline_reference import (
    MixtureTeacher,
    assert_matches,
    expected_result,
    rollout_topk_rows,
)

from opd_stream import (
    ConfigError,
    OPDStream,
    Sample,
    SampleFailure,
    ScoredSample,
    StreamConfig,
)
from opd_stream.fetch._mixture import mix_logprobs, mixture_topk, union_ids
from opd_stream.fleet._ensemble import Ensemble
from opd_stream.fleet._routing import TeacherRouting, normalize_teachers, parse_teacher_urls
from opd_stream.integrations.miles import config_from_miles_args
from opd_stream.kl._math import STRATEGIES
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.transport._transports import Response

S = "http://student:9"
K = 3

# ------------------------------------------------------------------------- configuration


def test_the_spelling_with_replicas_and_plain_teachers() -> None:
    got = normalize_teachers("mix=0.7*http://a:1|http://a:2;0.3*http://b:1,plain=http://c:1")
    assert got == {
        "mix": Ensemble((("http://a:1", "http://a:2"), ("http://b:1",)), (0.7, 0.3)),
        "plain": ("http://c:1",),
    }


def test_a_plain_ensemble_is_the_default_teacher() -> None:
    got = normalize_teachers("0.25*http://a:1; 0.75 * http://b:1/generate")
    assert got == {"default": Ensemble((("http://a:1",), ("http://b:1",)), (0.25, 0.75))}


def test_the_python_spellings() -> None:
    as_map = normalize_teachers({"m": {"http://a:1": 0.5, "http://b:1|http://b:2": 0.5}})
    as_struct = normalize_teachers(
        {"m": Ensemble((("http://a:1",), ("http://b:1", "http://b:2")), (0.5, 0.5))}
    )
    assert as_map == as_struct == normalize_teachers("m=0.5*http://a:1;0.5*http://b:1|http://b:2")


def test_a_url_is_still_a_url() -> None:
    # a ';' in a plain URL keeps its meaning: only a value that starts with W* is an ensemble
    assert normalize_teachers("t=http://h:1/p;x") == {"t": ("http://h:1/p;x",)}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("m=0.5*http://a:1;0.4*http://b:1", r"weights must sum to 1, got 0.5 \+ 0.4 = 0.9"),
        ("m=0.5*http://a:1;http://b:1", r"member 2: expected WEIGHT\*URL"),
        ("m=0.5*http://a:1;0.5*http://a:1", "is in two members"),
        ("m=0.5*http://a:1;0.5*http://b:1|http://a:1", "is in two members"),
        ("m=-1*http://a:1;2*http://b:1", "member 1: weight must be finite and > 0"),
        ("m=0*http://a:1;1*http://b:1", "member 1: weight must be finite and > 0"),
        ("m=1e999*http://a:1", "weight must be finite"),
        ("m=1.2.3*http://a:1", "is not a number"),
        ("m=0.5*ftp://a:1;0.5*http://b:1", "member 1: invalid server URL"),
        ("m=1*", "member 1: empty URL"),
    ],
)
def test_a_bad_ensemble_is_a_config_error_that_says_why(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        normalize_teachers(text)
    with pytest.raises(ConfigError, match=f"^teachers \\(from OPD_STREAM_TEACHERS\\): .*{match}"):
        StreamConfig.from_env({"OPD_STREAM_TEACHERS": text})


def test_weights_within_the_tolerance_are_divided_by_their_sum() -> None:
    (ens,) = normalize_teachers("0.3333333*http://a:1;0.6666667*http://b:1").values()
    assert isinstance(ens, Ensemble)
    assert math.fsum(ens.weights) == pytest.approx(1.0, abs=1e-15)


def test_env_flags_and_logs_carry_an_ensemble() -> None:
    text = "mix=0.7*http://a:1|http://a:2;0.3*http://b:1"
    cfg = StreamConfig.from_env({"OPD_STREAM_TEACHERS": text})
    assert isinstance(cfg.teachers["mix"], Ensemble)
    assert cfg.to_log_dict()["teachers"] == {"mix": "0.7*http://a:1|http://a:2;0.3*http://b:1"}
    assert parse_teacher_urls([text]) == cfg.teachers  # --teacher NAME=...
    routing = TeacherRouting(cfg.teachers)
    assert routing.urls("mix") == ("http://a:1", "http://a:2", "http://b:1")
    assert routing.teacher("mix") == cfg.teachers["mix"]


def test_miles_teacher_urls_carry_an_ensemble() -> None:
    args = SimpleNamespace(
        use_opd=True,
        opd_type="sglang",
        opd_teacher_urls=["mix=0.5*http://a:1/generate;0.5*http://b:1/generate"],
        opd_log_prob_top_k=4,
    )
    cfg = config_from_miles_args(args, environ={})
    assert cfg.teachers == {"mix": Ensemble((("http://a:1",), ("http://b:1",)), (0.5, 0.5))}


# ---------------------------------------------------------------------- the mixture, sans IO

logprob = st.one_of(st.floats(-60.0, 0.0), st.just(-math.inf))


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.lists(logprob, min_size=3, max_size=3), min_size=1, max_size=4),
    raw_weights=st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3),
)
def test_the_mixture_is_the_float64_log_sum_exp(
    data: list[list[float]], raw_weights: list[float]
) -> None:
    members = [np.array(col, dtype=np.float32) for col in zip(*data, strict=True)]
    weights = [w / math.fsum(raw_weights) for w in raw_weights]
    got = mix_logprobs(members, weights)
    assert got.dtype == np.float32
    for j in range(len(data)):
        total = math.fsum(w * math.exp(float(m[j])) for w, m in zip(weights, members, strict=True))
        want = math.log(total) if total > 0 else -math.inf
        # (the weights' float sum may be 1 +- 1 ulp: a value near 0 is then ~1e-16 off)
        ok = float(got[j]) == want or abs(float(got[j]) - want) <= 1e-6 * abs(want) + 1e-12
        assert ok, (got[j], want)


def test_the_mixture_of_one_or_of_identical_members_is_the_member() -> None:
    x = np.array([-0.1, -3.5, -math.inf, -1e4, -17.25], dtype=np.float32)
    assert np.array_equal(mix_logprobs([x], [1.0]), x)
    assert np.array_equal(mix_logprobs([x, x], [0.5, 0.5]), x)
    assert np.array_equal(mix_logprobs([x, x, x, x], [0.25] * 4), x)


def test_a_missing_value_in_any_member_is_missing() -> None:
    got = mix_logprobs(
        [np.array([np.nan, -1.0], np.float32), np.array([-1.0, np.nan], np.float32)], [0.5, 0.5]
    )
    assert np.isnan(got).all()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.lists(st.integers(-1, 12), min_size=3, max_size=3), min_size=1, max_size=3),
        min_size=1,
        max_size=4,
    )
)
def test_the_union_keeps_first_occurrences_in_member_order(rows: list[list[list[int]]]) -> None:
    members = len(rows[0])
    rows = [r[:members] + [r[0]] * (members - len(r)) for r in rows]
    tops = [np.array([r[m] for r in rows], dtype=np.int64) for m in range(members)]
    got = union_ids(tops)
    wants: list[list[int]] = []
    for r in rows:
        want: list[int] = []
        for m in range(members):
            for v in r[m]:
                if v >= 0 and v not in want:
                    want.append(v)
        wants.append(want)
    width = max(3, *(len(w) for w in wants))  # the widest row, at least one member's k
    assert got.shape == (len(rows), width)
    for i, want in enumerate(wants):
        assert got[i].tolist() == want + [-1] * (width - len(want))


def test_the_mixtures_top_k_ranks_by_value_padding_last() -> None:
    ids = np.array([[4, 9, 2, 7, -1, -1]], dtype=np.int64)
    lps = np.array([[-2.0, -0.5, -math.inf, -0.5, 0.0, 0.0]], dtype=np.float32)
    top_ids, top_lps = mixture_topk(ids, lps, 4)
    assert top_ids.tolist() == [[9, 7, 4, 2]]  # a tie keeps the earlier; -inf before padding
    assert top_lps.tolist() == [[-0.5, -0.5, -2.0, -math.inf]]


# ------------------------------------------------------------------------- the pipeline


def _servers(members: dict[str, int], **kw: Any) -> dict[str, InProcessSGLang]:
    out = {url: InProcessSGLang("teacher", seed, **kw) for url, seed in members.items()}
    out[S] = InProcessSGLang("student", 1)
    return out


def _samples(seed: int, n: int, *, with_topk: bool, teacher_prompt: bool = False) -> list[Sample]:
    rng = np.random.default_rng(seed)
    student = InProcessSGLang("student", 1).model
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 9)), int(rng.integers(0, 7))
        tokens = rng.integers(0, 3000, p + r).tolist()
        rows = rollout_topk_rows(student, tokens, p, K) if with_topk else None
        prompt = rng.integers(0, 3000, 1 + i).tolist() if teacher_prompt and i % 2 else None
        out.append(
            Sample(
                tokens,
                r,
                student_top_logprobs=rows,
                rollout_logprobs=rng.uniform(-3, 0, r).tolist(),
                teacher_prompt_ids=prompt,
                sample_id=i,
            )
        )
    return out


async def _run(teachers: Any, servers: Any, samples: list[Any], **kw: Any) -> list[Any]:
    cfg = stream_config(teachers, student_url=S, backoff_initial_s=0.001, **kw)
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
        stats = stream.stats()
    assert len(out) == len(samples)
    return [sorted(out, key=lambda r: r.index), stats]


def _same(a: ScoredSample, b: ScoredSample) -> None:
    assert torch.equal(a.teacher_logprobs, b.teacher_logprobs)
    assert (a.signal is None) == (b.signal is None)
    if a.signal is not None and b.signal is not None:
        assert torch.equal(a.signal, b.signal)
    assert (a.candidates is None) == (b.candidates is None)
    if a.candidates is not None and b.candidates is not None:
        for name in ("ids", "student_logprobs", "teacher_logprobs", "weights", "mask"):
            assert torch.equal(getattr(a.candidates, name), getattr(b.candidates, name)), name


MODES = [(0, "only-student")] + [(K, s) for s in STRATEGIES]


@pytest.mark.parametrize(("top_k", "strategy"), MODES)
async def test_an_ensemble_of_one_member_is_that_teacher(top_k: int, strategy: str) -> None:
    servers = _servers({"http://t:1": 3})
    samples = _samples(1, 8, with_topk=strategy != "only-teacher")
    kw = {"top_k": top_k, "strategy": strategy}
    plain, _ = await _run("http://t:1", servers, samples, **kw)
    one, _ = await _run("1*http://t:1", servers, samples, **kw)
    for a, b in zip(plain, one, strict=True):
        assert isinstance(a, ScoredSample) and isinstance(b, ScoredSample), (a, b)
        _same(a, b)


@pytest.mark.parametrize(("top_k", "strategy"), MODES)
async def test_two_identical_members_are_one(top_k: int, strategy: str) -> None:
    servers = _servers({"http://t:1": 3, "http://twin:1": 3})
    samples = _samples(2, 8, with_topk=strategy != "only-teacher")
    kw = {"top_k": top_k, "strategy": strategy, "tail": top_k > 0}
    plain, _ = await _run("http://t:1", servers, samples, **kw)
    twins, _ = await _run("0.5*http://t:1;0.5*http://twin:1", servers, samples, **kw)
    for a, b in zip(plain, twins, strict=True):
        assert isinstance(a, ScoredSample) and isinstance(b, ScoredSample), (a, b)
        _same(a, b)


COMBOS = [(s, "reverse_kl", False) for s in STRATEGIES]
COMBOS += [(s, "reverse_kl", True) for s in ("only-student", "union")]
COMBOS += [("union", "forward_kl", True), ("xor", "jsd", False), ("only-teacher", "jsd", True)]
WEIGHTS = {"reverse_kl": "student_p", "forward_kl": "teacher_p", "jsd": "student_p"}


@pytest.mark.parametrize(("strategy", "divergence", "tail"), COMBOS)
async def test_values_are_the_float64_mixture_of_the_members(
    strategy: str, divergence: str, tail: bool
) -> None:
    members = {"http://m1:1": 3, "http://m2:1|http://m2:2": 5, "http://m3:1": 7}
    urls = {"http://m1:1": 3, "http://m2:1": 5, "http://m2:2": 5, "http://m3:1": 7}
    servers = _servers(urls)
    weights = [0.2, 0.5, 0.3]
    spec = ";".join(f"{w}*{u}" for w, u in zip(weights, members, strict=True))
    samples = _samples(3, 10, with_topk=strategy != "only-teacher", teacher_prompt=True)
    out, stats = await _run(
        spec,
        servers,
        samples,
        top_k=K,
        strategy=strategy,
        weight_mode=WEIGHTS[divergence],
        divergence=divergence,
        tail=tail,
    )
    mixture = MixtureTeacher(
        [servers[u].model for u in ("http://m1:1", "http://m2:1", "http://m3:1")], weights
    )
    for res in out:
        assert isinstance(res, ScoredSample), res
        smp = samples[res.index]
        expected = expected_result(
            tokens=list(smp.tokens),
            response_length=smp.response_length,
            teacher=mixture,
            student=servers[S].model,
            top_k=K,
            strategy=strategy,
            weight_mode=WEIGHTS[divergence],
            tail=tail,
            teacher_prompt=None if smp.teacher_prompt_ids is None else list(smp.teacher_prompt_ids),
            divergence=divergence,
        )
        assert_matches(res, expected, teacher_rtol=1e-6)
    # every member was asked, and its traffic is in the per-endpoint stats
    for url in urls:
        assert servers[url].requests > 0
    assert servers["http://m2:1"].requests + servers["http://m2:2"].requests > 0
    for url in ("http://m1:1", "http://m3:1"):
        assert stats.endpoints[url].requests == servers[url].requests


WIRE = [
    # (server, id_scoring, topk_wire, weight_mode)
    ("patched", "per-position", "json", "none"),
    ("unpatched", "auto", "b64", "teacher_p"),  # falls back to blocked
    ("unpatched", "flat", "json", "student_p"),
    ("unpatched", "blocks", "b64", "none"),
]


@pytest.mark.parametrize(("per_position", "id_scoring", "topk_wire", "weight_mode"), WIRE)
async def test_every_id_form_and_weight_mode_works_with_an_ensemble(
    per_position: Any, id_scoring: str, topk_wire: str, weight_mode: str
) -> None:
    urls = {"http://m1:1": 3, "http://m2:1": 5}
    servers = _servers(urls, per_position=per_position)
    servers[S] = InProcessSGLang("student", 1, per_position=per_position)
    samples = _samples(6, 8, with_topk=True, teacher_prompt=True)
    out, _ = await _run(
        "0.6*http://m1:1;0.4*http://m2:1",
        servers,
        samples,
        top_k=K,
        strategy="union",
        weight_mode=weight_mode,
        id_scoring=id_scoring,
        topk_wire=topk_wire,
    )
    mixture = MixtureTeacher([servers[u].model for u in urls], [0.6, 0.4])
    for res in out:
        assert isinstance(res, ScoredSample), res
        smp = samples[res.index]
        expected = expected_result(
            tokens=list(smp.tokens),
            response_length=smp.response_length,
            teacher=mixture,
            student=servers[S].model,
            top_k=K,
            strategy="union",
            weight_mode=weight_mode,
            teacher_prompt=None if smp.teacher_prompt_ids is None else list(smp.teacher_prompt_ids),
        )
        assert_matches(res, expected, teacher_rtol=1e-6)


async def test_sampled_token_mode_mixes_the_sampled_tokens() -> None:
    servers = _servers({"http://m1:1": 3, "http://m2:1": 5})
    samples = _samples(4, 6, with_topk=False)
    out, _ = await _run("0.25*http://m1:1;0.75*http://m2:1", servers, samples)
    mixture = MixtureTeacher(
        [servers["http://m1:1"].model, servers["http://m2:1"].model], [0.25, 0.75]
    )
    for res in out:
        assert isinstance(res, ScoredSample), res
        smp = samples[res.index]
        expected = expected_result(
            tokens=list(smp.tokens),
            response_length=smp.response_length,
            teacher=mixture,
            student=servers[S].model,
            top_k=0,
            strategy="only-student",
            weight_mode="student_p",
            rollout_logprobs=smp.rollout_logprobs,
        )
        assert_matches(res, expected, teacher_rtol=1e-6)


V_SMALL, K_WIDE = 64, 40  # two members' top-k (80 ids) are more than the vocabulary


@pytest.mark.parametrize("strategy", ["only-teacher", "union"])
async def test_members_top_k_wider_than_the_vocabulary_send_only_ids_in_it(strategy: str) -> None:
    """n x k > V: the union of the members' top-k has at most V ids, and every id sent is
    one of the vocabulary (the mock answers 400 to any other, like SGLang)."""
    from support.threaded_mock import serve_mock_threaded

    from opd_stream.testing.mock_sglang import MockOptions

    opts = MockOptions(vocab_size=V_SMALL, head_size=8)
    rng = np.random.default_rng(12)
    samples = []
    for i in range(4):
        p, r = int(rng.integers(2, 6)), int(rng.integers(1, 6))
        samples.append(Sample(rng.integers(0, V_SMALL - 2, p + r).tolist(), r, sample_id=i))
    async with (
        serve_mock_threaded("teacher", 3, options=opts) as m1,
        serve_mock_threaded("teacher", 5, options=opts) as m2,
        serve_mock_threaded("student", 1, options=opts) as student,
    ):
        cfg = stream_config(
            f"0.3*{m1.url};0.7*{m2.url}",
            student_url=student.url,
            top_k=K_WIDE,
            strategy=strategy,
            id_scoring="per-position",
            max_attempts=1,
        )
        async with OPDStream(cfg) as stream:
            async with stream.run(samples) as results:
                out = sorted([r async for r in results], key=lambda r: r.index)
        mixture = MixtureTeacher([m1.model, m2.model], [0.3, 0.7])
        for res in out:
            assert isinstance(res, ScoredSample), res
            smp = samples[res.index]
            expected = expected_result(
                tokens=list(smp.tokens),
                response_length=smp.response_length,
                teacher=mixture,
                student=student.model,
                top_k=K_WIDE,
                strategy=strategy,
                weight_mode="student_p",
            )
            assert_matches(res, expected, teacher_rtol=1e-6)


def test_the_union_is_as_wide_as_its_widest_row() -> None:
    a = np.array([[5, 1, 2], [7, 8, 9]], dtype=np.int64)
    b = np.array([[1, 5, 2], [3, 7, -1]], dtype=np.int64)
    got = union_ids([a, b])
    assert got.tolist() == [[5, 1, 2, -1], [7, 8, 9, 3]]  # not [R, 6]
    same = union_ids([a, a])
    assert same.tolist() == a.tolist()  # never narrower than a member's top-k
    assert union_ids([a[:0], b[:0]]).shape == (0, 3)


def _fails_on(marker: int, status: int) -> Any:
    """A fault script: HTTP ``status`` for every request whose tokens hold ``marker``."""

    def fault(n: int, body: bytes) -> Response | None:
        del n
        ids = msgspec.json.decode(body)["input_ids"]
        flat = [t for row in ids for t in row] if ids and isinstance(ids[0], list) else ids
        if marker in flat:
            return Response(status, b'{"error": {"message": "injected"}}')
        return None

    return fault


@pytest.mark.parametrize("status", [503, 400])
@pytest.mark.parametrize("top_k", [0, K])
async def test_a_failing_member_fails_its_sample_alone_and_is_named(
    status: int, top_k: int
) -> None:
    marker = 4242
    servers = _servers({"http://m1:1": 3})
    servers["http://m2:1"] = InProcessSGLang("teacher", 5, fault=_fails_on(marker, status))
    samples = _samples(5, 6, with_topk=True)
    bad = 2
    samples[bad] = Sample([marker, 10, 11, 12, 13], 3)  # only its requests hold the marker
    out, stats = await _run(
        "0.5*http://m1:1;0.5*http://m2:1",
        servers,
        samples,
        top_k=top_k,
        strategy="union" if top_k else "only-student",
        max_attempts=2,
    )
    for res in out:
        if res.index != bad:
            assert isinstance(res, ScoredSample), res
            continue
        assert isinstance(res, SampleFailure)
        assert res.reason == f"teacher_http_{status}"
        assert res.message.startswith("ensemble member 2 of 2 (http://m2:1): HTTP "), res.message
        assert res.attempts >= (2 if status == 503 else 1)
    assert stats.failed == 1 and stats.completed == len(samples) - 1


async def test_members_are_asked_at_once_and_a_failure_cancels_the_others() -> None:
    """Member 1's answer waits until member 2's request has arrived: asked one after the
    other, the sample would run into its deadline. Then member 2 answers 400 while member
    1 waits for ever: the sample fails at once, member 2 named, member 1's request
    cancelled (nothing outlives the sample's fetch)."""
    import anyio

    servers = _servers({"http://m1:1": 3, "http://m2:1": 5})
    arrived = anyio.Event()
    mode = {"fail": False}
    cancelled: list[str] = []

    async def handler(method: str, url: str, body: bytes) -> Response:
        base = url.split("/generate")[0]
        if base == "http://m2:1":
            arrived.set()
            if mode["fail"]:
                return Response(400, b'{"error": {"message": "no"}}')
        elif base == "http://m1:1":
            try:
                await arrived.wait()
                if mode["fail"]:
                    await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                cancelled.append(base)
                raise
        path = url[len(base) :].split("?")[0]
        return servers[base].handle(method, path, body)

    from opd_stream.transport._transports import MockTransport

    cfg = stream_config(
        "0.5*http://m1:1;0.5*http://m2:1",
        request_deadline_s=30.0,
        max_attempts=1,
    )
    async with OPDStream(cfg, transport=MockTransport(handler)) as stream:
        async with stream.run([Sample([1, 2, 3, 4], 2)]) as results:
            (ok,) = [r async for r in results]
        assert isinstance(ok, ScoredSample), ok
        mode["fail"] = True
        arrived = anyio.Event()
        with anyio.fail_after(20):  # a generous bound: it ends at once, or hangs for ever
            async with stream.run([Sample([1, 2, 3, 5], 2)]) as results:
                (failed,) = [r async for r in results]
    assert isinstance(failed, SampleFailure), failed
    assert failed.reason == "teacher_http_400"
    assert failed.message.startswith("ensemble member 2 of 2 (http://m2:1): HTTP 400")
    assert cancelled == ["http://m1:1"]


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])  # verl's manager is asyncio's
@pytest.mark.parametrize("k", [0, 3])
async def test_verls_teacher_manager_scores_with_an_ensemble(k: int) -> None:
    from opd_stream.integrations.verl import TeacherManager

    servers = _servers({"http://m1:1": 3, "http://m2:1": 5})
    cfg = StreamConfig.from_env({}, teachers="0.3*http://m1:1;0.7*http://m2:1")
    manager = TeacherManager(cfg, top_k=k, transport=mock_transport(servers))
    mixture = MixtureTeacher(
        [servers["http://m1:1"].model, servers["http://m2:1"].model], [0.3, 0.7]
    )
    seq = np.random.default_rng(k).integers(0, 3000, 12).tolist()
    try:
        ids, lps = await manager.compute_teacher_logprobs_single(
            sequence_ids=seq, multi_modal_data={}, routing_key=None
        )
    finally:
        await manager.aclose()
    tok = np.asarray(seq)
    for j in range(1, len(seq)):  # row j - 1 is position j; the last row is verl's pad row
        if k == 0:
            want_ids = [seq[j]]
            want = mixture.token_logprobs(tok, np.array([j])).tolist()
        else:
            top_ids, top_lps = mixture.topk(tok, np.array([j]), k)
            want_ids, want = top_ids[0].tolist(), top_lps[0].tolist()
        assert ids[j - 1].tolist() == want_ids
        for g, e in zip(lps[j - 1].tolist(), want, strict=True):
            assert abs(g - e) <= 1e-6 * abs(e), (j, g, e)


def test_a_member_is_named_without_its_query_string() -> None:
    (ens,) = normalize_teachers("0.5*http://a:1/g?token=abc;0.5*http://b:1").values()
    assert isinstance(ens, Ensemble)
    assert ens.member_name(0) == "member 1 of 2 (http://a:1/g)"
    assert ens.spec() == "0.5*http://a:1/g?token=abc;0.5*http://b:1"


def test_replica_groups_split_an_ensemble_into_its_members() -> None:
    from opd_stream.fleet._routing import replica_groups

    teachers = normalize_teachers("mix=0.5*http://a:1|http://a:2;0.5*http://b:1,t=http://c:1")
    assert replica_groups(teachers) == {
        "mix member 1": ("http://a:1", "http://a:2"),
        "mix member 2": ("http://b:1",),
        "t": ("http://c:1",),
    }
