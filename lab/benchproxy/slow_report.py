"""bench-slow-readers' results.json, its table (printed and in report.md) and ttft.png.

Ratios are taken within a round (B over the A run just before it), then the median over
rounds, so that slow drift of a shared machine cancels out.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.benchproxy.slow_options import DUTY, QUIET_WAIT_PER_S, RATIO_GOAL


def _ratio(b: float, a: float) -> float | None:
    return b / a if a and not math.isnan(a) and not math.isnan(b) else None


def _quiet(run: dict[str, Any]) -> bool:
    return bool(run["cpu_wait_per_s"]["router"] <= QUIET_WAIT_PER_S)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios per round, their medians (over every round, and over the quiet ones: the
    router waited for a CPU at most QUIET_WAIT_PER_S in both runs), the totals, and which
    goals were met. The TTFT goal is judged on the quiet rounds: None when there was
    none (on a machine this busy the router's own queueing for a CPU is the TTFT)."""
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        rounds.setdefault(run["round"], {})[run["variant"]] = run
    ratios = []
    for number, pair in sorted(rounds.items()):
        if "A" in pair and "B" in pair:
            a, b = pair["A"]["others"]["ttft_ms"], pair["B"]["others"]["ttft_ms"]
            ratios.append({"round": number, "p50": _ratio(b["p50"], a["p50"]),
                           "p99": _ratio(b["p99"], a["p99"]),
                           "quiet": _quiet(pair["A"]) and _quiet(pair["B"])})
    errors = sum(run["others"]["errors"] + run.get("designated", {}).get("errors", 0)
                 for run in runs)
    ejections = sum(run["ejections"] for run in runs)
    quiet = _median([r["p99"] for r in ratios if r["quiet"]])
    return {
        "ratios": ratios,
        "ttft_p99_ratio": _median([r["p99"] for r in ratios]),
        "ttft_p50_ratio": _median([r["p50"] for r in ratios]),
        "quiet_ttft_p99_ratio": quiet,
        "errors": errors, "ejections": ejections,
        "attempt_failures": sum(sum(run["failures"].values()) for run in runs),
        "goals": {"no errors": errors == 0, "no ejections": ejections == 0,
                  f"TTFT p99 B/A <= {RATIO_GOAL:.2f} (quiet rounds)":
                      None if quiet is None else quiet <= RATIO_GOAL},
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _verdict(ok: bool | None) -> str:
    return "not measured (no quiet round)" if ok is None else "met" if ok else "NOT met"


def _f(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None or math.isnan(value) else f"{value:{spec}}"


def _outcomes(run: dict[str, Any]) -> str:
    slow = run.get("slow")
    if slow is None:
        return "-"
    return ", ".join(f"{n} {kind}" for kind, n in sorted(slow["outcomes"].items())) or "none"


HEADERS = ("round", "run", "open streams", "others' streams", "errors", "TTFT p50",
           "TTFT p90", "TTFT p99", "p99 B/A", "ejections", "attempt failures",
           "slow readers' streams")
# Where the time went, and what else the machine was doing.
MACHINE_HEADERS = ("round", "run", "router's TTFT p99", "worker TTFB p99",
                   "GET /health p99 (max)", "router core", "CPU wait: router / backends",
                   "router RSS peak", "backends / loadgen core")


def _cells(run: dict[str, Any], ratios: dict[int, dict[str, Any]]) -> list[str]:
    others = run["others"]
    ttft = others["ttft_ms"]
    errors = others["errors"] + run.get("designated", {}).get("errors", 0)
    ratio = ratios.get(run["round"], {}).get("p99") if run["variant"] == "B" else None
    failures = ", ".join(f"{int(n)} {kind}" for kind, n in run["failures"].items()) or "0"
    open_streams = run["open_streams"]
    return [*_run_name(run),
            f"{_f(open_streams['mean'], '.0f')} (max {_f(open_streams['max'], '.0f')})",
            str(others["completed"]), str(errors), _f(ttft["p50"]), _f(ttft["p90"]),
            _f(ttft["p99"]), _f(ratio, ".3f"), str(run["ejections"]), failures,
            _outcomes(run)]


def _run_name(run: dict[str, Any]) -> list[str]:
    return [str(run["round"]), run["variant"] + (" (slow readers)" if run["slow_readers"]
                                                 else "")]


def _machine_cells(run: dict[str, Any]) -> list[str]:
    view, router = run["router_view_ms"], run["router"]
    probe, wait = router["health_probe_ms"], run["cpu_wait_per_s"]
    return [*_run_name(run), f"<= {_f(view['ttft_p99'], '.0f')}",
            f"<= {_f(view['upstream_ttfb_p99'], '.0f')}",
            f"{_f(probe['p99'], '.1f')} ({_f(probe['max'], '.0f')})",
            f"{_f(router['core_pct'], '.0f')}% of "
            f"{_f((router['core_share_before'] or math.nan) * 100, '.0f')}%",
            f"{wait['router']:.2f} / {wait['backends']:.2f}",
            f"{_f(router['rss_peak_mib'], '.0f')} MiB",
            f"{run['backends_core_pct']:.0f}% / {run['loadgen_core_pct']:.0f}%"]


def run_line(run: dict[str, Any]) -> str:
    """One run, said in a line as it finishes."""
    ttft = run["others"]["ttft_ms"]
    return (f"[round {run['round']}] run {run['variant']}: others TTFT p50 "
            f"{_f(ttft['p50'], '.2f')} ms, p99 {_f(ttft['p99'], '.2f')} ms, errors "
            f"{run['others']['errors']}, ejections {run['ejections']}, attempt failures "
            f"{dict(run['failures']) or 0}, slow readers: {_outcomes(run)}")


def _render(headers: tuple[str, ...], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in [list(headers), *rows]) + "\n"


def table(document: dict[str, Any], markdown: bool) -> str:
    """The goals' table (times in ms), then where the time went."""
    ratios = {r["round"]: r for r in document["summary"]["ratios"]}
    runs = document["runs"]
    return (_render(HEADERS, [_cells(run, ratios) for run in runs], markdown) + "\n"
            + _render(MACHINE_HEADERS, [_machine_cells(run) for run in runs], markdown))


def _notes(document: dict[str, Any]) -> str:
    meta, summary = document["meta"], document["summary"]
    options = meta["options"]
    goals = "; ".join(f"{name}: {_verdict(ok)}" for name, ok in summary["goals"].items())
    quiet = [str(r["round"]) for r in summary["ratios"] if r["quiet"]]
    return "\n".join([
        f"- command: `{meta['command']}`",
        f"- {options['streams']} concurrent streams of {options['tokens']} tokens "
        f"{options['gap_ms']:g} ms apart (~{options['token_chars']} characters a token) from "
        f"{document['runs'][0]['clients']} clients, each streaming {DUTY:.0%} of the time "
        "on its own timetable (`open streams`: sampled every 0.1 s after the warm-up), "
        f"{options['workers']} workers (one backend process each); in B "
        f"{options['slow_share']:.0%} of the clients read {options['slow_bytes_per_s']:g} "
        f"B/s with SO_RCVBUF {options['slow_rcvbuf_bytes']} B; router settings: "
        f"{', '.join(meta['bench_settings'] + options['overrides'])}",
        "- TTFT: the other clients' (never slow in either run), of streams started after "
        "the first period; `p99 B/A` within the round; `attempt failures` and `ejections`: "
        "the router's /metrics over the run",
        "- router's TTFT / worker TTFB p99: the bucket bounds of the router's own "
        "histograms (every stream, the slow readers' too: arrival at the router to first "
        "byte; request sent to the worker to its first byte); GET /health: every 0.1 s "
        "during the run (a router whose loop stalls answers it late too); router core: its "
        "CPU time / wall time, of the share of its core a busy process got just before the "
        "run; CPU wait: seconds the router (the backends, summed) spent runnable but "
        "waiting for a CPU, per second (/proc/PID/schedstat): other work on the machine",
        f"- TTFT p99 B/A, median over rounds: {_f(summary['ttft_p99_ratio'], '.3f')} "
        f"(p50 {_f(summary['ttft_p50_ratio'], '.3f')}); over the quiet rounds (the router "
        f"waited for a CPU <= {QUIET_WAIT_PER_S:g} s per s in A and B: "
        f"{', '.join(quiet) or 'none'}): {_f(summary['quiet_ttft_p99_ratio'], '.3f')}",
        f"- goals: {goals}",
        f"- pinning: {meta['pinning']}; python {meta['python']}, {meta['machine']}, "
        f"{meta['cores']} cores, {meta['duration_s']} s"])


def chart(document: dict[str, Any], path: Path) -> bool:
    """Left, the other clients' TTFT distribution (CDF), A against B per round; right,
    their TTFT p99 by the second their streams started. False when matplotlib is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    share = document["meta"]["options"]["slow_share"]
    figure, (cdf, timeline) = plt.subplots(1, 2, figsize=(13, 5))
    for run in document["runs"]:
        others = run["others"]
        label = f"round {run['round']} {run['variant']}" + (
            f" ({share:.0%} slow readers)" if run["slow_readers"] else "")
        # A round's two runs in one colour: A solid, B dashed.
        style = {"linestyle": "--" if run["slow_readers"] else "-",
                 "color": f"C{(run['round'] - 1) % 10}", "label": label}
        quantiles = others["ttft_quantiles_ms"]
        if quantiles:
            cdf.plot(quantiles, [i / (len(quantiles) - 1) for i in range(len(quantiles))],
                     **style)
        seconds = others["timeline"]
        timeline.plot([s["second"] for s in seconds], [s["p99_ms"] for s in seconds],
                      marker=".", **style)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT of the other clients (ms, log scale)")
    cdf.set_ylabel("fraction of streams")
    cdf.axhline(0.99, color="grey", linewidth=0.5)
    cdf.legend(fontsize=8)
    timeline.set_yscale("log")
    timeline.set_xlabel("second of the run the stream started in")
    timeline.set_ylabel("TTFT p99 of the other clients (ms)")
    figure.suptitle("TTFT with and without slow readers among the streams")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_outputs(document: dict[str, Any], out: Path, say: Callable[[str], None]) -> None:
    """results.json, report.md (the table, notes and chart) and ttft.png under `out`;
    the table and notes are also said."""
    document["summary"] = summarize(document["runs"])
    drawn = chart(document, out / "ttft.png")
    say("\n" + table(document, markdown=False) + "\n" + _notes(document).replace("`", ""))
    (out / "results.json").write_text(json.dumps(document, indent=1, default=str))
    streams = document["meta"]["options"]["streams"]
    (out / "report.md").write_text(
        f"### Slow readers among {streams:,} paced streams\n\n"
        + table(document, markdown=True) + "\n" + _notes(document) + "\n\n"
        + ("![TTFT, A against B](ttft.png)\n" if drawn
           else "(no chart: matplotlib is not installed)\n"))
