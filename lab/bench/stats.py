"""The numbers of one policy's run, from its outcomes. Pure functions, unit-tested.

Definitions (also written into results.json):
- percentiles are nearest-rank over successful requests;
- `slo_attainment`: interactive requests whose TTFT was within the scenario's target,
  over all interactive requests sent (a failed request missed it);
- `goodput_rps`: requests that succeeded within their class's target (interactive: the
  TTFT SLO; batch: its TTFT budget, if it sent one) per second of the trace;
- `traffic_share`: successful requests by the region that served them;
- oscillation: see `oscillation`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from lab.bench.replay import Outcome

DEFINITIONS = {
    "ttft_ms": "client at its region's router: request handed to the connection -> first "
               "SSE event carrying a token. Includes router->worker->router RTT (emulated), "
               "queueing and prefill; not the client->router hop (same region, loopback)",
    "itl_ms": "per request: (last token - first token) / (tokens - 1); percentiles over "
              "requests",
    "e2e_ms": "request sent -> stream ended",
    "percentiles": "nearest rank, over successful requests",
    "slo_attainment": "interactive requests with TTFT <= the scenario's target / all "
                      "interactive requests sent (failures count as misses)",
    "goodput_rps": "successful requests within their class's target (interactive: TTFT SLO; "
                   "batch: TTFT <= its budget header) per second of the trace",
    "traffic_share": "successful requests by serving region (x-globalpool-region)",
    "prefix_hit_rate": "prompt tokens served from the engines' prefix caches / prompt "
                       "tokens (vllm:prefix_cache_hits_total / queries_total, increase over "
                       "the run, all workers)",
    "oscillation_index": "per origin region and serving region: RMS of z = (share of the "
                         "origin's requests served there in a 1-s bin - that share over the "
                         "centred 5-s window) / binomial standard error, scaled so that "
                         "independent routing (no oscillation) gives 1.0; the policy's value "
                         "is the largest over pairs (pooled_index: over all pairs' z)",
    "swings": "1-s bins where such a share is more than 25 points and 4 standard errors away "
              "from its centred 5-s average (by chance: ~1 in 16,000 bins)",
    "prediction_error": "per policy, over streamed interactive requests that succeeded "
                        "and carried a prediction (x-globalpool-predicted-ttft-ms > 0): "
                        "|measured - predicted| / measured, where measured = the client's "
                        "TTFT minus the router time the prediction does not cover "
                        "(server-timing queue and retry); p50_abs / p90_abs are fractions, "
                        "count the requests with a prediction, of `eligible`. Twin: the "
                        "same from its decisions (decision -> first token at the client)",
    "home_share": "successful requests served in their origin region / successful requests",
    "lag_ms": "load generator: actual send time - scheduled time",
    "cpu_pressure": "Linux PSI: share of the run's wall time in which some runnable task on "
                    "the machine waited for a CPU (other engineers' work included)",
}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100.0 * len(ordered))) - 1]


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    collected = list(values)
    return {f"p{q}": _round(percentile(collected, q)) for q in (50, 90, 99)}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _met(outcome: Outcome, slo_ms: float, budgets: dict[int, float | None]) -> bool:
    ttft = outcome.ttft_ms
    if not outcome.ok or ttft is None:
        return False
    if outcome.traffic_class == "interactive":
        return ttft <= slo_ms
    budget = budgets.get(outcome.index)
    return budget is None or ttft <= budget


def summarize(outcomes: Sequence[Outcome], *, slo_ms: float, duration_s: float,
              regions: Sequence[str], budgets: dict[int, float | None] | None = None
              ) -> dict[str, Any]:
    """Requests, errors, latency percentiles, SLO attainment, goodput and traffic share."""
    budgets = budgets or {}
    ok = [o for o in outcomes if o.ok]
    interactive = [o for o in outcomes if o.traffic_class == "interactive"]
    batch = [o for o in outcomes if o.traffic_class != "interactive"]
    within = [o for o in interactive if _met(o, slo_ms, budgets)]
    served = Counter(o.region for o in ok if o.region)
    failures = Counter(o.failure for o in outcomes if o.failure)
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "errors_by_phase": dict(failures),
        "ttft_ms": distribution(t for o in ok if (t := o.ttft_ms) is not None),
        "itl_ms": distribution(t for o in ok if (t := o.itl_ms) is not None),
        "e2e_ms": distribution(o.e2e_ms for o in ok),
        "interactive": {
            "requests": len(interactive),
            "ttft_ms": distribution(t for o in interactive if o.ok
                                    and (t := o.ttft_ms) is not None),
        },
        "batch": {
            "requests": len(batch),
            "ttft_ms": distribution(t for o in batch if o.ok and (t := o.ttft_ms) is not None),
            "budget_attainment": _round(
                sum(_met(o, slo_ms, budgets) for o in batch) / len(batch), 4) if batch
            else None,
        },
        "slo_attainment": _round(len(within) / len(interactive), 4) if interactive else None,
        "goodput_rps": round(sum(_met(o, slo_ms, budgets) for o in outcomes) / duration_s, 3),
        "traffic_share": {r: _round(served[r] / len(ok), 4) if ok else None for r in regions},
        "routes": dict(Counter(o.route or "-" for o in ok).most_common()),
        "hedged": sum(o.hedged for o in outcomes),
        "home_share": _round(sum(o.region == o.origin for o in ok) / len(ok), 4) if ok
        else None,
        "prediction_error": prediction_error(interactive),
    }


def prediction_error(outcomes: Iterable[Outcome]) -> dict[str, Any]:
    """How far the router's predicted TTFT was from what the client then measured, over
    the successful interactive requests of `outcomes` that carried a prediction:
    |measured - predicted| / measured (a fraction), measured being decision -> first
    token (`Outcome.predicted_span_ms`). `count`: requests with a prediction (None
    percentiles when none had one), `eligible`: successful interactive requests."""
    errors: list[float] = []
    eligible = 0
    for outcome in outcomes:
        measured = outcome.predicted_span_ms
        if not outcome.ok or outcome.traffic_class != "interactive" or measured is None:
            continue
        eligible += 1
        predicted = outcome.predicted_ttft_ms
        if predicted is None or predicted <= 0.0 or measured <= 0.0:
            continue
        errors.append(abs(measured - predicted) / measured)
    return {"p50_abs": _round(percentile(errors, 50), 4),
            "p90_abs": _round(percentile(errors, 90), 4),
            "count": len(errors), "eligible": eligible}


def burst_placement(outcomes: Sequence[Outcome], moments_s: Sequence[float]
                    ) -> dict[str, Any] | None:
    """How the requests sent at each synchronized-burst instant were spread: the most
    of one burst on a single worker (mean over the bursts, and the worst), and their
    TTFT. None without bursts. A herd shows as many on one worker."""
    if not moments_s:
        return None
    bursts: dict[float, list[Outcome]] = {moment: [] for moment in moments_s}
    for outcome in outcomes:
        if outcome.scheduled_s in bursts:
            bursts[outcome.scheduled_s].append(outcome)
    most = [max(Counter(o.worker for o in burst if o.worker).values(), default=0)
            for burst in bursts.values()]
    return {"bursts": len(most), "requests_per_burst": max(map(len, bursts.values())),
            "max_on_one_worker_mean": _round(sum(most) / len(most)),
            "max_on_one_worker": max(most),
            "ttft_ms": distribution(t for burst in bursts.values() for o in burst
                                    if o.ok and (t := o.ttft_ms) is not None)}


def share_bins(outcomes: Sequence[Outcome], regions: Sequence[str], duration_s: float,
               bin_s: float = 1.0) -> list[dict[str, Any]]:
    """Per bin of send time: successful requests, how many each region served, and the
    same per origin region (`by_origin[origin][serving region]`)."""
    count = max(1, math.ceil(duration_s / bin_s))
    by_origin: list[dict[str, dict[str, int]]] = [{} for _ in range(count)]
    for outcome in outcomes:
        region = outcome.region
        if outcome.ok and region is not None and region in regions:
            cell = by_origin[min(count - 1, int(outcome.sent_s / bin_s))]
            cell.setdefault(outcome.origin, dict.fromkeys(regions, 0))[region] += 1
    bins = []
    for i, origins in enumerate(by_origin):
        served = {r: sum(counts[r] for counts in origins.values()) for r in regions}
        bins.append({"t_s": round(i * bin_s, 3), "requests": sum(served.values()),
                     "served": served, "by_origin": origins})
    return bins


def _series_oscillation(series: Sequence[tuple[int, int]], window: int, swing_share: float
                        ) -> tuple[list[float], int, list[float]]:
    """z values, swings and shares of one (served, requests) series (see `oscillation`)."""
    half = window // 2
    shares = [served / total for served, total in series]
    z_values: list[float] = []
    swings = 0
    for i in range(half, len(series) - half):
        around = range(i - half, i + half + 1)
        mean = sum(series[j][0] for j in around) / sum(series[j][1] for j in around)
        if mean <= 0.0 or mean >= 1.0:
            continue
        error = math.sqrt(mean * (1.0 - mean) / series[i][1])
        z = (shares[i] - mean) / error
        z_values.append(z)
        if abs(shares[i] - mean) > swing_share and abs(z) > 4.0:
            swings += 1
    return z_values, swings, shares


def oscillation(bins: Sequence[dict[str, Any]], regions: Sequence[str], *, window: int = 5,
                min_requests: int = 5, swing_share: float = 0.25) -> dict[str, Any]:
    """How much the share of an origin's requests that each region serves moves beyond
    sampling noise, bin to bin.

    Per origin region (so that shifts in the demand mix between origins do not count),
    for every bin with at least `min_requests` of its requests: z = (share served by a
    region - that share over the centred `window` bins) / binomial standard error.
    Independent routing decisions give z of variance ~(1 - 1/window); the index is
    RMS(z) scaled by that, so ~1.0 means "sampling noise only". A herd that moves between
    regions from one heartbeat to the next shows as an index well above 1 and as swings
    (bins more than `swing_share` and 4 standard errors off the average: by chance, one
    in ~16,000 bins). A policy that
    always serves an origin in one region has no index for it (None).
    """
    origins = sorted({o for b in bins for o in b.get("by_origin", {})})
    result: dict[str, dict[str, Any]] = {}
    all_z: list[float] = []
    for origin in origins:
        usable = [b["by_origin"][origin] for b in bins
                  if sum(b.get("by_origin", {}).get(origin, {}).values()) >= min_requests]
        result[origin] = {}
        for region in regions:
            series = [(counts[region], sum(counts.values())) for counts in usable]
            z_values, swings, shares = _series_oscillation(series, window, swing_share)
            all_z += z_values
            mean_share = sum(shares) / len(shares) if shares else 0.0
            stdev = (math.sqrt(sum((s - mean_share) ** 2 for s in shares) / len(shares))
                     if shares else None)
            result[origin][region] = {
                "index": _round(_index(z_values, window), 2), "swings": swings,
                "share_stdev_pp": _round(None if stdev is None else 100 * stdev)}
    indices = [v["index"] for by_region in result.values() for v in by_region.values()
               if v["index"] is not None]
    return {"index": max(indices) if indices else None,
            "pooled_index": _round(_index(all_z, window), 2),
            "swings": sum(v["swings"] for by_region in result.values()
                          for v in by_region.values()),
            "by_origin": result}


def _index(z_values: Sequence[float], window: int) -> float | None:
    if not z_values:
        return None
    return math.sqrt(sum(z * z for z in z_values) / len(z_values) / (1 - 1 / window))


def lag(outcomes: Sequence[Outcome], skipped: int) -> dict[str, Any]:
    lags = [o.lag_ms for o in outcomes]
    return {"p50_ms": _round(percentile(lags, 50), 2), "p99_ms": _round(percentile(lags, 99), 2),
            "max_ms": _round(max(lags) if lags else None, 2), "skipped": skipped}
