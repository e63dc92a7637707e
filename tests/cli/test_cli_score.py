"""``opd-stream score``: a JSON Lines file of rollouts scored against real HTTP mock servers.

Numbers are checked against the independent float64 reference (``pipeline_reference``,
from the mock's closed-form model). The command runs in-process (``main([...])`` in a
worker thread, the mock servers on the test's event loop) and once as the installed
console script, end to end through stdin and stdout.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
from support.cli import CONSOLE_SCRIPT, run_cli
from support.pipeline_reference import Expected, expected_result, rollout_topk_rows

from opd_stream import InvalidSampleError, Sample
from opd_stream.cli._main import main
from opd_stream.cli._progress import Progress
from opd_stream.cli._score_files import LineReader
from opd_stream.cli._score_schema import LineRef, decode_line
from opd_stream.testing.mock_sglang import MockModel, MockOptions, serve_mock

K = 4
MASKED_ID = 151935  # the mock's default masked ids are the two largest: logprob -inf


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # serve_mock runs on asyncio


pytestmark = pytest.mark.usefixtures("cli_env")


# --- helpers ----------------------------------------------------------------------------------


def _rollout(
    rng: np.random.Generator, student: MockModel, p: int, r: int
) -> tuple[list[int], list[int], list[float]]:
    tokens = rng.integers(0, 5000, p + r).tolist()
    lps = student.token_logprobs(np.asarray(tokens), np.arange(p, p + r))
    return tokens[:p], tokens[p:], [float(np.float32(x)) for x in lps]


def _write_lines(path: Path, lines: list[Any]) -> None:
    """Objects are JSON-encoded; strings are written as they are."""
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    path.write_text(text + "\n")


def _read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _score(tmp_path: Path, teacher: str, *extra: str) -> int:
    """``opd-stream score --teacher TEACHER --input in.jsonl --output out.jsonl *extra``."""
    files = ("--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"))
    return await _run("--teacher", teacher, *files, *extra)


_run = partial(run_cli, "--log-level", "warning", "score")
"""``opd-stream score ...`` in-process, in a worker thread (it runs its own loop)."""


def _expected_sampled(
    tokens: list[int],
    response_length: int,
    teacher: Any,
    student: Any,
    rollout_logprobs: list[float] | None = None,
) -> Expected:
    """The reference result of a sampled-token (top_k = 0) sample."""
    return expected_result(
        tokens=tokens,
        response_length=response_length,
        teacher=teacher,
        student=student,
        top_k=0,
        strategy="only-student",
        weight_mode="student_p",
        rollout_logprobs=rollout_logprobs,
    )


def _assert_sampled(line: dict[str, Any], expected: Expected) -> None:
    got = [-math.inf if v is None else v for v in line["teacher_logprobs"]]
    assert got == expected.teacher_logprobs
    if expected.reverse_kl is None:
        assert line["reverse_kl"] is None
    else:
        assert len(line["reverse_kl"]) == len(expected.reverse_kl)
        for g, e in zip(line["reverse_kl"], expected.reverse_kl, strict=True):
            assert abs(g - e) <= 1e-5, (g, e)


# --- sans-IO: line decoding and reading ----------------------------------------------------


def test_decode_line_builds_a_sample_with_a_line_ref_and_the_default_teacher() -> None:
    data = b'{"id": {"run": [1, 2.5]}, "prompt_ids": [5, 6], "response_ids": [7]}'
    sample = decode_line(data, line=3, seq=2, default_teacher="math")
    assert isinstance(sample, Sample)
    assert sample.tokens.tolist() == [5, 6, 7]
    assert sample.response_length == 1
    assert sample.metadata == {"opd_teacher": "math"}
    ref = sample.sample_id
    assert isinstance(ref, LineRef)
    assert (ref.seq, ref.line, bytes(ref.id)) == (2, 3, b'{"run": [1, 2.5]}')


def test_decode_line_without_id_uses_the_index_among_non_blank_lines() -> None:
    sample = decode_line(b'{"tokens": [1, 2, 3], "response_length": 2}', line=9, seq=4)
    assert bytes(sample.sample_id.id) == b"4"
    assert sample.response_length == 2


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b'{"prompt_ids": [1, 2', "json"),
        (b'{"prompt_ids": [1, "x"], "response_ids": [2]}', "prompt_ids"),
        (b'{"prompt_ids": [1], "response_ids": [2], "extra": 1}', "schema"),
        (b'{"prompt_ids": [1], "response_ids": [2], "tokens": [1, 2]}', "tokens"),
        (b'{"prompt_ids": [], "response_ids": [2]}', "prompt_ids"),
        (b'{"response_ids": [2]}', "prompt_ids"),
        (b'{"tokens": [1, 2]}', "response_length"),
        (b'{"id": 1}', "prompt_ids"),
        (b'{"prompt_ids": [1], "response_ids": [-2]}', "response_ids"),
        (
            b'{"prompt_ids": [1], "response_ids": [2], "teacher": "a", '
            b'"metadata": {"opd_teacher": "b"}}',
            "teacher",
        ),
    ],
)
def test_decode_line_rejects_a_bad_line_naming_the_field(data: bytes, field: str) -> None:
    with pytest.raises(InvalidSampleError) as info:
        decode_line(data, line=1, seq=0)
    assert info.value.field == field


def test_decode_line_error_messages_never_repeat_values() -> None:
    with pytest.raises(InvalidSampleError) as info:
        decode_line(b'{"prompt_ids": [1, "PAYLOAD-TEXT"], "response_ids": [2]}', line=1, seq=0)
    assert "PAYLOAD-TEXT" not in str(info.value)
    assert "prompt_ids[1]" in str(info.value)


def test_line_reader_splits_chunks_counts_blank_lines_and_reads_a_last_line_without_newline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import opd_stream.cli._score_files as scorefile_files

    monkeypatch.setattr(scorefile_files, "READ_CHUNK", 7)  # lines span several chunks
    ok = b'{"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}'
    data = ok + b"\r\n\n   \n" + b"{oops\n" + ok  # CRLF, blank lines, no final newline
    reader = LineReader(io.BytesIO(data), lambda d, line, seq: decode_line(d, line=line, seq=seq))
    items = []
    while (batch := reader.read_batch()) is not None:
        items.extend(batch)
    assert [type(x).__name__ for x in items] == ["Sample", "SampleFailure", "Sample"]
    refs = [x.sample.sample_id if hasattr(x, "sample") else x.sample_id for x in items]
    assert [(r.seq, r.line) for r in refs] == [(0, 1), (1, 4), (2, 5)]
    assert items[1].reason == "invalid_sample"
    assert items[2].tokens.tolist() == [1, 2, 3, 4, 5]


# --- progress bar ---------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_redraws_at_most_every_interval_and_ends_the_line() -> None:
    now = [0.0]
    out = _Tty()
    bar = Progress(out, clock=lambda: now[0], width=200)
    bar.set_total(4)
    for _ in range(3):
        now[0] += 0.01
        bar.update(ok=1)  # within 0.1 s of the first draw: not redrawn
    now[0] = 1.0
    bar.update(failed=1)
    bar.close()
    frames = out.getvalue().split("\r")[1:]
    assert len(frames) == 3  # first draw, the one after 0.1 s, the final one
    assert frames[0].startswith("scored 0/4 samples (0.0%)")
    assert frames[-1].startswith("scored 4/4 samples (100.0%) | ok 3, failed 1 | 4.0 samples/s")
    assert out.getvalue().endswith("\x1b[K\n")


def test_progress_off_a_terminal_writes_one_plain_final_line() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = Progress(out, clock=lambda: now[0])
    bar.update(ok=5)
    assert out.getvalue() == ""
    now[0] = 2.0
    bar.close()
    bar.close()
    assert out.getvalue() == "scored 5 samples | ok 5, failed 0 | 2.5 samples/s | 2.0 s\n"


def test_progress_disabled_writes_nothing() -> None:
    out = _Tty()
    bar = Progress(out, enabled=False)
    bar.update(ok=1)
    bar.close()
    assert out.getvalue() == ""


# --- usage errors (no server needed) --------------------------------------------------------


def _usage_cases(tmp: Path) -> dict[str, tuple[list[str], dict[str, str], str]]:
    good_in = tmp / "in.jsonl"
    good_in.write_text('{"prompt_ids": [1], "response_ids": [2]}\n')
    base = ["--input", str(good_in), "--output", str(tmp / "out.jsonl")]
    teacher = ["--teacher", "math=http://127.0.0.1:9"]
    return {
        "teacher without '='": (["--teacher", "math", *base], {}, "expected NAME=URL"),
        "teacher with an empty name": (
            ["--teacher", "=http://127.0.0.1:9", *base],
            {},
            "expected NAME=URL",
        ),
        "unknown default teacher": (
            [*teacher, "--default-teacher", "code", *base],
            {},
            "--default-teacher 'code' is not a configured teacher",
        ),
        "unreadable input": (
            [*teacher, "--input", str(tmp / "missing.jsonl"), "--output", str(tmp / "out.jsonl")],
            {},
            "cannot open input",
        ),
        "invalid env config": (
            [*teacher, *base],
            {"OPD_STREAM_MAX_ATTEMPTS": "many"},
            "max_attempts (from OPD_STREAM_MAX_ATTEMPTS): expected an integer",
        ),
        "api key variable unset": (
            [*teacher, "--api-key-env", "OPD_TEST_UNSET_KEY", *base],
            {},
            "environment variable OPD_TEST_UNSET_KEY is not set",
        ),
        "candidates in sampled-token mode": (
            [*teacher, "--with-candidates", *base],
            {},
            "--with-candidates needs top-k mode",
        ),
        "output is the input": (
            [*teacher, "--input", str(good_in), "--output", str(good_in)],
            {},
            "--output is the same file as --input",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "teacher without '='",
        "teacher with an empty name",
        "unknown default teacher",
        "unreadable input",
        "invalid env config",
        "api key variable unset",
        "candidates in sampled-token mode",
        "output is the input",
    ],
)
def test_usage_errors_exit_2_with_a_message_and_no_output_file(
    case: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv, env, message = _usage_cases(tmp_path)[case]
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert main(["score", *argv]) == 2
    err = capsys.readouterr().err
    assert "opd-stream score: error: " in err and message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()
    assert (tmp_path / "in.jsonl").read_text() == '{"prompt_ids": [1], "response_ids": [2]}\n'


# --- against mock servers -------------------------------------------------------------------


async def test_sampled_token_mode_lines_equal_the_mock_closed_form(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    async with serve_mock("teacher", 1) as teacher:
        student = MockModel("student", 0)
        lines: list[Any] = []
        expected: list[Expected] = []
        for i in range(8):
            prompt, response, lps = _rollout(rng, student, int(rng.integers(2, 9)), 1 + i)
            with_rollout = i % 3 != 2
            if i % 2:
                line: dict[str, Any] = {"prompt_ids": prompt, "response_ids": response}
            else:
                line = {"tokens": prompt + response, "response_length": len(response)}
            if with_rollout:
                line["rollout_logprobs"] = lps
            line["id"] = f"r{i}"
            lines.append(line)
            expected.append(
                _expected_sampled(
                    prompt + response,
                    len(response),
                    teacher.model,
                    student,
                    rollout_logprobs=lps if with_rollout else None,
                )
            )
        # a response token the teacher gives probability 0: its logprob is written as null
        masked = {"prompt_ids": [3, 4], "response_ids": [MASKED_ID, 5], "id": "masked"}
        lines.append(masked)
        expected.append(_expected_sampled([3, 4, MASKED_ID, 5], 2, teacher.model, student))
        _write_lines(tmp_path / "in.jsonl", lines)
        code = await _score(tmp_path, f"math={teacher.url}", "--no-progress")
    assert code == 0
    out = {line["id"]: line for line in _read_lines(tmp_path / "out.jsonl")}
    assert len(out) == len(lines)
    for n, (src, exp) in enumerate(zip(lines, expected, strict=True)):
        got = out[src["id"]]
        assert got["ok"] is True and got["line"] == n + 1 and got["teacher"] == "math"
        assert got["response_length"] == len(exp.teacher_logprobs)
        assert got["attempts"] == 1 and got["latency_s"] >= 0
        assert "candidates" not in got
        _assert_sampled(got, exp)
    assert out["masked"]["teacher_logprobs"][0] is None


async def test_topk_mode_with_candidates_matches_the_reference(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    async with serve_mock("teacher", 1) as teacher, serve_mock("student", 0) as student:
        lines: list[dict[str, Any]] = []
        expected: list[Expected] = []
        for i in range(6):
            prompt, response, _ = _rollout(rng, student.model, int(rng.integers(2, 8)), 2 + i)
            line: dict[str, Any] = {"prompt_ids": prompt, "response_ids": response}
            if i % 2:  # else the student's top-k is fetched from the student server
                line["student_top_logprobs"] = rollout_topk_rows(
                    student.model, prompt + response, len(prompt), K
                )
            lines.append(line)
            expected.append(
                expected_result(
                    tokens=prompt + response,
                    response_length=len(response),
                    teacher=teacher.model,
                    student=student.model,
                    top_k=K,
                    strategy="union",
                    weight_mode="student_p",
                )
            )
        _write_lines(tmp_path / "in.jsonl", lines)
        code = await _run(
            "--teacher",
            f"math={teacher.url}",
            "--student-url",
            student.url,
            "--top-k",
            str(K),
            "--strategy",
            "union",
            "--weight-mode",
            "student_p",
            "--with-candidates",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--no-progress",
        )
    assert code == 0
    out = {line["id"]: line for line in _read_lines(tmp_path / "out.jsonl")}
    assert sorted(out) == list(range(len(lines)))
    for i, exp in enumerate(expected):
        got = out[i]
        assert got["ok"] is True
        assert got["teacher_logprobs"] == exp.teacher_logprobs
        assert exp.reverse_kl is not None and exp.ids is not None and exp.weights is not None
        for t, (g, e) in enumerate(zip(got["reverse_kl"], exp.reverse_kl, strict=True)):
            assert abs(g - e) <= 1e-5 + 1e-6 * exp.scale[t], (i, t, g, e)
        cands = got["candidates"]
        assert set(cands) == {"ids", "student_logprobs", "teacher_logprobs", "weights", "mask"}
        for t, ids in enumerate(exp.ids):
            n = len(ids)
            assert len(cands["ids"][t]) == 2 * K
            assert cands["ids"][t][:n] == ids
            assert all(cands["mask"][t][:n]) and not any(cands["mask"][t][n:])
            assert all(x == -1 for x in cands["ids"][t][n:])
            for g, e in zip(cands["weights"][t][:n], exp.weights[t], strict=True):
                assert abs(g - e) <= 1e-5, (i, t, g, e)


async def test_topk_mode_omits_candidates_without_the_flag(tmp_path: Path) -> None:
    async with serve_mock("teacher", 1) as teacher, serve_mock("student", 0) as student:
        _write_lines(tmp_path / "in.jsonl", [{"prompt_ids": [1, 2], "response_ids": [3, 4]}])
        code = await _run(
            "--teacher",
            f"math={teacher.url}",
            "--student-url",
            student.url,
            "--top-k",
            "2",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--no-progress",
        )
    assert code == 0
    [line] = _read_lines(tmp_path / "out.jsonl")
    assert line["ok"] is True and len(line["reverse_kl"]) == 2
    assert "candidates" not in line


async def test_two_teachers_route_by_the_teacher_key_and_the_default_teacher(
    tmp_path: Path,
) -> None:
    async with serve_mock("teacher", 1) as math_t, serve_mock("teacher", 2) as code_t:
        models = {"math": math_t.model, "code": code_t.model}
        lines = [
            {"id": "m", "prompt_ids": [1, 2], "response_ids": [3, 4, 5], "teacher": "math"},
            {"id": "c", "prompt_ids": [1, 2], "response_ids": [3, 4, 5], "teacher": "code"},
            {"id": "d", "prompt_ids": [1, 2], "response_ids": [3, 4, 5]},
            {
                "id": "meta",
                "prompt_ids": [1, 2],
                "response_ids": [3, 4, 5],
                "metadata": {"opd_teacher": "math", "other": [1, 2]},
            },
        ]
        _write_lines(tmp_path / "in.jsonl", lines)
        code = await _run(
            "--teacher",
            f"math={math_t.url}",
            "--teacher",
            f"code={code_t.url}",
            "--default-teacher",
            "code",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--no-progress",
        )
    assert code == 0
    out = {line["id"]: line for line in _read_lines(tmp_path / "out.jsonl")}
    want = {"m": "math", "c": "code", "d": "code", "meta": "math"}
    assert {k: v["teacher"] for k, v in out.items()} == want
    tokens = np.array([1, 2, 3, 4, 5])
    assert models["math"].token_logprobs(tokens, [2, 3, 4]).tolist() != (
        models["code"].token_logprobs(tokens, [2, 3, 4]).tolist()
    )
    for key, name in want.items():
        ref = [float(np.float32(x)) for x in models[name].token_logprobs(tokens, [2, 3, 4])]
        assert out[key]["teacher_logprobs"] == ref, key


async def test_bad_lines_each_fail_alone_with_one_output_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = {"prompt_ids": [1, 2], "response_ids": [3, 4]}
    lines: list[Any] = [
        good,
        '{"prompt_ids": [1, 2], "response_ids": [3, PAYLOAD-A]}',  # not JSON
        "",
        {"id": "typo", "prompt_ids": [1], "respons_ids": [2]},  # unknown key
        {"id": "type", "prompt_ids": [1, "PAYLOAD-B"], "response_ids": [2]},  # wrong type
        {"id": "who", "prompt_ids": [1], "response_ids": [2], "teacher": "PAYLOAD-C"},
        {"id": "range", "tokens": [1, 2], "response_length": 2},  # checked by the stream
        good,
    ]
    async with serve_mock("teacher", 1) as teacher:
        _write_lines(tmp_path / "in.jsonl", lines)
        code = await _score(tmp_path, f"math={teacher.url}", "--no-progress")
    assert code == 0
    out = sorted(_read_lines(tmp_path / "out.jsonl"), key=lambda x: x["line"])
    assert [x["line"] for x in out] == [1, 2, 4, 5, 6, 7, 8]  # line 3 is blank
    assert [x["id"] for x in out] == [0, 1, "typo", "type", "who", "range", 6]
    assert [x["ok"] for x in out] == [True, False, False, False, False, False, True]
    failures = {x["id"]: x for x in out if not x["ok"]}
    assert {k: v["reason"] for k, v in failures.items()} == {
        1: "invalid_sample",
        "typo": "invalid_sample",
        "type": "invalid_sample",
        "who": "routing",
        "range": "invalid_sample",
    }
    assert failures[1]["message"].startswith("json: ")
    assert "respons_ids" in failures["typo"]["message"]
    assert failures["type"]["message"].startswith("prompt_ids: ")
    assert failures["range"]["message"].startswith("response_length: ")
    for failure in failures.values():
        assert set(failure) == {"id", "line", "ok", "reason", "message", "attempts"}
        assert failure["attempts"] == 0
        assert "PAYLOAD-A" not in failure["message"] and "PAYLOAD-B" not in failure["message"]
    err = capsys.readouterr().err
    assert "opd-stream score: 7 samples, 2 ok, 5 failed (invalid_sample 4, routing 1) in " in err


async def test_fail_on_error_exits_1_when_a_sample_failed(tmp_path: Path) -> None:
    async with serve_mock("teacher", 1) as teacher:
        _write_lines(tmp_path / "in.jsonl", [{"prompt_ids": [1], "response_ids": [2]}, "{"])
        common = ["--teacher", f"math={teacher.url}", "--input", str(tmp_path / "in.jsonl")]
        strict = await _run(*common, "--output", str(tmp_path / "a.jsonl"), "--fail-on-error")
        lenient = await _run(*common, "--output", str(tmp_path / "b.jsonl"))
        _write_lines(tmp_path / "ok.jsonl", [{"prompt_ids": [1], "response_ids": [2]}])
        clean = await _run(
            "--teacher",
            f"math={teacher.url}",
            "--input",
            str(tmp_path / "ok.jsonl"),
            "--output",
            str(tmp_path / "c.jsonl"),
            "--fail-on-error",
        )
    assert (strict, lenient, clean) == (1, 0, 0)
    assert len(_read_lines(tmp_path / "a.jsonl")) == 2


def _ordering_input(path: Path) -> None:
    """Line 1 is slow (many tokens at the server's per-token latency), the rest are fast."""
    slow = {"prompt_ids": list(range(1, 401)), "response_ids": [7, 8]}
    fast = {"prompt_ids": [1, 2], "response_ids": [3]}
    _write_lines(path, [slow, fast, "not json", fast, {"prompt_ids": []}, fast])


# line 1 takes 2 s at the server, the others 15 ms: a busy machine cannot reverse that
_SLOW_PER_TOKEN = MockOptions(latency_per_token_s=0.005)


async def test_ordered_writes_results_in_input_order(tmp_path: Path) -> None:
    _ordering_input(tmp_path / "in.jsonl")
    async with serve_mock("teacher", 1, options=_SLOW_PER_TOKEN) as teacher:
        code = await _score(tmp_path, f"math={teacher.url}", "--ordered", "--no-progress")
    assert code == 0
    out = _read_lines(tmp_path / "out.jsonl")
    assert [x["line"] for x in out] == [1, 2, 3, 4, 5, 6]
    assert [x["ok"] for x in out] == [True, True, False, True, False, True]


async def test_default_order_is_completion_order(tmp_path: Path) -> None:
    _ordering_input(tmp_path / "in.jsonl")
    async with serve_mock("teacher", 1, options=_SLOW_PER_TOKEN) as teacher:
        code = await _score(tmp_path, f"math={teacher.url}", "--no-progress")
    assert code == 0
    out = _read_lines(tmp_path / "out.jsonl")
    assert sorted(x["line"] for x in out) == [1, 2, 3, 4, 5, 6]
    assert out[-1]["line"] == 1  # the slow sample finishes last


async def test_progress_writes_one_final_line_to_a_non_terminal_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_lines(tmp_path / "in.jsonl", [{"prompt_ids": [1], "response_ids": [2]}, "{"])
    async with serve_mock("teacher", 1) as teacher:
        common = ["--teacher", f"math={teacher.url}", "--input", str(tmp_path / "in.jsonl")]
        capsys.readouterr()
        assert await _run(*common, "--output", str(tmp_path / "a.jsonl")) == 0
        shown = capsys.readouterr().err
        assert await _run(*common, "--output", str(tmp_path / "b.jsonl"), "--no-progress") == 0
        hidden = capsys.readouterr().err
    progress = [line for line in shown.splitlines() if line.startswith("scored ")]
    assert len(progress) == 1
    assert progress[0].startswith("scored 2/2 samples (100.0%) | ok 1, failed 1 | ")
    assert "\r" not in shown
    assert not [line for line in hidden.splitlines() if line.startswith("scored ")]
    assert "opd-stream score: 2 samples, 1 ok, 1 failed" in hidden


async def test_api_key_from_env_is_sent_as_bearer_and_never_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key = "k3y-Zq81-never-shown"
    monkeypatch.setenv("OPD_TEST_TEACHER_KEY", key)
    _write_lines(tmp_path / "in.jsonl", [{"prompt_ids": [1, 2], "response_ids": [3]}] * 3)
    async with serve_mock("teacher", 1, options=MockOptions(api_key=key)) as teacher:
        common = ["--teacher", f"math={teacher.url}", "--input", str(tmp_path / "in.jsonl")]
        with_key = await run_cli(
            "--log-level",
            "debug",
            "score",
            *common,
            "--output",
            str(tmp_path / "a.jsonl"),
            "--api-key-env",
            "OPD_TEST_TEACHER_KEY",
        )
        without = await _run(*common, "--output", str(tmp_path / "b.jsonl"))
    assert with_key == 0 and without == 1  # nothing scored without the key
    assert [x["ok"] for x in _read_lines(tmp_path / "a.jsonl")] == [True] * 3
    assert {x["reason"] for x in _read_lines(tmp_path / "b.jsonl")} == {"teacher_http_401"}
    err = capsys.readouterr().err
    assert "score_started" in err  # the debug log ran
    for text in (err, (tmp_path / "a.jsonl").read_text(), (tmp_path / "b.jsonl").read_text()):
        assert key not in text


class _FailingInput:
    """A stdin whose second read fails (a disk or pipe error in the middle of the input)."""

    def __init__(self, first: bytes) -> None:
        self.chunks = [first]

    def read1(self, size: int) -> bytes:
        if self.chunks:
            return self.chunks.pop()
        raise OSError(errno.EIO, os.strerror(errno.EIO))


async def test_an_input_read_error_scores_what_was_read_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    first = b'{"prompt_ids": [1], "response_ids": [2]}\n' * 2
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=_FailingInput(first)))
    async with serve_mock("teacher", 1) as teacher:
        code = await _run(
            "--teacher",
            f"math={teacher.url}",
            "--input",
            "-",
            "--output",
            str(tmp_path / "out.jsonl"),
            "--no-progress",
        )
    assert code == 2
    assert [x["ok"] for x in _read_lines(tmp_path / "out.jsonl")] == [True, True]
    err = capsys.readouterr().err
    assert (
        f"opd-stream score: error: cannot read input after line 2: {os.strerror(errno.EIO)}" in err
    )
    assert "Traceback" not in err


async def test_an_output_write_error_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_lines(tmp_path / "in.jsonl", [{"prompt_ids": [1], "response_ids": [2]}] * 3)
    async with serve_mock("teacher", 1) as teacher:
        code = await _run(
            "--teacher",
            f"math={teacher.url}",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            "/dev/full",  # every write fails with ENOSPC
            "--no-progress",
        )
    assert code == 2
    err = capsys.readouterr().err
    assert f"opd-stream score: error: cannot write output: {os.strerror(errno.ENOSPC)}" in err
    assert "Traceback" not in err


async def test_console_script_scores_stdin_to_stdout(tmp_path: Path) -> None:
    assert CONSOLE_SCRIPT.exists(), CONSOLE_SCRIPT
    rng = np.random.default_rng(2)
    student = MockModel("student", 0)
    async with serve_mock("teacher", 1) as teacher:
        lines, expected = [], []
        for i in range(4):
            prompt, response, lps = _rollout(rng, student, 3, 2 + i)
            lines.append({"prompt_ids": prompt, "response_ids": response, "rollout_logprobs": lps})
            expected.append(
                _expected_sampled(
                    prompt + response, len(response), teacher.model, student, rollout_logprobs=lps
                )
            )
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPD_STREAM_")}
        env["OPD_STREAM_KL_DEVICE"] = "cpu"
        proc = await anyio.run_process(
            [
                str(CONSOLE_SCRIPT),
                "score",
                "--teacher",
                f"math={teacher.url}",
                "--input",
                "-",
                "--output",
                "-",
                "--ordered",
            ],
            input="\n".join(json.dumps(x) for x in lines).encode(),
            env=env,
            check=False,
        )
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-2000:]
    out = [msgspec.json.decode(line) for line in proc.stdout.splitlines()]
    assert [x["id"] for x in out] == [0, 1, 2, 3]
    for got, exp in zip(out, expected, strict=True):
        assert got["ok"] is True
        _assert_sampled(got, exp)
    assert "scored 4/4 samples (100.0%) | ok 4, failed 0" in err
    assert "opd-stream score: 4 samples, 4 ok, 0 failed in " in err


async def test_teacher_prompt_ids_and_the_tail_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18 through the command: ``teacher_prompt_ids`` in the input schema, the tail
    logprobs in ``candidates`` (``OPD_STREAM_TAIL``), bad teacher prompts failing alone."""
    monkeypatch.setenv("OPD_STREAM_TAIL", "1")
    rng = np.random.default_rng(18)
    async with serve_mock("teacher", 1) as teacher, serve_mock("student", 0) as student:
        lines: list[dict[str, Any]] = []
        expected: list[Expected] = []
        for i in range(4):
            prompt, response, _ = _rollout(rng, student.model, int(rng.integers(2, 8)), 2 + i)
            teacher_prompt = rng.integers(0, 5000, 1 + 5 * i).tolist()
            lines.append(
                {
                    "id": i,
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "teacher_prompt_ids": teacher_prompt,
                }
            )
            expected.append(
                expected_result(
                    tokens=prompt + response,
                    response_length=len(response),
                    teacher=teacher.model,
                    student=student.model,
                    top_k=K,
                    strategy="union",
                    weight_mode="student_p",
                    tail=True,
                    teacher_prompt=teacher_prompt,
                )
            )
        bad = {"empty": [], "type": "1 2", "negative": [1, -3], "float": [1, 2.5]}
        for name, value in bad.items():
            lines.append(
                {"id": name, "prompt_ids": [1], "response_ids": [2], "teacher_prompt_ids": value}
            )
        _write_lines(tmp_path / "in.jsonl", lines)
        code = await _run(
            "--teacher",
            f"math={teacher.url}",
            "--student-url",
            student.url,
            "--top-k",
            str(K),
            "--strategy",
            "union",
            "--with-candidates",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--no-progress",
        )
    assert code == 0
    out = {line["id"]: line for line in _read_lines(tmp_path / "out.jsonl")}
    for i, exp in enumerate(expected):
        got = out[i]
        assert got["ok"] is True
        assert [-math.inf if v is None else v for v in got["teacher_logprobs"]] == (
            exp.teacher_logprobs
        )
        assert exp.reverse_kl is not None and exp.tails is not None
        for t, (g, e) in enumerate(zip(got["reverse_kl"], exp.reverse_kl, strict=True)):
            assert g >= 0 and abs(g - e) <= 1e-5 + 1e-6 * exp.scale[t], (i, t, g, e)
        cands = got["candidates"]
        for t, (ls, lt) in enumerate(exp.tails):
            assert abs(cands["student_tail_logprobs"][t] - ls) <= 1e-6 * abs(ls) + 1e-9
            assert abs(cands["teacher_tail_logprobs"][t] - lt) <= 1e-6 * abs(lt) + 1e-9
    for name in bad:
        assert out[name]["ok"] is False and out[name]["reason"] == "invalid_sample"
        assert out[name]["message"].startswith("teacher_prompt_ids: "), out[name]
    assert "empty teacher prompt" in out["empty"]["message"]
