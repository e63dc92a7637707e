"""``opd_stream.testing._miles_source``: a module of Miles' taken from a git repository's
``HEAD`` and imported, with nothing of it left in ``sys.modules``; None where it cannot be."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from opd_stream.testing._miles_source import load_miles_module, miles_repo

FILES = ("miles/rollout/scorer.py", "miles/utils/helpers.py")


def _repo(root: Path, files: dict[str, str]) -> Path:
    """A git repository at ``root`` whose one commit holds ``files``."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "files"], check=True)
    return root


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = _repo(
        tmp_path / "miles",
        {
            FILES[0]: "from miles.utils.helpers import twice\n\nVALUE = twice(21)\n",
            FILES[1]: "def twice(x):\n    return 2 * x\n",
        },
    )
    monkeypatch.setenv("MILES_REPO", str(root))
    return root


def test_a_module_and_the_file_it_imports_come_from_the_repository(repo: Path) -> None:
    module = load_miles_module(FILES, "miles.rollout.scorer")
    assert module is not None and module.VALUE == 42
    assert miles_repo() == str(repo)


def test_nothing_of_miles_is_left_in_sys_modules_and_what_was_there_is_put_back(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = types.ModuleType("miles")
    monkeypatch.setitem(sys.modules, "miles", before)
    assert load_miles_module(FILES, "miles.rollout.scorer") is not None
    assert sys.modules["miles"] is before
    assert not [k for k in sys.modules if k.startswith("miles.")]


def test_the_committed_file_is_read_not_the_work_tree(repo: Path) -> None:
    (repo / FILES[1]).write_text("def twice(x):\n    return 0\n", encoding="utf-8")
    module = load_miles_module(FILES, "miles.rollout.scorer")
    assert module is not None and module.VALUE == 42


def test_a_file_missing_from_the_repository_gives_none(repo: Path) -> None:
    assert load_miles_module((*FILES, "miles/absent.py"), "miles.rollout.scorer") is None


def test_a_module_that_fails_to_import_gives_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _repo(tmp_path / "broken", {FILES[0]: "raise RuntimeError('no')\n"})
    monkeypatch.setenv("MILES_REPO", str(root))
    assert load_miles_module(FILES[:1], "miles.rollout.scorer") is None
    assert not [k for k in sys.modules if k == "miles" or k.startswith("miles.")]


def test_no_repository_gives_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_REPO", str(tmp_path / "nowhere"))
    assert miles_repo() is None
    assert load_miles_module(FILES, "miles.rollout.scorer") is None
