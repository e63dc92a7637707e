"""Settings renamed before 1.0 (``RENAMED_SETTINGS``): the new name is the field; the old
one is still read for one release, everywhere a setting is given or read (a keyword of
``StreamConfig(...)``, ``from_env``, ``evolve``, ``check_settings``; its ``OPD_STREAM_*``
variable; the attribute), each use a ``DeprecationWarning`` pointing at the caller's line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from opd_stream import MockTransport, Response
from opd_stream._errors import ConfigError
from opd_stream.config._settings import (
    ENV_PREFIX,
    RENAMED_SETTINGS,
    StreamConfig,
    check_settings,
)

T = "http://t:30000"
#: old name -> (new name, a value other than the default, as text for the environment)
CASES = {
    "decode_thread_bytes": ("offload_bytes", 4096, "4096"),
    "router_discovery": ("gateway_discovery", "off", "off"),
}


def test_every_renamed_setting_is_covered_here() -> None:
    assert {old: new for old, (new, _, _) in CASES.items()} == dict(RENAMED_SETTINGS)


@pytest.mark.parametrize("old", CASES)
def test_the_new_name_is_the_field(old: str) -> None:
    new, value, text = CASES[old]
    assert new in StreamConfig.__struct_fields__ and old not in StreamConfig.__struct_fields__
    assert getattr(StreamConfig(teachers=T, **{new: value}), new) == value
    env = {ENV_PREFIX + "TEACHERS": T, ENV_PREFIX + new.upper(): text}
    assert getattr(StreamConfig.from_env(environ=env), new) == value


def _warns_here(old: str, make: Callable[[], Any]) -> Any:
    with pytest.deprecated_call(match=f"{old} is deprecated: it is .* now") as caught:
        got = make()
    assert [w.filename for w in caught] == [__file__]
    return got


@pytest.mark.parametrize("old", CASES)
def test_the_old_keyword_is_read_with_a_warning(old: str) -> None:
    new, value, _ = CASES[old]
    for make in (
        lambda: StreamConfig(teachers=T, **{old: value}),
        lambda: StreamConfig.from_env(environ={}, teachers=T, **{old: value}),
        lambda: StreamConfig(teachers=T).evolve(**{old: value}),
    ):
        assert getattr(_warns_here(f"the setting {old}", make), new) == value
    assert _warns_here(f"the setting {old}", lambda: check_settings(**{old: value})) == {new: value}


@pytest.mark.parametrize("old", CASES)
def test_the_old_environment_variable_is_read_with_a_warning(old: str) -> None:
    new, value, text = CASES[old]
    env = {ENV_PREFIX + "TEACHERS": T, ENV_PREFIX + old.upper(): text}
    cfg = _warns_here(
        f"the environment variable {ENV_PREFIX}{old.upper()}",
        lambda: StreamConfig.from_env(environ=env),
    )
    assert getattr(cfg, new) == value


@pytest.mark.parametrize("old", CASES)
def test_the_old_attribute_is_read_with_a_warning(old: str) -> None:
    new, value, _ = CASES[old]
    cfg = StreamConfig(teachers=T, **{new: value})
    assert _warns_here(f"StreamConfig.{old}", lambda: getattr(cfg, old)) == value


@pytest.mark.parametrize("old", CASES)
def test_the_old_and_the_new_name_together_are_refused(old: str) -> None:
    new, value, text = CASES[old]
    with pytest.raises(ConfigError, match=f"^{new}: given twice, also as {old}"):
        StreamConfig(teachers=T, **{old: value, new: value})
    env = {
        ENV_PREFIX + "TEACHERS": T,
        ENV_PREFIX + old.upper(): text,
        ENV_PREFIX + new.upper(): text,
    }
    with pytest.raises(ConfigError, match=f"^{ENV_PREFIX}{new.upper()}: set twice"):
        StreamConfig.from_env(environ=env)


def test_a_bad_value_under_the_old_name_names_the_new_field() -> None:
    with pytest.deprecated_call(), pytest.raises(ConfigError, match=r"^offload_bytes"):
        StreamConfig(teachers=T, decode_thread_bytes=-1)


async def _workers(transport: MockTransport) -> int:
    return (await transport.get("http://gw:1/workers", max_bytes=1 << 20)).status


@pytest.mark.parametrize("gateways", [False, True])
async def test_a_mock_transport_plays_a_gateway_when_asked(gateways: bool) -> None:
    transport = MockTransport(lambda m, u, b: Response(200, b"{}"), gateways=gateways)
    assert await _workers(transport) == (200 if gateways else 404)


async def test_the_mock_transports_old_keyword_routers_warns() -> None:
    with pytest.deprecated_call(match=r"MockTransport\(routers=...\) is deprecated") as caught:
        transport = MockTransport(lambda m, u, b: Response(200, b"{}"), routers=True)
    assert [w.filename for w in caught] == [__file__]
    assert await _workers(transport) == 200
