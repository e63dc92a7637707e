"""``cache_salt``: none (no field), per-sample (one random salt for all of a sample's
requests), per-request (a fresh salt for every HTTP request, every item and block its own).

SGLang 0.5.23 types the field ``Optional[StringOrList]``: a batch body carries one string
(all items) or one string per item.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import msgspec
import numpy as np
import pytest
from support.config import stream_config

from opd_stream import OPDStream, Sample, ScoredSample, StreamConfig
from opd_stream.cli._score_options import add_score_arguments, score_config
from opd_stream.integrations.miles import config_from_miles_args
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.testing.mock_sglang import MockServer
from opd_stream.testing.mock_sglang._request import parse_generate_request
from opd_stream.wire._payloads import build_block_payloads, build_score_payload
from opd_stream.wire._request import ScoreRequest

T = "http://teacher:1"
ST = "http://student:2"
P, R = 6, 5


def _req(**kw: Any) -> ScoreRequest:
    tokens = np.random.default_rng(0).integers(0, 3000, P + R).astype(np.int64)
    return ScoreRequest(tokens=tokens, response_length=R, **kw)


def _ids() -> np.ndarray:
    return np.arange(R * 2, dtype=np.int64).reshape(R, 2) + 10


def _salts(body: bytes) -> Any:
    return msgspec.json.decode(body).get("cache_salt")


def _parsed_salts(body: bytes) -> list[str | None]:
    spec = parse_generate_request(
        body, vocab_size=151936, context_length=1 << 20, per_position="patched"
    )
    return [it.cache_salt for it in spec.items]


# -- payloads -------------------------------------------------------------------------------


def test_no_salt_sends_no_field() -> None:
    assert "cache_salt" not in msgspec.json.decode(build_score_payload(_req()))


def test_a_single_body_carries_its_salt_and_the_server_reads_it() -> None:
    body = build_score_payload(_req(cache_salt="abc"))
    assert _salts(body) == "abc"
    assert _parsed_salts(body) == ["abc"]


def test_a_blocked_batch_shares_one_salt_unless_each_item_gets_its_own() -> None:
    shared = build_score_payload(_req(ids=_ids(), id_form="blocked", block_size=2, cache_salt="s"))
    assert _salts(shared) == "s"
    assert _parsed_salts(shared) == ["s", "s", "s"]
    each = build_score_payload(
        _req(ids=_ids(), id_form="blocked", block_size=2, cache_salt="s", salt_each_item=True)
    )
    assert _salts(each) == ["s-0", "s-1", "s-2"]
    assert _parsed_salts(each) == ["s-0", "s-1", "s-2"]


@pytest.mark.parametrize(
    ("each", "expected"), [(False, ["s", "s", "s"]), (True, ["s-0", "s-1", "s-2"])]
)
def test_blocks_sent_separately_carry_the_salt(each: bool, expected: list[str]) -> None:
    req = _req(ids=_ids(), id_form="blocks", block_size=2, cache_salt="s", salt_each_item=each)
    assert [_salts(b) for b in build_block_payloads(req)] == expected


def test_the_per_position_form_carries_the_salt() -> None:
    body = build_score_payload(_req(ids=_ids(), id_form="per-position", cache_salt="pp"))
    assert _parsed_salts(body) == ["pp"]


# -- the pipeline ---------------------------------------------------------------------------


def _servers() -> dict[str, InProcessSGLang]:
    return {T: InProcessSGLang("teacher", 1), ST: InProcessSGLang("student", 1)}


async def _run(mode: str, n: int = 3, **kw: Any) -> dict[str, InProcessSGLang]:
    servers = _servers()
    cfg = stream_config(T, student_url=ST, top_k=3, strategy="union", cache_salt=mode, **kw)
    rng = np.random.default_rng(1)
    samples = [Sample(rng.integers(0, 3000, P + R).tolist(), R, sample_id=i) for i in range(n)]
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
    assert all(isinstance(r, ScoredSample) for r in out), out
    return servers


def _body_salts(servers: dict[str, InProcessSGLang]) -> list[list[str | None]]:
    return [_parsed_salts(b) for s in servers.values() for b in s.bodies]


def _by_tokens(servers: dict[str, InProcessSGLang]) -> dict[bytes, set[str | None]]:
    """Salts seen per sample (keyed by the response tokens every request of it ends in)."""
    out: dict[bytes, set[str | None]] = {}
    for s in servers.values():
        for body in s.bodies:
            spec = parse_generate_request(
                body, vocab_size=151936, context_length=1 << 20, per_position="patched"
            )
            key = spec.items[0].input_ids[:P].tobytes()
            out.setdefault(key, set()).update(it.cache_salt for it in spec.items)
    return out


async def test_by_default_no_request_carries_a_salt() -> None:
    servers = await _run("none")
    assert all(s is None for items in _body_salts(servers) for s in items)


async def test_per_sample_one_salt_covers_a_samples_requests_and_only_them() -> None:
    servers = await _run("per-sample")
    per_sample = _by_tokens(servers)
    assert len(per_sample) == 3
    salts = [next(iter(v)) for v in per_sample.values()]
    assert all(len(v) == 1 for v in per_sample.values())  # teacher and student alike
    assert len(set(salts)) == 3 and None not in salts


async def test_per_request_every_request_and_item_has_a_fresh_salt() -> None:
    servers = await _run("per-request", id_scoring="blocked", id_block_size=2)
    items = [s for body in _body_salts(servers) for s in body]
    assert len(items) > 3 * 3  # blocked: several items per request
    assert None not in items
    assert len(set(items)) == len(items)


async def test_salts_are_random_not_taken_from_the_payload() -> None:
    one = {s for body in _body_salts(await _run("per-sample")) for s in body}
    two = {s for body in _body_salts(await _run("per-sample")) for s in body}
    assert not one & two  # the same samples, other salts
    for salt in one:
        assert salt is not None and len(salt) == 16 and int(salt, 16) >= 0


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"debug": True})])
async def test_the_mock_server_records_the_salts_it_receives() -> None:
    server = MockServer("teacher", 1)
    await server.start()
    try:
        cfg = stream_config(server.url, cache_salt="per-request")
        samples = [Sample(list(range(1, P + R + 1)), R) for _ in range(2)]
        async with OPDStream(cfg) as stream:
            async with stream.run(samples) as results:
                assert all([isinstance(r, ScoredSample) async for r in results])
    finally:
        await server.stop()
    assert server.stats.salted_items == 2
    assert len(set(server.stats.cache_salts)) == 2
    server.stats.reset()
    assert server.stats.cache_salts == [] and server.stats.salted_items == 0


# -- where the setting comes from -----------------------------------------------------------


def test_the_environment_variable_sets_it() -> None:
    cfg = StreamConfig.from_env({"OPD_STREAM_TEACHERS": T, "OPD_STREAM_CACHE_SALT": "per-sample"})
    assert cfg.cache_salt == "per-sample"


def test_the_score_command_has_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPD_STREAM_TEACHERS", raising=False)
    p = argparse.ArgumentParser()
    add_score_arguments(p)
    args = p.parse_args(
        ["--teacher", f"t={T}", "--input", "x", "--output", "y", "--cache-salt", "per-request"]
    )
    cfg, _ = score_config(args)
    assert cfg.cache_salt == "per-request"
    with pytest.raises(SystemExit):
        p.parse_args(["--teacher", f"t={T}", "--input", "x", "--output", "y", "--cache-salt", "x"])


def test_the_miles_flag_sets_it() -> None:
    args = argparse.Namespace(
        use_opd=True, opd_type="sglang", rm_url=f"{T}/generate", opd_cache_salt="per-sample"
    )
    assert config_from_miles_args(args, environ={}).cache_salt == "per-sample"
    bad = argparse.Namespace(
        use_opd=True, opd_type="sglang", rm_url=f"{T}/generate", opd_cache_salt="always"
    )
    with pytest.raises(ValueError, match="--opd-cache-salt"):
        config_from_miles_args(bad, environ={})
    without = argparse.Namespace(opd_cache_salt="per-sample")
    with pytest.raises(ValueError, match="--opd-cache-salt given without --use-opd"):
        config_from_miles_args(without, environ={})


def test_the_config_table_documents_the_cost() -> None:
    from opd_stream.config._settings import CONFIG_FIELDS

    (row,) = [r for r in CONFIG_FIELDS if r.field == "cache_salt"]
    assert "no prefix reuse" in row.meaning
    assert json.dumps(row.default) == '"none"' or row.default == "none"
