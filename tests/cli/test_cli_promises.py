"""Issue 32, section 3: the ``opd-stream`` command does what its docs say.

A configuration failure (a missing ``[xtok]`` extra) is one line and exit 2 before the
output is touched; an ensemble is a ``--teacher`` value of the teacher ``default``; a full
output device exits 2 with its message, and the command returns only when no thread of
ours runs Python any more (such a thread during the interpreter's shutdown aborted the
process, exit 134); ``probe`` takes ``--log-level``; the "compiling ... for the first
time" line is not repeated while another process compiles.

Mock servers on 127.0.0.1, started and stopped here; the values are the independent
references' (``pipeline_reference``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from support.cli import ROOT, run_cli, subprocess_env
from support.pipeline_reference import MixtureTeacher, expected_result

from opd_stream.cli._main import main
from opd_stream.scanner import _loader
from opd_stream.testing.mock_sglang import serve_mock


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # serve_mock runs on asyncio


pytestmark = pytest.mark.usefixtures("cli_env")

_score = partial(run_cli, "--log-level", "warning", "score")  # in a worker thread
_NOTICE = "compiling the answer scanner for the first time"


def _write_lines(path: Path, lines: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _rollouts(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 8)), int(rng.integers(1, 6))
        tokens = rng.integers(0, 5000, p + r).tolist()
        out.append({"id": i, "prompt_ids": tokens[:p], "response_ids": tokens[p:]})
    return out


@contextlib.contextmanager
def _sessions() -> Iterator[list[subprocess.Popen[Any] | int]]:
    """A list to put processes (or their ids) in, each the leader of a session: every
    process of each session is killed at the end (and a ``Popen`` waited for)."""
    leaders: list[subprocess.Popen[Any] | int] = []
    try:
        yield leaders
    finally:
        for leader in leaders:
            pid = leader if isinstance(leader, int) else leader.pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            if not isinstance(leader, int):
                leader.communicate()


# --- a configuration failure: one line, exit 2, the output untouched -------------------------

#: ``tokenizers``, ``jinja2`` and ``tiktoken`` (the ``[xtok]`` extra) cannot be imported.
_NO_XTOK = textwrap.dedent(
    """
    import sys

    class _NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("tokenizers", "jinja2", "tiktoken"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
    """
)


def test_a_missing_xtok_extra_is_one_line_and_exit_2_and_the_output_is_untouched(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "no_xtok"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_NO_XTOK)
    (tmp_path / "tokenizer.json").write_text("{}")  # never read: the import fails first
    _write_lines(tmp_path / "in.jsonl", [{"prompt_ids": [1], "response_ids": [2]}])
    kept = tmp_path / "kept.jsonl"
    kept.write_bytes(b'{"an earlier": "run"}\n')
    env = subprocess_env(
        PYTHONPATH=os.pathsep.join([str(ROOT), str(blocker)]), OPD_STREAM_KL_DEVICE="cpu"
    )
    for output in (kept, tmp_path / "new.jsonl"):
        argv = ["score", "--teacher", "t=http://127.0.0.1:9", "--no-progress"]
        argv += ["--student-tokenizer", str(tmp_path / "tokenizer.json")]
        argv += ["--teacher-tokenizer", f"t={tmp_path / 'tokenizer.json'}"]
        argv += ["--input", str(tmp_path / "in.jsonl"), "--output", str(output)]
        proc = subprocess.run(
            [sys.executable, "-m", "opd_stream", *argv],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == [
            "opd-stream score: error: configuration: student_tokenizer: a teacher with "
            "another tokenizer needs the 'tokenizers' package (pip install 'opd-stream[xtok]')"
        ]
    assert kept.read_bytes() == b'{"an earlier": "run"}\n'
    assert not (tmp_path / "new.jsonl").exists()


# --- an ensemble as the teacher 'default' ----------------------------------------------------


async def test_an_ensemble_is_a_value_of_the_teacher_default(tmp_path: Path) -> None:
    lines = _rollouts(np.random.default_rng(32), 4)
    _write_lines(tmp_path / "in.jsonl", lines)
    files = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    async with serve_mock("teacher", 1) as t1, serve_mock("teacher", 2, replicas=2) as t2:
        teacher = f"0.25*{t1.url};0.75*{'|'.join(t2.urls)}"  # as the README spells it
        assert await _score("--teacher", teacher, *files, "--no-progress") == 0
    mixture = MixtureTeacher([t1.model, t2.model], [0.25, 0.75])
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(x["id"] for x in out) == [0, 1, 2, 3]
    for got in out:
        line = lines[got["id"]]
        assert got["ok"] is True and got["teacher"] == "default", got
        exp = expected_result(
            tokens=line["prompt_ids"] + line["response_ids"],
            response_length=len(line["response_ids"]),
            teacher=mixture,
            student=t1.model,
            top_k=0,
            strategy="only-student",
            weight_mode="student_p",
        )
        for g, e in zip(got["teacher_logprobs"], exp.teacher_logprobs, strict=True):
            assert abs(g - e) <= 1e-6 * abs(e), (g, e)


async def test_probe_takes_an_ensemble_of_the_teacher_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with serve_mock("teacher", 1, replicas=2) as t1, serve_mock("teacher", 2) as t2:
        code = await run_cli("probe", "--teacher", f"0.5*{'|'.join(t1.urls)};0.5*{t2.url}")
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] is True
    probed = sorted((r["teacher"], r["url"]) for r in report["replicas"])
    members = [("default member 1", url) for url in t1.urls] + [("default member 2", t2.url)]
    assert probed == sorted(members)  # each member's replicas compared among themselves


def test_an_ensemble_with_other_values_of_the_teacher_default_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_lines(tmp_path / "in.jsonl", [{"prompt_ids": [1], "response_ids": [2]}])
    files = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    ensemble = "0.5*http://127.0.0.1:9;0.5*http://127.0.0.1:10"
    argv = ["--teacher", ensemble, "--teacher", "http://127.0.0.1:11"]
    assert main(["score", *argv, *files]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opd-stream score: error: --teacher: an ensemble (W*URLS;W*URLS) is one")
    assert not (tmp_path / "out.jsonl").exists()


# --- a full output device -------------------------------------------------------------------

#: ``opd-stream ARGV`` in a process of its own; then the daemon threads still alive.
_AND_THREADS = textwrap.dedent(
    """
    import sys, threading
    from opd_stream.cli._main import main

    code = main(sys.argv[1:])
    print(sorted(t.name for t in threading.enumerate() if t.daemon and t.is_alive()))
    sys.exit(code)
    """
)


async def test_a_full_output_device_exits_2_with_no_thread_of_ours_left_running(
    tmp_path: Path,
) -> None:
    # A daemon thread running Python while the interpreter shuts down aborted the process
    # ("terminate called without an active exception", exit 134, 3 runs in 11): the
    # scanner's, still importing numba (a garbage collection there freed a tensor of the
    # run). numba's cache is cold here, so that thread would be busy for many seconds.
    (tmp_path / "script.py").write_text(_AND_THREADS)
    _write_lines(tmp_path / "in.jsonl", [{"prompt_ids": [1, 2], "response_ids": [3]}] * 3)
    env = subprocess_env(OPD_STREAM_KL_DEVICE="cpu", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env.pop("NUMBA_DISABLE_JIT", None)
    async with serve_mock("teacher", 1) as teacher:
        argv = ["score", "--teacher", f"t={teacher.url}", "--no-progress"]
        argv += ["--input", str(tmp_path / "in.jsonl"), "--output", "/dev/full"]
        with (
            _sessions() as sessions,
            (tmp_path / "out.txt").open("wb") as out_file,
            (tmp_path / "err.txt").open("wb") as err_file,
        ):
            proc = await anyio.open_process(
                [sys.executable, str(tmp_path / "script.py"), *argv],
                stdout=out_file,
                stderr=err_file,
                env=env,
                cwd=tmp_path,
                start_new_session=True,  # the compiling process outlives it, killed here
            )
            sessions.append(proc.pid)
            with anyio.fail_after(180):
                code = await proc.wait()
    out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert code == 2, err
    assert "terminate called" not in err and "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"opd-stream score: error: cannot write output: {os.strerror(errno.ENOSPC)}"
    )
    assert out.splitlines() == ["[]"]  # the scanner's thread ended before main returned


# --- probe --log-level ----------------------------------------------------------------------


async def test_probe_takes_log_level_after_the_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with serve_mock("teacher", 1, replicas=2) as teacher:
        url = "|".join(teacher.urls)
        assert await run_cli("probe", "--teacher", f"t={url}", "--log-level", "info") == 0
        loud = capsys.readouterr()
        assert await run_cli("probe", "--teacher", f"t={url}") == 0
        quiet = capsys.readouterr()
    assert json.loads(loud.out)["ok"] is True and json.loads(quiet.out)["ok"] is True
    events = [json.loads(x)["event"] for x in loud.err.splitlines() if x.startswith("{")]
    assert "stream_started" in events
    assert "stream_started" not in quiet.err


# --- the compile notice, once across processes ----------------------------------------------


def _holds_lock(path: Path) -> bool:
    """Whether another process holds the exclusive lock on ``path``."""
    with path.open("rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="sessions, flock, SIGSTOP")
def test_the_compile_notice_is_not_repeated_while_another_process_compiles(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "NUMBA_CACHE_DIR": str(tmp_path / "numba"),  # cold
        "TMPDIR": str(tmp_path),  # where the compiling processes take their lock
        "PYTHONPATH": str(ROOT),
        "OPD_STREAM_KL_DEVICE": "cpu",
    }
    env.pop("NUMBA_DISABLE_JIT", None)
    popen = partial(subprocess.Popen, env=env, cwd=tmp_path, start_new_session=True)
    with _sessions() as sessions:
        # an earlier command's compiling process (as the scanner's loader starts it), held
        # still once it holds its lock: it is compiling for as long as this test runs
        first = popen([sys.executable, "-c", _loader._CHILD, str(ROOT)])
        sessions.append(first)
        deadline = time.monotonic() + 120
        while not any(_holds_lock(p) for p in tmp_path.glob("opd_stream-kernels-*.lock")):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)
        # a demo long enough that the kernels' thread looks at the (cold) cache before it ends
        demo = ["demo", "--samples", "64", "--response-len", "512", "--no-progress"]
        proc = popen(
            [sys.executable, "-m", "opd_stream", *demo],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        sessions.append(proc)
        _, err = proc.communicate(timeout=300)
        # the demo's thread found the cache cold: its own compiling process waits for the
        # lock (so the demo did look, and had a notice to print or not)
        assert _session_alive(proc.pid), "the demo ended before its thread saw the cache"
    assert proc.returncode == 0, err[-2000:]
    assert _NOTICE not in err, err


def _session_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_probe_deadline_flag_names_a_hanging_replica(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with serve_mock("teacher", 1, replicas=2) as fleet:
        fleet.set_options(1, fault_hang=1.0)
        code = await run_cli("probe", "--teacher", "|".join(fleet.urls), "--deadline-s", "0.5")
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["ok"] is False
    assert report["failed"] == [fleet.urls[1]]
    (hung,) = [r for r in report["replicas"] if r["url"] == fleet.urls[1]]
    assert hung["error"] == "deadline_exceeded", hung


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_probe_deadline_flag_out_of_range_is_a_usage_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["probe", "--teacher", "http://127.0.0.1:9", "--deadline-s", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opd-stream probe: error: configuration:"), err
    assert "probe_deadline_s" in err, err
