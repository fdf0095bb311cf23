"""Which heartbeats the router believes: signed by a known key, fresh, from an allowed address.

The pool's membership lives in Redis, so whoever can write there could otherwise steer
traffic. `HeartbeatGate.check` runs on every heartbeat the collector parses and returns
why it must be dropped (a `SecurityStats.heartbeats_dropped` label), or None:

- signing keys configured (worker.signing): unsigned, unknown key id, bad signature;
  sent more than `max_clock_skew_s` in the future; older than its own `ttl_s` plus the
  skew (a replay of a captured heartbeat of a worker that is gone); or, on pub/sub, older
  (by send time, then sequence number) than one already accepted from the same worker
  (a replay of an old one). A restarted worker starts its sequence again at 0 but with a
  later send time, so it is not mistaken for a replay.
- an endpoint host outside its region's `allowed_endpoints` (without one: private and
  loopback IP addresses, router.auth.endpoints.DEFAULT_ALLOWED_ENDPOINTS); a region
  regions.yaml does not define; a model the region's `models` do not list.
- load records (`check_record`): signed, and sent within the same bounds; the collector
  takes one only if it is newer than the worker's view and taken with the same
  heartbeat, whose region and endpoint were checked.

Without signing keys every heartbeat is refused (`no_keys`), unless regions.yaml says
`heartbeat.insecure: true`: then unsigned heartbeats are believed, and so are signed ones
(their signatures are not checked). `globalpool up` makes a key for its agents and router.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.registry.worker_view import WorkerView

from router.auth.endpoints import EndpointAllowList
from router.core.stats import SecurityStats
from worker.load_records import LoadRecord
from worker.schema import Heartbeat
from worker.signing import verify_payload, verify_record, verify_signature

log = logging.getLogger("globalpool.registry")

_LOG_EVERY_S = 60.0
_MAX_TRACKED_WORKERS = 100_000


@dataclass(frozen=True)
class HeartbeatRules:
    """What regions.yaml says about heartbeats (it may change with a hot reload)."""

    allow_lists: Mapping[str, EndpointAllowList] = field(default_factory=dict)
    known_regions: frozenset[str] = frozenset()
    max_clock_skew_s: float = 5.0
    # region -> the models regions.yaml lists for it (a worker advertising another is
    # refused); a region not in it: any model.
    models: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # Believe unsigned heartbeats when there are no keys (heartbeat.insecure).
    insecure: bool = True


class HeartbeatGate:
    """Verification for one router. `rules` is read per heartbeat (the config in force);
    the keys come from the environment at start. `clock` is wall time (heartbeats carry
    Unix time)."""

    def __init__(
        self,
        *,
        keys: Mapping[str, bytes],
        rules: Callable[[], HeartbeatRules],
        stats: SecurityStats,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keys = dict(keys)
        self._rules = rules
        self._stats = stats
        self._clock = clock
        self._monotonic = monotonic
        self._latest: dict[str, tuple[float, int]] = {}
        self._logged_at: dict[str, float] = {}

    @property
    def signing(self) -> bool:
        return bool(self._keys)

    @property
    def rules(self) -> HeartbeatRules:
        """The rules in force: another object once regions.yaml is reloaded, when the
        workers already known are judged again (`refused_by_rules`)."""
        return self._rules()

    def refused_by_rules(self, heartbeat: Heartbeat) -> str | None:
        """Why regions.yaml's rules in force refuse `heartbeat` (its region, its endpoint
        or its models), or None: asked again of every known worker after a reload, so
        that a region, model or address taken out of regions.yaml gets no new request
        (its last heartbeat may otherwise live for its `ttl_s`). Not counted."""
        return _refused_by(self._rules(), heartbeat)

    def check(self, heartbeat: Heartbeat, *, via_pubsub: bool,
              payload: bytes | None = None) -> str | None:
        """None to accept `heartbeat`, else the reason it is dropped (also counted/logged).
        `payload`: the bytes it was parsed from (its signature is then checked on them,
        see worker.signing.verify_payload)."""
        reason = self._reason(heartbeat, via_pubsub, payload)
        if reason is None:
            if self._keys:
                self._stats.heartbeats_verified += 1
                if via_pubsub:
                    self._remember(heartbeat)
            return None
        self._dropped(reason, "heartbeat", heartbeat.worker_id, heartbeat.region)
        return reason

    def check_record(self, record: LoadRecord, payload: bytes, view: WorkerView) -> str | None:
        """None to accept a load record (worker.load_records.load_record, parsed from `payload`)
        that the collector found newer than `view`, the worker's current view, and taken
        with the same heartbeat; else the reason it is dropped (counted/logged as for
        heartbeats). With signing keys: signed by one of them, and its send time within
        the same bounds as a heartbeat's (by the view's `ttl_s`). The rest of the
        heartbeat (region, endpoint) was checked when `view` was."""
        if not self._keys:
            return None if self._rules().insecure else "no_keys"
        reason = (verify_record(payload, record, self._keys)
                  or self._untimely(record.sent_at_s, view.ttl_s, self._rules()))
        if reason is None:
            self._stats.heartbeats_verified += 1
            return None
        self._dropped(reason, "load record", view.worker_id, view.region)
        return reason

    def _untimely(self, sent_at_s: float, ttl_s: float, rules: HeartbeatRules) -> str | None:
        """"future" if sent more than the allowed skew ahead of this router's clock,
        "expired" if older than `ttl_s` plus the skew, else None."""
        now = self._clock()
        skew_s = rules.max_clock_skew_s
        if not math.isfinite(sent_at_s) or sent_at_s > now + skew_s:
            return "future"
        if sent_at_s + ttl_s + skew_s < now:
            return "expired"
        return None

    def _dropped(self, reason: str, what: str, worker_id: str, region: str) -> None:
        self._stats.heartbeats_dropped[reason] += 1
        now = self._monotonic()
        if now - self._logged_at.get(reason, -math.inf) >= _LOG_EVERY_S:
            self._logged_at[reason] = now
            log.warning("dropped %s (%s) claiming worker %r in region %r; further drops "
                        "for this reason are only counted for %.0f s",
                        what, reason, worker_id, region, _LOG_EVERY_S)

    def _reason(self, heartbeat: Heartbeat, via_pubsub: bool,
                payload: bytes | None) -> str | None:
        rules = self._rules()
        refused = _refused_by(rules, heartbeat)
        if refused is not None:
            return refused
        if not self._keys:
            return None if rules.insecure else "no_keys"
        verdict = (verify_signature(heartbeat, self._keys) if payload is None
                   else verify_payload(payload, heartbeat, self._keys))
        if verdict is not None:
            return verdict
        untimely = self._untimely(heartbeat.sent_at_s, heartbeat.ttl_s, rules)
        if untimely is not None:
            return untimely
        if via_pubsub:
            latest = self._latest.get(heartbeat.worker_id)
            if latest is not None and (heartbeat.sent_at_s, heartbeat.seq) < latest:
                return "replayed"
        return None

    def _remember(self, heartbeat: Heartbeat) -> None:
        """Only pub/sub messages count: one worker's messages arrive in the order it sent
        them, while a full read may legitimately see a newer report than messages still
        queued, which must not then look like replays."""
        order = (heartbeat.sent_at_s, heartbeat.seq)
        latest = self._latest.get(heartbeat.worker_id)
        if latest is None or order > latest:
            if latest is None and len(self._latest) >= _MAX_TRACKED_WORKERS:
                self._forget_old()
            self._latest[heartbeat.worker_id] = order

    def _forget_old(self) -> None:
        """Drop workers not heard of for an hour (no heartbeat lives longer)."""
        cutoff = self._clock() - 3600.0
        for worker_id in [w for w, (sent, _) in self._latest.items() if sent < cutoff]:
            del self._latest[worker_id]


def _refused_by(rules: HeartbeatRules, heartbeat: Heartbeat) -> str | None:
    """Why `rules` refuse `heartbeat`'s region, endpoint or models, or None."""
    if rules.allow_lists:
        allow = rules.allow_lists.get(heartbeat.region)
        if heartbeat.region not in rules.known_regions:
            return "unknown_region"
        if allow is not None and not allow.allows(heartbeat.endpoint):
            return "endpoint_not_allowed"
    listed = rules.models.get(heartbeat.region)
    if listed is not None and not listed.issuperset(heartbeat.models):
        return "model_not_listed"
    return None
