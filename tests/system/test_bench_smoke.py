"""The bench harness (``python -m bench.run``, a subprocess) runs end to end on a minuscule
size, and its baseline client agrees with opd_stream (no timing is asserted: performance is
shown by the bench, never by tests)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from support.cli import run_module

from opd_stream.testing._miles_source import MILES_SCORER_FILES, load_miles_module

TINY = (
    '{"s1_n": 2, "s1_prompt": 8, "s1_response": 24, "s1_floor_samples": 2,'
    ' "s4_prompt": 8, "s4_lengths": [16]}'
)


def test_bench_runs_and_baseline_equals_opd_stream(tmp_path: Path) -> None:
    proc = run_module(
        "bench.run",
        "--quick",
        "--scenario",
        "1",
        "--scenario",
        "4",
        "--no-progress",
        "--out",
        str(tmp_path),
        "--sizes",
        TINY,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["errors"] == {}
    modes = data["results"]["1"]["modes"]
    assert set(modes) == {
        "sampled-token",
        "top-k 16 only-student",
        "top-k 16 union",
        "top-k 16 only-student, array rows",
    }
    for mode in modes.values():
        assert mode["equality"]["equal_within_1e-5"] is True
        assert mode["equality"]["compared"] == 2
        assert mode["equality"]["failures"] == 0
    statuses = {t["status"] for t in data["targets"]}
    assert statuses <= {"MET", "MISSED", "N/A"}
    assert (tmp_path / "results.md").read_text().startswith("# opd_stream bench")
    assert (tmp_path / "bytes_per_token.png").stat().st_size > 0


def test_prefix_locality_scenario_runs_end_to_end(tmp_path: Path) -> None:
    """Scenario 9 (prefix locality; smg in the same run) on a minuscule size: every run of
    every variant scores every sample and the report has its rows (no timing asserted)."""
    if importlib.util.find_spec("smg") is None:
        if os.environ.get("CI"):
            pytest.fail("smg is not installed: run `scripts/dev.sh setup`")
        pytest.skip("smg is not installed (the test extra has it on Linux)")
    sizes = (
        '{"s9_prompts": 2, "s9_per_prompt": 2, "s9_prompt": 16, "s9_response": 8,'
        ' "s9_teacher_prompt": 32, "s9_window": 2, "s9_per_token_s": 0.0, "s9_block": 4,'
        ' "s9_variants": "own prompt|blocks, completion order"}'
    )
    proc = run_module(
        "bench.run",
        "--quick",
        "--scenario",
        "9",
        "--no-progress",
        "--out",
        str(tmp_path),
        "--sizes",
        sizes,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["errors"] == {}
    variants = data["results"]["9"]["variants"]
    # (the privileged prompt and completion order differ in their samples alone; the N
    # client processes take ~40 s here: the bench's own runs cover them)
    assert len(variants) == 2
    for v in variants.values():
        assert len(v["runs"]) in (4, 6)
        for run in v["runs"].values():
            assert run["failures"] == 0
            assert run["computed_tokens"] > 0
            assert run["gpu_bound_share"] > 0  # the replicas' simulated compute was read
    assert "## 9. Prefix locality" in (tmp_path / "results.md").read_text()


def test_vllm_cpu_bench_runs_and_both_engines_agree(tmp_path: Path) -> None:
    """``bench.vllm_cpu`` on a minuscule size: every mode scores every sample on both
    engines, with the same values, and vLLM's binary ids are the smaller answer (no timing
    asserted)."""
    proc = run_module(
        "bench.vllm_cpu",
        *("--n", "2", "--prompt", "8", "--response", "16", "--top-k", "4", "--repeats", "1"),
        *("--out", str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "vllm_cpu.json").read_text())
    modes = data["modes"]
    assert set(modes) == {"sampled-token", "top-k 4 only-student", "top-k 4 intersection"}
    for row in modes.values():
        assert row["agreement"]["compared"] == 2 and row["agreement"]["same_samples"]
        assert row["agreement"]["teacher_logprobs_max_diff"] == 0.0
        assert row["agreement"]["signal_max_diff"] == 0.0
        for engine in ("sglang", "vllm"):
            assert len(row[engine]["cpu_us_per_token_runs"]) == 1
    ids = modes["top-k 4 only-student"]
    assert ids["vllm"]["bytes_per_token"] < ids["sglang"]["bytes_per_token"]
    assert "| top-k 4 intersection | vLLM scale-out |" in proc.stdout


BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize(
    "module",
    sorted(p.stem for p in BENCH.glob("*.py") if "__main__" in p.read_text() and p.stem != "run"),
)
def test_every_bench_command_starts(module: str) -> None:
    # each micro-benchmark at least imports and parses its flags (a moved module or file
    # otherwise breaks it unseen: no test runs them whole)
    proc = run_module(f"bench.{module}", "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_the_placement_model_counts_what_a_shared_view_saves(tmp_path: Path) -> None:
    """``bench.placement_bound`` on a small size: a key hash and a shared placement compute
    each prompt once (computed / unique 1.0), a client balancing on its own view with no
    slack computes prompts again, and the real pool's rule is in the table."""
    out = tmp_path / "bound.json"
    proc = run_module(
        "bench.placement_bound", "--groups", "8", "--draws", "6", "--json", str(out), timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["rule"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["key hash"]["computed_mean"] == 1.0
    assert rows["shared placement, slack 0"]["computed_mean"] == 1.0
    assert rows["own view, slack 0"]["computed_mean"] > 1.0
    assert 1.0 <= rows["opd_stream prefix"]["computed_mean"] <= 2.0
    assert all(0.0 <= r["both_share"] <= 1.0 and r["load_mean"] >= 1.0 for r in rows.values())


def test_the_cpu_burst_bench_runs_every_column_and_the_bare_client_agrees(
    tmp_path: Path,
) -> None:
    """``bench.cpu_burst`` on a minuscule size: every column is measured (a stream per
    burst, one kept open as now, as before, with every answer parsed on the loop and with
    the signal alone, the bare client, the parse floors, Miles' own scorer where its source
    is at hand) with its CPU by step, and the bare client's signal equals opd_stream's,
    Miles' within float32 rounding (no timing asserted)."""
    scorer = load_miles_module(MILES_SCORER_FILES, "miles.rollout.on_policy_distillation")
    miles_at_hand = scorer is not None
    out = tmp_path / "burst.json"
    proc = run_module(
        "bench.cpu_burst",
        *("--n", "3", "--prompt", "16", "--response", "32", "--k", "4", "--reps", "1"),
        *("--short", "0", "--json", str(out)),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    burst = json.loads(out.read_text())["burst"]
    assert set(burst) == {"Python rows", "array rows"}
    for row in burst.values():
        assert row["bare_max_abs_diff"] == 0.0
        for key in ("opd", "opd_kept_stream", "opd_kept_stream_threads", "bare", "scanner"):
            assert row[f"{key}_ms_per_sample"] > 0, key
        kept = ("kept_stream", "kept_stream_threads", "kept_stream_on_loop", "kept_stream_signal")
        for key in kept:
            assert row[f"{key}_page_faults_per_sample"] >= 0, key
        for key in ("", *(f"{k}_" for k in kept)):
            steps = row[f"{key}by_step_ms_per_sample"]
            assert steps["decode_loop"] + steps["decode_threads"] > 0, key
            assert steps["kl"] > 0, key
        # offload_bytes above every answer: none is parsed in a decode thread
        assert row["kept_stream_on_loop_by_step_ms_per_sample"]["decode_threads"] == 0
        assert row["opd_kept_stream_on_loop_ms_per_sample"] > 0
        for key in kept:
            assert row[f"{key}_wall_ms_per_burst"] > 0, key
            assert row[f"{key}_lag_ms"]["lag_p99_ms"] is not None, key
        if miles_at_hand:
            assert row["miles_own_max_abs_diff"] < 1e-5
            assert row["miles_own_ms_per_sample"] > 0
        else:  # no source of Miles' here: its columns are empty, the rest is measured
            assert row["miles_own_ms_per_sample"] is row["miles_own_max_abs_diff"] is None
    assert "| 1 MiB and more, rows, in threads (before) |" in proc.stdout
    assert "| all on the loop |" in proc.stdout
    assert "| the signal alone |" in proc.stdout


def test_the_loop_slices_bench_runs_both_reads_and_they_agree(tmp_path: Path) -> None:
    """``bench.loop_slices`` on a minuscule size, every answer through the sliced read
    (``--sliced-from 0``): both policies measured, the signal the same (no figure asserted:
    the machine decides)."""
    out = tmp_path / "slices.json"
    proc = run_module(
        "bench.loop_slices",
        *("--n", "3", "--prompt", "16", "--response", "32", "--k", "4", "--rounds", "1"),
        *("--lag-bursts", "1", "--warm-s", "0", "--sliced-from", "0", "--json", str(out)),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["max_abs_diff"] == 0.0
    for name in ("before", "now"):
        assert got[name]["cpu_ms_per_sample_least"] > 0
        assert got[name]["lag_max_ms"] >= 0
    assert "| 256 KiB slices (before) |" in proc.stdout


def test_the_long_answers_bench_runs_both_ways(tmp_path: Path) -> None:
    """``bench.long_answers`` on answers just over the body pool's threshold (R = 2048 at
    top-k 64: ~6 MB): both ways measured, each with its CPU by step (no figure asserted:
    the machine decides)."""
    out = tmp_path / "long.json"
    proc = run_module(
        "bench.long_answers",
        *("--n", "2", "--prompt", "16", "--response", "2048", "--k", "64"),
        *("--reps", "1", "--bursts", "1", "--json", str(out)),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())["long_answers"]
    assert set(got) == {"buffers used again (now)", "fresh buffers (before)"}
    for row in got.values():
        assert row["ms_per_sample"] > 0 and row["page_faults_per_sample"] >= 0
        assert row["by_step_ms_per_sample"]["decode_threads"] > 0
    assert "| fresh buffers (before) |" in proc.stdout


def test_the_paired_bench_runs_both_settings_and_scores_every_sample(tmp_path: Path) -> None:
    """``bench.paired`` on a minuscule size: both streams score every sample in every
    burst, the pairs' ratio and each side's steps are reported (no timing asserted)."""
    out = tmp_path / "paired.json"
    proc = run_module(
        "bench.paired",
        *("--b", '{"candidates": false}', "--seconds", "0", "--min-pairs", "6"),
        *("--n", "3", "--prompt", "16", "--response", "32", "--k", "4", "--json", str(out)),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["pairs"] == 6
    assert data["b"] == {"candidates": False}
    assert data["b_over_a_median"] > 0
    lo, hi = data["b_over_a_interval_95"]
    assert 0 < lo <= data["b_over_a_median"] <= hi
    for side in ("a_side", "b_side"):
        assert data[side]["unscored"] == 0
        assert data[side]["by_step_ms_per_sample_median"]["kl"] > 0
    assert "B / A, client CPU a sample" in proc.stdout
