"""What limits a policy on a scenario: the virtual-time twin with one source of error
removed at a time (no test bed, ~1 s of CPU per line).

    python -m lab.bench.diagnose [--scenario skewed-3region] [--quick] [--seed N]

Lines: predicted_ttft as deployed (a router replica per region, heartbeats every interval
with the agent's measured performance, replicas exchanging their open requests, requests
waiting at the router while every worker is busy); without that queue; without that
exchange; with one router replica for every origin (no
dispatches by other replicas go unseen); with the engines' true prefill rate in the
heartbeats; both; heartbeats every 0.1 s; least_load and power_of_two likewise with one
replica; and the oracle (exact engine state at every decision).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from lab.bench import stats
from lab.bench.scenario import Scenario, load_scenario
from lab.bench.trace import Trace
from lab.bench.twin import ORACLE, Twin
from lab.bench.workload import generate

VARIANTS: tuple[tuple[str, str, dict[str, Any], float | None], ...] = (
    ("predicted_ttft", "as deployed: 3 replicas, measured performance", {}, None),
    ("predicted_ttft", "no queue at the router", {"queue": False}, None),
    ("predicted_ttft", "replicas do not exchange open requests", {"peer_interval_s": None}, None),
    ("predicted_ttft", "one router replica", {"one_router": True}, None),
    ("predicted_ttft", "true prefill rate in heartbeats", {"true_prefill_rate": True}, None),
    ("predicted_ttft", "one replica + true prefill rate",
     {"one_router": True, "true_prefill_rate": True}, None),
    ("predicted_ttft", "heartbeats every 0.1 s", {}, 0.1),
    ("least_load", "as deployed", {}, None),
    ("least_load", "one router replica", {"one_router": True}, None),
    ("power_of_two", "as deployed", {}, None),
    ("power_of_two", "one router replica", {"one_router": True}, None),
    (ORACLE, "exact engine state at every decision", {}, None),
)


def diagnose(scenario: Scenario, trace: Trace, seed: int = 0) -> list[dict[str, Any]]:
    regions = list(scenario.regions)
    rows = []
    for policy, label, options, interval_s in VARIANTS:
        shaped = (scenario if interval_s is None
                  else scenario.model_copy(update={"heartbeat_interval_s": interval_s}))
        result = Twin(shaped, trace, policy, seed=seed, **options).run()
        summary = stats.summarize(result.outcomes, slo_ms=scenario.interactive_ttft_slo_ms,
                                  duration_s=trace.duration_s, regions=regions)
        rows.append({"policy": policy, "variant": label,
                     "ttft_ms": summary["interactive"]["ttft_ms"],
                     "slo_attainment": summary["slo_attainment"],
                     "prefix_hit_rate": result.prefix_hit_rate})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.bench.diagnose",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="skewed-3region")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=None, help="trace seed")
    parser.add_argument("--router-seed", type=int, default=0, help="routers' random source")
    args = parser.parse_args(argv)
    base = load_scenario(args.scenario)
    scenario = base.quick_variant() if args.quick else base
    trace = generate(base, seed=args.seed, quick=args.quick)
    print(f"| policy | variant | interactive TTFT p50 / p90 / p99 (ms) | SLO "
          f"{scenario.interactive_ttft_slo_ms:g} ms | prefix hits |")
    print("|---|---|---|---:|---:|")
    for row in diagnose(scenario, trace, args.router_seed):
        ttft = row["ttft_ms"]
        hits = row["prefix_hit_rate"]
        print(f"| `{row['policy']}` | {row['variant']} | {ttft['p50']:.0f} / {ttft['p90']:.0f} / "
              f"{ttft['p99']:.0f} | {100 * row['slo_attainment']:.1f} % | "
              f"{'-' if hits is None else f'{100 * hits:.1f} %'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
