"""A guest must not stall the host's loop (issue 32, item 2): no call of ours holds a
running event loop more than 50 ms, first use included (torch's import, the HTTP client,
the compiled scanner's loading, the first run and the first per-call sample).

Each check runs a host in a fresh process (``tests/support/loop_stall.py``: nothing of
torch loaded before its loop runs), on asyncio and on trio, against mock SGLang servers on
127.0.0.1; the host's heartbeat task measures the stalls. The measure holds on a busy
machine: a stall counts the process's own CPU time only (other processes taking the cores
do not lengthen it) and leaves out the garbage collector's passes (the support module's
docstring says why); the report it asserts on names the host's work each stall fell in.

What the measure cannot take out is a busy machine slowing the CPU work itself (shared
caches, a hyperthread's sibling): torch's C initialiser, 15-25 ms here alone, read 55-80 ms
inside CI runs. So a host whose worst stall goes over the limit is run again, in a fresh
process, up to three times; if every run goes over, a host that only imports torch as a
stream does (the floor: torch's own import, which no code of ours can split) runs twice.
The check holds if one run keeps under the limit, or under 1.5 times the floors' worst
stall plus 10 ms (a stream's start runs aiohttp's and numba's C initialisers besides
torch's, each slowed as much by a busy machine): a hold of ours shows in every run and
beyond the floor's scale; every report is in the failure's message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.xtok_vocabs import family_dir, family_vocab

import opd_stream
from opd_stream.testing.mock_sglang import MockProcess

SCRIPT = Path(__file__).parents[1] / "support" / "loop_stall.py"
ROOT = Path(opd_stream.__file__).resolve().parents[1]
LIMIT_S = 0.050
RUNS = 3
FLOORS = 2
FLOOR_SCALE = 1.5


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPD_STREAM_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run_host(args: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=260,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got: dict[str, Any] = json.loads(proc.stdout)
    assert got["beats"] > 20, got  # it measured what it says
    return got


def _host(args: list[str]) -> list[dict[str, Any]]:
    """Run the host with ``args`` and return its reports: while every run's worst stall is
    over the limit, a fresh host, up to ``RUNS``; then, if all were over, the torch-only
    host (the floor) ``FLOORS`` times, last in the list (see the module's docstring)."""
    runs = [_run_host(args)]
    while len(runs) < RUNS and all(got["stall_s"] > LIMIT_S for got in runs):
        runs.append(_run_host(args))
    if all(got["stall_s"] > LIMIT_S for got in runs):
        floors = [_run_host([args[0], "-", "--torch-floor"]) for _ in range(FLOORS)]
        runs.extend({**floor, "floor": True} for floor in floors)
    return runs


def _held_too_long(runs: list[dict[str, Any]]) -> bool:
    ours = [got["stall_s"] for got in runs if not got.get("floor")]
    floors = [got["stall_s"] for got in runs if got.get("floor")]
    bound = max([LIMIT_S, *(FLOOR_SCALE * f + 0.010 for f in floors)])
    return bool(min(ours) > bound)


def _brief(runs: list[dict[str, Any]]) -> list[str]:
    """Each run's worst stall, the host's work it fell in, the next ones and the collector's
    longest pass, in a line (pytest would cut the reports short)."""
    keys = ("floor", "stall_s", "phases", "loop_cpu_s", "next_s", "max_gc_s", "beats")
    return [json.dumps({k: got.get(k) for k in keys}) for got in runs]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str]]:
    with MockProcess("teacher", 1) as teacher, MockProcess("student", 2) as student:
        yield teacher.url, student.url


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_no_call_of_ours_holds_a_cold_hosts_loop_over_50_ms(
    servers: tuple[str, str], backend: str
) -> None:
    if backend == "trio":
        pytest.importorskip("trio")
        pytest.importorskip("httpx", reason="trio's default transport is the httpx extra")
    runs = _host([backend, *servers])
    assert all(got["torch_loaded"] for got in runs), runs  # it measured what it says
    assert not _held_too_long(runs), _brief(runs)


RESPONSES = [
    "Hello, world! Größe café naïve — Zürich façade. 12345 + 678 = 13023.",
    "東京と北京、你好世界。Ελληνικά русский язык עברית العربية हिन्दी",
    "```python\ndef square(x):\n    return x * x  # 平方\n```\n",
    "emoji 🎉🎉 👍🏽 ❤️ 🇫🇷 <think>ok</think> done",
]


def _xtok_samples(tmp: Path, student_family: str, teacher_family: str) -> str:
    """The host's samples, computed here (the host's own process stays cold)."""
    student = family_vocab(student_family)
    teacher = family_vocab(teacher_family, "teacher_tokenizers[default]")
    prompt = "Question: say something in many scripts.\nAnswer: "
    samples = []
    for i, text in enumerate(RESPONSES * 3):
        prompt_ids, response = student.encode(prompt), student.encode(text)
        samples.append(
            {
                "tokens": [*prompt_ids.tolist(), *response.tolist()],
                "response_length": int(response.shape[0]),
                "rollout_logprobs": [-1.0] * int(response.shape[0]),
                "teacher_prompt_ids": teacher.encode(prompt).tolist(),
                "sample_id": i,
            }
        )
    path = tmp / "samples.json"
    given = {
        "student_tokenizer": family_dir(student_family),
        "teacher_tokenizer": family_dir(teacher_family),
        "samples": samples,
    }
    path.write_text(json.dumps(given), encoding="utf-8")
    return str(path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("backend", "student_family", "teacher_family"),
    # each backend and each direction once (the four pairs cost the suite ~30 s more; the
    # host's tables are the same code on both backends)
    [("asyncio", "qwen-3.5", "deepseek-v3"), ("trio", "deepseek-v3", "qwen-3.5")],
)
def test_loading_a_teachers_own_tokenizer_holds_a_cold_hosts_loop_under_50_ms(
    tmp_path: Path, backend: str, student_family: str, teacher_family: str
) -> None:
    if backend == "trio":
        pytest.importorskip("trio")
        pytest.importorskip("httpx", reason="trio's default transport is the httpx extra")
    samples = _xtok_samples(tmp_path, student_family, teacher_family)
    byte_model = ["--byte-model-tokenizer", family_dir(teacher_family), "--vocab-size", "262144"]
    with MockProcess("teacher", 1, extra_args=byte_model, startup_timeout=120) as teacher:
        runs = _host([backend, teacher.url, "--xtok", samples])
    # loading the tokenizers in this process held it 0.74 s; in their own processes, with the
    # host's tables built in short steps, 5-31 ms at a stretch
    assert not _held_too_long(runs), _brief(runs)


def test_building_a_stream_imports_neither_torch_nor_the_http_client() -> None:
    code = (
        "import sys\n"
        "from opd_stream import OPDStream, StreamConfig\n"
        "stream = OPDStream(StreamConfig.from_env({}, teachers='http://127.0.0.1:9'))\n"
        "print(sorted(m for m in ('torch', 'aiohttp', 'httpx', 'numba') if m in sys.modules))\n"
        "print(stream.stats().kl.device)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[]", "auto"]  # resolved when loaded
