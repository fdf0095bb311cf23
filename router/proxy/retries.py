"""One request's retries: what its failed attempts mean for the next.

A failure before the first byte is retried on a worker not tried yet; after a failure of
the path to a region the retry prefers another region. A retry spends the retry budget
unless it is failover (`free`). When no attempt is left, `gave_up` answers the client.
"""

from __future__ import annotations

import logging

from router.core.outcome import Attempt, Failure, RequestRecord
from router.health.breaker import BreakerState
from router.policy import Decision, NoRoute, Policy, RouteRequest
from router.proxy.continuation import Failover
from router.proxy.exchange import Exchange, Reply
from router.proxy.failures import StreamBroken, TooLong, UpstreamFailure, WorkerRefusal
from router.proxy.replies import upstream_failed_reply
from router.proxy.stream import end_broken_stream
from router.registry.drained import Drained
from router.registry.snapshot import Snapshot, SnapshotHolder

log = logging.getLogger(__name__)

_PATH_FAILURES = frozenset({Failure.CONNECT, Failure.TIMEOUT})


class Retries:
    """The attempts of one request so far, as they bear on the next one."""

    __slots__ = ("avoid_regions", "broken_stream", "failure", "free", "refused_for",
                 "server_failure", "tried")

    def __init__(self) -> None:
        self.tried: set[str] = set()  # workers that failed it: never tried again
        self.avoid_regions: set[str] = set()
        self.failure: UpstreamFailure | None = None  # the last attempt's
        # The last failure that was not an engine's refusal of the request itself
        # (WorkerRefusal): a timeout, a 5xx, a connection that failed.
        self.server_failure: UpstreamFailure | None = None
        self.broken_stream: StreamBroken | None = None  # its client has part of the answer
        self.free = False  # the next retry costs no budget
        # Each refusal as too long: the worker, and the context its engine named.
        self.refused_for: list[tuple[str, int]] = []

    def next_route(self, route: RouteRequest, drained: Drained,
                   snapshot: Snapshot) -> RouteRequest:
        """`route` for the next attempt: not to the workers tried (nor those it excluded
        already), away from the regions to avoid, to a longer context than any that
        refused it (`context_above`), with what is drained now."""
        return route._replace(exclude=route.exclude.union(self.tried), drained=drained,
                              avoid_regions=frozenset(self.avoid_regions),
                              context_above=self.context_above(snapshot))

    def context_above(self, snapshot: Snapshot) -> int:
        """The longest context a worker refused the request for (0: none did). A refusal
        counts for no more than the context the worker's heartbeat gives: an engine that
        names a context far beyond its own (a lie, or a bug) cannot make a request that
        shorter contexts would serve hopeless, and keep every other worker from it."""
        return max((min(named, _context_of(snapshot, worker_id, named))
                    for worker_id, named in self.refused_for), default=0)

    def hopeless(self, snapshot: Snapshot, model: str) -> bool:
        """Whether the last failure rules out every worker: a refusal as too long for a
        context that no worker of the model exceeds (its answer is the client's)."""
        return (isinstance(self.failure, TooLong)
                and snapshot.contexts(model)[1] <= self.context_above(snapshot))

    def failed(self, attempt: Attempt, failed: UpstreamFailure, request_id: str) -> str:
        """`attempt` failed before its first byte: logged, and noted in it. Returns its
        worker's id."""
        log.log(logging.INFO if isinstance(failed, WorkerRefusal) else logging.WARNING,
                "request %s: attempt on %s (%s) failed before first byte: %s",
                request_id, attempt.worker_id, attempt.region, failed.detail)
        note_failure(attempt, failed)
        self.tried.add(attempt.worker_id)
        # A retry costs no budget when the failed attempt did no work anywhere: a
        # refused connection, or a wait abandoned on a stalled worker (ejected, so
        # its requests move once; the budget guards against amplification, and
        # this is failover).
        self.free = (failed.kind is Failure.CONNECT or attempt.abandoned is not None
                     or self.broken_stream is not None or isinstance(failed, WorkerRefusal))
        if isinstance(failed, TooLong):  # refused before any work: a longer context may
            self.refused_for.append((attempt.worker_id, failed.context))
        if failed.kind in _PATH_FAILURES:
            # The path to the region may be down (refused, or a blackhole that
            # only times out): the retry prefers another region. A reset is
            # usually one stale pooled connection, not the region.
            self.avoid_regions.add(attempt.region)
        self.failure = failed
        if not isinstance(failed, WorkerRefusal):
            self.server_failure = failed
        return attempt.worker_id

    def told(self, snapshot: Snapshot, model: str) -> UpstreamFailure:
        """The failure the client is told of once no attempt is left: the last one, unless
        that is an engine's refusal (too long for its context, a model it does not
        serve) after a worker that could have served the request failed. Then the
        refusal is not the request's fault, and the client, told "too long" or "does not
        exist", would not send it again: it is told the earlier failure (a 5xx with
        Retry-After). A request too long for every context gets the refusal all the
        same."""
        assert self.failure is not None
        if (isinstance(self.failure, WorkerRefusal) and self.server_failure is not None
                and not self.hopeless(snapshot, model)):
            return self.server_failure
        return self.failure

    def broke(self, attempt: Attempt, broken: StreamBroken) -> None:
        """`attempt`'s stream broke off, to be continued on another worker."""
        self.tried.add(attempt.worker_id)
        self.broken_stream = self.failure = broken
        self.free = True  # failover: the budget guards against amplification


def _context_of(snapshot: Snapshot, worker_id: str, otherwise: int) -> int:
    """The context the worker's heartbeat gives, or `otherwise` (none given, or gone)."""
    view = snapshot.workers.get(worker_id)
    length = None if view is None else view.heartbeat.capacity.max_model_len
    return otherwise if length is None else length


def pick_now(policy: Policy, holder: SnapshotHolder, route: RouteRequest) -> Decision:
    """`policy`'s pick for `route` on the fleet view of this moment."""
    return policy.pick(holder.current, route)


def could_retry(policy: Policy, holder: SnapshotHolder, route: RouteRequest,
                record: RequestRecord) -> bool:
    """Whether a retry of the request would find a worker it has not tried, now (an
    attempt's `elsewhere`: passive health abandons it on a stalled worker only then)."""
    tried = route.exclude.union(attempt.worker_id for attempt in record.attempts)
    try:
        worker_id = pick_now(policy, holder, route._replace(exclude=tried)).worker.worker_id
    except NoRoute:
        return False
    # Not to an ejected worker (the health filter offers those when it has nothing else).
    health = policy.context.health
    return health is None or health.state_of(worker_id) is not BreakerState.OPEN


def never() -> bool:
    """An attempt's `elsewhere` when it is the request's last: its retry would not be made."""
    return False


def note_failure(attempt: Attempt, failed: UpstreamFailure) -> None:
    attempt.error = failed.detail
    attempt.failure = failed.kind
    attempt.status = failed.status
    attempt.retry_after_s = failed.retry_after_s


async def gave_up(exchange: Exchange, failover: Failover | None, retries: Retries | None,
                  record: RequestRecord, snapshot: Snapshot) -> Reply:
    """The answer when no attempt is left (each failed: `retries` holds them): the error
    of the failure it is told of (Retries.told), or the end of a stream whose client has
    part of the answer."""
    assert retries is not None and retries.failure is not None
    failure = retries.told(snapshot, record.model)
    record.error = failure.detail
    if retries.broken_stream is not None:  # the client has part of the answer: end it
        record.failover = "failed"
        await end_broken_stream(exchange, None if failover is None else failover.transcript,
                                retries.broken_stream)
        return Reply(200, {}, streamed=True)
    if isinstance(failure, WorkerRefusal):  # the engine's own refusal: no other could take it
        return Reply(failure.status, {"Content-Type": "application/json"}, failure.answer)
    return upstream_failed_reply(failure, len(retries.tried))
