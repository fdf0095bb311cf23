"""A drill's report: report.json (the numbers), report.md (for people), timeline.png,
and the raw records (requests.jsonl, health.jsonl) that every number is computed from."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.devstack.loadgen import RequestResult
from lab.drill import analysis
from lab.drill.analysis import Target, Timeline
from lab.drill.redis_scenarios import FRESH_AFTER_FAILOVER_S, RedisFailover
from lab.drill.scenarios import Scenario, WorkerFlap

STALL_S = 0.25
# After Redis returns: how long the router's view of the workers is watched.
RECONNECT_WINDOW_S = 5.0

DEFINITIONS = {
    "touch": "a request touches the fault target if it was served by the faulty region or "
             "worker, or the router retried it (server-timing has a `retry` phase), or it "
             "failed",
    "time_to_detect_s": "fault -> first moment T (the fault, or the start of a touching "
                        "request) after which no new request touched the target for 1 s: "
                        "when the router stopped sending new requests there. Later isolated "
                        "touches (half-open probes, oscillation) are `touches_after_detect`. "
                        "Redis outage: fault -> first /health answer with "
                        "redis_connected=false",
    "time_to_reroute_s": "fault -> start of the first 1-s window (starting at the fault or at "
                         "a request start) in which every new request succeeded elsewhere: "
                         "200, complete stream, served outside the target, not retried. "
                         "Not defined for a Redis outage (nothing to reroute)",
    "time_to_return_s": "fault cleared -> start of the first 1-s window in which the target "
                        "serves at least half the share of requests it served before the "
                        "fault. The load goes on until then (at most options.return_wait_s "
                        "after the clear is done), and options.after_return_s more; null if "
                        "that wait ran out, or the target served nothing before the fault",
    "time_to_recover_s": "Redis back -> first /health answer with redis_connected=true and "
                         "every worker known",
    "phases": "by request start: before = [warmup end, fault), during = [fault, cleared), "
              "after = [cleared, end]; the end is at least options.after_s after the clear, "
              "and options.after_return_s after the return",
    "hedged": "requests of which the router sent a copy to another worker because the "
              "first token was late (server-timing has a `hedge` phase; router.hedging): "
              "the extra engine load",
    "ttft": "client-side time from sending the request to the first SSE event carrying a "
            "token; percentiles over requests that succeeded, nearest rank",
    "failed": "before_first_byte: no body byte reached the client (error status, connect "
              "error, timeout); mid_stream: the stream started, then an SSE error event, a "
              "broken connection, or no `data: [DONE]`",
}


@dataclass(frozen=True)
class DrillFacts:
    """What was done, as the report needs it: from a Scenario, or from an old report."""

    scenario: str
    description: str
    target: Target
    flap_cycles: int | None = None
    flap_comebacks: int | None = None
    failover: dict[str, Any] | None = None  # redis-failover: how long each part took

    @classmethod
    def of(cls, scenario: Scenario) -> DrillFacts:
        if isinstance(scenario, WorkerFlap):
            return cls(scenario.name, scenario.describe(), scenario.target(),
                       scenario.cycles, scenario.comebacks)
        if isinstance(scenario, RedisFailover):
            return cls(scenario.name, scenario.describe(), scenario.target(),
                       failover=dict(scenario.failover))
        return cls(scenario.name, scenario.describe(), scenario.target())


def build_report(
    *, facts: DrillFacts, options_json: dict[str, Any], timeline: Timeline,
    results: Sequence[RequestResult], t0_s: float, events: list[tuple[float, str]],
    health: list[dict[str, Any]], router_events: list[dict[str, Any]], expected_workers: int,
    skipped: int, exited: list[str], max_start_lag_s: float = 0.0,
) -> dict[str, Any]:
    requests = analysis.relative(results, t0_s)
    target = facts.target
    phases = analysis.phase_stats(requests, timeline)
    failed = analysis.failures(requests)
    report: dict[str, Any] = {
        "scenario": facts.scenario,
        "description": facts.description,
        "target": target.label,
        "target_regions": sorted(target.regions),
        "target_workers": sorted(target.workers),
        "requests": len(requests),
        "failed": {k: failed[k] for k in ("before_first_byte", "mid_stream")}
        | {"total": failed["total"]},
        "time_to_detect_s": None,
        "time_to_reroute_s": None,
        "ttft_p99_ms": {phase: phases[phase]["ttft_p99_ms"] for phase in phases},
    }
    if target:
        detect, after = analysis.time_to_detect(requests, target, timeline)
        report["time_to_detect_s"] = _round(detect)
        report["touches_after_detect"] = after
        report["time_to_reroute_s"] = _round(analysis.time_to_reroute(requests, target,
                                                                      timeline))
        report["time_to_return_s"] = _round(analysis.time_to_return(requests, target, timeline))
    else:
        detect, recover = analysis.health_times(health, timeline, expected_workers)
        report["time_to_detect_s"] = _round(detect)
        report["time_to_recover_s"] = _round(recover)
        report["router_stale_s"] = _stale_seconds(health)
        report["workers_expected"] = expected_workers
        report["workers_seen_min_during"] = _fewest_workers(
            health, timeline.fault_s, timeline.cleared_s)
        report["workers_seen_min_after"] = _fewest_workers(
            health, timeline.cleared_s, timeline.cleared_s + RECONNECT_WINDOW_S)
    mid = [r for r in requests if r.failure == "mid_stream"]
    report["mid_stream_failures"] = {
        "on_target": sum(1 for r in mid if target.serves(r)),
        "elsewhere": sum(1 for r in mid if not target.serves(r)),
    }
    if facts.flap_cycles is not None:
        report["flap"] = _flap_stats(facts, requests, timeline, router_events)
    if facts.failover is not None:
        report["failover"] = facts.failover
    report["goals"] = _goals(facts.scenario, report)
    report["goals_met"] = all(goal["met"] for goal in report["goals"])
    report["exited_children"] = exited
    report["phases"] = phases
    report["timeline"] = {"warmup_end_s": timeline.warmup_end_s, "fault_s": timeline.fault_s,
                          "cleared_s": timeline.cleared_s, "end_s": timeline.end_s}
    report["events"] = [{"t_s": t, "what": label} for t, label in events]
    report["router_events"] = router_events
    report["load"] = {
        "skipped_by_loadgen": skipped,
        "in_warmup": sum(1 for r in requests if timeline.phase(r.start_s) is None),
        "max_start_lag_s": round(max_start_lag_s, 3),
        # A late start means the drill process, and likely the machine, stalled: the
        # latencies (and heartbeats, and timeouts) of that moment are not the router's.
        "machine_stalled": max_start_lag_s > STALL_S,
    }
    report["per_second"] = analysis.per_second(requests, timeline.end_s, target)
    report["definitions"] = DEFINITIONS
    report["options"] = options_json
    return report


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _fewest_workers(health: list[dict[str, Any]], from_s: float, to_s: float) -> int | None:
    """The fewest workers the router's /health reported between two moments."""
    return min((p["workers"] for p in health
                if from_s <= p["t_s"] < to_s and isinstance(p.get("workers"), int)),
               default=None)


def _stale_seconds(health: list[dict[str, Any]]) -> float:
    stale = [p["t_s"] for p in health if p.get("redis_connected") is False]
    return round(len(stale) * 0.25, 2)


def _flap_stats(facts: DrillFacts, requests: Sequence[RequestResult], timeline: Timeline,
                router_events: list[dict[str, Any]]) -> dict[str, Any]:
    """How often traffic came back to the flapping worker, against how often it came back."""
    target = facts.target
    worker = next(iter(target.workers))
    seconds = [any(target.serves(r) and r.ok for r in requests if int(r.start_s) == second)
               for second in range(int(timeline.fault_s), int(timeline.cleared_s))]
    readmissions = sum(1 for a, b in itertools.pairwise(seconds) if b and not a)
    served = [r for r in requests if timeline.phase(r.start_s) == "during" and target.serves(r)]
    return {
        "cycles": facts.flap_cycles,
        "comebacks": facts.flap_comebacks,
        "readmissions": readmissions,
        "seconds_with_traffic": sum(seconds),
        "requests_served_during": len(served),
        "router_ejections": sum(1 for e in router_events
                                if e.get("kind") == "ejected" and worker in str(e.get("subject"))),
        "router_readmissions": sum(1 for e in router_events if e.get("kind") == "readmitted"
                                   and worker in str(e.get("subject"))),
    }


def _goals(name: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    failed = report["failed"]
    goals = [
        {"goal": "0 requests failed before the first byte",
         "measured": failed["before_first_byte"], "met": failed["before_first_byte"] == 0},
        {"goal": "mid-stream failures only on streams served by the faulty target",
         "measured": report["mid_stream_failures"]["elsewhere"],
         "met": report["mid_stream_failures"]["elsewhere"] == 0},
    ]
    if name == "drain-region":
        goals.append({"goal": "0 failed requests", "measured": failed["total"],
                      "met": failed["total"] == 0})
        detect = report["time_to_detect_s"]
        goals.append({"goal": "no new requests to the drained region within 1 s",
                      "measured": detect, "met": detect is not None and detect <= 1.0})
    if name in ("kill-region", "worker-flap"):
        goals.append({"goal": "0 streams failed mid-stream (continued on another worker)",
                      "measured": failed["mid_stream"], "met": failed["mid_stream"] == 0})
        detect = report["time_to_detect_s"]
        goals.append({"goal": "the router stops sending to the killed engine(s) within 1 s",
                      "measured": detect, "met": detect is not None and detect <= 1.0})
    if name in ("partition-region", "slow-region"):
        goals.append({"goal": "detected and avoided while the fault lasts",
                      "measured": report["time_to_detect_s"],
                      "met": report["time_to_detect_s"] is not None})
    if name == "kill-region":
        reroute = report["time_to_reroute_s"]
        goals.append({"goal": "time_to_reroute_s <= 1", "measured": reroute,
                      "met": reroute is not None and reroute <= 1.0})
    if name == "worker-flap":
        flap = report["flap"]
        goals.append({"goal": "no oscillation: traffic returns to the flapping worker after "
                              "fewer than half of its comebacks",
                      "measured": f"{flap['readmissions']} of {flap['comebacks']}",
                      "met": flap["readmissions"] * 2 < flap["comebacks"]})
    if name in ("redis-failover", "redis-cluster-failover"):
        failover = report.get("failover") or {}
        promoted, fresh = failover.get("promoted_after_s"), failover.get(
            "heartbeats_fresh_after_s")
        goals.append({"goal": "0 failed requests (the router fails static through the gap)",
                      "measured": failed["total"], "met": failed["total"] == 0})
        goals.append({"goal": f"heartbeats fresh again within {FRESH_AFTER_FAILOVER_S:g} s "
                              "of the failover (the promotion)",
                      "measured": None if promoted is None or fresh is None
                      else round(fresh - promoted, 3),
                      "met": promoted is not None and fresh is not None
                      and fresh - promoted <= FRESH_AFTER_FAILOVER_S})
        published = failover.get("agents_published_after_s")
        goals.append({"goal": f"every agent's heartbeat in Redis again within "
                              f"{FRESH_AFTER_FAILOVER_S:g} s of the failover",
                      "measured": None if promoted is None or published is None
                      else round(published - promoted, 3),
                      "met": promoted is not None and published is not None
                      and published - promoted <= FRESH_AFTER_FAILOVER_S})
    if name == "redis-outage":
        goals.append({"goal": "the router reports its stale view while Redis is down",
                      "measured": report["time_to_detect_s"],
                      "met": report["time_to_detect_s"] is not None})
        goals.append({"goal": "the router recovers by itself when Redis returns",
                      "measured": report["time_to_recover_s"],
                      "met": report["time_to_recover_s"] is not None})
    return goals


def reanalyze(out: Path) -> dict[str, Any]:
    """report.json (and .md, .png) again from the raw records a drill left in `out`
    (requests.jsonl, health.jsonl and the old report.json): after a change of definitions,
    without running the drill again."""
    old = json.loads((out / "report.json").read_text())
    with (out / "requests.jsonl").open() as lines:
        results = [RequestResult.from_json(json.loads(line)) for line in lines]
    health: list[dict[str, Any]] = []
    if (out / "health.jsonl").exists():
        with (out / "health.jsonl").open() as lines:
            health = [json.loads(line) for line in lines]
    flap = old.get("flap") or {}
    labels = [part.split(" ", 1) for part in old["target"].split(", ") if " " in part]
    regions = old.get("target_regions", [name for kind, name in labels if kind == "region"])
    workers = old.get("target_workers", [name for kind, name in labels if kind == "worker"])
    facts = DrillFacts(old["scenario"], old["description"],
                       Target(frozenset(regions), frozenset(workers)),
                       flap.get("cycles"), flap.get("comebacks"), old.get("failover"))
    expected = old.get("workers_expected") or max(
        (p["workers"] for p in health if isinstance(p.get("workers"), int)), default=0)
    report = build_report(
        facts=facts, options_json=old["options"], timeline=Timeline(**old["timeline"]),
        results=results, t0_s=0.0, events=[(e["t_s"], e["what"]) for e in old["events"]],
        health=health, router_events=old["router_events"], expected_workers=expected,
        skipped=old["load"]["skipped_by_loadgen"], exited=old["exited_children"],
        max_start_lag_s=old["load"].get("max_start_lag_s", 0.0),
    )
    for kept in ("regions", "host"):
        if kept in old:
            report[kept] = old[kept]
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    rerender(out)
    return report


def rerender(out: Path) -> None:
    """report.md and timeline.png again from `out/report.json` (no drill is run)."""
    from lab.drill.markdown import render
    from lab.drill.plot import timeline_png

    report = json.loads((out / "report.json").read_text())
    timeline_png(report, out / "timeline.png")
    (out / "report.md").write_text(render(report))


def write_outputs(out: Path, report: dict[str, Any], results: Sequence[RequestResult],
                  t0_s: float, health: list[dict[str, Any]] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    with (out / "requests.jsonl").open("w") as records:
        for result in sorted(results, key=lambda r: r.start_s):
            records.write(json.dumps(result.to_json(t0_s)) + "\n")
    if health is not None:
        with (out / "health.jsonl").open("w") as polls:
            for poll in health:
                polls.write(json.dumps(poll) + "\n")
    from lab.drill.markdown import render
    from lab.drill.plot import timeline_png

    timeline_png(report, out / "timeline.png")
    (out / "report.md").write_text(render(report))


__all__ = ["DEFINITIONS", "Target", "build_report", "write_outputs"]
