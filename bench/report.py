"""Targets (MET / MISSED), results.json, a Markdown table and PNG plots (Agg backend)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ("evaluate_targets", "render_markdown", "write_outputs")


def _t(name: str, met: bool | None, value: str, why: str = "") -> dict[str, Any]:
    status = "N/A" if met is None else ("MET" if met else "MISSED")
    return {"target": name, "status": status, "value": value, "note": why}


def _parse_lines(modes: dict[str, Any]) -> list[str]:
    """Scenario 1: each parser on the same answer bytes, and where opd_stream's CPU went."""
    lines = [
        "### Parsing the same answers (CPU-s per 1M response tokens)",
        "",
        "| mode | " + " | ".join(next(iter(modes.values()))["decode_floor_per_1m_tokens"]) + " |",
        "|---|" + "---|" * len(next(iter(modes.values()))["decode_floor_per_1m_tokens"]),
    ]
    for label, m in modes.items():
        vals = " | ".join(_fmt(v) for v in m["decode_floor_per_1m_tokens"].values())
        lines.append(f"| {label} | {vals} |")
    lines += [
        "",
        "2 decode threads vs 1 (the threaded decoder, wall): "
        + ", ".join(f"{label} {m['decode_threads_speedup']:.2f}x" for label, m in modes.items()),
        "",
        "### opd_stream's client CPU by step (us per response token; `stats().cpu_s`)",
        "",
    ]
    steps = list(next(iter(modes.values()))["cpu_us_per_token_by_step"])
    lines += ["| mode | " + " | ".join(steps) + " |", "|---|" + "---|" * len(steps)]
    for label, m in modes.items():
        vals = " | ".join(f"{v:.2f}" for v in m["cpu_us_per_token_by_step"].values())
        lines.append(f"| {label} | {vals} |")
    lines.append("")
    return lines


#: Issue 35's ratios against the baseline (Miles' way), by scenario 1's mode.
CPU_VS_BASELINE = {"top-k 16 only-student": 20.0, "top-k 16 only-student, array rows": 30.0}
MSGSPEC_UNTYPED = "msgspec.json.decode, untyped, gc off"
SCANNER = "opd_stream compiled scanner"


def _cpu_targets(label: str, m: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 35's targets for one mode of scenario 1: client CPU against the baseline,
    against msgspec's untyped decode and our scanner's parse of the same answers, and the
    share of the CPU no step of ``stats().cpu_s`` names."""
    out: list[dict[str, Any]] = []
    opd = m["opd_stream"]["cpu_s_per_1m_tokens"]
    r = m["cpu_ratio_baseline_over_opd"]
    want = CPU_VS_BASELINE[label]
    out.append(
        _t(f"S1 client CPU >= {want:g}x lower than baseline ({label})", r >= want, f"{r:.1f}x")
    )
    floors = m["decode_floor_per_1m_tokens"]
    for name, limit in ((MSGSPEC_UNTYPED, 1.0), (SCANNER, 2.0)):
        if name in floors:
            x = opd / floors[name]
            out.append(
                _t(
                    f"S1 client CPU <= {limit:g}x {name}'s parse of the same answers ({label})",
                    x <= limit,
                    f"{x:.2f}x",
                )
            )
    steps = m["cpu_us_per_token_by_step"]
    total = sum(steps.values())
    if total > 0:
        rest = steps["other"] / total
        out.append(
            _t(
                f"S1 CPU outside every step of stats().cpu_s < 10% ({label})",
                rest < 0.10,
                f"{rest:.1%}",
            )
        )
    return out


def evaluate_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target of the issue that the scenarios that ran can decide."""
    out: list[dict[str, Any]] = []
    s1 = res.get("1")
    if s1:
        for label, floor_x in (
            ("top-k 16 only-student", 1.5),
            ("top-k 16 only-student, array rows", 1.2),
        ):
            m = s1["modes"].get(label)
            if not m:
                continue
            r = m["cpu_ratio_baseline_over_opd"]
            if label == "top-k 16 only-student":
                out.append(
                    _t(
                        f"S1 client CPU/token >= 6x lower than baseline ({label})",
                        r >= 6,
                        f"{r:.1f}x",
                        "stretch 10x: " + ("met" if r >= 10 else "missed"),
                    )
                )
            f = m["opd_cpu_over_floor"]
            out.append(
                _t(
                    f"S1 client CPU/token within {floor_x}x of the parsing floor ({label})",
                    f <= floor_x,
                    f"{f:.2f}x of floor",
                    "floor: the faster of msgspec untyped (gc off) and pyarrow's reader",
                )
            )
            sp = m.get("decode_threads_speedup")
            if sp is not None and label == "top-k 16 only-student":
                out.append(
                    _t(
                        "decode throughput, 2 decode threads >= 1.5x one thread",
                        sp >= 1.5,
                        f"{sp:.2f}x",
                    )
                )
            out += _cpu_targets(label, m)
        for label, m in s1["modes"].items():
            w = m["wall_ratio_baseline_over_opd"]
            out.append(_t(f"S1 rollout-tail wall >= 3x shorter ({label})", w >= 3, f"{w:.2f}x"))
            eq = m["equality"]["equal_within_1e-5"]
            out.append(
                _t(
                    f"S1 baseline == opd_stream within 1e-5 ({label})",
                    eq,
                    f"{m['equality']['max_abs_diff_reverse_kl']:.1e}",
                )
            )
    s3 = res.get("3")
    if s3:
        run = s3["runs"].get("opd_stream (defaults)")
        if run and run.get("lag_p99_ms") is not None:
            v = run["lag_p99_ms"]
            out.append(
                _t(
                    "S3 event-loop lag p99 <= 20 ms (defaults)",
                    v <= 20,
                    f"p99 {v:.1f} ms, max {run['lag_max_ms']:.1f} ms",
                )
            )
    s4 = res.get("4")
    if s4:
        for row in s4["rows"]:
            r = row["response_length"]
            pp, tgt = row["per_position"], row["per_position_target"]
            out.append(
                _t(
                    f"S4 per-position <= 1.05 (k+1) x 34 B/token (R={r})",
                    pp <= tgt,
                    f"{pp:.1f} B vs {tgt:.1f} B",
                )
            )
            b = row["b64_topk_per_candidate"]
            out.append(
                _t(
                    f"S4 b64 top-k <= 12 B/candidate (R={r})",
                    b <= 12,
                    f"{b:.2f} B (whole body {row['b64_topk_per_candidate_whole_body']:.2f})",
                )
            )
            blk = row.get("blocked_default", row["blocked_B8"])
            ratio = blk / pp
            b = row.get("default_block_size", 8)
            total = (blk + row.get("blocked_default_request", 0.0)) / (
                pp + row.get("per_position_request", 0.0)
            )
            out.append(
                _t(
                    f"S4 blocked (default B) <= 3x per-position (R={r})",
                    ratio <= 3,
                    f"{ratio:.2f}x (auto B = {b}; request + answer {total:.2f}x)",
                    ""
                    if ratio <= 3
                    else "a smaller B shrinks the answer but re-sends the prefix more "
                    "often; auto minimises request + answer bytes",
                )
            )
            out.append(
                _t(
                    f"S4 flat union / per-position (R={r}), reported",
                    None,
                    f"{row['flat_union'] / pp:.1f}x"
                    + (" (estimated)" if row["flat_union_estimated"] else ""),
                )
            )
    s5 = res.get("5")
    if s5:
        bad = [
            p
            for p in s5["points"]
            if p["max_inflight"] >= s5["capacity"]
            and not p["cpu_bound"]
            and p["samples_per_s"] < 0.9 * s5["c_over_l"]
        ]
        best = max(p["samples_per_s"] for p in s5["points"])
        out.append(
            _t(
                "S5 throughput >= 90% of C/L when not CPU bound",
                not bad,
                f"best {best:.1f}/s vs C/L {s5['c_over_l']:.1f}/s",
                "" if not bad else f"short at max_inflight {[p['max_inflight'] for p in bad]}",
            )
        )
    s6 = res.get("6")
    if s6 and s6.get("rss_ratio") is not None:
        r = s6["rss_ratio"]
        out.append(
            _t(
                f"S6 RSS after all / after {s6['checkpoint']} <= 1.2",
                r <= 1.2,
                f"{r:.3f} ({s6['rss_at_checkpoint_mb']:.0f} -> {s6['rss_at_end_mb']:.0f} MB)",
            )
        )
    s7 = res.get("7")
    if s7:
        for row in s7["rows"]:
            v = row["unpatched_over_patched_cpu"]
            out.append(
                _t(
                    f"S7 unpatched CPU/sample <= 3x patched (R={row['response_length']})",
                    v <= 3,
                    f"{v:.2f}x",
                )
            )
    s8 = res.get("8")
    if s8:
        r = s8["sizes"]["response"]
        for name, limit in (
            ("through sglang-router, discovery on", 1.5),
            ("through sglang-router, discovery off (blocks)", 3.0),
        ):
            run = s8["runs"][name]
            for what in ("cpu", "bytes"):
                v = run[f"{what}_over_direct"]
                out.append(
                    _t(
                        f"S8 {name}: client {what.upper() if what == 'cpu' else what} "
                        f"<= {limit}x direct (R={r})",
                        v <= limit,
                        f"{v:.2f}x",
                    )
                )
        out.append(_t("S8 values equal direct scoring in every run", s8["equal_to_direct"], ""))
    s9 = res.get("9")
    if s9:
        for variant, v in s9["variants"].items():
            # 1.05x in completion order and for blocks, 1.1x for N clients
            limit = 1.05 if "completion order" in variant and "client" not in variant else 1.1
            ours = v["runs"]["opd_stream prefix"]
            c, m = ours["computed_over_unique"], ours["max_over_mean_load"]
            of = "unique"
            if "computed_over_floor" in ours:  # blocks: each recomputes a partial page
                c, of = ours["computed_over_floor"], "one replica's"
            t_lo = ours["throughput_over_least_outstanding"]
            t_smg = ours["throughput_over_smg_cache_aware"]
            out += [
                _t(
                    f"S9 {variant}: teacher tokens computed <= {limit}x {of}",
                    c <= limit,
                    f"{c:.3f}x",
                ),
                _t(f"S9 {variant}: max/mean replica load <= 1.25", m <= 1.25, f"{m:.3f}"),
                _t(f"S9 {variant}: throughput >= least-outstanding", t_lo >= 1.0, f"{t_lo:.2f}x"),
                _t(f"S9 {variant}: throughput >= smg cache_aware", t_smg >= 1.0, f"{t_smg:.2f}x"),
            ]
            failed = sum(r["failures"] for r in v["runs"].values())
            out.append(_t(f"S9 {variant}: every sample scored in every run", failed == 0, ""))
    return out


def _fmt(v: Any, unit: str = "", digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}{unit}"
        return f"{v:.{digits}f}{unit}"
    return f"{v}{unit}"


_COLS = (
    "samples_per_s",
    "tokens_per_s",
    "cpu_s_per_1m_tokens",
    "bytes_per_token",
    "lag_p99_ms",
    "lag_max_ms",
    "latency_p50_s",
    "latency_p99_s",
    "peak_rss_mb",
    "wall_s",
)
_HEAD = (
    "samples/s",
    "tokens/s",
    "CPU s / 1M tok",
    "B / tok",
    "lag p99 ms",
    "lag max ms",
    "lat p50 s",
    "lat p99 s",
    "peak RSS MB",
    "wall s",
)


def _row(label: str, d: dict[str, Any], ratio: str = "") -> str:
    return "| " + " | ".join([label, *(_fmt(d.get(c)) for c in _COLS), ratio]) + " |"


def _header() -> list[str]:
    return ["| run | " + " | ".join(_HEAD) + " | baseline / opd |", "|" + "---|" * (len(_HEAD) + 2)]


def _kl_stage_lines(res: dict[str, Any]) -> list[str]:
    """The KL stage apart from the network: device and time per batch (scenarios 1, 3)."""
    runs: list[tuple[str, dict[str, Any]]] = []
    for label, m in res.get("1", {}).get("modes", {}).items():
        if "kl_stage" in m:
            runs.append((f"1. {label}", m["kl_stage"]))
    for name, r in res.get("3", {}).get("runs", {}).items():
        if "kl_stage" in r:
            runs.append((f"3. {name}", r["kl_stage"]))
    if not runs:
        return []
    lines = [
        "## KL stage (opd_stream, apart from the network)",
        "",
        "| run | device | batches | samples / batch | ms / batch p50 | ms / batch p99 | total s |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, k in runs:
        lines.append(
            f"| {label} | {k['device']} | {k['batches']} | {_fmt(k['samples_per_batch'])} "
            f"| {_fmt(k['ms_per_batch_p50'])} | {_fmt(k['ms_per_batch_p99'])} "
            f"| {_fmt(k['total_s'], digits=3)} |"
        )
    return [*lines, ""]


def render_markdown(
    res: dict[str, Any], targets: list[dict[str, Any]], meta: dict[str, Any]
) -> str:
    lines = [
        f"# opd_stream bench ({'quick' if meta.get('quick') else 'full'} sizes)",
        "",
        f"machine: {meta.get('machine')}",
        "",
    ]
    lines += ["## Targets", "", "| target | status | value | note |", "|---|---|---|---|"]
    lines += [
        f"| {t['target']} | **{t['status']}** | {t['value']} | {t['note']} |" for t in targets
    ]
    lines.append("")
    if "1" in res:
        lines += ["## 1. Rollout tail (burst)", "", f"sizes: {res['1']['sizes']}", ""]
        lines += _header()
        for label, m in res["1"]["modes"].items():
            ratio = (
                f"CPU {m['cpu_ratio_baseline_over_opd']:.1f}x, "
                f"wall {m['wall_ratio_baseline_over_opd']:.1f}x"
            )
            lines.append(_row(f"{label}: baseline", m["baseline"]))
            lines.append(_row(f"{label}: opd_stream", m["opd_stream"], ratio))
            lines.append(
                f"| {label}: parsing floor | | | "
                f"{_fmt(m['decode_floor_cpu_s_per_1m_tokens'])} | | | | | | | | "
                f"opd = {m['opd_cpu_over_floor']:.2f}x floor |"
            )
        lines.append("")
        for label, m in res["1"]["modes"].items():
            lines.append(f"- {label}: equality {m['equality']}")
        lines.append("")
        lines += _parse_lines(res["1"]["modes"])
    lines += _kl_stage_lines(res)
    if "2" in res:
        s = res["2"]
        lines += ["## 2. Streaming arrivals (Poisson)", "", f"sizes: {s['sizes']}", ""]
        lines += _header()
        lines.append(_row("baseline", s["baseline"]))
        lines.append(
            _row("opd_stream", s["opd_stream"], f"tail {s['tail_ratio_baseline_over_opd']:.1f}x")
        )
        lines += [
            "",
            f"- last arrival -> its result: baseline "
            f"{s['baseline']['last_arrival_to_its_result_s']:.3f} s, opd_stream "
            f"{s['opd_stream']['last_arrival_to_its_result_s']:.3f} s "
            f"(all results: {s['opd_stream']['last_arrival_to_all_results_s']:.3f} s)",
            f"- equality: {s['equality']}",
            "",
        ]
    if "3" in res:
        s = res["3"]
        lines += ["## 3. Long responses", "", f"sizes: {s['sizes']}", ""]
        lines += _header()
        base = s["runs"].get("baseline")
        for name, d in s["runs"].items():
            ratio = ""
            if base and name != "baseline":
                ratio = f"CPU {base['cpu_s_per_1m_tokens'] / d['cpu_s_per_1m_tokens']:.1f}x"
            lines.append(_row(name, d, ratio))
        lines.append("")
        for name, d in s["runs"].items():
            if d.get("equality"):
                lines.append(f"- {name}: equality {d['equality']}")
        lines.append("")
    if "4" in res:
        s = res["4"]
        lines += [
            "## 4. Wire size (response bytes per response token)",
            "",
            f"k = {s['k']}, prompt {s['prompt']}",
            "",
            "| R | per-position | blocked B=1 | B=2 | B=4 | B=8 | blocked auto (B) | "
            "b64 top-k | b64 B/candidate | json top-k | flat union | flat / pp |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in s["rows"]:
            flat = _fmt(row["flat_union"], "", 0) + (
                " (est.)" if row["flat_union_estimated"] else ""
            )
            lines.append(
                f"| {row['response_length']} | {_fmt(row['per_position'])} | "
                f"{_fmt(row.get('blocked_B1'))} | "
                f"{_fmt(row['blocked_B2'])} | {_fmt(row['blocked_B4'])} | "
                f"{_fmt(row['blocked_B8'])} | {_fmt(row.get('blocked_default'))} "
                f"({row.get('default_block_size')}) | "
                f"{_fmt(row['b64_topk'])} | {_fmt(row['b64_topk_per_candidate'])} | "
                f"{_fmt(row['json_topk'])} | {flat} | "
                f"{row['flat_union'] / row['per_position']:.1f}x |"
            )
        lines += [
            "",
            "Request bytes per response token: "
            + ", ".join(
                f"R={row['response_length']}: pp {row['per_position_request']:.0f}, "
                f"B1 {row.get('blocked_B1_request', float('nan')):.0f}, "
                f"B2 {row['blocked_B2_request']:.0f}, B4 {row['blocked_B4_request']:.0f}, "
                f"B8 {row['blocked_B8_request']:.0f}, "
                f"auto {row.get('blocked_default_request', float('nan')):.0f}"
                for row in s["rows"]
            ),
            "",
        ]
    if "5" in res:
        s = res["5"]
        lines += [
            "## 5. Concurrency sweep",
            "",
            f"mock capacity C = {s['capacity']}, latency L = {s['latency_s']} s, "
            f"C/L = {s['c_over_l']:.1f} samples/s",
            "",
            "| max_inflight | samples/s | ideal min(n,C)/L | % of ideal | client CPU frac | "
            "lat p50 s | lat p99 s |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in s["points"]:
            lines.append(
                f"| {p['max_inflight']} | {p['samples_per_s']:.1f} | "
                f"{p['ideal_samples_per_s']:.1f} | "
                f"{100 * p['samples_per_s'] / p['ideal_samples_per_s']:.0f}% | "
                f"{p['client_cpu_fraction']:.2f} | {p['latency_p50_s']:.3f} | "
                f"{p['latency_p99_s']:.3f} |"
            )
        b = s["baseline"]
        lines += [
            f"| baseline (unbounded) | {b['samples_per_s']:.1f} | {s['c_over_l']:.1f} | "
            f"{100 * b['samples_per_s'] / s['c_over_l']:.0f}% | - | "
            f"{_fmt(b['latency_p50_s'], '', 3)} | {_fmt(b['latency_p99_s'], '', 3)} |",
            "",
        ]
    if "6" in res:
        s = res["6"]
        lines += ["## 6. Soak", ""]
        lines += _header()
        lines.append(_row("opd_stream", s["opd_stream"]))
        lines += [
            "",
            f"RSS after {s['checkpoint']} samples: {_fmt(s['rss_at_checkpoint_mb'])} MB;"
            f" after {s['opd_stream']['samples']}: {_fmt(s['rss_at_end_mb'])} MB "
            f"(ratio {_fmt(s['rss_ratio'], '', 3)})",
            "",
        ]
    if "7" in res:
        s = res["7"]
        lines += ["## 7. Unpatched server (top-k 16 only-student)", ""]
        for row in s["rows"]:
            lines += [f"R = {row['response_length']}, {row['n']} samples:", ""]
            lines += [*_header()]
            for name in (
                "opd_stream patched (per-position)",
                "opd_stream unpatched (auto -> blocked)",
                "baseline flat union",
            ):
                d = row.get(name)
                if d is None:
                    continue
                if d.get("skipped"):
                    lines.append(f"| {name} | skipped: {d['reason']} |" + " |" * len(_COLS))
                    continue
                extra = ""
                if name.startswith("baseline"):
                    extra = f"finished {d['finished']}/{row['n']}" + (
                        " (capped)" if d["timed_out"] else ""
                    )
                lines.append(_row(name, d, extra))
            lines += [
                "",
                f"unpatched / patched client CPU per sample: "
                f"{row['unpatched_over_patched_cpu']:.2f}x",
                "",
            ]
    if "8" in res:
        s = res["8"]
        lines += [
            "## 8. A fleet behind a gateway: sglang-router 0.3.2, smg 1.13 (top-k 16 only-student)",
            "",
        ]
        lines += [f"sizes: {s['sizes']}", "", *_header()]
        for name, d in s["runs"].items():
            extra = ""
            if "cpu_over_direct" in d:
                extra = (
                    f"CPU {d['cpu_over_direct']:.2f}x, bytes {d['bytes_over_direct']:.2f}x "
                    f"direct; {d['requests']} requests"
                )
            lines.append(_row(name, d, extra))
        lines += ["", f"values equal to direct scoring: {s['equal_to_direct']}", ""]
    if "9" in res:
        s = res["9"]
        lines += ["## 9. Prefix locality on a GPU-bound fleet (mock compute model)", ""]
        lines += [f"sizes: {s['sizes']}", ""]
        for variant, v in s["variants"].items():
            lines += [f"### {variant} (unique teacher tokens {v['unique_tokens']})", ""]
            if "floor" in v:
                f = v["floor"]
                lines += [
                    f"one replica (every prefix reused) computed {f['computed_tokens']} "
                    f"({f['computed_over_unique']:.3f}x unique); computed / that: "
                    + ", ".join(
                        f"{n} {d['computed_over_floor']:.3f}" for n, d in v["runs"].items()
                    ),
                    "",
                ]
            lines += [
                "| run | computed / unique | max / mean replica load | samples/s | "
                "vs least-outstanding | busiest GPU / wall | cached share (client) | failures |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for name, d in v["runs"].items():
                lines.append(
                    f"| {name} | {d['computed_over_unique']:.3f} | "
                    f"{_fmt(d['max_over_mean_load'], digits=3)} | {d['samples_per_s']:.1f} | "
                    f"{d['throughput_over_least_outstanding']:.2f}x | "
                    f"{_fmt(d.get('gpu_bound_share'), digits=2)} | "
                    f"{_fmt(d['client_cached_share'], digits=3)} | {d['failures']} |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"


def _plots(res: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: list[str] = []
    if "5" in res:
        s = res["5"]
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [p["max_inflight"] for p in s["points"]]
        ax.plot(xs, [p["samples_per_s"] for p in s["points"]], "o-", label="opd_stream")
        ax.plot(xs, [p["ideal_samples_per_s"] for p in s["points"]], "--", label="min(n, C)/L")
        ax.axhline(s["baseline"]["samples_per_s"], color="gray", ls=":", label="baseline")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_inflight")
        ax.set_ylabel("samples / s")
        ax.set_title(f"Throughput vs concurrency (C={s['capacity']}, L={s['latency_s']} s)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_concurrency.png", dpi=100)
        plt.close(fig)
        files.append("throughput_vs_concurrency.png")
    lat_sets: list[tuple[str, list[float]]] = []
    for key in ("1", "2"):
        for label, lat in res.get(key, {}).get("_latencies", {}).items():
            lat_sets.append((f"S{key} {label}", lat))
    if lat_sets:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, lat in lat_sets:
            xs = sorted(lat)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.set_xlabel("latency (s)")
        ax.set_ylabel("fraction of samples")
        ax.set_title("Latency CDF")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "latency_cdf.png", dpi=100)
        plt.close(fig)
        files.append("latency_cdf.png")
    if "4" in res:
        rows = res["4"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["response_length"] for r in rows]
        for key, label in (
            ("flat_union", "flat union"),
            ("blocked_default", "blocked (default B)"),
            ("per_position", "per-position"),
            ("b64_topk", "b64 top-k"),
            ("json_topk", "json top-k"),
        ):
            ys = [r.get(key) for r in rows]
            if all(y is not None for y in ys):
                ax.plot(xs, ys, "o-", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("response length")
        ax.set_ylabel("response bytes / response token")
        ax.set_title(f"Wire size (k={res['4']['k']})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "bytes_per_token.png", dpi=100)
        plt.close(fig)
        files.append("bytes_per_token.png")
    return files


def write_outputs(
    res: dict[str, Any], meta: dict[str, Any], out: Path
) -> tuple[str, list[dict[str, Any]]]:
    """Write results.json, results.md and the PNGs; returns the Markdown and the targets."""
    out.mkdir(parents=True, exist_ok=True)
    targets = evaluate_targets(res)
    md = render_markdown(res, targets, meta)
    plots = _plots(res, out)
    (out / "results.json").write_text(
        json.dumps(
            {"meta": meta, "targets": targets, "results": res, "plots": plots},
            indent=1,
            default=str,
        )
    )
    (out / "results.md").write_text(md)
    return md, targets
