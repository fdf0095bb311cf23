"""`globalpool bench-heartbeats`: the router's CPU to keep its snapshot fresh.

An embedded Valkey, `--publishers` processes (lab.benchproxy.hbpublish) writing what
agents write (the heartbeat JSON, a load record, a message when something other than load
changes; with `--legacy-agents` a message for every heartbeat, as before load records)
for `--workers` workers across 10 regions at `--hz` each, and the real router (`python -m
router.cli router`, its collector as in production) on its own core, serving no
requests. Once the router sees (nearly) every worker and its pace has settled (its
reading interval grows from 20 ms at start), its process CPU time is read over
`--seconds`; meanwhile its worker count (GET /health) and the subscriber's output buffer
in Valkey (CLIENT LIST) are sampled: a buffer that grows means the router falls behind
the heartbeats. Then what keeping the view does to requests: /health asked every 20 ms for
`WAITS_S` (how long a request waits for the router's event loop, which a heartbeat cycle
or a scrape can hold), and a /metrics scrape and an /admin/status read timed with the
same probe running. Then the router's collector alone (lab.benchproxy.hbcollect). If
the publishers cannot reach the target rate on this machine, the router's CPU at the
target is extrapolated linearly and marked so.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from lab.benchproxy import procs
from lab.benchproxy.cpu import tree_cpu_s
from lab.benchproxy.decision import REGIONS, ten_regions
from lab.benchproxy.stats import summarize
from router.config import DEFAULT_FLEET_VIEW_CPU_SHARE

WARM_TIMEOUT_S = 30.0
# The router's idle CPU is measured over IDLE_S, IDLE_SETTLE_S after it first answers.
IDLE_SETTLE_S = 3.0
IDLE_S = 8.0
WAITS_S = 10.0  # the request-wait probe's window (at most `--seconds`)
PROBE_EVERY_S = 0.02
# What the status page asks for every second (router/admin/status.html: MAX_WORKERS).
STATUS_PAGE_READ = "/admin/status?workers=500"
# The view's age: this many /admin/status reads (after the windows above), 0.1-0.6 s apart
# at random, so that they do not fall in step with the router's reads of the records.
VIEW_AGE_READS = 8
SETTLE_TIMEOUT_S = 20.0  # for the router's pace to settle before the window (`_settled`)
AGE_BIN_MS = 100  # the plot's bars


def _rss_mb(pid: int) -> float | None:
    """Resident memory of `pid` (Linux /proc), in MB; None elsewhere."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def router_config(redis_url: str, prefix: str, port: int,
                  cpu_share: float = DEFAULT_FLEET_VIEW_CPU_SHARE,
                  signed: bool = True) -> dict[str, Any]:
    regions = ten_regions().model_dump(include={"regions"})["regions"]
    return {
        "apiVersion": "globalpool/v1",
        "redis": {"url": redis_url, "key_prefix": prefix},
        "router": {"region": REGIONS[0], "host": "127.0.0.1", "port": port,
                   "fleet_view_cpu_share": cpu_share},
        # An unsigned run believes unsigned heartbeats: the explicit opt-out.
        "heartbeat": {"interval_s": 0.25, "ttl_s": 1.0, "insecure": not signed},
        "regions": {name: {"models": r["models"], "rtt_ms": r["rtt_ms"]}
                    for name, r in regions.items()},
    }


async def _idle_cpu_pct(session: aiohttp.ClientSession, health: str, valkey: Any,
                        pid: int, seconds: float) -> float | None:
    """The router's CPU (% of a core, its whole process tree) over IDLE_S (at most the
    measured window's `seconds`) once it answers /health (IDLE_SETTLE_S after, at most
    half that), before any worker heartbeats; None if it never answers."""
    deadline = time.monotonic() + WARM_TIMEOUT_S
    while (await _sample(session, health, valkey))[0] < 0:
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.2)
    await asyncio.sleep(min(IDLE_SETTLE_S, seconds / 2))
    window_s = min(IDLE_S, seconds)
    before = tree_cpu_s(pid)
    await asyncio.sleep(window_s)
    after = tree_cpu_s(pid)
    return None if before is None or after is None else (after - before) / window_s * 100


async def _sample(session: aiohttp.ClientSession, url: str, valkey: Any) -> tuple[int, int]:
    """(workers the router knows, bytes queued in Valkey for its subscription)."""
    workers = -1
    try:
        async with session.get(url) as answer:
            workers = int((await answer.json())["workers"])
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
        pass
    queued = 0
    for client in await valkey.client_list(_type="pubsub"):
        queued = max(queued, int(client.get("omem", 0)))
    return workers, queued


def unit_costs_us(signed: bool, batches: int = 5, per_batch: int = 2000) -> dict[str, float]:
    """Per-heartbeat costs of the steps the collector runs on every message, without Redis
    (medians over batches, in CPU us, so a busy shared machine does not inflate them):
    parse + validate the JSON (`Heartbeat.from_json`), the gate (signature check when
    `signed`), and `Snapshot.build` of 10,000 workers; for a load record: parse + validate,
    the gate (asked only when signed), and the worker's new view."""
    from lab.benchproxy.hbpublish import worker_heartbeat
    from router.admission.setup import heartbeat_gate
    from router.core.stats import SecurityStats
    from router.registry.snapshot import Snapshot
    from router.registry.worker_view import WorkerView
    from worker.load_records import LoadRecord, load_record, record_items
    from worker.schema import Heartbeat
    from worker.signing import HeartbeatSigner

    secret = b"0123456789abcdef0123"
    heartbeat = worker_heartbeat(7, len(REGIONS), 1.0).model_copy(
        update={"sent_at_s": time.time(), "seq": 1})
    signer = HeartbeatSigner(key_id="bench", secret=secret)
    if signed:  # as agents publish them (worker.publisher)
        heartbeat, payload = signer.signed_payload(heartbeat)
        record = signer.signed_record(load_record(heartbeat))
    else:
        payload = heartbeat.to_json().encode()
        record = load_record(heartbeat)
    config = ten_regions()
    gate = heartbeat_gate(lambda: config, {"bench": secret} if signed else {}, SecurityStats())

    def median_us(step: Any) -> float:
        times = []
        for _ in range(batches):
            started = time.process_time()
            for _ in range(per_batch):
                step()
            times.append((time.process_time() - started) / per_batch * 1e6)
        return sorted(times)[len(times) // 2]

    parsed = Heartbeat.from_json(payload)
    view = WorkerView(parsed, 0.0)
    items = record_items(record)
    views = [WorkerView(worker_heartbeat(i, len(REGIONS), 1.0), 0.0) for i in range(10_000)]
    started = time.process_time()
    Snapshot.build(views, built_at_s=0.0, redis_connected=True, last_redis_ok_at_s=0.0)
    build_ms = (time.process_time() - started) * 1000
    return {
        "from_json_us": median_us(lambda: Heartbeat.from_json(payload)),
        "gate_us": median_us(lambda: gate.check(parsed, via_pubsub=False, payload=payload)),
        "snapshot_build_10k_ms": build_ms,
        "payload_bytes": len(payload),
        "record_parse_us": median_us(lambda: record_items(record)),
        # The collector asks the gate about records only when it signs
        # (router/registry/load_records.py).
        "record_gate_us": median_us(lambda: gate.check_record(LoadRecord.of(items), record,
                                                              view)) if signed else 0.0,
        "record_view_us": median_us(lambda: view.with_load(items, 1.0, 0)),
        "record_bytes": len(record),
    }


async def _waits(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[float]:
    """Milliseconds each GET of `url` (/health: ~1 ms when the router is free) took, one
    every PROBE_EVERY_S until `stop` (a failed one: the time it took to fail)."""
    waits = []
    while not stop.is_set():
        started = time.perf_counter()
        try:
            async with session.get(url) as answer:
                await answer.read()
        except (aiohttp.ClientError, TimeoutError):
            pass
        waits.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(PROBE_EVERY_S)
    return waits


async def _request_waits(session: aiohttp.ClientSession, port: int, token: str,
                         seconds: float) -> dict[str, Any]:
    """/health's latency while the router keeps its view (`seconds`), then during one
    /metrics scrape, one whole /admin/status read and one as the status page reads it
    (their time, size and the longest wait)."""
    base = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    probe = asyncio.create_task(_waits(session, f"{base}/health", stop))
    await asyncio.sleep(seconds)
    stop.set()
    result: dict[str, Any] = {"idle": summarize(await probe)}
    for path in ("/metrics", "/admin/status", STATUS_PAGE_READ):
        stop = asyncio.Event()
        probe = asyncio.create_task(_waits(session, f"{base}/health", stop))
        await asyncio.sleep(0.2)
        started = time.perf_counter()
        status: int | str
        try:
            async with session.get(f"{base}{path}",
                                   headers={"Authorization": f"Bearer {token}"}) as answer:
                body = await answer.read()
                status = answer.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            body, status = b"", str(exc) or type(exc).__name__
        took_ms = (time.perf_counter() - started) * 1000
        await asyncio.sleep(0.2)
        stop.set()
        result[path] = {"status": status, "bytes": len(body), "ms": took_ms,
                        "longest_wait_ms": max(await probe)}
    return result


async def until_settled(interval: Callable[[], Awaitable[float | None]]) -> float | None:
    """Wait (up to SETTLE_TIMEOUT_S) until the collector's reading interval, as `interval`
    reads it, stops growing: it starts at 20 ms and grows by at most 1.5x a build
    (router.registry.collector), a few seconds of start-up at 10,000 workers that are not
    what keeping the view costs. The interval it settled at, or None."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last = None
    while time.monotonic() < deadline:
        now = await interval()
        if now is not None and last is not None and now <= 1.2 * last:
            return now
        last = now
        await asyncio.sleep(1.0)
    return last


async def _rebuild_interval(session: aiohttp.ClientSession, port: int) -> float | None:
    return (await _router_counts(session, port)).get(
        "globalpool_fleet_view_rebuild_interval_seconds")


async def _view_ages(session: aiohttp.ClientSession, port: int, token: str,
                     reads: int = VIEW_AGE_READS) -> dict[str, Any]:
    """How old the router's view of its workers is: every worker's `heartbeat_age_s` (since
    the router took its latest heartbeat or load record) in `reads` /admin/status reads
    over a few seconds, in ms; a worker's record was up to one heartbeat interval old
    already when the router read it."""
    ages: list[float] = []
    spacing = random.Random(reads)
    for n in range(reads):
        if n:
            await asyncio.sleep(spacing.uniform(0.1, 0.6))
        try:
            async with session.get(f"http://127.0.0.1:{port}/admin/status",
                                   headers={"Authorization": f"Bearer {token}"}) as answer:
                document = await answer.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            continue
        ages += [worker["heartbeat_age_s"] * 1000 for worker in document.get("workers", ())]
    if not ages:
        return {"count": 0}
    bins: dict[int, int] = {}
    for age in ages:
        start = int(age // AGE_BIN_MS * AGE_BIN_MS)
        bins[start] = bins.get(start, 0) + 1
    return {**summarize(ages), "histogram": dict(sorted(bins.items()))}


def chart(result: dict[str, Any], path: Path) -> bool:
    """The router's CPU second by second against the goal, and how old its views were;
    False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (cpu, ages) = plt.subplots(1, 2, figsize=(11, 4))
    timeline = [t for t in result["timeline"] if t["router_cpu_pct"] is not None]
    cpu.plot([t["t_s"] for t in timeline], [t["router_cpu_pct"] for t in timeline],
             marker="o", label="router")
    cpu.axhline(result["router_cpu_pct"], color="tab:blue", linestyle=":",
                label=f"router, over the window ({result['router_cpu_pct']:.1f}%)")
    cpu.axhline(10, color="grey", linestyle="--", label="goal: 10% of a core")
    cpu.set_ylim(bottom=0)
    cpu.set_xlabel("s into the window")
    cpu.set_ylabel("% of one core")
    cpu.set_title(f"{result['workers']:,} workers x {result['hz']:g} Hz "
                  f"({'signed' if result['signed'] else 'unsigned'}): router CPU")
    cpu.legend(fontsize=8)
    histogram = (result.get("view_age_ms") or {}).get("histogram") or {}
    if histogram:
        ages.bar([float(start) for start in histogram], list(histogram.values()),
                 width=AGE_BIN_MS, align="edge")
    interval = result.get("router_rebuild_interval_s")
    if interval is not None:
        ages.axvline(interval * 1000, color="grey", linestyle="--",
                     label=f"reading interval at the end ({interval:.2f} s)")
        ages.legend(fontsize=8)
    ages.set_xlabel("age of a worker's view (ms since the router took its record)")
    ages.set_ylabel("worker views")
    ages.set_title(f"How old the router's view was ({VIEW_AGE_READS} status reads)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


async def _disconnections(valkey: Any) -> int:
    """Clients Valkey cut off for an output buffer over its limit: a subscriber that
    fell too far behind the heartbeats (pub/sub limit: 32 MB, or 8 MB for 60 s)."""
    stats = await valkey.info("stats")
    return int(stats.get("client_output_buffer_limit_disconnections", 0))


async def _router_counts(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    """From the router's /metrics: heartbeats whose signature it checked (signed runs
    only) and its own account of the CPU spent keeping the fleet view."""
    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as answer:
            text = await answer.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    found = {}
    for line in text.splitlines():
        for name in ("globalpool_heartbeats_verified", "globalpool_fleet_view_cpu_seconds",
                     "globalpool_fleet_view_rebuild_interval_seconds"):
            if line.startswith(name):
                found[name] = float(line.split()[-1])
    return found


def _rate(before: dict[str, float], after: dict[str, float], name: str,
          elapsed: float) -> float | None:
    if name not in before or name not in after:
        return None
    return (after[name] - before[name]) / elapsed


def compiled_router_tree(log: Path) -> Path:
    """The compiled copy of this checkout that bench-proxy measures (built or brought up
    to date here: `globalpool compile`, ~1-3 min). Raises router.compiled.CompileError."""
    from lab.benchproxy.routers import compiled_copy_dir
    from router.compiled import CompileError, build_copy, source_checkout

    source = source_checkout()
    if source is None:
        raise CompileError("not run from a checkout: an installed globalpool is measured "
                           "as it was installed")
    return build_copy(source, compiled_copy_dir(), log)


async def main(*, workers: int, hz: float, seconds: float, publishers: int, signed: bool,
               out: Path | None, legacy: bool = False,
               cpu_share: float = DEFAULT_FLEET_VIEW_CPU_SHARE, tap_watched: bool = False,
               processes: int = 1, busy: bool = False, compiled: bool = False) -> int:
    from redis.asyncio import Redis

    from lab.devstack.valkey import EmbeddedValkey

    work = Path(tempfile.mkdtemp(prefix="gp-hbbench-")) if out is None else out
    work.mkdir(parents=True, exist_ok=True)
    tree = None
    if compiled:
        from router.compiled import CompileError

        try:
            tree = await asyncio.to_thread(compiled_router_tree, work / "compile.log")
        except CompileError as exc:
            print(f"--compiled: {exc}")
            return 1
    cores = procs.usable_cores()
    router_cores, load_cores = ({cores[0]}, set(cores[1:])) if len(cores) > 1 else (None, None)
    if load_cores:
        os.sched_setaffinity(0, load_cores)
    core_share = await asyncio.to_thread(procs.core_share, router_cores)
    valkey = EmbeddedValkey.start(die_with_parent=True, log_path=work / "valkey.log")
    if load_cores:
        os.sched_setaffinity(valkey.pid, load_cores)
    prefix = f"hbbench-{secrets.token_hex(4)}"
    port = procs.free_port()
    config = work / "hb-regions.yaml"
    config.write_text(yaml.safe_dump(router_config(valkey.url, prefix, port, cpu_share,
                                                   signed)))
    key = f"bench:{secrets.token_hex(16)}"
    env = {**os.environ, "GLOBALPOOL_LOG_LEVEL": "WARNING",
           "GLOBALPOOL_ROUTER_PROCESSES": str(processes)}
    if tree is not None:  # the router (and the collector alone) from the compiled copy
        env["PYTHONPATH"] = str(tree)
    env.pop("REDIS_URL", None)
    if signed:
        env["GLOBALPOOL_HEARTBEAT_KEYS"] = key
    admin_token = secrets.token_hex(16)
    env["GLOBALPOOL_ADMIN_TOKEN"] = admin_token
    run_s = WARM_TIMEOUT_S + 2 * seconds + 30.0  # stopped early with SIGTERM
    share = -(-workers // publishers)
    publisher_processes: list[subprocess.Popen[bytes]] = []

    def start_publishers() -> None:
        for n in range(publishers):
            args = [sys.executable, "-m", "lab.benchproxy.hbpublish", "--redis-url",
                    valkey.url, "--prefix", prefix, "--first", str(n * share),
                    "--last", str(min(workers, (n + 1) * share)), "--hz", str(hz),
                    "--seconds", str(run_s), "--regions", str(len(REGIONS)),
                    # Four beats per TTL, as the agents' defaults keep (0.5 s, 2 s).
                    "--ttl-s", f"{max(1.0, 4.0 / hz):g}"]
            if signed:
                args += ["--sign", key]
            if legacy:
                args.append("--legacy")
            if tap_watched:
                args.append("--tap-watched")
            if busy:
                args.append("--busy")
            publisher_processes.append(procs.start(args, cores=load_cores, stdout_pipe=True,
                                                   log_path=work / f"hbpublish-{n}.log"))

    router = procs.start([sys.executable, "-m", "router.cli", "router", "--config", str(config),
                          "--port", str(port)], cores=router_cores, env=env, cwd=tree,
                         log_path=work / "hb-router.log")
    redis = Redis.from_url(valkey.url)
    health = f"http://127.0.0.1:{port}/health"
    result: dict[str, Any] = {"workers": workers, "hz": hz, "target_per_s": workers * hz,
                              "signed": signed, "publishers": publishers, "seconds": seconds,
                              "fleet_view_cpu_share": cpu_share,
                              "agents": "legacy (every heartbeat a message)" if legacy
                              else "load records",
                              "tap_watched": tap_watched, "router_processes": processes,
                              "busy_agents": busy,
                              "build": "compiled (mypyc)" if compiled else "pure Python",
                              "router_core_share": core_share,
                              "pinning": "router on core 0, Valkey and publishers on core 1"
                              if router_cores else "not pinned"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            # The router's own cost with no fleet (its processes' timers, Redis polls):
            # what it spends beyond this below is following the fleet.
            result["idle_router_cpu_pct"] = await _idle_cpu_pct(session, health, redis,
                                                                router.pid, seconds)
            start_publishers()
            deadline = time.monotonic() + WARM_TIMEOUT_S
            seen = -1
            while time.monotonic() < deadline:
                seen, _ = await _sample(session, health, redis)
                if seen >= 0.95 * workers:
                    break
                await asyncio.sleep(0.5)
            result["warm_workers_seen"] = seen
            result["settled_interval_s"] = await until_settled(
                lambda: _rebuild_interval(session, port))
            cpu_before, started = tree_cpu_s(router.pid), time.monotonic()
            valkey_before = tree_cpu_s(valkey.pid)
            drops_before = await _disconnections(redis)
            counts_before = await _router_counts(session, port)
            samples = []
            timeline = []
            last_cpu = cpu_before
            while time.monotonic() - started < seconds:
                await asyncio.sleep(1.0)
                samples.append(await _sample(session, health, redis))
                now_cpu = tree_cpu_s(router.pid)
                timeline.append({"t_s": round(time.monotonic() - started, 1),
                                 "workers": samples[-1][0], "backlog_bytes": samples[-1][1],
                                 "router_cpu_pct": None if now_cpu is None or last_cpu is None
                                 else round((now_cpu - last_cpu) * 100, 0)})
                last_cpu = now_cpu
            cpu_after, elapsed = tree_cpu_s(router.pid), time.monotonic() - started
            valkey_after = tree_cpu_s(valkey.pid)
            result["router_rss_mb"] = _rss_mb(router.pid)
            result["valkey_rss_mb"] = _rss_mb(valkey.pid)
            drops = await _disconnections(redis) - drops_before
            counts_after = await _router_counts(session, port)
            result["request_waits"] = await _request_waits(session, port, admin_token,
                                                           min(WAITS_S, seconds))
            result["view_age_ms"] = await _view_ages(session, port, admin_token)
        procs.stop(router)
        # The collector alone, under the same heartbeats (lab.benchproxy.hbcollect).
        collector = procs.start(
            [sys.executable, "-m", "lab.benchproxy.hbcollect", "--redis-url", valkey.url,
             "--prefix", prefix, "--seconds", str(seconds), "--cpu-share", str(cpu_share),
             *(["--keys", key] if signed else [])],
            cores=router_cores, log_path=work / "hbcollect.log", stdout_pipe=True,
            env=None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}, cwd=tree)
        output, _ = await asyncio.to_thread(collector.communicate, None, seconds + 60)
        lines = output.decode().strip().splitlines()
        result["collector_alone"] = (
            json.loads(lines[-1]) if collector.returncode == 0 and lines
            else {"failed": procs.log_tail(work / "hbcollect.log", 500)})
        achieved = []
        for process in publisher_processes:
            process.terminate()
            output, _ = await asyncio.to_thread(process.communicate, None, 30)
            achieved.append(json.loads(output.decode().strip().splitlines()[-1]))
    finally:
        for process in publisher_processes:
            procs.stop(process)
        procs.stop(router)
        await redis.aclose()
        valkey.stop()
    if cpu_before is None or cpu_after is None:
        print(f"the router exited: {procs.log_tail(work / 'hb-router.log')}")
        return 1
    rate = sum(a["achieved_per_s"] for a in achieved)
    view_cpu = _rate(counts_before, counts_after, "globalpool_fleet_view_cpu_seconds", elapsed)
    cpu_pct = (cpu_after - cpu_before) / elapsed * 100
    alone = result["collector_alone"]
    if "cpu_pct" in alone:  # per heartbeat published, whichever way it reached the router
        alone["cpu_us_per_heartbeat"] = alone["cpu_pct"] / 100 / rate * 1e6
    result.update(
        achieved_per_s=rate, router_cpu_pct=cpu_pct,
        router_cpu_us_per_heartbeat=(cpu_after - cpu_before) / (rate * elapsed) * 1e6,
        valkey_cpu_pct=((valkey_after or 0) - (valkey_before or 0)) / elapsed * 100,
        workers_seen_min=min(s[0] for s in samples), workers_seen_max=max(s[0] for s in samples),
        subscriber_queue_bytes_max=max(s[1] for s in samples),
        subscriber_queue_bytes_last=samples[-1][1],
        publishers_detail=achieved, timeline=timeline,
        subscriber_disconnections=drops,
        keeps_up=drops == 0 and min(s[0] for s in samples) >= 0.95 * workers,
        # How often the router reads the load records and rebuilds (at the window's end).
        router_rebuild_interval_s=counts_after.get(
            "globalpool_fleet_view_rebuild_interval_seconds"),
        router_verified_per_s=_rate(counts_before, counts_after,
                                    "globalpool_heartbeats_verified", elapsed),
        # The router's own account (globalpool_fleet_view_cpu_seconds_total), as a share.
        router_fleet_view_cpu_pct=None if view_cpu is None else view_cpu * 100,
        extrapolated_cpu_pct_at_target=(cpu_pct * workers * hz / rate
                                        if rate < 0.95 * workers * hz else None),
    )
    result["unit_costs"] = await asyncio.to_thread(unit_costs_us, signed)
    print(render(result))
    if out is not None:
        (out / "heartbeats.json").write_text(json.dumps(result, indent=1))
        if not chart(result, out / "heartbeats.png"):
            print("(no plot: matplotlib is not installed)")
    return 0


def _pct(share: float | None) -> str:
    return "?" if share is None else f"{share * 100:.0f}%"


def render(r: dict[str, Any]) -> str:
    lines = [
        f"heartbeat plane: {r['workers']:,} workers x {r['hz']:g} Hz = target "
        f"{r['target_per_s']:,.0f}/s; achieved {r['achieved_per_s']:,.0f}/s "
        f"({'signed' if r['signed'] else 'unsigned'}; agents: {r.get('agents', '?')}"
        f"{', busy' if r.get('busy_agents') else ''}; "
        f"router processes: {r.get('router_processes', 1)}; "
        f"fleet_view_cpu_share {r.get('fleet_view_cpu_share', DEFAULT_FLEET_VIEW_CPU_SHARE):g}; "
        f"{r['publishers']} publisher processes; "
        f"{r['pinning']}; a busy process got {_pct(r['router_core_share'])} of the router "
        "core)",
        f"  router CPU: {r['router_cpu_pct']:.1f}% of one core over {r['seconds']:g} s "
        f"({r['router_cpu_us_per_heartbeat']:.1f} us per heartbeat); Valkey "
        f"{r['valkey_cpu_pct']:.0f}%"
        + ("" if r.get("router_rss_mb") is None else
           f"; memory (RSS): router {r['router_rss_mb']:.0f} MB, Valkey "
           f"{r['valkey_rss_mb']:.0f} MB")
        + ("" if r.get("router_fleet_view_cpu_pct") is None else
           f"; of the router's, keeping the fleet view by its own account "
           f"(globalpool_fleet_view_cpu_seconds_total): {r['router_fleet_view_cpu_pct']:.1f}%")
        + ("" if r.get("idle_router_cpu_pct") is None else
           f"; the router idle, before any heartbeat: {r['idle_router_cpu_pct']:.1f}% (so "
           f"following the fleet: {r['router_cpu_pct'] - r['idle_router_cpu_pct']:.1f}%)"),
        f"  workers in the router's snapshot: {r['workers_seen_min']}..{r['workers_seen_max']}; "
        f"subscriber backlog in Valkey: max {r['subscriber_queue_bytes_max']:,} B, "
        f"last {r['subscriber_queue_bytes_last']:,} B; disconnected by Valkey "
        f"{r['subscriber_disconnections']} time(s) -> "
        f"{'KEEPS UP' if r['keeps_up'] else 'FALLS BEHIND'}",
    ]
    alone = r.get("collector_alone")
    if alone and "failed" in alone:
        lines.append(f"  collector alone: FAILED - {alone['failed']}")
    elif alone:
        per = alone["cpu_us_per_heartbeat"]
        lines.append(
            f"  collector alone: {alone['cpu_pct']:.1f}% CPU = {per:.2f} us per published "
            f"heartbeat; messages received {alone['received_per_s']:,.0f}/s (parsed "
            f"{alone['parsed_per_s']:,.0f}/s), load records read "
            f"{alone['records_read_per_s']:,.0f}/s (taken "
            f"{alone['records_applied_per_s']:,.0f}/s); {alone['snapshots_per_s']:.1f} "
            f"snapshots/s; {r['target_per_s']:,.0f}/s would need "
            f"{per * r['target_per_s'] / 1e4:.1f}% of one core")
    units = r.get("unit_costs")
    if units:
        per = units["from_json_us"] + units["gate_us"]
        lines.append(
            f"  per heartbeat without Redis: Heartbeat.from_json {units['from_json_us']:.1f} us "
            f"({units['payload_bytes']} B) + gate {units['gate_us']:.1f} us = {per:.1f} us -> "
            f"{per * r['target_per_s'] / 1e4:.0f}% of a core at the target rate, before "
            f"pub/sub reading and Snapshot.build ({units['snapshot_build_10k_ms']:.1f} ms per "
            "build of 10,000 workers)")
    if units and "record_parse_us" in units:
        per = units["record_parse_us"] + units["record_gate_us"] + units["record_view_us"]
        lines.append(
            f"  per load record without Redis: parse {units['record_parse_us']:.2f} us "
            f"({units['record_bytes']} B) + gate {units['record_gate_us']:.2f} us + view "
            f"{units['record_view_us']:.2f} us = {per:.2f} us")
    waits = r.get("request_waits")
    if waits:
        idle = waits["idle"]
        lines.append(
            f"  requests meanwhile (/health every {PROBE_EVERY_S * 1000:.0f} ms, "
            f"{idle['count']} times): p50 {idle['p50']:.1f} ms, p99 {idle['p99']:.1f} ms, max "
            f"{idle['max']:.1f} ms; "
            + "; ".join(f"{path}: {w['bytes'] / 1e6:.1f} MB in {w['ms']:.0f} ms (status "
                        f"{w['status']}; longest /health meanwhile {w['longest_wait_ms']:.0f} ms)"
                        for path, w in waits.items() if path != "idle"))
    ages = r.get("view_age_ms")
    if ages and ages.get("count"):
        interval = r.get("router_rebuild_interval_s")
        lines.append(
            "  the router's view: "
            + ("" if interval is None else f"records read and snapshot rebuilt every "
               f"{interval:.2f} s; ")
            + f"age of its {ages['count']:,} worker views ({VIEW_AGE_READS} status reads): "
            f"p50 {ages['p50']:.0f} ms, p99 {ages['p99']:.0f} ms, max {ages['max']:.0f} ms "
            f"(plus up to {1000 / r['hz']:.0f} ms the record had waited in Redis)")
    if r.get("router_verified_per_s") is not None:
        lines.append(f"  heartbeats verified by the router: {r['router_verified_per_s']:,.0f}/s")
    if r.get("extrapolated_cpu_pct_at_target") is not None:
        lines.append(f"  EXTRAPOLATED (linear) to the target rate: "
                     f"{r['extrapolated_cpu_pct_at_target']:.0f}% of one core")
    return "\n".join(lines)
