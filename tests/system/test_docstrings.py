"""A module's docstring says what the module holds, in a few lines; the long form (reasons,
measurements, history) is its section of docs/design-notes.md.

* Every module docstring of the package is at most :data:`MAX_LINES` lines, but for the
  package's and the rooms' ``__init__.py`` (their module lists are reworked apart) and the
  modules of :data:`LONGER` (longer on purpose).
* Every ``## opd_stream/...`` section of docs/design-notes.md names a module that exists.

The checks read the source (``ast``), never import it.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "opd_stream"
NOTES = ROOT / "docs" / "design-notes.md"
MAX_LINES = 12

#: Modules whose docstring is longer on purpose: module -> why.
LONGER = {"opd_stream/_errors.py": "draws the error tree, the one place it is drawn"}

_SECTION = re.compile(r"^## `?(?P<path>opd_stream/[^`\s]*)`?\s*$", re.MULTILINE)


def docstring_lines(source: str) -> int:
    """How many lines the module docstring of ``source`` has (0 without one)."""
    doc = ast.get_docstring(ast.parse(source), clean=False)
    return len(doc.splitlines()) if doc else 0


@functools.cache
def _checked_modules() -> dict[str, int]:
    """``{module path from the root: docstring lines}``, the ``__init__.py`` files aside."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts or (
            path.name == "__init__.py" and path.parent.parent in (PACKAGE.parent, PACKAGE)
        ):
            continue
        out[path.relative_to(ROOT).as_posix()] = docstring_lines(path.read_text(encoding="utf-8"))
    return out


def test_every_module_docstring_is_at_most_twelve_lines() -> None:
    over = {
        module: n
        for module, n in _checked_modules().items()
        if n > MAX_LINES and module not in LONGER
    }
    assert over == {}, f"docstrings over {MAX_LINES} lines (the long form: {NOTES.name})"


def test_the_longer_list_holds_only_modules_over_the_limit() -> None:
    modules = _checked_modules()
    stale = sorted(m for m in LONGER if modules.get(m, 0) <= MAX_LINES)
    assert stale == [], "within the limit now, or gone: take them out of the list"


def test_every_section_of_the_design_notes_names_a_module_that_exists() -> None:
    sections = _SECTION.findall(NOTES.read_text(encoding="utf-8"))
    assert sections
    assert [s for s in sections if not (ROOT / s).is_file()] == []


def test_the_line_count_is_the_docstrings_own() -> None:
    body = "\n".join(f"line {i}" for i in range(13))
    assert docstring_lines(f'"""{body}\n"""\n\nx = 1\n') == 13
    assert docstring_lines(f'"""{body}"""\n') == 13
    assert docstring_lines('"""One line."""\n') == 1
    assert docstring_lines("x = 1\n") == 0


@pytest.mark.parametrize("heading", ["## `opd_stream/kl/_math.py`", "## opd_stream/kl/_math.py"])
def test_a_section_heading_is_read_with_or_without_backticks(heading: str) -> None:
    assert _SECTION.findall(f"# Notes\n\n{heading}\n\ntext\n") == ["opd_stream/kl/_math.py"]
