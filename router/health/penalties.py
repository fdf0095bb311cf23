"""Region latency penalties: how much slower than predicted each region's first bytes have
been lately, beyond the other regions', learnt from every streamed attempt's TTFT.

One `RegionPenalties` per router, held by router.health.tracker.Health, which feeds it the
attempts that finish and answers the policy's and the operators' questions with it.
"""

from __future__ import annotations

from router.core.outcome import Attempt

# A region's first bytes must miss their predictions by this much more than the other
# regions' before it is penalised (ms): smaller misses are scheduling noise.
PENALTY_FLOOR_MS = 25.0
# Penalties are recomputed at most this often (s), or after a new sample.
PENALTY_REFRESH_S = 0.05


class RegionPenalties:
    """Per region, the mean of (measured - predicted TTFT) in ms, weighted 0.2 for each new
    sample and halving every `half_life_s`; each region's penalty is its mean beyond the
    lowest other region's and PENALTY_FLOOR_MS."""

    def __init__(self, half_life_s: float) -> None:
        self._half_life_s = half_life_s
        self._excess_ms: dict[str, tuple[float, float]] = {}  # region -> (ewma, at_s)
        self._penalties: dict[str, float] = {}  # region -> penalty, as of _penalties_at_s
        self._penalties_at_s = -1e18

    def penalty_ms(self, region: str, now_s: float) -> float:
        """How much slower than predicted this region's first bytes have been lately,
        beyond the other regions' (ms, >= 0).

        Every prediction misses some constant (engine scheduling, this machine's load),
        so a region is compared with the least-surprising *other* region; a region this
        router has no recent samples from counts as "as predicted" (0 ms). A region that
        carries all the traffic is thus judged against the prediction itself, not against
        itself, and misses below `PENALTY_FLOOR_MS` are treated as noise.
        """
        entry = self._excess_ms.get(region)
        if entry is None:
            return 0.0
        if now_s - self._penalties_at_s > PENALTY_REFRESH_S or now_s < self._penalties_at_s:
            self._refresh(now_s)
        return self._penalties.get(region, 0.0)

    def all(self, now_s: float) -> dict[str, float]:
        """Every region's `penalty_ms` now, for operators (/metrics, /admin/status): why
        this router may prefer a farther region than heartbeats and RTTs alone say."""
        if not self._excess_ms:
            return {}
        self._refresh(now_s)
        return dict(self._penalties)

    def _refresh(self, now_s: float) -> None:
        half_life_s = self._half_life_s
        current = {region: ewma * 0.5 ** ((now_s - at_s) / half_life_s)
                   for region, (ewma, at_s) in self._excess_ms.items()}
        penalties: dict[str, float] = {}
        for region, excess in current.items():
            others = [value for other, value in current.items() if other != region]
            baseline = min(others) if others else 0.0
            penalties[region] = max(0.0, excess - max(0.0, baseline) - PENALTY_FLOOR_MS)
        self._penalties = penalties
        self._penalties_at_s = now_s

    def learn(self, attempt: Attempt, now_s: float) -> None:
        """Take in how far `attempt`'s first byte missed its predicted TTFT."""
        ttfb_s = attempt.ttfb_s
        if ttfb_s is None or not attempt.streamed:
            return  # a non-streaming answer's first byte is its last: not a TTFT
        excess = ttfb_s * 1000.0 - attempt.predicted_ttft_ms
        previous = self._excess_ms.get(attempt.region)
        ewma = excess if previous is None else (
            0.8 * previous[0] * 0.5 ** ((now_s - previous[1]) / self._half_life_s) + 0.2 * excess)
        self._excess_ms[attempt.region] = (ewma, now_s)
        self._penalties_at_s = -1e18  # recompute at the next question
