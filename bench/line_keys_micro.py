"""Micro-benchmark: what the repeated-key check costs ``opd-stream score``'s line decoding.

msgspec keeps the last value of a key given twice without a word; ``decode_line`` fails such
a line (the input schema is strict). Its check counts the line's ``:`` against the keys
msgspec kept (one ``bytes.count``), counts again with every string emptied when a string
holds a ``:`` (one regular-expression substitution), and reads the keys object by object
only when both differ. This times ``decode_line`` with the check and with it switched off,
in the same run, on three line shapes: ids and rollout logprobs (the common line), the
rollout's top-k as ``[logprob, id]`` pairs, and as ``[logprob, id, text]`` triples whose
texts hold a ``:`` (the substitution's case). CPU time per line, the least of several
repeats, GC off.

Run::

    .venv/bin/python -m bench.line_keys_micro [--response 2048] [--k 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable, Sequence

import numpy as np

from opd_stream.cli import _score_schema

__all__ = ("main",)


def _lines(r: int, k: int) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    base = {
        "id": "r1",
        "prompt_ids": rng.integers(0, 150_000, 1024).tolist(),
        "response_ids": rng.integers(0, 150_000, r).tolist(),
    }

    def rows(width: int) -> list[list[list[object]]]:
        out = []
        for _ in range(r):
            ids = rng.integers(0, 150_000, k).tolist()
            lps = (-rng.random(k) * 10).astype(np.float32).tolist()
            out.append([[lp, i, ":x"][:width] for lp, i in zip(lps, ids, strict=True)])
        return out

    plain = {**base, "rollout_logprobs": (-rng.random(r)).tolist(), "metadata": {"a": {"b": 1}}}
    return {
        "ids + rollout logprobs": json.dumps(plain).encode(),
        f"top-{k} pairs": json.dumps({**base, "student_top_logprobs": rows(2)}).encode(),
        f"top-{k} triples, ':' in texts": json.dumps(
            {**base, "student_top_logprobs": rows(3)}
        ).encode(),
    }


def _cpu(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.line_keys_micro", description=__doc__)
    p.add_argument("--response", type=int, default=2048, help="response tokens per line")
    p.add_argument("--k", type=int, default=20, help="top-k entries per response token")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    check = _score_schema._check_duplicate_keys
    print("| line | bytes | decode_line, ms | without the check, ms | ratio |")
    print("|---|---|---|---|---|")
    gc.disable()
    try:
        for name, line in _lines(args.response, args.k).items():

            def decode(data: bytes = line) -> object:
                return _score_schema.decode_line(data, line=1, seq=0)

            with_check = _cpu(decode, args.repeats)
            _score_schema._check_duplicate_keys = lambda data, distinct: None
            try:
                without = _cpu(decode, args.repeats)
            finally:
                _score_schema._check_duplicate_keys = check
            print(
                f"| {name} | {len(line)} | {with_check * 1e3:.3f} | {without * 1e3:.3f} | "
                f"{with_check / without:.2f}x |"
            )
    finally:
        gc.enable()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
