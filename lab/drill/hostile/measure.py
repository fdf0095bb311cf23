"""A cell's numbers: from what its clients saw, what the bad worker received (its own
record of arrivals) and what the router reported (ejections in /admin/status events).

Every definition used is in DEFINITIONS, which the report carries."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from lab.drill.hostile.cell import CellRun
from lab.drill.hostile.clients import Outcome

# The `code`s of the router's errors that report a worker's failure or no capacity: a 5xx
# with one of these is the pool's problem, passed on; any other 5xx is the router's own.
UPSTREAM_CODES = frozenset({"upstream_failed", "upstream_error", "no_capacity", "queue_full",
                            "region_unavailable"})
QUIET_S = 1.0  # sending must have stopped this long before the load ended to count
PROBE_SLACK_S = 0.05  # a request sent just before an ejection may arrive just after it
DETECT_GOAL_S = 5.0
STALL_S = 0.5  # a loop lag above this: the machine stalled during the cell
RSS_GROWTH_GOAL_MB = 64.0

DEFINITIONS = {
    "requests": "requests the cell's clients sent: the behaviour's own, and witness requests "
                "(normal clients, streams and whole answers, chat and completions in turn) "
                "sent beside them so that every cell measures detection and loss alike",
    "lost": "requests whose client did not get what it waited for although a healthy worker "
            "could have served it: a whole answer (normal, slow_reader, idle_connections, "
            "witnesses: 200 and, for a stream, `data: [DONE]` after at least one token with "
            "no error event before it, or a JSON answer with `choices`), the head "
            "(disconnects_after_headers: 200), or the head and the first events "
            "(reads_then_stalls, disconnects_mid_stream: 200 and 3 events without error). "
            "A client that leaves before any answer (disconnects_before_headers) loses "
            "nothing; a 10 MB body is refused (see refusals_missed)",
    "refusals_missed": "big_body requests (10 MB, over router.max_body_bytes) that did not "
                       "get their 413 (for instance a reset before it)",
    "healthy_ejected": "ejections of workers other than the bad one in the router's "
                       "/admin/status events",
    "detect_s": "fault start -> the last request the router sent to the bad worker (as the "
                "bad worker recorded their arrival) other than probes: requests that arrived "
                "while the router had it ejected (from its `ejected` event to its next "
                "`readmitted`), which are the breaker's half-open probes. null when the "
                "router was still sending there within 1 s of the end of the load; 0 when it "
                "sent nothing there after the fault",
    "exercised": "whether any request reached the bad worker after the fault: a cell in "
                 "which the router sent it nothing met its goals without meeting the fault",
    "router_5xx": "answers (a status, or an SSE error event after 200) of 500, or of "
                  "another 5xx whose OpenAI error `code` is not one that reports a worker's "
                  "failure or no capacity (upstream_failed, upstream_error, no_capacity, "
                  "queue_full, region_unavailable): 5xx the router itself caused",
    "slowest_served_s": "the longest a request that got its whole answer took (slow_reader "
                        "requests take their slow phase, 4 s, at least): a request retried "
                        "after a timeout on the bad worker is served, but late",
    "max_loop_lag_s": "the longest the drill's own event loop (the clients) ran a 0.1 s "
                      "timer late during the cell's load: above STALL_S the host stalled, "
                      "and that cell's timeouts and detection measure the host too",
    "rss_mb": "the router process's VmRSS (/proc/PID/status) after it started and before "
              "the cell (before), after the cell's clients had all gone (after), and its "
              "VmHWM (peak); a fresh router per cell",
}


def is_router_5xx(outcome: Outcome) -> bool:
    answer = outcome.answer
    status = outcome.status
    if answer is not None and answer.stream and answer.error is not None:
        status = answer.error_status  # an error event after the head's 200
    if status is None or status < 500:
        return False
    code = None if outcome.error is None else outcome.error.get("code")
    return status == 500 or code not in UPSTREAM_CODES


def is_lost(outcome: Outcome) -> bool:
    return outcome.expects in ("answer", "head", "partial") and not outcome.got_expected


def is_refusal_missed(outcome: Outcome) -> bool:
    return outcome.expects == "refusal" and not outcome.got_expected


def reason(outcome: Outcome) -> str:
    """Why a request did not get what it waited for, in a few words."""
    error = outcome.error
    code = None if error is None else error.get("code")
    if outcome.failure is not None:
        got = f" after {outcome.status}" if outcome.status is not None else ""
        return f"{outcome.failure}{got}"
    if outcome.status is not None and outcome.status >= 300:
        return f"{outcome.status} {code or ''}".strip()
    if error is not None:
        return f"{outcome.status} then an error event ({code})"
    return f"{outcome.status}, incomplete answer"


def _worker_of(event: dict[str, Any]) -> str | None:
    subject = str(event.get("subject", ""))
    parts = subject.split()
    return parts[1] if len(parts) >= 2 and parts[0] == "worker" else None


def ejection_windows(events: Iterable[dict[str, Any]], worker: str
                     ) -> list[tuple[float, float]]:
    """When the router had `worker` ejected: [ejected, next readmitted) in Unix seconds."""
    mine = sorted((float(e["at_unix_s"]), str(e.get("kind"))) for e in events
                  if _worker_of(e) == worker and e.get("kind") in ("ejected", "readmitted"))
    windows: list[tuple[float, float]] = []
    opened: float | None = None
    for at_s, kind in mine:
        if kind == "ejected" and opened is None:
            opened = at_s
        elif kind == "readmitted" and opened is not None:
            windows.append((opened, at_s))
            opened = None
    if opened is not None:
        windows.append((opened, math.inf))
    return windows


def detection(arrivals_unix_s: Sequence[float], fault_unix_s: float, load_end_unix_s: float,
              windows: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """detect_s (see DEFINITIONS), when the first request reached the bad worker, how many
    were sent there, and how many of those were probes."""
    arrivals = sorted(a for a in arrivals_unix_s if fault_unix_s <= a <= load_end_unix_s)
    probes = [a for a in arrivals if any(s + PROBE_SLACK_S <= a < e for s, e in windows)]
    sends = [a for a in arrivals if a not in probes]
    detect_s: float | None
    if not sends:
        detect_s = 0.0
    elif load_end_unix_s - sends[-1] < QUIET_S:
        detect_s = None
    else:
        detect_s = round(sends[-1] - fault_unix_s, 3)
    return {"detect_s": detect_s,
            "first_send_s": round(arrivals[0] - fault_unix_s, 3) if arrivals else None,
            "sent_to_bad": len(arrivals), "probes": len(probes)}


def _examples(outcomes: Iterable[Outcome], most: int = 3) -> list[str]:
    counts = Counter(f"{o.plan.role} {'stream' if o.plan.stream else 'whole'}: {reason(o)}"
                     for o in outcomes)
    return [f"{n} x {text}" for text, n in counts.most_common(most)]


def summarize(run: CellRun) -> dict[str, Any]:
    """The cell's entry in report.json (without its goals)."""
    outcomes = run.outcomes
    lost = [o for o in outcomes if is_lost(o)]
    router_5xx = [o for o in outcomes if is_router_5xx(o)]
    refusals = [o for o in outcomes if is_refusal_missed(o)]
    healthy = [e for e in run.router_events
               if e.get("kind") == "ejected" and _worker_of(e) not in (None, run.bad_worker)]
    windows = ejection_windows(run.router_events, run.bad_worker)
    found = detection(run.arrivals_unix_s, run.fault_unix_s, run.load_end_unix_s, windows)
    cell: dict[str, Any] = {
        "worker_fault": run.fault, "client_behaviour": run.client, "lane": run.lane,
        "exercised": found["sent_to_bad"] > 0,
        "requests": len(outcomes),
        "behaviour_requests": sum(o.plan.role == "behaviour" for o in outcomes),
        "lost": len(lost), "lost_witness": sum(o.plan.role == "witness" for o in lost),
        "refusals_missed": len(refusals),
        "healthy_ejected": len(healthy),
        **found,
        "bad_ejections": sum(1 for e in run.router_events if e.get("kind") == "ejected"
                             and _worker_of(e) == run.bad_worker),
        "router_5xx": len(router_5xx),
        "rss_mb_before": run.rss_mb_before, "rss_mb_after": run.rss_mb_after,
        "rss_mb_peak": run.rss_mb_peak,
        "served_by_bad": sum(o.got_expected and o.worker == run.bad_worker for o in outcomes),
        "slowest_served_s": max((round(o.ended_unix_s - o.started_unix_s, 2) for o in outcomes
                                 if o.got_expected and o.expects == "answer"), default=None),
        "lost_examples": _examples(lost),
        "router_5xx_examples": _examples(router_5xx),
        "refusal_examples": _examples(refusals),
        "healthy_ejections": [f"{e.get('subject')}: {e.get('detail')}" for e in healthy[:3]],
        "arrivals_total": run.arrivals_total,
        "max_loop_lag_s": run.max_loop_lag_s,
        # What detect_s was computed from: arrivals at the bad worker and its events in the
        # router, in seconds since the fault.
        "bad_arrivals_s": [round(a - run.fault_unix_s, 3) for a in run.arrivals_unix_s][:100],
        "bad_events": [f"{float(e['at_unix_s']) - run.fault_unix_s:.3f} s {e.get('kind')}: "
                       f"{e.get('detail')}" for e in sorted(
                           run.router_events, key=lambda e: float(e["at_unix_s"]))
                       if _worker_of(e) == run.bad_worker][:20],
        "wall_s": run.wall_s,
        **run.facts,
    }
    return cell


GOALS: tuple[tuple[str, str], ...] = (
    ("lost", "lost == 0"),
    ("refusals_missed", "refusals_missed == 0"),
    ("healthy_ejected", "healthy_ejected == 0"),
    ("detect_s", f"detect_s <= {DETECT_GOAL_S:g}"),
    ("router_5xx", "router_5xx == 0"),
    ("rss", f"rss_mb_after - rss_mb_before <= {RSS_GROWTH_GOAL_MB:g}"),
)


def goals_missed(cell: dict[str, Any]) -> list[str]:
    """The names (GOALS) of the goals this cell missed."""
    missed = [name for name in ("lost", "refusals_missed", "healthy_ejected", "router_5xx")
              if cell[name] != 0]
    if cell["detect_s"] is None or cell["detect_s"] > DETECT_GOAL_S:
        missed.append("detect_s")
    if cell["rss_mb_after"] - cell["rss_mb_before"] > RSS_GROWTH_GOAL_MB:
        missed.append("rss")
    return [name for name, _ in GOALS if name in missed]
