"""Scenario 9: prefix locality on a GPU-bound teacher fleet, simulated on CPU.

GRPO groups (``s9_prompts`` prompts x ``s9_per_prompt`` samples) scored against
``s9_replicas`` mock teacher replicas, each with a prefix cache (SGLang's radix cache:
LRU, whole pages, reuse capped at ``logprob_start_len``) and the compute-time model (one
request at a time, ``s9_per_token_s`` per token not served from the cache): what a replica
computes, and so the run's wall time, is what prefix placement decides. Variants:

* ``own prompt``: the samples' own prompt (``s9_prompt`` tokens), all handed over at once;
* ``privileged teacher prompt``: a teacher prompt of its own (``s9_teacher_prompt`` tokens,
  one per group), at once;
* :data:`COMPLETION` (``own prompt, completion order``): the samples in the order rollouts
  finish (group ``g`` starts at time ``g``, each of its samples finishes an exponential time
  later, mean ``s9_spread``: a group's samples come at random times among other groups'),
  ``s9_window`` in flight at a time;
* :data:`BLOCKS` (``blocks, completion order``): the same order, the teacher scoring the
  student's top-``s9_topk`` ids as independent block requests (``id_scoring="blocks"``,
  ``s9_block`` rows a block: each block carries the prompt);
* :data:`CLIENTS` (``N client processes``): the same order dealt at random to
  ``s9_clients`` processes, one stream each (``max_inflight`` ``s9_client_inflight``), no
  shared state.

Runs (the same replicas and samples; caches flushed between runs):

* ``opd_stream prefix`` (the default ``balance``): the replicas as client-side replicas;
* ``opd_stream least-outstanding``: the same without prefix locality (the baseline);
* ``smg cache_aware``: through smg 1.13 with its default policy (discovery off), our
  ``X-SMG-Routing-Key`` and ``X-SMG-Routing-Tokens`` sent (the ``prefix`` balance's);
* ``smg cache_aware, no headers``: the same without them (``least-outstanding`` sends none);
* ``smg manual + routing key``: through smg ``--policy manual`` (new keys to the worker
  with the fewest keys, ``--assignment-mode min_group``), which pins each
  ``X-SMG-Routing-Key`` (our prefix key) to a worker (discovery off);
* ``opd_stream prefix, balance_load_factor 1.0``: the tightest bound;
* N clients only, with ``s9_gateway_per_client`` (on by default, off under ``--quick``):
  ``smg manual + routing key`` (one gateway: a shared view), and each client process
  through a gateway of its own (``s9_clients`` smg processes in front of the same
  replicas, no mesh: no state shared between them; the stream as for one gateway, our
  headers sent): ``smg cache_aware`` (:data:`SMG_EACH`), ``smg manual + routing key``
  (:data:`SMG_MANUAL_EACH`), ``smg prefix_hash`` (:data:`SMG_PREFIX_HASH_EACH`: our key's
  hash on a ring, walked past a worker over 1.25x the mean of what that gateway has in
  flight and 10 requests over it), the same walking past any worker over 1.25x the mean
  (:data:`SMG_PREFIX_HASH_BOUNDED_EACH`) and ``smg consistent_hashing``
  (:data:`SMG_CONSISTENT_EACH`: our key's hash on the ring, no load bound): another
  implementation's placement with no shared view, on the same work (the floor the
  ``prefix`` balance is held to); and ``cache_aware`` and ``manual`` with the gateways in
  smg's mesh on 127.0.0.1 (:data:`SMG_MESH`, :data:`SMG_MANUAL_MESH`: the gossiped view
  smg offers several gateways).

Measured per run: the tokens the replicas computed over the unique tokens (prompt once per
group plus every response), the max / mean of what each replica computed, wall time and
samples per second; from ``stats()``, the prompt and cached tokens the client saw. How
GPU-bound a run was is ``gpu_bound_share``: the busiest replica's simulated compute over the
wall time (1.0: the wall is that replica's GPU time; well below it, the client's and the
mocks' CPU set the pace and throughput says little about placement).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np

from opd_stream import Sample, StreamConfig
from opd_stream.testing.mock_sglang import MockOptions
from opd_stream.testing.router import _free_port

from .harness import mocks, run_opd
from .workload import TEACHER_SEED

__all__ = (
    "BLOCKS",
    "CLIENTS",
    "COMPLETION",
    "GATEWAY_PER_CLIENT_RUNS",
    "LOCALITY_RUNS",
    "s9_locality",
)

COMPLETION = "own prompt, completion order"
BLOCKS = "blocks, completion order"
CLIENTS = "N client processes, completion order"

Progress = Callable[[str], None]

FLOOR = "one replica (the floor)"

PREFIX, LEAST, SMG, SMG_BARE, SMG_MANUAL, TIGHT = LOCALITY_RUNS = (
    "opd_stream prefix",
    "opd_stream least-outstanding",
    "smg cache_aware",
    "smg cache_aware, no headers",
    "smg manual + routing key",
    "opd_stream prefix, balance_load_factor 1.0",
)

(
    SMG_EACH,
    SMG_MANUAL_EACH,
    SMG_PREFIX_HASH_EACH,
    SMG_PREFIX_HASH_BOUNDED_EACH,
    SMG_CONSISTENT_EACH,
    SMG_MESH,
    SMG_MANUAL_MESH,
) = GATEWAY_PER_CLIENT_RUNS = (
    "smg cache_aware, a gateway per client",
    "smg manual + routing key, a gateway per client",
    "smg prefix_hash, a gateway per client",
    "smg prefix_hash, load-bounded, a gateway per client",
    "smg consistent_hashing, a gateway per client",
    "smg cache_aware, a gateway per client, mesh",
    "smg manual + routing key, a gateway per client, mesh",
)

# smg's --policy, its other flags, and whether the gateways form a mesh (--enable-mesh)
_GATEWAY_ARGS: dict[str, tuple[str, list[str], bool]] = {
    SMG_EACH: ("cache_aware", [], False),
    SMG_MANUAL_EACH: ("manual", ["--assignment-mode", "min_group"], False),
    SMG_PREFIX_HASH_EACH: ("prefix_hash", [], False),
    # a worker over 1.25x the mean in flight is walked past whatever the difference (the
    # default needs it 10 requests over the mean: never, with 4 in flight a gateway)
    SMG_PREFIX_HASH_BOUNDED_EACH: (
        "prefix_hash",
        ["--prefix-hash-balance-abs-threshold", "0"],
        False,
    ),
    SMG_CONSISTENT_EACH: ("consistent_hashing", [], False),
    SMG_MESH: ("cache_aware", [], True),
    SMG_MANUAL_MESH: ("manual", ["--assignment-mode", "min_group"], True),
}


def _gateways(stack: ExitStack, workers: list[str], n: int, name: str) -> list[str]:
    """``n`` smg gateways of run ``name`` in front of ``workers``, open until ``stack``
    closes: independent, or (a mesh run) each joining the ones started before it, returned
    once each pair has synced (``/metrics`` counts sync rounds per peer)."""
    from opd_stream.testing.router import SMGGateway

    policy, extra, mesh = _GATEWAY_ARGS[name]
    urls: list[str] = []
    peers: list[str] = []
    metrics: list[str] = []
    for i in range(n):
        args = list(extra)
        if mesh:
            port, prom = _free_port(), _free_port()
            args += ["--enable-mesh", "--mesh-host", "127.0.0.1", "--mesh-port", str(port)]
            args += ["--mesh-server-name", f"client{i}"]
            args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
            if peers:
                args += ["--mesh-peer-urls", *peers]
            peers.append(f"127.0.0.1:{port}")
            metrics.append(f"http://127.0.0.1:{prom}/metrics")
        urls.append(stack.enter_context(SMGGateway(workers, policy=policy, extra_args=args)))
    pairs = {(i, j) for i in range(len(metrics)) for j in range(i + 1, len(metrics))}
    deadline = time.monotonic() + 60
    while pairs:  # a sync stream runs one way per pair: either end counts its rounds
        for i, url in enumerate(metrics):
            text = _text(url)
            for j in range(len(metrics)):
                if f'sync_round_duration_seconds_count{{peer="client{j}"}}' in text:
                    pairs.discard((min(i, j), max(i, j)))
        if pairs and time.monotonic() > deadline:
            raise RuntimeError(f"smg's mesh did not sync {sorted(pairs)} within 60 s")
        time.sleep(0.2)
    return urls


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body: bytes = resp.read()
    return body.decode()


_RUNS = {  # the runs of each variant
    "own prompt": LOCALITY_RUNS,
    "privileged teacher prompt": LOCALITY_RUNS,
    COMPLETION: LOCALITY_RUNS,
    BLOCKS: (PREFIX, LEAST, SMG, SMG_BARE, FLOOR),
    CLIENTS: (PREFIX, LEAST, SMG, SMG_BARE),
}


def _groups(
    prompts: int,
    per_prompt: int,
    prompt: int,
    response: int,
    teacher_prompt: int,
    seed: int,
    topk: int = 0,
) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(prompts):
        head = rng.integers(0, 30000, prompt, dtype=np.int64).tolist()
        privileged = (
            rng.integers(0, 30000, teacher_prompt, dtype=np.int64).tolist()
            if teacher_prompt
            else None
        )
        for _ in range(per_prompt):
            tail = rng.integers(0, 30000, response, dtype=np.int64).tolist()
            rows = None
            if topk:  # the student's top-k (any distinct ids: the teacher scores them)
                ids = rng.integers(0, 30000, response)
                rows = [
                    [[-1.0 - j, int((ids[t] + 7001 * j) % 30000)] for j in range(topk)]
                    for t in range(response)
                ]
            out.append(
                Sample(
                    head + tail,
                    response,
                    rollout_logprobs=[-1.0] * response,
                    student_top_logprobs=rows,
                    teacher_prompt_ids=privileged,
                    sample_id=g,
                )
            )
    return out


def completion_order(samples: list[Sample], per_prompt: int, spread: float) -> list[Sample]:
    """``samples`` (groups of ``per_prompt`` in a row) in the order their rollouts finish:
    group ``g`` starts at ``g``, each sample finishes an exponential time (mean ``spread``)
    later."""
    rng = np.random.default_rng(3)
    group = np.arange(len(samples)) // per_prompt
    finish = group + rng.exponential(spread, len(samples))
    return [samples[i] for i in np.argsort(finish, kind="stable")]


async def _mock_stats(session: aiohttp.ClientSession, urls: list[str]) -> list[dict[str, Any]]:
    out = []
    for u in urls:
        async with session.get(u + "/mock/stats") as resp:
            out.append(msgspec.json.decode(await resp.read()))
    return out


async def _flush(session: aiohttp.ClientSession, urls: list[str]) -> None:
    for u in urls:
        async with session.post(u + "/flush_cache") as resp:
            await resp.read()


def _measure(
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    wall: float,
    n: int,
    unique: int,
    failures: int,
    prompt_tokens: int,
    cached: int,
) -> dict[str, Any]:
    per_replica = [
        a["computed_tokens"] - b["computed_tokens"] for a, b in zip(after, before, strict=True)
    ]
    busy = [a["compute_s"] - b["compute_s"] for a, b in zip(after, before, strict=True)]
    total = sum(per_replica)
    return {
        "wall_s": wall,
        "samples_per_s": n / wall,
        "failures": failures,
        "computed_tokens": total,
        "computed_over_unique": total / unique,
        "replica_computed": per_replica,
        "max_over_mean_load": max(per_replica) / (total / len(per_replica)) if total else None,
        "replica_compute_s": busy,
        "gpu_bound_share": max(busy) / wall,
        "client_prompt_tokens": prompt_tokens,
        "client_cached_tokens": cached,
        "client_cached_share": cached / prompt_tokens if prompt_tokens else None,
    }


async def _one_run(
    cfg: StreamConfig, samples: list[Sample], workers: list[str], unique: int
) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        await _flush(session, workers)
        before = await _mock_stats(session, workers)
        t0 = time.perf_counter()
        opd = await run_opd(cfg, samples, keep=False)
        wall = time.perf_counter() - t0
        after = await _mock_stats(session, workers)
    eps = opd.stats.endpoints.values()
    prompt_tokens = sum(e.prompt_tokens for e in eps)
    cached = sum(e.cached_tokens for e in eps)
    return _measure(
        before, after, wall, len(samples), unique, len(opd.failures), prompt_tokens, cached
    )


def _spawn(path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.locality", str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


async def _clients_run(
    kws: list[dict[str, Any]], parts: list[list[Sample]], workers: list[str], unique: int
) -> dict[str, Any]:
    """``parts`` scored by one stream each (``kws[i]`` the config of ``parts[i]``'s), in
    processes of their own, started together."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, (kw, part) in enumerate(zip(kws, parts, strict=True)):
            path = Path(tmp) / f"client{i}.pkl"
            path.write_bytes(pickle.dumps((kw, part)))
            procs.append(_spawn(path))
        try:
            for p in procs:  # each has imported and warmed up its stream
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError("a client process of scenario 9 did not start")
            async with aiohttp.ClientSession() as session:
                await _flush(session, workers)
                before = await _mock_stats(session, workers)
                t0 = time.perf_counter()
                for p in procs:
                    assert p.stdin is not None
                    p.stdin.write("go\n")
                    p.stdin.flush()
                got = [msgspec.json.decode(p.communicate()[0].strip()) for p in procs]
                wall = time.perf_counter() - t0
                after = await _mock_stats(session, workers)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    n = sum(len(part) for part in parts)
    return _measure(
        before,
        after,
        wall,
        n,
        unique,
        sum(g["failures"] for g in got),
        sum(g["prompt_tokens"] for g in got),
        sum(g["cached_tokens"] for g in got),
    )


def _client_main(path: str) -> None:
    """One client process of :func:`_clients_run`: warm up, say ``ready``, wait for ``go``,
    score its part, print its counts."""
    import asyncio

    kw, part = pickle.loads(Path(path).read_bytes())

    async def main() -> None:
        warm = _groups(1, 1, 16, 8, 0, seed=99)
        await run_opd(StreamConfig.from_env({}, **kw), warm, keep=False)
        print("ready", flush=True)
        sys.stdin.readline()
        opd = await run_opd(StreamConfig.from_env({}, **kw), part, keep=False)
        eps = opd.stats.endpoints.values()
        out = {
            "failures": len(opd.failures),
            "prompt_tokens": sum(e.prompt_tokens for e in eps),
            "cached_tokens": sum(e.cached_tokens for e in eps),
        }
        print(msgspec.json.encode(out).decode(), flush=True)

    asyncio.run(main())


async def s9_locality(sz: Any, progress: Progress) -> dict[str, Any]:
    """Prefix locality (see the module docstring)."""
    from opd_stream.testing.router import SMGGateway

    opts = MockOptions(
        prefix_cache_tokens=sz.s9_cache_tokens,
        prefix_cache_page=16,
        compute_fixed_s=0.0005,
        compute_per_token_s=sz.s9_per_token_s,
    )
    n_rep = sz.s9_replicas
    out: dict[str, Any] = {
        "sizes": {
            "prompts": sz.s9_prompts,
            "per_prompt": sz.s9_per_prompt,
            "prompt": sz.s9_prompt,
            "response": sz.s9_response,
            "teacher_prompt": sz.s9_teacher_prompt,
            "replicas": n_rep,
            "per_token_s": sz.s9_per_token_s,
            "cache_tokens": sz.s9_cache_tokens,
            "window": sz.s9_window,
            "spread": sz.s9_spread,
            "block": sz.s9_block,
            "topk": sz.s9_topk,
            "clients": sz.s9_clients,
            "client_inflight": sz.s9_client_inflight,
            "gateway_per_client": sz.s9_gateway_per_client,
        },
        "variants": {},
    }
    specs = [("teacher", TEACHER_SEED, opts)] * n_rep
    with mocks(*specs) as procs:
        workers = [p.url for p in procs]
        with (
            SMGGateway(workers, policy="cache_aware") as smg_default,
            SMGGateway(
                workers, policy="manual", extra_args=["--assignment-mode", "min_group"]
            ) as smg_manual,
        ):
            chosen = [v for v in sz.s9_variants.split("|") if v] or list(_RUNS)
            for variant, names in _RUNS.items():
                if variant not in chosen:
                    continue
                teacher_prompt = sz.s9_teacher_prompt if variant.startswith("privileged") else 0
                ordered = variant in (COMPLETION, BLOCKS, CLIENTS)
                topk = sz.s9_topk if variant == BLOCKS else 0
                samples = _groups(
                    sz.s9_prompts,
                    sz.s9_per_prompt,
                    sz.s9_prompt,
                    sz.s9_response,
                    teacher_prompt,
                    seed=len(variant),
                    topk=topk,
                )
                if ordered:  # groups' samples finishing at random times among others'
                    samples = completion_order(samples, sz.s9_per_prompt, sz.s9_spread)
                head = teacher_prompt or sz.s9_prompt
                unique = sz.s9_prompts * (head + sz.s9_per_prompt * sz.s9_response)
                common: dict[str, Any] = {"kl_device": "cpu", "request_deadline_s": 600}
                if ordered:
                    common["max_inflight"] = sz.s9_window
                if variant == CLIENTS:
                    common["max_inflight"] = sz.s9_client_inflight
                if topk:
                    common.update(top_k=topk, id_scoring="blocks", id_block_size=sz.s9_block)
                configs = {
                    PREFIX: {"teachers": {"default": workers}},
                    LEAST: {"teachers": {"default": workers}, "balance": "least-outstanding"},
                    SMG: {"teachers": smg_default, "gateway_discovery": "off"},
                    SMG_BARE: {
                        "teachers": smg_default,
                        "gateway_discovery": "off",
                        "balance": "least-outstanding",  # sends no routing headers
                    },
                    SMG_MANUAL: {"teachers": smg_manual, "gateway_discovery": "off"},
                    TIGHT: {"teachers": {"default": workers}, "balance_load_factor": 1.0},
                    FLOOR: {"teachers": {"default": workers[:1]}},
                }
                if variant == CLIENTS and sz.s9_gateway_per_client:
                    names = (*names, SMG_MANUAL, *GATEWAY_PER_CLIENT_RUNS)
                runs: dict[str, Any] = {}
                warm = _groups(2, 2, 16, 8, min(teacher_prompt, 32), seed=99, topk=topk)
                for name in names:  # unmeasured: imports, compilation, pools
                    if name in _GATEWAY_ARGS:  # each client process warms up its own
                        continue
                    kw = {**common, **configs[name]}
                    await run_opd(StreamConfig.from_env({}, **kw), warm, keep=False)
                for name in names:
                    progress(f"s9 {variant}: {name}")
                    if variant == CLIENTS:
                        deal = np.random.default_rng(5).integers(0, sz.s9_clients, len(samples))
                        parts = [
                            [s for s, c in zip(samples, deal, strict=True) if c == i]
                            for i in range(sz.s9_clients)
                        ]
                        with ExitStack() as stack:
                            if name in _GATEWAY_ARGS:  # a gateway of its own for each client
                                urls = _gateways(stack, workers, len(parts), name)
                                kws = [
                                    {**common, "teachers": url, "gateway_discovery": "off"}
                                    for url in urls
                                ]
                            else:
                                kws = [{**common, **configs[name]}] * len(parts)
                            runs[name] = await _clients_run(kws, parts, workers, unique)
                    else:
                        kw = {**common, **configs[name]}
                        cfg = StreamConfig.from_env({}, **kw)
                        runs[name] = await _one_run(cfg, samples, workers, unique)
                floor = runs.pop(FLOOR, None)
                if floor is not None:  # what one replica computes: every prefix reused
                    for run in runs.values():
                        run["computed_over_floor"] = (
                            run["computed_tokens"] / floor["computed_tokens"]
                        )
                    out["variants"].setdefault(variant, {})["floor"] = floor
                base = runs[LEAST]
                for run in runs.values():
                    run["throughput_over_least_outstanding"] = (
                        run["samples_per_s"] / base["samples_per_s"]
                    )
                for name, field in ((SMG, "smg_cache_aware"), (SMG_BARE, "smg_no_headers")):
                    runs[PREFIX][f"throughput_over_{field}"] = (
                        runs[PREFIX]["samples_per_s"] / runs[name]["samples_per_s"]
                    )
                entry = out["variants"].setdefault(variant, {})
                entry.update(unique_tokens=unique, runs=runs)
    return out


if __name__ == "__main__":  # a client process of the N-clients variant
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m bench.locality",
        description="one client process of scenario 9's N-clients variant (bench.run starts "
        "it: it says 'ready', waits for a line on stdin, scores its part, prints its counts)",
    )
    parser.add_argument("part", help="the pickled (config overrides, samples) of this client")
    _client_main(parser.parse_args().part)
