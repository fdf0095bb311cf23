"""Readiness: whether this router can route now, apart from whether it is alive.

`/health` is liveness (the process answers; clients and benchmark tools call it, and
autohealing replaces a replica only when it fails). `/ready` is what a load balancer
asks before it sends clients here: 503, with the reason, whenever this replica cannot
route:
- it has no view of the fleet yet (Redis has not been read since it started);
- its heartbeat collector is not running (it crashed and is being restarted);
- its view has aged past `router.fail_static_s` with Redis unreachable;
- no worker is ready for any model.

Fail static holds: a replica whose good view ages because Redis went away keeps serving
from it and stays ready for `fail_static_s`, and says so (`fail_static: true`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.registry.snapshot import Snapshot


@dataclass(frozen=True, slots=True)
class CollectorState:
    """What readiness needs of the supervised collector (router.supervisor)."""

    running: bool
    crashes: int
    last_error: str | None


def readiness(snapshot: Snapshot, collector: CollectorState, fail_static_s: float,
              now_s: float) -> tuple[bool, dict[str, Any]]:
    """(ready, the document /ready answers with)."""
    age_s = snapshot.view_age_s(now_s)
    document: dict[str, Any] = {
        "redis_connected": snapshot.redis_connected,
        "view_age_s": None if age_s is None else round(age_s, 3),
        "workers": len(snapshot.workers),
        "collector_crashes": collector.crashes,
    }
    reason = _not_ready_because(snapshot, collector, fail_static_s, now_s, age_s)
    if reason is not None:
        return False, {"status": "not_ready", "reason": reason, **document}
    fail_static = not snapshot.redis_connected
    return True, {"status": "ready", "fail_static": fail_static,
                  "models": len(snapshot.models(now_s)), **document}


def _not_ready_because(snapshot: Snapshot, collector: CollectorState, fail_static_s: float,
                       now_s: float, age_s: float | None) -> str | None:
    if not collector.running:
        last = f" (last: {collector.last_error})" if collector.last_error else ""
        return (f"the heartbeat collector is not running: it crashed {collector.crashes} "
                f"time(s){last} and is being restarted")
    if age_s is None:
        return "no view of the fleet yet: Redis has not been read since the router started"
    if not snapshot.redis_connected and age_s > fail_static_s:
        return (f"the view of the fleet is {age_s:.0f} s old (Redis unreachable), past "
                f"router.fail_static_s ({fail_static_s:g} s)")
    if not snapshot.models(now_s):
        return "no worker is ready for any model"
    return None


ReadinessProbe = Callable[[float], tuple[bool, dict[str, Any]]]
