"""One worker as this router last heard of it: a `WorkerView`, with the scoring terms the
request path reads for every candidate, made once per heartbeat or load record."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.load_records import RecordItems, static_digest
from worker.schema import MAX_LATENCY_MS, Heartbeat, LifecycleState

# Used until a worker has reported its own figures (no traffic yet).
DEFAULT_PREFILL_TOKENS_PER_S = 4000.0
DEFAULT_SERVICE_MS = 2000.0
# An engine step (one decode iteration of the batch, ms) while the worker reports no
# inter-token latency (it has had no traffic lately): none. Any figure would make such a
# worker look slower than busy ones that report a shorter step, so that it would get no
# request to show its own, and a worker readmitted after a fault (its figures gone with
# its traffic) would never be chosen again (tests/integration/test_hung_workers.py).
DEFAULT_STEP_MS = 0.0
# Above this KV usage new sequences start to wait for blocks even with free batch slots.
KV_PRESSURE_START = 0.9
# A prefill rate below this (tokens/s) is read as this: 1,000 s a token. The schema lets
# any rate in 0..MAX_TOKENS_PER_S through, and 1000 / 5e-324 is inf (then 0 tokens x inf
# is NaN, and a NaN score is never among the best: the pick found no candidate).
MIN_PREFILL_TOKENS_PER_S = 1e-3

# A view's order, load figures, receipt and freshness as plain values, by position
# (WorkerView.load_items): worker_id, seq, sent_at_s, running, waiting, kv_cache_usage,
# ttft_ms, itl_ms, e2e_ms, prefill_tokens_per_s, decode_tokens_per_s, received_at_s,
# expires_at_s.
LoadItems = tuple[Any, ...]


def fresh_for_s(ttl_s: float, next_read_s: float) -> float:
    """How long a worker stays fresh after the router last heard of it: its TTL, or, when
    the router reads the load records only every so often, until the next read could take
    the worker's next record (`next_read_s`: the longest until then, ~3 s for 10,000
    workers; router.registry.pace). A live agent writes a record at least every half
    TTL (worker.cli checks), so reads that far apart always find a newer one: a live
    worker must not go stale between two of them."""
    return max(ttl_s, next_read_s)


class WorkerView:
    """One worker as this router last heard of it. Never changed once made (but see
    `refresh`): a new heartbeat or load record makes a new view (`with_load`).

    `heartbeat` is the last full heartbeat: the worker's identity, state, models and
    capacity. Its order (`seq`, `sent_at_s`) and load figures are the view's own
    attributes, from that heartbeat or from a newer load record (worker.schema.
    load_record) taken with it. `received_at_s` is the router's monotonic clock when the
    latest of those arrived; the worker counts as fresh until `received_at_s +
    heartbeat.ttl_s`, or until the router's next read of the load records could take its
    next one, when that is later (`fresh_for_s`). `inflight_at_receipt` is how many
    requests this router had open on the worker at that moment, so that the policy can add
    what changed since (see router.registry.inflight).

    A plain class with slots rather than a frozen dataclass: a router makes thousands of
    views a second at scale, and a frozen class's `object.__setattr__` per field costs
    6x plain assignment.
    """

    __slots__ = (  # noqa: RUF023 (grouped by what they are, as documented)
        "heartbeat", "received_at_s", "inflight_at_receipt",
        # Read off the heartbeat once, as plain attributes: a routing decision reads them
        # for every candidate.
        "worker_id", "region", "endpoint", "ready", "ttl_s", "_digest",
        "served",  # the models and LoRA adapters it serves
        "cache_tokens",  # what its KV cache holds (None: the engine does not say)
        "seq", "sent_at_s", "running", "waiting", "kv_cache_usage", "ttft_ms", "itl_ms",
        "e2e_ms", "prefill_tokens_per_s", "decode_tokens_per_s",
        "expires_at_s",  # fresh while the router's clock is below it
        # Scoring terms, so that a routing decision is a few multiplications per candidate
        # (see router.policy.predicted_ttft, which documents what they mean).
        "reported_load", "slots", "queue_base", "queue_ms_per_request", "kv_pressure_ms",
        "prefill_ms_per_token",
        "first_step_ms",  # one engine step (its inter-token latency)
        "engine_ms",  # kv_pressure_ms + first_step_ms: the engine's part of every request
        "utilisation",  # reported load per batch slot: what a region's ranking sorts by
    )

    heartbeat: Heartbeat
    received_at_s: float
    inflight_at_receipt: int
    worker_id: str
    region: str
    endpoint: str
    ready: bool
    ttl_s: float
    _digest: int | None
    served: tuple[str, ...]
    cache_tokens: int | None
    seq: int
    sent_at_s: float
    running: int
    waiting: int
    kv_cache_usage: float | None
    ttft_ms: float | None
    itl_ms: float | None
    e2e_ms: float | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    expires_at_s: float
    reported_load: int
    slots: int
    queue_base: int
    queue_ms_per_request: float
    kv_pressure_ms: float
    prefill_ms_per_token: float
    first_step_ms: float
    engine_ms: float
    utilisation: float

    def __init__(self, heartbeat: Heartbeat | None, received_at_s: float,
                 inflight_at_receipt: int = 0, next_read_s: float = 0.0) -> None:
        """The view of `heartbeat`; None makes a blank that `_same_worker` fills (the
        compiled build refuses `object.__new__` on this class, and its `__new__` runs
        `__init__`)."""
        self.received_at_s = received_at_s
        self.inflight_at_receipt = inflight_at_receipt
        if heartbeat is None:
            return
        self.heartbeat = heartbeat
        self.worker_id = heartbeat.worker_id
        self.region = heartbeat.region
        self.endpoint = heartbeat.endpoint
        self.ready = heartbeat.state is LifecycleState.READY
        self.ttl_s = heartbeat.ttl_s
        self._digest = None
        self.served = (*heartbeat.models, *heartbeat.lora_adapters)
        self.seq = heartbeat.seq
        self.sent_at_s = heartbeat.sent_at_s
        load, performance = heartbeat.load, heartbeat.performance
        self.running = load.running
        self.waiting = load.waiting
        self.kv_cache_usage = load.kv_cache_usage
        self.ttft_ms = performance.ttft_ms
        self.itl_ms = performance.itl_ms
        self.e2e_ms = performance.e2e_ms
        self.prefill_tokens_per_s = performance.prefill_tokens_per_s
        self.decode_tokens_per_s = performance.decode_tokens_per_s
        capacity = heartbeat.capacity
        self.slots = capacity.max_num_seqs
        blocks, block_size = capacity.kv_blocks_total, capacity.block_size_tokens
        self.cache_tokens = blocks * block_size if blocks and block_size else None
        self._derive(next_read_s)

    def _derive(self, next_read_s: float) -> None:
        """The scoring terms. Finite whatever the figures (the schema's limits keep them
        so; the comparisons here keep them so even for a view of a heartbeat that skipped
        validation): a NaN or infinite term would make every score NaN or inf."""
        slots = self.slots
        service_ms = self.e2e_ms
        if service_ms is None or not 0.0 < service_ms <= MAX_LATENCY_MS:  # NaN too
            service_ms = DEFAULT_SERVICE_MS
        kv_usage = self.kv_cache_usage
        pressure = 0.0
        if kv_usage is not None and kv_usage > KV_PRESSURE_START:
            pressure = min(1.0, (kv_usage - KV_PRESSURE_START) / (1.0 - KV_PRESSURE_START))
        rate = self.prefill_tokens_per_s
        if rate is None or not rate > 0.0:  # not measured yet (or NaN)
            rate = DEFAULT_PREFILL_TOKENS_PER_S
        elif rate < MIN_PREFILL_TOKENS_PER_S:
            rate = MIN_PREFILL_TOKENS_PER_S
        # The engine step that makes the first token: the prompt's prefill runs in one
        # step that also advances the batch by a token (worker.engine_performance takes
        # that step out of the prefill rate). On a busy engine the step under way ends
        # first (half a step on average), but pricing that as well made routing worse on
        # the benchmark's twin (skewed-3region: 98.3 -> 97.7 % SLO, P99 1,071 -> 1,152
        # ms; |error| p90 58 -> 67 %): busy by the last heartbeat is not busy now.
        step_ms = self.itl_ms
        if step_ms is None or not 0.0 < step_ms <= MAX_LATENCY_MS:  # NaN too
            decode = self.decode_tokens_per_s
            step_ms = (1000.0 / decode if decode is not None and decode >= 1.0
                       else DEFAULT_STEP_MS)
        self.expires_at_s = self.received_at_s + fresh_for_s(self.ttl_s, next_read_s)
        self.reported_load = load = self.running + self.waiting
        # Requests ahead of a new one that wait for a batch slot, less this router's open
        # requests on the worker when the heartbeat came (add those open now).
        self.queue_base = load - self.inflight_at_receipt + 1 - slots
        self.utilisation = load / slots
        self.queue_ms_per_request = service_ms / slots
        self.kv_pressure_ms = pressure * service_ms
        self.prefill_ms_per_token = 1000.0 / rate
        self.first_step_ms = step_ms
        self.engine_ms = self.kv_pressure_ms + self.first_step_ms

    def _same_worker(self, received_at_s: float, inflight_at_receipt: int) -> WorkerView:
        """A new view of this worker with what its heartbeat says of it (identity, models,
        capacity), received at `received_at_s`; the caller sets the rest."""
        view = WorkerView(None, received_at_s, inflight_at_receipt)
        view.heartbeat = self.heartbeat
        view.worker_id = self.worker_id
        view.region = self.region
        view.endpoint = self.endpoint
        view.ready = self.ready
        view.ttl_s = self.ttl_s
        view._digest = self._digest
        view.served = self.served
        view.cache_tokens = self.cache_tokens
        view.slots = self.slots
        return view

    def with_load(self, record: RecordItems, received_at_s: float,
                  inflight_at_receipt: int, next_read_s: float = 0.0) -> WorkerView:
        """This worker as a newer load record of the same heartbeat describes it
        (`record`: its items, as worker.load_records.record_items returns them), read at
        `received_at_s`; `next_read_s`: see `fresh_for_s`."""
        view = self._same_worker(received_at_s, inflight_at_receipt)
        (_, _, view.seq, view.sent_at_s, _, view.running, view.waiting, view.kv_cache_usage,
         view.ttft_ms, view.itl_ms, view.e2e_ms, view.prefill_tokens_per_s,
         view.decode_tokens_per_s, *_) = record
        view._derive(next_read_s)
        return view

    def load_items(self) -> LoadItems:
        """What another process needs to make this view again from the same heartbeat
        (`mirrored`): its order, load figures, receipt and freshness (router.registry.
        feed ships it to the router's sibling processes)."""
        return (self.worker_id, self.seq, self.sent_at_s, self.running, self.waiting,
                self.kv_cache_usage, self.ttft_ms, self.itl_ms, self.e2e_ms,
                self.prefill_tokens_per_s, self.decode_tokens_per_s, self.received_at_s,
                self.expires_at_s)

    def mirrored(self, items: LoadItems, inflight_at_receipt: int) -> WorkerView:
        """This worker as another process's view of the same heartbeat describes it
        (`items`: that view's `load_items`), with this process's open requests on it."""
        view = self._same_worker(items[11], inflight_at_receipt)
        (_, view.seq, view.sent_at_s, view.running, view.waiting, view.kv_cache_usage,
         view.ttft_ms, view.itl_ms, view.e2e_ms, view.prefill_tokens_per_s,
         view.decode_tokens_per_s, _, expires_at_s) = items
        view._derive(0.0)
        view.expires_at_s = expires_at_s  # the same monotonic clock (CLOCK_MONOTONIC)
        return view

    def refresh(self, items: LoadItems, inflight_at_receipt: int) -> bool:
        """Take `items` (another process's view of the same heartbeat: `load_items`) in
        place when its load and performance figures are the ones this view has: only the
        report's order, receipt and freshness move on, and the open requests it was
        received with (so none of what a snapshot ranks or bounds by changes: the one that
        holds this view stays right). False, changing nothing, when a figure differs:
        then `mirrored` makes the new view. The one exception to a view never changing,
        for router.registry.mirror: an idle worker's report every heartbeat made a view
        and a snapshot build in every sibling process."""
        if (self.running, self.waiting, self.kv_cache_usage, self.ttft_ms, self.itl_ms,
                self.e2e_ms, self.prefill_tokens_per_s,
                self.decode_tokens_per_s) != items[3:11]:
            return False
        self.seq, self.sent_at_s = items[1], items[2]
        self.received_at_s, self.expires_at_s = items[11], items[12]
        self.inflight_at_receipt = inflight_at_receipt
        self.queue_base = self.reported_load - inflight_at_receipt + 1 - self.slots
        return True

    def received_again(self, received_at_s: float, next_read_s: float = 0.0) -> WorkerView:
        """The same report, as if received at `received_at_s` (see the collector)."""
        view = self._same_worker(received_at_s, self.inflight_at_receipt)
        view.seq = self.seq
        view.sent_at_s = self.sent_at_s
        view.running = self.running
        view.waiting = self.waiting
        view.kv_cache_usage = self.kv_cache_usage
        view.ttft_ms = self.ttft_ms
        view.itl_ms = self.itl_ms
        view.e2e_ms = self.e2e_ms
        view.prefill_tokens_per_s = self.prefill_tokens_per_s
        view.decode_tokens_per_s = self.decode_tokens_per_s
        view.expires_at_s = received_at_s + fresh_for_s(self.ttl_s, next_read_s)
        view.reported_load = self.reported_load
        view.queue_base = self.queue_base
        view.utilisation = self.utilisation
        view.queue_ms_per_request = self.queue_ms_per_request
        view.kv_pressure_ms = self.kv_pressure_ms
        view.prefill_ms_per_token = self.prefill_ms_per_token
        view.first_step_ms = self.first_step_ms
        view.engine_ms = self.engine_ms
        return view

    @property
    def static_digest(self) -> int:
        """worker.load_records.static_digest of the heartbeat (computed once, when first asked)."""
        digest = self._digest
        if digest is None:
            digest = self._digest = static_digest(self.heartbeat)
        return digest

    def fresh(self, now_s: float) -> bool:
        return now_s < self.expires_at_s

    def newer_than(self, other: WorkerView) -> bool:
        """Whether this report supersedes `other` (same worker): later send time, then seq."""
        return (self.sent_at_s, self.seq) > (other.sent_at_s, other.seq)

    def __repr__(self) -> str:
        return (f"WorkerView({self.worker_id!r}, {self.region!r}, seq={self.seq}, "
                f"load={self.running}+{self.waiting}/{self.slots}, "
                f"received_at_s={self.received_at_s:.3f})")


def take_loads(views: dict[str, WorkerView], loads: list[LoadItems],
               inflight: Callable[[str], int]) -> tuple[bool, bool]:
    """Take another process's load figures (`loads`: its views' `load_items`, in a frame of
    router.registry.feed) into `views`, with this process's open requests on each worker
    (`inflight`): a view whose figures are the same is refreshed in place, any other is
    replaced by its `mirrored` copy; a worker not in `views` is skipped (dropped here
    first). Returns (a view was replaced, a view was refreshed). Here rather than in
    router.registry.mirror so that the compiled build runs the loop natively: a busy
    fleet sends every worker's figures at every read."""
    replaced = refreshed = False
    for items in loads:
        worker_id: str = items[0]
        current = views.get(worker_id)
        if current is None:
            continue
        open_now = inflight(worker_id)
        if current.refresh(items, open_now):
            refreshed = True
        else:
            views[worker_id] = current.mirrored(items, open_now)
            replaced = True
    return replaced, refreshed


def changes_since(views: list[tuple[str, WorkerView]], shipped: dict[str, WorkerView],
                  current: dict[str, WorkerView], heartbeats: list[WorkerView],
                  loads: list[LoadItems]) -> None:
    """For router.registry.feed, a part of a table's `views` (id, view) against the views
    the followers have (`shipped`): each goes into `current`, and out of `shipped`; a
    view they have is skipped, one of a heartbeat they have goes to `loads` as its
    `load_items`, any other to `heartbeats` (they are sent its JSON). What is left in
    `shipped` after the whole table has gone through is the workers that left. Here so
    that the compiled build scans the table natively (a busy fleet changes every view
    between two snapshots)."""
    for worker_id, view in views:
        current[worker_id] = view
        # Popped, not read: the views it replaced are freed here, a part at a time.
        old = shipped.pop(worker_id, None)
        if old is view:
            continue
        if old is not None and old.heartbeat is view.heartbeat:
            loads.append(view.load_items())
        else:
            heartbeats.append(view)
