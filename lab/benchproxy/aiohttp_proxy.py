"""The plain aiohttp reverse proxy of the comparison: the floor for an aiohttp router.

Round robin over static upstreams, one ClientSession with pooled keep-alive connections,
the body passed as bytes, streams passed through chunk by chunk (`readany`), uvloop as
the loop (as the globalpool router uses). No routing, retries, timeouts, health,
metrics or header filtering beyond hop-by-hop: whatever globalpool costs above this is
the price of its features (or of its overhead).

    python -m lab.benchproxy.aiohttp_proxy --port 8000 --upstream http://127.0.0.1:9001
"""

from __future__ import annotations

import argparse
import itertools

import aiohttp
from aiohttp import web

from router.event_loop import new_event_loop

SESSION = web.AppKey("session", aiohttp.ClientSession)


def build_app(upstreams: list[str]) -> web.Application:
    turn = itertools.cycle(upstreams)

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = next(turn) + request.path_qs
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with request.app[SESSION].request(request.method, url, data=body,
                                                headers=headers) as upstream:
            content_type = upstream.headers.get("Content-Type", "application/json")
            if not content_type.startswith("text/event-stream"):
                return web.Response(status=upstream.status, body=await upstream.read(),
                                    headers={"Content-Type": content_type})
            response = web.StreamResponse(status=upstream.status,
                                          headers={"Content-Type": content_type})
            await response.prepare(request)
            read = upstream.content.readany
            while chunk := await read():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="a plain aiohttp round-robin reverse proxy")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", action="append", required=True)
    args = parser.parse_args()
    web.run_app(build_app([u.rstrip("/") for u in args.upstream]), host=args.host,
                port=args.port, access_log=None, loop=new_event_loop(),
                print=lambda _m: print(f"listening on {args.host}:{args.port}", flush=True))


if __name__ == "__main__":
    main()
