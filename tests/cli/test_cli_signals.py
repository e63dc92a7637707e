"""Issue 27 through ``opd-stream score`` and the Miles flags: ``--divergence`` /
``--jsd-beta``, an ensemble ``--teacher``, and the configuration errors that say why.

Scored against mock servers on 127.0.0.1 (started and stopped here); the values are the
independent references' (``pipeline_reference``).
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from support.cli import run_cli
from support.pipeline_reference import MixtureTeacher, expected_result

from opd_stream import ConfigError
from opd_stream.cli._main import main
from opd_stream.integrations.miles import config_from_miles_args
from opd_stream.testing.mock_sglang import serve_mock

K = 4


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # serve_mock runs on asyncio


pytestmark = pytest.mark.usefixtures("cli_env")


_run = partial(run_cli, "--log-level", "warning", "score")  # in a worker thread


def _lines(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 8)), int(rng.integers(1, 6))
        tokens = rng.integers(0, 5000, p + r).tolist()
        out.append({"id": i, "prompt_ids": tokens[:p], "response_ids": tokens[p:]})
    return out


def _files(tmp_path: Path, lines: list[dict[str, Any]]) -> tuple[str, ...]:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return (
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "out.jsonl"),
        "--no-progress",
    )


def _out(tmp_path: Path) -> dict[Any, dict[str, Any]]:
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    return {row["id"]: row for row in rows}


async def test_divergence_and_jsd_beta_flags(tmp_path: Path) -> None:
    rng = np.random.default_rng(27)
    lines = _lines(rng, 5)
    async with serve_mock("teacher", 1) as teacher, serve_mock("student", 0) as student:
        code = await _run(
            "--teacher",
            f"t={teacher.url}",
            "--student-url",
            student.url,
            "--top-k",
            str(K),
            "--strategy",
            "union",
            "--divergence",
            "jsd",
            "--jsd-beta",
            "0.3",
            *_files(tmp_path, lines),
        )
        assert code == 0
        out = _out(tmp_path)
        for line in lines:
            got = out[line["id"]]
            assert got["ok"] is True and got["divergence"] == "jsd"
            assert got["reverse_kl"] is None
            exp = expected_result(
                tokens=line["prompt_ids"] + line["response_ids"],
                response_length=len(line["response_ids"]),
                teacher=teacher.model,
                student=student.model,
                top_k=K,
                strategy="union",
                weight_mode="student_p",
                divergence="jsd",
                jsd_beta=0.3,
            )
            assert exp.reverse_kl is not None
            for g, e in zip(got["signal"], exp.reverse_kl, strict=True):
                assert 0 <= g <= math.log(2) and abs(g - e) <= 1e-6 + 1e-6 * abs(e), (g, e)


async def test_the_default_divergence_leaves_the_lines_as_they_were(tmp_path: Path) -> None:
    rng = np.random.default_rng(28)
    async with serve_mock("teacher", 1) as teacher, serve_mock("student", 0) as student:
        code = await _run(
            "--teacher",
            f"t={teacher.url}",
            "--student-url",
            student.url,
            "--top-k",
            str(K),
            *_files(tmp_path, _lines(rng, 2)),
        )
    assert code == 0
    for got in _out(tmp_path).values():
        assert got["ok"] is True, got
        assert "divergence" not in got and "signal" not in got and got["reverse_kl"] is not None


async def test_an_ensemble_teacher_flag(tmp_path: Path) -> None:
    rng = np.random.default_rng(29)
    lines = _lines(rng, 4)
    async with serve_mock("teacher", 1) as t1, serve_mock("teacher", 2, replicas=2) as t2:
        replicas = "|".join(t2.urls)
        code = await _run(
            "--teacher", f"mix=0.25*{t1.url};0.75*{replicas}", *_files(tmp_path, lines)
        )
        assert code == 0
        mixture = MixtureTeacher([t1.model, t2.model], [0.25, 0.75])
        out = _out(tmp_path)
        for line in lines:
            got = out[line["id"]]
            assert got["ok"] is True and got["teacher"] == "mix"
            exp = expected_result(
                tokens=line["prompt_ids"] + line["response_ids"],
                response_length=len(line["response_ids"]),
                teacher=mixture,
                student=t1.model,
                top_k=0,
                strategy="only-student",
                weight_mode="student_p",
            )
            for g, e in zip(got["teacher_logprobs"], exp.teacher_logprobs, strict=True):
                assert abs(g - e) <= 1e-6 * abs(e), (g, e)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--top-k", "4", "--divergence", "forward_kl"],
            "configuration: divergence, weight_mode: divergence forward_kl weighs the "
            "log-ratios t - s by the teacher's probabilities; set weight_mode teacher_p",
        ),
        (
            ["--divergence", "jsd"],
            "configuration: divergence, top_k: divergence jsd needs top-k mode",
        ),
        (
            ["--top-k", "4", "--jsd-beta", "0.2"],
            "configuration: jsd_beta, divergence: jsd_beta applies to divergence jsd only",
        ),
        (
            ["--top-k", "4", "--divergence", "jsd", "--jsd-beta", "1"],
            "configuration: jsd_beta: must be below 1, got 1",
        ),
    ],
)
def test_nonsense_combinations_are_usage_errors_that_say_why(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _files(tmp_path, [{"prompt_ids": [1], "response_ids": [2]}])
    assert main(["score", "--teacher", "t=http://127.0.0.1:9", *argv, *files]) == 2
    err = capsys.readouterr().err
    assert f"opd-stream score: error: {message}" in err, err


def test_a_bad_ensemble_teacher_flag_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _files(tmp_path, [{"prompt_ids": [1], "response_ids": [2]}])
    bad = "m=0.5*http://127.0.0.1:9;0.6*http://127.0.0.1:10"
    assert main(["score", "--teacher", bad, *files]) == 2
    err = capsys.readouterr().err
    assert "--teacher: teacher 'm': ensemble weights must sum to 1, got 0.5 + 0.6" in err, err


# ------------------------------------------------------------------------------ Miles flags


def _miles(**kw: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "use_opd": True,
        "opd_type": "sglang",
        "rm_url": "http://t:1/generate",
        "opd_log_prob_top_k": 4,
    }
    return SimpleNamespace(**(base | kw))


def test_miles_divergence_flags() -> None:
    cfg = config_from_miles_args(_miles(opd_divergence="jsd", opd_jsd_beta=0.2), environ={})
    assert (cfg.divergence, cfg.jsd_beta) == ("jsd", 0.2)
    cfg = config_from_miles_args(
        _miles(opd_divergence="forward_kl", opd_reward_weight_mode="teacher_p"), environ={}
    )
    assert cfg.divergence == "forward_kl"
    # absent: the environment's
    cfg = config_from_miles_args(_miles(), environ={"OPD_STREAM_DIVERGENCE": "jsd"})
    assert cfg.divergence == "jsd"


def test_miles_divergence_errors_name_the_flags() -> None:
    with pytest.raises(ConfigError, match=r"\(Miles flags: --opd-divergence, "):
        config_from_miles_args(_miles(opd_divergence="forward_kl"), environ={})
    with pytest.raises(ConfigError, match="given without --use-opd"):
        config_from_miles_args(_miles(use_opd=False, opd_divergence="jsd"), environ={})
