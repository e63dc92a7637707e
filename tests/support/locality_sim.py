"""A discrete-event model of scoring traffic on a fleet with prefix caches, driving the real
:class:`~opd_stream.fleet._balance.EndpointPool` (sans-IO): what placement alone decides.

Each replica is one GPU: it serves its requests one at a time, first come first served,
taking ``per_token_s`` per token not served from its cache (its whole prompt unless a
request of the same prompt started there before, plus the response: SGLang's radix cache
with room for every prompt, the mock's model). Each client (one stream: its own pool and
endpoint state, nothing shared) keeps ``inflight`` samples in flight, each one request,
and starts its next sample when one is answered. The answer reports ``cached_tokens`` as
SGLang does.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opd_stream.fleet._balance import Balance, EndpointPool, Route
from opd_stream.fleet._endpoints import Endpoints


@dataclass
class Outcome:
    computed: list[int]  # tokens each replica computed
    unique: int  # every prompt once plus every response
    makespan_s: float
    placements: dict[int, set[str]] = field(default_factory=dict)  # key -> replicas

    @property
    def computed_over_unique(self) -> float:
        return sum(self.computed) / self.unique

    @property
    def max_over_mean(self) -> float:
        return max(self.computed) / (sum(self.computed) / len(self.computed))


def groups(prompts: int, per_prompt: int, prompt: int, response: int, seed: int) -> list[Route]:
    """Every sample of ``prompts`` GRPO groups as its route."""
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(prompts)]
    return [Route(key, prompt, response) for key in keys for _ in range(per_prompt)]


def completion_order(samples: Sequence[Route], seed: int) -> list[Route]:
    """The samples as rollouts finish: groups' samples at random times among others'."""
    out = list(samples)
    random.Random(seed).shuffle(out)
    return out


def simulate(
    urls: Sequence[str],
    clients: Sequence[Sequence[Route]],
    *,
    inflight: int,
    balance: Balance = "prefix",
    load_factor: float = 1.25,
    per_token_s: float = 1e-4,
    make_pool: Callable[[Endpoints], EndpointPool] | None = None,
) -> Outcome:
    """Run every client's samples (in their order) to the end."""
    cache: dict[str, set[int]] = {u: set() for u in urls}
    queue: dict[str, deque[tuple[int, Route, int]]] = {u: deque() for u in urls}
    busy: dict[str, bool] = dict.fromkeys(urls, False)
    computed = dict.fromkeys(urls, 0)
    pools = [
        make_pool(Endpoints())
        if make_pool is not None
        else EndpointPool(
            Endpoints(), balance=balance, load_factor=load_factor, rng=random.Random(c)
        )
        for c in range(len(clients))
    ]
    todo = [deque(c) for c in clients]
    events: list[tuple[float, int, str, int, Route, int, int]] = []
    seq = 0
    now = 0.0
    placements: dict[int, set[str]] = {}

    def serve(url: str) -> None:
        nonlocal seq
        if busy[url] or not queue[url]:
            return
        client, route, work = queue[url].popleft()
        hit = route.prompt if route.key in cache[url] else 0
        cache[url].add(route.key)
        cost = route.prompt + route.response - hit
        computed[url] += cost
        busy[url] = True
        seq += 1
        heapq.heappush(events, (now + cost * per_token_s, seq, url, client, route, work, hit))

    def start(client: int) -> None:
        if not todo[client]:
            return
        route = todo[client].popleft()
        pool = pools[client]
        url = pool.pick(urls, key=route if balance == "prefix" else None)
        assert url is not None
        work = pool.begin(url, route if balance == "prefix" else None)
        placements.setdefault(route.key, set()).add(url)
        queue[url].append((client, route, work))
        serve(url)

    for c in range(len(clients)):
        for _ in range(inflight):
            start(c)
    while events:
        now, _, url, client, route, work, hit = heapq.heappop(events)
        busy[url] = False
        pool = pools[client]
        keyed = route if balance == "prefix" else None
        pool.end(url, keyed, work)
        pool.record_cached(url, keyed, hit)
        serve(url)
        start(client)
    keys = {r.key: r.prompt for c in clients for r in c}
    unique = sum(keys.values()) + sum(r.response for c in clients for r in c)
    return Outcome([computed[u] for u in urls], unique, now, placements)
