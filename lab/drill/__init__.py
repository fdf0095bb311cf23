"""Failover drills (`globalpool drill`): break a part of the local stack under load and
measure how the router copes.

- `scenarios`: the faults, registered by name (kill-region, drain-region, ...);
- `run`: bring the stack up with emulated networks, drive load, inject, clear;
- `analysis`: per-request records -> time to detect, time to reroute, TTFT by phase;
- `report`, `markdown`, `plot`: report.json, report.md, timeline.png.
"""
