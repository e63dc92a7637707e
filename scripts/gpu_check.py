"""The KL stage on CUDA against the CPU, end to end, for a session that has a GPU.

Streams the same samples through :class:`opd_stream.OPDStream` twice, with
``kl_device="cuda"`` and ``kl_device="cpu"``, against in-process mock SGLang servers (no
sockets), for every strategy x weight mode and the sampled-token mode; checks that every
result array agrees (ids and masks exactly, logprobs and reverse KL within 1e-5) and that
``stats().kl.device`` says where the KL ran; then prints the KL stage's time per batch on
each device at a larger size. Exits 1 on any disagreement.

Run by ``scripts/gpu_check.sh`` on the device machine; ``--device cpu`` runs the same
comparison CPU against CPU, to check the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio
import numpy as np
import torch

from opd_stream import OPDStream, Sample, ScoredSample, StreamConfig
from opd_stream.kl._math import STRATEGIES, WEIGHT_MODES
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport

TEACHER, STUDENT = "http://teacher", "http://student"
_FIELDS = ("student_logprobs", "teacher_logprobs", "weights")


def _samples(n: int, prompt: int, response: int, k: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = rng.integers(0, 30_000, prompt + response).astype(np.int64)
        out.append(
            Sample(tokens, response, rollout_logprobs=-rng.random(response) * 3, sample_id=i)
        )
    return out


async def _run(cfg: StreamConfig, samples: list[Sample]) -> tuple[dict[int, ScoredSample], Any]:
    servers = {
        TEACHER: InProcessSGLang("teacher", 1),
        STUDENT: InProcessSGLang("student", 0),
    }
    got: dict[int, ScoredSample] = {}
    async with OPDStream(cfg, transport=mock_transport(servers)) as stream:
        async with stream.run(samples) as results:
            async for item in results:
                if not isinstance(item, ScoredSample):
                    raise SystemExit(f"sample {item.index} failed: {item.reason}: {item.message}")
                got[item.index] = item
        return got, stream.stats().kl


def _compare(a: dict[int, ScoredSample], b: dict[int, ScoredSample]) -> float:
    """Max |difference| over every float array; ids and masks must be equal."""
    worst = 0.0
    assert a.keys() == b.keys()
    for i, x in a.items():
        y = b[i]
        pairs = [(x.teacher_logprobs, y.teacher_logprobs)]
        if x.reverse_kl is not None and y.reverse_kl is not None:
            pairs.append((x.reverse_kl, y.reverse_kl))
        if x.candidates is not None and y.candidates is not None:
            assert torch.equal(x.candidates.ids, y.candidates.ids), f"ids differ, sample {i}"
            assert torch.equal(x.candidates.mask, y.candidates.mask), f"mask differs, sample {i}"
            pairs += [(getattr(x.candidates, f), getattr(y.candidates, f)) for f in _FIELDS]
        for p, q in pairs:
            assert p.device.type == "cpu", "results live on the CPU"
            assert q.device.type == "cpu", "results live on the CPU"
            both = torch.isfinite(p) & torch.isfinite(q)
            assert torch.equal(torch.isfinite(p), torch.isfinite(q)), f"infinities, sample {i}"
            if both.any():
                worst = max(worst, float((p[both].double() - q[both].double()).abs().max()))
    return worst


def _cfg(device: str, **kw: Any) -> StreamConfig:
    return StreamConfig.from_env({}, teachers=TEACHER, student_url=STUDENT, kl_device=device, **kw)


async def main(device: str) -> int:
    bad = 0
    samples = _samples(12, 24, 40, 8, seed=0)
    modes: list[tuple[int, str, str]] = [(0, "only-student", "student_p")]
    modes += [(8, s, w) for s in STRATEGIES for w in WEIGHT_MODES]
    for k, strategy, weight in modes:
        kw = {"top_k": k, "strategy": strategy, "weight_mode": weight}
        on_dev, kl_dev = await _run(_cfg(device, **kw), samples)
        on_cpu, kl_cpu = await _run(_cfg("cpu", **kw), samples)
        worst = _compare(on_dev, on_cpu)
        ok = worst <= 1e-5 and kl_dev.device.startswith(device) and kl_cpu.device == "cpu"
        bad += not ok
        print(
            f"{'ok ' if ok else 'BAD'} top_k={k} {strategy:<12} {weight:<9} "
            f"max|{device}-cpu|={worst:.2e} kl devices {kl_dev.device}/{kl_cpu.device}"
        )
    print("\nKL stage time per batch (32 samples x 4096 tokens, top-k 64, union):")
    big = _samples(32, 512, 4096, 64, seed=1)
    for dev in (device, "cpu"):
        kw = {"top_k": 64, "strategy": "union", "kl_batch_size": 32, "kl_batch_wait_s": 0.05}
        _, kl = await _run(_cfg(dev, **kw), big)
        p50 = (kl.batch_p50_s or 0) * 1e3
        print(f"  {kl.device:<7} {kl.batches} batches, {p50:.1f} ms/batch p50, {kl.seconds:.3f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available here (use --device cpu for a dry run)", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(anyio.run(main, args.device))
