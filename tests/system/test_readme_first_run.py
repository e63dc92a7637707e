"""The README's "Install and first run" section, run as a new user would run it.

* Its two mock servers are started with the section's own command lines (on free ports:
  the README's ports are replaced by the ones the servers picked).
* Its shell block (the three-line JSON Lines file, ``opd-stream score``, ``cat``) runs in
  bash, with ``opd-stream`` and ``python`` on the path, and prints the lines the README
  shows (numbers as shown, to 4 decimals; ``latency_s`` is a time, not compared).
* Its Python loop, saved as ``first_run.py``, prints the lines the README shows.
* Its install commands pin the torch that ``scripts/dev.sh`` installs and name extras that
  ``pyproject.toml`` declares.

So the first thing a user reads cannot go stale without a test failing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from opd_stream.testing._process import stop_process

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
_FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```$", re.S | re.M)
_SERVER = re.compile(r"127\.0\.0\.1:(?P<port>\d+)")


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of ``text``: (language, body)."""
    return [(m["lang"], m["body"]) for m in _FENCE.finditer(text)]


def first_run() -> dict[str, str]:
    """The section's blocks by role: install, servers, score, output, loop, printed."""
    found: dict[str, str] = {}
    for lang, body in blocks(section(README.read_text(), "Install and first run")):
        if lang == "bash" and "pip install" in body:
            role = "install"
        elif lang == "bash" and "mock_sglang" in body:
            role = "servers"
        elif lang == "bash" and "opd-stream score" in body:
            role = "score"
        else:
            role = {"json": "output", "python": "loop", "text": "printed"}[lang]
        assert role not in found, f"two {role} blocks"
        found[role] = body
    assert set(found) == {"install", "servers", "score", "output", "loop", "printed"}
    return found


def _env() -> dict[str, str]:
    """The test process's environment, with this checkout first on the import path."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def _start(command: str) -> tuple[subprocess.Popen[bytes], str]:
    """One server line of the README (``python -m ... --port N ... &``), on a free port;
    returns the process and the ``host:port`` it listens on."""
    argv = shlex.split(command.rstrip().removesuffix("&"))
    assert argv[0] == "python", command
    argv[0] = sys.executable
    argv[argv.index("--port") + 1] = "0"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_env())
    line: list[bytes] = []

    def read() -> None:
        assert proc.stdout is not None
        line.append(proc.stdout.readline())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    text = line[0].decode() if line else ""
    match = _SERVER.search(text)
    if not text.startswith("listening on http://") or match is None:
        stop_process(proc)
        pytest.fail(f"{command!r} printed {text!r}")
    return proc, match[0]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """The README's servers, started as it says: its ``host:port`` -> the real one."""
    commands = [line for line in first_run()["servers"].splitlines() if line.strip()]
    started: list[subprocess.Popen[bytes]] = []
    where: dict[str, str] = {}
    try:
        for command in commands:
            proc, real = _start(command)
            started.append(proc)
            argv = shlex.split(command)
            where[f"127.0.0.1:{argv[argv.index('--port') + 1]}"] = real
        yield where
    finally:
        for proc in started:
            stop_process(proc)


def _moved(text: str, where: dict[str, str]) -> str:
    for said, real in where.items():
        text = text.replace(said, real)
    return text


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items() if k != "latency_s"}
    return value


def test_the_score_command_writes_what_the_readme_shows(
    servers: dict[str, str], tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    shim = bin_dir / "opd-stream"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m opd_stream "$@"\n')
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {**_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    script = "set -euo pipefail\n" + _moved(first_run()["score"], servers)
    done = subprocess.run(
        ["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    shown = [json.loads(line) for line in first_run()["output"].splitlines()]
    written = [json.loads(line) for line in done.stdout.splitlines()]
    assert [_rounded(line) for line in written] == [_rounded(line) for line in shown]
    assert "opd-stream score: 3 samples, 2 ok, 1 failed (invalid_sample 1)" in done.stderr
    assert (work / "scored.jsonl").read_text() == done.stdout


def test_the_python_loop_prints_what_the_readme_shows(
    servers: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "first_run.py").write_text(_moved(first_run()["loop"], servers))
    done = subprocess.run(
        [sys.executable, "first_run.py"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # a guest prints nothing of its own
    # results come as they complete: the order of the lines is not part of the promise
    assert sorted(done.stdout.splitlines()) == sorted(first_run()["printed"].splitlines())


def test_the_install_commands_pin_the_tested_torch_and_name_real_extras() -> None:
    install = first_run()["install"]
    assert "pip install torch==2.13.0" in install
    assert '"torch==2.13.0"' in (ROOT / "scripts/dev.sh").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    named = re.findall(r"'\.\[(\w+)\]'", section(README.read_text(), "Install and first run"))
    assert {"xtok", "httpx"} <= set(named)
    assert set(named) <= set(extras), set(named) - set(extras)


# --- the checks find what they look for -----------------------------------------------------


def test_a_block_of_the_section_is_found_by_its_role() -> None:
    text = (
        "intro\n## Install and first run\n"
        "```bash\npip install .\n```\n```json\n{}\n```\n## Next\n```text\nnot this\n```\n"
    )
    assert blocks(section(text, "Install and first run")) == [
        ("bash", "pip install .\n"),
        ("json", "{}\n"),
    ]


def test_numbers_are_compared_as_shown_and_times_not_at_all() -> None:
    shown = {"reverse_kl": [0.3302, 0.834], "latency_s": 0.05}
    assert _rounded({"reverse_kl": [0.33019888, 0.83401268], "latency_s": 1.7}) == _rounded(shown)
    assert _rounded({"reverse_kl": [0.3312, 0.834], "latency_s": 0.05}) != _rounded(shown)
