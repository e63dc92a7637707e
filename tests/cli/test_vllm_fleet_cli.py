"""The engine settings from the command line and the hosts' flags (issue 33, part 1):
``opd-stream score`` / ``probe`` ``--engine``, ``--server-engine URL=ENGINE`` (repeatable),
``--vllm-max-logprobs``; Miles' ``--opd-engine``, ``--opd-server-engines``,
``--opd-vllm-max-logprobs``."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import pytest

from opd_stream import ConfigError
from opd_stream.cli._main import _parser
from opd_stream.cli._probe import _config as probe_config
from opd_stream.cli._score_options import score_config
from opd_stream.integrations import miles

pytestmark = pytest.mark.usefixtures("cli_env")

T, S = "http://t:1", "http://s:2"


_SCORE = ["score", "--input", "-", "--output", "-"]


def test_score_flags_set_the_engines() -> None:
    args = _parser().parse_args(
        [
            *_SCORE,
            *("--teacher", T, "--student-url", S, "--engine", "vllm"),
            *("--server-engine", f"{S}/=vllm-completions", "--vllm-max-logprobs", "64"),
        ]
    )
    cfg, _ = score_config(args)
    assert (cfg.engine, cfg.server_engines, cfg.vllm_max_logprobs) == (
        "vllm",
        {S: "vllm-completions"},
        64,
    )


def test_score_flags_replace_the_environment_and_default_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPD_STREAM_SERVER_ENGINES", f"{T}=vllm")
    base = ["score", "--teacher", T, "--input", "-", "--output", "-"]
    cfg, _ = score_config(_parser().parse_args(base))
    assert (cfg.engine, cfg.server_engines) == ("auto", {T: "vllm"})
    cfg, _ = score_config(_parser().parse_args([*base, "--server-engine", f"{T}=sglang"]))
    assert cfg.server_engines == {T: "sglang"}


def test_an_unknown_engine_is_a_usage_error_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args([*_SCORE, "--teacher", T, "--engine", "tgi"])
    err = capsys.readouterr().err
    assert "--engine: invalid choice: 'tgi'" in err
    assert "'vllm-completions'" in err


def test_probe_flags_set_the_engines() -> None:
    args = _parser().parse_args(["probe", "--teacher", T, "--server-engine", f"{T}=vllm"])
    assert probe_config(args).server_engines == {T: "vllm"}


def _miles(**kw: Any) -> Namespace:
    base: dict[str, Any] = {"use_opd": True, "opd_type": "sglang", "rm_url": f"{T}/generate"}
    return Namespace(**(base | kw))


def test_miles_flags_set_the_engines() -> None:
    cfg = miles.config_from_miles_args(
        _miles(
            opd_engine="vllm-completions",
            opd_server_engines=[f"{T}=vllm"],
            opd_vllm_max_logprobs=-1,
        ),
        environ={},
    )
    assert (cfg.engine, cfg.server_engines, cfg.vllm_max_logprobs) == (
        "vllm-completions",
        {T: "vllm"},
        -1,
    )


def test_a_bad_miles_engine_flag_is_named() -> None:
    with pytest.raises(ConfigError, match=r"Miles flags: --opd-engine"):
        miles.config_from_miles_args(_miles(opd_engine="tgi"), environ={})
    with pytest.raises(ConfigError, match=r"--opd-server-engines"):
        miles.config_from_miles_args(_miles(opd_server_engines="http://x:9=vllm"), environ={})


def test_engine_flags_without_use_opd_are_refused() -> None:
    with pytest.raises(ConfigError, match="--opd-engine given without --use-opd"):
        miles.config_from_miles_args(Namespace(use_opd=False, opd_engine="vllm"))
