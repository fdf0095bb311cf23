"""Request ids: the one name under which a client, the router's logs and traces, and the
worker's logs find the same request.

A client's own `x-request-id` is kept when it is a plain token (at most 128 characters of
letters, digits and `-._:`); anything else, or none, gets the router's: a prefix random
per process (so that replicas do not collide) and a counter, cheaper than a UUID per
request. Every answer carries it, errors included: an error message never shows internal
addresses or a worker's raw answer, and the id is how an operator finds those in the log.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Mapping

from aiohttp import web

MAX_CLIENT_ID_CHARS = 128
_ALLOWED = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._:")
_PREFIX = f"gp-{secrets.token_hex(4)}-"
_COUNTER = itertools.count(1)


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's `x-request-id` if it is a plain token, else a new one."""
    given = headers.get("x-request-id")
    if given and len(given) <= MAX_CLIENT_ID_CHARS and _ALLOWED.issuperset(given):
        return given
    return new_request_id()


def new_request_id() -> str:
    return f"{_PREFIX}{next(_COUNTER):x}"


async def answer_with_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer the aiohttp side serves (the Files, Batch and admin APIs, aiohttp's
    own 404 and 405, errors included) carries `x-request-id`, as the request path's do
    (an `on_response_prepare` signal: before the head goes out, streams too)."""
    if "x-request-id" not in response.headers:
        response.headers["x-request-id"] = request_id_of(request.headers)
