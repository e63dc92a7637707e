"""The tests are untangled (issue 28): no test module imports another test module or
``bench``; what several tests share lives in ``tests/support``; ``bench`` imports nothing
from the tests (code both need lives in ``opd_stream.testing``, or in ``tests/support``, which
``bench`` reads by path: the fault matrix).

The tests mirror the package (issue 36): the tests of a room are in the folder of that room
(``tests/kl/``, ``tests/wire/`` ...), those of the whole stream (the package's top level) and
of the project (docs, CI, layout) in ``tests/system/``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
#: The folder of tests of the whole stream (the package's top level) and of the project.
SYSTEM = "system"
#: The folder of what several tests share; it holds no test.
SUPPORT = "support"


def folders_of_tests(tests: Path) -> list[Path]:
    """The folders of ``tests`` that hold tests (each a package: see ``support/__init__.py``);
    a tool's hidden folder (``.hypothesis/``, written where pytest runs) is none."""
    skip = {SUPPORT, "__pycache__"}
    return sorted(
        p for p in tests.iterdir() if p.is_dir() and p.name not in skip and p.name[0] != "."
    )


def rooms(package: Path) -> set[str]:
    """The rooms of ``package`` a folder of tests is named after: its subpackages."""
    return {p.parent.name for p in package.glob("*/__init__.py")}


def layout_problems(tests: Path, rooms: set[str]) -> list[str]:
    """What in ``tests`` is not where the layout puts it: every test file in the folder of
    its room or in ``system/``, each such folder named after a room and a package."""
    folders = rooms | {SYSTEM}
    problems = [
        f"{rel.as_posix()}: not in a room's folder or {SYSTEM}/"
        for rel in (p.relative_to(tests) for p in sorted(tests.rglob("test_*.py")))
        if len(rel.parts) != 2 or rel.parts[0] not in folders
    ]
    for folder in folders_of_tests(tests):
        if folder.name not in folders:
            problems.append(f"{folder.name}/: no room of the package is named so")
        elif not (folder / "__init__.py").is_file():
            problems.append(f"{folder.name}/: no __init__.py")
    return problems


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


#: A test module is also ``<folder>.test_x`` (its folder is a package): no folder either.
TEST_FORBIDDEN = (
    "test_*",
    "bench",
    "tests",
    "conftest",
    *(p.name for p in folders_of_tests(TESTS)),
)


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
        "from kl.test_kl import Case",
    ],
)
def test_the_check_sees_a_planted_import(line: str) -> None:
    assert forbidden_imports(line, TEST_FORBIDDEN) != []


def test_the_check_lets_support_and_the_library_through() -> None:
    ok = "from support.config import stream_config\nimport opd_stream.testing.mock_sglang\n"
    assert forbidden_imports(ok + "from .x import y\nimport benchmarks\n", TEST_FORBIDDEN) == []


def test_each_test_file_lives_in_the_folder_of_a_room_or_system() -> None:
    assert layout_problems(TESTS, rooms(ROOT / "opd_stream")) == []


def test_the_layout_check_sees_a_misplaced_test(tmp_path: Path) -> None:
    for name in (
        "test_top.py",
        "kl/__init__.py",
        "kl/test_ok.py",
        "kl/deep/test_deep.py",
        "support/test_helper.py",
        "nowhere/__init__.py",
        "wire/test_wire.py",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert layout_problems(tmp_path, {"kl", "wire"}) == [
        "kl/deep/test_deep.py: not in a room's folder or system/",
        "support/test_helper.py: not in a room's folder or system/",
        "test_top.py: not in a room's folder or system/",
        "nowhere/: no room of the package is named so",
        "wire/: no __init__.py",
    ]
