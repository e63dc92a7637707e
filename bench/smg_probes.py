"""Two facts about smg 1.13 behind scenario 9's N-clients rows, measured on smg itself
(``python -m bench.smg_probes hash-spread|mesh-lag``; mock workers and gateways on
127.0.0.1, a minute or less):

* ``hash-spread [POLICY] [RINGS] [DRAWS]``: smg's key hashing with no load bound
  (``prefix_hash`` at its defaults, ``consistent_hashing``) places each
  ``X-SMG-Routing-Key`` on one worker, the same in every gateway (checked: each key sent
  twice); how evenly does it spread 32 GRPO groups over 4 workers? For each of ``RINGS``
  fresh sets of 4 workers (new ports, a new ring), ``DRAWS`` sets of 32 random keys: the
  share of draws whose max / mean keys per worker is at most 1.25, its mean and 90th
  percentile (32 balls in 4 bins at random: 0.43, 1.37, 1.63).
* ``mesh-lag [WAIT_S] [PROMPTS]``: does smg's mesh give two ``cache_aware`` gateways one
  view, and how soon? A prompt through gateway A, ``WAIT_S`` seconds, the same prompt
  (longer) through gateway B: how many of ``PROMPTS`` went to the same worker (4 workers,
  our ``X-SMG-Routing-Tokens`` sent).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import numpy as np

from opd_stream.testing.mock_sglang import MockOptions
from opd_stream.testing.router import SMGGateway

from .harness import mocks
from .locality import SMG_MESH, _gateways
from .workload import TEACHER_SEED

__all__ = ("hash_spread", "mesh_lag")


def _post(url: str, ids: list[int], headers: dict[str, str]) -> str | None:
    """``ids`` scored through the gateway at ``url``: the worker it names."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": len(ids) - 1,
    }
    req = urllib.request.Request(
        url + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        worker: str | None = resp.headers.get("x-smg-routed-worker-id")
        return worker


def hash_spread(policy: str, rings: int, draws: int) -> dict[str, float]:
    rng = np.random.default_rng(11)
    ratios = []
    for _ in range(rings):
        with (
            mocks(*[("teacher", TEACHER_SEED, MockOptions())] * 4) as procs,
            SMGGateway([p.url for p in procs], policy=policy) as url,
            ThreadPoolExecutor(4) as pool,
        ):
            for _ in range(draws):
                keys = [f"{int(k):016x}" for k in rng.integers(0, 2**63, 32)]

                def send(key: str, url: str = url) -> str | None:
                    return _post(url, [1, 2, 3, 4], {"X-SMG-Routing-Key": key})

                got = list(pool.map(send, keys))
                if got != list(pool.map(send, keys)):
                    raise RuntimeError(f"{policy} placed a key on two workers")
                counts = [got.count(w) for w in set(got)]
                ratios.append(max(counts) / (len(keys) / 4))
    a = np.array(ratios)
    return {
        "draws": len(a),
        "share_at_most_1.25": float((a <= 1.25).mean()),
        "mean": float(a.mean()),
        "p90": float(np.percentile(a, 90)),
    }


def mesh_lag(wait_s: float, prompts: int) -> dict[str, float]:
    opts = MockOptions(prefix_cache_tokens=1 << 18, prefix_cache_page=16)
    rng = np.random.default_rng(1)
    same = 0
    with mocks(*[("teacher", TEACHER_SEED, opts)] * 4) as procs, ExitStack() as stack:
        a, b = _gateways(stack, [p.url for p in procs], 2, SMG_MESH)
        for _ in range(prompts):
            ids = rng.integers(0, 30000, 1024).tolist()
            head = {"X-SMG-Routing-Tokens": ",".join(map(str, ids[:512]))}
            first = _post(a, ids, head)
            time.sleep(wait_s)
            same += first == _post(b, [*ids, 5, 6, 7], head)
    return {"wait_s": wait_s, "prompts": prompts, "same_worker": same}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.smg_probes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="what")
    spread = sub.add_parser("hash-spread", help="smg's key hash over 4 workers")
    spread.add_argument("policy", nargs="?", default="prefix_hash")
    spread.add_argument("rings", nargs="?", type=int, default=20)
    spread.add_argument("draws", nargs="?", type=int, default=100)
    lag = sub.add_parser("mesh-lag", help="how soon smg's mesh shares a placement")
    lag.add_argument("wait_s", nargs="?", type=float, default=5.0)
    lag.add_argument("prompts", nargs="?", type=int, default=8)
    args = p.parse_args(argv)
    if args.what == "mesh-lag":
        print(mesh_lag(args.wait_s, args.prompts))
    else:  # hash-spread, the default
        policy = getattr(args, "policy", "prefix_hash")
        rings, draws = getattr(args, "rings", 20), getattr(args, "draws", 100)
        print(policy, hash_spread(policy, rings, draws))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
