"""The package's rooms: each subpackage holds one part of the pipeline, says in its docstring
what every module in it holds, and the rooms import one another in one direction only.

A room is a subpackage of ``opd_stream`` (``config``, ``wire``, ``kl`` ...); a module at the
top level is a room of its own. The checks read the source (``ast``), never import it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable
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
            # ``from . import _x`` imports the module ``_x`` (its package is only a path)
            names = [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
            out.update(n for n in names if n.startswith("opd_stream"))
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
def test_a_rooms_docstring_points_to_the_one_module_map(room: str) -> None:
    # the modules are listed in one place, docs/internals.md's "Module map" (which
    # tests/system/test_docs_in_repo.py checks names them all); a room says what it is for
    # and points there, so no second list can go stale
    init = PACKAGE / room / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    assert '``docs/internals.md``, "Module map"' in doc, f"opd_stream/{room}/__init__.py"
    modules = sorted(p.stem for p in (PACKAGE / room).glob("_*.py") if p.stem != "__init__")
    listed = [m for m in modules if re.search(rf"^\s*[*-] ``{m}``", doc, re.M)]
    assert not listed, (
        f"opd_stream/{room}/__init__.py lists {listed}: the map is in docs/internals.md"
    )


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


# --- each room owns its code (issue 36) ---------------------------------------------------


def _defined_classes(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


def _where_defined(names: set[str]) -> dict[str, list[str]]:
    """``{class name: [module defining it, ...]}`` for ``names``, over the package."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in _defined_classes(path) & names:
            found.setdefault(name, []).append(_module(path))
    return found


def test_the_wires_model_lives_in_the_wire() -> None:
    # a decoded answer and one HTTP item as the decoders see it: the wire's own model
    found = _where_defined({"ScoreRows", "Generation", "Segment"})
    elsewhere = {n: ms for n, ms in found.items() if any(_room(m) != "wire" for m in ms)}
    assert sorted(found) == ["Generation", "ScoreRows", "Segment"]
    assert not elsewhere, elsewhere


def test_the_tokenizer_room_holds_its_glue_and_imports_no_sample_or_settings() -> None:
    # a stream's tokenizers for teachers with another tokenizer are the xtok room's, and it
    # takes plain values: neither the pipeline's sample types nor the settings
    found = _where_defined({"CrossTokenizers"})
    assert [_room(m) for m in found.get("CrossTokenizers", [])] == ["xtok"], found
    wrong = {
        _module(path): sorted(
            m for m in _imports(path) if m.startswith(("opd_stream._sample", "opd_stream.config"))
        )
        for path in sorted((PACKAGE / "xtok").glob("*.py"))
    }
    assert not {m: i for m, i in wrong.items() if i}, wrong


@pytest.mark.parametrize(
    ("gone", "home"),
    [
        ("_answers", "wire/_answers.py"),
        ("_cross", "xtok/_tokenizers.py (the KL stage's part: _scoring.py)"),
        ("_failures", "_pipeline.py"),
    ],
)
def test_a_rooms_code_is_not_at_the_top_level(gone: str, home: str) -> None:
    assert not (PACKAGE / f"{gone}.py").exists(), f"opd_stream/{gone}.py belongs in {home}"


#: Top-level modules with one importer that stay apart from it, and why.
ONE_IMPORTER_APART = {
    "opd_stream._scoring": "loads torch as it is imported: the pipeline imports it lazily",
    "opd_stream._memory": "a platform call (glibc through ctypes), and when a stream makes it",
}


def test_a_top_level_module_with_one_importer_lives_in_it() -> None:
    # a top-level module imported by one module only is part of that module (or of its
    # room), unless it has a reason to stay apart
    top = {_module(p) for p in PACKAGE.glob("_*.py") if p.stem not in ("__init__", "__main__")}
    importers: dict[str, set[str]] = {m: set() for m in top}
    for path in sorted(PACKAGE.rglob("*.py")):
        for target in _imports(path) & top:
            if target != _module(path):
                importers[target].add(_module(path))
    alone = {m: sorted(i) for m, i in importers.items() if len(i) == 1}
    assert {m: i for m, i in alone.items() if m not in ONE_IMPORTER_APART} == {}
    assert sorted(ONE_IMPORTER_APART) == sorted(alone)  # the list holds no stale entry


def module_graph() -> dict[str, dict[str, list[str]]]:
    """``{module: {module of the same room it imports: [""]}}``, over every subpackage
    (lazy imports and ``TYPE_CHECKING`` ones included: a circle is one however it is cut)."""
    modules = {_module(p) for p in PACKAGE.rglob("*.py")}
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _module(path)
        room = _room(source)
        if room == source:  # a top-level module: a room of its own
            continue
        for target in _imports(path) & modules:
            if target != source and _room(target) == room:
                graph.setdefault(source, {})[target] = [""]
    return graph


def test_no_room_has_an_import_circle_inside() -> None:
    assert cycles(module_graph()) == []


def test_the_circle_check_sees_two_modules_of_a_room_importing_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    room = tmp_path / "opd_stream" / "room"
    room.mkdir(parents=True)
    (tmp_path / "opd_stream" / "__init__.py").write_text("")
    (room / "__init__.py").write_text("")
    (room / "_a.py").write_text("from ._b import B\nA = 1\n")
    (room / "_b.py").write_text("B = 1\n\ndef f():\n    from . import _a\n")
    (room / "_c.py").write_text("from ._a import A\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "opd_stream")
    assert cycles(module_graph()) == [["opd_stream.room._a", "opd_stream.room._b"]]


# ---------------------------------------------------------------- issue 36, item 2: the fleet

#: The top-level modules every room may import: the error tree, the logger, and the
#: answers' model (``_answers``: wire's, on its way into ``wire/``).
FOUNDATIONS = ("opd_stream._errors", "opd_stream._logging")


def _room_modules(room: str) -> list[Path]:
    return sorted((PACKAGE / room).rglob("*.py"))


def _where(found: Callable[[Path], set[str]], paths: list[Path]) -> dict[str, list[str]]:
    """``{module: sorted(found(path))}`` for the paths where ``found`` finds something."""
    out = {_module(p): sorted(found(p)) for p in paths}
    return {m: v for m, v in out.items() if v}


def _calls(path: Path) -> set[str]:
    """The names ``path`` calls (``f(...)`` and ``x.f(...)``: ``f``), at any depth."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                out.add(func.id)
            elif isinstance(func, ast.Attribute):
                out.add(func.attr)
    return out


def _third_party(path: Path) -> set[str]:
    """The top-level names of the modules ``path`` imports that are not ``opd_stream``'s."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return out - {"opd_stream"}


def test_the_fleet_imports_no_top_level_module_but_the_foundations() -> None:
    # the fleet's records live in fleet/ (not in _stats): the top level imports the fleet,
    # never the other way round
    wrong = _where(
        lambda p: {
            m
            for m in _imports(p)
            if _room(m) == m and m.count(".") == 1 and not m.startswith(FOUNDATIONS)
        },
        _room_modules("fleet"),
    )
    assert not wrong, wrong


#: What a sans-IO room never imports: an event loop, threads, a clock.
_IO = {"anyio", "asyncio", "trio", "sniffio", "threading", "concurrent", "time"}


def test_the_wire_is_sans_io() -> None:
    # bytes in, rows out: which step runs in a worker thread, and its timing, is the
    # fetch stage's (fetch/_threads)
    wrong = _where(lambda p: _third_party(p) & _IO, _room_modules("wire"))
    assert not wrong, wrong


def _defined(path: Path) -> set[str]:
    """The names ``path`` defines at its top level (functions and classes)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }


#: An ensemble's mixture: arithmetic of the fetch plan that asks the members.
MIXTURE = ("member_error", "mix_logprobs", "mixed_rows", "mixture_topk", "present", "union_ids")


def test_the_ensembles_mixture_is_the_fetch_plans_arithmetic() -> None:
    # the fleet knows an ensemble's members and weights; the fetch plan mixes their answers
    in_fleet = _where(lambda p: _defined(p) & set(MIXTURE), _room_modules("fleet"))
    assert not in_fleet, in_fleet
    mixture = PACKAGE / "fetch" / "_mixture.py"
    assert mixture.is_file() and set(MIXTURE) <= _defined(mixture)


#: The fleet's parts: built by the fleet (fleet/_fleet.py) alone.
FLEET_PARTS = ("Endpoints", "EndpointPool", "Capabilities", "FleetDirectory", "EngineDirectory")


def test_the_fleet_builds_its_parts_and_the_stream_builds_the_fleet() -> None:
    # one place knows the servers (and which engine each speaks): the stream owns it and
    # hands it to the fetcher, which asks it
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if p.parent.name != "fleet"]
    wrong = _where(lambda p: _calls(p) & set(FLEET_PARTS), outside)
    assert not wrong, wrong
    fetch = _where(lambda p: _calls(p) & {"Fleet"}, _room_modules("fetch"))
    assert not fetch, fetch
    assert "Fleet" in _calls(PACKAGE / "_stream.py")


def test_the_fetcher_is_handed_the_fleet() -> None:
    tree = ast.parse((PACKAGE / "fetch" / "_fetcher.py").read_text(encoding="utf-8"))
    (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SampleFetcher")
    (init,) = (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    kinds = [a.annotation for a in init.args.args + init.args.kwonlyargs]
    assert any(isinstance(a, ast.Name) and a.id == "Fleet" for a in kinds)


def test_no_module_reads_a_signature() -> None:
    # one seam per boundary: the transport takes one Request (send), so nothing is detected
    # from a signature (a transport with the old post() is wrapped once: transport._legacy)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            read = (
                isinstance(node, ast.Attribute)
                and node.attr == "signature"
                and isinstance(node.value, ast.Name)
                and node.value.id == "inspect"
            ) or (
                isinstance(node, ast.ImportFrom)
                and node.module == "inspect"
                and any(a.name == "signature" for a in node.names)
            )
            if read:
                found.append(f"{_module(path)}:{node.lineno}")
    assert not found, found


def test_the_transport_seams_types_are_public() -> None:
    # the seam's types, for a user's transport: opd_stream.__all__ and opd_stream.transport's
    def exported(path: Path) -> set[str]:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    assert node.value is not None
                    return set(ast.literal_eval(node.value))
        return set()

    seam = {"Transport", "Request", "Response", "BudgetLease"}
    assert seam <= exported(PACKAGE / "__init__.py")
    assert seam <= exported(PACKAGE / "transport" / "__init__.py")


# ------------------------------------------------------------------- names before 1.0 (#36)

#: The stats tables keyed by data (URLs, failure reasons), which no struct could name.
KEYED_BY_DATA = ("endpoints", "failures", "fleets")


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (found,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return found


def test_no_stats_table_is_a_dict_keyed_by_a_fixed_set_of_names() -> None:
    # channels, stages, parsers, CPU steps: a struct with a documented field each, never
    # string keys
    stats = _class(PACKAGE / "_stats.py", "StreamStats")
    dicts = [
        node.target.id
        for node in stats.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and "dict[" in ast.unparse(node.annotation)
    ]
    assert sorted(set(dicts) - set(KEYED_BY_DATA)) == []


def _old_names() -> set[str]:
    """Every old spelling the package still reads: the ``warn_renamed`` calls with a
    literal old name, the keys of ``RENAMED_SETTINGS`` and of each ``old_keys`` table."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "warn_renamed"
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(node.args[0].value)
            targets = (
                [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
            )
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if names & {"RENAMED_SETTINGS", "old_keys"} and node.value is not None:
                for inner in ast.walk(node.value):
                    if isinstance(inner, ast.Dict):
                        found.update(k.value for k in inner.keys if isinstance(k, ast.Constant))
    return found


def test_every_deprecated_old_name_is_in_the_changelog() -> None:
    changelog = PACKAGE.parent / "docs" / "changelog.md"
    assert changelog.exists(), "docs/changelog.md lists the names renamed before 1.0"
    text = changelog.read_text(encoding="utf-8")
    old = _old_names()
    assert {"jit", "decode_thread_bytes", "router_discovery", "TopKResult.reverse_kl"} <= old
    assert sorted(name for name in old if name not in text) == []


# ------------------------------------------------------- issue 36: "router" names one thing

#: Names of the package that say "router" and stay: each names the sglang-router product (a
#: gateway in front of workers), or is a public spelling kept for a release. (Values are not
#: names: the public ``FleetState.kind`` is ``"router"`` for a gateway.)
ROUTER_NAMES = {
    "opd_stream.testing.router": "public: runs the real gateways (sglang-router, smg) in tests",
    "opd_stream.testing.router.SGLangRouter": "the sglang-router product",
    "opd_stream.testing.router.RouterUnavailable": "public: a gateway package is not installed",
    "opd_stream.config._settings.StreamConfig.router_discovery": "deprecated gateway_discovery",
    "opd_stream.transport._transports.MockTransport.__init__(routers)": "deprecated gateways=",
}


def _names(path: Path) -> set[str]:
    """The names ``path`` defines, qualified: the module, its classes, functions and methods,
    their parameters (``f(x)``), module variables and class fields (``self.x`` included)."""
    module = _module(path)
    out = {module}

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{owner}.{child.name}"
                out.add(name)
                if not isinstance(child, ast.ClassDef):
                    a = child.args
                    args = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                    out.update(f"{name}({x.arg})" for x in args if x is not None)
                visit(child, name if isinstance(child, ast.ClassDef) else owner)
                continue
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, ast.AnnAssign):
                targets = [child.target]
            for t in targets:
                if isinstance(t, ast.Name) and not isinstance(node, ast.FunctionDef):
                    out.add(f"{owner}.{t.id}")  # a module's or a class's own
            if (
                isinstance(child, ast.Attribute)
                and isinstance(child.value, ast.Name)
                and child.value.id == "self"
                and isinstance(child.ctx, ast.Store)
            ):
                out.add(f"{owner}.{child.attr}")
            visit(child, owner)

    visit(ast.parse(path.read_text(encoding="utf-8")), module)
    return out


def _says_router(name: str) -> bool:
    """Whether the last part of ``name`` (a parameter's own name: ``f(x)``) says router."""
    own = name.partition("(")[2] if name.endswith(")") else name.rpartition(".")[2]
    return "router" in own.lower()


def test_router_names_the_gateway_product_only() -> None:
    # teacher routing (a sample's metadata -> its teacher) is "routing" (fleet/_routing.py,
    # TeacherRouting); a gateway in front of workers is a "gateway": "router" is left to the
    # sglang-router product and public spellings kept for a release
    found = {n for p in sorted(PACKAGE.rglob("*.py")) for n in _names(p) if _says_router(n)}
    assert sorted(found - set(ROUTER_NAMES)) == []
    assert sorted(set(ROUTER_NAMES) - found) == []  # the list holds no stale entry


def test_the_name_rule_sees_each_kind_of_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "opd_stream")
    room = tmp_path / "opd_stream" / "room"
    room.mkdir(parents=True)
    path = room / "_router.py"
    path.write_text(
        "ROUTER = 1\n"
        "class TeacherRouter:\n"
        "    router_kind: str\n"
        "    def __init__(self, router):\n"
        "        self._router = router\n"
        "        local_router = 2\n"
        "def parse_router(*, routers): pass\n"
    )
    assert {n for n in _names(path) if _says_router(n)} == {
        "opd_stream.room._router",
        "opd_stream.room._router.ROUTER",
        "opd_stream.room._router.TeacherRouter",
        "opd_stream.room._router.TeacherRouter.router_kind",
        "opd_stream.room._router.TeacherRouter.__init__(router)",
        "opd_stream.room._router.TeacherRouter._router",
        "opd_stream.room._router.parse_router",
        "opd_stream.room._router.parse_router(routers)",
    }
