"""Router replicas tell each other what they have open on each worker.

A heartbeat shows a worker's load as it was up to a heartbeat interval ago. A replica
counts its own requests since then (router.registry.inflight), but not the other
replicas': all of them would see the same worker as momentarily best and send to it
together until its next heartbeat. So every replica publishes its open requests per
worker on a Redis channel every `router.peer_interval_ms` (50 ms by default; only when
they changed, and at least every KEEPALIVE_S), and adds its peers' latest reports to
its own counts. On the benchmark's twin (lab.bench.twin) this took `predicted_ttft`
on skewed-3region from 92.5 % to 96.5 % interactive SLO attainment.

Large fleets report less often: a report is spaced so that reading every replica's
reports costs each receiver at most 5 % of a core (APPLY_S_PER_ENTRY), up to one report
every KEEPALIVE_S. A report replaces the same peer's previous one, so a lost message
costs nothing but freshness. A peer that falls silent for PEER_TTL_S (it died, or Redis
is unreachable) stops counting; one that stops cleanly says so with an empty report.

Wire format, one PUBLISH per report: `v1 <key_id> <hex HMAC-SHA256 of the body> <body>`
(`v1 - - <body>` unsigned), the body `{"router": "<id>", "open": {"<worker_id>": n}}`,
plus `"prefill": {"<worker_id>": tokens}` when some of those requests have not had their
first byte (the prompt tokens they put ahead of a new request there:
router.policy.predicted_ttft), and `"affinity": {"wrote": {"<worker_id>": tokens},
"served": [["<worker_id>", [prefix key, ...], tokens], ...]}` when it sent requests since
its last report: the prompts with prefix keys each worker got, in order, with the tokens
they write to its KV cache, and the tokens the others wrote (router.policy.affinity
`take_shared` / `apply_peer`), so that every replica knows which worker holds a long
shared prompt, whoever sent it there; `"batch": {"<worker_id>": n}`, how many of its
open requests there are Batch API lines (router.policy.batch_room: a peer's lines hold
slots, but are not interactive load that batch lines must leave room for); and
`"batch_ready": ["<model>", ...]`, the models it holds Batch API lines for (the replicas
that hold lines for a worker's models share its room for them: batch_room).
Every report also says when it was sent (`"sent_at"`, Unix s) and the how-manyth of its
sender's it is (`"seq"`). When heartbeat signing keys are configured (worker.signing),
reports are signed with the first key and unsigned or unverifiable reports are dropped:
otherwise anyone who can PUBLISH could steer traffic away from any worker; and a signed
report is taken only if it is recent and newer than the last one taken from its sender
(`MAX_REPORT_AGE_S`): a captured report published again is a replay.

What a router keeps of a report is bounded whoever publishes it (unsigned mode believes
anyone who can PUBLISH): only its entries for workers this router knows (in its fleet
view), and at most MAX_PEERS_COUNTED senders at once (a report from one more is dropped,
counted as `too_many_peers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Container, Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.core.stats import SecurityStats
from router.registry.inflight import InFlight
from router.registry.peer_reports import (
    MAX_REPORT_AGE_S,
    PeerReport,
    ReportError,
    decode_report_from,
    encode_report,
)
from router.registry.shared_sends import SharedAffinity, SharedSends
from router.registry.subscriber import Subscription
from worker.redis_client import is_cluster, publish, raise_if_cancelling

log = logging.getLogger("globalpool.peers")

KEEPALIVE_S = 0.5
# Reading a report costs ~0.8 us per worker in it (decode, check, apply; measured with
# 10-1,000 entries). A replica's reports are spaced so that each receiver spends at most
# this share of a core on all replicas' reports together: with 10 replicas of 1,000 open
# workers each, every ~0.2 s instead of every 50 ms.
APPLY_S_PER_ENTRY = 1e-6
RECEIVER_CPU_SHARE = 0.05
PEER_TTL_S = 2.0
# Each own request counts at most this many times again for sibling replicas (of this
# region): unsigned reports could otherwise claim siblings enough to push every request
# of this replica away from its region.
MAX_ECHO = 8
MAX_PEERS_REMEMBERED = 1024  # senders' last `seq` kept (pruned by age past 4x this)
MAX_PEERS_COUNTED = 1024  # senders whose open requests count at once (see the module doc)


def router_id() -> str:
    """Unique per process: host, pid and a random part (a restarted replica is a new peer)."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{secrets.token_hex(4)}"


class PeerExchange:
    """Publishes this replica's open requests and applies its peers' to `inflight`."""

    def __init__(
        self,
        *,
        redis: Redis,
        pubsub_redis: Redis,
        channel: str,
        inflight: InFlight,
        interval_s: Callable[[], float],
        keys: Mapping[str, bytes] | None = None,
        stats: SecurityStats | None = None,
        router: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_backoff_s: float = 2.0,
        region: str | None = None,
        affinity: SharedAffinity | None = None,
        workers: Callable[[], Container[str]] | None = None,
    ) -> None:
        """`workers`: the ids of the workers this router knows now (a report's entries for
        others are left out); None: every entry is kept."""
        self._redis = redis
        self._workers = workers
        # This replica's table of who holds which prompt prefixes, shared with the peers
        # (None: not shared; `share`, once the policy has its table).
        self.affinity: SharedAffinity | None = None
        if affinity is not None:
            self.share(affinity)
        self._region = region
        # Replicas of this region heard from within PEER_TTL_S, idle ones too: how many
        # times each own request is echoed (router.registry.inflight), at most MAX_ECHO.
        self._siblings: dict[str, float] = {}
        self._pubsub_redis = pubsub_redis
        self._channel = channel
        self._inflight = inflight
        self._interval_s = interval_s  # follows config reloads; 0 turns the exchange off
        self._keys = dict(keys or {})
        self._stats = stats
        self._signing_key = next(iter(self._keys.items()), None)
        self.router = router or router_id()
        self._clock = clock
        self._max_backoff_s = max_backoff_s
        self._sent: tuple[dict[str, int], dict[str, int], dict[str, int],
                          frozenset[str]] | None = None
        # This replica's Batch API lines per worker, and the models it holds lines for
        # (`share_batch`; None: not reported).
        self._batch_counts: Callable[[], dict[str, int]] | None = None
        self._batch_ready: Callable[[], frozenset[str]] = frozenset
        self._shared = 0  # entries of the last report's `affinity`
        self._seq = 0  # reports published
        self._wall_clock = time.time
        # Per sender: the `seq` of its last report taken, and when (signed reports only).
        self._last_seq: dict[str, tuple[int, float]] = {}
        self._sent_at_s = -float("inf")
        self.rejected_reports = 0
        self.connected = False

    def share(self, affinity: SharedAffinity) -> None:
        """Tell the peers what `affinity` records being sent from now on, and fill it
        with what they send."""
        affinity.shared = SharedSends()
        self.affinity = affinity

    def share_batch(self, counts: Callable[[], dict[str, int]],
                    ready: Callable[[], frozenset[str]] = frozenset) -> None:
        """Tell the peers, with each report, how many of this replica's open requests
        per worker are Batch API lines (`counts()`), and the models it holds lines for
        (`ready()`): router.policy.batch_room."""
        self._batch_counts = counts
        self._batch_ready = ready

    async def run(self) -> None:
        """Run until cancelled; never raises for Redis trouble. On cancellation, tells
        the peers this replica has nothing open any more."""
        backoff_s = 0.05
        try:
            while True:
                if self._interval_s() <= 0:
                    self._forget_all()
                    if self.affinity is not None:
                        self.affinity.shared = None  # no one to tell
                    await asyncio.sleep(1.0)
                    continue
                try:
                    await self._exchange()
                except (RedisError, OSError) as exc:
                    raise_if_cancelling()
                    if self.connected:
                        log.warning("peer exchange interrupted (redis: %s); peers' requests "
                                    "stop counting after %g s", exc, PEER_TTL_S)
                    self.connected = False
                    self._expire()
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(self._max_backoff_s, backoff_s * 2)
                else:
                    backoff_s = 0.05
        finally:
            if self._sent is not None and (self._sent[0] or self._sent[3]):
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._publish({})

    async def _exchange(self) -> None:
        async with Subscription(self._pubsub_redis, self._channel) as subscription:
            self.connected = True
            next_report_s = self._clock()
            while (interval_s := self._interval_s()) > 0:
                now_s = self._clock()
                if now_s >= next_report_s:
                    self._inflight.roll_echo()
                    await self._report(now_s)
                    raise_if_cancelling()  # redis-py can swallow a cancellation
                    next_report_s = now_s + self._spacing_s(interval_s)
                for payload in await subscription.get(max(0.0, next_report_s - now_s)):
                    self._apply(payload)
                self._expire()

    def _spacing_s(self, interval_s: float) -> float:
        """The configured interval, stretched so that reading this replica's reports costs
        every peer at most RECEIVER_CPU_SHARE of a core (see the module doc), but never
        beyond KEEPALIVE_S: peers must hear from this replica well within PEER_TTL_S."""
        entries = self._shared + (0 if self._sent is None
                                  else sum(len(figures) for figures in self._sent))
        replicas = 1 + len(self._inflight.peer_ids())
        spacing_s = APPLY_S_PER_ENTRY * entries * replicas / RECEIVER_CPU_SHARE
        return max(interval_s, min(KEEPALIVE_S, spacing_s))

    async def _report(self, now_s: float) -> None:
        """Publish this replica's counts if they changed, or what it sent since its last
        report, or as a keepalive."""
        batch = self._batch_counts() if self._batch_counts is not None else {}
        sent = (self._inflight.own_counts(), self._inflight.own_prefill(), batch,
                self._batch_ready())
        affinity = self.affinity
        shared = affinity.take_shared() if affinity is not None else None
        if sent == self._sent and not shared and now_s - self._sent_at_s < KEEPALIVE_S:
            return
        await self._publish(*sent, shared)
        self._sent, self._sent_at_s = sent, now_s
        self._shared = len(shared.wrote) + len(shared.served) if shared else 0

    async def _publish(self, counts: Mapping[str, int],
                       prefill: Mapping[str, int] | None = None,
                       batch: Mapping[str, int] | None = None,
                       batch_ready: frozenset[str] = frozenset(),
                       shared: SharedSends | None = None) -> None:
        self._seq += 1
        report = encode_report(self.router, counts, self._signing_key, self._region, prefill,
                               shared, self._wall_clock(), self._seq, batch, batch_ready)
        await publish(self._redis, self._channel, report, sharded=is_cluster(self._redis))

    def _apply(self, payload: bytes) -> None:
        try:
            report = decode_report_from(payload, self._keys)
            if self._keys:
                self._check_fresh(report)
        except ReportError as exc:
            self.rejected_reports += 1
            if self._stats is not None:
                self._stats.peer_reports_dropped[exc.reason] += 1
            count = self.rejected_reports
            if count & (count - 1) == 0:  # 1st, 2nd, 4th, 8th...: garbage cannot flood logs
                log.warning("dropped peer report (%d so far): %s", count, exc)
            return
        peer = report.router
        if peer == self.router:
            return
        if not self._inflight.has_peer(peer) and peer not in self._siblings and (
                self._inflight.peer_count() >= MAX_PEERS_COUNTED
                or len(self._siblings) >= MAX_PEERS_COUNTED):
            self.rejected_reports += 1
            if self._stats is not None:
                self._stats.peer_reports_dropped["too_many_peers"] += 1
            return
        if self._region is not None and report.region == self._region:
            self._siblings[peer] = self._clock()
            self._inflight.echo = min(MAX_ECHO, len(self._siblings))
        report = self._known_only(report)
        if report.open or report.batch_ready:
            self._inflight.apply_peer(peer, report.open, self._clock(), report.prefill,
                                      report.batch, report.batch_ready)
        else:
            self._inflight.forget_peer(peer)  # it left, or has nothing open or waiting
        if report.shared is not None and self.affinity is not None:
            self.affinity.apply_peer(report.shared)

    def _known_only(self, report: PeerReport) -> PeerReport:
        """`report` with only its entries for workers this router knows."""
        if self._workers is None:
            return report
        known = self._workers()
        shared = None
        if report.shared is not None:
            shared = SharedSends()
            shared.wrote = {w: n for w, n in report.shared.wrote.items() if w in known}
            shared.served = [sent for sent in report.shared.served if sent[0] in known]
        return report._replace(
            open={w: n for w, n in report.open.items() if w in known},
            prefill={w: n for w, n in report.prefill.items() if w in known},
            batch={w: n for w, n in report.batch.items() if w in known}, shared=shared)

    def _check_fresh(self, report: PeerReport) -> None:
        """Raise ReportError ("replayed") unless a signed report is recent and newer than
        the last one taken from its sender (MAX_REPORT_AGE_S)."""
        now_s = self._wall_clock()
        sent_at_s, seq = report.sent_at_s, report.seq
        if sent_at_s is None or seq is None or not (
                now_s - MAX_REPORT_AGE_S <= sent_at_s <= now_s + MAX_REPORT_AGE_S):
            raise ReportError("replayed", "not sent within the last "
                                          f"{MAX_REPORT_AGE_S:g} s (a replay?)")
        last = self._last_seq.get(report.router)
        if last is not None and seq <= last[0]:
            raise ReportError("replayed", "not newer than the last report of its sender")
        self._last_seq[report.router] = (seq, now_s)
        if len(self._last_seq) > 4 * MAX_PEERS_REMEMBERED:  # (senders come and go)
            self._last_seq = {router: last for router, last in self._last_seq.items()
                              if last[1] >= now_s - 2 * MAX_REPORT_AGE_S}

    def _expire(self) -> None:
        silent_since_s = self._clock() - PEER_TTL_S
        for peer in self._inflight.expire_peers(silent_since_s):
            log.info("peer router %s went silent; its requests no longer count", peer)
        if self._siblings:
            self._siblings = {peer: at_s for peer, at_s in self._siblings.items()
                              if at_s >= silent_since_s}
            self._inflight.echo = min(MAX_ECHO, len(self._siblings))

    def _forget_all(self) -> None:
        for peer in self._inflight.peer_ids():
            self._inflight.forget_peer(peer)
        self._siblings.clear()
        self._inflight.echo = 0
