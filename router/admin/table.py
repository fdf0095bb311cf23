"""`globalpool status`: the admin API's fleet status as a terminal table.

    globalpool status [--router URL] [--watch [--interval S]]

The admin token comes from GLOBALPOOL_ADMIN_TOKEN (or the variable `--token-env` names);
it is sent as a Bearer token and never printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any

from router.admin.terminal import escape_all
from router.core.cli_args import positive_seconds, router_url

DEFAULT_ROUTER = "http://127.0.0.1:8080"


class StatusError(Exception):
    """The status could not be read; the message says why and what to do."""


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", type=router_url,
                        default=os.environ.get("GLOBALPOOL_ROUTER_URL", DEFAULT_ROUTER),
                        help="router base URL (default: GLOBALPOOL_ROUTER_URL or "
                        f"{DEFAULT_ROUTER})")
    parser.add_argument("--token-env", default="GLOBALPOOL_ADMIN_TOKEN",
                        help="environment variable holding the admin token")
    parser.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    parser.add_argument("--interval", type=positive_seconds, default=2.0,
                        help="--watch refresh, seconds")
    parser.add_argument("--json", action="store_true", help="print the raw JSON instead")


def fetch_status(router_url: str, token: str, timeout_s: float = 5.0) -> dict[str, Any]:
    request = urllib.request.Request(f"{router_url.rstrip('/')}/admin/status",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            document: dict[str, Any] = json.loads(response.read())
            return document
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise StatusError(f"{router_url}: HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusError(f"cannot reach the router at {router_url}: {reason}") from None


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}ms" if value < 1000 else f"{value / 1000:.2f}s"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows,
                                                                        strict=False)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              for row in rows]
    return [line.rstrip() for line in lines]


def render(status: dict[str, Any]) -> str:
    """The status document as text: a header, regions, workers, drains and problems.
    Control and bidi characters in its strings are printed as escapes (router.admin.terminal):
    a worker's id, a drain's reason or a refused file's key must not drive the terminal."""
    status = escape_all(status)
    router = status["router"]
    config = status["config"]
    redis = status["redis"]
    age = redis["snapshot_age_s"]
    lines = [
        f"router {router['region'] or '-'}   config {config['version']}   "
        f"redis {'connected' if redis['connected'] else 'UNREACHABLE'}   "
        f"snapshot age {'-' if age is None else f'{age:.2f}s'}   "
        f"at {datetime.fromtimestamp(router['now_unix_s']).strftime('%H:%M:%S')}",
    ]
    if config["last_error"]:
        lines.append("config REFUSED (last good version stays in force):")
        lines += [f"  {problem}" for problem in config["last_error"]["problems"]]
    lines.append("")
    rows = []
    for region in status["regions"]:
        traffic = region["traffic"] or {}
        workers = ", ".join(f"{n} {state}" for state, n in region["workers"].items()) or "none"
        rows.append([
            region["name"], region["health"], workers,
            f"{region['load_seqs']}/{region['capacity_seqs']}", _pct(region["kv_cache_usage"]),
            _pct(traffic.get("share")), str(traffic.get("requests", 0)),
            f"{_ms(traffic.get('ttft_p50_ms'))}/{_ms(traffic.get('ttft_p99_ms'))}",
            str(traffic.get("errors", 0)),
        ])
    lines += _table(["REGION", "HEALTH", "WORKERS", "LOAD/CAP", "KV", "SHARE", "REQ/1m",
                     "TTFT p50/p99", "ERRORS"], rows)
    lines.append("")
    rows = [[w["id"], w["region"], _status(w),
             f"{w['load']['running']}+{w['load']['waiting']}/{w['capacity']['max_num_seqs']}",
             _pct(w["load"]["kv_cache_usage"]), str(w["load"]["router_inflight"]),
             _ms(w["performance"]["ttft_ms"]), f"{w['heartbeat_age_s']:.1f}s"]
            for w in status["workers"]]
    lines += _table(["WORKER", "REGION", "STATUS", "RUN+WAIT/CAP", "KV", "INFLIGHT", "TTFT",
                     "HEARTBEAT"], rows) if rows else ["no workers"]
    if status["drains"]:
        lines.append("")
        lines += _table(["DRAINED", "SINCE", "REASON"], [
            [f"{d['kind']} {d['name']}",
             datetime.fromtimestamp(d["since_unix_s"]).strftime("%H:%M:%S"), d["reason"]]
            for d in status["drains"]])
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    token = os.environ.get(args.token_env, "")
    if not token:
        print(f"set {args.token_env} to the router's admin token", file=sys.stderr)
        return 2
    while True:
        try:
            status = fetch_status(args.router, token)
        except StatusError as exc:
            if not args.watch:
                print(str(exc), file=sys.stderr)
                return 1
            text = f"{exc}\n(retrying every {args.interval:g} s)"
        else:
            text = json.dumps(status, indent=2) if args.json else render(status)
        if not args.watch:
            print(text)
            return 0
        sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
        sys.stdout.flush()
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


def _status(worker: dict[str, Any]) -> str:
    """A worker's status, and whether its agent says its engine is stuck (no step while
    it holds requests)."""
    stuck_for_s = worker.get("engine", {}).get("stuck_for_s")
    return worker["status"] if stuck_for_s is None else f"{worker['status']} (engine stuck)"
