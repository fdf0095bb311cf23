"""A virtual-time twin of the test bed: the same trace and routing, without the machine.

Every worker is the simulator's own engine model (lab.sim.engine.Engine, the code each
`globalpool sim` runs) on one shared virtual clock; a request reaches its engine half an
RTT after its router decided and its tokens reach the client half an RTT after the
engine made them. One router per region runs the real policy class (router.policy) on
snapshots of heartbeats that the twin publishes every heartbeat interval from the
engines' state, with the performance figures computed as the worker agent computes them
(means over the requests that finished in the interval, held for 4 intervals). Nothing
else is modelled: no CPU, no probe or Redis delay, no TCP handshakes.

It answers two questions next to the measured results:
- is a result the policy's or the machine's? (the twin has no machine);
- what is reachable at all: the `oracle` policy scores like predicted_ttft (RTT + queue
  wait + prefill + the first step) but from every engine's exact state at every
  decision, with the engine's true prefill rate and step time (its region's speed) and
  the service time measured at saturation. Its score is its predicted TTFT.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lab.bench.capacity import sim_config
from lab.bench.replay import Outcome
from lab.bench.scenario import Scenario
from lab.bench.trace import PromptBuilder, Trace, TraceRequest
from lab.bench.twin_parts import EngineEvents, SharedClock, TwinWorker
from lab.sim.engine import Engine
from lab.sim.sequence import Sequence as EngineSequence
from lab.sim.tokens import Prompt, prompt_from_text
from router.admission.queue import POLL_S as QUEUE_POLL_S
from router.admission.queue import Backlog
from router.config import QueueConfig, RouterConfig
from router.core.outcome import Attempt
from router.core.parse import ParsedRequest, parse_body
from router.policy import Decision, Policy, RouteRequest, RoutingContext, create_policy
from router.policy.affinity import AffinityTable
from router.registry.inflight import InFlight
from router.registry.snapshot import Snapshot
from router.registry.worker_view import WorkerView
from worker.schema import Capacity, Heartbeat, LifecycleState, Load, Performance

ORACLE = "oracle"


def _service_s(scenario: Scenario, trace: Trace, region: str) -> float:
    """One request's time in a batch slot of `region`'s workers at saturation (from the
    trace's capacity calibration; traces older than per-region capacities: the fleet's)."""
    by_region = trace.header.get("region_worker_capacity_rps") or {}
    capacity = float(by_region.get(region) or trace.header.get("worker_capacity_rps") or 0.0)
    return scenario.engine.max_num_seqs / capacity if capacity > 0 else 1.0
# How often router replicas report their open requests to each other, and their queue
# for requests that find every worker busy, as deployed by default.
PEER_INTERVAL_S = RouterConfig.model_fields["peer_interval_ms"].default / 1000.0
QUEUE = QueueConfig()


@dataclass
class TwinResult:
    outcomes: list[Outcome]
    prefix_hit_rate: float | None


class Twin:
    """Replays `trace` under one policy in virtual time; `run()` returns the outcomes."""

    def __init__(self, scenario: Scenario, trace: Trace, policy: str, *, seed: int = 0,
                 service_s: float | None = None, one_router: bool = False,
                 true_prefill_rate: bool = False, near_equal_ms: float = 5.0,
                 peer_interval_s: float | None = PEER_INTERVAL_S,
                 queue: bool = QUEUE.enabled) -> None:
        """`one_router`: one router replica for every origin (no other replica's traffic
        is invisible to it); `true_prefill_rate`: heartbeats carry the engine's configured
        prefill rate instead of the agent's measured one. Both are diagnostics: they
        remove one source of prediction error at a time. `peer_interval_s`: how often
        the replicas report their open requests to each other (router.registry.peers;
        None: they do not). `queue`: requests wait at their router while every candidate
        is busy (router.admission.queue), with regions.yaml's default settings."""
        self.scenario = scenario
        self.one_router = one_router
        self.peer_interval_s = peer_interval_s
        self.true_prefill_rate = true_prefill_rate
        self.near_equal_ms = near_equal_ms  # router.near_equal_ms (regions.yaml default: 5)
        self.trace = trace
        self.policy_name = policy
        self.clock = SharedClock()
        self.rng = random.Random(seed)
        # oracle: one request's time in a batch slot, per region (its engine speed)
        self.service_s = {region: service_s or _service_s(scenario, trace, region)
                          for region in scenario.regions}
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.workers: list[TwinWorker] = []
        self.outcomes: dict[int, Outcome] = {}
        self._pending: dict[str, tuple[TraceRequest, TwinWorker, ParsedRequest]] = {}
        self._attempts: dict[int, Attempt] = {}
        self._routers: dict[str, tuple[Policy | None, InFlight, dict[str, WorkerView]]] = {}
        self._open = len(trace.requests)  # requests whose client has not seen the end yet
        self.queue = queue
        self.queue_max_wait_s = QUEUE.max_wait_ms / 1000.0
        self._backlogs: dict[str, Backlog[tuple[TraceRequest, bytes, ParsedRequest]]] = {}
        self._polling = False
        self._builder = PromptBuilder(scenario.model)  # caches shared segments' text
        self._prompts: dict[int, Prompt] = {}

    def _at(self, when_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when_s, next(self._order), action))

    # --- the fleet ------------------------------------------------------------------
    def _build(self) -> None:
        for region, spec in self.scenario.regions.items():
            config = sim_config(self.scenario.engine_for(region), self.scenario.model)
            for number in range(1, spec.workers + 1):
                name = f"{region}-{number}"
                observer = EngineEvents(self._finished, self._first_token)
                engine = Engine(config, self.clock, observer)
                self.workers.append(TwinWorker(name, region, engine, observer, config.max_num_seqs))
        rtt = self.scenario.rtt_ms
        for region in list(self.scenario.regions)[:1] if self.one_router else self.scenario.regions:
            inflight = InFlight()
            context = RoutingContext(
                rtt_ms=rtt, inflight=inflight, clock=self.clock.now,
                near_equal_ms=self.near_equal_ms,
                rng=random.Random(self.rng.random()), affinity=AffinityTable(),
                region_cost=lambda r: self.scenario.regions[r].cost_per_gpu_hour)
            policy = (None if self.policy_name == ORACLE
                      else create_policy(self.policy_name, context))
            self._routers[region] = (policy, inflight, {})
        if self.one_router:
            only = next(iter(self._routers.values()))
            self._routers = {region: only for region in self.scenario.regions}
        elif self.peer_interval_s is not None:
            self._at(self.peer_interval_s, self._exchange)
        if self.queue and self.policy_name != ORACLE:
            backlogs: dict[int, Backlog[tuple[TraceRequest, bytes, ParsedRequest]]] = {}
            for region, (_, inflight, _) in self._routers.items():
                self._backlogs[region] = backlogs.setdefault(id(inflight), Backlog(
                    inflight, max_requests=QUEUE.max_requests, clock=self.clock.now))

    def _exchange(self) -> None:
        """Every replica's open requests, and what it sent since, reach the others
        (router.registry.peers)."""
        now_s = self.clock.now_s
        for region, (policy, inflight, _) in self._routers.items():
            counts, prefill = inflight.own_counts(), inflight.own_prefill()
            shared = policy.context.affinity.take_shared() if policy is not None else None
            for other, (peer_policy, peer_inflight, _) in self._routers.items():
                if other != region:
                    peer_inflight.apply_peer(region, counts, now_s, prefill)
                    if shared is not None and peer_policy is not None:
                        peer_policy.context.affinity.apply_peer(shared)
        if self._open and self.peer_interval_s is not None:
            self._at(now_s + self.peer_interval_s, self._exchange)

    def _heartbeat(self, worker: TwinWorker, next_in_s: float | None = None) -> None:
        """Publish `worker`'s heartbeat to every router, then again one interval later
        (or after `next_in_s`, to stagger the workers as the agents' jitter does)."""
        engine = worker.engine
        engine_config = self.scenario.engine_for(worker.region)  # as cache_config_info says
        worker.seq += 1
        heartbeat = Heartbeat(
            worker_id=worker.name, region=worker.region, endpoint=f"http://twin/{worker.name}",
            models=(self.scenario.model,), state=LifecycleState.READY,
            capacity=Capacity(max_num_seqs=worker.slots, kv_blocks_total=engine_config.kv_blocks,
                              block_size_tokens=engine_config.block_size),
            load=Load(running=engine.num_running, waiting=engine.num_waiting,
                      kv_cache_usage=engine.kv_usage),
            performance=self._performance(worker), seq=worker.seq, sent_at_s=self.clock.now_s,
            ttl_s=3600.0)
        routers = {id(router): router for router in self._routers.values()}.values()
        for _, inflight, views in routers:
            views[worker.name] = WorkerView(heartbeat, self.clock.now_s,
                                            inflight.of(worker.name))
        if self._open:
            interval = self.scenario.heartbeat_interval_s if next_in_s is None else next_in_s
            self._at(self.clock.now_s + interval, lambda: self._heartbeat(worker))

    def _performance(self, worker: TwinWorker) -> Performance:
        performance = worker.performance()
        if self.true_prefill_rate:
            rate = self.scenario.engine_for(worker.region).prefill_tokens_per_s
            performance = performance.model_copy(update={"prefill_tokens_per_s": rate})
        return performance

    # --- requests -------------------------------------------------------------------
    def _route(self, request: TraceRequest, body: bytes) -> None:
        policy, inflight, views = self._routers[request.origin]
        parsed = parse_body(body, "chat")
        if policy is None:
            worker, predicted_s = self._oracle(request)
            inflight.started(worker.name)
            self._dispatch(request, body, parsed, worker, "oracle", 1000.0 * predicted_s)
            return
        route = RouteRequest(
            model=self.scenario.model, origin_region=request.origin,
            prompt_tokens=parsed.prompt_tokens, stream=True,
            session_id=request.session_id, prefix_keys=parsed.prefix_keys,
            traffic_class=request.traffic_class, ttft_budget_ms=request.ttft_budget_ms)

        def pick(policy: Policy = policy) -> Decision:
            snapshot = Snapshot.build(views.values(), built_at_s=self.clock.now_s,
                                      redis_connected=True, last_redis_ok_at_s=self.clock.now_s)
            return policy.pick(snapshot, route)

        decision = pick()
        backlog = self._backlogs.get(request.origin)
        if backlog is None:
            inflight.started(decision.worker.worker_id)
        elif backlog.admit(route.model, request.traffic_class, decision, pick,
                           lambda: (request, body, parsed), arrived_s=request.at_s,
                           max_wait_s=self.queue_max_wait_s,
                           budget_ms=request.ttft_budget_ms) is not None:
            self._poll_backlogs()  # it waits at the router, as RouterQueue.turn does
            return
        self._dispatch(request, body, parsed, self._worker(decision), decision.reason,
                       decision.predicted_ttft_ms, decision.cached_tokens)

    def _worker(self, decision: Decision) -> TwinWorker:
        return next(w for w in self.workers if w.name == decision.worker.worker_id)

    def _poll_backlogs(self) -> None:
        """Every queue's heads that may go now (router.admission.queue); again in POLL_S
        while anything waits."""
        waiting = False
        for backlog in {id(b): b for b in self._backlogs.values()}.values():
            for item, outcome in backlog.due():
                request, body, parsed = item.payload
                if isinstance(outcome, BaseException):
                    raise outcome  # the twin's fleet never loses its last worker
                self._dispatch(request, body, parsed, self._worker(outcome), outcome.reason,
                               outcome.predicted_ttft_ms, outcome.cached_tokens)
            waiting |= bool(len(backlog))
        if waiting and not self._polling:
            self._polling = True
            self._at(self.clock.now_s + QUEUE_POLL_S, self._next_poll)

    def _next_poll(self) -> None:
        self._polling = False
        self._poll_backlogs()

    def _dispatch(self, request: TraceRequest, body: bytes, parsed: ParsedRequest,
                  worker: TwinWorker, reason: str, predicted_ms: float,
                  cached_tokens: int = 0) -> None:
        """Send to `worker` (already counted in its router's open requests), remembered
        for affinity as the proxy does when it sends (`cached_tokens`: of the prompt, in
        its prefix cache as the decision scored it). The outcome keeps the decision's
        prediction (<= 0: none) and the time the request waited for it at its router."""
        worker.in_transit += 1
        policy, inflight, views = self._routers[request.origin]
        # as the proxy counts its prompt's prefill until the first byte (Proxy._dispatched)
        attempt = self._attempts[request.index] = Attempt(
            worker_id=worker.name, region=worker.region, predicted_ttft_ms=predicted_ms,
            reason=reason, started_s=self.clock.now_s, streamed=True)
        inflight.commit(attempt, 0, parsed.prompt_tokens - cached_tokens, self.clock.now_s)
        if policy is not None:
            if request.traffic_class == "batch":  # as the proxy counts them (batch_room)
                policy.context.batch_room.started(worker.name)
            policy.context.affinity.sent(
                worker.name, views[worker.name].cache_tokens, session_id=request.session_id,
                prefix_keys=parsed.prefix_keys, prompt_tokens=parsed.prompt_tokens,
                cached_tokens=cached_tokens, completion_tokens=parsed.completion_tokens)
        outcome = Outcome(index=request.index, origin=request.origin,
                          traffic_class=request.traffic_class, scheduled_s=request.at_s,
                          sent_s=request.at_s, status=200, region=worker.region,
                          worker=worker.name, route=reason,
                          predicted_ttft_ms=predicted_ms if predicted_ms > 0.0 else None,
                          unpredicted_ms=1000.0 * (self.clock.now_s - request.at_s))
        self.outcomes[request.index] = outcome
        half_rtt_s = self.scenario.rtt_ms(request.origin, worker.region) / 2000.0
        self._at(self.clock.now_s + half_rtt_s,
                 lambda: self._arrive(request, body, worker, parsed))

    def _oracle(self, request: TraceRequest) -> tuple[TwinWorker, float]:
        """The worker of least RTT + queue wait + prefill of what its prefix cache lacks +
        its first step's decode time, from exact engine state and the engine's true
        speed, and that score (s): the oracle's own predicted TTFT."""
        prompt = self._prompt(request)

        def score(worker: TwinWorker) -> tuple[float, int, float]:
            occupied = worker.engine.num_running + worker.engine.num_waiting + worker.in_transit
            service_s = self.service_s[worker.region]
            queue_s = max(0, occupied + 1 - worker.slots) * service_s / worker.slots
            rtt_s = self.scenario.rtt_ms(request.origin, worker.region) / 1000.0
            engine = self.scenario.engine_for(worker.region)
            batch = min(worker.slots, occupied + 1)
            step_s = (engine.decode_step_ms + engine.decode_step_ms_per_seq * batch) / 1000.0
            uncached = prompt.num_tokens - worker.engine.cached_prefix_tokens(prompt)
            total_s = rtt_s + queue_s + uncached / engine.prefill_tokens_per_s + step_s
            return (total_s, occupied, self.rng.random())

        scores = {worker.name: score(worker) for worker in self.workers}
        best = min(self.workers, key=lambda worker: scores[worker.name])
        return best, scores[best.name][0]

    def _arrive(self, request: TraceRequest, body: bytes, worker: TwinWorker,
                parsed: ParsedRequest) -> None:
        worker.in_transit -= 1
        prompt = self._prompt(request)
        del self._prompts[request.index]
        seq = worker.engine.submit(f"twin-{request.index}", prompt, request.max_tokens,
                                   ignore_eos=True)
        self._pending[seq.request_id] = (request, worker, parsed)

    def _prompt(self, request: TraceRequest) -> Prompt:
        """The prompt as the engine sees it (kept until it arrives there)."""
        prompt = self._prompts.get(request.index)
        if prompt is None:
            text = "\n".join(m["content"] for m in self._builder.messages(request))
            prompt = prompt_from_text(text, self.scenario.engine.block_size, 0)
            self._prompts[request.index] = prompt
        return prompt

    def _first_token(self, seq: EngineSequence) -> None:
        """The first token reaches the router half an RTT later, as its first byte."""
        request, worker, _ = self._pending[seq.request_id]
        attempt = self._attempts.pop(request.index)
        at_s = self.clock.now_s + self.scenario.rtt_ms(request.origin, worker.region) / 2000.0
        self._at(at_s, lambda: attempt.first_byte(at_s))

    def _finished(self, seq: EngineSequence) -> None:
        request, worker, _ = self._pending.pop(seq.request_id)
        worker.finished.append(seq)
        half_rtt_s = self.scenario.rtt_ms(request.origin, worker.region) / 2000.0
        outcome = self.outcomes[request.index]
        if seq.first_token_s is not None:
            outcome.first_token_s = seq.first_token_s + half_rtt_s
            outcome.last_token_s = (seq.last_token_s or seq.first_token_s) + half_rtt_s
        outcome.tokens = len(seq.output)
        outcome.end_s = (seq.finished_s or self.clock.now_s) + half_rtt_s
        policy, inflight, _ = self._routers[request.origin]

        def client_end() -> None:
            self._open -= 1
            inflight.finished(worker.name)
            if policy is not None and request.traffic_class == "batch":
                policy.context.batch_room.finished(worker.name)
            if self._backlogs:
                self._poll_backlogs()  # as RouterQueue.capacity_freed

        self._at(outcome.end_s, client_end)

    # --- the driver -----------------------------------------------------------------
    async def _drive(self, bodies: Sequence[bytes]) -> None:
        self._build()
        tasks = [asyncio.create_task(w.engine.run()) for w in self.workers]
        interval = self.scenario.heartbeat_interval_s
        for number, worker in enumerate(self.workers):
            self._heartbeat(worker, next_in_s=interval * (number + 1) / len(self.workers))
        for request, body in zip(self.trace.requests, bodies, strict=True):
            self._at(request.at_s, functools.partial(self._route, request, body))
        try:
            while self._events:
                due = [t for t in (self._events[0][0] if self._events else None,
                                   self.clock.next_due()) if t is not None]
                if not due:
                    break
                self.clock.now_s = max(self.clock.now_s, min(due))
                while self._events and self._events[0][0] <= self.clock.now_s:
                    heapq.heappop(self._events)[2]()
                self.clock.fire_due()
                for _ in range(6):  # let the engines run their step bookkeeping
                    await asyncio.sleep(0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def run(self) -> TwinResult:
        bodies = PromptBuilder(self.scenario.model).bodies(self.trace.requests)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._drive(bodies))
        finally:
            loop.close()
        queried = sum(w.observer.queried_tokens for w in self.workers)
        hits = sum(w.observer.hit_tokens for w in self.workers)
        return TwinResult(outcomes=sorted(self.outcomes.values(), key=lambda o: o.index),
                          prefix_hit_rate=hits / queried if queried else None)
