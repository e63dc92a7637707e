"""The package's rooms: each subpackage holds one part of the pipeline, says in its docstring
what every module in it holds, and the rooms import one another in one direction only.

A room is a subpackage of ``opd_stream`` (``config``, ``wire``, ``kl`` ...); a module at the
top level is a room of its own. The checks read the source (``ast``), never import it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "opd_stream"
#: Rooms that hold tools around the library, which the library itself never imports.
OUTSIDE = ("cli", "testing", "integrations")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The ``opd_stream`` modules ``path`` imports (at any depth: lazy imports count)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names] if not node.module else []
            out.update(n for n in [target, *names] if n.startswith("opd_stream"))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("opd_stream"))
    return out


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "opd_stream"
    sub = PACKAGE / parts[1]
    return parts[1] if sub.is_dir() else module


def room_graph() -> dict[str, dict[str, list[str]]]:
    """``{room: {imported room: [importing module -> imported module, ...]}}``."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _module(path)
        for target in _imports(path):
            a, b = _room(source), _room(target)
            if a != b and "opd_stream" not in (a, b):
                graph.setdefault(a, {}).setdefault(b, []).append(f"{source} -> {target}")
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Every strongly connected set of more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_the_rooms_import_one_another_in_one_direction() -> None:
    graph = room_graph()
    found = cycles(graph)
    detail = [
        f"{a} -> {b}: {graph[a][b][:3]}"
        for group in found
        for a in group
        for b in group
        if b in graph.get(a, {})
    ]
    assert not found, detail


def test_the_cycle_check_sees_a_cycle() -> None:
    graph = {"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"]}, "d": {"a": ["w"]}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_library_never_imports_the_tools_around_it() -> None:
    # the command line, the testing kit and the framework adapters import the library,
    # never the other way round
    graph = room_graph()
    wrong = {
        f"{a} -> {b}": graph[a][b][:3]
        for a in graph
        for b in graph[a]
        if b in OUTSIDE and a not in OUTSIDE and a != "opd_stream.__main__"  # the command
    }
    assert not wrong, wrong


#: What drives a stream: the package's public face (``OPDStream``), the stream and its stages.
_DRIVES_A_STREAM = ("opd_stream._stream", "opd_stream._pipeline", "opd_stream.fetch")


def test_the_testing_kit_serves_and_never_drives_a_stream() -> None:
    # opd_stream.testing ships in the wheel for users' tests (mock servers, the in-process
    # transport, log capture); the project's own machinery that drives streams against them
    # (the fault matrix) lives in tests/support
    wrong = {
        _module(path): sorted(
            m for m in _imports(path) if m == "opd_stream" or m.startswith(_DRIVES_A_STREAM)
        )
        for path in sorted((PACKAGE / "testing").rglob("*.py"))
    }
    assert {module: found for module, found in wrong.items() if found} == {}


@pytest.mark.parametrize(
    "room",
    sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py") if p.parent.name != "__pycache__"),
)
def test_a_rooms_docstring_names_each_of_its_modules(room: str) -> None:
    init = PACKAGE / room / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    modules = sorted(p.stem for p in (PACKAGE / room).glob("_*.py") if p.stem != "__init__")
    missing = [m for m in modules if f"``{m}``" not in doc and f"{room}.{m}" not in doc]
    assert not missing, f"opd_stream/{room}/__init__.py does not say what {missing} hold"


def test_the_settings_load_neither_torch_nor_numba() -> None:
    # a configuration error is reported before the heavy imports (the CLI, a host's
    # start-up); kl's choices are torch-free names, its math loads torch on first use
    code = (
        "import sys\n"
        "from opd_stream import StreamConfig\n"
        "from opd_stream.kl import STRATEGIES\n"
        "StreamConfig(teachers={'default': 'http://127.0.0.1:1'})\n"
        "print(sorted(m for m in ('torch', 'numba') if m in sys.modules))\n"
        "from opd_stream.kl import topk_reverse_kl\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"]
