"""The TRL bench (``python -m bench.trl_teacher``, a subprocess) runs end to end on a
minuscule size: both clients measured in their own processes, their results equal (no
timing is asserted: performance is shown by the bench, never by tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import run_module
from support.trl_client import TRL_CLIENT

TINY = '{"prompts": 1, "per_prompt": 2, "prompt": 48, "response": 8}'


@pytest.mark.skipif(not TRL_CLIENT.is_file(), reason=f"TRL's source is not set up ({TRL_CLIENT})")
def test_the_trl_bench_runs_and_both_clients_give_the_same_result(tmp_path: Path) -> None:
    proc = run_module(
        "bench.trl_teacher", "--top", "2", "--sizes", TINY, "--out", str(tmp_path), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "trl_teacher.json").read_text())
    runs = data["runs"]["2"]
    assert runs["ratios"]["equal"] is True
    for client in ("trl", "opd_stream"):
        run = runs[client]
        assert run["rows"] == 2 * 8
        assert run["bytes_sent"] > 0 and run["computed_tokens"] > 0 and run["cpu_s"] > 0
    # TRL's request recomputes the shared prompt; ours reuses it (whole pages of 16)
    assert runs["trl"]["computed_tokens"] > runs["opd_stream"]["computed_tokens"]
    # the floors: the response rows' JSON (no client receives less), the least CPU
    floor = runs["floor"]
    assert 0 < floor["rows_bytes"] < runs["opd_stream"]["bytes_sent"] < runs["trl"]["bytes_sent"]
    assert floor["decode_cpu_s"] > 0 and floor["build_cpu_s"] > 0
    assert floor["best"]["memory"] > 0
    assert {t["status"] for t in data["targets"]} <= {"MET", "MISSED"}
    assert (tmp_path / "trl_teacher.md").read_text().startswith("# TRL's server teacher")
