"""Micro-benchmark: the compiled scanner alone, ns per answer byte, by answer shape.

The answers are the mock SGLang server's (``opd_stream.testing``: float32 logprobs printed
as their shortest double, the form SGLang writes), built once; then, on the very same
bytes, each the least of ``--reps`` runs (CPU time, GC off):

- ``scan``: the kernel alone (:func:`opd_stream.scanner._calls.run_scan`, buffers included);
- ``scanner decode``: the compiled reader with every check
  (``decode_score_response(parser="scanner")``);
- ``msgspec decode``: opd_stream's msgspec decoder, every check (the fallback);
- ``msgspec untyped``: ``msgspec.json.decode`` with no types, the baseline of this run.

Run::

    .venv/bin/python -m bench.scan_micro [--response 2048] [--k 16] [--reps 9]

``bench/jit_startup.py`` measures the kernels' compile time; this one what they buy.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from opd_stream.scanner import _loader
from opd_stream.testing.inprocess import InProcessSGLang
from opd_stream.wire._codec import decode_score_response
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest
from opd_stream.wire._scan_reader import _SCHEMA

__all__ = ("main", "shapes")


def shapes(response: int, k: int) -> dict[str, tuple[bytes, ScoreRequest]]:
    """The answers measured, by name: ``(body, request)``, each answered by the mock."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, 512 + response, dtype=np.int64)
    ids = np.stack([rng.choice(150_000, k, replace=False) for _ in range(response)])
    reqs = {
        "per-position ids (teacher scores the student's top-k)": ScoreRequest(
            tokens=tokens, response_length=response, ids=ids.astype(np.int64)
        ),
        "sampled token only": ScoreRequest(tokens=tokens, response_length=response),
        f"top-{k} json rows": ScoreRequest(tokens=tokens, response_length=response, top_k=k),
        f"top-{k} b64": ScoreRequest(
            tokens=tokens, response_length=response, top_k=k, topk_wire="b64"
        ),
    }
    server = InProcessSGLang(seed=1)
    out = {}
    for name, req in reqs.items():
        got = server.handle("POST", "/generate", bytes(build_score_payload(req)))
        assert got.status == 200, got.body[:200]
        out[name] = (bytes(got.body), req)
    return out


def _best(fn: Callable[[], Any], reps: int) -> float:
    """The least CPU seconds of ``reps`` runs of ``fn``, GC off."""
    best = float("inf")
    was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(reps):
            t = time.process_time()
            fn()
            best = min(best, time.process_time() - t)
    finally:
        if was:
            gc.enable()
    return best


def measure(response: int, k: int, reps: int) -> dict[str, dict[str, float]]:
    """ns per byte, by answer shape then by way."""
    from opd_stream.scanner import _calls

    out: dict[str, dict[str, float]] = {}
    for name, (body, req) in shapes(response, k).items():
        assert decode_score_response(body, req, parser="scanner") is not None
        assert _calls.run_scan(body, False, _SCHEMA).status == _calls.OK, name
        ways: dict[str, Callable[[], Any]] = {
            "scan": lambda body=body: _calls.run_scan(body, False, _SCHEMA),
            "scanner decode": lambda body=body, req=req: decode_score_response(
                body, req, parser="scanner"
            ),
            "msgspec decode": lambda body=body, req=req: decode_score_response(body, req),
            "msgspec untyped": lambda body=body: msgspec.json.decode(body),
        }
        out[name] = {way: _best(fn, reps) / len(body) * 1e9 for way, fn in ways.items()}
        out[name]["bytes"] = float(len(body))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scan_micro", description=__doc__)
    p.add_argument("--response", type=int, default=2048)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--reps", type=int, default=9)
    a = p.parse_args(argv)
    if not _loader.prepare():
        print("numba unavailable: nothing to measure")
        return 1
    res = measure(a.response, a.k, a.reps)
    print(f"R = {a.response}, k = {a.k}; ns of CPU per answer byte, least of {a.reps} (GC off)")
    print("| answer | bytes | scan | scanner decode | msgspec decode | msgspec untyped |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        print(
            f"| {name} | {int(r['bytes'])} | {r['scan']:.2f} | {r['scanner decode']:.2f} "
            f"| {r['msgspec decode']:.2f} | {r['msgspec untyped']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
