"""``scripts/dev.sh bench [--quick] [--scenario N ...] [--out DIR]`` (``python -m bench.run``):
run the scenarios, write results.json, results.md and PNG plots to the output folder, and
print MET / MISSED per target. Timing never makes this command fail: it exits 1 only when a
scenario crashes or the baseline and opd_stream disagree."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ("main",)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="sizes for a 2-core machine (minutes)")
    p.add_argument(
        "--scenario",
        type=int,
        action="append",
        choices=range(1, 10),
        metavar="N",
        help="run only scenario N (repeatable; default all)",
    )
    p.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--sizes",
        default=None,
        help="JSON object overriding sizes, e.g. '{\"s1_n\": 4}' (tests, tuning)",
    )
    return p


def _machine() -> str:
    return (
        f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{platform.system()}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    import msgspec
    from tqdm import tqdm

    from .report import write_outputs
    from .scenarios import SCENARIOS, sizes_for

    sizes = sizes_for(args.quick)
    if args.sizes:
        sizes = msgspec.convert(
            {**msgspec.to_builtins(sizes), **msgspec.json.decode(args.sizes)}, type(sizes)
        )
    chosen = sorted(set(args.scenario or SCENARIOS))
    # The compiled kernels once, before anything is measured (a stream starts compiling
    # them in a thread otherwise, 10-15 s of CPU the first time, into the measured runs).
    from opd_stream.scanner._loader import prepare

    prepare()
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    bar = tqdm(total=len(chosen), unit="scenario", file=sys.stderr, disable=args.no_progress)
    started = time.perf_counter()
    for n in chosen:
        name, fn = SCENARIOS[n]
        bar.set_description(f"{n}. {name}")

        def progress(msg: str) -> None:
            bar.set_postfix_str(msg)

        t0 = time.perf_counter()
        try:
            res = asyncio.run(fn(sizes, progress))
        except Exception:
            errors[str(n)] = traceback.format_exc()
            print(f"scenario {n} ({name}) failed:\n{errors[str(n)]}", file=sys.stderr)
        else:
            res["elapsed_s"] = time.perf_counter() - t0
            results[str(n)] = res
        bar.update(1)
    bar.close()
    meta = {
        "quick": args.quick,
        "machine": _machine(),
        "scenarios": chosen,
        "sizes": msgspec.to_builtins(sizes),
        "elapsed_s": time.perf_counter() - started,
        "errors": errors,
    }
    out = Path(args.out)
    md, targets = write_outputs(results, meta, out)
    print(md)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and plots to {out}/")
    disagree = [t for t in targets if "within 1e-5" in t["target"] and t["status"] == "MISSED"]
    return 1 if errors or disagree else 0


if __name__ == "__main__":
    raise SystemExit(main())
