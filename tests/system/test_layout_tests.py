"""The tests are untangled (issue 28): no test module imports another test module or
``bench``; what several tests share lives in ``tests/support``; ``bench`` imports nothing
from the tests (code both need lives in ``opd_stream.testing``, or in ``tests/support``, which
``bench`` reads by path: the fault matrix)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def forbidden_imports(source: str, forbidden: tuple[str, ...]) -> list[str]:
    """The modules ``source`` imports with an import statement, anywhere in it (top level or
    in a function), whose first dotted part matches ``forbidden`` (a name, or a prefix
    ending in ``*``)."""

    def hit(module: str) -> bool:
        top = module.split(".")[0]
        return any(top.startswith(f[:-1]) if f.endswith("*") else top == f for f in forbidden)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if hit(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and hit(node.module or ""):
            found.append(node.module)
    return found


TEST_FORBIDDEN = ("test_*", "bench", "tests", "conftest")


@pytest.mark.parametrize(
    "path",
    sorted([*TESTS.glob("*.py"), *TESTS.glob("*/test_*.py"), *TESTS.glob("support/*.py")]),
    ids=lambda p: str(p.relative_to(TESTS)),
)
def test_no_test_module_imports_another_test_module_or_bench(path: Path) -> None:
    assert forbidden_imports(path.read_text(encoding="utf-8"), TEST_FORBIDDEN) == []


@pytest.mark.parametrize("path", sorted(ROOT.glob("bench/*.py")), ids=lambda p: p.name)
def test_bench_imports_nothing_from_the_tests(path: Path) -> None:
    found = forbidden_imports(path.read_text(encoding="utf-8"), ("test_*", "tests", "support"))
    assert found == []


@pytest.mark.parametrize(
    "line",
    [
        "from test_fuzz_decode import FUZZ",
        "import test_kl_tail",
        "import numpy, bench.run",
        "from bench.reliability import MODES",
        "def f():\n    from bench import line_keys_micro",
        "from conftest import anyio_backend",
    ],
)
def test_the_check_sees_a_planted_import(line: str) -> None:
    assert forbidden_imports(line, TEST_FORBIDDEN) != []


def test_the_check_lets_support_and_the_library_through() -> None:
    ok = "from support.config import stream_config\nimport opd_stream.testing.mock_sglang\n"
    assert forbidden_imports(ok + "from .x import y\nimport benchmarks\n", TEST_FORBIDDEN) == []
