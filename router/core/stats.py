"""Counters of security decisions, for /metrics and the status page to read.

Plain counters updated inline on the request path and by the heartbeat collector (cheap,
no locks: one event loop). Readers take `as_dict()` or read the fields. Label meanings:

- `auth[outcome]`: "ok", "missing_api_key", "invalid_api_key", "model_not_allowed"
- `rate_limited[(scope, unit)]`: 429s by the limit that was hit, scope "key"/"tenant",
  unit "requests"/"tokens"; `rate_limit_source[source]`: decisions by "redis"/"local";
  `rate_limit_redis_errors`: Redis timeouts/errors on the request path
- `residency[(tenant, region, outcome)]`: requests of tenants limited to some regions;
  outcome "routed" (served in `region`) or "refused" (region "-": no allowed region
  could serve it, 503). `residency_violations` counts attempts that went to a region the
  tenant may not use: it must stay 0.
- `heartbeats_dropped[reason]`: "unsigned", "unknown_key", "bad_signature", "future",
  "expired", "replayed", "endpoint_not_allowed", "unknown_region";
  `heartbeats_verified`: heartbeats whose signature checked out.
- `peer_reports_dropped[reason]`: other router replicas' reports of open requests that
  were not believed: "too_large", "malformed", "unsigned", "unknown_key", "bad_signature",
  "replayed", or "too_many_peers" (from one sender more than MAX_PEERS_COUNTED)
  (router.registry.peers).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SecurityStats:
    auth: Counter[str] = field(default_factory=Counter)
    rate_limited: Counter[tuple[str, str]] = field(default_factory=Counter)
    rate_limit_source: Counter[str] = field(default_factory=Counter)
    rate_limit_redis_errors: int = 0
    residency: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    residency_violations: int = 0
    heartbeats_dropped: Counter[str] = field(default_factory=Counter)
    heartbeats_verified: int = 0
    peer_reports_dropped: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready copy (tuple labels joined with '/')."""
        return {
            "auth": dict(self.auth),
            "rate_limited": {"/".join(k): v for k, v in self.rate_limited.items()},
            "rate_limit_source": dict(self.rate_limit_source),
            "rate_limit_redis_errors": self.rate_limit_redis_errors,
            "residency": {"/".join(k): v for k, v in self.residency.items()},
            "residency_violations": self.residency_violations,
            "heartbeats_dropped": dict(self.heartbeats_dropped),
            "heartbeats_verified": self.heartbeats_verified,
            "peer_reports_dropped": dict(self.peer_reports_dropped),
        }
