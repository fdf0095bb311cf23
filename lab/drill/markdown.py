"""report.md: the drill's numbers as tables a person reads in a review."""

from __future__ import annotations

from typing import Any


def _value(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}" if abs(value) < 100 else f"{value:.0f}{unit}"
    return f"{value}{unit}"


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    failed = report["failed"]
    ttft = report["ttft_p99_ms"]
    rows = [
        ("requests", _value(report["requests"])),
        ("failed before first byte", _value(failed["before_first_byte"])),
        ("failed mid-stream", _value(failed["mid_stream"])
         + f" ({report['mid_stream_failures']['on_target']} on the target)"),
        ("time to detect", _value(report["time_to_detect_s"], " s")),
        ("time to reroute", _value(report["time_to_reroute_s"], " s")),
        ("TTFT P99 before / during / after",
         " / ".join(_value(ttft[p], " ms") for p in ("before", "during", "after"))),
    ]
    if "time_to_return_s" in report:
        rows.append(("traffic back on the target after clearing",
                     _value(report["time_to_return_s"], " s")))
    if "touches_after_detect" in report:
        rows.append(("touches after detection (probes, oscillation)",
                     _value(report["touches_after_detect"])))
    if "time_to_recover_s" in report:
        rows.append(("router view current again after Redis returned",
                     _value(report["time_to_recover_s"], " s")))
        rows.append(("router reported a stale view for", _value(report["router_stale_s"], " s")))
        expected = report["workers_expected"]
        rows.append(("fewest workers in the router's view while Redis was down",
                     f"{_value(report.get('workers_seen_min_during'))} of {expected}"))
        rows.append(("fewest workers in its view in the 5 s after Redis returned",
                     f"{_value(report.get('workers_seen_min_after'))} of {expected}"))
    if "failover" in report:
        failover = report["failover"]
        rows.append(("failover: primary killed -> a replica promoted",
                     _value(failover.get("promoted_after_s"), " s")))
        rows.append(("failover: primary killed -> every heartbeat fresh in the router "
                     f"(< {failover.get('fresh_s')} s old)",
                     _value(failover.get("heartbeats_fresh_after_s"), " s")))
        if "agents_published_after_s" in failover:
            rows.append(("failover: primary killed -> every agent's heartbeat in Redis again",
                         _value(failover.get("agents_published_after_s"), " s")))
    if "flap" in report:
        flap = report["flap"]
        rows.append(("flap: kills / comebacks / traffic resumed",
                     f"{flap['cycles']} / {flap['comebacks']} / {flap['readmissions']}"))
        rows.append(("flap: router ejections / readmissions",
                     f"{flap['router_ejections']} / {flap['router_readmissions']}"))
    return rows


def render(report: dict[str, Any]) -> str:
    lines = [f"# Drill `{report['scenario']}`", "",
             f"{report['description']} (target: {report['target']}).", ""]
    timeline = report["timeline"]
    lines += [f"Load from t=0; fault at t={timeline['fault_s']:g} s, cleared at "
              f"t={timeline['cleared_s']:g} s, end at t={timeline['end_s']:g} s.", "",
              "| measure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in summary_rows(report)]
    lines += ["", "## Goals", "", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {_value(g['measured'])} | {'yes' if g['met'] else '**no**'} |"
              for g in report["goals"]]
    if report["exited_children"]:
        lines += ["", f"Processes that exited unexpectedly: {', '.join(report['exited_children'])}"]
    lines += ["", "## Phases", "",
              "| phase | requests | failed (before first byte / mid-stream) | retried | "
              "hedged | TTFT P50 | TTFT P99 | served by region |",
              "|---|---|---|---|---|---|---|---|"]
    for phase, stats in report["phases"].items():
        total = sum(stats["served_by_region"].values()) or 1
        share = ", ".join(f"{region} {100 * n / total:.0f}%"
                          for region, n in stats["served_by_region"].items())
        failed = stats["failed"]
        lines.append(f"| {phase} | {stats['requests']} | {failed['before_first_byte']} / "
                     f"{failed['mid_stream']} | {stats['retried']} | "
                     f"{stats.get('hedged', 0)} | "
                     f"{_value(stats['ttft_p50_ms'], ' ms')} | "
                     f"{_value(stats['ttft_p99_ms'], ' ms')} | {share or '-'} |")
    lines += ["", "![timeline](timeline.png)", "", "## What the drill did", ""]
    lines += [f"- t={event['t_s']:.2f} s: {event['what']}" for event in report["events"]]
    if report["router_events"]:
        lines += ["", "## What the router reported (admin API events)", ""]
        shown = report["router_events"][:40]
        lines += [f"- t={e['t_s']:.2f} s: {e['kind']} {e['subject']}: {e['detail']}"
                  for e in shown]
        if len(report["router_events"]) > len(shown):
            lines.append(f"- ... {len(report['router_events']) - len(shown)} more in "
                         "report.json")
    load = report.get("load", {})
    if load.get("machine_stalled"):
        lines += ["", f"**Warning: the load generator started a request "
                  f"{load['max_start_lag_s']:.2f} s late: the machine stalled during this "
                  "drill, and the latencies, timeouts and heartbeats of that moment measure "
                  "the machine, not the router. Run it again on a quiet machine.**"]
    host = report.get("host")
    if host:
        lines += ["", f"Machine: {host['cpus']} CPUs, load average (1 min) "
                  f"{host['load_average_1m_at_start']:.1f} at the start of the load, "
                  f"{host['load_average_1m_at_end']:.1f} at the end (the whole stack, the load "
                  "generator and anything else share these CPUs)."]
    lines += ["", "## Definitions", ""]
    lines += [f"- `{name}`: {text}" for name, text in report["definitions"].items()]
    lines += ["", "Reproduce:", "", "```", report["options"].get("command") or "", "```", ""]
    return "\n".join(lines)
