"""One region's emulated network as a process, with a small control API.

    python -m lab.devstack.netem_process --listen-host 127.0.1.1 --rtt-ms 80 \
        --upstream 127.0.1.1:41001 --upstream 127.0.1.1:41002

prints one line when it listens (launchers wait for it):

    netem listening on http://127.0.1.1:CONTROL ports=PORT1,PORT2

one port per `--upstream`, in order. Control:

    GET  /netem   knobs and per-link counters
    POST /netem   {"extra_rtt_ms": 300, "partition": true, "rtt_ms": 80, "reset": true}
                  (each field optional; answers with the state after the change)

A process of its own keeps the proxy's cost off the load generator's event loop and
off the router's. SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from lab.devstack.netem import NetemRegion
from lab.devstack.netem_knobs import NetemKnobs

_REGION = web.AppKey("netem_region", NetemRegion)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host, int(port)


def _source_rtt(text: str) -> tuple[str, float]:
    source, _, rtt = text.partition("=")
    try:
        return source, float(rtt)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected IP=MS") from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lab.devstack.netem_process",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen-host", required=True)
    parser.add_argument("--control-port", type=int, default=0)
    parser.add_argument("--upstream", type=_host_port, action="append", required=True,
                        metavar="HOST:PORT")
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--rtt-ms-from", type=_source_rtt, action="append", default=[],
                        metavar="IP=MS", help="RTT for clients connecting from IP")
    return parser.parse_args(argv)


async def _get(request: web.Request) -> web.Response:
    return web.json_response(request.app[_REGION].stats())


async def _post(request: web.Request) -> web.Response:
    region = request.app[_REGION]
    try:
        changes: Any = await request.json()
    except ValueError:
        return web.json_response({"error": "body is not JSON"}, status=400)
    if not isinstance(changes, dict) or set(changes) - {"extra_rtt_ms", "partition", "rtt_ms",
                                                        "reset"}:
        return web.json_response(
            {"error": "expected fields: extra_rtt_ms, partition, rtt_ms, reset"}, status=400)
    try:
        region.set(
            extra_rtt_ms=_number(changes, "extra_rtt_ms"),
            rtt_ms=_number(changes, "rtt_ms"),
            partition=_flag(changes, "partition"),
        )
    except (TypeError, ValueError) as exc:
        return web.json_response({"error": str(exc)}, status=400)
    reset = region.reset() if changes.get("reset") is True else 0
    return web.json_response({**region.stats(), "reset_connections": reset})


def _number(changes: dict[str, Any], name: str) -> float | None:
    value = changes.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected a number >= 0")
    return float(value)


def _flag(changes: dict[str, Any], name: str) -> bool | None:
    value = changes.get(name)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}: expected true or false")
    return value


async def serve(args: argparse.Namespace) -> int:
    knobs = NetemKnobs(rtt_ms=args.rtt_ms, rtt_ms_by_source=dict(args.rtt_ms_from))
    region = NetemRegion(knobs, args.listen_host, args.upstream)
    ports = await region.start()
    app = web.Application()
    app[_REGION] = region
    app.router.add_get("/netem", _get)
    app.router.add_post("/netem", _post)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.listen_host, args.control_port)
    await site.start()
    control_port = int(runner.addresses[0][1])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    print(f"netem listening on http://{args.listen_host}:{control_port} "
          f"ports={','.join(map(str, ports))}", flush=True)
    try:
        await stop.wait()
    finally:
        await region.stop()
        await runner.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
