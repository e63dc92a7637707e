"""Micro-benchmark: a rollout's Python top-k rows into ``(ids, logprobs)`` arrays.

A rollout engine that decoded SGLang's nested JSON hands over ``R`` rows of ``k`` entries,
``[logprob, id]`` pairs or ``[logprob, id, None]`` triples (the Miles form). Turning them
into int64 / float32 arrays is pure Python-object work (it holds the GIL whatever runs it).
This compares, on the same rows, what ``opd_stream`` does (``parse_student_topk``: with
numba, ``msgspec.msgpack`` writes the rows and the compiled reader takes them back; without
it, msgspec validates every entry, then ``np.fromiter``) with the other ways measured, each
marked by whether it checks what ``parse_student_topk`` checks (types, bools, ids in int64,
short rows). CPU time per response token, the least of several repeats, GC off.

Run::

    .venv/bin/python -m bench.rows_micro [--response 2048] [--k 16]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import numpy as np

from opd_stream.scanner import _loader
from opd_stream.wire._student_topk import parse_student_topk

__all__ = ("main",)


def _rows(r: int, k: int, width: int, seed: int = 0) -> list[list[list[Any]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(r):
        ids = rng.choice(150_000, k, replace=False).tolist()
        lps = (-rng.random(k) * 10).astype(np.float32).tolist()
        out.append([[lp, i, None][:width] for lp, i in zip(lps, ids, strict=True)])
    return out


def _entry_by_entry(rows: list[Any], r: int, k: int) -> Any:
    kernel, _loader._kernel = _loader._kernel, None
    try:
        return parse_student_topk(rows, r, k)
    finally:
        _loader._kernel = kernel


def _nested_array(rows: list[Any], r: int, k: int) -> Any:
    a = np.array(rows, dtype=np.float64)  # None -> nan; bools, floats as ids pass silently
    return a[..., 1].astype(np.int64), a[..., 0].astype(np.float32)


def _object_array(rows: list[Any], r: int, k: int) -> Any:
    a = np.array(rows, dtype=object)
    return a[..., 1].astype(np.int64), a[..., 0].astype(np.float64).astype(np.float32)


def _flat_slices(rows: list[Any], r: int, k: int) -> Any:
    w = len(rows[0][0])
    flat = list(chain.from_iterable(chain.from_iterable(rows)))
    return np.array(flat[1::w], dtype=np.int64), np.array(flat[0::w], dtype=np.float64)


WAYS: dict[str, tuple[Callable[[list[Any], int, int], Any], str]] = {
    "opd_stream parse_student_topk": (parse_student_topk, "every check"),
    "opd_stream without numba (entry by entry)": (_entry_by_entry, "every check"),
    "np.array(rows, float64)": (_nested_array, "no type checks; full rows only"),
    "np.array(rows, object) + astype": (_object_array, "no type checks; full rows only"),
    "flatten + np.array of slices": (_flat_slices, "no type checks; uniform entries only"),
}


def _best(fn: Callable[[], Any], reps: int = 7) -> float:
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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rows_micro", description=__doc__)
    p.add_argument("--response", type=int, default=2048)
    p.add_argument("--k", type=int, default=16)
    a = p.parse_args(argv)
    if not _loader.prepare():
        print("numba unavailable: both opd_stream rows are the entry-by-entry path")
    print(f"R = {a.response}, k = {a.k}; us of CPU per response token (GC off)")
    print("| rows | way | us/token | checks |")
    print("|---|---|---|---|")
    for width in (2, 3):
        rows = _rows(a.response, a.k, width)
        want = parse_student_topk(rows, a.response, a.k)
        for name, (fn, checks) in WAYS.items():
            ids, lps = fn(rows, a.response, a.k)
            assert np.array_equal(np.asarray(ids).reshape(want[0].shape), want[0]), name
            assert np.array_equal(
                np.asarray(lps, dtype=np.float32).reshape(want[1].shape), want[1]
            ), name
            us = _best(lambda fn=fn, rows=rows: fn(rows, a.response, a.k)) / a.response * 1e6
            form = "[lp, id]" if width == 2 else "[lp, id, None]"
            print(f"| {form} | {name} | {us:.2f} | {checks} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
