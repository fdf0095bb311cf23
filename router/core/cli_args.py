"""argparse types the commands share (`globalpool router`, `up`, `sim`, `status`, `batch`):
what a user mistypes is a usage error naming the argument, not a traceback."""

from __future__ import annotations

import argparse
import urllib.parse


def router_url(text: str) -> str:
    """The argparse type of `--router` (and of GLOBALPOOL_ROUTER_URL, its default): an
    absolute http(s) URL, or a usage error that says how to write one (not a traceback
    from deep in an HTTP client)."""
    parts = urllib.parse.urlsplit(text.strip())
    try:
        parts.port  # noqa: B018  (raises for a port that is not one)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: not a port number; write http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a router URL; write http://HOST:PORT (or https://)")
    return text.strip()


def positive_seconds(text: str) -> float:
    """The argparse type of an interval or a timeout: a finite number of seconds > 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: write a number of seconds above 0")
    return seconds


def port_number(text: str) -> int:
    """The argparse type of `--port`: 0-65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: write a port number, 0-65535")
    return port
