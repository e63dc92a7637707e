"""``cache_salt`` that keeps the cache: ``weight-version`` (a request's salt is
the weight version its server last reported: a side whose weights change gets a fresh cache,
a frozen one keeps its own), and a ``per-sample`` salt drawn once for all of a sample's
requests, the re-ask after ``weight_version_changed`` included.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
from support.config import FAST_BACKOFF, stream_config

from opd_stream import OPDStream, Sample, ScoredSample, StreamConfig
from opd_stream.config._settings import CONFIG_FIELDS
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.testing.mock_sglang._request import parse_generate_request

T = "http://teacher:1"
ST = "http://student:2"
P, R = 6, 5

_cfg = partial(stream_config, T, **FAST_BACKOFF, top_k=3, max_inflight=1)


def _salts(server: InProcessSGLang) -> list[list[str | None]]:
    """Per request the server received (in order), the salt of each of its items."""
    out = []
    for body in server.bodies:
        spec = parse_generate_request(
            body, vocab_size=151936, context_length=1 << 20, per_position="patched"
        )
        out.append([it.cache_salt for it in spec.items])
    return out


async def _run(
    cfg: StreamConfig, servers: dict[str, InProcessSGLang], samples: list[Sample]
) -> list[Any]:
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
    assert all(isinstance(r, ScoredSample) for r in out), out
    return out


def _sample(seed: int) -> Sample:
    return Sample(np.random.default_rng(seed).integers(0, 3000, P + R).tolist(), R)


async def test_a_per_sample_salt_is_kept_by_the_re_ask_after_a_weight_update() -> None:
    # the teacher's first answer mixes v1 and v2: the teacher is asked again
    servers = {
        T: InProcessSGLang("teacher", 1, weight_versions=("v1", "v2")),
        ST: InProcessSGLang("student", 1),
    }
    cfg = _cfg(student_url=ST, cache_salt="per-sample", id_scoring="blocked", id_block_size=2)
    (res,) = await _run(cfg, servers, [_sample(1)])
    assert res.attempts >= 2
    teacher = _salts(servers[T])
    assert len(teacher) == 2  # the first ask and the re-ask
    salts = {s for items in teacher + _salts(servers[ST]) for s in items}
    assert len(salts) == 1 and None not in salts


async def test_weight_version_salt_is_the_version_the_server_reported() -> None:
    servers = {T: InProcessSGLang("teacher", 1, weight_versions=("w7",))}
    cfg = _cfg(cache_salt="weight-version", top_k=0)
    await _run(cfg, servers, [_sample(i) for i in range(3)])
    # nothing known before the first answer; then the server's own version
    assert _salts(servers[T]) == [[None], ["w7"], ["w7"]]


async def test_weight_version_salt_follows_an_update_into_the_re_ask() -> None:
    servers = {
        T: InProcessSGLang("teacher", 1, weight_versions=("w1", "w1", "w2")),
        ST: InProcessSGLang("student", 1),
    }
    cfg = _cfg(student_url=ST, cache_salt="weight-version", id_scoring="blocked", id_block_size=2)
    await _run(cfg, servers, [_sample(2), _sample(3)])
    got = _salts(servers[T])
    # sample 1 (3 items): w1, w1, w2 -> re-asked under the new version's salt; sample 2 too
    assert got[0] == [None] * 3
    assert got[1:] == [["w2"] * 3, ["w2"] * 3]


async def test_weight_version_salt_is_each_sides_own() -> None:
    # a frozen teacher keeps its salt (its cache) while the student's weights move on
    servers = {
        T: InProcessSGLang("teacher", 1, weight_versions=("frozen",)),
        ST: InProcessSGLang("student", 1, weight_versions=("s1", "s1", "s2")),
    }
    cfg = _cfg(student_url=ST, cache_salt="weight-version", strategy="only-teacher")
    await _run(cfg, servers, [_sample(i) for i in range(4)])
    assert [s for (s,) in _salts(servers[T])] == [None, "frozen", "frozen", "frozen"]
    assert [s for (s,) in _salts(servers[ST])] == [None, "s1", "s1", "s2"]


def test_the_setting_takes_weight_version_and_says_what_the_random_modes_cost() -> None:
    cfg = StreamConfig.from_env(
        {"OPD_STREAM_TEACHERS": T, "OPD_STREAM_CACHE_SALT": "weight-version"}
    )
    assert cfg.cache_salt == "weight-version"
    (row,) = [r for r in CONFIG_FIELDS if r.field == "cache_salt"]
    assert "weight-version" in row.meaning
    assert row.meaning.count("debugging only") == 2
