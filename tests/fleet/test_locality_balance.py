"""Prefix placement by work: a replica's load is the uncached tokens its
requests in flight are expected to compute (a request's whole prompt where that prompt is not
cached, its response alone where it is), every request goes to the first replica of its
order (its prompt's replicas first) under the bound, a replica known to hold the prompt keeps
it up to 3 prompts of work above the bound (elsewhere the prompt is computed again), a new
prompt leaves its first choice at the bound itself, and while the stream has at most 2
requests per replica in flight a replica holding the prompt keeps it while it holds at most 2
requests above its share of them (what chance puts there); a blocked attempt counts once, and
many clients agree with no shared state.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections import Counter
from functools import partial

import anyio
import numpy as np
import pytest
from support.config import FAST_BACKOFF, one_pool, stream_config
from support.locality_sim import completion_order, groups, simulate

from opd_stream import MockTransport, OPDStream, Response, Sample, ScoredSample
from opd_stream.fleet._balance import EndpointPool, Route
from opd_stream.fleet._endpoints import Endpoints
from opd_stream.testing.inprocess import InProcessSGLang

URLS = tuple(f"http://replica-{i}:1" for i in range(4))
P, R = 1000, 100


def _pool(factor: float = 1.25, limit: int = 64) -> EndpointPool:
    return EndpointPool(
        Endpoints(), balance="prefix", load_factor=factor, limit=limit, rng=random.Random(0)
    )


def _key(seed: int) -> int:
    return random.Random(seed).getrandbits(64)


# --- the work a request brings -----------------------------------------------------------
def test_a_request_is_charged_its_prompt_where_it_is_not_cached_and_its_response_where_it_is() -> (
    None
):
    pool = _pool()
    route = Route(_key(1), P, R)
    first = pool.begin(URLS[0], route)
    joined = pool.begin(URLS[0], route)  # in flight there: batched with the first
    assert (first, joined) == (P + R, R)
    pool.end(URLS[0], route, first)
    pool.end(URLS[0], route, joined)
    assert pool.begin(URLS[0], route) == R  # it was computed there
    assert pool.begin(URLS[1], route) == P + R
    assert pool._endpoints.work(URLS[0]) == R and pool._endpoints.work(URLS[1]) == P + R


def test_a_replica_that_reports_the_prompt_cached_is_where_it_goes() -> None:
    """Another client computed it there: its answer's cached_tokens say so."""
    pool = _pool()
    route = Route(_key(2), P, R)
    third = pool.preference(URLS, route.key)[2]
    pool.record_cached(third, route, P // 4)  # a quarter: not its prompt
    assert pool.pick(URLS, key=route) == pool.preference(URLS, route.key)[0]
    pool = _pool()
    pool.record_cached(third, route, P)
    assert pool.pick(URLS, key=route) == third
    assert pool.begin(third, route) == R


# --- the bound in work -------------------------------------------------------------------
def _load(pool: EndpointPool, url: str, n: int, seed: int, prompt: int = P) -> None:
    for i in range(n):  # new prompts, each its whole prompt's work
        pool.begin(url, Route(_key(seed * 1000 + i), prompt, R))


def _spread(pool: EndpointPool, seed: int) -> None:
    """2 new prompts on every replica: 8 requests in flight, more than 2 per replica with the
    next one counted, so the bound alone decides."""
    for i, url in enumerate(URLS):
        _load(pool, url, 2, seed=seed * 10 + i)


def test_a_new_prompt_goes_to_its_first_choice_while_under_the_bound() -> None:
    key = _key(3)
    pool = _pool()
    first, second = pool.preference(URLS, key)[:2]
    _spread(pool, seed=1)
    _load(pool, first, 3, seed=2, prompt=150)  # 5 of 11 there: 2200 + 3 x 250 = 2950
    # first choice: where every client's first request of it goes, so cached as far as
    # anyone knows: 2950 < 1.25 x (9550 + 100) / 4 = 3015.6
    assert pool.pick(URLS, key=Route(key, P, R)) == first
    _load(pool, first, 1, seed=3, prompt=150)  # 3200 >= 1.25 x (9800 + 100) / 4 = 3093.75
    assert pool.pick(URLS, key=Route(key, P, R)) == second


def test_a_new_prompt_leaves_its_first_choice_at_the_bound_itself() -> None:
    """No replica computed it yet: moving it costs nothing, so its first choice has no slack
    (a replica holding it has 3 prompts)."""
    key = _key(7)
    pool = _pool()
    first, second = pool.preference(URLS, key)[:2]
    _spread(pool, seed=4)
    _load(pool, first, 4, seed=5, prompt=500)  # 6 of 12 there: 2200 + 4 x 600 = 4600
    # 4600 >= 1.25 x (11200 + 100) / 4 = 3531.25 (with 1.5 prompts of slack it stayed)
    assert pool.pick(URLS, key=Route(key, P, R)) == second


def test_a_replica_holding_the_prompt_keeps_it_up_to_three_prompts_above_the_bound() -> None:
    key = _key(4)
    pool = _pool()
    home = pool.preference(URLS, key)[1]
    pool.record_cached(home, Route(key, P, R), P)  # placed there by another client
    _spread(pool, seed=6)
    _load(pool, home, 4, seed=7, prompt=900)  # 6 of 12 there: 2200 + 4 x 1000 = 6200
    # 6200 < 1.25 x (12800 + 100) / 4 + 3 x 1000 = 7031.25 (1.5 prompts: 5531.25)
    assert pool._endpoints.work(home) >= 1.25 * (12800 + R) / 4 + 1.5 * P
    assert pool.pick(URLS, key=Route(key, P, R)) == home
    _load(pool, home, 2, seed=8, prompt=900)  # 8200 >= 1.25 x 14900 / 4 + 3000: elsewhere
    assert pool.pick(URLS, key=Route(key, P, R)) != home


def test_a_replica_within_its_share_of_the_requests_keeps_the_prompt_whatever_its_work() -> None:
    """A stream with 2 requests in flight, both on the prompt's first choice, the others idle:
    hashing puts that many on one replica by chance (share: ceil(3 / 4) = 1, plus 2)."""
    key = _key(8)
    pool = _pool()
    first = pool.preference(URLS, key)[0]
    _load(pool, first, 2, seed=9, prompt=4000)  # 8200 >= 1.25 x 8300 / 4 + 1.5 x 1000
    assert pool.pick(URLS, key=Route(key, P, R)) == first
    _load(pool, first, 1, seed=10, prompt=4000)  # 3 of 3 (share 1 + 2): the bound decides
    assert pool.pick(URLS, key=Route(key, P, R)) != first


def test_with_more_than_two_requests_per_replica_in_flight_the_bound_alone_decides() -> None:
    """9 in flight (10 with this one: more than 2 per replica) read load, not chance: a
    replica holding 3 of them (its share 3, plus 2, would have kept it) over the bound spills."""
    key = _key(9)
    pool = _pool()
    first = pool.preference(URLS, key)[0]
    _spread(pool, seed=11)
    _load(pool, first, 1, seed=12, prompt=4000)  # 2200 + 4100 >= 1.25 x (12900 + 100) / 4
    assert pool.pick(URLS, key=Route(key, P, R)) != first


@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_no_request_is_placed_above_the_bound(factor: float) -> None:
    """Requests arrive and leave at random; a third share a few hot prompts. Each goes where
    its prompt is in flight, or (with at most 2 requests per replica in flight) to a replica
    expected to hold its prompt with fewer than its share of them plus 2, or to a replica
    under ``factor`` x the mean work (this request counted), plus 3 prompts where its prompt
    is known cached."""
    pool = _pool(factor, limit=1 << 30)
    eps = pool._endpoints
    rng = random.Random(1)
    live: list[tuple[str, Route, int]] = []
    hot = [_key(10 + i) for i in range(3)]
    bounded = 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            url, route, work = live.pop(rng.randrange(len(live)))
            pool.end(url, route, work)
            continue
        key = rng.choice(hot) if rng.random() < 1 / 3 else rng.getrandbits(64)
        route = Route(key, rng.randrange(1, 2000), rng.randrange(1, 500))
        holders = {u for u in URLS if eps.held(u, key)}
        known = set(pool._cached.get(key, ())) | holders
        cached = known or {pool.preference(URLS, key)[0]}
        total = sum(eps.work(u) for u in URLS)
        inflight = sum(eps.load(u) for u in URLS) + 1
        share = math.ceil(inflight / len(URLS)) + 2 if inflight <= 2 * len(URLS) else 0
        url = pool.pick(URLS, key=route)
        assert url is not None
        if holders:
            assert url in holders
        elif not (url in cached and eps.load(url) < share):
            bounded += 1
            cost = route.response if url in cached else route.prompt + route.response
            slack = 3 * route.prompt if url in known else 0
            assert eps.work(url) < factor * (total + cost) / len(URLS) + slack
        live.append((url, route, pool.begin(url, route)))
    assert bounded > 300  # the bound decided, not the share


def test_a_prompt_in_flight_is_joined_and_remembered_there() -> None:
    pool = _pool()
    route = Route(_key(6), P, R)
    third = pool.preference(URLS, route.key)[2]
    work = pool.begin(third, route)
    assert pool.pick(URLS, key=route) == third
    pool.end(third, route, work)
    assert pool._endpoints.prompts(third) == 0
    assert pool.pick(URLS, key=route) == third  # its prefix is there


# --- completion order and many clients (the model of tests/support/locality_sim.py) ------
SIM_URLS = tuple(f"http://r{i}:1" for i in range(4))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_completion_order_a_prompt_is_computed_about_once_on_balanced_replicas(
    seed: int,
) -> None:
    """32 prompts x 8 samples (prompt 1024, response 256), 16 in flight, the samples as
    rollouts finish (groups' samples at random times among others')."""
    samples = completion_order(groups(32, 8, 1024, 256, seed), seed + 100)
    prefix = simulate(SIM_URLS, [samples], inflight=16)
    spread = simulate(SIM_URLS, [samples], inflight=16, balance="least-outstanding")
    assert prefix.computed_over_unique <= 1.05
    assert prefix.max_over_mean <= 1.25
    assert prefix.makespan_s < spread.makespan_s
    assert spread.computed_over_unique > 1.8  # what the prefix saves


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_completion_order_one_stream_computes_every_prompt_once(seed: int) -> None:
    """The same traffic: a group's samples stay where its prompt is (a new group moves
    instead, before any replica computed it), with the load as balanced as before."""
    samples = completion_order(groups(32, 8, 1024, 256, seed), seed + 100)
    out = simulate(SIM_URLS, [samples], inflight=16)
    assert sum(out.computed) == out.unique
    assert out.max_over_mean <= 1.25


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_four_clients_without_shared_state_keep_a_prompt_together(seed: int) -> None:
    """4 streams x 4 in flight on 4 replicas, samples dealt at random, each stream with its
    own pool: computed 1.04-1.08x the unique tokens, replica load max / mean 1.15-1.33 (the
    bound is each client's own view: 32 prompts hashed to 4 replicas)."""
    samples = completion_order(groups(32, 8, 1024, 256, seed), seed + 100)
    rng = random.Random(seed + 7)
    clients: list[list[Route]] = [[], [], [], []]
    for route in samples:
        clients[rng.randrange(4)].append(route)
    out = simulate(SIM_URLS, clients, inflight=4)
    spread = simulate(SIM_URLS, clients, inflight=4, balance="least-outstanding")
    assert out.computed_over_unique <= 1.1
    assert out.max_over_mean <= 1.4
    assert out.makespan_s < spread.makespan_s


def test_the_key_order_is_the_same_in_every_process() -> None:
    """No per-process seed (``PYTHONHASHSEED``, a random source) enters a key or its order."""
    keys = [_key(i) for i in range(50)]
    code = (
        "import sys; from opd_stream.fleet._balance import EndpointPool, prefix_key; "
        "from opd_stream.fleet._endpoints import Endpoints; import numpy as np; "
        "p = EndpointPool(Endpoints(), balance='prefix'); "
        f"urls = {list(URLS)!r}; "
        f"print([p.preference(urls, k) for k in {keys!r}]); "
        "print(prefix_key(np.arange(100, dtype=np.int64), 10))"
    )
    pool = _pool()
    here = [pool.preference(URLS, k) for k in keys]
    key_here = prefix_key_of_range()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        got = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.splitlines()
        assert got[0] == repr(here)
        assert int(got[1]) == key_here


def prefix_key_of_range() -> int:
    from opd_stream.fleet._balance import prefix_key

    return prefix_key(np.arange(100, dtype=np.int64), 10)


# --- the blocked id form: a sample's blocks count once -----------------------------------
class _Fleet:
    """In-process replicas that remember which replica each prompt was sent to."""

    def __init__(self) -> None:
        self.servers = {u: InProcessSGLang("teacher", 1) for u in URLS}
        self.seen: dict[tuple[int, ...], set[str]] = {}
        self.transport = MockTransport(self.handle)

    async def handle(self, method: str, url: str, body: bytes) -> Response:
        import json

        base = next(b for b in self.servers if url.startswith(b))
        path = url[len(base) :]
        if path == "/generate":
            await anyio.sleep(0.002)  # let requests overlap
            ids = json.loads(body)["input_ids"]
            self.seen.setdefault(tuple(ids[:PROMPT]), set()).add(base)
        return self.servers[base].handle(method, path, body)


PROMPT, RESPONSE, GROUPS, PER_GROUP, K = 12, 16, 8, 4, 2


def _blocked_groups(student: InProcessSGLang) -> list[Sample]:
    rng = np.random.default_rng(0)
    out = []
    for g in range(GROUPS):
        head = rng.integers(0, 3000, PROMPT).tolist()
        for _ in range(PER_GROUP):
            tokens = head + rng.integers(0, 3000, RESPONSE).tolist()
            ids, lps = student.model.topk_in(
                student.model.head_rows(np.asarray(tokens), np.arange(PROMPT, PROMPT + RESPONSE)),
                K,
            )
            rows = [
                [[float(lp), int(i)] for lp, i in zip(lps[t], ids[t], strict=True)]
                for t in range(RESPONSE)
            ]
            out.append(Sample(tokens, RESPONSE, student_top_logprobs=rows, sample_id=g))
    return out


_cfg = partial(stream_config, one_pool(URLS), **FAST_BACKOFF)


@pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {"debug": True}), ("trio", {})], ids=["asyncio", "trio"]
)
async def test_a_groups_blocks_meet_on_one_replica() -> None:
    """Blocks of 2 rows (8 per sample) at 8 requests per replica: a sample's blocks are one
    request of its prompt, so its group's other samples join it instead of spilling."""
    fleet = _Fleet()
    samples = _blocked_groups(InProcessSGLang("student", 1))
    cfg = _cfg(
        top_k=K,
        id_scoring="blocks",
        id_block_size=2,
        max_inflight=GROUPS * PER_GROUP,
        max_inflight_per_endpoint=8,
    )
    async with OPDStream(cfg, transport=fleet.transport) as stream:
        async with stream.run(samples) as results:
            out = [r async for r in results]
    assert all(isinstance(r, ScoredSample) for r in out), out
    spread = Counter(len(v) for v in fleet.seen.values())
    assert sum(spread.values()) == GROUPS
    assert spread[1] == GROUPS, spread  # every group on one replica
