"""Miles' own source, loaded from a git repository of radixark/miles where one is at hand,
for the tests and the benches (never installed, never part of a run).

``MILES_REPO`` names the repository (a git directory, bare or not); without it, this
machine's mirror. :func:`load_miles_module` takes the files a module needs from the
repository's ``HEAD`` (``git show``), writes them into a temporary package and imports the
module from there. Any ``miles`` modules already imported (an installed Miles) are set
aside while it does; the ones it put in ``sys.modules`` are taken out again afterwards and
those set aside put back, so nothing else sees them, and the temporary files are removed.
The module object keeps working: its functions hold their own globals.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

__all__ = ("MILES_SCORER_FILES", "MILES_TRAINER_FILES", "load_miles_module", "miles_repo")

_DEFAULT_REPO = "/work/.mirror/radixark+miles/repo"

MILES_TRAINER_FILES = ("miles/backends/training_utils/loss_hub/opd.py", "miles/utils/types.py")
"""Miles' trainer-side OPD (``apply_opd_kl_to_advantages``) and the one file it imports."""

MILES_SCORER_FILES = ("miles/rollout/on_policy_distillation.py", "miles/utils/types.py")
"""Miles' OPD scorer (``reward_func``, ``post_process_rewards``) and the one file of Miles'
it imports (the others it needs are aiohttp, torch and the standard library)."""


def miles_repo() -> str | None:
    """The repository to read Miles' source from (``MILES_REPO``, else this machine's
    mirror), or None when it is not a directory here."""
    repo = os.environ.get("MILES_REPO") or _DEFAULT_REPO
    return repo if os.path.isdir(repo) else None


def load_miles_module(files: tuple[str, ...], module: str) -> types.ModuleType | None:
    """``module`` (dotted, e.g. ``"miles.rollout.on_policy_distillation"``) imported from
    ``files`` (paths in Miles' repository, the module's own among them) as they are at the
    repository's ``HEAD``; None when there is no repository, a file is missing there, or
    the import fails."""
    repo = miles_repo()
    if repo is None:
        return None
    with tempfile.TemporaryDirectory(prefix="miles_src_") as tmp:
        return _import_from(repo, files, module, Path(tmp))


def _import_from(
    repo: str, files: tuple[str, ...], module: str, tmp: Path
) -> types.ModuleType | None:
    for name in files:
        shown = subprocess.run(
            ["git", "-C", repo, "show", f"HEAD:{name}"], capture_output=True, check=False
        )
        if shown.returncode != 0:
            return None
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(shown.stdout)
    for folder in {Path(p).parent for p in files}:
        for parent in (folder, *folder.parents):
            if str(parent) != ".":
                (tmp / parent / "__init__.py").touch()
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if _is_miles(k)}
    sys.path.insert(0, str(tmp))
    try:
        return importlib.import_module(module)
    except Exception:
        return None
    finally:
        sys.path.remove(str(tmp))
        importlib.invalidate_caches()
        for k in [k for k in sys.modules if _is_miles(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


def _is_miles(name: str) -> bool:
    return name == "miles" or name.startswith("miles.")
