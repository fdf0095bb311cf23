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
moves neither until it ends). Several engines behind one server (data parallel) sum their
counts, so one of them stuck while another steps is not seen.
"""

from __future__ import annotations

from worker.engine_metrics import GENERATION_TOKENS_COUNTER, PROMPT_TOKENS_COUNTER, MetricsSample
from worker.schema import MAX_STUCK_S

# How long an engine may hold requests without a step before it is stuck, by default
# (--stuck-after-s; regions.yaml's heartbeat.stuck_after_s).
STUCK_AFTER_S = 15.0
# Observed once per engine step (vLLM 0.6 and later).
STEP_COUNT = "vllm:iteration_tokens_total_count"
# Without it: tokens prefilled or generated (each moves only at some steps' ends).
TOKEN_COUNTERS = (PROMPT_TOKENS_COUNTER, GENERATION_TOKENS_COUNTER)


def steps_of(sample: MetricsSample) -> float | None:
    """A count that moves whenever the engine makes progress; None if it exposes none."""
    totals = sample.totals
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
        self._steps: float | None = None
        self._last_s: float | None = None
        self._still_s = 0.0  # held without a step, as far as the samples show

    def observe(self, sample: MetricsSample, now_s: float) -> float | None:
        """Seconds the engine has held requests without a step, if `stuck_after_s` or more
        (at most MAX_STUCK_S); None while it steps, is idle, or exposes no count."""
        steps = steps_of(sample)
        gap_s = 0.0 if self._last_s is None else max(0.0, now_s - self._last_s)
        self._last_s = now_s
        if steps is None or steps != self._steps or sample.in_flight == 0:
            self._steps = steps
            self._still_s = 0.0
            return None
        self._still_s += min(gap_s, self.max_gap_s)
        still_s = self._still_s
        return min(still_s, MAX_STUCK_S) if still_s >= self.stuck_after_s else None
