"""Scenario 9: prefix locality on a GPU-bound teacher fleet, simulated on CPU.

GRPO groups (``s9_prompts`` prompts x ``s9_per_prompt`` samples) scored against
``s9_replicas`` mock teacher replicas, each with a prefix cache (SGLang's radix cache:
LRU, whole pages, reuse capped at ``logprob_start_len``) and the compute-time model (one
request at a time, ``s9_per_token_s`` per token not served from the cache): what a replica
computes, and so the run's wall time, is what prefix placement decides. Three variants:
the samples' own prompt (``s9_prompt`` tokens), a privileged teacher prompt of its own
(``s9_teacher_prompt`` tokens, one per group), and the first with the samples shuffled and
``s9_window`` in flight at a time (:data:`INTERLEAVED`).

Runs, on the same replicas and samples (caches flushed between runs):

* ``opd_stream prefix`` (the default ``balance``): the replicas as client-side replicas;
* ``opd_stream least-outstanding``: the same without prefix locality (the baseline);
* ``smg cache_aware``: through smg 1.13 with its default policy (discovery off);
* ``smg manual + routing key``: through smg ``--policy manual`` (new keys to the worker
  with the fewest keys, ``--assignment-mode min_group``), which pins each
  ``X-SMG-Routing-Key`` (our prefix key) to a worker (discovery off);
* ``opd_stream prefix, balance_load_factor 1.0``: the tightest bound.

Measured per run: the tokens the replicas computed over the unique tokens (prompt once per
group plus every response), the max / mean of what each replica computed, wall time and
samples per second; from ``stats()``, the prompt and cached tokens the client saw. How
GPU-bound a run was is ``gpu_bound_share``: the busiest replica's simulated compute over the
wall time (1.0: the wall is that replica's GPU time; well below it, the client's and the
mocks' CPU set the pace and throughput says little about placement).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import numpy as np

from opd_stream import Sample, StreamConfig
from opd_stream.testing.mock_sglang import MockOptions

from .harness import mocks, run_opd
from .workload import TEACHER_SEED

__all__ = ("INTERLEAVED", "LOCALITY_RUNS", "s9_locality")

#: The variant whose samples come in a shuffled order, ``s9_window`` in flight at a time (as
#: rollouts finish in a host that hands samples over one by one): a group's later samples
#: often arrive after its earlier ones are done, and find its replica by placement alone.
INTERLEAVED = "own prompt, interleaved arrivals"

Progress = Callable[[str], None]

LOCALITY_RUNS = (
    "opd_stream prefix",
    "opd_stream least-outstanding",
    "smg cache_aware",
    "smg manual + routing key",
    "opd_stream prefix, balance_load_factor 1.0",
)


def _groups(
    prompts: int, per_prompt: int, prompt: int, response: int, teacher_prompt: int, seed: int
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
            out.append(
                Sample(
                    head + tail,
                    response,
                    rollout_logprobs=[-1.0] * response,
                    teacher_prompt_ids=privileged,
                    sample_id=g,
                )
            )
    return out


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
    per_replica = [
        a["computed_tokens"] - b["computed_tokens"] for a, b in zip(after, before, strict=True)
    ]
    busy = [a["compute_s"] - b["compute_s"] for a, b in zip(after, before, strict=True)]
    total = sum(per_replica)
    eps = opd.stats.endpoints.values()
    prompt_tokens = sum(e.prompt_tokens for e in eps)
    cached = sum(e.cached_tokens for e in eps)
    return {
        "wall_s": wall,
        "samples_per_s": len(samples) / wall,
        "failures": len(opd.failures),
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
        },
        "variants": {},
    }
    specs = [("teacher", TEACHER_SEED, opts)] * n_rep
    with mocks(*specs) as procs:
        workers = [p.url for p in procs]
        with (
            SMGGateway(workers) as smg_default,
            SMGGateway(
                workers, policy="manual", extra_args=["--assignment-mode", "min_group"]
            ) as smg_manual,
        ):
            for variant, teacher_prompt, window in (
                ("own prompt", 0, 0),
                ("privileged teacher prompt", sz.s9_teacher_prompt, 0),
                (INTERLEAVED, 0, sz.s9_window),
            ):
                samples = _groups(
                    sz.s9_prompts,
                    sz.s9_per_prompt,
                    sz.s9_prompt,
                    sz.s9_response,
                    teacher_prompt,
                    seed=len(variant),
                )
                if window:  # groups' samples spread over the run, a few in flight at a time
                    order = np.random.default_rng(3).permutation(len(samples))
                    samples = [samples[i] for i in order]
                head = teacher_prompt or sz.s9_prompt
                unique = sz.s9_prompts * (head + sz.s9_per_prompt * sz.s9_response)
                common: dict[str, Any] = {"kl_device": "cpu", "request_deadline_s": 600}
                if window:
                    common["max_inflight"] = window
                configs = {
                    LOCALITY_RUNS[0]: {"teachers": {"default": workers}},
                    LOCALITY_RUNS[1]: {
                        "teachers": {"default": workers},
                        "balance": "least-outstanding",
                    },
                    LOCALITY_RUNS[2]: {"teachers": smg_default, "router_discovery": "off"},
                    LOCALITY_RUNS[3]: {"teachers": smg_manual, "router_discovery": "off"},
                    LOCALITY_RUNS[4]: {
                        "teachers": {"default": workers},
                        "balance_load_factor": 1.0,
                    },
                }
                runs: dict[str, Any] = {}
                warm = _groups(2, 2, 16, 8, min(teacher_prompt, 32), seed=99)
                for kw in configs.values():  # unmeasured: imports, compilation, pools
                    await run_opd(StreamConfig.from_env({}, **common, **kw), warm, keep=False)
                for name, kw in configs.items():
                    progress(f"s9 {variant}: {name}")
                    cfg = StreamConfig.from_env({}, **common, **kw)
                    runs[name] = await _one_run(cfg, samples, workers, unique)
                base = runs[LOCALITY_RUNS[1]]
                for run in runs.values():
                    run["throughput_over_least_outstanding"] = (
                        run["samples_per_s"] / base["samples_per_s"]
                    )
                smg = runs[LOCALITY_RUNS[2]]
                runs[LOCALITY_RUNS[0]]["throughput_over_smg_cache_aware"] = (
                    runs[LOCALITY_RUNS[0]]["samples_per_s"] / smg["samples_per_s"]
                )
                out["variants"][variant] = {"unique_tokens": unique, "runs": runs}
    return out
