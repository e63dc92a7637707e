"""The ``opd-stream`` command: the demo (the main job) runs end to end, config prints."""

from __future__ import annotations

import pytest
from support.cli import run_module

from opd_stream.cli._main import main
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


@pytest.mark.parametrize(
    ("engine", "mode"),
    [("vllm", "mode: top-k 4 union"), ("vllm-completions", "mode: top-k 4 only-teacher")],
)
def test_demo_on_vllm_teachers_detects_their_engine_and_verifies_them(
    engine: str, mode: str
) -> None:
    # the completions path serves no per-position ids: its default strategy reads only the
    # teacher's top-k; the student is a mock SGLang rollout engine either way
    proc = run_module(
        "opd_stream",
        "demo",
        "--engine",
        engine,
        *("--samples", "6", "--prompt-len", "8", "--response-len", "8", "--top-k", "4"),
        *("--teachers", "1", "--no-progress"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "(mock vLLM subprocesses" in out
    assert mode in out
    assert "scored 6 samples, 0 failures" in out
    assert f"engines: math {engine}, student sglang (detected)" in out
    assert "(OK)" in out


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--engine", "vllm-completions", "--strategy", "union"],
            [
                "--engine vllm-completions cannot serve --strategy union --top-k 8: ",
                "cannot score chosen ids per position: start vLLM with --enable-scale-out",
            ],
        ),
        (
            ["--engine", "vllm", "--strategy", "only-teacher", "--top-k", "21"],
            [
                "--engine vllm cannot serve --strategy only-teacher --top-k 21: ",
                "--max-logprobs 21 or more (the server allows 20) "
                "(OPD_STREAM_VLLM_MAX_LOGPROBS sets it for the demo's servers)",
            ],
        ),
    ],
)
@pytest.mark.usefixtures("cli_env")
def test_a_demo_mode_the_vllm_engine_cannot_serve_is_one_line_and_exit_2(
    argv: list[str], said: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *argv, "--samples", "1", "--no-progress"]) == 2
    captured = capsys.readouterr()
    line = captured.err.strip().splitlines()[-1]
    assert line.startswith(f"opd-stream demo: error: {said[0]}")
    assert said[1] in line
    assert captured.out == ""  # refused before any server started


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
