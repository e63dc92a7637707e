"""Teachers with another tokenizer, end to end, on both backends: small trained tokenizers
served by the mock with a model over bytes (:class:`ByteModel`), so every expected value is
computable from the text alone. The real tokenizer files (a Qwen 3.5 student, DeepSeek V3
and GLM 4.7 teachers): ``test_xtok_stream_real.py``."""

from __future__ import annotations

import math
import unicodedata
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from support.config import stream_config
from support.xtok_stream import PROMPT, RESPONSES, T, byte_reference, config, make_sample, run
from support.xtok_vocabs import SPECIAL, small_vocab, write_small

from opd_stream import ConfigError, OPDStream, Sample, SampleFailure, ScoredSample, StreamConfig
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.testing.mock_sglang import ByteModel
from opd_stream.xtok._vocab import Vocab

# ---------------------------------------------------------------- small tokenizers, any backend


@pytest.fixture
def small_paths(tmp_path: Path) -> tuple[str, str]:
    return write_small(tmp_path, "a"), write_small(tmp_path, "b")


async def test_without_return_alignment_results_have_none(small_paths: tuple[str, str]) -> None:
    a, b = small_vocab("a"), small_vocab("b")
    model = ByteModel(b.token_bytes)
    sample = make_sample(a, b, ByteModel(a.token_bytes), a.encode("quick fox"), 0)
    server = InProcessSGLang("teacher", 1, byte_model=model)
    (res,) = await run(config(*small_paths, return_alignment=False), server, [sample])
    assert isinstance(res, ScoredSample) and res.alignment is None
    assert float(res.reverse_kl.abs().max()) < 1e-5  # type: ignore[union-attr]


async def test_sampled_token_mode_sets_signal_the_reverse_kl(small_paths: tuple[str, str]) -> None:
    """``signal`` is ``reverse_kl`` (the same tensor) under the default divergence, with a
    teacher of another tokenizer too; its values are the byte reference's."""
    a, b = small_vocab("a"), small_vocab("b")
    s_model, t_model = ByteModel(a.token_bytes), ByteModel(b.token_bytes, q=0.7)
    texts = ["the quick brown fox", "jumps over"]
    samples = [make_sample(a, b, s_model, a.encode(t), i) for i, t in enumerate(texts)]
    server = InProcessSGLang("teacher", 1, byte_model=t_model)
    out = await run(config(*small_paths), server, samples)
    for text, res in zip(texts, out, strict=True):
        assert isinstance(res, ScoredSample), res
        assert res.divergence == "reverse_kl"
        assert res.signal is not None and res.signal is res.reverse_kl
        al = res.alignment
        assert al is not None
        ref = byte_reference(
            PROMPT.encode(), text.encode(), al.span_bytes.tolist(), s_model, t_model
        )
        expected = np.zeros(res.sample.response_length)
        for j, value in enumerate(ref):
            if al.scored[j]:
                expected[int(al.student_spans[j + 1]) - 1] = value
        assert float(np.abs(expected).max()) > 0.1
        np.testing.assert_allclose(res.signal.numpy(), expected, rtol=0, atol=2e-4)


@pytest.mark.parametrize("top_k", [0, 4])
async def test_an_empty_response_has_the_empty_alignment(
    small_paths: tuple[str, str], top_k: int
) -> None:
    from opd_stream.xtok._align import align_response

    a, b = small_vocab("a"), small_vocab("b")
    empty = make_sample(a, b, ByteModel(a.token_bytes), np.zeros(0, np.int64), 0)
    assert empty.response_length == 0
    server = InProcessSGLang("teacher", 1, byte_model=ByteModel(b.token_bytes))
    cfg = config(*small_paths, top_k=top_k)
    (res,) = await run(cfg, server, [msgspec.structs.replace(empty, student_top_logprobs=[])])
    assert isinstance(res, ScoredSample), res
    al = res.alignment
    assert al is not None
    # what the alignment of no tokens is: no teacher ids, no spans (one boundary, 0)
    want = align_response(a, b, np.zeros(0, np.int64), "default")
    for name in ("teacher_ids", "student_spans", "teacher_spans", "span_bytes", "scored"):
        got = getattr(al, name)
        assert got.tolist() == getattr(want, name).tolist(), name
        assert got.dtype == torch.from_numpy(np.asarray(getattr(want, name))).dtype, name
    assert al.teacher_token_logprobs.shape == (0,)
    assert al.teacher_token_logprobs.dtype == torch.float32
    assert res.signal is not None and res.signal.shape == (0,)
    assert server.requests == 0


async def test_every_bad_input_fails_alone_with_its_reason(
    small_paths: tuple[str, str], tmp_path: Path
) -> None:
    a, b = small_vocab("a"), small_vocab("b")
    s_model, t_model = ByteModel(a.token_bytes), ByteModel(b.token_bytes, q=0.7)
    good = make_sample(a, b, s_model, a.encode("the quick brown fox"), 0)
    end = a.tokenizer.token_to_id(SPECIAL)
    only_special = make_sample(a, b, s_model, np.array([end, end]), 0)
    byte_id = {v: i for i, v in enumerate(a.token_bytes) if len(v) == 1}
    samples: list[Any] = [
        good,
        Sample(tokens=[1, 2, a.size + 5], response_length=1, teacher_prompt_ids=[1]),
        Sample(tokens=[1, 2, 3], response_length=1),  # no teacher prompt
        Sample(  # not UTF-8
            tokens=[1, byte_id[b"a"], byte_id[b"\xff"], byte_id[b"b"]],
            response_length=3,
            teacher_prompt_ids=[1],
        ),
        only_special,
        good,
    ]
    server = InProcessSGLang("teacher", 1, byte_model=t_model)
    out = await run(config(*small_paths), server, samples)
    assert [type(r).__name__ for r in out] == [
        "ScoredSample",
        "SampleFailure",
        "SampleFailure",
        "SampleFailure",
        "ScoredSample",
        "ScoredSample",
    ]
    assert "outside the student tokenizer's vocabulary" in out[1].message
    assert out[2].message.startswith("teacher_prompt_ids: required: teacher 'default' has its")
    assert "not UTF-8 text at byte 1" in out[3].message
    assert all(r.reason == "invalid_sample" for r in out[1:4])
    assert out[1].attempts == out[2].attempts == out[3].attempts == 0
    # a response of textless tokens only: nothing asked, zeros
    assert out[4].attempts == 0 and out[4].reverse_kl.tolist() == [0.0, 0.0]
    assert torch.equal(out[0].reverse_kl, out[5].reverse_kl)
    assert server.requests == 2


async def test_text_the_teacher_tokenizer_cannot_round_trip_fails_alone(tmp_path: Path) -> None:
    import json

    from support.xtok_vocabs import small_json

    data = json.loads(small_json("b"))
    data["normalizer"] = {"type": "NFC"}
    (tmp_path / "nfc").mkdir()
    (tmp_path / "nfc" / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    a, b = small_vocab("a"), small_vocab("b")
    s_model = ByteModel(a.token_bytes)
    nfd = make_sample(a, b, s_model, a.encode(unicodedata.normalize("NFD", "café")), 0)
    ok = make_sample(a, b, s_model, a.encode("cafe"), 1)
    server = InProcessSGLang("teacher", 1, byte_model=ByteModel(b.token_bytes))
    cfg = config(write_small(tmp_path, "a"), str(tmp_path / "nfc"))
    bad, fine = await run(cfg, server, [nfd, ok])
    assert isinstance(bad, SampleFailure) and bad.reason == "invalid_sample"
    assert "does not round-trip the response text" in bad.message
    assert isinstance(fine, ScoredSample)


# ---------------------------------------------------------------- configuration


def test_teacher_tokenizers_need_the_student_tokenizer(small_paths: tuple[str, str]) -> None:
    with pytest.raises(
        ConfigError,
        match=r"teacher_tokenizers, student_tokenizer: .*set "
        r"student_tokenizer",
    ):
        config(*small_paths, student_tokenizer=None)


def test_teacher_tokenizers_name_configured_teachers(small_paths: tuple[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"names no configured teacher: 'other'"):
        config(small_paths[0], small_paths[1], teacher_tokenizers={"other": small_paths[1]})


def test_an_ensemble_teacher_takes_no_tokenizer_of_its_own(small_paths: tuple[str, str]) -> None:
    mix = {"default": "0.5*http://127.0.0.1:1;0.5*http://127.0.0.1:2"}
    with pytest.raises(ConfigError, match=r"teachers: 'default' is an ensemble"):
        config(*small_paths, teachers=mix)


def test_a_missing_tokenizer_file_from_the_environment_names_variable_and_path() -> None:
    env = {"OPD_STREAM_TEACHERS": T, "OPD_STREAM_STUDENT_TOKENIZER": "/nonexistent/qwen"}
    with pytest.raises(
        ConfigError,
        match=r"student_tokenizer \(from OPD_STREAM_STUDENT_TOKENIZER"
        r"\): tokenizer file not found: /nonexistent/qwen",
    ):
        StreamConfig.from_env(env)


def test_teacher_tokenizers_parse_from_the_environment(small_paths: tuple[str, str]) -> None:
    a, b = small_paths
    env = {
        "OPD_STREAM_TEACHERS": f"big={T},small=http://small:2",
        "OPD_STREAM_STUDENT_TOKENIZER": a,
        "OPD_STREAM_TEACHER_TOKENIZERS": f"big={b}",
        "OPD_STREAM_RETURN_ALIGNMENT": "1",
    }
    cfg = StreamConfig.from_env(env)
    assert cfg.teacher_tokenizers == {"big": b} and cfg.student_tokenizer == a
    assert cfg.return_alignment is True


async def test_an_unreadable_tokenizer_file_fails_the_stream_start(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{oops", encoding="utf-8")
    cfg = config(write_small(tmp_path, "a"), str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match=r"teacher_tokenizers\[default\]: .*bad.*not a readable"):
        async with OPDStream(cfg, transport=mock_transport({})):
            pass


async def test_a_teacher_without_a_tokenizer_of_its_own_is_scored_as_before(
    small_paths: tuple[str, str],
) -> None:
    """One stream, two teachers: "x" has its own tokenizer, "same" shares the student's;
    the second's results equal a stream without any tokenizer setting. Long responses
    (aligned in a decode thread) and short ones, in one KL batch."""
    a, b = small_vocab("a"), small_vocab("b")
    s_model = ByteModel(a.token_bytes, q=0.5)
    urls = {"x": "http://x:1", "same": "http://same:2"}
    servers = {
        urls["x"]: InProcessSGLang("teacher", 1, byte_model=ByteModel(b.token_bytes, q=0.6)),
        urls["same"]: InProcessSGLang("teacher", 1, byte_model=ByteModel(a.token_bytes, q=0.6)),
    }
    samples = []
    for i, text in enumerate(RESPONSES * 2):
        long_text = text * (40 if i % 3 == 0 else 1)  # >= 256 tokens: aligned in a thread
        for name in ("x", "same"):
            sample = make_sample(a, b, s_model, a.encode(long_text), len(samples))
            sample = msgspec.structs.replace(sample, metadata={"opd_teacher": name})
            if name == "same":  # it sees the student's tokens, as today
                sample = msgspec.structs.replace(sample, teacher_prompt_ids=None)
            samples.append(sample)
    assert max(s.response_length for s in samples) >= 256
    cfg = config(*small_paths, teachers=urls, teacher_tokenizers={"x": small_paths[1]})
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            mixed = sorted([r async for r in results], key=lambda r: r.index)
    plain_cfg = stream_config(T)
    plain = await run(plain_cfg, servers[urls["same"]], samples[1::2])
    for res in mixed:
        assert isinstance(res, ScoredSample), res
        if res.teacher == "x":
            assert res.alignment is not None
            ref = byte_reference(
                PROMPT.encode(),
                a.join(np.asarray(res.sample.tokens)[-res.sample.response_length :]),
                res.alignment.span_bytes.tolist(),
                s_model,
                servers[urls["x"]].byte_model,  # type: ignore[arg-type]
            )
            ends = res.alignment.student_spans[1:] - 1
            assert res.reverse_kl is not None
            np.testing.assert_allclose(res.reverse_kl[ends].numpy(), ref, rtol=0, atol=2e-4)
    for res, ref_res in zip(mixed[1::2], plain, strict=True):
        assert res.teacher == "same" and res.alignment is None
        assert torch.equal(res.teacher_logprobs, ref_res.teacher_logprobs)
        assert torch.equal(res.reverse_kl, ref_res.reverse_kl)


# ---------------------------------------------------------------- top-k: only-student


def reference_topk(
    student: Vocab,
    teacher: Vocab,
    model: Any,
    t_tokens: np.ndarray,
    t_prompt: int,
    spans: tuple[list[int], list[int], list[bool]],
    s_ids: np.ndarray,
    s_lps: np.ndarray,
    tail: bool = False,
) -> list[float]:
    """float64, per student row: student_p-weighted log-ratio over the candidates kept (a
    one-to-one span, a teacher token of the same bytes), 0 elsewhere; with ``tail`` the
    reverse KL over the kept candidates + one outcome holding the rest of the mass."""
    s_sp, t_sp, scored = spans
    r = s_ids.shape[0]
    out = [0.0] * r
    for j in range(len(scored)):
        if not (scored[j] and s_sp[j + 1] - s_sp[j] == 1 and t_sp[j + 1] - t_sp[j] == 1):
            continue
        s, u = s_sp[j], t_sp[j]
        pairs, seen = [], set()
        for v, lp in zip(s_ids[s].tolist(), s_lps[s].tolist(), strict=True):
            if v < 0 or not student.token_bytes[v]:
                continue
            spelled = student.token_bytes[v]
            twins = [w for w in range(teacher.size) if teacher.token_bytes[w] == spelled]
            if not twins or twins[0] in seen:
                continue
            seen.add(twins[0])
            t_lp = float(np.float32(model.logprobs(t_tokens, [t_prompt + u], [[twins[0]]])[0, 0]))
            pairs.append((float(np.float32(lp)), t_lp))
        if pairs and tail:
            # each model's mass outside the kept candidates (at least 1e-6, as documented)
            s_tail = 1 - min(math.fsum(math.exp(a) for a, _ in pairs), 1 - 1e-6)
            t_tail = 1 - min(math.fsum(math.exp(b) for _, b in pairs), 1 - 1e-6)
            out[s] = math.fsum(math.exp(a) * (a - b) for a, b in pairs) + s_tail * (
                math.log(s_tail) - math.log(t_tail)
            )
        elif pairs:
            z = math.fsum(math.exp(a) for a, _ in pairs)
            out[s] = math.fsum(math.exp(a) / z * (a - b) for a, b in pairs)
    return out


@pytest.mark.parametrize("tail", [False, True], ids=["normalised", "tail"])
async def test_only_student_top_k_asks_the_candidates_by_their_bytes(
    small_paths: tuple[str, str], tail: bool
) -> None:
    a, b = small_vocab("a"), small_vocab("b")
    k = 6
    s_model = ByteModel(a.token_bytes, q=0.5)
    server = InProcessSGLang("teacher", 1, byte_model=ByteModel(b.token_bytes, q=0.6))
    rng = np.random.default_rng(7)
    end = a.tokenizer.token_to_id(SPECIAL)
    samples = []
    for i, text in enumerate(RESPONSES):
        sample = make_sample(a, b, s_model, np.append(a.encode(text), end), i)
        r = sample.response_length
        rows = []
        for t, sampled in enumerate(np.asarray(sample.tokens)[-r:].tolist()):
            others = [v for v in range(a.size) if v not in (sampled, end)]
            row = [sampled, *rng.choice(others, k - 1, replace=False).tolist()]
            if t % 3 == 0 and sampled != end:
                row[1] = end  # a textless candidate: never kept
            if t % 4 == 1:
                row[-2:] = [-1, -1]  # a short row
            rows.append(row)
        ids = np.array(rows, dtype=np.int64)
        probs = 0.9 * rng.dirichlet(np.ones(k), r)  # a top-k holds part of the mass
        lps = np.log(np.sort(probs, axis=1)[:, ::-1]).astype(np.float32)
        samples.append(msgspec.structs.replace(sample, student_top_logprobs=(ids, lps)))
    cfg = config(*small_paths, top_k=k, tail=tail)
    out = await run(cfg, server, samples)
    kept_total = 0
    for res in out:
        assert isinstance(res, ScoredSample), res
        al, c = res.alignment, res.candidates
        assert al is not None and c is not None and res.reverse_kl is not None
        ids, lps = res.sample.student_top_logprobs
        t_tokens = np.concatenate(
            [np.asarray(res.sample.teacher_prompt_ids), al.teacher_ids.numpy()]
        )
        expected = reference_topk(
            a,
            b,
            server.model,
            t_tokens,
            len(res.sample.teacher_prompt_ids),
            (al.student_spans.tolist(), al.teacher_spans.tolist(), al.scored.tolist()),
            ids,
            lps,
            tail,
        )
        np.testing.assert_allclose(res.reverse_kl.numpy(), expected, rtol=1e-5, atol=1e-5)
        kept_total += int(c.mask.sum())
        # the textless candidate is never kept; the teacher logprobs are the span values
        assert not bool((c.ids[c.mask] == end).any())
        teacher, _ = span_signal_of(al)
        assert torch.equal(res.teacher_logprobs, teacher)
    assert kept_total > 20


def span_signal_of(al: Any) -> tuple[torch.Tensor, Any]:
    from opd_stream.xtok._align import Alignment, span_signal

    a = Alignment(
        teacher_ids=al.teacher_ids.numpy(),
        student_spans=al.student_spans.numpy(),
        teacher_spans=al.teacher_spans.numpy(),
        span_bytes=al.span_bytes.numpy(),
        scored=al.scored.numpy(),
        textless=np.zeros(int(al.student_spans[-1]), bool),
    )
    teacher, rkl = span_signal(a, al.teacher_token_logprobs.numpy(), None)
    return torch.from_numpy(teacher), rkl


def test_strategies_reading_the_teachers_top_k_are_refused(
    small_paths: tuple[str, str],
) -> None:
    with pytest.raises(
        ConfigError,
        match=r"teacher_tokenizers, top_k, strategy: strategy union "
        r"reads the teacher's top-k",
    ):
        config(*small_paths, top_k=4, strategy="union", student_url="http://s:1")


async def test_only_student_top_k_fetches_a_missing_student_top_k(
    small_paths: tuple[str, str],
) -> None:
    """Samples without the student's top-k: it comes from the student server first (the
    mock's ids run past the small tokenizer: such candidates have no bytes and are
    dropped), then the teacher is asked the kept candidates."""
    a, b = small_vocab("a"), small_vocab("b")
    s_model = ByteModel(a.token_bytes, q=0.5)
    student_url = "http://student:3"
    servers = {
        T: InProcessSGLang("teacher", 1, byte_model=ByteModel(b.token_bytes, q=0.6)),
        student_url: InProcessSGLang("student", 1),
    }
    samples = [make_sample(a, b, s_model, a.encode(text), i) for i, text in enumerate(RESPONSES)]
    cfg = config(*small_paths, top_k=4, student_url=student_url)
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
    assert servers[student_url].requests == len(samples)
    for res in out:
        assert isinstance(res, ScoredSample), res
        c = res.candidates
        assert c is not None and res.reverse_kl is not None
        assert bool((c.ids[c.mask] < a.size).all())
        assert torch.equal(res.reverse_kl[~c.mask.any(1)], torch.zeros(int((~c.mask.any(1)).sum())))
