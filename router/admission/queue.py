"""A bounded queue at the router for when every candidate worker is busy.

Without it a request is committed to one engine's queue the moment it arrives; the
engine that frees a batch slot first may be another one, and an interactive request
waits behind batch requests that arrived before it. Here, when the worker routing would
choose has no free batch slot (its load, as heartbeats and the replicas' open requests
show it, plus ENGINE_QUEUE requests already waiting there), the request waits at the
router instead: interactive before batch, and within a class the tenants (of the API
keys; all one without keys) take turns, each first come first served (start-time fair
queueing: a tenant's next request is ranked one turn after its last, or after the
request now being dispatched, whichever is later), one queue per model. Whenever
capacity may have freed (a request of this router finished, and every POLL_S while
anything waits) the head of each queue is routed again, so it goes to whichever worker
has room first, in any region.

A request waits at most until its deadline: `max_wait_ms` (regions.yaml
`router.queue`), or less when its TTFT budget leaves less time; then it goes to the
best worker as if there were no queue (its engine queues it). Past `max_requests`
waiting, a request is refused at once (503 with Retry-After: nothing is lost silently),
unless another tenant holds more of the queue than its own tenant: then that tenant's
newest waiting request is refused instead, so that one tenant filling the queue cannot
get every other tenant refused. A client that disconnects while waiting leaves the queue.

On the routing benchmark's twin (lab.bench.twin) this raised predicted_ttft's mean
interactive SLO attainment over six traces of skewed-3region by 1.1-1.7 points; batch
requests wait more, as they should.

`Backlog` is the synchronous core (the twin drives it on virtual time); `RouterQueue`
is the asyncio front the proxy awaits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from router.policy.predicted_ttft import effective_load
from router.policy.request import Decision
from router.registry.inflight import InFlight

# A worker counts as having room while fewer than this many requests would wait in its
# own queue: one waiting request keeps the engine from idling between a finished
# sequence and the next dispatch (which takes an RTT); more would commit requests to
# one engine early. Measured on the twin: 0 lost 0.6 points of SLO, 2 and 4 gave back
# most of the gain of 1.
ENGINE_QUEUE = 1
POLL_S = 0.02
_CLASS_ORDER = {"interactive": 0}  # every other class after interactive

T = TypeVar("T")

log = logging.getLogger("globalpool.queue")


def wait_deadline_s(arrived_s: float, max_wait_s: float, first: Decision,
                    budget_ms: float | None) -> float:
    """When a request stops waiting: `max_wait_s` after it arrived, or sooner if its TTFT
    budget, less the TTFT predicted when it arrived (`first`), leaves less."""
    wait_s = max_wait_s
    if budget_ms is not None:
        wait_s = min(wait_s, max(0.0, (budget_ms - first.predicted_ttft_ms) / 1000.0))
    return arrived_s + wait_s


class QueueFull(Exception):
    """More requests are waiting than the queue holds."""


@dataclass(order=True)
class Waiting(Generic[T]):
    """One request waiting for room; ordered by class, its tenant's turn, then arrival."""

    rank: tuple[int, float, int]
    deadline_s: float = field(compare=False)
    pick: Callable[[], Decision] = field(compare=False)  # routes it again (may raise NoRoute)
    payload: T = field(compare=False)
    tenant: str = field(default="", compare=False)
    gone: bool = field(default=False, compare=False)  # left the queue (or its client did)


class Backlog(Generic[T]):
    """Per-model priority queues of requests waiting for a worker with room."""

    def __init__(self, inflight: InFlight, *, max_requests: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._inflight = inflight
        self.max_requests = max_requests
        self._clock = clock
        self._queues: dict[str, list[Waiting[T]]] = {}
        self._count = 0
        self._order = itertools.count()
        self._turn = 0.0  # the turn of the request dispatched last (see the module doc)
        self._tenants: dict[str, _Tenant[T]] = {}  # those with requests waiting
        # Requests refused to make room for another tenant's (see `push`): the caller
        # answers them (RouterQueue: 503), then clears the list.
        self.evicted: list[Waiting[T]] = []
        self.dispatched = 0  # left the queue because a worker had room
        self.expired = 0  # left at their deadline, to the best worker anyway
        self.refused = 0  # found the queue full

    def __len__(self) -> int:
        return self._count

    def has_room(self, decision: Decision) -> bool:
        view = decision.worker
        load = effective_load(view, self._inflight.of(view.worker_id))
        return load + 1 <= view.slots + ENGINE_QUEUE

    def must_wait(self, model: str, decision: Decision) -> bool:
        """Whether a request that routing sent to `decision` waits: its worker has no
        room, or others of its model already wait (no overtaking; requests whose
        clients left do not count)."""
        queue = self._queues.get(model)
        while queue and queue[0].gone:
            heapq.heappop(queue)
        if queue:
            return True
        if queue is not None:
            del self._queues[model]
        return not self.has_room(decision)

    def admit(self, model: str, traffic_class: str, first: Decision,
              pick: Callable[[], Decision], payload: Callable[[], T], *, arrived_s: float,
              max_wait_s: float, budget_ms: float | None,
              tenant: str = "") -> Waiting[T] | None:
        """For a request that routing just sent to `first`: None when it goes there now
        (then it is counted in the open requests), else its place in the queue, holding
        `payload()`. Raises QueueFull."""
        if self.must_wait(model, first):
            deadline_s = wait_deadline_s(arrived_s, max_wait_s, first, budget_ms)
            if deadline_s > self._clock():
                return self.push(model, traffic_class, deadline_s, pick, payload(), tenant)
        self._inflight.started(first.worker.worker_id)
        return None

    def push(self, model: str, traffic_class: str, deadline_s: float,
             pick: Callable[[], Decision], payload: T, tenant: str = "") -> Waiting[T]:
        """Raises QueueFull: the queue is full, and no other tenant holds more of it than
        `tenant` (else that tenant's newest request leaves it, into `evicted`)."""
        if self._count >= self.max_requests:
            victim = self._victim_for(tenant)
            if victim is None:
                self.refused += 1
                raise QueueFull(f"{self._count} requests are waiting for capacity")
            self._left(victim)
            self.refused += 1
            self.evicted.append(victim)
        held = self._tenants.get(tenant)
        if held is None:
            held = self._tenants[tenant] = _Tenant()
        held.turn = max(self._turn, held.turn) + 1.0
        item = Waiting((_CLASS_ORDER.get(traffic_class, 1), held.turn, next(self._order)),
                       deadline_s, pick, payload, tenant)
        heapq.heappush(self._queues.setdefault(model, []), item)
        held.waiting.append(item)
        held.count += 1
        self._count += 1
        return item

    def leave(self, item: Waiting[T]) -> None:
        """The request's client went away: it is skipped (and dropped) when reached.
        Nothing happens for a request that already left the queue."""
        if not item.gone:
            self._left(item)

    def _victim_for(self, tenant: str) -> Waiting[T] | None:
        """The newest waiting request of the tenant that holds the most of the queue, if
        it holds more than one request more than `tenant` does; else None."""
        mine = self._tenants.get(tenant)
        biggest = max(self._tenants.values(), key=_held, default=None)
        if biggest is None or biggest.count <= (mine.count if mine else 0) + 1:
            return None
        while biggest.waiting and biggest.waiting[-1].gone:
            biggest.waiting.pop()
        return biggest.waiting[-1] if biggest.waiting else None

    def _left(self, item: Waiting[T]) -> None:
        """`item` is out of the queue (dispatched, expired, its client gone, evicted)."""
        item.gone = True
        self._count -= 1
        held = self._tenants.get(item.tenant)
        if held is not None:
            held.count -= 1
            while held.waiting and held.waiting[0].gone:
                held.waiting.popleft()
            if held.count <= 0:
                del self._tenants[item.tenant]
        if not self._count:
            self._turn = 0.0  # (turns count from here again)

    def due(self) -> list[tuple[Waiting[T], Decision | BaseException]]:
        """Pop every head that may go now, routed again: (item, decision), or (item,
        the exception its routing raised, e.g. NoRoute once no worker serves it)."""
        ready: list[tuple[Waiting[T], Decision | BaseException]] = []
        now_s = self._clock()
        for model, queue in list(self._queues.items()):
            while queue:
                head = queue[0]
                if head.gone:
                    heapq.heappop(queue)
                    continue
                try:
                    decision = head.pick()
                except Exception as exc:  # handed to the waiting request
                    ready.append((self._pop(queue), exc))
                    continue
                if self.has_room(decision):
                    self.dispatched += 1
                elif now_s >= head.deadline_s:
                    self.expired += 1
                else:
                    break
                ready.append((self._pop(queue), decision))
                # Routing counts a request only once it is dispatched: the caller must
                # mark it started before the next head is routed (see RouterQueue).
                self._inflight.started(decision.worker.worker_id)
            if not queue:
                del self._queues[model]
        return ready

    def _pop(self, queue: list[Waiting[T]]) -> Waiting[T]:
        item = heapq.heappop(queue)
        self._turn = max(self._turn, item.rank[1])
        self._left(item)  # out of the queue: a later `leave` changes nothing
        return item


@dataclass(eq=False)
class _Tenant(Generic[T]):
    """A tenant's requests in the queue: how many, the turn of its last one queued, and
    them in the order queued (with some that left already, dropped as they are reached)."""

    count: int = 0
    turn: float = 0.0
    waiting: collections.deque[Waiting[T]] = field(default_factory=collections.deque)


def _held(tenant: _Tenant[T]) -> int:
    return tenant.count


class RouterQueue:
    """The proxy's side: `goes_now(...)` says whether a request is dispatched at once;
    if not, `await turn(...)` returns the decision to dispatch.

    A returned decision has already been counted in the router's open requests
    (`InFlight.started`); the caller finishes it as usual.
    """

    def __init__(self, inflight: InFlight, *, max_requests: int, max_wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backlog: Backlog[asyncio.Future[Decision]] = Backlog(
            inflight, max_requests=max_requests, clock=clock)
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._inflight = inflight
        self._pump: asyncio.Task[None] | None = None
        self.pump_crashes = 0  # see _pump_ended
        self._wake = asyncio.Event()

    def goes_now(self, model: str, first: Decision) -> bool:
        """For a request that routing just sent to `first`: True when it goes there now
        (nothing of its model waits and that worker has room; it is then counted in the
        open requests), without the machinery of `turn`. False: `await turn(first, ...)`."""
        if self.backlog.must_wait(model, first):
            return False
        self._inflight.started(first.worker.worker_id)
        return True

    async def turn(self, first: Decision, pick: Callable[[], Decision], *, model: str,
                   traffic_class: str, arrived_s: float, budget_ms: float | None,
                   tenant: str = "") -> tuple[Decision, float]:
        """(decision, seconds waited) for a request that routing sent to `first` on
        arrival; `pick` routes it again. Raises NoRoute (from `pick`) and QueueFull (also
        when another tenant's request takes its place: Backlog.push)."""
        backlog = self.backlog
        item = backlog.admit(model, traffic_class, first, pick,
                             asyncio.get_running_loop().create_future, arrived_s=arrived_s,
                             max_wait_s=self.max_wait_s, budget_ms=budget_ms, tenant=tenant)
        for evicted in backlog.evicted:
            if not evicted.payload.done():
                evicted.payload.set_exception(QueueFull(
                    "its tenant holds more of the queue than the others; refused to make "
                    "room for another tenant's request"))
        backlog.evicted.clear()
        if item is None:
            return first, 0.0
        waiter = item.payload
        queued_s = self._clock()
        self._start_pump()
        try:
            decision = await waiter
        except BaseException:
            backlog.leave(item)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Dispatched in the same moment the client left: not sent after all.
                self._inflight.finished(waiter.result().worker.worker_id)
            raise
        return decision, self._clock() - queued_s

    def capacity_freed(self) -> None:
        """A request of this router finished: the heads may go now."""
        if self.backlog._count:  # len(), without the call: this runs for every request
            self._wake.set()

    def _start_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run(), name="queue-pump")
            self._pump.add_done_callback(self._pump_ended)

    def _pump_ended(self, pump: asyncio.Task[None]) -> None:
        """Supervision of the pump (it runs only while requests wait): a crash is logged
        with its traceback, counted, and the pump started again for those still waiting."""
        if pump.cancelled() or pump.exception() is None:
            return
        self.pump_crashes += 1
        log.error("the router queue's pump crashed (%d so far); starting it again",
                  self.pump_crashes, exc_info=pump.exception())
        if len(self.backlog):
            self._start_pump()

    async def _run(self) -> None:
        while len(self.backlog):
            for item, outcome in self.backlog.due():
                waiter = item.payload
                if waiter.done():  # cancelled meanwhile: undo the count `due` made
                    if isinstance(outcome, Decision):
                        self._inflight.finished(outcome.worker.worker_id)
                elif isinstance(outcome, Decision):
                    waiter.set_result(outcome)
                else:
                    waiter.set_exception(outcome)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self._wake.wait()

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
