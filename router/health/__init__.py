"""Passive health: per-worker breakers, region ejection, latency learning, retry budget."""

from router.health.breaker import Breaker, BreakerPolicy, BreakerState
from router.health.budget import RetryBudget
from router.health.tracker import Health, HealthEvent

__all__ = ["Breaker", "BreakerPolicy", "BreakerState", "Health", "HealthEvent", "RetryBudget"]
