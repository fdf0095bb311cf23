"""Hostile heartbeats and load records written to a real Valkey beside a good worker's:
the real collector of a real router (in front of a real simulator) refuses each one with
the reason the spec gives (tests.unit.test_heartbeat_fuzz), counts it by reason in
/metrics, takes what is valid, and the router serves every request meanwhile.

Each example is a batch, written in one pipeline: heartbeats on the routers' channel (not
as keys: a full read would parse a refused key again at every read, and count it again),
load records of workers nobody knows, and load records of workers the router knows
(`carriers`, published as agents publish), whose valid figures it must take. Heartbeats
that are taken join the fleet, at the simulator's address. The counts are printed
(`pytest -s`) for the README.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pydantic_core
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from redis.asyncio.client import Pipeline

from router.app import COLLECTOR, HOLDER
from router.registry.messages import WORKER_ID_FIELD
from tests.integration.operators_fleet import OpsFleet, Samples, chat, scrape, wait_for
from tests.unit.test_heartbeat_fuzz import (
    BASE_ITEMS,
    RECORD_ITEMS,
    TALLY,
    as_doc,
    base_heartbeat,
    heartbeat_reason,
    hostile_heartbeats,
    hostile_records,
    hostile_value,
    record_array,
    record_reason,
    render,
)
from worker.heartbeat_keys import HeartbeatKeys
from worker.load_records import load_record, static_digest
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect
from worker.schema import Heartbeat

pytestmark = pytest.mark.integration

PLACEHOLDER = b"http://127.0.0.1:9"  # the endpoint in generated heartbeats: the simulator's
BASE_ID = b'"fz-0"'  # the worker id in generated inputs: one of its own for each
EXAMPLES = 30
PER_EXAMPLE = 30  # heartbeats, as many load records, and one record of each carrier
CARRIERS = 2
FIGURES = range(5, 13)  # a load record's items from `running` on
REQUESTS_PER_EXAMPLE = 3
REFUSED = "globalpool_heartbeats_refused_total"
NOT_REFUSED = ("taken", "orphan", "applied")
numbering = itertools.count()
TOTALS: Counter[str] = Counter()


@pytest.fixture
async def started(fleet: OpsFleet) -> AsyncIterator[OpsFleet]:
    """One router in front of one simulator, whose worker `good` heartbeats; the counts
    are printed once every example has run."""
    await fleet.start({"good": "us-east"})
    yield fleet
    reasons = sorted((k[8:], v) for k, v in TOTALS.items() if k.startswith("refused "))
    print(f"\nheartbeat fuzzing (Valkey, the collector, a router): {TOTALS['heartbeats']:,} "
          f"heartbeats and {TOTALS['records']:,} load records; refused "
          f"{sum(v for _, v in reasons):,} ({', '.join(f'{k} {v}' for k, v in reasons)}); "
          f"heartbeats taken {TOTALS['taken']:,}, records of unknown workers "
          f"{TOTALS['orphan']:,}, carriers' records applied {TOTALS['applied']:,}; "
          f"requests {TOTALS['requests']:,}, every one 200")
    TALLY.update({f"integration {k}": v for k, v in TOTALS.items()})


def queued_as(payload: bytes) -> bytes | None:
    """The worker id the collector reads from a heartbeat's bytes to queue it by (its first
    worker_id field, to the next quote), or None when there is none."""
    start = payload.find(WORKER_ID_FIELD)
    if start < 0:
        return None
    start += len(WORKER_ID_FIELD)
    return payload[start:payload.find(b'"', start)]


def heartbeat_refusal(payload: bytes) -> str | None:
    """The spec's reason, or the collector's: a heartbeat whose bytes name another worker
    than it parses to (a field given twice) is refused."""
    reason = heartbeat_reason(payload)
    if reason is not None:
        return reason
    queued = queued_as(payload)
    worker_id = pydantic_core.from_json(payload)["worker_id"]
    return "worker_id_mismatch" if queued not in (None, worker_id.encode()) else None


def record_refusal(payload: bytes, worker_field: str) -> str | None:
    """The same for a record under `worker_field` of its region's hash: one naming another
    worker is refused."""
    reason = record_reason(payload)
    if reason is not None:
        return reason
    named = pydantic_core.from_json(payload)[1]
    return "worker_id_mismatch" if named != worker_field else None


def own(payload: bytes, worker_id: str, endpoint: str) -> bytes:
    """A generated input made this example's own: its worker id and the endpoint."""
    return payload.replace(BASE_ID, json.dumps(worker_id).encode()).replace(
        PLACEHOLDER, endpoint.encode())


@st.composite
def figures(draw: st.DrawFn) -> dict[int, bytes]:
    """Changes to a load record's figures: hostile, or valid anywhere in range."""
    index = st.sampled_from(FIGURES)
    return draw(st.dictionaries(index, st.one_of(*(
        hostile_value(RECORD_ITEMS[i][1]) for i in FIGURES)), max_size=3))


def carrier_record(carrier: Heartbeat, changes: dict[int, bytes]) -> bytes:
    """The carrier's next load record, its figures changed so."""
    items = [json.dumps(item).encode() for item in json.loads(load_record(
        carrier.model_copy(update={"seq": carrier.seq + 1}), static_digest(carrier)))]
    for index, raw in changes.items():
        items[index] = raw
    return b"[" + b",".join(items) + b"]"


@dataclass
class Batch:
    """What one example writes, and what the router must make of it."""

    keys: HeartbeatKeys
    expected: Counter[str] = field(default_factory=Counter)  # reason (or NOT_REFUSED) -> n
    taken: dict[str, bytes] = field(default_factory=dict)  # carrier -> its record applied
    queued: set[bytes] = field(default_factory=set)  # worker ids queued by the collector
    inputs: list[tuple[str | None, bytes]] = field(default_factory=list)  # reason, payload

    def heartbeats(self, pipe: Pipeline, generated: list[tuple[str, bytes]], example: int,
                   endpoint: str, start: int = 0) -> None:
        for index, (_, payload) in enumerate(generated, start=start):
            payload = own(payload, f"fz{example}-{index}", endpoint)
            name = queued_as(payload)
            if name in self.queued or payload.startswith(b"gone:"):
                continue  # one heartbeat per worker between builds: each is parsed once
            if name is not None:
                self.queued.add(name)
            pipe.publish(self.keys.channel, payload)
            reason = heartbeat_refusal(payload)
            self.expected[reason or "taken"] += 1
            self.inputs.append((reason, payload[:200]))
            TOTALS["heartbeats"] += 1

    def record(self, pipe: Pipeline, region: str, worker_field: str, payload: bytes,
               taken_as: str) -> None:
        """`taken_as`: what becomes of it when it is valid ("orphan", "applied", or the
        collector's reason to refuse it all the same)."""
        pipe.hset(self.keys.loads(region), worker_field, payload)
        reason = record_refusal(payload, worker_field)
        self.expected[reason or taken_as] += 1
        self.inputs.append((reason or taken_as, payload[:200]))
        if reason is None and taken_as == "applied":
            self.taken[worker_field] = payload
        TOTALS["records"] += 1

    def misplaced(self, pipe: Pipeline, carrier: Heartbeat, example: int,
                  endpoint: str) -> None:
        """Valid, but not where it belongs: the carrier's next record in another region's
        hash, a record under another worker's name, and a heartbeat whose bytes name
        another worker first."""
        elsewhere = "eu-west" if carrier.region == "us-east" else "us-east"
        self.record(pipe, elsewhere, carrier.worker_id, carrier_record(carrier, {}),
                    "wrong_region")
        self.record(pipe, "us-east", f"fz{example}-named",
                    own(record_array(BASE_ITEMS), f"fz{example}-other", endpoint), "orphan")
        first = json.dumps(f"fz{example}-first").encode()
        self.heartbeats(pipe, [("misplaced", render([("worker_id", first), *DOC]))],
                        example, endpoint, start=PER_EXAMPLE)

    @property
    def refusals(self) -> dict[str, int]:
        return {r: n for r, n in self.expected.items() if r not in NOT_REFUSED}


def refused_by_reason(before: Samples, after: Samples) -> dict[str, float]:
    """globalpool_heartbeats_refused_total{reason} counted between two scrapes."""
    counted = {labels: value - before.get((name, labels), 0.0)
               for (name, labels), value in after.items() if name == REFUSED}
    return {dict(labels)["reason"]: n for labels, n in counted.items() if n}


# No shrinking: against a live router it takes minutes; the assertions name the inputs.
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])
DOC = as_doc(json.loads(base_heartbeat().to_json()))


@FUZZ
@given(heartbeats=st.lists(hostile_heartbeats(DOC), min_size=PER_EXAMPLE,
                           max_size=PER_EXAMPLE),
       records=st.lists(hostile_records(BASE_ITEMS), min_size=PER_EXAMPLE,
                        max_size=PER_EXAMPLE),
       carried=st.lists(figures(), min_size=CARRIERS, max_size=CARRIERS),
       running=st.integers(0, 4))
async def test_the_router_counts_every_refusal_by_reason_and_keeps_serving(
        started: OpsFleet, heartbeats: list[tuple[str, bytes]],
        records: list[tuple[str, bytes]], carried: list[dict[int, bytes]],
        running: int) -> None:
    fleet = started
    app, sim_url = fleet.apps[0], fleet.sims["good"].url
    collector, holder = app[COLLECTOR], app[HOLDER]
    example = next(numbering)
    await fleet.publish("good", running=running)  # the good worker, as its agent does
    carriers = [base_heartbeat(f"carrier-{example}-{i}", ("us-east", "eu-west")[i % 2],
                               sim_url) for i in range(CARRIERS)]
    redis = connect(fleet.redis_url)
    publisher = HeartbeatPublisher(redis, HeartbeatKeys(fleet.key_prefix))
    try:
        for carrier in carriers:
            await publisher.publish(carrier)
        await wait_for(lambda: all(c.worker_id in holder.current.workers for c in carriers))
        batch = Batch(HeartbeatKeys(fleet.key_prefix),
                      queued={b"good", *(c.worker_id.encode() for c in carriers)})
        before = await scrape(fleet.url)
        refused_before = collector.rejected_heartbeats
        async with redis.pipeline(transaction=False) as pipe:
            batch.heartbeats(pipe, heartbeats, example, sim_url)
            for index, (_, payload) in enumerate(records):
                name = f"fz{example}-r{index}"
                batch.record(pipe, "us-east", name, own(payload, name, sim_url), "orphan")
            for carrier, changes in zip(carriers, carried, strict=True):
                batch.record(pipe, carrier.region, carrier.worker_id,
                             carrier_record(carrier, changes), "applied")
            batch.misplaced(pipe, carriers[0], example, sim_url)
            await pipe.execute()

        def caught_up() -> bool:
            views = holder.current.workers
            return (collector.rejected_heartbeats - refused_before
                    >= sum(batch.refusals.values())
                    and all(views[w].running == json.loads(p)[5] for w, p in batch.taken.items())
                    and views["good"].running == running)

        try:
            await wait_for(caught_up, timeout_s=15.0)
        except AssertionError:
            raise AssertionError(f"refused {collector.rejected_heartbeats - refused_before} "
                                 f"of {batch.refusals}; carriers {batch.taken}") from None
        for _ in range(REQUESTS_PER_EXAMPLE):
            status, _, answer = await chat(fleet.url)
            assert status == 200, answer[:300]
            TOTALS["requests"] += 1
        counted = refused_by_reason(before, await scrape(fleet.url))
        assert counted == batch.refusals, (counted, batch.refusals, batch.inputs)
        for worker_id, payload in batch.taken.items():  # the figures as the record says
            items = json.loads(payload)
            view = holder.current.workers[worker_id]
            assert (view.running, view.waiting, view.e2e_ms) == (items[5], items[6], items[10])
        TOTALS.update({f"refused {r}": n for r, n in batch.refusals.items()})
        TOTALS.update({k: batch.expected[k] for k in NOT_REFUSED})
    finally:
        await publisher.aclose()
