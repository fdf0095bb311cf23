"""Per cycle, in one process: the leader's shipping (ViewFeed._ship) and the follower's taking
(MirroredCollector._apply + build) of a busy 10,000-worker fleet, by thread CPU. Ad hoc (BENCHMARKS.md,
"Several router processes"): `.venv/bin/python docs/bench/processes/shared-view-compiled/ship_cost.py`
from the checkout for the pure build; with TREE=<a compiled copy (globalpool compile --out)> for the
compiled one. Redis is never contacted."""
import asyncio, os, sys, time, tempfile, marshal
sys.path.insert(0, os.environ.get("TREE", str(__import__("pathlib").Path(__file__).resolve().parents[4])))
from pathlib import Path
from router.registry import HeartbeatCollector, SnapshotHolder
from router.registry.feed import ViewFeed
from router.registry.mirror import MirroredCollector
from router.registry.worker_view import WorkerView
from worker.heartbeat_keys import HeartbeatKeys
from worker.redis_client import connect, connect_pubsub
from worker.schema import Capacity, Heartbeat, LifecycleState, Load, Performance
from router.event_loop import tune_gc, new_event_loop

N = 10_000
def hb(i):
    return Heartbeat(worker_id=f"hb-{i:05d}", region=f"region-{i % 20}", endpoint=f"http://127.0.{i%20}.1:{8000+i%1000}",
                     models=("m",), state=LifecycleState.READY, capacity=Capacity(max_num_seqs=8),
                     load=Load(running=i % 8, waiting=0, kv_cache_usage=0.3),
                     performance=Performance(ttft_ms=40.0, itl_ms=9.0, e2e_ms=700.0, prefill_tokens_per_s=5000.0),
                     seq=1, sent_at_s=1000.0, ttl_s=2.0)

async def main():
    url = "redis://127.0.0.1:1"  # never used
    keys = HeartbeatKeys("x")
    path = Path(tempfile.mkdtemp()) / "view.sock"
    first = HeartbeatCollector(redis=connect(url), pubsub_redis=connect_pubsub(url), keys=keys, holder=SnapshotHolder())
    second_c = HeartbeatCollector(redis=connect(url), pubsub_redis=connect_pubsub(url), keys=keys, holder=SnapshotHolder())
    second = MirroredCollector(second_c, path)
    table = first.table
    for i in range(N):
        v = WorkerView(hb(i), received_at_s=time.monotonic(), inflight_at_receipt=0)
        table.views[v.worker_id] = v
    table.connected = True; table.last_ok_at_s = time.monotonic()
    first.synced.set()
    feed = ViewFeed(table, path, first.synced, first.pace)
    serve = asyncio.create_task(feed.serve())
    await asyncio.sleep(0.2)
    mirror = asyncio.create_task(second.run())
    await asyncio.sleep(0.5)
    await feed._ship()  # FULL to the joiner
    for _ in range(50):
        await asyncio.sleep(0.05)
        if second.mirroring and len(second_c.table.views) == N: break
    print("mirroring", second.mirroring, len(second_c.table.views))
    rec = 0
    ship_s = []; follow_s = []; make_s = []
    for cycle in range(int(os.environ.get("CYCLES", "10"))):
        rec += 1
        t0 = time.thread_time()
        for wid, v in list(table.views.items()):
            r = v.running
            items = (None, None, v.seq + 1, v.sent_at_s + 0.5, None, (r + 1) % 8, v.waiting, v.kv_cache_usage,
                     v.ttft_ms, v.itl_ms, v.e2e_ms, v.prefill_tokens_per_s, v.decode_tokens_per_s)
            table.views[wid] = v.with_load(items, time.monotonic(), 0)
        make_s.append(time.thread_time() - t0)
        up0 = second_c.pace.upkeep_cpu_s
        builds0 = second_c.pace.builds
        await feed._ship()
        ship_s.append(first.pace.shipped_s)
        for _ in range(200):
            await asyncio.sleep(0.01)
            if second_c.pace.builds > builds0 and not second._changed: break
        await asyncio.sleep(0.05)
        follow_s.append(second_c.pace.upkeep_cpu_s - up0)
    ms = lambda xs: sorted(xs)[len(xs)//2] * 1000
    print(f"per cycle (median): leader making views {ms(make_s):.1f} ms; leader shipping {ms(ship_s):.1f} ms; follower taking+building {ms(follow_s):.1f} ms")
    mirror.cancel(); serve.cancel()

tune_gc()
loop = new_event_loop()
loop.run_until_complete(main())
