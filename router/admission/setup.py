"""Builds one replica's admission (auth + rate limits) and heartbeat gate from its config."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from router.admission.gate import Admission
from router.admission.limiter import RateLimiter
from router.admission.redis_limiter import RateLimitKeys, RedisLimiter
from router.auth.endpoints import DEFAULT_ALLOWED_ENDPOINTS, EndpointAllowList
from router.config import GlobalConfig
from router.core.stats import SecurityStats
from router.registry.heartbeat_gate import HeartbeatGate, HeartbeatRules
from worker import redis_client
from worker.signing import KEYS_ENV, KEYS_FILE_ENV

log = logging.getLogger("globalpool.router")


def build_admission(config: GlobalConfig, redis_url: str, stats: SecurityStats) -> Admission:
    """An Admission with its own Redis pool (close it with `aclose`). Logs a warning when
    authentication is off, and when a region's upstream key variable is not set."""
    if not config.auth.enabled:
        log.warning("client authentication is OFF: no API keys are configured (auth.keys or "
                    "auth.keys_file in regions.yaml); anyone who can reach this router can "
                    "use it")
    for name, region in config.regions.items():
        variable = region.upstream_api_key_env
        if variable and not os.environ.get(variable):
            log.warning("regions.%s.upstream_api_key_env: $%s is not set; requests to that "
                        "region's workers carry no key", name, variable)
    timing = config.auth.rate_limits
    # More connections than the heartbeat client: every limited request uses one briefly.
    redis = redis_client.connect(redis_url, socket_timeout_s=1.0, max_connections=64,
                                 pool_wait_s=timing.redis_timeout_ms / 1000)
    limiter = RateLimiter(
        RedisLimiter(redis, RateLimitKeys(config.redis.key_prefix)),
        stats=stats,
        timeout_s=timing.redis_timeout_ms / 1000,
        retry_s=timing.redis_retry_s,
    )
    return Admission(limiter, stats)


def heartbeat_rules(config: GlobalConfig) -> HeartbeatRules:
    default = EndpointAllowList.parse(DEFAULT_ALLOWED_ENDPOINTS)
    return HeartbeatRules(
        allow_lists={
            name: (default if region.allowed_endpoints is None
                   else EndpointAllowList.parse(region.allowed_endpoints))
            for name, region in config.regions.items()
        },
        known_regions=frozenset(config.regions),
        max_clock_skew_s=config.heartbeat.max_clock_skew_s,
        models={name: frozenset(region.models) for name, region in config.regions.items()},
        insecure=config.heartbeat.insecure,
    )


def following(current: Callable[[], GlobalConfig]) -> Callable[[], HeartbeatRules]:
    """The rules of whatever config is in force, rebuilt only when it changes (hot reload
    of regions.yaml swaps the config object)."""
    cache: dict[str, tuple[GlobalConfig, HeartbeatRules]] = {}

    def rules() -> HeartbeatRules:
        config = current()
        seen = cache.get("rules")
        if seen is None or seen[0] is not config:
            seen = cache["rules"] = (config, heartbeat_rules(config))
        return seen[1]

    return rules


def heartbeat_gate(
    config: Callable[[], GlobalConfig], keys: Mapping[str, bytes], stats: SecurityStats,
) -> HeartbeatGate:
    """The gate for this router's collector; `config` returns the config in force. `keys`
    come from the environment (worker.signing, read by router.app), so that secrets never
    sit in regions.yaml; none: unsigned heartbeats are believed."""
    if keys:
        log.info("heartbeat signatures are required (keys: %s)", ", ".join(keys))
    elif config().heartbeat.insecure:
        log.warning("heartbeat signing is OFF (heartbeat.insecure: true, no %s or %s): the "
                    "router believes any heartbeat written to Redis; anyone who can write "
                    "there can steer traffic", KEYS_ENV, KEYS_FILE_ENV)
    else:
        log.error("no heartbeat signing keys (%s or %s): every heartbeat is refused, so "
                  "this router routes nothing; give it the agents' keys, or set "
                  "heartbeat.insecure: true to believe unsigned heartbeats (unsafe)",
                  KEYS_ENV, KEYS_FILE_ENV)
    return HeartbeatGate(keys=keys, rules=following(config), stats=stats)
