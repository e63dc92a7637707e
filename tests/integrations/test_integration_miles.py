"""Miles / slime drop-in: flag mapping, and reward_func + post_process_rewards against the
worked example (``docs/semantics.md``, "Worked example"; a fake SGLang answering exactly
those numbers) and the mock servers."""

from __future__ import annotations

import asyncio
import json
import math
from argparse import Namespace
from typing import Any

import numpy as np
import pytest
from support.pipeline_reference import expected_result, rollout_topk_rows

from opd_stream import ConfigError, MockTransport, Response, Sample, SampleFailure
from opd_stream.integrations import miles
from opd_stream.integrations.miles._flags import STRATEGIES, WEIGHT_MODES
from opd_stream.testing.mock_sglang import serve_mock


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


def _args(**kw: Any) -> Namespace:
    base: dict[str, Any] = {"use_opd": True, "opd_type": "sglang", "rm_url": "http://t:1/generate"}
    base.update(kw)
    return Namespace(**base)


class _MilesSample:
    """Duck-typed Miles sample: tokens, response_length, metadata, reward."""

    def __init__(self, tokens: list[int], r: int, metadata: dict[str, Any] | None = None) -> None:
        self.tokens = tokens
        self.response_length = r
        self.metadata = metadata or {}
        self.reward: Any = None

    def get_reward_value(self, args: Any) -> Any:
        return self.reward


# --- flag mapping ------------------------------------------------------------------------
def test_reference_flags_map_to_a_stream_config() -> None:
    cfg = miles.config_from_miles_args(
        _args(
            opd_teacher_urls=["math=http://m:1/generate", "default=http://d:2"],
            opd_teacher_key="domain",
            opd_log_prob_top_k=16,
            opd_top_k_strategy="union",
            opd_reward_weight_mode="teacher_p",
            opd_topk_per_position=True,
            sglang_router_ip="10.0.0.5",
            sglang_router_port=3000,
            sglang_router_request_timeout_secs=120,
        )
    )
    assert cfg.teachers == {"math": ("http://m:1",), "default": ("http://d:2",)}
    assert (cfg.teacher_key, cfg.top_k, cfg.strategy, cfg.weight_mode) == (
        "domain",
        16,
        "union",
        "teacher_p",
    )
    assert cfg.id_scoring == "per-position"
    assert cfg.student_url == "http://10.0.0.5:3000"
    assert cfg.request_deadline_s == 120.0


def test_miles_reads_the_signal_alone_so_no_candidates_are_kept_unless_asked() -> None:
    assert miles.config_from_miles_args(_args(opd_log_prob_top_k=16)).candidates is False
    asked = miles.config_from_miles_args(_args(opd_log_prob_top_k=16), candidates=True)
    assert asked.candidates is True


def test_rm_url_is_the_single_teacher_and_sampled_mode_ignores_the_strategy() -> None:
    cfg = miles.config_from_miles_args(_args(opd_top_k_strategy="xor", opd_log_prob_top_k=0))
    assert cfg.teachers == {"default": ("http://t:1",)}
    assert (cfg.top_k, cfg.strategy, cfg.id_scoring) == (0, "only-student", "auto")


def test_a_missing_or_zero_router_timeout_keeps_a_finite_deadline() -> None:
    for value in (None, 0):
        cfg = miles.config_from_miles_args(_args(sglang_router_request_timeout_secs=value))
        assert math.isfinite(cfg.request_deadline_s) and cfg.request_deadline_s > 0


def test_an_opd_flag_without_use_opd_is_an_error_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--opd-log-prob-top-k given without --use-opd"):
        miles.config_from_miles_args(Namespace(use_opd=False, opd_log_prob_top_k=4))


def test_teacher_urls_need_opd_type_sglang() -> None:
    with pytest.raises(
        ConfigError, match=r"--opd-teacher-urls is only supported with --opd-type=sglang"
    ):
        miles.config_from_miles_args(
            _args(opd_type="megatron", opd_teacher_urls=["default=http://d:2"])
        )


def test_no_teacher_is_an_error_naming_both_flags() -> None:
    with pytest.raises(ConfigError, match=r"--rm-url .* --opd-teacher-urls"):
        miles.config_from_miles_args(_args(rm_url=None))


def test_unknown_strategy_and_malformed_teacher_entry_are_errors() -> None:
    with pytest.raises(ConfigError, match=r"--opd-top-k-strategy must be one of"):
        miles.config_from_miles_args(_args(opd_log_prob_top_k=2, opd_top_k_strategy="both"))
    with pytest.raises(ConfigError, match=r"Invalid --opd-teacher-urls entry .*expected NAME=URL"):
        miles.config_from_miles_args(_args(opd_teacher_urls=["http://no-name:1"]))


def test_strategy_needing_the_student_without_router_flags_names_them() -> None:
    with pytest.raises(ConfigError, match=r"sglang-router-ip"):
        miles.config_from_miles_args(_args(opd_log_prob_top_k=2, opd_top_k_strategy="union"))


# --- the worked example (docs/semantics.md, "Worked example") -----------------------------
TEACHER, STUDENT = "http://teacher:1", "http://student:2"
S_TOP = [{1: 0.6, 2: 0.4}, {4: 0.7, 5: 0.3}]
T_TOP = [{2: 0.5, 3: 0.5}, {4: 0.8, 6: 0.2}]
T_ON_S = [{1: 0.3, 2: 0.7}, {4: 0.4, 5: 0.6}]
S_ON_T = [{2: 0.4, 3: 0.2}, {4: 0.7, 6: 0.1}]
TOKENS, R = [10, 11, 12], 2


def _triples(table: dict[int, float], ids: list[int] | None = None) -> list[list[Any]]:
    keys = list(table) if ids is None else ids
    return [[math.log(table[i]), i, None] for i in keys]


def _vector_server(method: str, url: str, body: bytes) -> Response:
    """A fake SGLang answering the worked example (P = 1, so entry j is response t = j - 1)."""
    req = json.loads(body)
    ids, start = req["input_ids"], req["logprob_start_len"]
    teacher = url.startswith(TEACHER)
    top_table, id_table = (T_TOP, T_ON_S) if teacher else (None, S_ON_T)
    k = req.get("top_logprobs_num", 0)
    positions, flat = req.get("token_ids_logprob_positions"), req.get("token_ids_logprob")
    tok, top, idl = [], [], []
    for j in range(start, len(ids)):
        tok.append([None if j == 0 else -1.0, ids[j], None])
        if j == 0:
            top.append(None)
            idl.append(None)
            continue
        if k:
            assert top_table is not None
            top.append(_triples(top_table[j - 1]))
        want = positions[j] if positions is not None else flat
        idl.append(_triples(id_table[j - 1], want) if want else None)
    meta: dict[str, Any] = {
        "finish_reason": {"type": "length", "length": 0},
        "input_token_logprobs": tok,
    }
    if k:
        meta["input_top_logprobs"] = top
    if positions is not None or flat is not None:
        meta["input_token_ids_logprobs"] = idl
    return Response(200, json.dumps({"text": "", "meta_info": meta}).encode())


def _xlnx(p: float, q: float) -> float:
    return math.log(p / q)


EXAMPLE_EXPECTED = {
    ("only-student", "student_p"): [
        0.6 * _xlnx(0.6, 0.3) + 0.4 * _xlnx(0.4, 0.7),
        0.7 * _xlnx(0.7, 0.4) + 0.3 * _xlnx(0.3, 0.6),
    ],
    ("intersection", "none"): [_xlnx(0.4, 0.5), _xlnx(0.7, 0.8)],
    ("only-teacher", "student_p"): [
        (2 / 3) * _xlnx(0.4, 0.5) + (1 / 3) * _xlnx(0.2, 0.5),
        (7 / 8) * _xlnx(0.7, 0.8) + (1 / 8) * _xlnx(0.1, 0.2),
    ],
    ("xor", "none"): [_xlnx(0.6, 0.3) + _xlnx(0.2, 0.5), _xlnx(0.3, 0.6) + _xlnx(0.1, 0.2)],
}


@pytest.mark.parametrize(("strategy", "weight_mode"), list(EXAMPLE_EXPECTED))
async def test_reward_func_and_post_process_give_the_worked_example(
    strategy: str, weight_mode: str
) -> None:
    args = _args(
        rm_url=TEACHER + "/generate",
        opd_log_prob_top_k=2,
        opd_top_k_strategy=strategy,
        opd_reward_weight_mode=weight_mode,
        sglang_router_ip="student",
        sglang_router_port=2,
    )
    miles.engine_for(args, transport=MockTransport(_vector_server))
    rows = [[[math.log(p), i, None] for i, p in pos.items()] for pos in S_TOP]
    sample = _MilesSample(TOKENS, R, {"opd_student_top_logprobs": [[], *rows][-R:]})
    try:
        sample.reward = await miles.reward_func(args, sample)
    finally:
        await miles.close()
    raw, processed = miles.post_process_rewards(args, [sample])
    assert raw == processed == [0.0]
    got = sample.opd_reverse_kl  # type: ignore[attr-defined]
    assert got.dtype.is_floating_point and str(got.dtype) == "torch.float32"
    for g, e in zip(got.tolist(), EXAMPLE_EXPECTED[(strategy, weight_mode)], strict=True):
        assert abs(g - e) < 1e-5, (g, e)


# --- mock servers -------------------------------------------------------------------------
def _mock_samples(student: Any, n: int, k: int, seed: int = 0) -> list[_MilesSample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, r = int(rng.integers(2, 9)), int(rng.integers(1, 8))
        tokens = rng.integers(0, 5000, p + r).tolist()
        meta: dict[str, Any] = {}
        if k:
            meta["opd_student_top_logprobs"] = rollout_topk_rows(student, tokens, p, k)
        out.append(_MilesSample(tokens, r, meta))
    return out


@pytest.mark.parametrize(("k", "strategy"), [(0, "only-student"), (3, "union")])
async def test_concurrent_reward_funcs_share_one_stream_and_match_the_reference(
    k: int, strategy: str
) -> None:
    async with serve_mock("teacher", 1, replicas=2) as teacher, serve_mock("student", 1) as student:
        host, port = student.url.removeprefix("http://").rsplit(":", 1)
        args = _args(
            rm_url="|".join(u + "/generate" for u in teacher.urls),
            opd_log_prob_top_k=k,
            opd_top_k_strategy=strategy,
            sglang_router_ip=host,
            sglang_router_port=int(port),
        )
        samples = _mock_samples(student.model, 12, k)
        try:
            rewards = await asyncio.gather(*(miles.reward_func(args, s) for s in samples))
            engine = miles.engine_for(args)
            assert engine.stream is not None
            assert engine.stream.stats().admitted == len(samples)  # one shared run
        finally:
            await miles.close()
        assert engine.stream is None
        for s, reward in zip(samples, rewards, strict=True):
            s.reward = reward
        miles.post_process_rewards(args, samples)
        name = "opd_reverse_kl" if k else "teacher_log_probs"
        for s in samples:
            exp = expected_result(
                tokens=s.tokens,
                response_length=s.response_length,
                teacher=teacher.model,
                student=student.model,
                top_k=k,
                strategy=strategy,
                weight_mode="student_p",
            )
            got = getattr(s, name).tolist()
            want = exp.reverse_kl if k else exp.teacher_logprobs
            assert want is not None and len(got) == s.response_length
            for t, (g, e) in enumerate(zip(got, want, strict=True)):
                assert abs(g - e) <= 1e-5 + 1e-6 * exp.scale[t], (t, g, e)


async def test_a_failed_sample_raises_with_its_reason() -> None:
    args = _args(rm_url="http://teacher:1")

    def refuse(method: str, url: str, body: bytes) -> Response:
        return Response(400, b'{"error": {"message": "bad input"}}')

    miles.engine_for(args, transport=MockTransport(refuse))
    try:
        with pytest.raises(miles.OPDSampleError, match="teacher_http_400") as info:
            await miles.reward_func(args, _MilesSample([1, 2, 3], 1))
    finally:
        await miles.close()
    assert info.value.reason == "teacher_http_400"


def test_post_process_rejects_a_reward_that_is_not_ours() -> None:
    sample = _MilesSample([1, 2], 1)
    sample.reward = {"meta_info": {}}
    with pytest.raises(ValueError, match="not an opd_stream reward_func result"):
        miles.post_process_rewards(_args(), [sample])


# --- issue 14: Miles rollouts as they really are -----------------------------------------
def _short_rows_supported() -> bool:
    """Whether the row parser takes short and empty rows (``_student_topk.parse_student_topk``)."""
    from opd_stream.wire._student_topk import parse_student_topk

    try:
        parse_student_topk([[], [[-0.1, 3], None]], 2, 2)
    except ValueError:
        return False
    return True


needs_short_rows = pytest.mark.skipif(
    not _short_rows_supported(),
    reason="parse_student_topk does not take short/empty rows yet (the _decode.py change)",
)
T1, T2, STU = "http://t-math:1", "http://t-code:1", "http://stu:2"


def _merged_sample(model: Any, seed: int, k: int) -> tuple[_MilesSample, list[list[int]]]:
    """A Miles merged multi-turn sample: observation spans carry empty top-k rows (``[]``),
    loss mask 0 and rollout logprob 0.0; some rows are short or hold ``None`` entries.
    Returns the sample and the ids kept per response position."""
    rng = np.random.default_rng(seed)
    p, r = 3, 12
    tokens = rng.integers(0, 5000, p + r).tolist()
    rows: list[list[Any]] = [
        [[lp, i, None] for lp, i in row] for row in rollout_topk_rows(model, tokens, p, k)
    ]
    rollout = [-0.5] * r
    for t in (3, 4, 5, 9):  # an observation span and a lone observation token
        rows[t] = []
        rollout[t] = 0.0
    rows[6] = rows[6][:1]  # short
    rows[7] = [rows[7][0], None, rows[7][1]]  # a None entry is skipped
    kept = [[int(e[1]) for e in row if e is not None] for row in rows]
    sample = _MilesSample(tokens, r, {"opd_student_top_logprobs": rows, "opd_teacher": "math"})
    sample.rollout_log_probs = rollout  # type: ignore[attr-defined]
    sample.loss_mask = [0 if not row else 1 for row in rows]  # type: ignore[attr-defined]
    return sample, kept


def _merged_reference(
    sample: _MilesSample,
    kept: list[list[int]],
    teacher: Any,
    student: Any,
    k: int,
    strategy: str,
    weight_mode: str,
) -> list[Any]:
    from support.kl_reference import reference_position

    def f32(values: Any) -> list[float]:
        return [float(np.float32(v)) for v in np.asarray(values, dtype=np.float64).ravel()]

    tok = np.asarray(sample.tokens)
    p = len(tok) - sample.response_length
    out = []
    for t, ids in enumerate(kept):
        pos = np.array([p + t])
        s_ids = np.asarray([ids], dtype=np.int64)
        t_ids, t_lp = teacher.topk(tok, pos, k)
        out.append(
            reference_position(
                strategy=strategy,
                weight_mode=weight_mode,
                s_ids=ids,
                s_lp=f32(student.logprobs(tok, pos, s_ids)[0]) if ids else [],
                t_on_s=f32(teacher.logprobs(tok, pos, s_ids)[0]) if ids else [],
                t_ids=[int(x) for x in t_ids[0]],
                t_lp=f32(t_lp[0]),
                s_on_t=f32(student.logprobs(tok, pos, t_ids)[0]),
            )
        )
    return out


def _two_teachers() -> tuple[Any, dict[str, Any]]:
    from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

    servers = {
        T1: InProcessSGLang("teacher", 0),
        T2: InProcessSGLang("teacher", 5),
        STU: InProcessSGLang("student", 1),
    }
    return mock_transport(servers), servers


def _multi_args(**kw: Any) -> Namespace:
    return _args(
        rm_url=None,
        opd_teacher_urls=[f"math={T1}/generate", f"code={T2}/generate"],
        sglang_router_ip="stu",
        sglang_router_port=2,
        **kw,
    )


@needs_short_rows
@pytest.mark.parametrize(
    ("strategy", "weight_mode"),
    [(s, w) for s in STRATEGIES for w in WEIGHT_MODES],
)
async def test_merged_multi_turn_samples_are_scored_like_the_reference(
    strategy: str, weight_mode: str
) -> None:
    k = 3
    transport, servers = _two_teachers()
    args = _multi_args(
        opd_log_prob_top_k=k, opd_top_k_strategy=strategy, opd_reward_weight_mode=weight_mode
    )
    sample, kept = _merged_sample(servers[STU].model, 1, k)
    miles.engine_for(args, transport=transport)
    try:
        sample.reward = await miles.reward_func(args, sample)
    finally:
        await miles.close()
    miles.post_process_rewards(args, [sample])
    got = sample.opd_reverse_kl.tolist()  # type: ignore[attr-defined]
    want = _merged_reference(
        sample, kept, servers[T1].model, servers[STU].model, k, strategy, weight_mode
    )
    for t, ref in enumerate(want):
        assert abs(got[t] - ref.r) <= 1e-5 + 1e-6 * ref.scale, (t, got[t], ref.r)
    if strategy == "only-student":
        assert [got[t] for t in (3, 4, 5, 9)] == [0.0] * 4  # empty rows contribute 0


async def test_rollout_log_probs_are_never_read() -> None:
    """The reference ignores rollout_log_probs (top-k and sampled-token): 0.0 on observation
    spans, values above 0, NaN or a wrong length must not fail the sample."""
    transport, servers = _two_teachers()
    for k in (0, 2):
        args = _multi_args(opd_log_prob_top_k=k)
        model = servers[STU].model
        tokens = [5, 6, 7, 8, 9]
        meta: dict[str, Any] = {"opd_teacher": "code"}
        if k:
            meta["opd_student_top_logprobs"] = rollout_topk_rows(model, tokens, 2, k)
        sample = _MilesSample(tokens, 3, meta)
        miles.engine_for(args, transport=transport)
        try:
            for bad in ([0.0, 0.5, math.nan], [0.0], None):
                sample.rollout_log_probs = bad  # type: ignore[attr-defined]
                result = await miles.reward_func(args, sample)
                name = "opd_reverse_kl" if k else "teacher_log_probs"
                assert result[name].shape == (3,)
                assert result["opd_stream"]["teacher"] == "code"
        finally:
            await miles.close()


def test_opd_stream_variables_are_read_and_the_flags_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPD_STREAM_MAX_INFLIGHT", "7")
    monkeypatch.setenv("OPD_STREAM_ATTEMPT_TIMEOUT_S", "2.5")
    monkeypatch.setenv("OPD_STREAM_TOP_K", "9")  # the flag wins
    monkeypatch.setenv("OPD_STREAM_TEACHERS", "x=http://x:1")  # the flag wins
    monkeypatch.setenv("OPD_STREAM_ID_SCORING", "blocked")
    monkeypatch.setenv("OPD_STREAM_REQUEST_DEADLINE_S", "33")
    cfg = miles.config_from_miles_args(_args(opd_log_prob_top_k=2))
    assert (cfg.max_inflight, cfg.attempt_timeout_s, cfg.top_k) == (7, 2.5, 2)
    assert cfg.teachers == {"default": ("http://t:1",)}
    assert cfg.id_scoring == "blocked"  # no --opd-topk-per-position: the variable
    assert cfg.request_deadline_s == 33.0  # no router timeout flag: the variable
    cfg = miles.config_from_miles_args(
        _args(opd_topk_per_position=True, sglang_router_request_timeout_secs=5)
    )
    assert (cfg.id_scoring, cfg.request_deadline_s) == ("per-position", 5.0)
    # An explicit environment replaces os.environ.
    cfg = miles.config_from_miles_args(_args(), environ={})
    assert cfg.max_inflight != 7


def test_an_invalid_variable_is_a_value_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPD_STREAM_MAX_INFLIGHT", "many")
    with pytest.raises(ValueError, match="OPD_STREAM_MAX_INFLIGHT"):
        miles.config_from_miles_args(_args())
    monkeypatch.delenv("OPD_STREAM_MAX_INFLIGHT")
    monkeypatch.setenv("OPD_STREAM_MAX_INFLIGH", "3")
    with pytest.raises(ValueError, match="OPD_STREAM_MAX_INFLIGH"):
        miles.config_from_miles_args(_args())


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (
            {"opd_teacher_urls": ["math"]},
            "Invalid --opd-teacher-urls entry 'math'; expected NAME=URL.",
        ),
        (
            {"opd_teacher_urls": ["a=http://a:1", "a=http://b:1"]},
            "Duplicate teacher name 'a' in --opd-teacher-urls.",
        ),
        (
            {"opd_log_prob_top_k": 2, "opd_top_k_strategy": "both"},
            "Unknown OPD top-k strategy: both",
        ),
        ({"opd_reward_weight_mode": "p"}, "Unknown OPD reward weight mode: p"),
        (
            {"opd_type": "megatron", "opd_teacher_urls": ["a=http://a:1"]},
            "--opd-teacher-urls is only supported with --opd-type=sglang",
        ),
    ],
)
def test_bad_teacher_configuration_is_a_value_error_in_the_reference_words(
    kw: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValueError) as info:
        miles.config_from_miles_args(_args(**kw))
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        ({}, "Sample metadata is missing teacher key 'opd_teacher' and no 'default' teacher"),
        (
            {"opd_teacher": "bio"},
            "Sample metadata['opd_teacher']='bio' matches no teacher name configured by "
            "--opd-teacher-urls (known: ['code', 'math']) and no 'default' entry",
        ),
    ],
)
async def test_missing_or_unknown_teacher_key_is_a_value_error(
    metadata: dict[str, Any], words: str
) -> None:
    transport, _ = _two_teachers()
    args = _multi_args()
    miles.engine_for(args, transport=transport)
    try:
        with pytest.raises(miles.MilesRoutingError) as info:
            await miles.reward_func(args, _MilesSample([1, 2, 3], 1, metadata))
    finally:
        await miles.close()
    assert isinstance(info.value, ValueError) and isinstance(info.value, miles.OPDSampleError)
    assert words in str(info.value)
    assert info.value.reason == "routing"


async def test_a_default_teacher_catches_unknown_and_missing_keys() -> None:
    transport, _ = _two_teachers()
    args = _args(rm_url=None, opd_teacher_urls=[f"math={T1}", f"default={T2}"])
    miles.engine_for(args, transport=transport)
    try:
        for meta in ({}, {"opd_teacher": "bio"}, {"opd_teacher": "math"}):
            reward = await miles.reward_func(args, _MilesSample([1, 2, 3], 1, meta))
            want = "math" if meta.get("opd_teacher") == "math" else "default"
            assert reward["opd_stream"]["teacher"] == want
    finally:
        await miles.close()


async def test_a_deadline_is_a_timeout_error() -> None:
    import anyio

    async def hang(method: str, url: str, body: bytes) -> Response:
        await anyio.sleep(3600)
        raise AssertionError("unreachable")

    args = _args(rm_url="http://teacher:1", sglang_router_request_timeout_secs=0.05)
    miles.engine_for(args, transport=MockTransport(hang))
    try:
        with pytest.raises(miles.MilesTimeoutError) as info:
            await miles.reward_func(args, _MilesSample([1, 2, 3], 1))
    finally:
        await miles.close()
    assert isinstance(info.value, TimeoutError)
    assert info.value.reason == "deadline_exceeded"


async def test_an_invalid_sample_is_a_value_error_and_http_errors_are_not() -> None:
    transport, _ = _two_teachers()
    args = _args(rm_url=T1)
    miles.engine_for(args, transport=transport)
    try:
        with pytest.raises(miles.MilesInvalidSampleError) as info:
            await miles.reward_func(args, _MilesSample([1, -2, 3], 1))
    finally:
        await miles.close()
    assert isinstance(info.value, ValueError) and info.value.reason == "invalid_sample"
    failure = SampleFailure(
        sample=Sample([1], 0), index=0, reason="teacher_http_503", message="x", attempts=4
    )
    err = miles.sample_error(failure)
    assert type(err) is miles.OPDSampleError and not isinstance(err, ValueError | TimeoutError)


# --- a teacher prompt of its own (issue 18) --------------------------------------------------
@pytest.mark.parametrize(("k", "strategy"), [(0, "only-student"), (3, "union")])
async def test_the_teacher_prompt_metadata_key_gives_the_teacher_its_own_context(
    k: int, strategy: str
) -> None:
    from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

    servers = {TEACHER: InProcessSGLang("teacher", 1), STUDENT: InProcessSGLang("student", 1)}
    args = _args(
        rm_url=TEACHER,
        opd_log_prob_top_k=k,
        opd_top_k_strategy=strategy,
        sglang_router_ip="student",
        sglang_router_port=2,
    )
    rng = np.random.default_rng(18)
    samples = _mock_samples(servers[STUDENT].model, 6, k)
    prompts = [rng.integers(0, 3000, int(rng.integers(1, 12))).tolist() for _ in samples]
    for s, prompt in zip(samples, prompts, strict=True):
        s.metadata[miles.TEACHER_PROMPT_KEY] = prompt
    miles.engine_for(args, transport=mock_transport(servers))
    try:
        rewards = await asyncio.gather(*(miles.reward_func(args, s) for s in samples))
        bad_prompt = r"invalid_sample.*teacher_prompt_ids: empty"
        with pytest.raises(miles.MilesInvalidSampleError, match=bad_prompt):
            bad = _MilesSample([1, 2, 3], 1, {miles.TEACHER_PROMPT_KEY: []})
            await miles.reward_func(args, bad)
    finally:
        await miles.close()
    for s, reward in zip(samples, rewards, strict=True):
        s.reward = reward
    miles.post_process_rewards(args, samples)
    name = "opd_reverse_kl" if k else "teacher_log_probs"
    for s, prompt in zip(samples, prompts, strict=True):
        exp = expected_result(
            tokens=s.tokens,
            response_length=s.response_length,
            teacher=servers[TEACHER].model,
            student=servers[STUDENT].model,
            top_k=k,
            strategy=strategy,
            weight_mode="student_p",
            teacher_prompt=prompt,
        )
        got = getattr(s, name).tolist()
        want = exp.reverse_kl if k else exp.teacher_logprobs
        assert want is not None and len(got) == s.response_length
        for t, (g, e) in enumerate(zip(got, want, strict=True)):
            assert abs(g - e) <= 1e-5 + 1e-6 * exp.scale[t], (t, g, e)
    assert miles.TEACHER_PROMPT_KEY == "opd_teacher_prompt_ids"
