"""results.json, the table (printed and in report.md) and cpu_per_request.png.

With several rounds, each figure in the table is the median over rounds, and the CPU
column also lists every round's value; ratios are taken within a round (router vs
globalpool in the same round) and then the median, so slow drift of a shared machine
cancels out.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.benchproxy.workloads import Workload


def _median(values: list[float | None]) -> float | None:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(clean) if clean else None


def ratio_base(document: dict[str, Any]) -> str:
    """The row the `x globalpool` ratios divide by: the compiled build when it ran (the
    build to deploy), else globalpool as installed."""
    ran = {r["router"] for r in document["results"] if r.get("completed")}
    return "globalpool-compiled" if "globalpool-compiled" in ran else "globalpool"


def summarize(document: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per (workload, router), aggregated over rounds."""
    rows = document["results"]
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault((row["workload"], row["router"]), []).append(row)
    index = {(r["round"], r["workload"], r["router"]): r for r in rows}
    base_router = ratio_base(document)
    lines = []
    for (workload, router), group in by_key.items():
        ok = [r for r in group if r.get("completed")]
        if not ok:
            lines.append({"workload": workload, "router": router, "status": group[0]["status"],
                          "reason": group[0].get("reason")})
            continue
        ratios, added_p50, added_p99 = [], [], []
        for r in ok:
            base = index.get((r["round"], workload, base_router))
            if base and base.get("cpu_us_per_request") and r.get("cpu_us_per_request"):
                ratios.append(r["cpu_us_per_request"] / base["cpu_us_per_request"])
            direct = index.get((r["round"], workload, "direct"))
            if direct and direct.get("completed"):
                added_p50.append(r["ttft_ms"]["p50"] - direct["ttft_ms"]["p50"])
                added_p99.append(r["ttft_ms"]["p99"] - direct["ttft_ms"]["p99"])
        lines.append({
            "workload": workload, "router": router,
            "status": "ok" if all(r["status"] == "ok" for r in ok) else "errors",
            "rounds": len(ok),
            "requests_per_s": _median([r["requests_per_s"] for r in ok]),
            "ttft_p50_ms": _median([r["ttft_ms"]["p50"] for r in ok]),
            "ttft_p99_ms": _median([r["ttft_ms"]["p99"] for r in ok]),
            "added_ttft_p50_ms": _median(added_p50),
            "added_ttft_p99_ms": _median(added_p99),
            "e2e_p50_ms": _median([r["e2e_ms"]["p50"] for r in ok]),
            "e2e_p99_ms": _median([r["e2e_ms"]["p99"] for r in ok]),
            "cpu_us_per_request": _median([r.get("cpu_us_per_request") for r in ok]),
            "cpu_us_per_round": [r.get("cpu_us_per_request") for r in ok],
            "cpu_vs_globalpool": _median(ratios),
            "router_core_pct": _median([r.get("router_core_pct") for r in ok]),
            "errors": sum(r["errors"] for r in ok),
            "upstream_connections": _median([r.get("upstream_connections_opened") for r in ok]),
            "completed": sum(r["completed"] for r in ok),
        })
    return lines


def _f(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


HEADERS = ("router", "req/s", "TTFT p50", "TTFT p99", "+TTFT p99", "E2E p50", "E2E p99",
           "CPU us/req", "per round", "x globalpool", "router core", "new conns", "errors")


def _cells(line: dict[str, Any]) -> list[str]:
    if "requests_per_s" not in line:
        return [line["router"], f"{line['status']}: {(line.get('reason') or '')[:160]}",
                *[""] * (len(HEADERS) - 2)]
    rounds = " / ".join(_f(v) for v in line["cpu_us_per_round"])
    return [
        line["router"], _f(line["requests_per_s"]),
        _f(line["ttft_p50_ms"], ".2f"), _f(line["ttft_p99_ms"], ".2f"),
        "" if line["router"] == "direct" else _f(line["added_ttft_p99_ms"], "+.2f"),
        _f(line["e2e_p50_ms"], ".2f"), _f(line["e2e_p99_ms"], ".2f"),
        _f(line["cpu_us_per_request"]),
        rounds if line["rounds"] > 1 and line["cpu_us_per_request"] is not None else "",
        _f(line["cpu_vs_globalpool"], ".2f", "x"), _f(line["router_core_pct"], ".0f", "%"),
        _f(line["upstream_connections"]), str(line["errors"]),
    ]


def tables(document: dict[str, Any], markdown: bool) -> str:
    lines = summarize(document)
    titles = {w["name"]: Workload.from_json(w).title for w in document["meta"]["workloads"]}
    out: list[str] = []
    for workload, title in titles.items():
        group = [line for line in lines if line["workload"] == workload]
        rows = [_cells(line) for line in group]
        heading = f"{title} ({workload}); times in ms"
        if markdown:
            out += [f"#### {heading}", "", "| " + " | ".join(HEADERS) + " |",
                    "|" + "---|" * len(HEADERS)]
            out += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |"
                    for row in rows]
        else:
            measured = [r for r in rows if not r[1].startswith(("skipped", "failed"))]
            widths = [max(len(h), *(len(r[i]) for r in measured)) for i, h in
                      enumerate(HEADERS)]
            out += [heading, "  ".join(h.rjust(w) for h, w in zip(HEADERS, widths, strict=True))]
            out += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                    if row in measured else f"{row[0].rjust(widths[0])}  {row[1]}"
                    for row in rows]
        out.append("")
    return "\n".join(out) + "\n"


def _notes(document: dict[str, Any]) -> str:
    meta = document["meta"]
    notes = [f"- command: `{meta['command']}`",
             f"- pinning: {meta['pinning']}",
             f"- backends: {meta['backends']}",
             "- CPU us/req: user+system time of the router's process tree (/proc/PID/stat) "
             "over the measured phase / requests completed; `x globalpool` is that ratio "
             f"to {ratio_base(document)}'s within a round; `+TTFT p99` is added over the "
             "direct run of the same round; `router core` is the router's CPU time / wall "
             "time; `new conns`: connections the backends accepted during the workload "
             "(warm-up included; for `direct`, the load generator's own)",
             f"- python {meta['python']}, {meta['machine']}, {meta['cores']} cores, "
             f"{meta['duration_s']} s"]
    notes += core_share_note(meta)
    for name, problem in meta.get("unavailable", {}).items():
        notes.append(f"- {name} unavailable: {problem}")
    return "\n".join(notes)


def chart(document: dict[str, Any], path: Path) -> bool:
    """Grouped bars of CPU us per request; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    lines = [line for line in summarize(document)
             if line.get("cpu_us_per_request") is not None]
    workloads = [w["name"] for w in document["meta"]["workloads"]]
    routers = list(dict.fromkeys(line["router"] for line in lines))
    figure, axes = plt.subplots(figsize=(10, 5))
    width = 0.8 / max(1, len(routers))
    for i, router in enumerate(routers):
        values = [next((line["cpu_us_per_request"] for line in lines
                        if line["router"] == router and line["workload"] == w), 0.0)
                  for w in workloads]
        bars = axes.bar([x + i * width for x in range(len(workloads))], values, width,
                        label=router)
        axes.bar_label(bars, fmt="%.0f", fontsize=7)
    axes.set_xticks([x + width * (len(routers) - 1) / 2 for x in range(len(workloads))])
    titles = {w["name"]: Workload.from_json(w).title for w in document["meta"]["workloads"]}
    axes.set_xticklabels([titles[w] for w in workloads], fontsize=8)
    axes.set_ylabel("router CPU time per request (us)")
    axes.set_title("Router CPU per request (lower is better)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_outputs(document: dict[str, Any], out: Path, say: Callable[[str], None]) -> None:
    document["summary"] = summarize(document)
    (out / "results.json").write_text(json.dumps(document, indent=1, default=str))
    text = tables(document, markdown=False)
    say("\n" + text + _notes(document).replace("`", ""))
    profile_lines = []
    for name, profile in document.get("profiles", {}).items():
        if "own" in profile:
            profile_lines += [f"#### globalpool profile under {name} (own time, "
                              f"{profile['samples']} samples)", "", "| % | function |",
                              "|---|---|"]
            profile_lines += [f"| {e['pct']} | `{e['function']}` |" for e in profile["own"][:15]]
            profile_lines.append("")
    drawn = chart(document, out / "cpu_per_request.png")
    (out / "report.md").write_text(
        "### Proxy cost\n\n" + tables(document, markdown=True) + _notes(document) + "\n\n"
        + "\n".join(profile_lines)
        + ("![CPU per request](cpu_per_request.png)\n" if drawn else
           "(no chart: matplotlib is not installed)\n"))


def core_share_note(meta: dict[str, Any], core: str = "router core") -> list[str]:
    """The note on how much of the `core` a busy process got before and after the run
    (other work on this shared machine), if it was measured."""
    share = meta.get("router_core_share") or {}
    if share.get("before") is None or share.get("after") is None:
        return []
    return [f"- share of the {core} a busy process got (other work on this shared machine): "
            f"{share['before'] * 100:.0f}% before the run, {share['after'] * 100:.0f}% after"]
