"""`globalpool bench-proxy --throughput`: requests a second through the compiled router
with 1 and with 2 router processes (`GLOBALPOOL_ROUTER_PROCESSES`), under wrk.

wrk (a C load generator: Debian's `wrk`) sends small non-streaming chat completions
(bench-proxy's `unary` body, 32 tokens back) over `--wrk-connections` keep-alive
connections from one thread, for `--wrk-seconds` after a 2 s warm-up that is not counted,
to the router in front of bench-proxy's fake backends. Each variant is measured

- **unpinned**: nothing pinned, so the router processes, wrk, the backends and Valkey
  share every core of the machine (on 2 cores: two router processes can only gain what
  the load generator and backends leave them);
- **pinned**: as bench-proxy pins (router processes on the first core; wrk, backends,
  Valkey and this orchestrator on the others): the processes then share one core.

Rounds alternate 1 and 2 processes. Per run: requests/s and latency p50/p99 (wrk's own
histogram, read from a Lua `done()` that prints them as JSON), and the CPU time of the
router's process tree (supervisor and children, lab.benchproxy.cpu) per request, of the
backends and of wrk. Written to throughput.json, throughput.md and throughput.png in
`--out`.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.benchproxy import procs
from lab.benchproxy.cpu import cpu_by_process, tree_cpu_s
from lab.benchproxy.peers import PeerEnv
from lab.benchproxy.report import core_share_note
from lab.benchproxy.routers import Context, Running, compiled_tree, start_compiled_processes
from lab.benchproxy.unavailable import Unavailable
from lab.benchproxy.workloads import workloads

WARMUP_S = 2.0
PROCESS_COUNTS = (1, 2)
MARK = "GPBENCH-WRK "

# wrk runs this script: every request the same POST; at the end one JSON line with what
# the summary and the latency histogram (microseconds) hold.
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[%(body)s]==]

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%(mark)s{"requests":%%d,"duration_us":%%d,"bytes":%%d,' ..
    '"errors":{"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d},' ..
    '"latency_us":{"p50":%%d,"p90":%%d,"p99":%%d,"max":%%d,"mean":%%.1f}}\\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean))
end
"""


def wrk_script(body: bytes) -> str:
    """The Lua script for a POST of `body` (JSON: no `]==]` in it)."""
    text = body.decode()
    if "]==]" in text:
        raise ValueError("the body cannot hold ']==]'")
    return WRK_SCRIPT % {"body": text, "mark": MARK}


@dataclass(frozen=True)
class WrkResult:
    """What one wrk run measured (latencies in ms)."""

    requests: int  # answered, any status
    duration_s: float
    errors: dict[str, int]  # connect, read, write, status (non-2xx/3xx), timeout
    latency_ms: dict[str, float]  # p50, p90, p99, max, mean
    requests_per_s_printed: float | None  # wrk's own "Requests/sec:" line

    @property
    def ok(self) -> int:
        """Requests answered 2xx/3xx."""
        return self.requests - self.errors.get("status", 0)

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def failed(self) -> int:
        return sum(self.errors.values())


_REQUESTS_PER_S = re.compile(r"^Requests/sec:\s+([0-9.]+)", re.MULTILINE)


def parse_wrk(output: str) -> WrkResult:
    """wrk's stdout with the WRK_SCRIPT's done() line in it. Raises ValueError."""
    line = next((line for line in output.splitlines() if line.startswith(MARK)), None)
    if line is None:
        raise ValueError(f"no {MARK.strip()} line in wrk's output: {output[-300:]!r}")
    document = json.loads(line[len(MARK):])
    printed = _REQUESTS_PER_S.search(output)
    return WrkResult(
        requests=int(document["requests"]),
        duration_s=document["duration_us"] / 1e6,
        errors={name: int(count) for name, count in document["errors"].items()},
        latency_ms={name: value / 1000 for name, value in document["latency_us"].items()},
        requests_per_s_printed=float(printed.group(1)) if printed else None,
    )


@dataclass
class ThroughputOptions:
    out: Path
    rounds: int = 1
    seconds: float = 10.0
    connections: int = 32
    pinned: bool = True  # also the pinned variant
    say: Callable[[str], None] = print


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_wrk(wrk: str, url: str, script: Path, seconds: float, connections: int,
             cores: set[int] | None, log: Path) -> tuple[WrkResult, float]:
    """One bounded wrk run; (its result, wrk's own CPU seconds)."""
    args = [wrk, "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "5s",
            "-s", str(script), url]
    before = _children_cpu_s()
    done = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 30,
                          preexec_fn=procs.pinning(cores), check=False)
    wrk_cpu_s = _children_cpu_s() - before
    with log.open("a") as handle:
        handle.write(f"$ {' '.join(args)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        raise RuntimeError(f"wrk exited {done.returncode}: {done.stderr[-300:]}")
    return parse_wrk(done.stdout), wrk_cpu_s


def _pin(pids: list[int], cores: set[int]) -> None:
    for pid in pids:
        os.sched_setaffinity(pid, cores)


async def _measure(name: str, processes: int, pinned: bool, round_number: int,
                   ctx: Context, tree: Path, backends_pid: int, load_cores: set[int] | None,
                   wrk: str, script: Path, options: ThroughputOptions) -> dict[str, Any]:
    row: dict[str, Any] = {"round": round_number, "variant": name, "processes": processes,
                           "pinned": pinned}
    try:
        running: Running = await start_compiled_processes(ctx, name, tree, processes)
    except Unavailable as exc:
        return {**row, "status": "skipped", "reason": str(exc)}
    assert running.pid is not None
    host, port = running.targets[0]
    url = f"http://{host}:{port}/v1/chat/completions"
    log = options.out / "logs" / "wrk.log"
    try:
        await asyncio.to_thread(_run_wrk, wrk, url, script, WARMUP_S, options.connections,
                                load_cores, log)
        router_before, backends_before = tree_cpu_s(running.pid), tree_cpu_s(backends_pid)
        by_process_before = cpu_by_process(running.pid)
        result, wrk_cpu_s = await asyncio.to_thread(
            _run_wrk, wrk, url, script, options.seconds, options.connections, load_cores, log)
        by_process_after = cpu_by_process(running.pid)
        router_after, backends_after = tree_cpu_s(running.pid), tree_cpu_s(backends_pid)
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        return {**row, "status": "failed", "reason": str(exc)}
    finally:
        await running.stop()
    wall = result.duration_s
    router_cpu = (None if router_before is None or router_after is None
                  else router_after - router_before)
    backends_cpu = (None if backends_before is None or backends_after is None
                    else backends_after - backends_before)
    return {
        **row, "status": "ok" if not result.failed else "errors",
        "requests": result.requests, "ok": result.ok, "errors": result.errors,
        "duration_s": wall, "requests_per_s": result.requests_per_s,
        "requests_per_s_wrk": result.requests_per_s_printed,
        "latency_ms": result.latency_ms,
        "router_cpu_s": router_cpu,
        "cpu_us_per_request": router_cpu / result.ok * 1e6 if router_cpu and result.ok
        else None,
        "router_cores_used": router_cpu / wall if router_cpu is not None and wall else None,
        "backends_cores_used": backends_cpu / wall if backends_cpu is not None and wall
        else None,
        "wrk_cores_used": wrk_cpu_s / wall if wall else None,
        # the supervisor first, then each router process: how the work was shared
        "cores_used_by_process": [
            round((after - by_process_before.get(pid, 0.0)) / wall, 3) if wall else None
            for pid, after in by_process_after.items()],
    }


def _line(row: dict[str, Any]) -> str:
    if row.get("requests_per_s") is None:
        return f"{row['variant']}: {row['status'].upper()} - {row.get('reason')}"
    return (f"{row['variant']:>12}: {row['requests_per_s']:7.0f} req/s, p50 "
            f"{row['latency_ms']['p50']:.2f} ms, p99 {row['latency_ms']['p99']:.2f} ms, CPU "
            f"{_f(row['cpu_us_per_request'])} us/req, router {_f(row['router_cores_used'], '.2f')}"
            f" cores (by process: {row['cores_used_by_process']}), errors "
            f"{sum(row['errors'].values())}")


def _variants(options: ThroughputOptions) -> list[tuple[str, int, bool]]:
    placements = [False, True] if options.pinned else [False]
    return [(f"{n}p-{'pinned' if pinned else 'unpinned'}", n, pinned)
            for pinned in placements for n in PROCESS_COUNTS]


async def bench_throughput(options: ThroughputOptions) -> dict[str, Any]:
    """Run every variant `options.rounds` times; returns (and writes) the document."""
    from lab.benchproxy.run import BACKEND_PORTS, _start_backends, _Valkey

    say = options.say
    wrk = shutil.which("wrk")
    if wrk is None:
        raise Unavailable("wrk is not installed (Debian: apt-get install wrk)")
    out = options.out
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    script = log_dir / "post.lua"
    body = next(w for w in workloads(False) if w.name == "unary").body()
    script.write_text(wrk_script(body))
    cores = procs.usable_cores()
    router_cores = {cores[0]} if len(cores) > 1 else None
    load_cores = set(cores[1:]) if len(cores) > 1 else None
    every = set(cores)
    valkey = _Valkey(None, log_dir)
    ports = [procs.free_port() for _ in range(BACKEND_PORTS)]
    backends = await _start_backends(ports, None, log_dir)
    base = Context(backend_ports=ports, out_dir=out, router_cores=None,
                   peers=PeerEnv(log_dir / "no-peers"), redis_url=valkey.url)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    share_before = await asyncio.to_thread(procs.core_share, router_cores)
    try:
        tree = await compiled_tree(base)
        valkey.url()
        for round_number in range(1, options.rounds + 1):
            for name, processes, pinned in _variants(options):
                placed = pinned and router_cores is not None and load_cores is not None
                others = [os.getpid(), backends.pid, valkey.server.pid]
                _pin(others, load_cores if placed and load_cores else every)
                ctx = Context(backend_ports=ports, out_dir=out,
                              router_cores=router_cores if placed else None,
                              peers=base.peers, redis_url=valkey.url, compiled=tree)
                say(f"[round {round_number}] {name}: starting")
                row = await _measure(name, processes, placed, round_number, ctx, tree,
                                     backends.pid, load_cores if placed else None, wrk,
                                     script, options)
                rows.append(row)
                say(f"[round {round_number}] {_line(row)}")
    finally:
        procs.stop(backends)
        valkey.stop()
        _pin([os.getpid()], every)
    share_after = await asyncio.to_thread(procs.core_share, router_cores)
    document: dict[str, Any] = {
        "meta": {
            "command": " ".join(["globalpool", *sys.argv[1:]]) if sys.argv else "",
            "router": "globalpool, compiled build (mypyc) of this checkout, policy "
                      "predicted_ttft, GLOBALPOOL_ROUTER_PROCESSES=1 or 2",
            "load": f"wrk -t1 -c{options.connections} -d{options.seconds:g}s (after a "
                    f"{WARMUP_S:g} s warm-up), POST /v1/chat/completions, non-streaming, "
                    "32 tokens back",
            "placement": {
                "unpinned": f"nothing pinned: router processes, wrk, backends and Valkey "
                            f"share all {len(cores)} cores",
                "pinned": (f"router processes on core {cores[0]}; wrk, backends, Valkey "
                           f"and orchestrator on {','.join(map(str, cores[1:]))}"
                           if load_cores else "not pinned (one core)"),
            },
            "backends": f"{BACKEND_PORTS} ports of one raw-asyncio process "
                        "(lab.benchproxy.backend)",
            "wrk": _wrk_version(wrk),
            "python": sys.version.split()[0], "machine": platform.platform(),
            "cores": os.cpu_count(), "duration_s": round(time.monotonic() - started, 1),
            "router_core_share": {"before": share_before, "after": share_after},
        },
        "results": rows,
        "summary": summarize(rows),
    }
    write_outputs(document, out, say)
    return document


def _wrk_version(wrk: str) -> str:
    try:
        done = subprocess.run([wrk, "--version"], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "?"
    return (done.stdout or done.stderr).splitlines()[0].strip() if done.stdout or \
        done.stderr else "?"


def _median(values: list[float | None]) -> float | None:
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per variant: medians over its rounds, and the 2-process lines' ratios
    to the 1-process line of the same placement, taken within each round."""
    index = {(r["round"], r["pinned"], r["processes"]): r for r in rows
             if r.get("requests_per_s") is not None}
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_variant.setdefault(row["variant"], []).append(row)
    lines = []
    for variant, group in by_variant.items():
        ok = [r for r in group if r.get("requests_per_s") is not None]
        line: dict[str, Any] = {"variant": variant, "processes": group[0]["processes"],
                                "pinned": group[0]["pinned"], "rounds": len(ok)}
        if not ok:
            lines.append({**line, "status": group[0]["status"],
                          "reason": group[0].get("reason")})
            continue
        rps_ratios, cpu_ratios = [], []
        for r in ok:
            one = index.get((r["round"], r["pinned"], 1))
            if one is None or r["processes"] == 1:
                continue
            rps_ratios.append(r["requests_per_s"] / one["requests_per_s"])
            if r.get("cpu_us_per_request") and one.get("cpu_us_per_request"):
                cpu_ratios.append(r["cpu_us_per_request"] / one["cpu_us_per_request"])
        line.update(
            status="ok" if all(r["status"] == "ok" for r in ok) else "errors",
            requests_per_s=_median([r["requests_per_s"] for r in ok]),
            requests_per_s_per_round=[r["requests_per_s"] for r in ok],
            latency_p50_ms=_median([r["latency_ms"]["p50"] for r in ok]),
            latency_p99_ms=_median([r["latency_ms"]["p99"] for r in ok]),
            cpu_us_per_request=_median([r.get("cpu_us_per_request") for r in ok]),
            cpu_us_per_round=[r.get("cpu_us_per_request") for r in ok],
            router_cores_used=_median([r.get("router_cores_used") for r in ok]),
            backends_cores_used=_median([r.get("backends_cores_used") for r in ok]),
            wrk_cores_used=_median([r.get("wrk_cores_used") for r in ok]),
            requests_per_s_vs_1p=_median(list(rps_ratios)),
            cpu_vs_1p=_median(list(cpu_ratios)),
            failed=sum(sum(r["errors"].values()) for r in ok),
            cores_used_by_process_per_round=[r.get("cores_used_by_process") for r in ok],
        )
        lines.append(line)
    return lines


def _f(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


HEADERS = ("variant", "req/s", "per round", "x 1p", "p50 ms", "p99 ms", "CPU us/req",
           "CPU x 1p", "router cores", "by process", "backends cores", "wrk cores",
           "errors")


def _cells(line: dict[str, Any]) -> list[str]:
    if "requests_per_s" not in line:
        return [line["variant"], f"{line['status']}: {(line.get('reason') or '')[:160]}",
                *[""] * (len(HEADERS) - 2)]
    return [
        line["variant"], _f(line["requests_per_s"]),
        " / ".join(_f(v) for v in line["requests_per_s_per_round"]),
        _f(line["requests_per_s_vs_1p"], ".2f", "x"),
        _f(line["latency_p50_ms"], ".2f"), _f(line["latency_p99_ms"], ".2f"),
        _f(line["cpu_us_per_request"]), _f(line["cpu_vs_1p"], ".2f", "x"),
        _f(line["router_cores_used"], ".2f"),
        " / ".join("+".join(_f(v, ".2f") for v in shares[1:])
                   for shares in line["cores_used_by_process_per_round"] if shares)
        if line["processes"] > 1 else "",
        _f(line["backends_cores_used"], ".2f"),
        _f(line["wrk_cores_used"], ".2f"), str(line["failed"]),
    ]


def table(document: dict[str, Any], markdown: bool) -> str:
    rows = [_cells(line) for line in document["summary"]]
    if markdown:
        return "\n".join(["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS),
                          *("| " + " | ".join(row) + " |" for row in rows)]) + "\n"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADERS)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in [list(HEADERS), *rows]) + "\n"


def _notes(document: dict[str, Any]) -> str:
    meta = document["meta"]
    notes = [f"- command: `{meta['command']}`", f"- router: {meta['router']}",
             f"- load: {meta['load']} ({meta['wrk']})",
             f"- unpinned: {meta['placement']['unpinned']}",
             f"- pinned: {meta['placement']['pinned']}",
             "- req/s: 2xx answers / wrk's duration (median over rounds); `x 1p`: ratio to "
             "the 1-process run of the same placement in the same round (median); p50/p99: "
             "wrk's latency histogram; CPU us/req: user+system time of the router's whole "
             "process tree (supervisor and router processes) / 2xx answers; `... cores`: "
             "CPU time / wall time; `by process`: each router process's cores (per "
             "round; the supervisor's, ~0, not shown)",
             f"- python {meta['python']}, {meta['machine']}, {meta['cores']} cores, "
             f"{meta['duration_s']} s"]
    notes += core_share_note(meta, "(pinned) router core")
    return "\n".join(notes) + "\n"


def chart(document: dict[str, Any], path: Path) -> bool:
    """Bars of requests/s (left) and router CPU per request (right) per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    lines = [line for line in document["summary"] if line.get("requests_per_s") is not None]
    if not lines:
        return False
    names = [line["variant"] for line in lines]
    colours = ["tab:blue" if line["processes"] == 1 else "tab:orange" for line in lines]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    bars = left.bar(names, [line["requests_per_s"] for line in lines], color=colours)
    left.bar_label(bars, labels=[f"{line['requests_per_s']:.0f}\np99 "
                                 f"{line['latency_p99_ms']:.1f} ms" for line in lines],
                   fontsize=8, label_type="center", color="white")
    for x, line in enumerate(lines):  # each round's, over the median's bar
        rounds = line["requests_per_s_per_round"]
        left.scatter([x] * len(rounds), rounds, color="black", s=10, zorder=3)
    left.set_ylabel("requests/s (wrk, median; dots: rounds)")
    left.set_title("Throughput, compiled router", fontsize=10)
    bars = right.bar(names, [line["cpu_us_per_request"] or 0.0 for line in lines],
                     color=colours)
    right.bar_label(bars, fmt="%.0f", fontsize=8, label_type="center", color="white")
    for x, line in enumerate(lines):
        rounds = [v for v in line["cpu_us_per_round"] if v is not None]
        right.scatter([x] * len(rounds), rounds, color="black", s=10, zorder=3)
    right.set_ylabel("router CPU per request, whole tree (us)")
    right.set_title("Router CPU per request (lower is better)", fontsize=10)
    for axes in (left, right):
        axes.tick_params(axis="x", labelsize=8)
        axes.margins(y=0.2)
    figure.suptitle(f"globalpool router, 1 vs 2 processes; {document['meta']['load']}; "
                    f"{document['meta']['cores']} cores shared with wrk and the backends",
                    fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_outputs(document: dict[str, Any], out: Path, say: Callable[[str], None]) -> None:
    (out / "throughput.json").write_text(json.dumps(document, indent=1, default=str))
    say("\n" + table(document, markdown=False) + "\n" + _notes(document).replace("`", ""))
    drawn = chart(document, out / "throughput.png")
    (out / "throughput.md").write_text(
        "### Throughput, 1 and 2 router processes (wrk)\n\n" + table(document, markdown=True)
        + "\n" + _notes(document) + "\n"
        + ("![throughput](throughput.png)\n" if drawn else
           "(no chart: matplotlib is not installed)\n"))
