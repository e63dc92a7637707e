"""One sample, one set of weights per side: every answer a side gives for a sample (the items
of a blocked answer, the blocks sent as separate requests, the student's several requests)
must report the same ``meta_info.weight_version``; otherwise the side is asked once more,
then the sample fails with ``weight_version_changed``.

Weight updates are scripted with the mock's ``weight_versions`` (item ``n`` a server answers
reports ``weight_versions[min(n, len - 1)]``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest
from support.config import FAST_BACKOFF, stream_config
from support.pipeline_reference import assert_matches, expected_result

from opd_stream import (
    OPDStream,
    ProtocolError,
    Sample,
    SampleFailure,
    ScoredSample,
    StreamConfig,
    WeightVersionChanged,
)
from opd_stream.fetch._fetcher import same_weights
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.wire._codec import PARSERS, decode_block_answers, decode_score_response
from opd_stream.wire._payloads import build_block_payloads, build_score_payload
from opd_stream.wire._request import ScoreRequest

T = "http://teacher:1"
ST = "http://student:2"
K = 3
P, R = 6, 5


_cfg = partial(stream_config, T, **FAST_BACKOFF, top_k=K)


def _tokens(seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 3000, P + R).tolist()


def _with_student_topk(student: InProcessSGLang, tokens: list[int]) -> Sample:
    """A sample carrying the student's own top-k rows (from the student model)."""
    ids, lps = student.model.topk_in(
        student.model.head_rows(np.asarray(tokens), np.arange(P, P + R)), K
    )
    rows = [[[float(lp), int(i)] for lp, i in zip(lps[t], ids[t], strict=True)] for t in range(R)]
    return Sample(tokens, R, student_top_logprobs=rows)


def _blocked_request(id_form: Any = "blocked") -> ScoreRequest:
    ids = np.arange(R * 2, dtype=np.int64).reshape(R, 2) + 10
    return ScoreRequest(
        tokens=np.asarray(_tokens(), dtype=np.int64),
        response_length=R,
        ids=ids,
        id_form=id_form,
        block_size=2,
    )


# -- the decoders ---------------------------------------------------------------------------


@pytest.mark.parametrize("parser", PARSERS)
def test_items_of_one_blocked_answer_with_different_versions_are_refused(parser: Any) -> None:
    server = InProcessSGLang("teacher", 1, weight_versions=("v1", "v2"))
    req = _blocked_request()
    body = server.handle("POST", "/generate", build_score_payload(req)).body
    with pytest.raises(WeightVersionChanged) as info:
        decode_score_response(body, req, parser=parser)
    assert info.value.reason == "weight_version_changed"
    assert info.value.versions == ("v1", "v2")
    assert isinstance(info.value, ProtocolError) and not info.value.retryable


@pytest.mark.parametrize("parser", PARSERS)
def test_blocks_sent_as_separate_requests_with_different_versions_are_refused(
    parser: Any,
) -> None:
    server = InProcessSGLang("teacher", 1, weight_versions=("v1", "v1", "v2"))
    req = _blocked_request("blocks")
    bodies = [server.handle("POST", "/generate", b).body for b in build_block_payloads(req)]
    assert len(bodies) == 3
    with pytest.raises(WeightVersionChanged, match="'v1', 'v2'"):
        decode_block_answers(bodies, req, parser=parser)


@pytest.mark.parametrize("parser", PARSERS)
def test_one_version_across_items_is_the_answers_version(parser: Any) -> None:
    server = InProcessSGLang("teacher", 1, weight_versions=("v7",))
    req = _blocked_request()
    body = server.handle("POST", "/generate", build_score_payload(req)).body
    assert decode_score_response(body, req, parser=parser).weight_version == "v7"


def test_the_students_requests_are_compared_with_each_other() -> None:
    server = InProcessSGLang("student", 1, weight_versions=("s1", "s2"))
    req = ScoreRequest(tokens=np.asarray(_tokens(), dtype=np.int64), response_length=R)
    first = decode_score_response(
        server.handle("POST", "/generate", build_score_payload(req)).body, req
    )
    again = decode_score_response(
        server.handle("POST", "/generate", build_score_payload(req)).body, req
    )
    same_weights((again, again), "student")  # one version: nothing to say
    with pytest.raises(WeightVersionChanged) as info:
        same_weights((first, again), "student")
    assert info.value.side == "student" and info.value.versions == ("s1", "s2")


# -- the pipeline ---------------------------------------------------------------------------


async def _run(
    cfg: StreamConfig, servers: dict[str, InProcessSGLang], samples: list[Sample]
) -> list[Any]:
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            return [r async for r in results]


def _expected(sample: Sample, servers: dict[str, InProcessSGLang], strategy: str) -> Any:
    return expected_result(
        tokens=list(sample.tokens),
        response_length=R,
        teacher=servers[T].model,
        student=servers[ST].model,
        top_k=K,
        strategy=strategy,
        weight_mode="student_p",
    )


@pytest.mark.parametrize("id_scoring", ["blocked", "blocks"])
async def test_a_teacher_update_within_a_sample_is_retried_once_and_the_sample_scores(
    id_scoring: str,
) -> None:
    # first answer: its first item v1, the rest v2; the second pass sees v2 only
    servers = {
        T: InProcessSGLang("teacher", 1, weight_versions=("v1", "v2")),
        ST: InProcessSGLang("student", 1),
    }
    sample = _with_student_topk(servers[ST], _tokens(3))
    cfg = _cfg(id_scoring=id_scoring, id_block_size=2)
    (res,) = await _run(cfg, servers, [sample])
    assert isinstance(res, ScoredSample), res
    assert_matches(res, _expected(sample, servers, "only-student"))
    blocks = 3 if id_scoring == "blocks" else 1
    assert servers[T].requests == 2 * blocks
    assert res.attempts == 2


async def test_a_teacher_whose_versions_keep_changing_fails_the_sample() -> None:
    servers = {
        T: InProcessSGLang("teacher", 1, weight_versions=("a", "b") * 8),
        ST: InProcessSGLang("student", 1),
    }
    sample = _with_student_topk(servers[ST], _tokens(4))
    (res,) = await _run(_cfg(id_scoring="blocked", id_block_size=2), servers, [sample])
    assert isinstance(res, SampleFailure)
    assert res.reason == "weight_version_changed"
    assert res.message.startswith("teacher: ") and "'a'" in res.message and "'b'" in res.message
    assert servers[T].requests == 2  # one retry of the side, no attempt-level retries


async def test_a_student_update_between_its_requests_retries_the_student_side() -> None:
    # union without the rollout's top-k: student top-k -> teacher scores S (+ its top-k)
    # -> student scores T. The student's two answers report s1 then s2.
    servers = {
        T: InProcessSGLang("teacher", 1),
        ST: InProcessSGLang("student", 1, weight_versions=("s1", "s2")),
    }
    sample = Sample(_tokens(5), R)
    cfg = _cfg(student_url=ST, strategy="union", id_scoring="per-position")
    (res,) = await _run(cfg, servers, [sample])
    assert isinstance(res, ScoredSample), res
    assert_matches(res, _expected(sample, servers, "union"))
    assert servers[ST].requests == 4  # both student requests, twice
    # the teacher scored the first pass's student ids: asked again too
    assert servers[T].requests == 2


async def test_a_student_update_keeps_a_teacher_answer_that_did_not_use_the_students_ids() -> None:
    # only-teacher without the rollout's top-k needs one student request per pass; the
    # student's answer items disagree in the blocked form
    servers = {
        T: InProcessSGLang("teacher", 1),
        ST: InProcessSGLang("student", 1, weight_versions=("s1", "s2")),
    }
    sample = Sample(_tokens(6), R)
    cfg = _cfg(student_url=ST, strategy="only-teacher", id_scoring="blocked", id_block_size=2)
    (res,) = await _run(cfg, servers, [sample])
    assert isinstance(res, ScoredSample), res
    assert_matches(res, _expected(sample, servers, "only-teacher"))
    assert servers[T].requests == 1
    assert servers[ST].requests == 2


async def test_a_student_whose_versions_keep_changing_fails_the_sample() -> None:
    servers = {
        T: InProcessSGLang("teacher", 1),
        ST: InProcessSGLang("student", 1, weight_versions=("s1", "s2", "s3", "s4", "s5")),
    }
    cfg = _cfg(student_url=ST, strategy="union", id_scoring="per-position")
    (res,) = await _run(cfg, servers, [Sample(_tokens(7), R)])
    assert isinstance(res, SampleFailure)
    assert res.reason == "weight_version_changed"
    assert "student" in res.message and "'s3', 's4'" in res.message


# -- the aiohttp mock server ----------------------------------------------------------------


async def test_over_http_a_scripted_weight_update_is_retried_and_scored() -> None:
    from support.threaded_mock import serve_mock_threaded

    from opd_stream.testing.mock_sglang import MockOptions

    options = MockOptions(weight_versions=("v1", "v2"))
    async with serve_mock_threaded("teacher", 1, options=options) as teacher:
        student = InProcessSGLang("student", 1)
        sample = _with_student_topk(student, _tokens(8))
        cfg = _cfg(teachers=teacher.url, id_scoring="blocked", id_block_size=2)
        async with OPDStream(cfg) as stream:
            async with stream.run([sample]) as results:
                (res,) = [r async for r in results]
        assert isinstance(res, ScoredSample), res
        assert res.attempts == 2
        assert teacher.stats[0].generate_requests == 2


def test_the_mock_command_line_takes_the_signal_options() -> None:
    from opd_stream.testing.mock_sglang.__main__ import build_parser

    args = build_parser().parse_args(
        ["--weight-versions", "v1,v2", "--logprob-offset", "-0.5", "--warm-drift", "0.2"]
    )
    assert args.weight_versions == ("v1", "v2")
    assert (args.logprob_offset, args.warm_drift) == (-0.5, 0.2)
    assert build_parser().parse_args([]).weight_versions == ()


# -- an ensemble: the rule holds per member --------------------------------------------------

M1, M2 = "http://m1:1", "http://m2:1"
ENSEMBLE = f"0.4*{M1};0.6*{M2}"


def _ensemble_servers(v1: tuple[str, ...], v2: tuple[str, ...]) -> dict[str, InProcessSGLang]:
    return {
        M1: InProcessSGLang("teacher", 3, weight_versions=v1),
        M2: InProcessSGLang("teacher", 5, weight_versions=v2),
        ST: InProcessSGLang("student", 1),
    }


def _mixture_expected(sample: Sample, servers: dict[str, InProcessSGLang], strategy: str) -> Any:
    from support.pipeline_reference import MixtureTeacher

    return expected_result(
        tokens=list(sample.tokens),
        response_length=R,
        teacher=MixtureTeacher([servers[M1].model, servers[M2].model], [0.4, 0.6]),
        student=servers[ST].model,
        top_k=K,
        strategy=strategy,
        weight_mode="student_p",
    )


def test_a_members_weight_version_error_names_the_member() -> None:
    import pickle

    from opd_stream.fetch._mixture import member_error

    exc = WeightVersionChanged(("a", "b"), where="the items of one answer")
    named = member_error(exc, "member 2 of 3 (http://b:1)")
    assert isinstance(named, WeightVersionChanged) and named.reason == exc.reason
    assert named.member == "member 2 of 3 (http://b:1)" and exc.member is None
    assert str(named) == (
        "ensemble member 2 of 3 (http://b:1): teacher: the items of one answer report "
        "different meta_info.weight_version values ('a', 'b')"
    )
    assert str(pickle.loads(pickle.dumps(named))) == str(named)  # back from a decode worker


@pytest.mark.parametrize("strategy", ["only-teacher", "union"])
async def test_an_ensemble_member_updated_between_its_two_requests_is_asked_again(
    strategy: str,
) -> None:
    # member 1 answers its top-k from weights a1, then the union's ids from a2; member 2
    # reports b7 throughout (members may differ from each other: the rule is per member)
    servers = _ensemble_servers(("a1", "a2"), ("b7",))
    sample = (
        _with_student_topk(servers[ST], _tokens(9))
        if strategy == "union"
        else Sample(_tokens(9), R)
    )
    cfg = _cfg(teachers=ENSEMBLE, student_url=ST, strategy=strategy, id_scoring="per-position")
    (res,) = await _run(cfg, servers, [sample])
    assert isinstance(res, ScoredSample), res
    assert_matches(res, _mixture_expected(sample, servers, strategy), teacher_rtol=1e-6)
    # the whole teacher side asked again: two requests per member per pass
    assert servers[M1].requests == servers[M2].requests == 4
    assert servers[ST].requests == 1  # it scores T's ids, after the teacher's second pass
    assert res.attempts == 9


async def test_an_ensemble_member_whose_versions_keep_changing_fails_the_sample_named() -> None:
    servers = _ensemble_servers(("a", "b", "c", "d"), ("b7",))
    cfg = _cfg(teachers=ENSEMBLE, student_url=ST, strategy="only-teacher")
    (res,) = await _run(cfg, servers, [Sample(_tokens(10), R)])
    assert isinstance(res, SampleFailure), res
    assert res.reason == "weight_version_changed"
    assert res.message == (
        f"ensemble member 1 of 2 ({M1}): teacher: the requests for one sample report "
        "different meta_info.weight_version values ('c', 'd')"
    )
    assert servers[M1].requests == servers[M2].requests == 4
    assert servers[ST].requests == 0


async def test_a_weight_update_within_one_members_answer_names_the_member() -> None:
    # the items of member 2's blocked answer disagree, on both passes
    servers = _ensemble_servers(("a1",), ("x", "y") * 8)
    sample = _with_student_topk(servers[ST], _tokens(11))
    cfg = _cfg(teachers=ENSEMBLE, id_scoring="blocked", id_block_size=2)
    (res,) = await _run(cfg, servers, [sample])
    assert isinstance(res, SampleFailure), res
    assert res.reason == "weight_version_changed"
    assert res.message.startswith(f"ensemble member 2 of 2 ({M2}): teacher: the items of one")
    assert "'x'" in res.message and "'y'" in res.message
