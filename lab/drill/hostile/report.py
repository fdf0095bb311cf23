"""The hostile drill's report: report.json (the cells and the goals), report.md (tables a
person reads in a review) and matrix.png (lab.drill.hostile.plot)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.drill.hostile.measure import DEFINITIONS, GOALS, STALL_S, goals_missed


def build_report(cells: Sequence[dict[str, Any]], *, faults: Sequence[str],
                 clients: Sequence[str], settings: dict[str, Any], wall_s: float,
                 host: dict[str, Any], command: str, incomplete: str | None = None
                 ) -> dict[str, Any]:
    """`incomplete`: why the run stopped before its last cell (its goals are then missed)."""
    for cell in cells:
        cell["goals_missed"] = goals_missed(cell)
    goals = []
    for name, text in GOALS:
        missed = [f"{c['worker_fault']} x {c['client_behaviour']}" for c in cells
                  if name in c["goals_missed"]]
        goals.append({"goal": text, "met": not missed, "cells_missed": missed})
    return {
        "drill": "hostile",
        "command": command,
        "worker_faults": list(faults),
        "client_behaviours": list(clients),
        "cells": list(cells),
        "goals": goals,
        "goals_met": incomplete is None and all(goal["met"] for goal in goals),
        "incomplete": incomplete,
        "cells_met": sum(not cell["goals_missed"] for cell in cells),
        "cells_not_exercised": sum(not cell["exercised"] for cell in cells),
        "settings": settings,
        "definitions": DEFINITIONS,
        "wall_s": round(wall_s, 1),
        "host": host,
    }


def _value(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def _short(cell: dict[str, Any]) -> str:
    """A matrix entry: `ok`, or what was missed."""
    missed = cell["goals_missed"]
    if not missed:
        return "ok" if cell["exercised"] else "ok (not exercised)"
    parts = []
    for name in missed:
        if name == "lost":
            parts.append(f"lost {cell['lost']}")
        elif name == "detect_s":
            parts.append(f"detect {_value(cell['detect_s'], ' s')}")
        elif name == "rss":
            parts.append(f"RSS +{cell['rss_mb_after'] - cell['rss_mb_before']:.0f} MB")
        else:
            parts.append(f"{name.replace('_', ' ')} {cell[name]}")
    return ", ".join(parts)


def render(report: dict[str, Any]) -> str:
    faults, clients = report["worker_faults"], report["client_behaviours"]
    by_key = {(c["worker_fault"], c["client_behaviour"]): c for c in report["cells"]}
    lines = ["# Hostile drill: worker faults x client behaviours", "",
             f"{len(report['cells'])} cells, {report['cells_met']} meeting every goal "
             f"({report['cells_not_exercised']} not exercised: no request reached the bad "
             "worker); "
             f"{report['wall_s']:g} s in all. Goals per cell: "
             + "; ".join(f"`{g['goal']}`" for g in report["goals"]) + ".", "",
             *([f"**Incomplete: {report['incomplete']}**", ""] if report["incomplete"] else []),
             "| worker fault \\ client | " + " | ".join(clients) + " |",
             "|---|" + "---|" * len(clients)]
    for fault in faults:
        row = [_short(by_key[(fault, c)]) if (fault, c) in by_key else " " for c in clients]
        lines.append(f"| {fault} | " + " | ".join(row) + " |")
    lines += ["", "![matrix](matrix.png)", "", "## Goals", "", "| goal | met | cells missed |",
              "|---|---|---|"]
    for goal in report["goals"]:
        lines.append(f"| `{goal['goal']}` | {'yes' if goal['met'] else '**no**'} | "
                     f"{len(goal['cells_missed'])} |")
    lines += ["", "## Cells", "",
              "| worker fault | client | requests | lost | healthy ejected | detect s | "
              "router 5xx | RSS MB before / after / peak | first send s | sent to bad | "
              "slowest served s | goals missed |", "|---" * 12 + "|"]
    for cell in report["cells"]:
        lines.append(
            f"| {cell['worker_fault']} | {cell['client_behaviour']} | {cell['requests']} | "
            f"{cell['lost']} | {cell['healthy_ejected']} | {_value(cell['detect_s'])} | "
            f"{cell['router_5xx']} | {cell['rss_mb_before']:.0f} / {cell['rss_mb_after']:.0f}"
            f" / {cell['rss_mb_peak']:.0f} | {_value(cell['first_send_s'])} | "
            f"{cell['sent_to_bad']} | {_value(cell['slowest_served_s'])} | "
            f"{', '.join(cell['goals_missed']) or '-'} |")
    lines += _why(report["cells"])
    lines += ["", "## Settings", "", "```json", json.dumps(report["settings"], indent=2), "```",
              "", "## Definitions", ""]
    lines += [f"- `{name}`: {text}" for name, text in report["definitions"].items()]
    stalled = [f"{c['worker_fault']} x {c['client_behaviour']} ({c['max_loop_lag_s']:.1f} s)"
               for c in report["cells"] if c["max_loop_lag_s"] > STALL_S]
    if stalled:
        lines += ["", f"**The machine stalled (the clients' event loop ran more than "
                  f"{STALL_S:g} s late) in {len(stalled)} cells: {', '.join(stalled)}. Their "
                  "timeouts and detection measure the machine too; run them again on a "
                  "quiet one (--faults, --clients).**"]
    host = report["host"]
    lines += ["", f"Machine: {host['cpus']} CPUs, load average (1 min) "
              f"{host['load_average_1m_at_start']:.1f} at the start, "
              f"{host['load_average_1m_at_end']:.1f} at the end.", "", "Reproduce:", "",
              "```", report["command"], "```", ""]
    return "\n".join(lines)


def _why(cells: Sequence[dict[str, Any]]) -> list[str]:
    """What the clients saw in the cells that missed a goal."""
    lines = ["", "## What went wrong, by cell", ""]
    missed = [c for c in cells if c["goals_missed"]]
    if not missed:
        return [*lines, "Nothing: every cell met every goal."]
    for cell in missed:
        notes = cell["lost_examples"] + cell["router_5xx_examples"] + cell["refusal_examples"]
        notes += cell["healthy_ejections"]
        if "detect_s" in cell["goals_missed"]:
            notes.append(f"{cell['sent_to_bad']} requests reached the bad worker "
                         f"({cell['probes']} probes), {cell['bad_ejections']} ejections")
        lines.append(f"- **{cell['worker_fault']} x {cell['client_behaviour']}**: "
                     + "; ".join(notes))
    return lines


def write_outputs(out: Path, report: dict[str, Any]) -> None:
    from lab.drill.hostile.plot import matrix_png

    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render(report))
    matrix_png(report, out / "matrix.png")
