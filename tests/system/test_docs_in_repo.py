"""The docs are in the repository and say what is there.

* The module map of docs/internals.md names every module of the package.
* No docstring or comment of the package, the benchmarks, the scripts or the tests cites a
  document that is not in the repository: the spec the project started from lives
  elsewhere, so a citation goes to ``docs/`` (``docs/protocol.md``, "Answer rows and
  positions"), and the file and the section it names must exist.
* Every relative link of the docs pages reaches a file (and a heading) of the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "opd_stream"
TESTS = ROOT / "tests"
THIS_FILE = Path(__file__).resolve()

#: The spec's files (outside the repository), by the names a citation would use. The
#: distinctive names count bare or with ``.md``; the common words only as ``word.md``.
_SPEC_NAME = re.compile(
    r"(?P<prefix>docs/)?(?P<name>(?:opd-semantics|sglang-protocol|perf-facts"
    r"|fleets-and-tokenizers)(?:\.md)?|(?:hosts|style|landscape)\.md)"
)
#: Other ways of pointing outside: the spec's directory, its section signs, "the spec".
_OUTSIDE = re.compile(r"shared/spec|§|\bthe spec\b|\bspec ``|\bspec [a-z-]+\.md")
#: ``docs/X.md`` and, when one follows, the quoted section: ``docs/X.md``, "Heading".
_DOCS_CITATION = re.compile(
    r"docs/(?P<file>[\w./-]+?\.md)`{0,2}(?:,\s*(?:#:\s*)?\"(?P<section>[^\"]+)\")?"
)
_LINK = re.compile(r"\]\((?P<path>[^)#\s]*)(?:#(?P<anchor>[^)\s]*))?\)")
#: Lines of the tests that name the outside on purpose, to check that a page does not:
#: file (from the root) -> the exact lines, stripped. This file is not scanned at all (its
#: strings plant citations on purpose).
_ALLOWED_LINES = {
    "tests/cli/test_cli_hardening.py": {'assert "shared/spec" not in text'},
}


def _python_files() -> list[Path]:
    files = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "bench").rglob("*.py"),
        *(ROOT / "scripts").glob("*"),
        *TESTS.rglob("*.py"),
    ]
    return sorted(
        f
        for f in files
        if f.is_file() and "__pycache__" not in f.parts and f.resolve() != THIS_FILE
    )


def _scanned_text(path: Path) -> str:
    """``path``'s text without the lines ``_ALLOWED_LINES`` lets it have."""
    allowed = _ALLOWED_LINES.get(path.relative_to(ROOT).as_posix(), set())
    lines = path.read_text().splitlines(keepends=True)
    return "".join(line for line in lines if line.strip() not in allowed)


def _headings(doc: Path) -> list[str]:
    return [
        line.lstrip("#").strip().replace("`", "")
        for line in doc.read_text().splitlines()
        if line.startswith("#")
    ]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def citation_problems(text: str) -> list[str]:
    """What in ``text`` (a source file) points outside the repository or to nothing."""
    problems = []
    for m in _SPEC_NAME.finditer(text):
        if m["prefix"] is None or not (ROOT / "docs" / m["name"]).is_file():
            problems.append(f"cites {m[0]!r}, not a file of docs/")
    problems += [f"points outside: {m[0]!r}" for m in _OUTSIDE.finditer(text)]
    for m in _DOCS_CITATION.finditer(text):
        doc = ROOT / "docs" / m["file"]
        if not doc.is_file():
            problems.append(f"cites docs/{m['file']}, which does not exist")
            continue
        if m["section"] is not None:
            section = " ".join(m["section"].replace("#:", " ").split())
            if not any(h.startswith(section) for h in _headings(doc)):
                problems.append(f"cites section {section!r} of docs/{m['file']}: no such heading")
    return problems


def module_map(internals: str) -> str:
    """The "Module map" section of docs/internals.md (its room subsections included)."""
    start = internals.index("\n## Module map\n")
    end = internals.find("\n## ", start + 1)
    return internals[start : None if end < 0 else end]


def missing_from_layout(layout: str, package: Path) -> list[str]:
    modules = sorted(f.relative_to(package).as_posix() for f in package.rglob("*.py"))
    return [m for m in modules if f"`{m}`" not in layout]


def link_problems(text: str, where: Path) -> list[str]:
    """The relative links of ``text`` (a page in folder ``where``) that reach nothing."""
    problems = []
    for m in _LINK.finditer(text):
        path, anchor = m["path"], m["anchor"]
        if "://" in path or not path:
            continue
        target = (where / path).resolve()
        if not target.is_relative_to(ROOT) or not target.exists():
            problems.append(f"{path}: no such file")
        elif (
            anchor
            and target.suffix == ".md"
            and anchor not in {_slug(h) for h in _headings(target)}
        ):
            problems.append(f"{path}#{anchor}: no such heading")
    return problems


# --- the repository as it is ----------------------------------------------------------------


def test_the_internals_module_map_names_every_module_of_the_package() -> None:
    layout = module_map((ROOT / "docs" / "internals.md").read_text())
    assert missing_from_layout(layout, PACKAGE) == []


@pytest.mark.parametrize("path", _python_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_source_file_cites_a_document_outside_the_repository(path: Path) -> None:
    assert citation_problems(_scanned_text(path)) == []


def test_the_scan_covers_the_tests_but_not_this_file() -> None:
    scanned = {f.relative_to(ROOT).as_posix() for f in _python_files()}
    assert {"tests/kl/test_kl.py", "tests/support/kl_reference.py"} <= scanned
    assert "tests/system/test_docs_in_repo.py" not in scanned


@pytest.mark.parametrize(("name", "lines"), sorted(_ALLOWED_LINES.items()))
def test_each_allowed_line_is_still_there_and_is_all_that_is_dropped(
    name: str, lines: set[str]
) -> None:
    path = ROOT / name
    scanned = set(_scanned_text(path).splitlines())
    dropped = [line.strip() for line in path.read_text().splitlines() if line not in scanned]
    assert sorted(dropped) == sorted(lines)


@pytest.mark.parametrize(
    "doc", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))], ids=lambda p: p.name
)
def test_every_relative_link_of_the_docs_reaches_a_file_and_heading(doc: Path) -> None:
    assert link_problems(doc.read_text(), doc.parent) == []


# --- the checks find what they look for -----------------------------------------------------


@pytest.mark.parametrize(
    "planted",
    [
        "Layout (spec ``sglang-protocol.md`` §2.3): ...",
        'Speed (``perf-facts.md`` "d2"): ...',
        "(opd-semantics §4)",
        "(``hosts.md`` §6)",
        "see /work/shared/spec/ for it",
        "in the spec order",
        "see ``docs/nowhere.md``",
        "see ``docs/hosts.md`` (there is no such page)",
        'see ``docs/semantics.md``, "No such heading"',
    ],
)
def test_a_citation_outside_the_repository_is_found(planted: str) -> None:
    assert citation_problems(f'"""A docstring.\n\n{planted}\n"""\n') != []


def test_a_citation_of_a_docs_section_passes_across_a_line_break() -> None:
    text = '    (``docs/semantics.md``, "Which requests each\n    strategy makes").'
    assert citation_problems(text) == []


def test_a_module_left_out_of_the_layout_is_found(tmp_path: Path) -> None:
    (tmp_path / "room").mkdir()
    for name in ("__init__.py", "_a.py", "room/_b.py"):
        (tmp_path / name).write_text("")
    internals = (
        "# Internals\n## Module map\n### top\n| `__init__.py` | the names |\n| `_a.py` | a |\n"
        "## Conventions\n`room/_b.py` is named here, outside the map\n"
    )
    assert missing_from_layout(module_map(internals), tmp_path) == ["room/_b.py"]


def test_a_link_to_a_missing_file_or_heading_is_found() -> None:
    text = "[a](semantics.md#no-such-heading) [b](nowhere.md) [c](../../etc/passwd)"
    assert len(link_problems(text, ROOT / "docs")) == 3
    assert link_problems("[d](semantics.md#teachers) [e](../README.md)", ROOT / "docs") == []
