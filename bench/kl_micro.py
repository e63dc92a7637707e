"""Micro-benchmark of the KL stage (``opd_stream._scoring.score_batch``) on the CPU.

Builds realistic ``Fetched`` batches (what the fetch workers hand the KL stage: the request
plan of each strategy decides which arrays are present, exactly as ``_scorer`` fills them),
scores them with the KL stage as the pipeline does (one torch intra-op thread) and prints
the CPU time per batch and per response token (``time.process_time``, the minimum of
several repeats, after a warm-up).

Every configuration is checked before it is timed: the result of every sample is compared
with the independent float64 reference ``tests/support/kl_reference.py`` (all arrays of a spread of
positions, with the tolerances of ``tests/kl/test_kl.py``), and dtypes and shapes are checked.

Before/after in one run: ``--baseline REV`` (default: the commit before the KL fast path)
also loads ``opd_stream/_kl.py`` and ``opd_stream/_klstage.py`` (today's ``kl/_math.py`` and
``_scoring.py``) as they were at git revision ``REV`` (read with ``git show``, nothing in the
working tree is touched), times them on the same batches and checks that both give the
same results.  ``--baseline none`` skips it.

Run::

    .venv/bin/python -m bench.kl_micro            # B=8, R in (1024, 4096), k in (16, 64)
    .venv/bin/python -m bench.kl_micro --quick    # R=1024 only, fewer repeats
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from opd_stream import Sample
from opd_stream._sample import Fetched, PreparedSample, ScoredSample
from opd_stream._scoring import score_batch
from opd_stream.kl._math import STRATEGIES, Strategy, WeightMode
from opd_stream.kl._plan import candidate_width, plan_requests
from opd_stream.wire._answers import ScoreRows

__all__ = ("main", "make_batch")

_ROOT = Path(__file__).resolve().parent.parent


def _load_reference() -> Any:
    """``tests/support/kl_reference.py`` (the independent float64 per-position reference)."""
    spec = importlib.util.spec_from_file_location(
        "kl_reference", _ROOT / "tests" / "support" / "kl_reference.py"
    )
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


reference_position: Any = _load_reference().reference_position

#: The last commit whose KL stage predates the fast path (the "before" of the report).
DEFAULT_BASELINE = "ba0e155"
VOCAB = 151_936
PROMPT = 16
#: Share of the teacher's top-k that is also in the student's (~60 %, as in the
#: measurement in docs/performance.md, "The KL math").
OVERLAP = 0.6

ScoreFn = Callable[..., list[Any]]


def _topk_rows(
    rng: np.random.Generator, r: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Student ids S and teacher ids T ([R, k], distinct per row, about OVERLAP shared)."""
    pool = rng.integers(0, VOCAB, size=(r, 3 * k))
    # Distinct per row: sort, then nudge duplicates to a fresh id (rare with this vocab).
    pool.sort(axis=1)
    dup = np.zeros_like(pool, dtype=bool)
    dup[:, 1:] = pool[:, 1:] == pool[:, :-1]
    pool[dup] = VOCAB + np.arange(int(dup.sum()))
    pool = np.take_along_axis(pool, np.argsort(rng.random(pool.shape), axis=1), axis=1)
    s_ids = pool[:, :k]
    shared = rng.binomial(k, OVERLAP, size=r)
    from_s = np.take_along_axis(s_ids, np.argsort(rng.random((r, k)), axis=1), axis=1)
    t_ids = np.where(np.arange(k)[None, :] < shared[:, None], from_s, pool[:, k : 2 * k])
    t_ids = np.take_along_axis(t_ids, np.argsort(rng.random((r, k)), axis=1), axis=1)

    def best_first(n: int) -> np.ndarray:
        logits = rng.normal(0.0, 3.0, size=(r, n))
        lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True) + 50.0)
        return -np.sort(-lp, axis=1).astype(np.float32)

    return s_ids.astype(np.int64), best_first(k), t_ids.astype(np.int64), best_first(k)


def make_batch(
    b: int, r: int, k: int, strategy: Strategy, *, seed: int = 0, lengths: Sequence[int] = ()
) -> list[Fetched]:
    """``b`` fetched samples of response length ``r`` (or ``lengths``), top-k ``k``.

    The arrays present are the ones the request plan of ``strategy`` fetches when the
    rollout carries the student's top-k (``docs/semantics.md``, "Which requests each
    strategy makes").
    """
    rng = np.random.default_rng(seed)
    plan = plan_requests(k, strategy, have_student_topk=True)
    uses_s = strategy != "only-teacher"
    out = []
    for i in range(b):
        ri = lengths[i] if lengths else r
        s_ids, s_lp, t_ids, t_lp = _topk_rows(rng, ri, k)
        tokens = rng.integers(0, VOCAB, size=PROMPT + ri).astype(np.int64)

        def lp(shape: tuple[int, ...]) -> np.ndarray:
            return rng.uniform(-25.0, -0.01, size=shape).astype(np.float32)

        prepared = PreparedSample(
            sample=Sample(tokens, ri),
            index=i,
            teacher="default",
            tokens=tokens,
            prompt_length=PROMPT,
            response_length=ri,
            rollout_logprobs=None,
            student_top_ids=s_ids if uses_s else None,
            student_top_logprobs=s_lp if uses_s else None,
        )
        teacher_rows = ScoreRows(
            token_ids=tokens[PROMPT:],
            token_logprobs=lp((ri,)),
            top_ids=t_ids if plan.teacher_topk else None,
            top_logprobs=t_lp if plan.teacher_topk else None,
            id_logprobs=lp((ri, k)) if plan.teacher_scores_student_ids else None,
            used_b64=False,
            weight_version=None,
        )
        student_rows = None
        if plan.student_scores_teacher_ids:
            student_rows = ScoreRows(
                token_ids=tokens[PROMPT:],
                token_logprobs=lp((ri,)),
                top_ids=None,
                top_logprobs=None,
                id_logprobs=lp((ri, k)),
                used_b64=False,
                weight_version=None,
            )
        out.append(
            Fetched(
                prepared=prepared,
                teacher_rows=teacher_rows,
                student_ids=s_ids if uses_s else None,
                student_lps=s_lp if uses_s else None,
                student_rows=student_rows,
                attempts=1,
                admitted_at=time.monotonic(),
            )
        )
    return out


# ----------------------------------------------------------------------------- checking


def _check_against_reference(
    items: Sequence[Fetched],
    results: Sequence[Any],
    k: int,
    strategy: Strategy,
    weight_mode: WeightMode,
    positions_per_sample: int,
) -> float:
    """Compare every array of a spread of positions with the float64 reference (the
    tolerances of ``tests/kl/test_kl.py``); return the largest ``|r_t - reference|`` seen."""
    c = candidate_width(strategy, k)
    worst = 0.0
    for f, res in zip(items, results, strict=True):
        assert isinstance(res, ScoredSample), res
        r = f.prepared.response_length
        cands = res.candidates
        assert cands is not None
        assert res.reverse_kl is not None
        assert res.reverse_kl.dtype == torch.float32
        assert res.reverse_kl.shape == (r,)
        assert res.teacher_logprobs.dtype == torch.float32
        assert res.teacher_logprobs.shape == (r,)
        for name, dtype in (
            ("ids", torch.int64),
            ("student_logprobs", torch.float32),
            ("teacher_logprobs", torch.float32),
            ("weights", torch.float32),
            ("mask", torch.bool),
        ):
            t = getattr(cands, name)
            assert t.dtype == dtype, name
            assert t.shape == (r, c), name
            assert t.device.type == "cpu", name
        tr, sr = f.teacher_rows, f.student_rows
        step = max(1, r // positions_per_sample)
        for pos in range(0, r, step):

            def row(a: np.ndarray | None, p: int = pos) -> list[Any] | None:
                return None if a is None else a[p].tolist()

            ref = reference_position(
                strategy=strategy,
                weight_mode=weight_mode,
                s_ids=row(f.student_ids),
                s_lp=row(f.student_lps),
                t_on_s=row(tr.id_logprobs),
                t_ids=row(tr.top_ids),
                t_lp=row(tr.top_logprobs),
                s_on_t=row(sr.id_logprobs if sr is not None else None),
            )
            n = len(ref.ids)
            got_r = float(res.reverse_kl[pos])
            assert abs(got_r - ref.r) <= 1e-5 + 2e-6 * ref.scale, (pos, got_r, ref.r)
            worst = max(worst, abs(got_r - ref.r))
            assert cands.ids[pos, :n].tolist() == ref.ids
            assert (cands.ids[pos, n:] == -1).all()
            assert cands.mask[pos, :n].all()
            assert not cands.mask[pos, n:].any()
            for name, want in (
                ("student_logprobs", ref.student),
                ("teacher_logprobs", ref.teacher),
                ("weights", ref.weights),
            ):
                got = getattr(cands, name)[pos].double().numpy()
                assert np.abs(got[:n] - np.asarray(want)).max(initial=0.0) <= 1e-5, name
                assert (got[n:] == 0).all(), name
    return worst


def _max_diff(a: Sequence[Any], b: Sequence[Any]) -> float:
    """Largest difference between two runs' results (ids, mask must be equal)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.teacher_logprobs, y.teacher_logprobs)
        assert torch.equal(x.candidates.ids, y.candidates.ids)
        assert torch.equal(x.candidates.mask, y.candidates.mask)
        for u, v in (
            (x.reverse_kl, y.reverse_kl),
            (x.candidates.student_logprobs, y.candidates.student_logprobs),
            (x.candidates.teacher_logprobs, y.candidates.teacher_logprobs),
            (x.candidates.weights, y.candidates.weights),
        ):
            if u.numel():
                worst = max(worst, float((u - v).abs().max()))
    return worst


# ------------------------------------------------------------------------------ timing


def _cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """Minimum CPU milliseconds of ``fn()`` over ``repeats`` runs (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


class _GilHog:
    """A thread that uses the GIL like the pipeline's event loop while it decodes responses:
    a ``msgspec`` decode of a JSON body (one C call of about ``hold_ms``, holding the GIL),
    then as long idle (a sleep, GIL released), over and over: half the time busy."""

    def __init__(self, hold_ms: float) -> None:
        self._decoder = msgspec.json.Decoder()
        self._body = self._make_body(1000)
        entries = max(1, int(1000 * hold_ms / max(self.hold_ms(), 1e-3)))
        self._body = self._make_body(entries)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _make_body(entries: int) -> bytes:
        rng = np.random.default_rng(0)
        return msgspec.json.encode([[float(x), i, None] for i, x in enumerate(rng.random(entries))])

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            self._decoder.decode(self._body)
            time.sleep(time.perf_counter() - start)

    def hold_ms(self) -> float:
        start = time.perf_counter()
        self._decoder.decode(self._body)
        return (time.perf_counter() - start) * 1e3

    def __enter__(self) -> _GilHog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _wall_ms_contended(fn: Callable[[], object], repeats: int) -> float:
    """Median wall milliseconds of ``fn()`` run in a worker thread (as the pipeline runs the
    KL stage) while a :class:`_GilHog` runs."""
    times: list[float] = []

    def work() -> None:
        fn()
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return float(np.median(times)) * 1e3


#: The modules the baseline files import, by their name then, and where that now lives.
_NOW = {
    "_kltypes": "kl._names",
    "_klbatch": "kl._tensors",
    "_klindex": "kl._index",
    "_plan": "kl._plan",
    "_scorer": "_sample",  # Fetched
    "_config": "config._settings",
}
_MOVED = re.compile(r"^(\s*)from \.(" + "|".join(_NOW) + r") import", re.M)


def _moved(m: re.Match[str]) -> str:
    return f"{m.group(1)}from opd_stream.{_NOW[m.group(2)]} import"


def _load_baseline(rev: str) -> ScoreFn | None:
    """``score_batch`` of ``opd_stream/_kl{,select,stage}.py`` at git ``rev`` (None if absent).

    Those files predate the package's rooms: what they import from the rest of the package
    is taken from where it lives now (:data:`_MOVED`)."""

    def show(path: str) -> str:
        return subprocess.run(
            ["git", "-C", str(_ROOT), "show", f"{rev}:{path}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    try:
        kl_src = show("opd_stream/_kl.py")
        stage_src = show("opd_stream/_klstage.py")
    except (OSError, subprocess.CalledProcessError):
        return None
    try:  # since the split, selection lives in _klselect.py: take that revision's too
        select_src: str | None = show("opd_stream/_klselect.py")
    except subprocess.CalledProcessError:
        select_src = None
    kl_src = kl_src.replace("from ._klselect import", "from ._klselect_baseline import")
    stage_src = stage_src.replace("from ._kl import", "from ._kl_baseline import")
    sources = [("_kl_baseline", kl_src), ("_klstage_baseline", stage_src)]
    if select_src is not None:
        sources.insert(0, ("_klselect_baseline", select_src))
    sources = [(name, _MOVED.sub(_moved, src)) for name, src in sources]
    mods = {}
    for name, src in sources:
        spec = importlib.util.spec_from_loader(f"opd_stream.{name}", loader=None)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = "opd_stream"
        sys.modules[spec.name] = mod
        exec(compile(src, f"<{rev}:{name}>", "exec"), mod.__dict__)
        mods[name] = mod
    fn: ScoreFn = mods["_klstage_baseline"].score_batch
    return fn


def _run(fn: ScoreFn, items: list[Fetched], k: int, strategy: Strategy) -> list[Any]:
    return fn(
        items, top_k=k, strategy=strategy, weight_mode="student_p", device=torch.device("cpu")
    )


def _runner(fn: ScoreFn, items: list[Fetched], k: int, strategy: Strategy) -> Callable[[], object]:
    return lambda: _run(fn, items, k, strategy)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kl_micro", description=__doc__.split(".")[0])
    ap.add_argument("--quick", action="store_true", help="R=1024 only, 3 repeats")
    ap.add_argument("--repeats", type=int, default=0, help="timed runs per config (min is kept)")
    ap.add_argument("--batch", type=int, default=8, help="samples per KL batch (B)")
    ap.add_argument("--lengths", default="1024,4096", help="response lengths R, comma-separated")
    ap.add_argument("--ks", default="16,64", help="top-k values, comma-separated")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument(
        "--ragged",
        action="store_true",
        help="response lengths spread over [R/4, R] within a batch instead of all R",
    )
    ap.add_argument(
        "--baseline",
        default=DEFAULT_BASELINE,
        help="git revision of the 'before' KL stage to time alongside (or 'none')",
    )
    ap.add_argument("--check-positions", type=int, default=16, help="positions per sample checked")
    ap.add_argument(
        "--contended",
        type=float,
        default=0.0,
        metavar="MS",
        help="instead of CPU time, the wall time of score_batch in a worker thread while "
        "another thread holds the GIL in back-to-back C calls of about MS ms (a busy event "
        "loop decoding responses): the cost of the stage's GIL hand-offs",
    )
    args = ap.parse_args(argv)
    lengths = [1024] if args.quick else [int(x) for x in args.lengths.split(",")]
    repeats = args.repeats or (3 if args.quick else 7)
    ks = [int(x) for x in args.ks.split(",")]
    strategies: list[Strategy] = args.strategies.split(",")

    # The pipeline scores in a worker thread with one intra-op thread; score_batch itself
    # switches to one thread, this only makes the baseline comparable when it does not.
    torch.set_num_threads(1)
    baseline = None if args.baseline == "none" else _load_baseline(args.baseline)
    if args.baseline != "none" and baseline is None:
        print(f"(baseline {args.baseline!r} not available: timing the current code only)")
    b = args.batch
    header = f"{'strategy':<13} {'R':>5} {'k':>3} {'ms/batch':>9} {'us/token':>9} {'err':>8}"
    if baseline is not None:
        header += f" {'before ms':>10} {'us/token':>9} {'err':>8} {'speedup':>7} {'max|diff|':>9}"
    hog = _GilHog(args.contended) if args.contended else None
    timer = _cpu_ms
    if hog is None:
        print(f"B={b}, weight_mode=student_p, CPU ms = min of {repeats} runs (process_time);")
    else:
        timer = _wall_ms_contended
        print(
            f"B={b}, weight_mode=student_p, WALL ms = median of {repeats} runs in a worker "
            f"thread, another thread holding the GIL {hog.hold_ms():.1f} ms at a time, "
            "half the time;"
        )
    print("err = largest |r_t - float64 reference| over the checked positions")
    print(header)
    with contextlib.ExitStack() as stack:
        if hog is not None:
            stack.enter_context(hog)
        _table(args, lengths, ks, strategies, repeats, baseline, timer)
    return 0


def _table(
    args: argparse.Namespace,
    lengths: list[int],
    ks: list[int],
    strategies: list[Strategy],
    repeats: int,
    baseline: ScoreFn | None,
    timer: Callable[[Callable[[], object], int], float],
) -> None:
    b = args.batch
    for r in lengths:
        for k in ks:
            for strategy in strategies:
                rng = np.random.default_rng(r * 1000 + k)
                sizes: list[int] = []
                if args.ragged:  # one sample of length R, the others in [R/4, R]
                    sizes = [r, *(int(x) for x in rng.integers(r // 4, r + 1, size=b - 1))]
                items = make_batch(b, r, k, strategy, seed=k + r, lengths=sizes)
                tokens = sum(f.prepared.response_length for f in items)
                res = _run(score_batch, items, k, strategy)
                err = _check_against_reference(
                    items, res, k, strategy, "student_p", args.check_positions
                )
                ms = timer(_runner(score_batch, items, k, strategy), repeats)
                line = f"{strategy:<13} {r:>5} {k:>3} {ms:>9.2f} {ms * 1e3 / tokens:>9.3f}"
                line += f" {err:>8.1e}"
                if baseline is not None:
                    old = _run(baseline, items, k, strategy)
                    err0 = _check_against_reference(
                        items, old, k, strategy, "student_p", args.check_positions
                    )
                    diff = _max_diff(res, old)
                    ms0 = timer(_runner(baseline, items, k, strategy), repeats)
                    line += f" {ms0:>10.2f} {ms0 * 1e3 / tokens:>9.3f} {err0:>8.1e}"
                    line += f" {ms0 / ms:>6.1f}x {diff:>9.1e}"
                print(line, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
