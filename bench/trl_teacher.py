"""TRL's server teacher: TRL 1.16.0's own ``VLLMClient.get_sequence_logprobs`` against
opd_stream's drop-in (:class:`opd_stream.integrations.trl.TeacherClient`), on the same mock
vLLM server, in one run.

``python -m bench.trl_teacher [--quick] [--out DIR] [--top K ...]`` (full: 16 prompts x 8
samples, prompt 1024, response 512, ``top_logprobs`` 1, 20 and 100; ``--quick``: 4 x 4,
prompt 512, response 256; ``--sizes '{"prompts": 2}'`` overrides any size).

One mock vLLM server runs as a subprocess (``python -m opd_stream.testing.mock_vllm``,
``--max-logprobs -1`` as TRL's documented ``vllm serve`` command, scale-out on, a prefix
cache with pages of 16 and the compute model: one request at a time), so its CPU is not the
clients'; it is restarted (an empty prefix cache) before each client's run. Each client runs
in a child process of its own (``--child``), one call per ``top_logprobs`` after an
unmeasured warm-up call on other sequences (imports, pools, engine detection):

* client CPU per sample: the child's CPU over the call (every thread; ``ClientMeter``);
* bytes per response token: what the mock sent over the call (``/mock/stats``), over the
  response tokens;
* teacher tokens computed over the unique tokens (each prompt once plus every response):
  the mock's ``computed_tokens`` over the call;
* peak client memory: the child's peak RSS over the call less its RSS before it (sampled
  every 20 ms, and the kernel's ``ru_maxrss`` high-water mark; the target's measure); and,
  from the same call repeated under ``tracemalloc`` (its CPU not counted), the peak of what
  Python allocated and how much of it is the returned result (the same lists for both
  clients: what remains is each client's working memory);
* equal: a digest of each client's four result lists (float64 bytes), TRL's against ours.

Floors, measured outside both clients' code in a third child (``_floor``) on a fresh
server, say whether a missed target is within anyone's reach on vLLM 0.34's API at these
sizes: bytes, the JSON of the response rows of TRL's own answer (``prompt_logprobs[P:]``,
the only form vLLM gives the teacher's top-k in); CPU, the requests opd_stream's client
sends, sent with ``http.client`` on one kept-alive connection, an untyped
``msgspec.json.decode`` of their answers and TRL's result lists built with
``ndarray.tolist()``, in a process holding torch as both clients' do; memory, TRL's
result's own size over TRL's peak (the least ratio any client returning that result can
have). ``heap`` (``--sizes '{"heap": N}'``) makes each
child hold N more tracked Python objects before it measures, as a trainer's process does
(the cyclic GC's full collections cost in proportion to what the process holds, and run
less often the more it holds).

TRL's client is loaded from the set-up step's copy of its wheel (``.cache/trl/src``) by
``opd_stream/testing/_trl_source.py`` and called with its defaults (``chunk_size=0``: the whole
batch in one POST). Targets: at every ``top_logprobs``, >= 5x less client
CPU, >= 3x fewer bytes, teacher tokens computed <= 1.05x the unique tokens, peak client
memory <= 1/10 of TRL's. The results go to ``<out>/trl_teacher.json`` and
``<out>/trl_teacher.md``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import resource
import subprocess
import sys
import time
import tracemalloc
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np

__all__ = ("SIZES", "Sizes", "main", "run", "workload")

ROOT: Final = Path(__file__).resolve().parent.parent
CLIENTS: Final = ("trl", "opd_stream")
VOCAB: Final = 151936
SEND_HEADERS: Final = {"Content-Type": "application/json"}
ID_RANGE: Final = 30000


class Sizes(msgspec.Struct, frozen=True):
    prompts: int
    per_prompt: int
    prompt: int
    response: int
    top: tuple[int, ...] = (1, 20, 100)
    per_token_s: float = 2e-6
    heap: int = 0  # tracked objects each child holds before measuring (a trainer's heap)


SIZES: Final = {
    "full": Sizes(prompts=16, per_prompt=8, prompt=1024, response=512),
    "quick": Sizes(prompts=4, per_prompt=4, prompt=512, response=256),
}

TARGETS: Final = {
    "cpu": 5.0,  # TRL's CPU / ours, at least
    "bytes": 3.0,  # TRL's bytes / ours, at least
    "computed": 1.05,  # our computed / unique, at most
    "memory": 0.1,  # our peak / TRL's, at most
}


def workload(
    prompts: int, per_prompt: int, prompt: int, response: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """GRPO groups: ``prompts`` random prompts, each with ``per_prompt`` random responses."""
    rng = np.random.default_rng(seed)
    seqs: list[list[int]] = []
    for _ in range(prompts):
        head = rng.integers(0, ID_RANGE, prompt).tolist()
        seqs += [head + rng.integers(0, ID_RANGE, response).tolist() for _ in range(per_prompt)]
    return seqs, [prompt] * len(seqs)


def _digest(result: dict[str, list[Any]]) -> str:
    h = hashlib.sha256()
    for key in sorted(result):
        for rows in result[key]:
            h.update(np.asarray(rows, dtype=np.float64).tobytes())
            h.update(b"|")
    return h.hexdigest()


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One client, one measured call (run in a child process)."""
    from bench.harness import ClientMeter

    sz = msgspec.convert(spec["sizes"], Sizes)
    k = int(spec["k"])
    ballast = [[i] for i in range(sz.heap)]  # noqa: F841  (held: a trainer-sized heap)
    seqs, lengths = workload(sz.prompts, sz.per_prompt, sz.prompt, sz.response, seed=1)
    # the warm-up: as many sequences (so as many connections as a training step opens),
    # short ones, other prompts
    warm, warm_lengths = workload(sz.prompts, sz.per_prompt, 32, 16, seed=2)
    if spec["client"] == "trl":
        from opd_stream.testing._trl_source import trl_client

        client: Any = trl_client(spec["url"])
    else:
        from opd_stream.integrations.trl import TeacherClient

        client = TeacherClient(spec["url"], environ={})
    client.get_sequence_logprobs(warm, warm_lengths, top_logprobs=k)
    if spec["client"] != "trl":
        from opd_stream.scanner._loader import prepare

        prepare()  # the stream loads its compiled kernels in a thread: done before measuring
    before = _mock_stats(spec["url"])
    gc.collect()
    max_rss0 = _max_rss_bytes()
    with ClientMeter() as meter:
        result = client.get_sequence_logprobs(seqs, lengths, top_logprobs=k)
    max_rss1 = _max_rss_bytes()
    after = _mock_stats(spec["url"])
    peak = max(meter.peak_rss, max_rss1 if max_rss1 > max_rss0 else 0)
    digest = _digest(result)
    rows = sum(len(r) for r in result["logprobs"])
    # the same call again under tracemalloc (slower: its CPU is not counted): the peak of
    # what Python allocated during the call, and what stays (the result lists)
    del result
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    again = client.get_sequence_logprobs(seqs, lengths, top_logprobs=k)
    current, traced_peak = tracemalloc.get_traced_memory()
    del again
    tracemalloc.stop()
    out = {
        "traced_peak": traced_peak - base,
        "traced_result": current - base,
        "bytes_sent": after["bytes_sent"] - before["bytes_sent"],
        "computed_tokens": after["computed_tokens"] - before["computed_tokens"],
        "requests": after["requests"] - before["requests"],
        "cpu_s": meter.cpu_s,
        "wall_s": meter.wall_s,
        "rss_start": meter.rss_start,
        "peak_rss_growth": max(0, peak - meter.rss_start),
        "rows": rows,
        "digest": digest,
    }
    if spec["client"] != "trl":
        client.close()
    return out


class _Choice(msgspec.Struct):
    prompt_logprobs: list[msgspec.Raw]  # each row exactly as the server wrote it


class _Completion(msgspec.Struct):
    choices: list[_Choice]


class _ScaleOut(msgspec.Struct):
    prompt_logprobs: msgspec.Raw  # the field exactly as the server wrote it


def _post(url: str, body: bytes) -> bytes:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        answer: bytes = resp.read()
    return answer


def _floor(spec: dict[str, Any]) -> dict[str, Any]:
    """What any client must receive and spend, measured outside both clients' code (run in
    a child process of its own, after theirs, on a fresh server):

    * bytes: the JSON of the response rows of TRL's own answer (``prompt_logprobs[P:]`` of
      each sequence, exactly as the server wrote it): vLLM 0.34 has no other form for the
      teacher's top-k, so no client can receive less; and the ``prompt_logprobs`` field of
      a scale-out answer from ``P`` (those rows and a ``null`` for each of the ``P``
      positions before them, which vLLM writes for any request scored from ``P``): the
      least any request on vLLM 0.34's API receives;
    * CPU: sending the requests opd_stream's client sends (scale-out, one per sequence:
      the only path that meets the targets on bytes and computed tokens) with the standard
      library's ``http.client`` on one kept-alive connection, one after another (the least
      CPU a Python client spends per request, with no deadline, retry or bound), an untyped
      ``msgspec.json.decode`` of their answers, and TRL's result lists built from numpy
      arrays with ``ndarray.tolist()`` (the least the contract forces a client to build);
      the arrays are prepared beforehand, not counted. The process holds torch, as both
      clients' processes do (TRL's client imports it; a trainer always has): the cyclic
      GC's full collections, which the result's lists set off, walk its objects too.
    """
    import http.client
    import urllib.parse

    import torch  # noqa: F401  (held: as in both clients' processes)

    from opd_stream.integrations.trl._rows import sequence_result
    from opd_stream.wire._codec import decode_score_response
    from opd_stream.wire._payloads import build_score_payload
    from opd_stream.wire._request import ScoreRequest

    sz = msgspec.convert(spec["sizes"], Sizes)
    k, url = int(spec["k"]), spec["url"]
    ballast = [[i] for i in range(sz.heap)]  # noqa: F841  (held: a trainer-sized heap)
    seqs, lengths = workload(sz.prompts, sz.per_prompt, sz.prompt, sz.response, seed=1)
    with urllib.request.urlopen(url + "/v1/models") as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    rows_bytes = 0
    for seq, p in zip(seqs, lengths, strict=True):  # TRL's request, one sequence at a time
        body = {"model": model, "prompt": [seq], "max_tokens": 1, "prompt_logprobs": k}
        answer = _post(url + "/v1/completions", json.dumps(body).encode())
        (choice,) = msgspec.json.decode(answer, type=_Completion).choices
        rows_bytes += len(b"[" + b",".join(choice.prompt_logprobs[p:]) + b"]")
    answers, arrays, bodies = [], [], []
    field_bytes = 0
    for seq, p in zip(seqs, lengths, strict=True):  # opd_stream's request, as its client sends
        tokens = np.array(seq, dtype=np.int64)
        req = ScoreRequest(tokens=tokens, response_length=len(seq) - p, top_k=k, engine="vllm")
        bodies.append(bytes(build_score_payload(req)))
        answer = _post(url + "/inference/v1/generate", bodies[-1])
        answers.append(answer)
        field_bytes += len(msgspec.json.decode(answer, type=_ScaleOut).prompt_logprobs)
        # the result's arrays (float64 / int64, TRL's shapes), ready for tolist()
        res = sequence_result(decode_score_response(answer, req), tokens, p, k)
        arrays.append(tuple(np.array(res[key]) for key in res))
    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port)
    conn.connect()
    del answers
    gc.collect()
    t0 = time.process_time()
    answers = []
    for body in bodies:
        conn.request("POST", "/inference/v1/generate", body, SEND_HEADERS)
        answers.append(conn.getresponse().read())
    t1 = time.process_time()
    for answer in answers:
        decoded = msgspec.json.decode(answer)
        del decoded
    t2 = time.process_time()
    result = [[a.tolist() for a in four] for four in arrays]
    t3 = time.process_time()
    conn.close()
    del result
    return {
        "rows_bytes": rows_bytes,
        "field_bytes": field_bytes,
        "answer_bytes": sum(map(len, answers)),
        "send_cpu_s": t1 - t0,
        "decode_cpu_s": t2 - t1,
        "build_cpu_s": t3 - t2,
        "cpu_s": t3 - t0,
    }


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.trl_teacher", "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the {spec['client']} client failed:\n{proc.stderr[-4000:]}")
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return res


def _mock_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/mock/stats") as resp:
        stats: dict[str, Any] = json.loads(resp.read())
    return stats


def _mock(sz: Sizes) -> Any:
    """The mock vLLM server (a subprocess) with TRL's ``vllm serve`` flags."""
    from opd_stream.testing.mock_vllm import VllmMockOptions, VllmMockProcess

    options = VllmMockOptions(
        vocab_size=VOCAB,
        max_logprobs=-1,
        prefix_cache_tokens=1 << 22,
        prefix_cache_page=16,
        compute_fixed_s=0.0005,
        compute_per_token_s=sz.per_token_s,
    )
    return VllmMockProcess("teacher", 0, options=options)


def run(sz: Sizes, progress: Any = None) -> dict[str, Any]:
    """Both clients at each ``top_logprobs`` (see the module's docstring)."""
    from opd_stream.scanner._loader import prepare

    prepare()  # the compiled kernels once, on disk for the children
    samples = sz.prompts * sz.per_prompt
    response_tokens = samples * sz.response
    unique = sz.prompts * sz.prompt + response_tokens
    out: dict[str, Any] = {
        "sizes": msgspec.to_builtins(sz),
        "samples": samples,
        "response_tokens": response_tokens,
        "unique_tokens": unique,
        "runs": {},
    }
    mock = _mock(sz)
    try:
        for k in sz.top:
            runs: dict[str, Any] = {}
            for client in CLIENTS:
                if progress is not None:
                    progress(f"top_logprobs {k}: {client}")
                mock.kill()  # a fresh server: an empty prefix cache
                url = mock.start()
                spec = {"client": client, "url": url, "k": k, "sizes": msgspec.to_builtins(sz)}
                res = _run_child(spec)
                res["cpu_ms_per_sample"] = 1000 * res["cpu_s"] / samples
                res["bytes_per_response_token"] = res["bytes_sent"] / response_tokens
                res["computed_over_unique"] = res["computed_tokens"] / unique
                runs[client] = res
            if progress is not None:
                progress(f"top_logprobs {k}: floors")
            mock.kill()
            url = mock.start()
            spec = {"client": "floor", "url": url, "k": k, "sizes": msgspec.to_builtins(sz)}
            floor = _run_child(spec)
            floor["cpu_ms_per_sample"] = 1000 * floor["cpu_s"] / samples
            floor["bytes_per_response_token"] = floor["rows_bytes"] / response_tokens
            trl, ours = runs["trl"], runs["opd_stream"]
            # the best ratio any client could show (TRL's over the floor), and the smallest
            # memory ratio any client returning TRL's result can have (the result over
            # TRL's peak)
            floor["best"] = {
                "cpu": trl["cpu_s"] / floor["cpu_s"],
                "bytes": trl["bytes_sent"] / floor["rows_bytes"],
                "bytes_api": trl["bytes_sent"] / floor["field_bytes"],
                "memory": trl["traced_result"] / max(trl["peak_rss_growth"], 1),
                "memory_traced": trl["traced_result"] / max(trl["traced_peak"], 1),
            }
            runs["floor"] = floor
            runs["ratios"] = {
                "cpu": trl["cpu_s"] / ours["cpu_s"],
                "bytes": trl["bytes_sent"] / ours["bytes_sent"],
                "memory": ours["peak_rss_growth"] / max(trl["peak_rss_growth"], 1),
                "memory_traced": ours["traced_peak"] / max(trl["traced_peak"], 1),
                "memory_working": (ours["traced_peak"] - ours["traced_result"])
                / max(trl["traced_peak"] - trl["traced_result"], 1),
                "equal": trl["digest"] == ours["digest"],
            }
            out["runs"][str(k)] = runs
    finally:
        mock.kill()
    return out


def _reach(met: bool, best: float, target: float, *, at_most: bool = False) -> str:
    """How a target stands against the floor: ``best`` is the best ratio any client could
    show on vLLM 0.34's API at these sizes (the floors)."""
    if met:
        return ""
    reachable = best <= target if at_most else best >= target
    word = "reachable" if reachable else "beyond reach"
    fmt = f"{best:.3f}" if at_most else f"{best:.2f}x"
    return f" ({word}: the floor allows {fmt})"


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """MET / MISSED per target and ``top_logprobs``; a miss says whether the floor (what
    any client must receive, spend or return, measured outside both clients) allows it."""
    rows = []
    for k, runs in result["runs"].items():
        r = runs["ratios"]
        ours = runs["opd_stream"]
        best = runs.get("floor", {}).get("best")
        met = {
            "cpu": r["cpu"] >= TARGETS["cpu"],
            "bytes": r["bytes"] >= TARGETS["bytes"],
            "memory": r["memory"] <= TARGETS["memory"],
        }
        note = {
            key: ""
            if best is None
            else _reach(met[key], best[key], TARGETS[key], at_most=key == "memory")
            for key in met
        }
        if best is not None and not met["bytes"]:
            word = "reachable" if best["bytes_api"] >= TARGETS["bytes"] else "beyond reach"
            note["bytes"] = (
                f" ({word}: the response rows alone allow {best['bytes']:.3f}x; vLLM 0.34's "
                f"prompt_logprobs field, the least a request scored from P receives, "
                f"{best['bytes_api']:.2f}x)"
            )
        checks = [
            (
                f"top {k}: client CPU >= {TARGETS['cpu']:g}x less",
                met["cpu"],
                f"{r['cpu']:.1f}x{note['cpu']}",
            ),
            (
                f"top {k}: bytes >= {TARGETS['bytes']:g}x fewer",
                met["bytes"],
                f"{r['bytes']:.2f}x{note['bytes']}",
            ),
            (
                f"top {k}: teacher tokens computed <= {TARGETS['computed']:g}x unique",
                ours["computed_over_unique"] <= TARGETS["computed"],
                f"{ours['computed_over_unique']:.3f}x",
            ),
            (
                f"top {k}: peak client memory <= 1/10 of TRL's",
                met["memory"],
                f"{r['memory']:.3f}{note['memory']}",
            ),
            (f"top {k}: equal to TRL's client, value for value", r["equal"], ""),
        ]
        rows += [
            {"target": t, "status": "MET" if ok else "MISSED", "value": v} for t, ok, v in checks
        ]
    return rows


def markdown(result: dict[str, Any], machine: str) -> str:
    sz = result["sizes"]
    lines = [
        "# TRL's server teacher: TRL 1.16.0's client vs opd_stream's drop-in",
        "",
        f"machine: {machine}",
        "",
        f"sizes: {sz['prompts']} prompts x {sz['per_prompt']} samples, prompt {sz['prompt']}, "
        f"response {sz['response']}; unique teacher tokens {result['unique_tokens']}"
        + (
            f"; each client's process holds {sz['heap']:,} more Python objects"
            if sz.get("heap")
            else ""
        ),
        "",
        "## Targets",
        "",
        "| target | status | value |",
        "|---|---|---|",
    ]
    lines += [f"| {t['target']} | **{t['status']}** | {t['value']} |" for t in targets(result)]
    lines += [
        "",
        "## Per client",
        "",
        "| top_logprobs | client | CPU ms / sample | bytes / response token | computed / unique "
        "| peak RSS growth (MB) | traced peak (MB) | of which the result (MB) | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, runs in result["runs"].items():
        for client in CLIENTS:
            r = runs[client]
            lines.append(
                f"| {k} | {client} | {r['cpu_ms_per_sample']:.2f} | "
                f"{r['bytes_per_response_token']:.0f} | {r['computed_over_unique']:.3f} | "
                f"{r['peak_rss_growth'] / 1e6:.1f} | {r['traced_peak'] / 1e6:.1f} | "
                f"{r['traced_result'] / 1e6:.1f} | {r['wall_s']:.2f} |"
            )
    lines += [
        "",
        "## TRL's over ours (CPU, bytes) and ours over TRL's (memory)",
        "",
        "| top_logprobs | CPU | bytes | peak RSS growth | traced peak | traced working "
        "(peak less the result) | equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, runs in result["runs"].items():
        r = runs["ratios"]
        lines.append(
            f"| {k} | {r['cpu']:.1f}x | {r['bytes']:.2f}x | {r['memory']:.3f} | "
            f"{r['memory_traced']:.3f} | {r['memory_working']:.3f} | {r['equal']} |"
        )
    if all("floor" in runs for runs in result["runs"].values()):
        lines += [
            "",
            "## Floors (measured outside both clients' code, same run)",
            "",
            "| top_logprobs | bytes floor / response token: the rows (vLLM's field) "
            "| TRL's bytes over the floor | ours over the floor "
            "| CPU floor ms / sample (send + decode + tolist) "
            "| TRL's CPU over the floor | ours over the floor "
            "| TRL's result over its peak RSS growth (traced peak) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for k, runs in result["runs"].items():
            f, ours = runs["floor"], runs["opd_stream"]
            b = f["best"]
            lines.append(
                f"| {k} | {f['bytes_per_response_token']:.0f} "
                f"({f['field_bytes'] / result['response_tokens']:.0f}) | {b['bytes']:.3f}x "
                f"({b['bytes_api']:.3f}x) | {ours['bytes_sent'] / f['rows_bytes']:.3f}x "
                f"({ours['bytes_sent'] / f['field_bytes']:.3f}x) | {f['cpu_ms_per_sample']:.2f} "
                f"({1000 * f.get('send_cpu_s', 0.0) / result['samples']:.2f} + "
                f"{1000 * f['decode_cpu_s'] / result['samples']:.2f} + "
                f"{1000 * f['build_cpu_s'] / result['samples']:.2f}) | {b['cpu']:.1f}x | "
                f"{ours['cpu_s'] / f['cpu_s']:.2f}x | {b['memory']:.3f} "
                f"({b['memory_traced']:.3f}) |"
            )
    return "\n".join(lines) + "\n"


def _machine() -> str:
    import os
    import platform

    return f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trl_teacher", description=__doc__)
    p.add_argument("--quick", action="store_true", help="4 x 4 samples, prompt 512, response 256")
    p.add_argument("--sizes", help="JSON object overriding sizes, e.g. '{\"prompts\": 2}'")
    p.add_argument("--top", type=int, action="append", help="top_logprobs (repeatable)")
    p.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(_floor(spec) if spec["client"] == "floor" else _child(spec)))
        return 0
    sz = SIZES["quick" if args.quick else "full"]
    if args.sizes:
        sz = msgspec.convert({**msgspec.to_builtins(sz), **json.loads(args.sizes)}, Sizes)
    if args.top:
        sz = msgspec.structs.replace(sz, top=tuple(args.top))
    t0 = time.perf_counter()
    result = run(sz, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    result["elapsed_s"] = time.perf_counter() - t0
    result["machine"] = _machine()
    result["targets"] = targets(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trl_teacher.json").write_text(json.dumps(result, indent=1))
    md = markdown(result, result["machine"])
    (out / "trl_teacher.md").write_text(md)
    print(md)
    return 0 if all(r["ratios"]["equal"] for r in result["runs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
