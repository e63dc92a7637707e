"""Teacher routing and server URL validation (``docs/semantics.md``, "Teachers"; entries and
URLs: ``docs/semantics.md``, "Teacher entries and server URLs")."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_stream._errors import ConfigError, RoutingError
from opd_stream.fleet._routing import (
    DEFAULT_TEACHER,
    TeacherRouting,
    endpoint_url,
    generate_url,
    normalize_server_url,
    normalize_teachers,
    parse_teacher_urls,
)

# --------------------------------------------------------------------------- NAME=URL parsing


def test_entry_is_split_on_the_first_equals_sign() -> None:
    assert parse_teacher_urls(["code=http://h/g?tag=a=b"]) == {"code": ("http://h/g?tag=a=b",)}


def test_comma_separated_string_holds_several_entries() -> None:
    assert parse_teacher_urls("math=http://m:1, code=http://c:2") == {
        "math": ("http://m:1",),
        "code": ("http://c:2",),
    }


def test_replicas_are_joined_with_a_bar() -> None:
    assert parse_teacher_urls("a=http://h1:1|http://h2:2,b=http://h3:3") == {
        "a": ("http://h1:1", "http://h2:2"),
        "b": ("http://h3:3",),
    }


def test_iterable_entries_are_not_split_on_commas() -> None:
    # One entry per element: a comma inside an element is part of the URL's query.
    assert parse_teacher_urls(["a=http://h/?x=1,2"]) == {"a": ("http://h?x=1,2",)}


def test_entry_urls_are_normalised() -> None:
    assert parse_teacher_urls([" a = HTTP://H:1/generate/ "]) == {"a": ("http://h:1",)}


@pytest.mark.parametrize(
    ("entries", "detail"),
    [
        pytest.param(["http//no-equals"], "no '='", id="no-equals"),
        pytest.param(["=http://h:1"], "empty name", id="empty-name"),
        pytest.param(["  =http://h:1"], "empty name", id="blank-name"),
        pytest.param(["a="], "empty URL", id="empty-url"),
        pytest.param(["a=  "], "empty URL", id="blank-url"),
        pytest.param("a=http://h:1,", "no '='", id="trailing-comma"),
        pytest.param(["a=http://h:1|"], "empty URL", id="empty-replica"),
    ],
)
def test_malformed_entry_is_an_expected_name_url_error(entries: Any, detail: str) -> None:
    with pytest.raises(ConfigError, match="expected NAME=URL") as info:
        parse_teacher_urls(entries)
    assert detail in str(info.value)


def test_duplicate_teacher_name_is_an_error() -> None:
    with pytest.raises(ConfigError, match="duplicate teacher name 'a'"):
        parse_teacher_urls(["a=http://h1:1", "b=http://h2:2", "a=http://h3:3"])


def test_duplicate_replica_of_one_teacher_is_an_error() -> None:
    with pytest.raises(ConfigError, match="duplicate replica URL"):
        parse_teacher_urls(["a=http://h:1|http://h:1/generate"])


def test_no_entries_is_an_error() -> None:
    with pytest.raises(ConfigError, match="expected NAME=URL"):
        parse_teacher_urls([])


def test_invalid_url_error_names_the_teacher() -> None:
    with pytest.raises(ConfigError, match=r"teacher 'code'.*scheme must be http or https"):
        parse_teacher_urls(["code=ftp://h:1"])


# --------------------------------------------------------------------------- URL normalisation


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://h:30000", "http://h:30000"),
        ("http://h:30000/", "http://h:30000"),
        ("http://h:30000/generate", "http://h:30000"),
        ("http://h:30000/generate/", "http://h:30000"),
        ("https://h", "https://h"),
        ("http://h/sglang", "http://h/sglang"),
        ("http://h/sglang/", "http://h/sglang"),
        ("http://h/sglang/generate", "http://h/sglang"),
        ("http://h/sglang/generate/", "http://h/sglang"),
        ("HTTP://Host.Example:8080/Prefix", "http://host.example:8080/Prefix"),
        ("  http://h:1  ", "http://h:1"),
        ("http://[::1]:30000/generate", "http://[::1]:30000"),
        ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
        ("http://h/g?tag=a=b", "http://h/g?tag=a=b"),
        ("http://h/generate?tag=a", "http://h?tag=a"),
        ("http://h/generated", "http://h/generated"),
    ],
)
def test_base_and_generate_urls_normalise_to_the_base(url: str, base: str) -> None:
    assert normalize_server_url(url) == base


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        pytest.param("ftp://h:1", "scheme must be http or https", id="ftp"),
        pytest.param("localhost:30000", "scheme must be http or https", id="no-scheme"),
        pytest.param("h:30000/generate", "scheme must be http or https", id="bare-host"),
        pytest.param("http://", "no host", id="no-host"),
        pytest.param("http:///generate", "no host", id="path-only"),
        pytest.param("http://h:99999", "invalid port", id="port-too-big"),
        pytest.param("http://h:abc", "invalid port", id="port-not-number"),
        pytest.param("http://h:0", "invalid port", id="port-zero"),
        pytest.param("http://h:", "invalid port", id="port-empty"),
        pytest.param("http://h/generate#x", "fragment", id="fragment"),
        pytest.param("http://[::1", "invalid server URL", id="bad-ipv6"),
        pytest.param("", "empty", id="empty"),
        pytest.param("   ", "empty", id="blank"),
    ],
)
def test_invalid_server_url_is_a_config_error(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        normalize_server_url(url)


def test_non_string_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="must be a string"):
        normalize_server_url(30000)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    ["http://alice:hunter2@h:1", "http://alice@h:1", "https://:hunter2@h/generate"],
)
def test_credentials_in_url_are_rejected_without_echoing_them(url: str) -> None:
    with pytest.raises(ConfigError, match="credentials") as info:
        normalize_server_url(url)
    assert "hunter2" not in str(info.value)
    assert "alice" not in str(info.value)


def test_other_url_errors_mask_credentials_too() -> None:
    with pytest.raises(ConfigError, match="scheme") as info:
        normalize_server_url("ftp://user:hunter2@h:1")
    assert "hunter2" not in str(info.value)


@settings(max_examples=60, deadline=None)
@given(
    scheme=st.sampled_from(["http", "https", "HTTP"]),
    host=st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z]{2,5})?", fullmatch=True),
    port=st.none() | st.integers(1, 65535),
    prefix=st.lists(st.from_regex(r"[A-Za-z0-9_-]{1,6}", fullmatch=True), max_size=2),
    suffix=st.sampled_from(["", "/", "/generate", "/generate/"]),
    query=st.sampled_from(["", "?tag=a", "?a=b=c"]),
)
def test_normalisation_is_idempotent_and_strips_the_generate_suffix(
    scheme: str, host: str, port: int | None, prefix: list[str], suffix: str, query: str
) -> None:
    netloc = host if port is None else f"{host}:{port}"
    path = "".join(f"/{p}" for p in prefix)
    base = normalize_server_url(f"{scheme}://{netloc}{path}{suffix}{query}")
    # Prefix segments have at most 6 characters, so none of them is "generate".
    assert base == f"{scheme.lower()}://{netloc}{path}{query}"
    assert normalize_server_url(base) == base
    assert normalize_server_url(generate_url(base)) == base


def test_generate_url_appends_the_endpoint_before_the_query() -> None:
    assert generate_url("http://h/sglang?tag=a=b") == "http://h/sglang/generate?tag=a=b"


def test_generate_url_of_a_plain_base() -> None:
    assert generate_url("http://h:30000") == "http://h:30000/generate"


def test_endpoint_url_joins_one_slash() -> None:
    assert endpoint_url("http://h:1/p", "/health") == "http://h:1/p/health"
    assert endpoint_url("http://h:1", "get_server_info") == "http://h:1/get_server_info"


# --------------------------------------------------------------------------- teacher spellings


def test_plain_url_means_the_single_default_teacher() -> None:
    assert normalize_teachers("http://h:1/generate") == {DEFAULT_TEACHER: ("http://h:1",)}


def test_plain_url_with_query_equals_is_not_a_name() -> None:
    assert normalize_teachers("http://h/g?tag=a=b") == {"default": ("http://h/g?tag=a=b",)}


def test_plain_replica_urls_mean_the_default_teacher() -> None:
    assert normalize_teachers("http://h1:1|http://h2:2") == {
        "default": ("http://h1:1", "http://h2:2")
    }


def test_list_of_urls_means_default_replicas() -> None:
    assert normalize_teachers(["http://h1:1", "http://h2:2"]) == {
        "default": ("http://h1:1", "http://h2:2")
    }


def test_list_of_entries_is_a_routing_map() -> None:
    assert normalize_teachers(("a=http://h1:1", "b=http://h2:2|http://h3:3")) == {
        "a": ("http://h1:1",),
        "b": ("http://h2:2", "http://h3:3"),
    }


def test_mixed_list_is_an_error() -> None:
    with pytest.raises(ConfigError, match="mixes plain URLs and NAME=URL"):
        normalize_teachers(["http://h1:1", "a=http://h2:2"])


def test_mapping_values_may_be_a_url_a_bar_list_or_a_sequence() -> None:
    assert normalize_teachers(
        {"a": "http://h1:1", "b": "http://h2:2|http://h3:3", "c": ["http://h4:4/generate"]}
    ) == {"a": ("http://h1:1",), "b": ("http://h2:2", "http://h3:3"), "c": ("http://h4:4",)}


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        pytest.param({}, "no teacher configured", id="empty-mapping"),
        pytest.param([], "no teacher configured", id="empty-list"),
        pytest.param({"": "http://h:1"}, "non-empty string", id="empty-name"),
        pytest.param({1: "http://h:1"}, "non-empty string", id="int-name"),
        pytest.param({"a": 5}, "expected a URL or a list of URLs", id="int-url"),
        pytest.param({"a": []}, "no URL", id="no-replica"),
        pytest.param({"a": "http://h:1", " a ": "http://h:2"}, "duplicate", id="dup-after-strip"),
        pytest.param([5], "must be strings", id="int-entry"),
        pytest.param(5, "teachers must be", id="int"),
        pytest.param("", "expected NAME=URL", id="empty-string"),
    ],
)
def test_invalid_teacher_spec_is_a_config_error(spec: Any, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        normalize_teachers(spec)


# --------------------------------------------------------------------------- per-sample routing


def _routing(**kwargs: Any) -> TeacherRouting:
    return TeacherRouting({"math": "http://m:1", "code": "http://c:1|http://c:2"}, **kwargs)


def test_known_name_routes_to_that_teacher() -> None:
    routing = _routing()
    assert routing.resolve({"opd_teacher": "code"}) == "code"
    assert routing.route({"opd_teacher": "code"}) == ("code", ("http://c:1", "http://c:2"))


def test_metadata_value_is_compared_as_a_string() -> None:
    routing = TeacherRouting({"7": "http://h:1", "True": "http://h:2"})
    assert routing.resolve({"opd_teacher": 7}) == "7"
    assert routing.resolve({"opd_teacher": True}) == "True"


def test_custom_teacher_key() -> None:
    routing = _routing(teacher_key="domain")
    assert routing.teacher_key == "domain"
    assert routing.resolve({"domain": "math", "opd_teacher": "code"}) == "math"


def test_unknown_name_falls_back_to_default() -> None:
    routing = TeacherRouting({"math": "http://m:1", "default": "http://d:1"})
    assert routing.resolve({"opd_teacher": "poetry"}) == "default"


def test_missing_name_falls_back_to_default() -> None:
    routing = TeacherRouting({"math": "http://m:1", "default": "http://d:1"})
    assert routing.resolve({}) == "default"
    assert routing.resolve(None) == "default"
    assert routing.resolve({"opd_teacher": None}) == "default"


def test_unknown_name_without_default_names_the_key_and_known_names_never_the_value() -> None:
    with pytest.raises(RoutingError) as info:
        _routing().resolve({"opd_teacher": "poetry-SECRET"})
    message = str(info.value)
    assert "'opd_teacher'" in message
    assert "poetry" not in message and "SECRET" not in message
    assert "a str that names no such teacher" in message
    assert "['code', 'math']" in message  # sorted


def test_missing_name_without_default_says_missing() -> None:
    with pytest.raises(RoutingError, match=r"'opd_teacher' \(value: missing\)"):
        _routing().resolve({"other": "x"})


def test_routing_error_is_a_lookup_error() -> None:
    with pytest.raises(LookupError):
        _routing().resolve({})


def test_a_single_named_teacher_does_not_catch_unknown_names() -> None:
    routing = TeacherRouting({"math": "http://m:1"})
    with pytest.raises(RoutingError, match="known teachers: \\['math'\\]"):
        routing.resolve({})


def test_no_routing_map_routes_every_sample_to_the_single_teacher() -> None:
    routing = TeacherRouting("http://h:1")
    assert routing.names == ("default",)
    for metadata in ({}, None, {"opd_teacher": "anything"}, {"opd_teacher": 3}):
        assert routing.route(metadata) == ("default", ("http://h:1",))


def test_long_metadata_values_are_truncated_in_the_error() -> None:
    with pytest.raises(RoutingError) as info:
        _routing().resolve({"opd_teacher": "x" * 10_000})
    assert len(str(info.value)) < 400


def test_urls_of_a_teacher() -> None:
    assert _routing().urls("code") == ("http://c:1", "http://c:2")


def test_urls_of_an_unknown_teacher_is_a_routing_error() -> None:
    with pytest.raises(RoutingError, match="unknown teacher 'poetry'"):
        _routing().urls("poetry")


def test_the_routing_validates_the_whole_configuration_at_construction() -> None:
    with pytest.raises(ConfigError, match="teacher 'b'"):
        TeacherRouting({"a": "http://h:1", "b": "ftp://h:2"})


def test_empty_teacher_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="teacher_key"):
        TeacherRouting("http://h:1", teacher_key="")


def test_the_routing_keeps_its_own_copy_of_the_map() -> None:
    routing = _routing()
    routing.teachers["math"] = ("http://evil:1",)
    assert routing.urls("math") == ("http://m:1",)
