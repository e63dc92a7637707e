"""numba's disk cache and the kernel files: what each compiled file depends on is in its
own source, so an edit anywhere reaches every cached kernel it changes.

numba keys a cached function on its own file only (modification time and size). So a
kernel file calls no function of another file, and what it takes from
``opd_stream.scanner._shared`` (intrinsics inlined, constants frozen, decorator options) is
tied to it by the digest of that file, which it carries as ``SHARED_DIGEST``: an edit of
``scanner/_shared.py`` fails here until each kernel file holds the new digest, and that edit
makes numba compile them again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from opd_stream.scanner._shared import digest

PACKAGE = Path(__file__).resolve().parents[2] / "opd_stream" / "scanner"
SHARED = "_shared"
DECORATORS = {"njit_cached", "njit_leaf", "njit_once", "njit_held"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _kernel_files() -> list[Path]:
    """The package's files that define a compiled function (one of the decorators)."""
    out = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id in DECORATORS for d in node.decorator_list
            ):
                out.append(path)
                break
    return out


def _package_imports(tree: ast.Module) -> dict[str, set[str]]:
    """``{module: names}`` of what the file imports from this package."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            out.setdefault(node.module, set()).update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 1:  # from . import _x
            for a in node.names:
                out.setdefault(a.name, set()).add("*")
        elif isinstance(node, ast.ImportFrom) and node.module == "opd_stream":
            out.setdefault("", set()).update(a.name for a in node.names)
    return out


def _carried_digest(tree: ast.Module) -> str | None:
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["SHARED_DIGEST"]
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value)
    return None


KERNEL_FILES = _kernel_files()


def test_the_kernel_files_are_found() -> None:
    names = {p.stem for p in KERNEL_FILES}
    assert {"_scan", "_ids", "_rows", "_lists", "_checks", "_objects"} <= names
    assert SHARED not in names  # it compiles nothing itself


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_a_kernel_file_takes_code_from_the_shared_file_only(path: Path) -> None:
    imports = _package_imports(_tree(path))
    others = {m: names for m, names in imports.items() if m != SHARED}
    assert not others, (
        f"{path.name} imports {others} from this package: numba's cache would not see an "
        f"edit there; move what it needs into {SHARED}.py (or pass it as an argument)"
    )


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_a_kernel_file_carries_the_shared_files_digest(path: Path) -> None:
    want = digest()
    assert _carried_digest(_tree(path)) == want, (
        f"{SHARED}.py changed: set SHARED_DIGEST = {want!r} in {path.name} (and every "
        "kernel file), so that numba compiles it again instead of serving its stale cache"
    )


def test_the_digest_is_of_the_shared_files_bytes() -> None:
    import hashlib

    data = (PACKAGE / f"{SHARED}.py").read_bytes()
    assert digest() == hashlib.sha256(data).hexdigest()[:16]
