"""``opd-stream score`` tells the truth (issue 24, section 3): the exit code when nothing was
scored, usage and file errors before torch is loaded, Ctrl-C at start-up, ``--teacher URL``,
what a failure message says (an HTML error page, a refused connection, a repeated key, a
teacher name from the line) and which answer parser runs.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from support.cli import ROOT, run_cli, run_module, subprocess_env

from opd_stream import InvalidSampleError
from opd_stream._errors import ServerHTTPError
from opd_stream.cli._main import main
from opd_stream.cli._score_files import LineReader
from opd_stream.cli._score_schema import decode_line
from opd_stream.testing.mock_sglang import serve_mock
from opd_stream.wire._error_body import parse_error_message

LINE = {"prompt_ids": [1, 2], "response_ids": [3, 4]}


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # serve_mock and aiohttp.web run on asyncio


pytestmark = pytest.mark.usefixtures("cli_env")


def _write(path: Path, lines: list[Any]) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


_score = partial(run_cli, "score", "--no-progress")  # opd-stream score ..., in a thread


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed on exit: a connection is refused


# --- exit code, and a teacher that refuses every connection ------------------------------------
async def test_nothing_scored_exits_1_and_a_refusing_teacher_fails_the_rest_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _closed_port()
    _write(tmp_path / "in.jsonl", [LINE] * 200)
    monkeypatch.setenv("OPD_STREAM_UNREACHABLE_AFTER_S", "0.2")
    monkeypatch.setenv("OPD_STREAM_MAX_INFLIGHT", "1")  # one after the other
    monkeypatch.setenv("OPD_STREAM_MAX_ATTEMPTS", "2")
    code = await _score(
        "--teacher",
        f"http://127.0.0.1:{port}",
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "out.jsonl"),
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert "200 samples, 0 ok, 200 failed (connection_error 200)" in err
    assert err.rstrip().endswith("opd-stream score: error: no sample was scored")
    out = _read(tmp_path / "out.jsonl")
    assert len(out) == 200 and not any(x["ok"] for x in out)
    refused = f"cannot connect to 127.0.0.1:{port}: Connection refused"
    unreachable = (
        f"teacher unreachable: every replica (127.0.0.1:{port}) has refused connections for "
    )
    for x in out:
        assert x["message"] == refused or x["message"].startswith(unreachable), x
    # once the teacher has refused for unreachable_after_s, the rest fail without an attempt
    assert out[-1]["attempts"] == 0 and out[-1]["message"].startswith(unreachable), out[-1]
    assert "unreachable_after_s=0.2); failed without retrying" in out[-1]["message"]


async def test_some_scored_and_some_failed_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "in.jsonl", [LINE, "{"])
    async with serve_mock("teacher", 1) as teacher:
        code = await _score(
            "--teacher",
            f"m={teacher.url}",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
        )
    assert code == 0
    assert "no sample was scored" not in capsys.readouterr().err


# --- usage and file errors come before torch ------------------------------------------------
_BEFORE_TORCH = """
import sys
from opd_stream.cli._main import main
code = main(sys.argv[1:])
print("torch loaded:", "torch" in sys.modules, file=sys.stderr)
raise SystemExit(code)
"""


def _usage_case(tmp: Path, case: str) -> list[str]:
    good = tmp / "in.jsonl"
    _write(good, [LINE])
    files = {
        "missing input": ["--input", str(tmp / "missing.jsonl"), "--output", str(tmp / "o")],
        "unwritable output": ["--input", str(good), "--output", str(tmp / "no-dir" / "o")],
        "output is the input": ["--input", str(good), "--output", str(good)],
        "bad teacher": ["--input", str(good), "--output", str(tmp / "o")],
    }[case]
    teacher = "math" if case == "bad teacher" else "http://127.0.0.1:9"
    return ["score", "--teacher", teacher, *files]


@pytest.mark.parametrize(
    "case", ["missing input", "unwritable output", "output is the input", "bad teacher"]
)
def test_usage_and_file_errors_come_before_torch_is_imported(tmp_path: Path, case: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _BEFORE_TORCH, *_usage_case(tmp_path, case)],
        capture_output=True,
        text=True,
        env=subprocess_env(OPD_STREAM_KL_DEVICE="auto"),  # auto: building the stream imports torch
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[-1] == "torch loaded: False", proc.stderr
    assert len(lines) == 2 and lines[0].startswith("opd-stream score: error: "), proc.stderr
    assert (tmp_path / "in.jsonl").read_text() == json.dumps(LINE) + "\n"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("existing", [True, False])
async def test_a_configuration_the_stream_refuses_leaves_the_output_as_it_was(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    existing: bool,
) -> None:
    _write(tmp_path / "in.jsonl", [LINE])
    out = tmp_path / "out.jsonl"
    if existing:
        out.write_text("earlier results\n")
    monkeypatch.setenv("OPD_STREAM_KL_DEVICE", "cuda:99")  # found out when torch is there
    argv = ["--teacher", "http://127.0.0.1:9", "--input", str(tmp_path / "in.jsonl")]
    code = await _score(*argv, "--output", str(out))
    err = capsys.readouterr().err
    assert code == 2
    assert "opd-stream score: error: configuration: kl_device: 'cuda:99'" in err
    if existing:
        assert out.read_text() == "earlier results\n"  # opened, never truncated
    else:
        assert not out.exists()


# --- Ctrl-C at start-up ---------------------------------------------------------------------
def _loaded(line: str, module: str) -> bool:
    """Whether an ``-X importtime`` line says ``module`` (or one of its submodules) loaded."""
    if not line.startswith("import time:"):
        return False
    name = line.rsplit("|", 1)[-1].strip()
    return name == module or name.startswith(module + ".")


@pytest.mark.parametrize(
    "milestone",
    [
        "opd_stream._errors",  # main() has just begun to load the package
        "numpy",  # the configuration's modules load
        "opd_stream._stream",  # the stream's modules load (the parser is being built)
        "torch",  # the stream is being built: torch loads
    ],
)
def test_ctrl_c_at_start_up_is_one_line_and_exit_130(tmp_path: Path, milestone: str) -> None:
    _write(tmp_path / "in.jsonl", [LINE] * 10)
    cmd = [sys.executable, "-X", "importtime", "-m", "opd_stream", "score", "--no-progress"]
    files = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")]
    proc = subprocess.Popen(
        [*cmd, "--teacher", "http://127.0.0.1:9", *files],
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(OPD_STREAM_KL_DEVICE="cpu"),
        cwd=ROOT,
    )
    assert proc.stderr is not None
    try:
        # -X importtime writes a line as each module has loaded: SIGINT once the milestone
        # module (or a first one of its submodules) is there, at that point of the start-up
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if _loaded(line, milestone):
                break
        else:
            pytest.fail(f"{milestone} was never imported:\n" + "".join(seen[-20:]))
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    # (the kernels' loader thread may be importing too: its -X importtime lines can land
    # inside our line; each runs from "import time:" to its end of line)
    said = re.sub(r"import time:[^\n]*\n?", "", rest).splitlines()
    assert proc.returncode == 130, rest[-3000:]
    assert said == ["opd-stream score: interrupted"], said


# --- --teacher URL ----------------------------------------------------------------------------
async def test_teacher_url_without_a_name_is_the_teacher_default(tmp_path: Path) -> None:
    _write(tmp_path / "in.jsonl", [LINE, {**LINE, "teacher": "default"}])
    async with serve_mock("teacher", 1) as teacher:
        code = await _score(
            "--teacher",
            teacher.url,
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
        )
    out = _read(tmp_path / "out.jsonl")
    assert code == 0
    assert [(x["ok"], x["teacher"]) for x in out] == [(True, "default")] * 2


def test_teacher_urls_without_names_cannot_be_mixed_with_named_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "in.jsonl", [LINE])
    argv = ["--teacher", "http://h:1", "--teacher", "m=http://h:2"]
    files = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")]
    assert main(["score", *argv, *files]) == 2
    assert "mixes plain URLs and NAME=URL entries" in capsys.readouterr().err


# --- what a failure says ------------------------------------------------------------------------
NGINX_502 = (
    b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n"
    b"</body>\r\n</html>\r\n"
)


@pytest.mark.parametrize(
    ("body", "summary"),
    [
        (NGINX_502, "an HTML page titled '502 Bad Gateway'"),
        (
            b'<!DOCTYPE HTML>\n<html lang="en"><head><meta charset="utf-8">\n'
            b"<title>Error response</title></head><body><p>Error code: 404</p>",
            "an HTML page titled 'Error response'",
        ),
        (
            b"  <html><body><p>" + b"x" * 5000 + b"</p></body></html>",
            "an HTML page without a title",
        ),
        (b"<title>A &amp; B\n  C</title>", "an HTML page titled 'A & B C'"),
    ],
)
def test_an_html_error_page_is_summarised_by_its_title(body: bytes, summary: str) -> None:
    message = str(ServerHTTPError(502, parse_error_message(body)))
    assert message.startswith(f"HTTP 502: {summary}")
    assert "<" not in message and len(message) < 200


def test_a_text_body_that_is_not_html_is_still_shown() -> None:
    assert parse_error_message(b"upstream connect error <title>x</title>").startswith("upstream")


async def test_an_html_answer_from_a_plain_web_server_fails_with_status_and_title(
    tmp_path: Path,
) -> None:
    async def not_found(request: web.Request) -> web.Response:
        page = b"<!doctype html><html><head><title>404 Not Found</title></head><body>...</body>"
        return web.Response(status=404, body=page, content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", not_found)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        _write(tmp_path / "in.jsonl", [LINE])
        code = await _score(
            "--teacher",
            f"http://127.0.0.1:{port}",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
        )
    finally:
        await runner.cleanup()
    (line,) = _read(tmp_path / "out.jsonl")
    assert code == 1
    # every dialect's path tried (engine="auto": a 404 on /generate makes the stream ask
    # vLLM's two), each one's status named, and the page's title
    assert line["reason"] == "capability"
    assert line["message"].startswith(f"no scoring API found at http://127.0.0.1:{port}: ")
    assert "an HTML page titled '404 Not Found'" in line["message"]
    for path in ("/generate", "/inference/v1/generate", "/v1/completions"):
        assert f"POST {path} answered 404" in line["message"]


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        (b'{"prompt_ids": [1], "response_ids": [2], "prompt_ids": [3]}', "prompt_ids", "twice"),
        (b'{"prompt_ids": [1], "response_ids": [2], "prompt\\u005fids": [3]}', "prompt_ids", ""),
        (b'{"tokens": [1, 2], "response_length": 1, "response_length" : 1}', "response_length", ""),
        (
            b'{"prompt_ids": [1], "response_ids": [2], "teacher": "a", "teacher": null}',
            "teacher",
            "",
        ),
        (
            b'{"prompt_ids": [1], "response_ids": [2], '
            b'"metadata": {"k": {"SECRET": 1, "SECRET": 2}}}',
            "metadata",
            "holds an object that gives a key twice",
        ),
        (
            b'{"id": {"SECRET": 1, "SECRET": 1}, "prompt_ids": [1], "response_ids": [2]}',
            "id",
            "holds an object",
        ),
    ],
)
def test_a_key_given_twice_fails_its_line_naming_the_key(
    data: bytes, field: str, words: str
) -> None:
    with pytest.raises(InvalidSampleError) as info:
        decode_line(data, line=1, seq=0)
    assert info.value.reason == "invalid_sample" and info.value.field == field
    assert words in str(info.value) and "SECRET" not in str(info.value)


@pytest.mark.parametrize(
    "data",
    [
        b'{"prompt_ids": [1], "response_ids": [2], "metadata": {"a": "x:y", "b": {"a": 1}}}',
        b'{"prompt_ids": [1], "response_ids": [2], "metadata": {"a:b": 1, "c": "\\"d\\":"}}',
        b'{"prompt_ids": [1], "response_ids": [2], "teacher": null, "metadata": {"t": "::"}}',
        b'{"id": {"a": {"a": 1}}, "prompt_ids": [1], "response_ids": [2], "metadata": {"a": 1}}',
        b'{"prompt_ids": [1], "response_ids": [2], "student_top_logprobs": [[[-0.1, 5, ":"]]]}',
    ],
)
def test_the_same_key_in_different_objects_and_colons_in_strings_are_fine(data: bytes) -> None:
    decode_line(data, line=1, seq=0)


def test_a_line_with_a_repeated_key_fails_alone() -> None:
    good = json.dumps(LINE).encode()
    dup = b'{"prompt_ids": [1], "response_ids": [2], "response_ids": [3]}'
    chunks = [good + b"\n" + dup + b"\n" + good + b"\n", b""]

    class _Source:
        def read1(self, size: int = -1) -> bytes:
            return chunks.pop(0)

    reader = LineReader(_Source(), lambda d, n, s: decode_line(d, line=n, seq=s))  # type: ignore[arg-type]
    batch = reader.read_batch()
    assert batch is not None and len(batch) == 3
    failure = batch[1]
    assert not hasattr(failure, "tokens")
    assert failure.reason == "invalid_sample"  # type: ignore[union-attr]
    assert failure.message == "response_ids: the key is given twice"  # type: ignore[union-attr]


async def test_a_routing_failure_does_not_repeat_the_teacher_name_of_the_line(
    tmp_path: Path,
) -> None:
    _write(tmp_path / "in.jsonl", [{**LINE, "teacher": "poetry-PAYLOAD"}])
    async with serve_mock("teacher", 1) as teacher:
        await _score(
            "--teacher",
            f"math={teacher.url}",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
        )
    (line,) = _read(tmp_path / "out.jsonl")
    assert line["reason"] == "routing"
    assert "PAYLOAD" not in line["message"] and "poetry" not in line["message"]
    assert "['math']" in line["message"]


# --- which parser runs ----------------------------------------------------------------------------
@pytest.mark.parametrize("disabled", [False, True])
def test_config_names_the_answer_parser(disabled: bool) -> None:
    import importlib.util

    env = subprocess_env(NUMBA_DISABLE_JIT="1") if disabled else subprocess_env()
    env.pop("NUMBA_DISABLE_JIT", None) if not disabled else None
    proc = run_module("opd_stream", "config", env=env)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.splitlines()[-1]
    if disabled:
        assert last.startswith("answer parser: msgspec ")
        assert last.endswith("(the compiled scanner is unavailable: NUMBA_DISABLE_JIT is set)")
    elif importlib.util.find_spec("numba") is not None:
        assert last.startswith("answer parser: the compiled scanner (numba ")
    else:
        assert last.endswith("(the compiled scanner is unavailable: numba is not installed)")


async def test_score_says_in_one_line_when_the_scanner_is_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from opd_stream.cli import _parser_notice

    _write(tmp_path / "in.jsonl", [LINE])
    files = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    async with serve_mock("teacher", 1) as teacher:
        monkeypatch.setattr(_parser_notice, "unavailable_reason", lambda: None)
        assert await _score("--teacher", teacher.url, *files) == 0
        quiet = capsys.readouterr().err
        monkeypatch.setattr(_parser_notice, "unavailable_reason", lambda: "numba is not installed")
        assert await _score("--teacher", teacher.url, *files) == 0
        noted = capsys.readouterr().err
    assert "note:" not in quiet
    notes = [x for x in noted.splitlines() if "note:" in x]
    assert notes == [
        "opd-stream score: note: the compiled answer scanner is unavailable (numba is not "
        "installed); answers are parsed with msgspec, several times slower"
    ]


def test_the_repeated_key_bench_runs() -> None:
    proc = run_module("bench.line_keys_micro", "--response", "8", "--k", "2", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("x |") == 3  # no timing asserted: the bench runs


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        ("respons_ids", "unknown field `respons_ids`"),  # a misspelt field: named
        ("SECRET payload, as text", "unknown field (a key that is no field name; not shown)"),
        ("x" * 41, "unknown field (a key that is no field name; not shown)"),
    ],
)
def test_an_unknown_key_is_named_only_when_it_looks_like_a_field(key: str, shown: str) -> None:
    data = json.dumps({**LINE, key: 1}).encode()
    with pytest.raises(InvalidSampleError) as info:
        decode_line(data, line=1, seq=0)
    assert str(info.value) == f"schema: Object contains {shown}"
