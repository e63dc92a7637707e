"""StreamConfig: construction-time validation, env parsing, secrets, the documented table."""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec
import numpy as np
import pytest

from opd_stream._errors import ConfigError
from opd_stream.config._settings import (
    CONFIG_FIELDS,
    ENV_PREFIX,
    Secret,
    StreamConfig,
    render_config_table,
    resolve_kl_device,
)

T = "http://t:30000"
FIELDS = StreamConfig.__struct_fields__
SECRET = "sk-very-secret-key-4242"


def _config(**kwargs: Any) -> StreamConfig:
    return StreamConfig(**({"teachers": T} | kwargs))


# --------------------------------------------------------------------------- defaults


def test_defaults_are_the_documented_ones() -> None:
    cfg = StreamConfig.from_env(environ={}, teachers=T)
    assert cfg.teachers == {"default": ("http://t:30000",)}
    assert cfg.teacher_key == "opd_teacher"
    assert cfg.student_url is None
    assert cfg.top_k == 0
    assert cfg.strategy == "only-student"
    assert cfg.weight_mode == "student_p"
    assert cfg.tail is False
    assert cfg.id_scoring == "auto"
    assert cfg.logprob_start == "prompt"
    assert cfg.topk_wire == "auto"
    assert cfg.request_deadline_s == 60.0
    assert cfg.max_attempts == 4
    assert cfg.max_inflight == 256
    assert cfg.max_inflight_per_endpoint == 64
    assert cfg.max_response_bytes == 1 << 30
    assert cfg.kl_device == "auto"
    assert cfg.order == "completed"
    assert cfg.api_key is None
    assert cfg.channel_capacity == 64
    assert cfg.id_block_size == 0
    assert cfg.kl_batch_size == 32
    assert cfg.kl_batch_wait_s == 0.002
    assert cfg.backoff_initial_s == 0.05
    assert cfg.backoff_max_s == 2.0
    assert cfg.connect_timeout_s == 10.0
    assert cfg.decode_threads == 0
    assert cfg.offload_bytes == 4 << 20
    assert cfg.max_reorder == 1024
    assert cfg.release_memory_after_s == 60.0


def test_teachers_is_required() -> None:
    with pytest.raises(ConfigError, match=r"^teachers: "):
        StreamConfig()


def test_teachers_is_required_from_env() -> None:
    with pytest.raises(ConfigError, match=r"teachers: required.*OPD_STREAM_TEACHERS"):
        StreamConfig.from_env(environ={})


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        _config(top_k=-1)


def test_config_is_frozen() -> None:
    cfg = _config()
    with pytest.raises(AttributeError):
        cfg.top_k = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- normalisation


def test_teachers_are_normalised_to_name_to_replica_tuple() -> None:
    cfg = _config(teachers={"a": ["http://h1:1/generate", "http://h2:2/"], "b": "http://h3:3"})
    assert cfg.teachers == {"a": ("http://h1:1", "http://h2:2"), "b": ("http://h3:3",)}


def test_config_keeps_its_own_copy_of_the_teachers() -> None:
    teachers = {"a": ("http://h1:1",)}
    cfg = _config(teachers=teachers)
    teachers["b"] = ("http://evil:1",)
    assert set(cfg.teachers) == {"a"}


def test_student_url_is_normalised() -> None:
    assert _config(student_url="HTTP://S:2/generate/").student_url == "http://s:2"


def test_kl_device_is_lower_cased() -> None:
    assert _config(kl_device="CUDA:1").kl_device == "cuda:1"


def test_float_fields_accept_integers_and_store_floats() -> None:
    cfg = _config(request_deadline_s=5, kl_batch_wait_s=0)
    assert type(cfg.request_deadline_s) is float
    assert cfg.request_deadline_s == 5.0
    assert type(cfg.kl_batch_wait_s) is float


def test_integer_fields_accept_numpy_integers() -> None:
    cfg = _config(top_k=np.int64(16), strategy="intersection")
    assert type(cfg.top_k) is int
    assert cfg.top_k == 16


def test_top_k_bounds_are_inclusive() -> None:
    assert _config(top_k=0).top_k == 0
    assert _config(top_k=1024).top_k == 1024


def test_kl_batch_wait_may_be_zero_and_decode_threads_may_be_positive() -> None:
    cfg = _config(kl_batch_wait_s=0.0, decode_threads=3, offload_bytes=0)
    assert (cfg.kl_batch_wait_s, cfg.decode_threads, cfg.offload_bytes) == (0.0, 3, 0)


# --------------------------------------------------------------------------- invalid values

# (field, invalid value) for every field; the message must start with the field's name.
INVALID: list[tuple[str, Any]] = [
    ("teachers", {}),
    ("teachers", ""),
    ("teachers", "nourl"),
    ("teachers", "a="),
    ("teachers", "=http://h:1"),
    ("teachers", "a=ftp://h:1"),
    ("teachers", "a=http://h:1,a=http://h:2"),
    ("teachers", 5),
    ("teachers", ["http://h:1", "a=http://h:2"]),
    ("teacher_key", ""),
    ("teacher_key", 5),
    ("student_url", "ftp://s:1"),
    ("student_url", "http://u:p@s:1"),
    ("student_url", ""),
    ("student_url", 5),
    ("top_k", -1),
    ("top_k", 1025),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_k", "3"),
    ("strategy", "bogus"),
    ("strategy", "ONLY-STUDENT"),
    ("strategy", 5),
    ("weight_mode", "student-p"),
    ("weight_mode", None),
    ("tail", 1),
    ("tail", "true"),
    ("tail", None),
    ("candidates", 0),
    ("candidates", "false"),
    ("divergence", "kl"),
    ("divergence", "JSD"),
    ("divergence", None),
    ("jsd_beta", 0.0),
    ("jsd_beta", 1.0),
    ("jsd_beta", math.nan),
    ("jsd_beta", "0.5"),
    ("id_scoring", "per_position"),
    ("logprob_start", "one"),
    ("topk_wire", "base64"),
    ("request_deadline_s", 0),
    ("request_deadline_s", -1.0),
    ("request_deadline_s", math.inf),
    ("request_deadline_s", math.nan),
    ("request_deadline_s", "5"),
    ("request_deadline_s", True),
    ("max_attempts", 0),
    ("max_attempts", -1),
    ("max_attempts", 2.0),
    ("max_inflight", 0),
    ("max_inflight_per_endpoint", 0),
    ("max_response_bytes", 1023),
    ("max_response_bytes", 0),
    ("max_inflight_response_bytes", 1023),
    ("max_inflight_response_bytes", -1),
    ("kl_device", "gpu"),
    ("kl_device", "cuda:"),
    ("kl_device", "cuda:-1"),
    ("kl_device", "cuda:x"),
    ("kl_device", "cpu0"),
    ("kl_device", 0),
    ("order", "random"),
    ("api_key", 5),
    ("api_key", ""),
    ("api_key", "has space"),
    ("api_key", "tab\there"),
    ("api_key", "newline\n"),
    ("channel_capacity", 0),
    ("id_block_size", -1),
    ("kl_batch_size", 0),
    ("kl_batch_wait_s", -0.1),
    ("kl_batch_wait_s", math.inf),
    ("kl_batch_wait_s", math.nan),
    ("backoff_initial_s", 0.0),
    ("backoff_initial_s", -1.0),
    ("backoff_initial_s", math.inf),
    ("backoff_max_s", 0.0),
    ("backoff_max_s", math.inf),
    ("backoff_max_s", 0.01),  # below backoff_initial_s (0.05)
    ("connect_timeout_s", 0.0),
    ("connect_timeout_s", math.inf),
    ("connect_timeout_s", math.nan),
    ("decode_threads", -1),
    ("offload_bytes", -1),
    ("max_reorder", 0),
    ("release_memory_after_s", -1.0),
    ("release_memory_after_s", math.inf),
    ("release_memory_after_s", math.nan),
    ("balance", "random"),
    ("balance_load_factor", 0.9),
    ("eject_after_failures", -1),
    ("eject_cooldown_s", 0.0),
    ("unreachable_after_s", -1.0),
    ("unreachable_after_s", math.inf),
    ("hedge_after_percentile", 100.0),
    ("hedge_min_s", -1.0),
    ("attempt_timeout_s", -1.0),
    ("attempt_timeout_s", math.inf),
    ("gateway_discovery", "always"),
    ("cache_salt", "per_sample"),
    ("probe_tolerance", 0.0),
    ("probe_tolerance", math.inf),
    ("probe_deadline_s", 0.0),
    ("probe_deadline_s", math.inf),
    ("probe_at_start", "yes"),
    ("student_tokenizer", "/nonexistent/tokenizer.json"),
    ("student_tokenizer", 3),
    ("teacher_tokenizers", "default=/nonexistent"),
    ("teacher_tokenizers", "no-equals-sign,x=/y"),
    ("teacher_tokenizers", 5),
    ("return_alignment", 1),
    ("engine", "vLLM-scale-out"),
    ("engine", None),
    ("server_engines", "http://h:1=trt-llm"),
    ("server_engines", "http://h:1"),
    ("server_engines", "http://elsewhere:1=vllm"),  # not a configured server
    ("server_engines", 5),
    ("vllm_max_logprobs", 0),
    ("vllm_max_logprobs", -2),
    ("vllm_max_logprobs", "20"),
]


def test_every_field_has_invalid_value_cases() -> None:
    assert {field for field, _ in INVALID} == set(FIELDS)


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_config_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        _config(**{field: value})
    assert str(info.value).startswith(f"{field}"), str(info.value)


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_override_raises_config_error_naming_the_field(field: str, value: Any) -> None:
    kwargs = {"teachers": T, field: value}
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_env(environ={}, **kwargs)
    assert str(info.value).startswith(f"{field}"), str(info.value)
    assert ENV_PREFIX not in str(info.value)  # the value did not come from the environment


# (field, env text) for every field; the message must name the variable and the field.
INVALID_ENV: list[tuple[str, str]] = [
    ("teachers", "a"),
    ("teachers", "a=http://h:1,a=http://h:2"),
    ("teachers", ""),
    ("teacher_key", ""),
    ("student_url", "ftp://s:1"),
    ("top_k", "abc"),
    ("top_k", "1.5"),
    ("top_k", "-1"),
    ("top_k", "2000"),
    ("top_k", "0x10"),
    ("strategy", "bogus"),
    ("weight_mode", "x"),
    ("tail", "maybe"),
    ("tail", "2"),
    ("candidates", "no"),
    ("divergence", "kl"),
    ("jsd_beta", "half"),
    ("jsd_beta", "1"),
    ("id_scoring", "x"),
    ("logprob_start", "x"),
    ("topk_wire", "x"),
    ("request_deadline_s", "inf"),
    ("request_deadline_s", "nan"),
    ("request_deadline_s", "0"),
    ("request_deadline_s", "soon"),
    ("max_attempts", "0"),
    ("max_inflight", "many"),
    ("max_inflight_per_endpoint", "0"),
    ("max_response_bytes", "1GiB"),
    ("max_inflight_response_bytes", "2GiB"),
    ("kl_device", "gpu"),
    ("order", "x"),
    ("api_key", "has space"),
    ("channel_capacity", "0"),
    ("id_block_size", "-1"),
    ("kl_batch_size", "0"),
    ("kl_batch_wait_s", "-1"),
    ("backoff_initial_s", "0"),
    ("backoff_max_s", "0.01"),
    ("connect_timeout_s", "-inf"),
    ("decode_threads", "-1"),
    ("offload_bytes", "-1"),
    ("max_reorder", "0"),
    ("release_memory_after_s", "later"),
    ("balance", "p2c"),
    ("balance_load_factor", "one"),
    ("eject_after_failures", "some"),
    ("eject_cooldown_s", "0"),
    ("unreachable_after_s", "a while"),
    ("hedge_after_percentile", "101"),
    ("hedge_min_s", "-0.5"),
    ("attempt_timeout_s", "soon"),
    ("gateway_discovery", "sometimes"),
    ("cache_salt", "always"),
    ("probe_tolerance", "-1"),
    ("probe_deadline_s", "never"),
    ("probe_at_start", "2"),
    ("student_tokenizer", "/nonexistent"),
    ("teacher_tokenizers", "default="),
    ("return_alignment", "maybe"),
    ("engine", "tgi"),
    ("server_engines", "http://h:1=tgi"),
    ("vllm_max_logprobs", "0"),
]


def test_every_field_has_invalid_env_cases() -> None:
    assert {field for field, _ in INVALID_ENV} == set(FIELDS)


@pytest.mark.parametrize(("field", "text"), INVALID_ENV, ids=[f"{f}={t!r}" for f, t in INVALID_ENV])
def test_invalid_env_value_names_the_variable_and_the_field(field: str, text: str) -> None:
    var = ENV_PREFIX + field.upper()
    environ = {f"{ENV_PREFIX}TEACHERS": T, var: text}
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_env(environ)
    assert str(info.value).startswith(f"{field} (from {var})"), str(info.value)


# --------------------------------------------------------------------------- cross-field rules


@pytest.mark.parametrize("strategy", ["only-teacher", "intersection", "union", "xor"])
def test_strategy_other_than_only_student_needs_top_k_mode(strategy: str) -> None:
    with pytest.raises(ConfigError, match=r"strategy applies to top-k mode; set top_k > 0"):
        _config(strategy=strategy, student_url="http://s:1")


@pytest.mark.parametrize("strategy", ["only-teacher", "union", "xor"])
def test_strategies_scoring_teacher_ids_need_the_student_server(strategy: str) -> None:
    with pytest.raises(ConfigError, match=rf"^strategy, student_url: strategy {strategy} "):
        _config(strategy=strategy, top_k=4)


@pytest.mark.parametrize("strategy", ["only-teacher", "union", "xor"])
def test_strategies_scoring_teacher_ids_accept_a_student_server(strategy: str) -> None:
    cfg = _config(strategy=strategy, top_k=4, student_url="http://s:1")
    assert cfg.strategy == strategy


@pytest.mark.parametrize("strategy", ["only-student", "intersection"])
def test_strategies_without_student_requests_need_no_student_server(strategy: str) -> None:
    assert _config(strategy=strategy, top_k=4).student_url is None


def test_backoff_max_equal_to_initial_is_allowed() -> None:
    cfg = _config(backoff_initial_s=0.5, backoff_max_s=0.5)
    assert cfg.backoff_max_s == cfg.backoff_initial_s


def test_cross_field_error_names_the_env_variable_of_each_field_from_env() -> None:
    environ = {f"{ENV_PREFIX}TEACHERS": T, f"{ENV_PREFIX}STRATEGY": "union"}
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_env(environ)
    assert str(info.value).startswith(
        "strategy (from OPD_STREAM_STRATEGY), top_k: strategy applies to top-k mode"
    )


def test_replace_and_evolve_validate() -> None:
    cfg = _config()
    with pytest.raises(ConfigError, match=r"^top_k: "):
        msgspec.structs.replace(cfg, top_k=-1)
    with pytest.raises(ConfigError, match=r"^top_k: "):
        cfg.evolve(top_k=-1)
    assert cfg.evolve(top_k=3).top_k == 3


def test_evolve_rejects_unknown_fields() -> None:
    with pytest.raises(ConfigError, match=r"unknown StreamConfig field 'top_kk'.*top_k"):
        _config().evolve(top_kk=3)


@pytest.mark.parametrize(("text", "value"), [("1", True), ("true", True), ("0", False)])
def test_tail_is_read_from_its_env_variable(text: str, value: bool) -> None:
    environ = {"OPD_STREAM_TEACHERS": T, "OPD_STREAM_TOP_K": "4", "OPD_STREAM_TAIL": text}
    assert StreamConfig.from_env(environ).tail is value


def test_tail_needs_top_k_mode() -> None:
    with pytest.raises(ConfigError, match=r"^tail, top_k: the tail bucket applies to top-k mode"):
        _config(tail=True)
    environ = {"OPD_STREAM_TEACHERS": T, "OPD_STREAM_TAIL": "1"}
    with pytest.raises(ConfigError, match=r"^tail \(from OPD_STREAM_TAIL\), top_k: "):
        StreamConfig.from_env(environ)


@pytest.mark.parametrize("weight_mode", ["teacher_p", "none"])
def test_tail_needs_student_weights(weight_mode: str) -> None:
    with pytest.raises(ConfigError, match=r"^tail, weight_mode: .*set weight_mode student_p"):
        _config(tail=True, top_k=4, weight_mode=weight_mode)


@pytest.mark.parametrize(
    "strategy", ["only-student", "only-teacher", "intersection", "union", "xor"]
)
def test_tail_accepts_every_strategy(strategy: str) -> None:
    cfg = _config(tail=True, top_k=4, strategy=strategy, student_url="http://s:1")
    assert cfg.tail is True
    assert {row.field: row.default for row in CONFIG_FIELDS}["tail"] == "false"


# --------------------------------------------------------------------------- environment


def test_env_values_are_coerced_and_stripped() -> None:
    cfg = StreamConfig.from_env(
        {
            "OPD_STREAM_TEACHERS": f" {T} ",
            "OPD_STREAM_TOP_K": " 16 ",
            "OPD_STREAM_STRATEGY": "intersection",
            "OPD_STREAM_REQUEST_DEADLINE_S": "2.5",
            "OPD_STREAM_MAX_RESPONSE_BYTES": "1e6",
            "OPD_STREAM_KL_DEVICE": "cpu",
        }
    )
    assert (cfg.top_k, cfg.strategy, cfg.request_deadline_s) == (16, "intersection", 2.5)
    assert cfg.max_response_bytes == 1_000_000
    assert cfg.kl_device == "cpu"


def test_env_teachers_with_replicas() -> None:
    cfg = StreamConfig.from_env({"OPD_STREAM_TEACHERS": "a=http://h1:1|http://h2:2,b=http://h3:3"})
    assert cfg.teachers == {"a": ("http://h1:1", "http://h2:2"), "b": ("http://h3:3",)}


def test_env_teachers_plain_url_is_the_default_teacher() -> None:
    cfg = StreamConfig.from_env({"OPD_STREAM_TEACHERS": "http://h/g?tag=a=b"})
    assert cfg.teachers == {"default": ("http://h/g?tag=a=b",)}


def test_every_field_is_read_from_its_env_variable() -> None:
    environ = {
        "OPD_STREAM_TEACHERS": "math=http://m:1",
        "OPD_STREAM_TEACHER_KEY": "domain",
        "OPD_STREAM_STUDENT_URL": "http://s:2",
        "OPD_STREAM_TOP_K": "8",
        "OPD_STREAM_STRATEGY": "xor",
        "OPD_STREAM_WEIGHT_MODE": "student_p",  # (jsd takes no other: see the signal tests)
        "OPD_STREAM_TAIL": "false",
        "OPD_STREAM_CANDIDATES": "0",
        "OPD_STREAM_DIVERGENCE": "jsd",
        "OPD_STREAM_JSD_BETA": "0.25",
        "OPD_STREAM_ID_SCORING": "blocked",
        "OPD_STREAM_LOGPROB_START": "zero",
        "OPD_STREAM_TOPK_WIRE": "json",
        "OPD_STREAM_REQUEST_DEADLINE_S": "30",
        "OPD_STREAM_MAX_ATTEMPTS": "2",
        "OPD_STREAM_MAX_INFLIGHT": "10",
        "OPD_STREAM_MAX_INFLIGHT_PER_ENDPOINT": "3",
        "OPD_STREAM_MAX_RESPONSE_BYTES": "4096",
        "OPD_STREAM_MAX_INFLIGHT_RESPONSE_BYTES": "8192",
        "OPD_STREAM_KL_DEVICE": "cuda:1",
        "OPD_STREAM_ORDER": "input",
        "OPD_STREAM_API_KEY": SECRET,
        "OPD_STREAM_CHANNEL_CAPACITY": "5",
        "OPD_STREAM_ID_BLOCK_SIZE": "4",
        "OPD_STREAM_KL_BATCH_SIZE": "7",
        "OPD_STREAM_KL_BATCH_WAIT_S": "0.01",
        "OPD_STREAM_BACKOFF_INITIAL_S": "0.1",
        "OPD_STREAM_BACKOFF_MAX_S": "3",
        "OPD_STREAM_CONNECT_TIMEOUT_S": "4",
        "OPD_STREAM_DECODE_THREADS": "2",
        "OPD_STREAM_OFFLOAD_BYTES": "100",
        "OPD_STREAM_MAX_REORDER": "9",
        "OPD_STREAM_RELEASE_MEMORY_AFTER_S": "0.5",
        "OPD_STREAM_BALANCE": "round-robin",
        "OPD_STREAM_BALANCE_LOAD_FACTOR": "1.5",
        "OPD_STREAM_EJECT_AFTER_FAILURES": "2",
        "OPD_STREAM_EJECT_COOLDOWN_S": "1.5",
        "OPD_STREAM_UNREACHABLE_AFTER_S": "30",
        "OPD_STREAM_HEDGE_AFTER_PERCENTILE": "90",
        "OPD_STREAM_HEDGE_MIN_S": "0.2",
        "OPD_STREAM_ATTEMPT_TIMEOUT_S": "2.5",
        "OPD_STREAM_GATEWAY_DISCOVERY": "off",
        "OPD_STREAM_CACHE_SALT": "per-request",
        "OPD_STREAM_PROBE_TOLERANCE": "0.5",
        "OPD_STREAM_PROBE_DEADLINE_S": "2.5",
        "OPD_STREAM_PROBE_AT_START": "1",
        "OPD_STREAM_STUDENT_TOKENIZER": "",  # empty: unset (see test_xtok_stream for paths)
        "OPD_STREAM_TEACHER_TOKENIZERS": "",
        "OPD_STREAM_RETURN_ALIGNMENT": "true",
        "OPD_STREAM_ENGINE": "sglang",
        "OPD_STREAM_SERVER_ENGINES": " HTTP://S:2/=vllm ",
        "OPD_STREAM_VLLM_MAX_LOGPROBS": "-1",
    }
    assert set(environ) == {ENV_PREFIX + f.upper() for f in FIELDS}
    cfg = StreamConfig.from_env(environ)
    expected = StreamConfig(
        teachers={"math": ("http://m:1",)},
        teacher_key="domain",
        student_url="http://s:2",
        top_k=8,
        strategy="xor",
        weight_mode="student_p",
        tail=False,
        candidates=False,
        divergence="jsd",
        jsd_beta=0.25,
        id_scoring="blocked",
        logprob_start="zero",
        topk_wire="json",
        request_deadline_s=30.0,
        max_attempts=2,
        max_inflight=10,
        max_inflight_per_endpoint=3,
        max_response_bytes=4096,
        max_inflight_response_bytes=8192,
        kl_device="cuda:1",
        order="input",
        api_key=Secret(SECRET),
        channel_capacity=5,
        id_block_size=4,
        kl_batch_size=7,
        kl_batch_wait_s=0.01,
        backoff_initial_s=0.1,
        backoff_max_s=3.0,
        connect_timeout_s=4.0,
        decode_threads=2,
        offload_bytes=100,
        max_reorder=9,
        release_memory_after_s=0.5,
        balance="round-robin",
        balance_load_factor=1.5,
        eject_after_failures=2,
        eject_cooldown_s=1.5,
        unreachable_after_s=30.0,
        hedge_after_percentile=90.0,
        hedge_min_s=0.2,
        attempt_timeout_s=2.5,
        gateway_discovery="off",
        cache_salt="per-request",
        probe_tolerance=0.5,
        probe_deadline_s=2.5,
        probe_at_start=True,
        return_alignment=True,
        engine="sglang",
        server_engines={"http://s:2": "vllm"},
        vllm_max_logprobs=-1,
    )
    assert cfg == expected


def test_unknown_env_variable_is_an_error() -> None:
    environ = {"OPD_STREAM_TEACHERS": T, "OPD_STREAM_MAX_INFLGHT": "8"}
    with pytest.raises(
        ConfigError,
        match="unknown environment variable OPD_STREAM_MAX_INFLGHT "
        r"\(did you mean OPD_STREAM_MAX_INFLIGHT\?\)",
    ):
        StreamConfig.from_env(environ)


def test_unknown_override_is_an_error() -> None:
    with pytest.raises(ConfigError, match="unknown StreamConfig field 'topk'"):
        StreamConfig.from_env(environ={}, teachers=T, topk=3)


def test_variables_without_the_prefix_are_ignored() -> None:
    environ = {"OPD_STREAM_TEACHERS": T, "OPD_STREAMX": "1", "opd_stream_top_k": "x", "PATH": "/"}
    assert StreamConfig.from_env(environ).top_k == 0


def test_overrides_beat_the_environment() -> None:
    environ = {"OPD_STREAM_TEACHERS": "http://env:1", "OPD_STREAM_TOP_K": "8"}
    cfg = StreamConfig.from_env(environ, teachers="http://arg:1", top_k=2)
    assert cfg.teachers == {"default": ("http://arg:1",)}
    assert cfg.top_k == 2


def test_malformed_env_value_is_reported_even_when_overridden() -> None:
    # Env text is parsed before overrides apply: a malformed variable is still reported.
    environ = {"OPD_STREAM_TEACHERS": T, "OPD_STREAM_TOP_K": "many"}
    with pytest.raises(ConfigError, match=r"^top_k \(from OPD_STREAM_TOP_K\)"):
        StreamConfig.from_env(environ, top_k=2)


def test_override_error_does_not_blame_the_env_variable() -> None:
    environ = {"OPD_STREAM_TEACHERS": T, "OPD_STREAM_TOP_K": "8"}
    with pytest.raises(ConfigError, match=r"^top_k: must be in 0\.\.1024, got 5000$"):
        StreamConfig.from_env(environ, top_k=5000)


def test_empty_environ_with_overrides_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPD_STREAM_TOP_K", "not-a-number")
    cfg = StreamConfig.from_env(environ={}, teachers=T, max_attempts=1)
    assert (cfg.top_k, cfg.max_attempts) == (0, 1)


def test_environ_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPD_STREAM_TEACHERS", T)
    monkeypatch.setenv("OPD_STREAM_MAX_ATTEMPTS", "7")
    assert StreamConfig.from_env().max_attempts == 7


@pytest.mark.parametrize("field", ["student_url", "api_key"])
def test_empty_optional_env_value_means_unset(field: str) -> None:
    environ = {"OPD_STREAM_TEACHERS": T, ENV_PREFIX + field.upper(): "  "}
    assert getattr(StreamConfig.from_env(environ), field) is None


# --------------------------------------------------------------------------- the API key


def test_api_key_string_is_stored_as_a_secret() -> None:
    cfg = _config(api_key=SECRET)
    assert isinstance(cfg.api_key, Secret)
    assert cfg.api_key.get_secret_value() == SECRET


def test_api_key_secret_is_accepted_as_is() -> None:
    assert _config(api_key=Secret(SECRET)).api_key == Secret(SECRET)


def test_secret_repr_and_str_are_masked() -> None:
    assert repr(Secret(SECRET)) == "Secret('***')"
    assert str(Secret(SECRET)) == "***"


def test_api_key_never_appears_in_repr_or_str() -> None:
    cfg = _config(api_key=SECRET)
    assert SECRET not in repr(cfg)
    assert SECRET not in str(cfg)
    assert "Secret('***')" in repr(cfg)


def test_api_key_from_env_never_appears_in_repr() -> None:
    cfg = StreamConfig.from_env({"OPD_STREAM_TEACHERS": T, "OPD_STREAM_API_KEY": SECRET})
    assert cfg.api_key is not None
    assert cfg.api_key.get_secret_value() == SECRET
    assert SECRET not in repr(cfg)


@pytest.mark.parametrize("bad", [f"{SECRET} x", f"{SECRET}\n", f"\t{SECRET}"])
def test_invalid_api_key_error_does_not_echo_it(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"^api_key: ") as info:
        _config(api_key=bad)
    assert SECRET not in str(info.value)
    assert SECRET not in repr(info.value)


def test_api_key_never_appears_in_other_errors() -> None:
    environ = {"OPD_STREAM_TEACHERS": T, "OPD_STREAM_API_KEY": SECRET, "OPD_STREAM_TOP_K": "x"}
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_env(environ)
    assert SECRET not in str(info.value)
    with pytest.raises(ConfigError) as info:
        _config(api_key=SECRET, strategy="union")
    assert SECRET not in str(info.value)


def test_log_dict_masks_the_api_key_and_keeps_urls() -> None:
    cfg = _config(teachers="a=http://h1:1|http://h2:2", student_url="http://s:3", api_key=SECRET)
    log = cfg.to_log_dict()
    assert log["api_key"] == "***"
    assert log["teachers"] == {"a": ["http://h1:1", "http://h2:2"]}
    assert log["student_url"] == "http://s:3"
    assert set(log) == set(FIELDS)
    assert SECRET not in repr(log)


def test_log_dict_without_api_key_says_none() -> None:
    assert _config().to_log_dict()["api_key"] is None


def test_log_dict_is_json_encodable() -> None:
    assert b"***" in msgspec.json.encode(_config(api_key=SECRET).to_log_dict())


# --------------------------------------------------------------------------- the table


def test_every_field_is_documented_in_the_table() -> None:
    assert [row.field for row in CONFIG_FIELDS] == list(FIELDS)
    for row in CONFIG_FIELDS:
        assert row.env_var == "OPD_STREAM_" + row.field.upper()
        assert row.meaning.strip()


def test_table_defaults_match_the_struct_defaults() -> None:
    shown = {row.field: row.default for row in CONFIG_FIELDS}
    assert shown["teachers"] == "required"
    assert shown["student_url"] == "none"
    assert shown["max_response_bytes"] == "1 GiB"
    assert shown["offload_bytes"] == "4 MiB"
    assert shown["top_k"] == "0"
    assert shown["strategy"] == "only-student"
    assert shown["request_deadline_s"] == "60"
    assert shown["kl_batch_wait_s"] == "0.002"
    defaults = {f.name: f.default for f in msgspec.structs.fields(StreamConfig)}
    for name, text in shown.items():
        default = defaults[name]
        if isinstance(default, float):
            assert float(text) == default, name
        elif isinstance(default, str):
            assert text == default, name


def test_advanced_fields_are_marked_in_the_table() -> None:
    advanced = {row.field for row in CONFIG_FIELDS if row.meaning.startswith("(advanced) ")}
    assert {"channel_capacity", "decode_threads", "kl_batch_wait_s", "topk_wire"} <= advanced
    assert not {"teachers", "top_k", "strategy", "request_deadline_s"} & advanced


def test_settings_checked_alone_use_the_config_messages() -> None:
    from opd_stream.config._settings import check_settings

    assert check_settings(max_attempts=np.int64(3)) == {"max_attempts": 3}
    for kwargs in ({"top_k": 5000}, {"backoff_initial_s": 0.5, "backoff_max_s": 0.1}):
        with pytest.raises(ConfigError) as alone:
            check_settings(**kwargs)
        with pytest.raises(ConfigError) as whole:
            _config(**kwargs)
        assert str(alone.value) == str(whole.value)


def test_rendered_table_has_one_row_per_field() -> None:
    table = render_config_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(FIELDS)
    for row in rows:  # escaped bars keep every row at exactly 4 cells
        assert len(re.split(r"(?<!\\)\|", row)) == 6


# --------------------------------------------------------------------------- KL device


def _fake_cuda(
    monkeypatch: pytest.MonkeyPatch, available: bool, count: int, current: int = 0
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_kl_device_cpu_resolves_to_cpu() -> None:
    assert resolve_kl_device(_config(kl_device="cpu")) == "cpu"


@pytest.mark.parametrize(("available", "device"), [(False, "cpu"), (True, "cuda:0")])
def test_kl_device_auto_picks_cuda_when_available(
    monkeypatch: pytest.MonkeyPatch, available: bool, device: str
) -> None:
    _fake_cuda(monkeypatch, available, int(available))
    assert resolve_kl_device(_config()) == device


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_kl_device_cuda_without_cuda_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    _fake_cuda(monkeypatch, False, 0)
    cfg = _config(kl_device=device)  # no CUDA needed at configuration time
    with pytest.raises(ConfigError, match=r"^kl_device: .*CUDA is not available"):
        resolve_kl_device(cfg)


def test_kl_device_index_beyond_the_visible_devices_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_cuda(monkeypatch, True, 2)
    assert resolve_kl_device(_config(kl_device="cuda:1")) == "cuda:1"
    assert resolve_kl_device("cuda") == "cuda:0"
    with pytest.raises(ConfigError, match="only 2 CUDA device"):
        resolve_kl_device(_config(kl_device="cuda:2"))


@pytest.mark.parametrize("spelling", ["auto", "cuda", " CUDA "])
def test_auto_and_cuda_resolve_to_the_callers_current_device(
    monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    # A rank that called torch.cuda.set_device(3) in its main thread: the KL thread must get
    # "cuda:3", not a bare "cuda" (GPU 0 in a new thread).
    _fake_cuda(monkeypatch, True, 4, current=3)
    assert resolve_kl_device(_config(kl_device=spelling)) == "cuda:3"
    assert resolve_kl_device(_config(kl_device="cuda:1")) == "cuda:1"  # explicit stays


def test_the_stream_resolves_its_kl_device_in_the_constructing_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rank that called torch.cuda.set_device(2): CUDA is initialized, and the current
    # device is read in the caller's thread.
    import threading

    import torch

    from opd_stream import OPDStream

    seen: list[str] = []

    def current() -> int:
        seen.append(threading.current_thread().name)
        return 2

    _fake_cuda(monkeypatch, True, 4)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", current)
    stream = OPDStream(_config(kl_device="auto"))
    assert stream.stats().kl.device == "cuda:2"
    assert seen == [threading.current_thread().name]


async def test_before_cuda_starts_the_stream_resolves_its_kl_device_as_it_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No thread has chosen a device yet (CUDA is not initialized): every thread's current
    # device is the same, and the stream reads it off the caller's loop, as it loads.
    import threading

    import torch

    from opd_stream import OPDStream

    seen: list[str] = []

    def current() -> int:
        seen.append(threading.current_thread().name)
        return 0

    _fake_cuda(monkeypatch, True, 4)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", current)
    stream = OPDStream(_config(kl_device="auto"))
    assert seen == [] and stream.stats().kl.device == "auto"
    await stream.load()
    assert stream.stats().kl.device == "cuda:0"
    assert len(seen) == 1 and seen[0] != threading.current_thread().name


async def test_a_kl_device_without_cuda_is_a_config_error_when_the_stream_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opd_stream import OPDStream

    _fake_cuda(monkeypatch, False, 0)
    stream = OPDStream(_config(kl_device="cuda:1"))
    with pytest.raises(ConfigError, match=r"^kl_device: .*CUDA is not available"):
        await stream.load()
    with pytest.raises(ConfigError, match=r"^kl_device: .*CUDA is not available"):
        async with stream:
            pass


def test_resolve_kl_device_rejects_a_bad_string() -> None:
    with pytest.raises(ConfigError, match=r"^kl_device: "):
        resolve_kl_device("tpu")


def test_config_survives_pickling_with_its_secret() -> None:
    import pickle

    cfg = _config(teachers="a=http://h1:1|http://h2:2", api_key=SECRET)
    clone = pickle.loads(pickle.dumps(cfg))
    assert clone == cfg
    assert clone.api_key is not None
    assert clone.api_key.get_secret_value() == SECRET


# --------------------------------------------------------------------------- replicas


def test_replica_balancing_defaults_are_the_documented_ones() -> None:
    cfg = StreamConfig.from_env(environ={}, teachers=T)
    assert (cfg.balance, cfg.balance_load_factor) == ("prefix", 1.25)
    assert (cfg.eject_after_failures, cfg.eject_cooldown_s) == (5, 10.0)
    assert (cfg.hedge_after_percentile, cfg.hedge_min_s) == (0.0, 0.05)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("balance", "random", r"^balance: must be one of prefix, least-outstanding, round-robin"),
        ("balance_load_factor", 0.5, r"^balance_load_factor: must be >= 1"),
        ("eject_after_failures", -1, r"^eject_after_failures: must be >= 0"),
        ("eject_cooldown_s", 0, r"^eject_cooldown_s: must be > 0"),
        ("eject_cooldown_s", math.inf, r"^eject_cooldown_s: must be finite"),
        ("hedge_after_percentile", -1, r"^hedge_after_percentile: must be >= 0"),
        ("hedge_after_percentile", 100, r"^hedge_after_percentile: must be 0 \(off\) or below 100"),
        ("hedge_min_s", -0.1, r"^hedge_min_s: must be >= 0"),
    ],
)
def test_replica_balancing_fields_are_validated(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**{field: value})


def test_replica_balancing_env_error_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"OPD_STREAM_EJECT_AFTER_FAILURES"):
        StreamConfig.from_env(environ={"OPD_STREAM_EJECT_AFTER_FAILURES": "-2"}, teachers=T)
