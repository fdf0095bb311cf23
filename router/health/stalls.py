"""Stall detection: a worker that answers nobody while the others answer.

`StallWatch` keeps the attempts waiting for their first byte (a non-streaming answer's
first byte is its whole body) and finds the workers that have stopped answering them
(`find`); router.health.tracker.Health ejects those and abandons their attempts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from router.core.outcome import Attempt
from router.registry.worker_view import WorkerView

# A heartbeat should count a request once the engine has had `stall_after_s` to take it
# in (less any time this router was not running): a heartbeat received sooner may have
# been probed before the request arrived, or while the engine's API server, starved of
# CPU, had it but had not yet handed it to the scheduler, whose figures /metrics shows
# (real vLLM on a busy 2-core host: seconds). The evidence waits that long after the
# request, and at least this long (s).
HEARTBEAT_SLACK_S = 0.5
# Kept attempts on a stalled worker asked, at most, each check whether their requests
# could go elsewhere now (StallWatch.release): each ask is a routing decision.
ASKS_PER_CHECK = 32
# A stream under way on an engine its agent says is stuck is cut once nothing has come
# for this long: the report already stands for seconds without a step, and an engine
# that has since come back (its next heartbeat not here yet) sends chunks within a step.
STUCK_SILENCE_S = 1.0


@dataclass(frozen=True, slots=True)
class Stall:
    """A worker found stalled: the attempts waiting on it, and why (for the event)."""

    worker_id: str
    region: str  # of the attempt that shows it
    detail: str
    attempts: list[Attempt]


class StallWatch:
    """The attempts waiting for their first byte, what this router saw of its workers'
    first bytes, and how long it was not running meanwhile: `find` judges by them."""

    def __init__(self, *, stall_after_s: float, stall_factor: float,
                 views: Callable[[], Mapping[str, WorkerView]]) -> None:
        self._stall_after_s = stall_after_s
        self._stall_factor = stall_factor
        self._views = views  # the current snapshot's workers, for their own reports
        self._awaiting: dict[int, Attempt] = {}  # attempts before their first byte
        # Streams past their first byte, once `find` has seen it (see `cut_stuck_streams`).
        self._under_way: dict[int, Attempt] = {}
        # Answers on their way (Attempt.answering): the read count last seen, and when.
        self._silence: dict[int, tuple[int, float]] = {}
        self._paused_s: dict[int, float] = {}  # waiting time the router was not running
        self._last_first_byte_s: dict[str, float] = {}
        self._last_any_first_byte_s = -1e18

    @property
    def waiting(self) -> bool:
        """Whether any attempt waits for its first byte."""
        return bool(self._awaiting)

    @property
    def under_way(self) -> bool:
        """Whether any stream is under way past its first byte (see `cut_stuck_streams`)."""
        return bool(self._under_way)

    def dispatched(self, attempt: Attempt) -> None:
        """`attempt` waits for its first byte from now (see `find`)."""
        self._awaiting[id(attempt)] = attempt

    def finished(self, attempt: Attempt) -> None:
        if self._awaiting.pop(id(attempt), None) is not None:
            self._saw_first_byte(attempt)
        elif self._under_way:
            self._under_way.pop(id(attempt), None)

    def paused(self, paused_s: float) -> None:
        """This process was not running for `paused_s` (its host stalled): the attempts
        waiting now did not wait meanwhile, since nobody could answer them."""
        paused = self._paused_s
        self._paused_s = {key: paused.get(key, 0.0) + paused_s for key in self._awaiting}

    def waiting_streams(self, now_s: float) -> list[tuple[Attempt, float]]:
        """The streamed attempts still waiting for their first byte, each with how long it
        has waited less the time this process was not running (s)."""
        return [(attempt, self._waited_s(attempt, now_s)) for attempt in self._awaiting.values()
                if attempt.streamed and attempt.first_byte_s is None]

    def find(self, now_s: float) -> list[Stall]:
        """The workers that have stopped answering, with the attempts waiting on them.

        A worker is stalled when an attempt there has waited `stall_after_s` (streams:
        also `stall_factor` x their predicted TTFT), the worker has answered nothing since
        that attempt was sent, and there is evidence that the fault is the worker's:
        - for a stream, other workers delivered first bytes meanwhile;
        - for any attempt that has received nothing for `stall_after_s` (a long
          generation is not silence: its engine counts it), the worker's own heartbeat,
          received `stall_after_s` after those requests were sent (see
          HEARTBEAT_SLACK_S), counts fewer sequences than this router has waiting there
          (they never reached its engine: a hung API server, a partition of the data
          path), or the worker has left the fleet view (its
          heartbeats stopped; the view drops a worker only while Redis answers, so an
          outage of Redis is not taken for one), or its heartbeat says that its engine
          has run no step for a while with requests in it (`engine.stuck_for_s`: a wedged
          accelerator, whose engine counts what it holds; this takes every attempt there
          that has received nothing for `stall_after_s`, answered before or not). A
          non-streaming answer whose head came `stall_after_s` ago and whose body has
          not ended counts as silent too (an engine writes a whole answer at once: a
          body that never ends).
        """
        # Only attempts sent `stall_after_s` ago or earlier can show a stall (every rule
        # needs that long a wait): the usual check, with every request young, stops here.
        sent_before_s = now_s - self._stall_after_s
        waiting: dict[str, list[Attempt]] = {}
        for key, attempt in list(self._awaiting.items()):
            if attempt.first_byte_s is not None:
                del self._awaiting[key]
                self._saw_first_byte(attempt)
                if attempt.streamed:
                    self._under_way[key] = attempt
            elif attempt.started_s <= sent_before_s:
                waiting.setdefault(attempt.worker_id, []).append(attempt)
        if self._silence:
            for key in [key for key in self._silence
                        if key not in self._awaiting and key not in self._under_way]:
                del self._silence[key]
        if not waiting:
            return []
        views = self._views()
        stalls: list[Stall] = []
        for worker_id, old in waiting.items():
            found = self._evidence(worker_id, old, views, now_s)
            if found is None:
                continue
            evidence, oldest = found
            attempts = [a for a in self._awaiting.values() if a.worker_id == worker_id]
            waited_s = self._waited_s(oldest, now_s)
            detail = (f"stalled: no answer for {waited_s:.1f} s ({len(attempts)} "
                      f"waiting) {evidence}")
            stalls.append(Stall(worker_id, oldest.region, detail, attempts))
        return stalls

    def _evidence(self, worker_id: str, attempts: list[Attempt],
                  views: Mapping[str, WorkerView], now_s: float
                  ) -> tuple[str, Attempt] | None:
        """(why, the attempt that shows it) if `worker_id` is stalled (see `find`)."""
        answered_s = self._last_first_byte_s.get(worker_id, -1e18)
        streams = [a for a in attempts if a.streamed and a.started_s > answered_s]
        if streams:
            oldest = min(streams, key=_started)
            limit_s = max(self._stall_after_s,
                          self._stall_factor * oldest.predicted_ttft_ms / 1000)
            if (self._waited_s(oldest, now_s) >= limit_s
                    and self._last_any_first_byte_s > oldest.started_s):
                return "while other workers answer", oldest
        # An unending whole answer counts whatever else the worker answered meanwhile (a
        # worker whose streams start well may still never finish a body).
        silent = [a for a in attempts if self._waited_s(a, now_s) >= self._stall_after_s
                  and (self._unending(a, now_s)
                       or (a.started_s > answered_s
                           and self._silent_s(a, now_s) >= self._stall_after_s))]
        view = views.get(worker_id)
        stuck_for_s = None if view is None else view.heartbeat.engine.stuck_for_s
        if stuck_for_s is not None:
            # Its agent says its engine has run no step for a while, with requests in it
            # (worker.progress): whatever answered there before, nothing moves now.
            quiet = [a for a in attempts if self._waited_s(a, now_s) >= self._stall_after_s
                     and self._silent_s(a, now_s) >= self._stall_after_s]
            if quiet:
                return (f"while its agent reports no engine step for {stuck_for_s:.0f} s "
                        "with requests in it"), min(quiet, key=_started)
        if not silent:
            return None
        oldest = min(silent, key=_started)
        if view is None:
            # Out of the fleet view: its heartbeats stopped or it said it is gone. (An
            # empty view says nothing: the router has not read the fleet yet.)
            return ("after its heartbeats stopped", oldest) if views else None
        counted_by_s = max(HEARTBEAT_SLACK_S, self._stall_after_s)
        sent_before = sum(1 for a in silent
                          if view.received_at_s - a.started_s
                          - self._paused_s.get(id(a), 0.0) >= counted_by_s)
        if sent_before == 0 or view.reported_load >= sent_before:
            return None
        return (f"while its heartbeat counts {view.reported_load} sequences of the "
                f"{sent_before} sent there before it"), oldest

    def cut_stuck_streams(self, now_s: float) -> dict[tuple[str, str], tuple[int, float]]:
        """Cut the streams under way (past their first byte) on workers whose agent says
        the engine holds requests and runs no step (`engine.stuck_for_s`), from which
        nothing has arrived for STUCK_SILENCE_S since: their clients keep what they got, and
        the router continues each elsewhere (mid-stream failover) instead of waiting
        `timeouts.idle_s` (60 s) for a chunk. (worker, region) -> (streams cut, how long
        its engine has been stuck)."""
        if not self._under_way:
            return {}
        views = self._views()
        cut: dict[tuple[str, str], tuple[int, float]] = {}
        for key, attempt in list(self._under_way.items()):
            view = views.get(attempt.worker_id)
            stuck_for_s = None if view is None else view.heartbeat.engine.stuck_for_s
            connection = attempt.answering
            if stuck_for_s is None or connection is None:
                self._silence.pop(key, None)
            elif self._silent_s(attempt, now_s) >= STUCK_SILENCE_S:
                del self._under_way[key]
                connection.close()
                where = (attempt.worker_id, attempt.region)
                cut[where] = (cut.get(where, (0, 0.0))[0] + 1, stuck_for_s)
        return cut

    def release(self, stall: Stall, now_s: float) -> tuple[int, int]:
        """Abandon the attempts of `stall` whose requests could go to another worker now
        (Attempt.elsewhere), or that have waited `stall_factor` x `stall_after_s` (30 s
        by default: given up then even with nowhere else to go); keep the others. Each
        ask is a routing decision: at most ASKS_PER_CHECK a call, from a place that moves
        on with the clock, so that every kept attempt is asked in turn. (kept, abandoned)"""
        reason = f"worker {stall.worker_id} stalled"
        attempts = stall.attempts
        count = len(attempts)
        start = int(now_s * 4) * ASKS_PER_CHECK % count if count > ASKS_PER_CHECK else 0
        hopeless_s = self._stall_factor * self._stall_after_s
        kept = abandoned = 0
        asks = ASKS_PER_CHECK
        for index in range(count):
            attempt = attempts[(start + index) % count]
            elsewhere = attempt.elsewhere
            if elsewhere is not None and self._waited_s(attempt, now_s) < hopeless_s:
                asks -= 1
                if asks < 0 or not elsewhere():
                    kept += 1
                    continue
            if attempt.abandon(reason):
                abandoned += 1
        return kept, abandoned

    def _waited_s(self, attempt: Attempt, now_s: float) -> float:
        """How long `attempt` has waited, less the time this process was not running."""
        return now_s - attempt.started_s - self._paused_s.get(id(attempt), 0.0)

    def _unending(self, attempt: Attempt, now_s: float) -> bool:
        """A non-streaming answer whose head came `stall_after_s` ago and whose body has
        not ended: an engine writes a whole answer at once, when generation is done (a
        body that never ends, or trickles). With the heartbeat evidence (the engine no
        longer counts the request) it is a stall, however the body still moves."""
        head = attempt.answer_head
        return head is not None and now_s - head[1] >= self._stall_after_s

    def _silent_s(self, attempt: Attempt, now_s: float) -> float:
        """How long nothing has arrived for `attempt`: since it was sent, or since its
        answer's body last moved (a non-streaming answer on its way: `answering`)."""
        answering = attempt.answering
        if answering is None:
            return self._waited_s(attempt, now_s)
        key = id(attempt)
        reads = answering.reads
        seen = self._silence.get(key) or attempt.answer_head  # (silent since its head?)
        if seen is None or seen[0] != reads:
            self._silence[key] = (reads, now_s)
            return 0.0
        self._silence[key] = seen
        return now_s - seen[1]

    def prune(self, now_s: float) -> None:
        """Forget first bytes older than every waiting attempt: `find` only compares
        answers with attempts sent before them."""
        oldest_s = min((a.started_s for a in self._awaiting.values()), default=now_s)
        self._last_first_byte_s = {worker: at_s for worker, at_s
                                   in self._last_first_byte_s.items() if at_s >= oldest_s}

    def _saw_first_byte(self, attempt: Attempt) -> None:
        self._paused_s.pop(id(attempt), None)
        first_byte_s = attempt.first_byte_s
        if first_byte_s is None:
            return
        if first_byte_s > self._last_first_byte_s.get(attempt.worker_id, -1e18):
            self._last_first_byte_s[attempt.worker_id] = first_byte_s
        self._last_any_first_byte_s = max(self._last_any_first_byte_s, first_byte_s)


def _started(attempt: Attempt) -> float:
    return attempt.started_s
