"""What a new user and hostile input found in the commands (issue 17, items 6-19):
one bad input line fails alone, files are never clobbered, Ctrl-C works while the input
blocks, every usage problem is one line and exit 2, and the docs hold what is true.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch
from support.cli import CONSOLE_SCRIPT, ROOT, run_cli, subprocess_env

from opd_stream import Candidates, Sample, SampleFailure, ScoredSample
from opd_stream.cli._demo import _summary
from opd_stream.cli._main import _parser, main
from opd_stream.cli._score_files import LineReader, open_input
from opd_stream.cli._score_schema import LineRef, decode_line, render_result
from opd_stream.testing.mock_sglang import serve_mock
from opd_stream.testing.mock_sglang.__main__ import main as mock_main

GOOD = b'{"prompt_ids": [1, 2], "response_ids": [3]}'
_SCORE_CMD = (str(CONSOLE_SCRIPT), "score", "--teacher", "t=http://127.0.0.1:9")


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # serve_mock runs on asyncio


pytestmark = pytest.mark.usefixtures("cli_env")


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_bytes().decode("utf-8").splitlines()]


class _Chunks(io.RawIOBase):
    """A source that returns the given chunks, one per read, then EOF."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)
        self.reads = 0

    def read1(self, size: int = -1) -> bytes:
        self.reads += 1
        return self.chunks.pop(0) if self.chunks else b""


def _reader(chunks: list[bytes], max_line_bytes: int = 1 << 20) -> LineReader:
    def decode(data: bytes, line: int, seq: int) -> Sample:
        return decode_line(data, line=line, seq=seq)

    return LineReader(_Chunks(chunks), decode, max_line_bytes)  # type: ignore[arg-type]


def _drain(reader: LineReader) -> list[Sample | SampleFailure]:
    out: list[Sample | SampleFailure] = []
    while (batch := reader.read_batch()) is not None:
        out.extend(batch)
    return out


# --- items 6, 7, 8, 11: one bad line fails alone --------------------------------------------


def test_a_deeply_nested_line_fails_alone_with_invalid_sample() -> None:
    for depth in (1000, 100_000):
        deep = b'{"prompt_ids": [1], "response_ids": [2], "metadata": {"a": '
        deep += b"[" * depth + b"]" * depth + b"}}"
        deep_id = b'{"id": ' + b"[" * depth + b"]" * depth + b', "prompt_ids": [1]}'
        out = _drain(_reader([GOOD + b"\n" + deep + b"\n" + deep_id + b"\n" + GOOD + b"\n"]))
        assert [type(x).__name__ for x in out] == [
            "Sample",
            "SampleFailure",
            "SampleFailure",
            "Sample",
        ]
        for failure in out[1:3]:
            assert isinstance(failure, SampleFailure) and failure.reason == "invalid_sample"
            assert "nested too deeply" in failure.message


def test_an_id_that_is_not_valid_utf8_fails_its_line_and_the_output_stays_json() -> None:
    bad = b'{"id": "r\xff\xfe7", "prompt_ids": [1], "response_ids": [2]}'
    (failure,) = _drain(_reader([bad + b"\n"]))
    assert isinstance(failure, SampleFailure) and failure.reason == "invalid_sample"
    assert failure.message.startswith("id: ")
    line = render_result(failure)
    assert json.loads(line.decode("utf-8"))["id"] == 0  # the default id, valid JSON


def test_a_line_over_the_size_limit_fails_as_soon_as_it_is_seen_and_is_not_held() -> None:
    # An endless line (like --input /dev/zero): the failure comes after ~limit bytes, and
    # the reader never holds more than the limit.
    zeros = [b"0" * 4096] * 64
    reader = _reader(zeros, max_line_bytes=10_000)
    first = reader.read_batch()
    assert first is not None
    (failure,) = first
    assert isinstance(failure, SampleFailure) and failure.message.startswith("line: longer than")
    assert reader._held <= 10_000
    assert _drain(reader) == []  # the rest of that line is dropped
    # A too-long line between good ones: only it fails; line numbers stay right.
    long_line = b'{"prompt_ids": [' + b"1," * 6000 + b'1], "response_ids": [2]}'
    out = _drain(_reader([GOOD + b"\n" + long_line + b"\n" + GOOD + b"\n"], 10_000))
    assert [type(x).__name__ for x in out] == ["Sample", "SampleFailure", "Sample"]
    last = out[2]
    assert isinstance(last, Sample) and isinstance(last.sample_id, LineRef)
    assert last.sample_id.line == 3


def test_a_byte_order_mark_at_the_start_of_the_input_is_accepted() -> None:
    bom = b"\xef\xbb\xbf"
    out = _drain(_reader([bom + GOOD + b"\n" + GOOD + b"\n"]))
    assert [type(x).__name__ for x in out] == ["Sample", "Sample"]
    out = _drain(_reader([bom[:1], bom[1:] + GOOD + b"\n"]))  # split across reads
    assert [type(x).__name__ for x in out] == ["Sample"]
    out = _drain(_reader([GOOD + b"\n" + bom + GOOD + b"\n"]))  # only at the very start
    assert [type(x).__name__ for x in out] == ["Sample", "SampleFailure"]


async def test_score_end_to_end_bad_lines_fail_alone_and_the_output_is_valid_json(
    tmp_path: Path,
) -> None:
    deep = b'{"prompt_ids": [1], "metadata": {"a": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
    bad_id = b'{"id": "\xff", "prompt_ids": [1], "response_ids": [2]}'
    long_line = b'{"prompt_ids": [' + b"1," * 3000 + b'1], "response_ids": [2]}'
    data = b"\xef\xbb\xbf" + b"\n".join([GOOD, deep, bad_id, long_line, GOOD]) + b"\n"
    (tmp_path / "in.jsonl").write_bytes(data)
    async with serve_mock("teacher", 1) as teacher:
        code = await run_cli(
            "score",
            "--teacher",
            f"t={teacher.url}",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--max-line-bytes",
            "4096",
            "--ordered",
            "--no-progress",
        )
    assert code == 0
    out = _lines(tmp_path / "out.jsonl")
    assert [x["line"] for x in out] == [1, 2, 3, 4, 5]
    assert [x["ok"] for x in out] == [True, False, False, False, True]
    assert {x.get("reason") for x in out[1:4]} == {"invalid_sample"}


# --- item 9: a FIFO with no writer ------------------------------------------------------------


async def test_opening_a_fifo_with_no_writer_leaves_the_loop_free_and_can_be_cancelled(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(open_input, str(fifo))
            await anyio.wait_all_tasks_blocked()  # the loop runs while open() blocks
            scope.cancel()
    assert scope.cancelled_caught
    # Let the abandoned open finish (a writer comes): it closes what it opened.
    await anyio.to_thread.run_sync(lambda: os.close(os.open(fifo, os.O_WRONLY)))


def _blocked_in_open(pid: int) -> bool:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "wchan").read_text().strip() in ("wait_for_partner", "fifo_open"):
                return True
        except OSError:
            continue
    return False


def test_the_first_ctrl_c_interrupts_score_waiting_on_a_fifo(tmp_path: Path) -> None:
    if sys.platform != "linux":  # on Linux (CI included) /proc/<pid>/wchan is always there
        pytest.skip("needs Linux's /proc/<pid>/wchan")
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [*_SCORE_CMD, "--input", str(fifo), "--output", str(tmp_path / "o.jsonl"), "--no-progress"],
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(OPD_STREAM_KL_DEVICE="cpu"),
    )
    try:
        while not _blocked_in_open(proc.pid):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            anyio.run(anyio.sleep, 0.05)  # polling, not a timing assertion
        proc.send_signal(signal.SIGINT)  # once
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "opd-stream score: interrupted" in err
    assert "Traceback" not in err


# --- item 10: the file behind stdin -----------------------------------------------------------


def test_output_equal_to_the_file_behind_stdin_is_refused_before_truncating(
    tmp_path: Path,
) -> None:
    data = GOOD + b"\n"
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(data)
    with path.open("rb") as stdin:
        proc = subprocess.run(
            [*_SCORE_CMD, "--input", "-", "--output", str(path)],
            stdin=stdin,
            capture_output=True,
            text=True,
            env=subprocess_env(OPD_STREAM_KL_DEVICE="cpu"),
            timeout=120,
            check=False,
        )
    assert proc.returncode == 2, proc.stderr
    assert "--output is the same file as --input" in proc.stderr
    assert path.read_bytes() == data


# --- item 12: OPD_STREAM_TEACHERS ----------------------------------------------------------


async def test_score_takes_its_teachers_from_the_environment_when_no_flag_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "in.jsonl").write_bytes(GOOD + b"\n")
    files = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    async with serve_mock("teacher", 1) as teacher:
        monkeypatch.setenv("OPD_STREAM_TEACHERS", f"math={teacher.url}")
        assert await run_cli("score", *files, "--no-progress") == 0
    (line,) = _lines(tmp_path / "out.jsonl")
    assert line["ok"] is True and line["teacher"] == "math"


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ("garbage", ["--teacher", "t=http://127.0.0.1:9"], "OPD_STREAM_TEACHERS: "),
        ("math=ftp://h", [], "OPD_STREAM_TEACHERS: "),
        (None, [], "--teacher is required (or set OPD_STREAM_TEACHERS)"),
    ],
)
def test_opd_stream_teachers_is_validated_either_way(
    env: str | None,
    flags: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if env is not None:
        monkeypatch.setenv("OPD_STREAM_TEACHERS", env)
    (tmp_path / "in.jsonl").write_bytes(GOOD + b"\n")
    files = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    assert main(["score", *flags, *files]) == 2
    err = capsys.readouterr().err
    assert f"opd-stream score: error: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


# --- items 13, 14, 16: one-line errors, honest output ----------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "bogus", "config"],
        ["demo", "--fault-rate", "2"],
        ["demo", "--fault-rate", "nan"],
        ["demo", "--samples", "-3"],
        ["demo", "--response-len", "0"],
        ["score", "--log-level", "loud", "--input", "-", "--output", "-"],
    ],
)
def test_bad_flags_are_one_usage_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("opd-stream")


def test_an_invalid_env_variable_under_demo_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPD_STREAM_MAX_ATTEMPTS", "many")
    assert main(["demo", "--samples", "1", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        "opd-stream demo: error: configuration: max_attempts (from OPD_STREAM_MAX_ATTEMPTS): "
        "expected an integer, got 'many'"
    )
    assert captured.out == ""  # no server was started


async def test_score_accepts_log_level_after_the_subcommand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "in.jsonl").write_bytes(GOOD + b"\n" + b"{not json}\n")
    async with serve_mock("teacher", 1) as teacher:
        argv = ["score", "--teacher", f"t={teacher.url}", "--no-progress", "--ordered"]
        argv += ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "a.jsonl")]
        assert await run_cli(*argv) == 0
        quiet = capsys.readouterr().err
        assert await run_cli(*argv, "--log-level", "info") == 0
        loud = capsys.readouterr().err
    # item 15: at the default level no per-line event; the output file has the failure
    assert "line_failed" not in quiet and "sample_failed" not in quiet
    assert [x["ok"] for x in _lines(tmp_path / "a.jsonl")] == [True, False]
    events = [json.loads(x) for x in loud.splitlines() if x.startswith("{")]
    names = [e["event"] for e in events]
    assert "score_started" in names and "sample_failed" not in names
    (failed,) = [e for e in events if e["event"] == "line_failed"]
    assert failed["line"] == 2 and failed["reason"] == "invalid_sample"
    assert "index" not in failed


def test_the_mock_server_on_a_port_in_use_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert mock_main(["--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot serve on 127.0.0.1:{port}: ")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_demo_says_so_when_no_sample_was_scored(capsys: pytest.CaptureFixture[str]) -> None:
    class _Stats:  # the fields of stream.stats() that _summary reads
        latency_p50_s = latency_p99_s = loop_lag_p99_s = loop_lag_max_s = None
        requests, retries, bytes_received = 8, 6, 0
        failures = {"teacher_http_503": 2}  # noqa: RUF012

    failures = [
        SampleFailure(
            sample=Sample([1, 2], 1), index=i, reason="teacher_http_503", message="x", attempts=4
        )
        for i in range(2)
    ]
    _summary([], failures, _Stats(), 1.0, 0.0)
    out = capsys.readouterr().out
    assert "no sample scored" in out
    assert "max |diff|" not in out and "(OK)" not in out


def test_help_lists_only_real_subcommands_and_there_is_a_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "{demo,score,probe,config}" in text  # the sub-commands there are
    assert "``" not in text and "mock``" not in text and "mock," not in text
    with pytest.raises(SystemExit):
        main(["--version"])
    import opd_stream

    assert capsys.readouterr().out.strip() == f"opd-stream {opd_stream.__version__}"


# --- item 17: one representation of probability 0 -------------------------------------------


def test_probability_zero_is_null_in_every_logprob_list_of_a_result() -> None:
    inf = float("-inf")
    cands = Candidates(
        ids=torch.tensor([[5, 6], [7, -1]]),
        student_logprobs=torch.tensor([[-0.5, -1e4], [-0.25, 0.0]]),
        teacher_logprobs=torch.tensor([[-1e4, -2.0], [-0.75, 0.0]]),
        weights=torch.tensor([[1.0, 0.0], [1.0, 0.0]]),
        mask=torch.tensor([[True, True], [True, False]]),
    )
    item = ScoredSample(
        sample=Sample([1, 5, 7], 2, sample_id=LineRef(0, 1, msgspec.Raw(b'"a"'))),
        index=0,
        teacher="t",
        teacher_logprobs=torch.tensor([inf, -0.75]),
        reverse_kl=torch.tensor([9999.5, 0.5]),
        candidates=cands,
        attempts=1,
        latency_s=0.1,
    )
    line = json.loads(render_result(item, with_candidates=True))
    assert line["teacher_logprobs"] == [None, -0.75]
    assert line["candidates"]["teacher_logprobs"] == [[None, -2.0], [-0.75, 0.0]]
    assert line["candidates"]["student_logprobs"] == [[-0.5, None], [-0.25, 0.0]]
    assert line["reverse_kl"] == [9999.5, 0.5]  # signals: finite, computed with the floor
    assert None not in line["candidates"]["weights"][0]


# --- items 18, 19: docs a user can follow ----------------------------------------------------

_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize(
    "doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]
)
def test_every_relative_link_in_the_docs_points_into_the_repository(doc: str) -> None:
    text = (ROOT / doc).read_text()
    assert "shared/spec" not in text
    for target in _LINK.findall(text):
        if "://" in target:
            continue
        assert (ROOT / doc).parent.joinpath(target).resolve().is_relative_to(ROOT), target
        assert (ROOT / doc).parent.joinpath(target).exists(), (doc, target)


def test_the_readme_links_the_semantics_and_names_only_real_demo_flags() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "](docs/semantics.md)" in readme
    assert "decode_generate_response" not in readme  # not a public name
    cli = (ROOT / "docs" / "cli.md").read_text()
    demo = next(
        a.choices["demo"]
        for a in _parser()._actions
        if getattr(a, "choices", None) and "demo" in a.choices
    )
    real = {opt for action in demo._actions for opt in action.option_strings}
    (flags_sentence,) = [p for p in cli.split("\n\n") if "lists the demo's flags" in p]
    named = set(re.findall(r"`(--[a-z-]+)`", flags_sentence))
    assert named and named <= real, named - real
    dev = (ROOT / "scripts/dev.sh").read_text()
    for installed in ("sglang-router", "test,bench", "sglang==0.5.23"):
        assert installed in dev
    (setup_sentence,) = [p for p in readme.split("\n\n") if "create `.venv/` on first use" in p]
    for said in ("bench", "sglang-router", "SGLang 0.5.23"):
        assert said in setup_sentence, said
