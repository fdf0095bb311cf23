"""How often the collector rebuilds the snapshot and reads the load records, and what
keeping the fleet view costs (exported as globalpool_fleet_view_*)."""

from __future__ import annotations

import time
from collections.abc import Callable

# A new snapshot at most this often: rebuilding per message would cost O(workers) per
# heartbeat at scale; 20 ms is well below a heartbeat interval. Taking in the load records
# and building cost O(workers) (~60-80 ms for 10,000), so the interval also grows, up to
# MAX_REBUILD_INTERVAL_S, until keeping the view takes the share of a core the router's
# config allows (`router.fleet_view_cpu_share`, 0.1 by default; read at every build, so a
# reload takes effect at once): a 10,000-worker fleet's view then lags its heartbeats by
# ~1-1.5 s (BENCHMARKS.md, "Heartbeat plane"). What is measured (taking in,
# building, freeing, by this thread's CPU time, so a busy machine does not stretch it) is
# ~MEASURED_SHARE of what the router spends on the view (0.72-0.77 in five bench-heartbeats
# runs at 10,000 workers); reading the records (the Redis client parsing the reply, ~1 us a
# record) and the loop around it are the rest, and cannot be told apart from what other
# tasks run meanwhile. The interval is what was measured / (share x MEASURED_SHARE).
MIN_REBUILD_INTERVAL_S = 0.02
MAX_REBUILD_INTERVAL_S = 2.0
MEASURED_SHARE = 0.75
# The interval grows at most this much from one build to the next, so that the next read
# stays within the margin views were given (NEXT_READ_INTERVALS) when a cycle suddenly
# costs more or the share is lowered; it shrinks at once.
MAX_INTERVAL_GROWTH = 1.5
# A worker's next load record is taken at the next read, one interval after this one ends:
# a view stays fresh until then, with a margin (twice the interval plus the slack: the
# next interval is at most MAX_INTERVAL_GROWTH times this one, and the rest is for reading
# and taking in 10,000 records between requests), when that is longer than its TTL
# (worker_view.fresh_for_s): a live worker must not go stale between two reads. Small
# fleets (20 ms) keep their TTL; at 10,000 workers (~1.3-1.5 s) a dead worker with a 1 s
# TTL goes stale within ~4-5 s of its last record instead of ~1.5-2 s.
NEXT_READ_INTERVALS = 2.0
NEXT_READ_SLACK_S = 0.1
# Load records are read at most this many times per agents' heartbeat interval
# (`heartbeat.interval_s`): a small fleet's view would otherwise be rebuilt and its records
# read every 20 ms, 25 reads per record written at 0.5 s, ~3% of a core for a handful of
# workers (BENCHMARKS.md). Reading 10 times per interval adds at most a tenth of it to a
# record's age; messages (state changes, new and departing workers) still reach the view
# at the next build.
LOAD_READS_PER_INTERVAL = 10
# A full read of N workers happens at most every N / this many seconds.
FULL_READ_WORKERS_PER_S = 1000.0


class Pace:
    """The collector's intervals, and its upkeep: `upkeep_cpu_s`, thread CPU seconds spent
    parsing, checking and applying what was read, and building snapshots (not the Redis
    client's reads), and `builds`, snapshots built.

    `cpu_share`: the share of a core the view may take (see MEASURED_SHARE);
    `agent_interval_s`: how often agents write their records (the config's
    `heartbeat.interval_s`; read at every load read, so a reload takes effect): see
    LOAD_READS_PER_INTERVAL, 0: as often as the view is built; `full_read_interval_s`:
    the least interval between full reads."""

    def __init__(self, *, cpu_share: Callable[[], float],
                 agent_interval_s: Callable[[], float], full_read_interval_s: float) -> None:
        self._cpu_share = cpu_share
        self._agent_interval_s = agent_interval_s
        self._full_read_interval_s = full_read_interval_s
        self.rebuild_every_s = MIN_REBUILD_INTERVAL_S  # see MEASURED_SHARE
        self.apply_s = 0.0  # what taking in the last load records took
        self.released_s = 0.0  # what freeing the snapshot last replaced took
        # What sending the last snapshot's changes to sibling processes took
        # (router.registry.feed): a cost of keeping the view, as building is.
        self.shipped_s = 0.0
        self.upkeep_cpu_s = 0.0
        self.builds = 0

    def spent(self, started: float) -> float:
        """Thread CPU since `started`, counted as upkeep."""
        spent = time.thread_time() - started
        self.upkeep_cpu_s += spent
        return spent

    def built(self, cost_s: float) -> None:
        """A snapshot was built and made current for `cost_s` of measured CPU: pace the
        next build by what this cycle took (with taking in the last load records and
        freeing the snapshot last replaced)."""
        self.builds += 1
        # The last one freed and shipped: costs of building.
        cost_s += self.apply_s + self.released_s + self.shipped_s
        self.rebuild_every_s = min(
            MAX_REBUILD_INTERVAL_S, MAX_INTERVAL_GROWTH * self.rebuild_every_s,
            max(MIN_REBUILD_INTERVAL_S, cost_s / (self._cpu_share() * MEASURED_SHARE)))

    def load_read_every_s(self) -> float:
        return max(self.rebuild_every_s, self._agent_interval_s() / LOAD_READS_PER_INTERVAL)

    def next_read_s(self) -> float:
        """The longest until the load records are read again (see NEXT_READ_INTERVALS)."""
        return NEXT_READ_INTERVALS * self.load_read_every_s() + NEXT_READ_SLACK_S

    def full_read_every_s(self, workers: int) -> float:
        """Large fleets are read in full less often: pub/sub carries the updates anyway."""
        return max(self._full_read_interval_s, workers / FULL_READ_WORKERS_PER_S)

    def upkeep(self) -> dict[str, float]:
        """What keeping the fleet view costs (exported as globalpool_fleet_view_*): CPU
        seconds so far, snapshots built, and the current least interval between builds."""
        return {"cpu_seconds": self.upkeep_cpu_s, "builds": self.builds,
                "rebuild_interval_seconds": self.rebuild_every_s}
