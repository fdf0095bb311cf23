"""argparse types the commands share (`globalpool router`, `up`, `sim`, `status`, `batch`,
the benches and drills):
what a user mistypes is a usage error naming the argument, not a traceback."""

from __future__ import annotations

import argparse
import math
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


def _number(text: str, low: float, high: float, *, above_low: bool = False) -> float:
    """`text` as a finite number within [low, high] (or (low, high] if `above_low`)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (low < value if above_low else low <= value) or not value <= high:  # (NaN too)
        bound = "above" if above_low else "at least"
        top = "" if high == math.inf else f" and at most {high:g}"
        raise argparse.ArgumentTypeError(f"{text!r}: write a number {bound} {low:g}{top}")
    return value


def _whole(text: str, low: int, high: int | None = None, what: str = "a whole number") -> int:
    """`text` as an integer within [low, high] (no upper bound: None)."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        top = "" if high is None else f" and at most {high}"
        raise argparse.ArgumentTypeError(f"{text!r}: write {what}, at least {low}{top}")
    return value


def positive_number(text: str) -> float:
    """A finite number > 0 (a rate, a factor, an interval or a timeout in seconds)."""
    return _number(text, 0.0, math.inf, above_low=True)


positive_seconds = positive_number  # (the name an interval's or a timeout's flag reads by)


def non_negative_number(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, 0.0, math.inf)


def fraction(text: str) -> float:
    """A share: 0 to 1."""
    return _number(text, 0.0, 1.0)


def positive_int(text: str) -> int:
    """A count of at least 1."""
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    """A count that may be 0."""
    return _whole(text, 0)


def port_number(text: str) -> int:
    """The argparse type of `--port`: 0-65535 (0: any free port)."""
    return _whole(text, 0, 65535, what="a port number")
