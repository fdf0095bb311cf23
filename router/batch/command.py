"""`globalpool batch`: submit a JSONL file as a batch, follow it, fetch its results.

    globalpool batch submit requests.jsonl [--endpoint /v1/chat/completions] [--out DIR]
    globalpool batch follow BATCH_ID [--out DIR]     # a progress bar until it ends
    globalpool batch results BATCH_ID [--out DIR]    # its output and error files
    globalpool batch list | cancel BATCH_ID

It talks to a router's OpenAI-compatible API (`--router`, default GLOBALPOOL_ROUTER_URL
or http://127.0.0.1:8080) with the key in GLOBALPOOL_API_KEY (or OPENAI_API_KEY), exactly
as the `openai` client would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from router.batch.lines import BATCH_ENDPOINTS
from router.core.cli_args import positive_seconds, router_url

DEFAULT_ROUTER = "http://127.0.0.1:8080"
FINISHED = ("completed", "failed", "expired", "cancelled")
POLL_S = 1.0
# A router that sends nothing for this long (connected, or while connecting) is given up.
TIMEOUT_S = 60.0
BAR_WIDTH = 30


class BatchCommandError(Exception):
    """What the router answered instead (its OpenAI-format message), or why it could not
    be asked."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", type=router_url,
                        default=os.environ.get("GLOBALPOOL_ROUTER_URL", DEFAULT_ROUTER),
                        help="the router's URL (default: GLOBALPOOL_ROUTER_URL, then "
                        f"{DEFAULT_ROUTER})")
    parser.add_argument("--timeout", type=positive_seconds, default=TIMEOUT_S, metavar="S",
                        help="give up when the router sends nothing for this long (default "
                        f"{TIMEOUT_S:g} s; a download or an upload may take longer in all)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    submit = actions.add_parser("submit", help="upload a JSONL file and run it as a batch")
    submit.add_argument("file", type=Path, help="the requests, one JSON object a line "
                        "(custom_id, method, url, body), as OpenAI's Batch API takes them")
    submit.add_argument("--endpoint", default=BATCH_ENDPOINTS[0], choices=BATCH_ENDPOINTS,
                        help=f"the endpoint every line is for (default {BATCH_ENDPOINTS[0]})")
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                        help="a metadata pair for the batch (repeat for more, up to 16)")
    submit.add_argument("--no-wait", action="store_true",
                        help="print the batch's id and return at once")
    follow = actions.add_parser(
        "follow", help="show a batch's progress until it ends, then fetch its results")
    results = actions.add_parser("results", help="fetch a batch's output and error files")
    cancel = actions.add_parser("cancel", help="cancel a batch")
    listing = actions.add_parser("list", help="your batches, newest first")
    for action in (submit, follow, results, cancel, listing):
        # (after the action too: `globalpool batch list --router URL`, as `status` takes
        # it; given there, it stands over the one before the action)
        action.add_argument("--router", type=router_url, default=argparse.SUPPRESS,
                            help="the router's URL (as before the action)")
        action.add_argument("--timeout", type=positive_seconds, default=argparse.SUPPRESS,
                            metavar="S", help="as before the action")
    for action in (follow, results, cancel):
        action.add_argument("batch_id", help="the batch's id (batch_...)")
    for action in (submit, follow, results):
        action.add_argument("--out", type=Path, default=Path("."),
                            help="where to write BATCH_output.jsonl and BATCH_error.jsonl")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except BatchCommandError as exc:
        print(f"globalpool batch: {exc}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace) -> int:
    key = os.environ.get("GLOBALPOOL_API_KEY") or os.environ.get("OPENAI_API_KEY") or ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, args.timeout),
                                    sock_read=args.timeout)
    async with aiohttp.ClientSession(args.router.rstrip("/"), headers=headers,
                                     timeout=timeout) as http:
        api = _Api(http, args.timeout)
        if args.action == "list":
            for batch in (await api.call("GET", "/v1/batches?limit=100"))["data"]:
                print(_summary(batch))
            return 0
        if args.action == "cancel":
            print(_summary(await api.call("POST", f"/v1/batches/{args.batch_id}/cancel")))
            return 0
        if args.action == "results":
            return await _fetch(api, await api.call("GET", f"/v1/batches/{args.batch_id}"),
                                args.out)
        batch_id = args.batch_id if args.action == "follow" else await _submit(api, args)
        if args.action == "submit" and args.no_wait:
            return 0
        return await _fetch(api, await follow(api, batch_id, sys.stderr), args.out)


class _Api:
    def __init__(self, http: aiohttp.ClientSession, timeout_s: float = TIMEOUT_S) -> None:
        self._http = http
        self._timeout_s = timeout_s

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON answer; BatchCommandError with the router's message otherwise."""
        body = await self.read(method, path, **kwargs)
        return json.loads(body)

    async def read(self, method: str, path: str, **kwargs: Any) -> bytes:
        try:
            async with self._http.request(method, path, **kwargs) as response:
                body = await response.read()
                if response.status != 200:
                    raise BatchCommandError(f"{method} {path}: HTTP {response.status}: "
                                            f"{_message(body)}")
                return body
        except (aiohttp.ClientError, TimeoutError) as exc:
            # (the router's URL the user gave; never the exception's repr of its internals)
            why = (f"no answer within {self._timeout_s:g} s (--timeout)"
                   if isinstance(exc, TimeoutError)
                   else str(getattr(exc, "os_error", None) or exc).split(" [", 1)[0][:200])
            raise BatchCommandError(f"cannot reach the router: {why}") from None


async def _submit(api: _Api, args: argparse.Namespace) -> str:
    if not args.file.is_file():
        raise BatchCommandError(f"{args.file}: no such file")
    metadata = {}
    for pair in args.metadata:
        key, equals, value = pair.partition("=")
        if not equals:
            raise BatchCommandError(f"--metadata {pair!r}: write KEY=VALUE")
        metadata[key] = value
    with args.file.open("rb") as source:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", source, filename=args.file.name,
                       content_type="application/jsonl")
        uploaded = await api.call("POST", "/v1/files", data=form)
    print(f"uploaded {args.file} as {uploaded['id']} ({uploaded['bytes']} bytes)",
          file=sys.stderr)
    batch = await api.call("POST", "/v1/batches", json={
        "input_file_id": uploaded["id"], "endpoint": args.endpoint,
        "completion_window": "24h", "metadata": metadata or None})
    print(batch["id"])
    return str(batch["id"])


async def follow(api: _Api, batch_id: str, out: Any, poll_s: float = POLL_S) -> Any:
    """Poll the batch until it ends, drawing its progress on `out` (redrawn in place on a
    terminal, a line every ten polls otherwise); returns the batch as it ended."""
    started = time.monotonic()
    first_done: tuple[float, int] | None = None
    polls = 0
    while True:
        batch = await api.call("GET", f"/v1/batches/{batch_id}")
        counts = batch.get("request_counts") or {}
        done = counts.get("completed", 0) + counts.get("failed", 0)
        now = time.monotonic()
        if first_done is None and batch["status"] == "in_progress":
            first_done = (now, done)
        rate = None
        if first_done is not None and now > first_done[0] and done > first_done[1]:
            rate = (done - first_done[1]) / (now - first_done[0])
        line = progress_line(batch["status"], done, counts.get("failed", 0),
                             counts.get("total", 0), rate, now - started)
        if getattr(out, "isatty", lambda: False)():
            out.write("\r" + line.ljust(100))
        elif polls % 10 == 0 or batch["status"] in FINISHED:
            out.write(line + "\n")
        out.flush()
        if batch["status"] in FINISHED:
            if getattr(out, "isatty", lambda: False)():
                out.write("\n")
            return batch
        polls += 1
        await asyncio.sleep(poll_s)


def progress_line(status: str, done: int, failed: int, total: int, rate: float | None,
                  elapsed_s: float) -> str:
    """`[#####.....]  120/480 lines, 2 failed, 35.0/s, 10 s left (in_progress)`."""
    share = done / total if total else 0.0
    filled = round(share * BAR_WIDTH)
    left = ""
    if rate and total > done:
        left = f", {round((total - done) / rate)} s left"
    speed = f", {rate:.1f}/s" if rate else ""
    return (f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done:>{len(str(total))}}/{total} "
            f"lines, {failed} failed{speed}{left} ({status}, {elapsed_s:.0f} s)")


async def _fetch(api: _Api, batch: Any, out: Path) -> int:
    """Write the batch's output and error files into `out`; 0 when it completed."""
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    for kind in ("output", "error"):
        file_id = batch.get(f"{kind}_file_id")
        if file_id:
            path = out / f"{batch['id']}_{kind}.jsonl"
            content = await api.read("GET", f"/v1/files/{file_id}/content")
            await asyncio.to_thread(path.write_bytes, content)
            print(f"{kind}: {path}", file=sys.stderr)
    errors = (batch.get("errors") or {}).get("data") or []
    for error in errors:
        print(f"error: line {error.get('line')}: {error.get('message')}", file=sys.stderr)
    print(_summary(batch), file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1


def _summary(batch: Any) -> str:
    counts = batch.get("request_counts") or {}
    return (f"{batch['id']} {batch['status']}: {counts.get('completed', 0)} completed, "
            f"{counts.get('failed', 0)} failed of {counts.get('total', 0)}")


def _message(body: bytes) -> str:
    try:
        document = json.loads(body)
        return str(document["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError, RecursionError):
        return body[:200].decode(errors="replace")
