"""Whether an engine that holds requests still runs steps: a wedged GPU, found from /metrics.

An engine whose accelerator hangs (a kernel that never returns, a collective waiting for
a peer that died) keeps its API server: /health answers 200 (vLLM's checks whether the
engine core has died, not whether it moves) and /metrics answers with the counts of its
last step, frozen. The requests it holds wait for ever, and since it counts them as
running, neither its load nor a router's stall rule (a long generation is counted too)
tells them from work in progress.

What does tell: vLLM observes `vllm:iteration_tokens_total` once per engine step, so its
`_count` moves while the engine steps and only then. An engine that holds requests
(running or waiting, as its last step reported) and whose step count has not moved for
`stuck_after_s` is stuck. An idle engine runs no steps and is never stuck; an engine that
restarts starts its counts again, which is movement too. An engine without that histogram
is judged by its prompt and generation token counters instead (coarser: a long prefill
moves neither until it ends). Several engines behind one server (data parallel: vLLM labels
each one's series with its `engine` index) are judged each by its own counts: one of them
stuck while another steps is stuck, though their sums still move (the server sends part of
its requests to the stuck one). A body that does not tell its engines apart is judged by
its sums.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.engine_metrics import (
    GENERATION_TOKENS_COUNTER,
    PROMPT_TOKENS_COUNTER,
    RUNNING,
    STEP_COUNT,
    WAITING,
    MetricsSample,
)
from worker.schema import MAX_STUCK_S

# How long an engine may hold requests without a step before it is stuck, by default
# (--stuck-after-s; regions.yaml's heartbeat.stuck_after_s).
STUCK_AFTER_S = 15.0
# Without it: tokens prefilled or generated (each moves only at some steps' ends).
TOKEN_COUNTERS = (PROMPT_TOKENS_COUNTER, GENERATION_TOKENS_COUNTER)


__all__ = ["STEP_COUNT", "STUCK_AFTER_S", "ProgressWatch", "steps_of"]


def steps_of(sample: MetricsSample) -> float | None:
    """A count that moves whenever the engine makes progress; None if it exposes none."""
    return _steps(sample.totals)


def _steps(totals: Mapping[str, float]) -> float | None:
    steps = totals.get(STEP_COUNT)
    if steps is not None:
        return steps
    if all(name in totals for name in TOKEN_COUNTERS):
        return sum(totals[name] for name in TOKEN_COUNTERS)
    return None


class ProgressWatch:
    """Fed every /metrics sample (`observe`); says for how long an engine holding requests
    has run no step, once that is `stuck_after_s` or more.

    The time is the sum of the gaps between samples, each counted up to `max_gap_s`: a
    host that stalls every process at once (a VM not scheduled, seen here for 13 s) stops
    the engine and this agent alike, and the first sample after it must not take the
    whole stall for the engine's.
    """

    def __init__(self, stuck_after_s: float, max_gap_s: float = 2.0) -> None:
        self.stuck_after_s = stuck_after_s
        self.max_gap_s = max_gap_s
        self._last_s: float | None = None
        # Per engine (the module doc; "" for a body judged by its sums): its step count
        # at the last sample, and how long it has held requests without a step since, as
        # far as the samples show.
        self._engines: dict[str, tuple[float | None, float]] = {}
        # The engines found stuck by the last sample ("" for a body judged by its sums).
        self.stuck_engines: tuple[str, ...] = ()

    def observe(self, sample: MetricsSample, now_s: float) -> float | None:
        """Seconds an engine has held requests without a step, if `stuck_after_s` or more
        (at most MAX_STUCK_S; the longest of several engines); None while each steps, is
        idle, or exposes no count."""
        gap_s = 0.0 if self._last_s is None else min(max(0.0, now_s - self._last_s),
                                                    self.max_gap_s)
        self._last_s = now_s
        engines = sample.engines or {"": sample.totals}
        seen: dict[str, tuple[float | None, float]] = {}
        longest_s = 0.0
        for engine, totals in engines.items():
            steps = _steps(totals)
            last = self._engines.get(engine)
            if (steps is None or last is None or steps != last[0]
                    or totals.get(RUNNING, 0.0) + totals.get(WAITING, 0.0) <= 0):
                still_s = 0.0  # it stepped, holds nothing, or is new (a restart: movement)
            else:
                still_s = last[1] + gap_s
            seen[engine] = (steps, still_s)
            longest_s = max(longest_s, still_s)
        self._engines = seen  # (engines gone from the body are forgotten)
        self.stuck_engines = tuple(engine for engine, (_, still_s) in seen.items()
                                   if still_s >= self.stuck_after_s)
        return min(longest_s, MAX_STUCK_S) if longest_s >= self.stuck_after_s else None
