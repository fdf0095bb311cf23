"""`globalpool bench-memory`: does the router's memory stay flat with time and the fleet?

Two measurements per source tree (`--tree`, default this checkout; give a copy of the
commit before a change as another tree to compare):

- headers: the router, set up as `bench-proxy` sets it up (config, signed heartbeats,
  Valkey), in front of fake backends that put a new Date, X-Request-Id and X-Seq line in
  every answer (`backend --distinct-headers`), sent `--requests` requests that each carry
  a new X-Request-Id and X-Client-Seq line. The router's RSS (VmRSS) and CPU time per
  request are read after a warm-up and after each tenth of the run: what grows with time
  shows as RSS that keeps climbing, a cache that stopped working as CPU that rises.
- https: `--https-endpoints` worker Targets for https endpoints, made by the tree's
  `router.proxy.targets` in a process of its own (`memory_https`), then one request
  through each to a TLS server on loopback (4 ports, a self-signed certificate made with
  the openssl CLI): the memory per Target, the TLS contexts made, the connections opened.

The router runs on the first core, everything else on the others, as in bench-proxy.
Bounded: the requests are counted and each waits at most 30 s; the https process stops
making Targets once it grew by 40% of the memory available when it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
HTTPS_PORTS = 4
BATCHES = 10  # RSS and CPU read after each tenth of the requests
WARMUP_REQUESTS = 2000
REQUEST_TIMEOUT_S = 30.0
HTTPS_TIMEOUT_S = 900.0  # 10,000 TLS contexts take ~1 min to make before the change
MEMORY_SHARE = 0.4  # of MemAvailable: the most the https process may grow by
_CHILD = Path(__file__).with_name("memory_https.py")
_RUN_PATH = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"
BODY = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="write memory.json and logs here")
    parser.add_argument("--tree", type=Path, action="append", default=None,
                        help="a source tree whose router to measure; repeat to compare "
                             "(default: this checkout)")
    parser.add_argument("--requests", type=int, default=100_000,
                        help="requests with new header lines (headers; default 100,000)")
    parser.add_argument("--https-endpoints", type=int, default=10_000,
                        help="https worker Targets to make (https; default 10,000)")
    parser.add_argument("--concurrency", type=int, default=16, help="clients (headers)")
    parser.add_argument("--parts", default="headers,https", help="headers, https or both")


def run_command(args: argparse.Namespace) -> int:
    from router.event_loop import new_event_loop

    here = Path(__file__).resolve().parents[2]
    trees = [tree.resolve() for tree in (args.tree or [here])]
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    if not parts or parts - {"headers", "https"}:
        print(f"--parts: headers and/or https, not {args.parts!r}")
        return 2
    work = args.out or Path(os.environ.get("TMPDIR", "/tmp")) / "globalpool-memory"
    work.mkdir(parents=True, exist_ok=True)
    loop = new_event_loop()
    try:
        document = loop.run_until_complete(bench_memory(args, trees, parts, work))
    finally:
        loop.close()
    return 0 if all(not row.get("errors") for row in document["results"]) else 1


async def bench_memory(args: argparse.Namespace, trees: list[Path], parts: set[str],
                       work: Path) -> dict[str, Any]:
    """Each part for each tree, printed as it is measured; memory.json in `work`."""
    from lab.benchproxy.run import _cores, _Valkey

    router_cores, other_cores, pinning = _cores()
    if other_cores:
        os.sched_setaffinity(0, other_cores)
    valkey = _Valkey(other_cores, work)
    rows: list[dict[str, Any]] = []
    try:
        for number, tree in enumerate(trees):
            if "headers" in parts:
                rows.append(await _headers(tree, number, args, work, valkey.url(),
                                           router_cores, other_cores))
                print(render_headers(rows[-1]), flush=True)
            if "https" in parts:
                rows.append(await _https(tree, number, args, work, router_cores, other_cores))
                print(render_https(rows[-1]), flush=True)
    finally:
        valkey.stop()
    document = {"meta": {"pinning": pinning, "python": sys.version.split()[0]},
                "results": rows}
    (work / "memory.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {work / 'memory.json'}")
    return document


async def _start_backend(ports: list[int], flags: list[str], cores: set[int] | None,
                         log_path: Path) -> subprocess.Popen[bytes]:
    """The fake backends (lab.benchproxy.backend) on `ports`, once they say `ready`."""
    from lab.benchproxy import procs

    args = [sys.executable, "-m", "lab.benchproxy.backend", *flags]
    for port in ports:
        args += ["--port", str(port)]
    process = procs.start(args, cores=cores, log_path=log_path, stdout_pipe=True)
    assert process.stdout is not None
    async with asyncio.timeout(30):
        said = await asyncio.to_thread(process.stdout.readline)
    if said.strip() != b"ready":
        procs.stop(process)
        raise RuntimeError(f"backends did not start: {procs.log_tail(log_path)}")
    return process


async def _headers(tree: Path, number: int, args: argparse.Namespace, work: Path,
                   redis_url: str, router_cores: set[int] | None,
                   other_cores: set[int] | None) -> dict[str, Any]:
    from lab.benchproxy import procs
    from lab.benchproxy.memory_https import vmrss_bytes
    from lab.benchproxy.routers import Running, setup_globalpool, wait_ready

    ports = [procs.free_port() for _ in range(2)]
    backends = await _start_backend(ports, ["--distinct-headers"], other_cores,
                                    work / f"backends-{number}.log")
    port = procs.free_port()
    setup = await setup_globalpool(redis_url, port, work / f"tree-{number}-regions.yaml",
                                   [f"http://127.0.0.1:{p}" for p in ports])
    log_path = work / f"router-{number}.log"
    process = procs.start(setup.args, cores=router_cores, log_path=log_path,
                          env={**setup.env, "PYTHONPATH": str(tree)}, cwd=tree)
    running = Running(f"tree-{number}", [("127.0.0.1", port)], process, log_path)
    try:
        await wait_ready(running)
        ready_rss_mib = round(vmrss_bytes(process.pid) / MIB, 1)
        samples = await drive(port, process.pid, args.requests, args.concurrency)
    finally:
        await asyncio.to_thread(procs.stop, process)
        await setup.stop_heartbeats()
        procs.stop(backends)
    return {"part": "headers", "tree": str(tree), "requests": args.requests,
            "ready_rss_mib": ready_rss_mib,
            "errors": sum(sample["errors"] for sample in samples), "samples": samples}


def _payload(port: int, seq: int) -> bytes:
    """A request whose X-Request-Id and X-Client-Seq lines no request had before."""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nX-Request-Id: client-{seq:x}\r\n"
            f"X-Client-Seq: {seq}\r\nContent-Length: {len(BODY)}\r\n\r\n").encode() + BODY


async def drive(port: int, router_pid: int, requests: int, concurrency: int
                ) -> list[dict[str, Any]]:
    """`requests` requests after a warm-up, closed loop; a sample of the router's RSS and
    CPU after the warm-up and after each tenth."""
    from lab.benchproxy.cpu import tree_cpu_s
    from lab.benchproxy.httpclient import HttpConnection, connect
    from lab.benchproxy.memory_https import vmrss_bytes

    pool: list[HttpConnection] = [await connect("127.0.0.1", port) for _ in range(concurrency)]
    sent = 0
    samples: list[dict[str, Any]] = []
    for batch in range(BATCHES + 1):
        count = WARMUP_REQUESTS if batch == 0 else requests // BATCHES
        seqs = iter(range(sent, sent + count))
        errors = [0]
        cpu_before_s = tree_cpu_s(router_pid) or 0.0

        async def client(slot: int, seqs: Any = seqs, errors: list[int] = errors) -> None:
            for seq in seqs:
                try:
                    async with asyncio.timeout(REQUEST_TIMEOUT_S):
                        answer = await pool[slot].request(_payload(port, seq))
                    errors[0] += answer.status != 200
                except Exception:  # counted (and shown as errors); a new connection
                    errors[0] += 1
                    pool[slot].close()
                    pool[slot] = await connect("127.0.0.1", port)

        await asyncio.gather(*(client(slot) for slot in range(concurrency)))
        sent += count
        cpu_s = (tree_cpu_s(router_pid) or 0.0) - cpu_before_s
        samples.append({"requests_sent": sent, "warmup": batch == 0,
                        "rss_mib": round(vmrss_bytes(router_pid) / MIB, 1),
                        "cpu_us_per_request": round(cpu_s / count * 1e6, 1),
                        "errors": errors[0]})
    for connection in pool:
        connection.close()
    return samples


def _certificate(work: Path) -> tuple[Path, Path, Path]:
    """A self-signed certificate for 127.0.0.1, its key, and a CA bundle of the system's
    CAs and it (so that a client context loads what a router's would, and trusts it)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the https part needs the openssl command (apt-get install openssl)")
    cert, key, bundle = work / "tls-cert.pem", work / "tls-key.pem", work / "tls-bundle.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    system = ssl.get_default_verify_paths().cafile
    bundle.write_text((Path(system).read_text() if system else "") + cert.read_text())
    return cert, key, bundle


def _available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 * 1024 * MIB


async def _https(tree: Path, number: int, args: argparse.Namespace, work: Path,
                 router_cores: set[int] | None, other_cores: set[int] | None
                 ) -> dict[str, Any]:
    from lab.benchproxy import procs

    cert, key, bundle = _certificate(work)
    ports = [procs.free_port() for _ in range(HTTPS_PORTS)]
    backend = await _start_backend(ports, ["--tls-cert", str(cert), "--tls-key", str(key)],
                                   other_cores, work / f"tls-backends-{number}.log")
    spec = {"endpoints": args.https_endpoints, "ports": ports, "host": "127.0.0.1",
            "limit_bytes": int(_available_bytes() * MEMORY_SHARE), "concurrency": 32}
    env = {**os.environ, "PYTHONPATH": str(tree), "SSL_CERT_FILE": str(bundle)}
    try:
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", _RUN_PATH, str(_CHILD), json.dumps(spec)],
            cwd=tree, env=env, capture_output=True, text=True, timeout=HTTPS_TIMEOUT_S,
            preexec_fn=procs.pinning(router_cores))
    finally:
        procs.stop(backend)
    if done.returncode != 0:
        raise RuntimeError(f"memory_https exited {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"part": "https", "tree": str(tree), "endpoints": args.https_endpoints, **result}


def render_headers(row: dict[str, Any]) -> str:
    lines = [f"headers, {row['tree']}: {row['requests']:,} requests with new header lines "
             f"(router RSS when ready: {row['ready_rss_mib']} MiB)",
             "| requests sent | router RSS (MiB) | router CPU per request (us) | errors |",
             "|---|---|---|---|"]
    lines += [f"| {s['requests_sent']:,}{' (warm-up)' if s['warmup'] else ''} | "
              f"{s['rss_mib']} | {s['cpu_us_per_request']} | {s['errors']} |"
              for s in row["samples"]]
    return "\n".join(lines)


def render_https(row: dict[str, Any]) -> str:
    made = f"{row['targets']:,}" + (" (stopped at the memory limit)"
                                    if row["stopped_at_limit"] else "")
    with_connections = row.get("rss_bytes_with_connections")
    return "\n".join([
        f"https, {row['tree']}: {row['endpoints']:,} https endpoints",
        "| Targets made | TLS contexts | MiB for them | KiB per Target | RSS (MiB) | "
        "requests answered | errors | connections opened | RSS with them (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {made} | {row['tls_contexts']:,} | {row['targets_bytes'] / MIB:.1f} | "
        f"{row['bytes_per_target'] / 1024:.1f} | {row['rss_bytes_with_targets'] / MIB:.1f} | "
        f"{row.get('answered', '-')} | {row.get('errors', '-')} | "
        f"{row.get('connections', {}).get('opened', '-')} | "
        f"{'-' if with_connections is None else f'{with_connections / MIB:.1f}'} |"])
