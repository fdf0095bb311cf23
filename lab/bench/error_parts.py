"""Where predicted_ttft's prediction error comes from: the twin's decisions taken apart.

    python -m lab.bench.error_parts [--scenario skewed-3region] [--seed N] [--quick]

Each interactive request's prediction, by its parts (router.core.outcome.Prediction), is
set beside what its engine did (how long the request waited there before the step that
prefilled it began, and how long that step took) and the engine's state when the request
was routed (the requests ahead of it for a batch slot, and the tokens each running
sequence had left). The error is then computed again with one part replaced by what the
engine knew: how far a better estimate of that part alone could take the prediction.
Lines (|measured - predicted| / measured, p50 and p90, as `stats.prediction_error`):

- as predicted;
- the requests ahead as the engine had them (those running, waiting and on their way),
  each priced as predicted (`Prediction.queue_ms` per request ahead);
- that count, and the wait for a slot read off the running sequences' tokens left;
- that, and half an engine step for the step under way when the engine was busy;
- the engine's wait exact, step under way included: what no heartbeat can know, the
  phase of the engine step a request arrives in, is in it;
- the engine's wait and the prefill step exact, and half of a step for the step under
  way: the best a router that knows everything but that phase could do.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lab.bench import stats
from lab.bench.scenario import load_scenario
from lab.bench.trace import TraceRequest
from lab.bench.twin import Twin
from lab.bench.twin_parts import TwinWorker
from lab.bench.workload import generate
from lab.sim.sequence import Sequence as EngineSequence
from router.core.outcome import Prediction
from router.core.parse import ParsedRequest
from router.policy import Decision
from router.policy.predicted_ttft import queue_price_ms


@dataclass
class Taken:
    """One routed request: its prediction and what the engine had and did."""

    prediction: Prediction
    predicted_ms: float
    true_count: int  # ... as the engine had them (running, waiting, on their way)
    tokens_left: list[int]  # each running sequence's, fewest first
    price_ms: float  # what each request ahead costs, as predicted_ttft prices it
    measured_ms: float = 0.0
    rtt_ms: float = 0.0
    wait_ms: float = 0.0  # arrival at the engine -> the start of the step that prefilled it
    step_ms: float = 0.0  # that step


class PartsTwin(Twin):
    """The twin, keeping each decision's parts and each request's engine timings."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.taken: dict[int, Taken] = {}
        self._decision: Decision | None = None

    def _worker(self, decision: Decision) -> TwinWorker:
        self._decision = decision
        return super()._worker(decision)

    def _dispatch(self, request: TraceRequest, body: bytes, parsed: ParsedRequest,
                  worker: TwinWorker, reason: str, predicted_ms: float,
                  cached_tokens: int = 0) -> None:
        decision, self._decision = self._decision, None
        if decision is not None and decision.prediction is not None:
            _, inflight, views = self._routers[request.origin]
            view = views[worker.name]
            engine = worker.engine
            ahead = engine.num_running + engine.num_waiting + worker.in_transit
            self.taken[request.index] = Taken(
                prediction=decision.prediction, predicted_ms=predicted_ms,
                true_count=max(0, ahead + 1 - worker.slots),
                tokens_left=sorted(seq.max_tokens - len(seq.output)
                                   for seq in engine.running_sequences()),
                price_ms=queue_price_ms(view, inflight, self.clock.now_s))
        super()._dispatch(request, body, parsed, worker, reason, predicted_ms, cached_tokens)

    def _finished(self, seq: EngineSequence) -> None:
        request, worker, _ = self._pending[seq.request_id]
        taken = self.taken.get(request.index)
        if (taken is not None and seq.scheduled_s is not None
                and seq.first_token_s is not None):
            taken.rtt_ms = self.scenario.rtt_ms(request.origin, worker.region)
            taken.wait_ms = 1000.0 * (seq.scheduled_s - seq.arrival_s)
            taken.step_ms = 1000.0 * (seq.first_token_s - seq.scheduled_s)
        super()._finished(seq)


def _slot_wait_ms(taken: Taken, count: int) -> float:
    """The wait for `count` slots to free, read off the running sequences' tokens left."""
    left = taken.tokens_left
    if count <= 0 or not left:
        return 0.0
    return left[min(count, len(left)) - 1] * taken.prediction.first_step_ms


ESTIMATES: tuple[tuple[str, Callable[[Taken], float]], ...] = (
    ("as predicted", lambda t: t.predicted_ms),
    ("requests ahead as the engine had them, priced as predicted",
     lambda t: t.predicted_ms - t.prediction.queue_ms
     + t.true_count * t.price_ms),
    ("... and the wait for a slot from the running sequences' tokens left",
     lambda t: t.predicted_ms - t.prediction.queue_ms + _slot_wait_ms(t, t.true_count)),
    ("... and half a step for the step under way (engine busy when routed)",
     lambda t: t.predicted_ms - t.prediction.queue_ms + _slot_wait_ms(t, t.true_count)
     + (0.5 * t.prediction.first_step_ms if t.tokens_left else 0.0)),
    ("the engine's wait exact (the step under way included)",
     lambda t: t.predicted_ms - t.prediction.queue_ms + t.wait_ms),
    ("wait and prefill step exact, half a step for the step under way",
     lambda t: t.rtt_ms + t.step_ms + max(0.0, t.wait_ms - t.prediction.first_step_ms)
     + 0.5 * min(t.wait_ms, t.prediction.first_step_ms)),
)


def error_parts(twin: PartsTwin) -> list[dict[str, Any]]:
    """Run `twin` and return one row per ESTIMATES line: its label and the error's p50
    and p90 over the successful interactive requests that had a prediction."""
    result = twin.run()
    taken: list[Taken] = []
    for outcome in result.outcomes:
        measured = outcome.predicted_span_ms
        entry = twin.taken.get(outcome.index)
        if (outcome.ok and outcome.traffic_class == "interactive" and measured
                and entry is not None and entry.predicted_ms > 0.0):
            entry.measured_ms = measured
            taken.append(entry)
    rows = []
    for label, estimate in ESTIMATES:
        errors = [abs(t.measured_ms - estimate(t)) / t.measured_ms for t in taken]
        rows.append({"estimate": label, "p50_abs": stats.percentile(errors, 50),
                     "p90_abs": stats.percentile(errors, 90), "count": len(errors)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.bench.error_parts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="skewed-3region")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=None, help="trace seed")
    args = parser.parse_args(argv)
    base = load_scenario(args.scenario)
    scenario = base.quick_variant() if args.quick else base
    trace = generate(base, seed=args.seed, quick=args.quick)
    rows = error_parts(PartsTwin(scenario, trace, "predicted_ttft"))
    print(f"predicted_ttft on the twin, {args.scenario}: |error| over {rows[0]['count']} "
          "interactive requests")
    print("| estimate | p50 | p90 |\n|---|---:|---:|")
    for row in rows:
        print(f"| {row['estimate']} | {100 * row['p50_abs']:.1f} % | "
              f"{100 * row['p90_abs']:.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
