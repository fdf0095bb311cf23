"""Region latency penalties: how much slower than predicted each region's first bytes have
been lately, beyond the other regions', learnt from streamed attempts' TTFT.

A penalty is for what heartbeats cannot show: a slow or congested path to a region. So
what is learnt from an attempt is only what the path and nothing else explains:
- the router's own delays are kept out: how long this router's event loop could not run
  when an attempt's first byte came (a busy host, a CPU hog beside it:
  router.health.loop_lag) is taken off its TTFB, since that first byte was read late
  here, not sent late there; an attempt whose wait was mostly that teaches nothing;
- the engine's part is taken as the larger of what was predicted for it and what the
  worker's own heartbeat says its requests waited for a first token lately (an engine
  busier than predicted is the engine's, and its queue terms already price it);
- the region's penalty needs evidence from several of its workers: each worker's misses
  are kept apart, and a region's excess is the least of its workers' (at least
  `min(2, its workers)` of them sampled), so one slow worker never penalises its region;
- first bytes that are late *now* count before they come (`overdue`): a worker's excess
  is at least the median of how far its streams still waiting have overrun what their
  path and engine explain. A region that turns slow at once is so penalised within a check or two
  of its streams' overrunning, not only once those slow first bytes have come and been
  averaged in (seconds, during which every new request went there too: the 300 ms
  slow-region drill was avoided after 0.95 s, against 1.35-2.2 s); and a decayed penalty
  that sends requests back to a region still slow is restored by the first few of them;
- a region that traffic left is tried again by one stream at a time (`dispatched`): while
  its penalty is below what its workers were last found at (it decays while nothing is
  learnt), a stream sent there is a probe, and until that probe has been learnt from (or
  for PROBE_HOLD_S) the region is scored as its workers were last found. Without it, the
  decay sent a wave of requests back to a region still slow, each of them late (the
  slow-region drill: 4-12 streams at ~630 ms, once or twice during the fault, and with
  6 or more its P99). What the probe finds holds for the region (`_probed`): still slow,
  its penalty is back; healed, traffic comes back at once. A region in use is found
  again at every answer: its penalty decays by less than PENALTY_FLOOR_MS between
  them, and none of this applies to it.

One `RegionPenalties` per router, held by router.health.tracker.Health, which feeds it the
attempts that finish and answers the policy's and the operators' questions with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from router.core.outcome import Attempt

# A region's first bytes must miss their predictions by this much more than the other
# regions' before it is penalised (ms): smaller misses are scheduling noise.
PENALTY_FLOOR_MS = 25.0
# Penalties are recomputed at least this often when asked (s), and after a new sample
# once `REFRESH_S_PER_WORKER` x the workers sampled has passed: a recomputation visits every
# sampled worker (~1 us each), and at 10,000 of them, after every sample, it would cost
# more than the routing decision; so it takes at most ~1 % of a core.
PENALTY_REFRESH_S = 0.05
REFRESH_S_PER_WORKER = 1e-4
# A worker's samples are forgotten once they have decayed over this many half-lives.
FORGET_HALF_LIVES = 8.0
# How many of a region's workers must have shown a miss for the region to be penalised
# (fewer if the region has fewer).
WORKERS_FOR_EVIDENCE = 2

# A worker's misses that step away from its mean by more than this (ms), in this many
# samples running, replace the mean: a path that slowed (or healed) at once is believed
# at its second sample, not after the ~5 an average weighted 0.2 would take, during which
# traffic went back and forth (the slow-region drill: 17 late streams in its first
# second; a region that traffic has left sends no more samples to average).
JUMP_MS = 100.0
JUMP_SAMPLES = 2

# A probe holds its region at its learnt penalty until it is learnt from, at most this
# long after it was sent (s): a long stream does not keep the region away while its
# penalty decays (when the hold lapses, the next stream sent there is the next probe).
PROBE_HOLD_S = 5.0
# A region whose workers a lower bound found (streams outrun by hedged copies) is probed
# once its penalty has decayed this much (ms), not PENALTY_FLOOR_MS: it was at least that
# slow, maybe much slower, and a wave of streams sent back would find out.
BOUNDED_NOISE_MS = 1.0

_NO_OVERRUNS: dict[str, float] = {}


class RegionPenalties:
    """Per worker, the mean of (measured - predicted path and engine time) in ms, weighted
    0.2 for each new sample and halving every `half_life_s` (or replaced by a step that
    JUMP_SAMPLES samples running confirm); per region, the least of its
    sampled workers' means; each region's penalty is its excess beyond the lowest other
    region's and PENALTY_FLOOR_MS.

    `workers_in(region)`: how many workers the region has now (the fleet view's count).
    """

    def __init__(self, half_life_s: float,
                 workers_in: Callable[[], Mapping[str, int]] = dict) -> None:
        self._half_life_s = half_life_s
        self._workers_in = workers_in
        # region -> worker -> (ewma, at_s)
        self._excess_ms: dict[str, dict[str, tuple[float, float]]] = {}
        self._penalties: dict[str, float] = {}  # region -> penalty, as of _penalties_at_s
        self._penalties_at_s = -1e18
        self._dirty = False  # a sample came since the last recomputation
        # worker -> (samples running beyond JUMP_MS of its mean: + above, - below, their
        # sum, the mean before them)
        self._steps: dict[str, tuple[int, float, float]] = {}
        # Workers whose mean a lower bound set last (see BOUNDED_NOISE_MS).
        self._bounded: set[str] = set()
        # region -> worker -> the largest overrun of its streams still waiting (ms), as
        # of the last `overdue` round: at least that much excess, now.
        self._overdue_ms: dict[str, dict[str, float]] = {}
        # region -> its penalty as its workers were last found, where their decay has
        # taken it lower since: what a probe holds it at (see `dispatched`).
        self._peaks: dict[str, float] = {}
        self._probes: dict[str, Attempt] = {}  # region -> its probe (see `dispatched`)
        self._usual_ms = 0.0  # see usual_ms
        self._gap_s = 0.0  # the least time between recomputations for new samples
        self.skipped_lagged = 0  # samples not learnt: mostly the router's own delay

    def penalty_ms(self, region: str, now_s: float) -> float:
        """How much slower than predicted this region's first bytes have been lately,
        beyond the other regions' (ms, >= 0).

        Every prediction misses some constant (engine scheduling, this machine's load),
        so a region is compared with the least-surprising *other* region; a region this
        router has no recent samples from counts as "as predicted" (0 ms). A region that
        carries all the traffic is thus judged against the prediction itself, not against
        itself, and misses below `PENALTY_FLOOR_MS` are treated as noise.
        """
        if region not in self._excess_ms:
            return 0.0
        self._refresh_if_due(now_s)
        penalty = self._penalties.get(region, 0.0)
        if self._probes:  # (the usual case: no region is being probed)
            return self._held(region, penalty, now_s)
        return penalty

    def _held(self, region: str, penalty: float, now_s: float) -> float:
        """`penalty`, or the region's learnt peak while a probe of it is out (see
        `dispatched`)."""
        probe = self._probes.get(region)
        if probe is None:
            return penalty
        if _out(probe, now_s):
            return max(penalty, self._peaks.get(region, penalty))
        del self._probes[region]
        return penalty

    def dispatched(self, attempt: Attempt) -> None:
        """`attempt` was sent. A stream to a region whose penalty has decayed below what
        its workers were last found at (by more than PENALTY_FLOOR_MS: traffic left it)
        is that region's probe, unless one is out: the region is scored as last found
        until the probe is learnt from (it finishes) or PROBE_HOLD_S has passed. So one
        stream at a time finds out whether a region that traffic left is still slow,
        not every request its decayed penalty sends back. The region is never ruled
        out, only scored as it was last found."""
        region = attempt.region
        if not attempt.streamed or region not in self._excess_ms:
            return  # (the usual case: a region with nothing learnt, or a whole answer)
        now_s = attempt.started_s
        self._refresh_if_due(now_s)
        if region not in self._peaks:
            return
        probe = self._probes.get(region)
        if probe is not None and _out(probe, now_s):
            return  # one is out already (this one went there all the same)
        self._probes[region] = attempt
        attempt.probe = True

    def _refresh_if_due(self, now_s: float) -> None:
        """Recompute if PENALTY_REFRESH_S has passed, or a sample came and the least gap
        between recomputations for new samples has (see REFRESH_S_PER_WORKER)."""
        since_s = now_s - self._penalties_at_s
        if since_s > PENALTY_REFRESH_S or since_s < 0 or (self._dirty and since_s >= self._gap_s):
            self._refresh(now_s)

    def all(self, now_s: float) -> dict[str, float]:
        """Every region's `penalty_ms` now, for operators (/metrics, /admin/status): why
        this router may prefer a farther region than heartbeats and RTTs alone say."""
        if not self._excess_ms:
            return {}
        self._refresh(now_s)
        return {region: self._held(region, penalty, now_s)
                for region, penalty in self._penalties.items()}

    def _refresh(self, now_s: float) -> None:
        half_life_s = self._half_life_s
        forget_before_s = now_s - FORGET_HALF_LIVES * half_life_s
        counts = self._workers_in()
        current: dict[str, float] = {}
        found: dict[str, float] = {}  # the same, each worker as last found (undecayed)
        overdue = self._overdue_ms
        for region, workers in list(self._excess_ms.items()):
            for worker, (_, at_s) in list(workers.items()):
                if at_s < forget_before_s:
                    del workers[worker]
                    self._steps.pop(worker, None)
                    self._bounded.discard(worker)
            late = overdue.get(region, _NO_OVERRUNS)
            sampled = len(workers) + sum(1 for worker in late if worker not in workers)
            needed = min(WORKERS_FOR_EVIDENCE, max(1, counts.get(region, sampled)))
            if sampled >= needed:
                by_worker = {worker: ewma * 0.5 ** ((now_s - at_s) / half_life_s)
                             for worker, (ewma, at_s) in workers.items()}
                for worker, overrun_ms in late.items():
                    by_worker[worker] = max(by_worker.get(worker, overrun_ms), overrun_ms)
                current[region] = min(by_worker.values())
                # (an overrun raises its worker's finding too; the least stays a bound)
                found[region] = max(current[region], min(
                    (ewma for ewma, _ in workers.values()), default=0.0))
            elif not workers and not late:
                del self._excess_ms[region]
        learnt = [min(ewma for ewma, _ in workers.values())
                  for region, workers in self._excess_ms.items() if workers]
        self._usual_ms = max(0.0, min(learnt, default=0.0))
        penalties: dict[str, float] = {region: 0.0 for region in self._excess_ms}
        peaks: dict[str, float] = {}
        for region, excess in current.items():
            others = [value for other, value in current.items() if other != region]
            baseline = max(0.0, min(others) if others else 0.0)
            penalties[region] = max(0.0, excess - baseline - PENALTY_FLOOR_MS)
            # What a probe holds the region at: its penalty as its workers were last
            # found, before their decay (see `dispatched`); only once that decay is
            # more than noise (a region in use is found again at every answer).
            peak = found[region] - baseline - PENALTY_FLOOR_MS
            noise = (BOUNDED_NOISE_MS if self._bounded and not self._bounded.isdisjoint(
                self._excess_ms[region]) else PENALTY_FLOOR_MS)
            if peak > penalties[region] + noise:
                peaks[region] = peak
        self._penalties, self._peaks = penalties, peaks
        if self._probes:
            for region in [region for region in self._probes if region not in peaks]:
                del self._probes[region]  # not decaying any more
        self._penalties_at_s = now_s
        self._dirty = False
        sampled = sum(len(workers) for workers in self._excess_ms.values())
        self._gap_s = sampled * REFRESH_S_PER_WORKER if sampled > 100 else 0.0

    def learn(self, attempt: Attempt, now_s: float, *, router_delay_s: float = 0.0,
              engine_ttft_ms: float | None = None, ttfb_s: float | None = None,
              lower_bound: bool = False) -> None:
        """Take in how far `attempt`'s first byte missed what its path and its engine
        explain. `router_delay_s`: how long this router's event loop could not run while
        the attempt waited (taken off; more than half the wait, and nothing is learnt);
        `engine_ttft_ms`: the worker's own recent mean TTFT, from its heartbeat (None:
        not reported); `ttfb_s`: the wait to learn, if not the attempt's first byte;
        `lower_bound`: it is only known to be at least that (a hedged copy outrun), so it
        can raise what is learnt, never lower it."""
        if ttfb_s is None:
            ttfb_s = attempt.ttfb_s
        if ttfb_s is None or not attempt.streamed:
            return  # a non-streaming answer's first byte is its last: not a TTFT
        if router_delay_s > 0.5 * ttfb_s:
            self.skipped_lagged += 1
            return
        # (Faster than predicted by more than a step counts as a step faster: it bounds
        # how far below its predictions a worker's mean can be pulled, by an absurd
        # heartbeat TTFT for one. While such a heartbeat lasts, that worker still holds
        # its region's penalty at 0: a region's excess is the least of its workers'.)
        excess = max(-JUMP_MS, (ttfb_s - router_delay_s) * 1000.0
                     - _expected_ms(attempt, engine_ttft_ms))
        workers = self._excess_ms.setdefault(attempt.region, {})
        worker_id = attempt.worker_id
        if lower_bound and excess <= 0.0:
            return
        if self._probes.get(attempt.region) is attempt:
            self._probed(attempt.region, workers, excess, now_s, lower_bound)
        previous = workers.get(worker_id)
        if previous is None:
            ewma = excess
        else:
            mean = previous[0] * 0.5 ** ((now_s - previous[1]) / self._half_life_s)
            if lower_bound and excess <= mean:
                # (Against the mean as it has decayed by now: against the mean as last
                # stored, a region's decayed penalty could never be restored by copies.)
                return
            ewma = 0.8 * mean + 0.2 * excess
            # A step is judged against the mean from before it began (the first sample
            # of it is averaged in meanwhile).
            count, total, before = self._steps.get(worker_id, (0, 0.0, mean))
            # A lower bound (a copy outran it) beyond the mean by a jump is a step up
            # too: its path was at least that slow (not believing it let a slow region
            # keep its traffic ~2 s longer while copies answered for it).
            if abs(excess - before) > JUMP_MS and (not lower_bound or excess > before):
                step = 1 if excess > before else -1
                count, total = (count + step, total + excess) if count * step > 0 else (
                    step, excess)
                if count * step >= JUMP_SAMPLES:
                    ewma = total / (count * step)  # a step, seen twice: believed
                    self._steps.pop(worker_id, None)
                else:
                    self._steps[worker_id] = (count, total, before if count * step > 1
                                              else mean)
            elif count:
                self._steps.pop(worker_id, None)
        workers[worker_id] = (ewma, now_s)
        if lower_bound:
            self._bounded.add(worker_id)
        elif self._bounded:
            self._bounded.discard(worker_id)
        self._dirty = True  # recompute at the next question (see PENALTY_REFRESH_S)

    def _probed(self, region: str, workers: dict[str, tuple[float, float]], excess: float,
                now_s: float, lower_bound: bool) -> None:
        """The region's probe (see `dispatched`) answered with `excess` (ms): what it
        says holds for the region, as a breaker's half-open probe does for a worker.
        Nearer what the region's workers were last found at than what that has decayed
        to, the region is still as found: their findings count from now (its penalty is
        back, and decays again). At or below the decayed value (only a whole answer can
        say that, not a copy's lower bound), the region has healed: its workers' means
        start from it (traffic comes back at once, not after a wave of samples)."""
        del self._probes[region]
        if not workers:
            return
        half_life_s = self._half_life_s
        found = min(ewma for ewma, _ in workers.values())
        by_worker = {worker: ewma * 0.5 ** ((now_s - at_s) / half_life_s)
                     for worker, (ewma, at_s) in workers.items()}
        decayed = min(by_worker.values())
        if excess >= (found + decayed) / 2:
            # (A whole answer slower than found: the region is that slow, found from
            # copies' lower bounds before. A lower bound only says "as found" at least.)
            again = found if lower_bound else max(found, excess)
            for worker, (ewma, _) in list(workers.items()):
                workers[worker] = (max(ewma, again), now_s)
                self._steps.pop(worker, None)
        elif excess <= decayed and not lower_bound:
            healed = max(0.0, excess)
            for worker, mean in by_worker.items():
                workers[worker] = (min(mean, healed), now_s)
                self._steps.pop(worker, None)

    def usual_ms(self, now_s: float) -> float:
        """How much every region's first bytes miss their predictions lately (ms, >= 0):
        the least region's learnt excess, a miss the whole fleet shares (predictions
        low for this machine, engines slowed by a busy host), which is nobody's path."""
        if self._excess_ms:
            self._refresh_if_due(now_s)  # (an overdue round recomputes at once: `overdue`)
        return self._usual_ms

    @property
    def overdue_pending(self) -> bool:
        """Whether some worker's overrun counts now (see `overdue`)."""
        return bool(self._overdue_ms)

    def overdue(self, waiting: list[tuple[Attempt, float, float | None]], now_s: float
                ) -> dict[str, dict[str, float]]:
        """This round's streams still waiting for their first byte, each as (attempt, how
        long it has waited less this router's own pauses (s), its worker's own recent mean
        TTFT from its heartbeat (ms, None: not reported)): a worker's excess is at least
        the median of their overruns until the next round. An empty list ends every
        overrun. Returns the overruns beyond the noise floor: region -> worker -> ms."""
        by_worker: dict[tuple[str, str], list[float]] = {}
        for attempt, waited_s, engine_ttft_ms in waiting:
            overrun_ms = waited_s * 1000.0 - _expected_ms(attempt, engine_ttft_ms)
            by_worker.setdefault((attempt.region, attempt.worker_id), []).append(overrun_ms)
        overdue: dict[str, dict[str, float]] = {}
        for (region, worker_id), overruns in by_worker.items():
            # The median of its waiting streams' overruns: the oldest of many streams is
            # always the latest, and a busy worker must not look slow for having many.
            overruns.sort()
            overrun_ms = overruns[(len(overruns) - 1) // 2]
            if overrun_ms > PENALTY_FLOOR_MS:
                overdue.setdefault(region, {})[worker_id] = overrun_ms
        if overdue or self._overdue_ms:
            for region in overdue:
                self._excess_ms.setdefault(region, {})
            self._overdue_ms = overdue
            self._dirty = True
            self._gap_s = 0.0  # an overrun counts at the next question
        return overdue


def _out(probe: Attempt, now_s: float) -> bool:
    """Whether a region's probe still holds it: not finished, and sent less than
    PROBE_HOLD_S ago."""
    return probe.finished_s is None and now_s - probe.started_s < PROBE_HOLD_S


def handshake_s(attempt: Attempt) -> float:
    """What of `attempt`'s wait opening a new connection excuses (s): the time it took
    (so far, while it is still connecting), up to the two round trips TCP and TLS take
    on its predicted RTT. A handshake is a one-off wait, not the path's usual delay (a
    region that had just taken over traffic looked ~80 ms slower than predicted for its
    first seconds); one that takes longer than that is the path's slowness too."""
    if not attempt.connecting and not attempt.connect_s:
        return 0.0
    parts = attempt.prediction
    allowed_s = 2.0 * (parts.rtt_ms if parts is not None else 0.0) / 1000.0
    return allowed_s if attempt.connecting else min(attempt.connect_s, allowed_s)


def _expected_ms(attempt: Attempt, engine_ttft_ms: float | None) -> float:
    """What `attempt`'s path and engine explain of its wait for a first byte (ms): its
    predicted RTT, and the larger of its predicted engine time and what its worker's own
    heartbeat says its requests waited lately (an engine busier than predicted is the
    engine's, and its queue terms already price it)."""
    parts = attempt.prediction
    if parts is None:
        return attempt.predicted_ttft_ms
    # The penalty itself is not expected: it is what is being learnt (expecting it
    # would make a working penalty look unneeded, and decay).
    engine_ms = parts.queue_ms + parts.prefill_ms + parts.first_step_ms
    if engine_ttft_ms is not None and engine_ttft_ms > engine_ms:
        engine_ms = engine_ttft_ms
    return parts.rtt_ms + engine_ms
