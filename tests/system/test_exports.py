"""The public API is exactly what ``opd_stream.__all__`` lists, sorted case-insensitively."""

from __future__ import annotations

import types

import pytest

import opd_stream


def test_all_is_sorted_case_insensitively() -> None:
    assert opd_stream.__all__ == sorted(opd_stream.__all__, key=str.casefold)


def test_all_lists_every_public_name_and_nothing_else() -> None:
    # each is loaded on first use, from the module the package's table names
    assert set(opd_stream._SOURCE) == set(opd_stream.__all__) - {"__version__"}
    for name in opd_stream.__all__:
        getattr(opd_stream, name)
    public = {
        name
        for name, value in vars(opd_stream).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"
    }
    assert set(opd_stream.__all__) - {"__version__"} == public


def test_the_top_level_is_what_an_application_needs() -> None:
    # the wire and KL building blocks live in documented submodules
    for name in ("ScoreRequest", "build_score_payload", "topk_reverse_kl", "TopKBatch"):
        assert name not in opd_stream.__all__
    from opd_stream import kl, wire

    assert wire.build_score_payload is not None
    assert kl.topk_reverse_kl is not None
    assert len(opd_stream.__all__) <= 42  # (40, and the transport seam's Request, BudgetLease)


def test_every_exported_name_resolves() -> None:
    for name in opd_stream.__all__:
        assert getattr(opd_stream, name) is not None


def test_readme_documents_the_headline_api() -> None:
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for name in ("OPDStream", "StreamConfig", "Sample", "ScoredSample", "SampleFailure"):
        assert name in readme


def test_the_configuration_page_table_is_the_generated_one() -> None:
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    from opd_stream.config._settings import render_config_table

    assert render_config_table() in page


def test_the_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    assert opd_stream.__version__ == version("opd-stream")


def test_kl_stage_stats_is_exported() -> None:
    assert opd_stream.KLStageStats.__name__ == "KLStageStats"


def test_importing_the_package_loads_none_of_its_modules() -> None:
    import subprocess
    import sys

    code = (
        "import sys, opd_stream; "
        "print(sorted(m for m in sys.modules if m.startswith('opd_stream.') or m == 'numpy'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert set(dir(opd_stream)) >= set(opd_stream.__all__)


def test_the_kl_module_loads_its_torch_names_on_first_use_and_no_others() -> None:
    from opd_stream import kl

    assert set(dir(kl)) >= set(kl.__all__)
    assert all(getattr(kl, name) is not None for name in kl.__all__)
    with pytest.raises(AttributeError, match="no attribute 'topk_forward_kl'"):
        _ = kl.topk_forward_kl  # type: ignore[attr-defined]
