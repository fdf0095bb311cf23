"""The child of `globalpool bench-memory` that measures https endpoints: the memory of
`endpoints` worker Targets (router.proxy.targets.target_of) and of one request through
each to a real TLS server on loopback, with the router's own upstream pool.

    python -c "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')" \
        lab/benchproxy/memory_https.py '{"endpoints": 10000, "ports": [...], ...}'

Run from the source tree under test (cwd and PYTHONPATH), so it imports nothing of this
package: only the standard library, uvloop and `router.proxy`, whose API these two
modules have had since before the shared TLS context (`target_of` lived in
`router.proxy.forward` before it had a module of its own: a tree from before is found
there). The server's certificate must be
trusted through SSL_CERT_FILE (a bundle of the system's CAs and it, so each context loads
as many CAs as a router's would). Stops creating Targets once the process grew by
`limit_bytes` (a shared machine), and says so. Prints one JSON document.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from typing import Any

PROBE_TARGETS = 200  # made before the growth per Target is judged against the limit
BODY = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'


def vmrss_bytes(pid: int | str = "self") -> int:
    """The resident set of process `pid` (VmRSS in /proc), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def make_targets(spec: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """`spec["endpoints"]` https Targets spread over the ports, or fewer at the limit."""
    target_of = _target_of()
    ports, host, limit_bytes = spec["ports"], spec["host"], int(spec["limit_bytes"])
    start_bytes = vmrss_bytes()
    targets = []
    for number in range(int(spec["endpoints"])):
        targets.append(target_of(f"https://{host}:{ports[number % len(ports)]}/w{number}"))
        if number + 1 >= PROBE_TARGETS and vmrss_bytes() - start_bytes > limit_bytes:
            break
    grown_bytes = vmrss_bytes() - start_bytes
    return targets, {
        "targets": len(targets), "stopped_at_limit": len(targets) < int(spec["endpoints"]),
        "tls_contexts": len({id(target.ssl) for target in targets}),
        "targets_bytes": grown_bytes, "bytes_per_target": grown_bytes / len(targets)}


def _target_of() -> Any:
    """The tree's `target_of`, where it lives in that tree."""
    try:
        module = importlib.import_module("router.proxy.targets")
    except ImportError:  # a tree from before router.proxy.targets
        module = importlib.import_module("router.proxy.forward")
    return module.target_of


async def request_each(targets: list[Any], concurrency: int) -> dict[str, Any]:
    """One POST through every Target on one pool, `concurrency` at a time."""
    from router.proxy.upstream.pool import UpstreamPool

    pool = UpstreamPool(connect_timeout_s=10.0)
    pending = iter(targets)
    statuses: list[int] = []
    failures: list[str] = []

    async def client() -> None:
        for target in pending:
            payload = target.request("/v1/chat/completions",
                                     {"content-type": "application/json"}, BODY)
            try:
                connection = await pool.send(target.host, target.port, payload, ssl=target.ssl)
                status, _ = await connection.head()
                await connection.read_all()
                connection.release()
                statuses.append(status)
            except Exception as exc:  # counted and shown: the run goes on
                failures.append(f"{type(exc).__name__}: {exc}"[:300])

    await asyncio.gather(*(client() for _ in range(concurrency)))
    answered = statuses.count(200)
    outcome = {"answered": answered, "errors": len(failures) + len(statuses) - answered,
               "error_samples": failures[:3], "connections": pool.stats(),
               "rss_bytes_with_connections": vmrss_bytes()}
    await pool.close()
    return outcome


async def measure(spec: dict[str, Any]) -> dict[str, Any]:
    _target_of()  # its module imported before the baseline is read

    baseline_bytes = vmrss_bytes()
    targets, made = make_targets(spec)
    result: dict[str, Any] = {"baseline_rss_bytes": baseline_bytes, **made,
                              "rss_bytes_with_targets": vmrss_bytes()}
    if spec.get("requests", True):
        result.update(await request_each(targets, int(spec.get("concurrency", 32))))
    return result


def main() -> None:
    import uvloop

    spec = json.loads(sys.argv[1])
    print(json.dumps(uvloop.run(measure(spec))), flush=True)


if __name__ == "__main__":
    main()
