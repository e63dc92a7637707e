"""How well can N clients place GRPO groups on a prefix-caching fleet with no shared state?

Scenario 9's N-clients variant (issue 34, section 2) asks N client processes, each with a
stream of its own and no state shared between them, for both ``computed / unique <= 1.1``
and ``max / mean replica load <= 1.25``. This module is a model of that placement problem
(no servers, no ``opd_stream`` code): it replays the variant's traffic, many random draws of
it, against placement rules of every family a client could run, and counts the draws in
which a rule meets both targets. Run::

    python -m bench.placement_bound [--groups 32] [--prompt 1024] [--response 256] [--draws 400]

The traffic (as ``bench.locality``): ``groups`` GRPO groups of ``per_group`` samples;
group ``g``'s samples finish at ``g + Exp(spread)`` (``spread`` 4: near their group;
1000: a uniform shuffle), dealt at random to ``clients`` processes. Each replica caches
every prompt it has computed (no eviction: scenario 9's caches hold all its work). A
sample costs its replica its ``response`` tokens, plus its ``prompt`` where the replica
has not computed that prompt before. ``computed / unique``: the fleet's tokens over each
prompt once plus every response (1.0: each group on one replica; the bench's mock adds its
page floor, 1.036 at the default sizes, to every rule alike). ``load``: max / mean of what
each replica computed. Each group's replica order is a random permutation (rendezvous
hashing: the same in every client).

The rules, by what a client knows when it places a sample:

* ``key hash``: the group's first choice, always (``smg prefix_hash`` / ``consistent_hashing``
  with no load bound): nothing shared is needed, and nothing balances.
* ``own view, slack S``: a client places a group it has not seen on the first replica in
  the group's order whose work, as this client's own requests made it (charged in full
  until an answer says the prompt was cached there: ``cached_tokens``), stays within
  ``1.25 x`` its mean plus ``S`` groups' worth of work; a group it has seen stays where
  it put it. The family of the ``prefix`` balance and of smg's gateways on their own view.
* ``global load, slack S``: the same rule reading every replica's true work at the
  moment (what no client can read: an upper bound on any scheme that shares load, such as
  scraping the replicas' metrics), each client still placing the groups it has not seen.
* ``opd_stream prefix``: each client's own :class:`~opd_stream.fleet._balance.EndpointPool`
  (the default ``balance="prefix"``, ``balance_load_factor`` 1.25), driven sans-IO: a
  client keeps ``inflight`` requests in flight, the oldest answered (``cached_tokens``
  reported) before its next is placed.
* ``shared placement``: the global-load rule decides a group's replica once, at its first
  sample anywhere, and every client follows it (one gateway's view: ``smg cache_aware``
  through one gateway, or a coordinator).

The model is generous to the rules: no page floor, no eviction, answers (and the
``cached_tokens`` they carry) back after ``lag`` placements, no timing noise.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ("Sizes", "Traffic", "bound_table", "draw_traffic", "place")

COMPUTED_TARGET = 1.1
LOAD_TARGET = 1.25
LOAD_FACTOR = 1.25


@dataclass(frozen=True)
class Sizes:
    """Scenario 9's N-clients sizes (the defaults: the README's and issue 34's)."""

    groups: int = 32
    per_group: int = 8
    prompt: int = 1024
    response: int = 256
    replicas: int = 4
    clients: int = 4
    spread: float = 4.0
    lag: int = 16  # placements between a request and its answer (16 in flight)
    inflight: int = 4  # requests in flight per client (``opd_stream prefix``)

    @property
    def unique(self) -> int:
        return self.groups * (self.prompt + self.per_group * self.response)

    @property
    def group_work(self) -> float:
        return float(self.prompt + self.per_group * self.response)


@dataclass(frozen=True)
class Traffic:
    """One draw: the samples' groups in completion order, their clients, each group's
    replica order."""

    group: npt.NDArray[np.int64]
    client: npt.NDArray[np.int64]
    keys: list[int]  # each group's routing key
    order: npt.NDArray[np.int64]  # [groups, replicas]: each key's rendezvous order


def _urls(sz: Sizes) -> list[str]:
    return [f"http://replica-{r}:1" for r in range(sz.replicas)]


def draw_traffic(sz: Sizes, seed: int) -> Traffic:
    from opd_stream.fleet._balance import EndpointPool
    from opd_stream.fleet._endpoints import Endpoints

    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(sz.groups), sz.per_group)
    finish = groups + rng.exponential(sz.spread, groups.size)
    group = groups[np.argsort(finish, kind="stable")]
    client = rng.integers(0, sz.clients, group.size)
    keys = [int(k) for k in rng.integers(0, 2**63, sz.groups)]
    urls = _urls(sz)
    ranking = EndpointPool(Endpoints(), balance="prefix")  # its order: the one every rule uses
    order = np.array([[urls.index(u) for u in ranking.preference(urls, k)] for k in keys])
    return Traffic(group=group, client=client, keys=keys, order=order)


class _Replicas:
    """What each replica computed: a sample's response, and its prompt the first time."""

    def __init__(self, sz: Sizes) -> None:
        self._sz = sz
        self.computed = np.zeros(sz.replicas)
        self._cached: list[set[int]] = [set() for _ in range(sz.replicas)]

    def serve(self, r: int, group: int) -> bool:
        """Replica ``r`` scores a sample of ``group``: whether its prompt was cached there."""
        hit = group in self._cached[r]
        self.computed[r] += self._sz.response + (0 if hit else self._sz.prompt)
        self._cached[r].add(group)
        return hit

    def outcome(self) -> tuple[float, float]:
        """``(computed / unique, max / mean load)``."""
        c = self.computed
        return float(c.sum()) / self._sz.unique, float(c.max() / c.mean())


@dataclass
class _Client:
    work: npt.NDArray[np.float64]  # its own view of each replica's work
    home: dict[int, int] = field(default_factory=dict)
    known: dict[int, set[int]] = field(default_factory=dict)  # group -> replicas holding it


Rule = Callable[[npt.NDArray[np.float64], Sequence[int], float], int]
"""(a view of each replica's work, the group's replica order, the cost of a new prompt
there) -> the replica."""


def _bounded(slack_groups: float, sz: Sizes) -> Rule:
    slack = slack_groups * sz.group_work

    def rule(work: npt.NDArray[np.float64], order: Sequence[int], cost: float) -> int:
        total = float(work.sum())
        for r in order:
            if work[r] + cost <= LOAD_FACTOR * (total + cost) / len(work) + slack:
                return int(r)
        return int(min(order, key=lambda r: work[r]))

    return rule


def _opd_stream(sz: Sizes, traffic: Traffic) -> tuple[float, float]:
    """``traffic`` placed by each client's own ``EndpointPool`` (``balance="prefix"``)."""
    from opd_stream.fleet._balance import EndpointPool, Route
    from opd_stream.fleet._endpoints import Endpoints

    urls = _urls(sz)
    pools = [EndpointPool(Endpoints(), balance="prefix") for _ in range(sz.clients)]
    keys = traffic.keys
    fleet = _Replicas(sz)
    flying: list[list[tuple[str, Route, int, int]]] = [[] for _ in range(sz.clients)]
    for g, c in zip(traffic.group.tolist(), traffic.client.tolist(), strict=True):
        pool = pools[c]
        if len(flying[c]) >= sz.inflight:  # the oldest answered first
            url, route, work, hit = flying[c].pop(0)
            pool.end(url, route, work)
            pool.record_cached(url, route, hit)
        route = Route(keys[g], sz.prompt, sz.response)
        url = pool.pick(urls, key=route)
        assert url is not None
        work = pool.begin(url, route)
        hit = sz.prompt if fleet.serve(urls.index(url), g) else 0
        flying[c].append((url, route, work, hit))
    return fleet.outcome()


def place(sz: Sizes, traffic: Traffic, how: str, slack_groups: float = 0.0) -> tuple[float, float]:
    """Replay ``traffic`` under rule ``how`` (``key-hash``, ``own-view``, ``global-load``,
    ``opd-stream``, ``shared``): ``(computed / unique, max / mean load)``."""
    if how == "opd-stream":
        return _opd_stream(sz, traffic)
    fleet = _Replicas(sz)
    computed = fleet.computed  # (the global-load rule and a shared placement read it)
    clients = [_Client(np.zeros(sz.replicas)) for _ in range(sz.clients)]
    shared: dict[int, int] = {}
    rule = _bounded(slack_groups, sz)
    # (due, client, group, replica, charged, whether it hit the cache), in placement order
    answers: list[tuple[int, int, int, int, float, bool]] = []
    p, resp = sz.prompt, sz.response
    for i, (g, c) in enumerate(zip(traffic.group.tolist(), traffic.client.tolist(), strict=True)):
        while answers and answers[0][0] <= i:  # answers come back in placement order
            _, ac, ag, ar, charged, hit = answers.pop(0)
            view = clients[ac]
            if hit:
                view.known.setdefault(ag, set()).add(ar)
            view.work[ar] += (resp if hit else p + resp) - charged
        me = clients[c]
        order = traffic.order[g].tolist()
        if how == "key-hash":
            r = order[0]
        elif how == "shared":
            if g not in shared:
                shared[g] = rule(computed, order, p + resp)
            r = shared[g]
        elif g in me.home:
            r = me.home[g]
        else:
            r = rule(computed if how == "global-load" else me.work, order, p + resp)
        me.home[g] = r
        charged = float(resp if r in me.known.get(g, ()) else p + resp)
        me.known.setdefault(g, set()).add(r)
        me.work[r] += charged
        answers.append((i + sz.lag, c, g, r, charged, fleet.serve(r, g)))
    return fleet.outcome()


RULES: tuple[tuple[str, str, float], ...] = (
    ("key hash", "key-hash", 0.0),
    *((f"own view, slack {s:g}", "own-view", s) for s in (0.0, 0.25, 0.5, 1.0, 2.0)),
    *((f"global load, slack {s:g}", "global-load", s) for s in (0.0, 0.5, 1.0, 2.0)),
    ("opd_stream prefix", "opd-stream", 0.0),
    ("shared placement, slack 0", "shared", 0.0),
)


def bound_table(sz: Sizes, draws: int) -> list[dict[str, float | str]]:
    """Each rule over ``draws`` draws: mean and 90th percentile of computed / unique and of
    load, and the share of draws meeting both targets."""
    traffic = [draw_traffic(sz, seed) for seed in range(draws)]
    rows: list[dict[str, float | str]] = []
    for name, how, slack in RULES:
        got = np.array([place(sz, t, how, slack) for t in traffic])
        cu, load = got[:, 0], got[:, 1]
        both = (cu <= COMPUTED_TARGET) & (load <= LOAD_TARGET)
        rows.append(
            {
                "rule": name,
                "computed_mean": float(cu.mean()),
                "computed_p90": float(np.quantile(cu, 0.9)),
                "load_mean": float(load.mean()),
                "load_p90": float(np.quantile(load, 0.9)),
                "both_share": float(both.mean()),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    defaults = Sizes()
    parser = argparse.ArgumentParser(
        prog="python -m bench.placement_bound", description=__doc__.split("\n\n")[0]
    )
    ints = ("groups", "per_group", "prompt", "response", "replicas", "clients", "lag", "inflight")
    for name in ints:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name)
        )
    parser.add_argument("--spread", type=float, default=defaults.spread)
    parser.add_argument("--draws", type=int, default=400)
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args(argv)
    sz = Sizes(**{k: getattr(args, k) for k in Sizes.__dataclass_fields__})
    rows = bound_table(sz, args.draws)
    print(
        f"## {sz.clients} clients, {sz.replicas} replicas, {sz.groups} groups x {sz.per_group} "
        f"(prompt {sz.prompt}, response {sz.response}), spread {sz.spread:g}, {args.draws} draws"
    )
    print(f"(targets: computed / unique <= {COMPUTED_TARGET}, load <= {LOAD_TARGET})\n")
    print("| rule | computed / unique (mean, p90) | load (mean, p90) | draws meeting both |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rule']} | {r['computed_mean']:.3f}, {r['computed_p90']:.3f} | "
            f"{r['load_mean']:.3f}, {r['load_p90']:.3f} | {r['both_share']:.0%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sz.__dict__, "draws": args.draws, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
