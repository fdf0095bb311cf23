"""How often the collector reads the load records and rebuilds the view: within the share
of a core the config allows (`router.fleet_view_cpu_share`), read at every build."""

from __future__ import annotations

import itertools

import pytest

from router.registry.pace import (
    MAX_INTERVAL_GROWTH,
    MAX_REBUILD_INTERVAL_S,
    MEASURED_SHARE,
    MIN_REBUILD_INTERVAL_S,
    Pace,
)


def test_the_interval_keeps_the_views_upkeep_within_its_share_of_a_core() -> None:
    share = [0.1]
    pace = Pace(cpu_share=lambda: share[0], agent_interval_s=lambda: 0.0,
                full_read_interval_s=2.0)

    def intervals_after(cost_s: float, builds: int = 15) -> list[float]:
        """The interval after each of `builds` builds whose cycle cost `cost_s` of
        measured CPU (what SnapshotPublisher.publish_in_turns passes to Pace.built)."""
        seen = []
        for _ in range(builds):
            pace.built(cost_s)
            seen.append(pace.upkeep()["rebuild_interval_seconds"])
        return seen

    # 10,000 workers cost ~75 ms a cycle: a read every second at a tenth of a core (the
    # measured part is MEASURED_SHARE of it; the Redis client's read is the rest), reached
    # growing by at most MAX_INTERVAL_GROWTH a build from the 20 ms it starts at.
    ramp = intervals_after(0.075)
    assert ramp[0] == pytest.approx(MIN_REBUILD_INTERVAL_S * MAX_INTERVAL_GROWTH)
    assert all(b <= a * MAX_INTERVAL_GROWTH + 1e-12 for a, b in itertools.pairwise(ramp))
    assert ramp[-1] == pytest.approx(0.075 / (0.1 * MEASURED_SHARE)) == pytest.approx(1.0)
    share[0] = 0.25  # a reload asking for a fresher view: the next build follows it at once
    assert intervals_after(0.075, 1) == [pytest.approx(0.4)]
    assert intervals_after(0.001, 1) == [MIN_REBUILD_INTERVAL_S]  # a small fleet
    share[0] = 0.01
    assert intervals_after(0.08)[-1] == MAX_REBUILD_INTERVAL_S  # never staler than the cap
