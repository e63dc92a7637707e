"""The ``opd-stream`` command: the demo (the main job) runs end to end, config prints."""

from __future__ import annotations

from support.cli import run_module

from opd_stream.config._settings import render_config_table


def test_demo_scores_rollouts_against_mock_servers_and_verifies_them() -> None:
    proc = run_module(
        "opd_stream",
        "demo",
        "--samples",
        "12",
        "--prompt-len",
        "16",
        "--response-len",
        "12",
        "--top-k",
        "4",
        "--strategy",
        "union",
        "--teachers",
        "2",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "scored 12 samples, 0 failures" in out
    assert "mean reverse KL, teacher math" in out
    assert "mean reverse KL, teacher code" in out
    assert "(OK)" in out


def test_demo_in_sampled_token_mode_against_unpatched_teachers() -> None:
    proc = run_module(
        "opd_stream",
        "demo",
        "--samples",
        "6",
        "--prompt-len",
        "8",
        "--response-len",
        "8",
        "--top-k",
        "0",
        "--teachers",
        "1",
        "--per-position",
        "unpatched",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mode: sampled-token" in proc.stdout
    assert "scored 6 samples, 0 failures" in proc.stdout


def test_config_prints_the_configuration_table() -> None:
    proc = run_module("opd_stream", "config", timeout=60)
    assert proc.returncode == 0
    table, parser = proc.stdout.strip().rsplit("\n", 1)  # then the answer parser's line
    assert table.strip() == render_config_table().strip()
    assert parser.startswith("answer parser: ")


def test_the_installed_command_does_not_run_the_benchmarks() -> None:
    # bench/ is not part of the package: scripts/dev.sh bench runs it from a checkout
    proc = run_module("opd_stream", "bench", "--help", timeout=60)
    assert proc.returncode == 2
    assert "invalid choice: 'bench'" in proc.stderr
